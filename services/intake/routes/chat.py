"""``POST /v1/chat/completions``: OpenAI-compatible, streaming (SSE) or not.

Per request::

    auth (tenant from the key) → parse + validate → admit (in-flight slot, else 429)
      → publish ChatRequest → wait for the first reply (headers name the worker)
      → stream chunks / collect the text → Completion → body with usage + kvmesh extension

Whatever ends the request early (client gone, timeout, shutdown) cancels it in the fleet, so a
worker never keeps decoding for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from schemas.messages import ChatRequest, Completion, TokenChunk
from services.intake.errors import IntakeError, InvalidRequest, ServiceUnavailable, UpstreamTimeout
from services.intake.openai_models import (
    ChatCompletionRequest,
    chunk_body,
    completion_body,
    kvmesh_extension,
    openai_finish_reason,
    usage,
)
from services.intake.replies import IncrementalDetokenizer, completion_error
from services.intake.routes.deps import ServiceDep
from services.intake.service import IntakeService
from streams.client import RequestClosed, RequestHandle

log = logging.getLogger("kvmesh.intake.chat")

router = APIRouter()


async def _parse_body(request: Request) -> ChatCompletionRequest:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest(
            "We could not parse the JSON body of your request.", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise InvalidRequest(f"Invalid value for '{param}': {err['msg']}.", param=param) from None


class _Deadline:
    """The one deadline of a request: every wait on the fleet takes what is left of it."""

    def __init__(self, seconds: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._end = self._loop.time() + seconds
        self.seconds = seconds

    async def next_chunk(self, it: AsyncIterator[TokenChunk], request_id: str) -> TokenChunk | None:
        remaining = self._end - self._loop.time()
        try:
            if remaining <= 0:
                raise TimeoutError
            return await asyncio.wait_for(anext(it), remaining)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise UpstreamTimeout(
                f"Request {request_id} did not complete within {self.seconds:g}s."
            ) from None
        except RequestClosed:
            raise ServiceUnavailable("The intake is shutting down.") from None


async def _cancel_shielded(handle: RequestHandle, reason: str) -> None:
    # Runs while the surrounding task may be cancelled (client gone): shield the publish.
    if handle.done:
        handle.close()
        return
    with anyio.CancelScope(shield=True):
        try:
            await handle.cancel(reason)
        except Exception:
            log.warning("could not publish the cancel of request %s", handle.request_id, exc_info=True)
            handle.close()


def _headers(req: ChatRequest, worker: str | None, c: Completion | None = None) -> dict[str, str]:
    h = {"X-Kvmesh-Request-Id": req.request_id, "X-Kvmesh-Session-Id": req.session_id}
    if worker:
        h["X-Kvmesh-Worker"] = worker
    if c is not None:
        h["X-Kvmesh-Reused-Tokens"] = str(c.reused_tokens)
        h["X-Kvmesh-Fetched-Tokens"] = str(c.fetched_tokens)
        h["X-Kvmesh-Recomputed-Tokens"] = str(c.recomputed_tokens)
    return h


class _FleetStream(StreamingResponse):
    """A streaming response that always runs ``on_close``, even when its body never started.

    Starlette leaves the body generator suspended when the client disconnects (the next ``send``
    fails, or the disconnect listener cancels the body task); waiting for garbage collection to close it
    would keep the fleet decoding and the in-flight slot taken.
    """

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], Awaitable[None]], **kw: Any):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self._on_close()


def _sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request, service: ServiceDep) -> Response:
    tenant = service.keys.tenant_for(request.headers.get("authorization"))
    body = await _parse_body(request)
    req = service.prepare(body, tenant=tenant, session_hint=request.headers.get("x-session-id") or body.user)
    slot = contextlib.ExitStack()
    slot.enter_context(service.admit())
    handle: RequestHandle | None = None
    streaming = False
    try:
        deadline = _Deadline(service.settings.request_timeout_s)
        handle = await service.submit(req)
        it = handle.stream()
        first = await deadline.next_chunk(it, req.request_id)
        if body.stream:
            response = _stream(service, body, req, handle, it, first, deadline, slot)
            streaming = True  # the streaming body owns the handle and the slot from here on
            return response
        return await _complete(service, body, req, handle, it, first, deadline)
    finally:
        if not streaming:
            if handle is not None:
                await _cancel_shielded(handle, "timeout_or_error")
            slot.close()


async def _complete(
    service: IntakeService,
    body: ChatCompletionRequest,
    req: ChatRequest,
    handle: RequestHandle,
    it: AsyncIterator[TokenChunk],
    first: TokenChunk | None,
    deadline: _Deadline,
) -> Response:
    ids: list[int] = []
    chunk = first
    while chunk is not None:
        ids.extend(chunk.token_ids)
        chunk = await deadline.next_chunk(it, req.request_id)
    c = await handle.result(0)
    err = completion_error(c)
    if err is not None:
        raise err
    service.metrics.observe_completion(c)
    service.metrics.requests.labels("ok").inc()
    text = service.tokenizer.decode(c.output_token_ids or ids)
    out = completion_body(
        completion_id=f"chatcmpl-{req.request_id}",
        created=int(time.time()),
        model=body.model,
        text=text,
        c=c,
        session_id=req.session_id,
    )
    return JSONResponse(out, headers=_headers(req, c.worker_id, c))


def _stream(
    service: IntakeService,
    body: ChatCompletionRequest,
    req: ChatRequest,
    handle: RequestHandle,
    it: AsyncIterator[TokenChunk],
    first: TokenChunk | None,
    deadline: _Deadline,
    slot: contextlib.ExitStack,
) -> StreamingResponse:
    if first is None and handle.completion is not None:
        # Finished before any token: a failure can still be a proper HTTP error status.
        err = completion_error(handle.completion)
        if err is not None:
            raise err
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    cid, created = f"chatcmpl-{req.request_id}", int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _sse(
            chunk_body(
                completion_id=cid, created=created, model=body.model, delta=delta, finish_reason=finish
            )
        )

    async def events() -> AsyncIterator[bytes]:
        detok = IncrementalDetokenizer(service.tokenizer)
        try:
            yield chunk({"role": "assistant", "content": ""})
            current = first
            while current is not None:
                text = detok.push(current.token_ids)
                if text:
                    yield chunk({"content": text})
                current = await deadline.next_chunk(it, req.request_id)
            c = await handle.result(0)
            err = completion_error(c)
            if err is not None:
                service.metrics.requests.labels(err.code or "error").inc()
                yield _sse(err.body())
                yield _sse("[DONE]")
                return
            tail = detok.flush()
            if tail:
                yield chunk({"content": tail})
            service.metrics.observe_completion(c)
            service.metrics.requests.labels("ok").inc()
            final = chunk_body(
                completion_id=cid,
                created=created,
                model=body.model,
                delta={},
                finish_reason=openai_finish_reason(c),
            )
            final["kvmesh"] = kvmesh_extension(c, req.request_id, req.session_id)
            yield _sse(final)
            if include_usage:
                last = chunk_body(
                    completion_id=cid, created=created, model=body.model, delta={}, choices=False
                )
                last["usage"] = usage(c)
                last["kvmesh"] = final["kvmesh"]
                yield _sse(last)
            yield _sse("[DONE]")
        except IntakeError as exc:
            service.metrics.requests.labels(exc.code or "error").inc()
            yield _sse(exc.body())
            yield _sse("[DONE]")
        finally:
            await cleanup()

    async def cleanup() -> None:
        # Client gone (the body task is cancelled or send failed), error, or done: the fleet stops.
        if slot_closed:
            return
        slot_closed.append(True)
        if not handle.done:
            service.metrics.requests.labels("abandoned").inc()
        await _cancel_shielded(handle, "client_disconnected")
        slot.close()

    slot_closed: list[bool] = []
    return _FleetStream(
        events(),
        on_close=cleanup,
        media_type="text/event-stream",
        headers={
            **_headers(req, first.worker_id if first else handle.worker_id),
            "Cache-Control": "no-cache",
        },
    )
