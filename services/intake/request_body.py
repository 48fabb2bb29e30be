"""Reading a request body before any expensive work: its media type, its size, its JSON.

A body is refused before it is parsed when it is not declared ``application/json`` (a web page can
make a browser post a form or ``text/plain`` to a local intake without a preflight, but not JSON) or
when it is over ``max_body_bytes``; the size is checked on the declared length and again while
reading, so a lying ``Content-Length`` buys nothing. JSON nested deeper than the parser's recursion
limit is a 400 like any other bad JSON.

Large bodies are decoded, validated and tokenized in a worker thread (at most ``HEAVY_SLOTS`` at a
time): a prompt of megabytes costs the event loop nothing, so ``/healthz`` and every other request
keep their latency meanwhile.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from pydantic import BaseModel, ValidationError

from services.intake.errors import InvalidRequest, RequestTooLarge, UnsupportedMediaType
from services.intake.field_policy import refuse_unknown_nested

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

#: Bodies up to this size are handled on the event loop (a thread hop costs more than the work).
INLINE_BYTES = 64 * 1024
#: Large bodies handled at once; the rest wait for a slot.
HEAVY_SLOTS = 2
_heavy: anyio.CapacityLimiter | None = None


def _limiter() -> anyio.CapacityLimiter:
    global _heavy  # created lazily: a limiter belongs to the running event loop's backend
    if _heavy is None:
        _heavy = anyio.CapacityLimiter(HEAVY_SLOTS)
    return _heavy


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body; 415 unless it is JSON, 413 past ``max_bytes`` (declared or read)."""
    if not _is_json(request.headers.get("content-type")):
        raise UnsupportedMediaType(
            "The request body must be JSON, sent with 'Content-Type: application/json'."
        )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise RequestTooLarge(f"The request body is over the limit of {max_bytes} bytes.")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise RequestTooLarge(f"The request body is over the limit of {max_bytes} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


def decode(raw: bytes, model: type[M]) -> M:
    """The body as ``model``; a 400 for bad JSON, a bad value, or a field kvmesh would ignore."""
    try:
        data: Any = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise InvalidRequest(
            "We could not parse the JSON body of your request.", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise InvalidRequest(f"Invalid value for '{param}': {err['msg']}.", param=param) from None
    except RecursionError:
        raise InvalidRequest("The request body is nested too deeply.", code="invalid_json") from None
    refuse_unknown_nested(body, data)
    return body


async def off_loop(size: int, work: Callable[[], T]) -> T:
    """``work()`` inline for a small body, else in a worker thread (bounded, see module doc)."""
    if size <= INLINE_BYTES:
        return work()
    return await anyio.to_thread.run_sync(work, limiter=_limiter())


async def parse_body(request: Request, model: type[M], max_bytes: int) -> M:
    """Read and decode a body that needs no further heavy work (tokenize endpoints)."""
    raw = await read_body(request, max_bytes)
    return await off_loop(len(raw), lambda: decode(raw, model))
