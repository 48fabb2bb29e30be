"""What the chat and legacy completions routes share: body parsing, and running a prepared request
in the fleet as one JSON response or one SSE stream.

Per request::

    auth (tenant from the key) → parse + refuse unknown fields → prepare (validate, build requests)
      → admit (in-flight slot, else 429) → submit every choice → first output (errors so far are HTTP
      statuses) → stream chunks / collect → body with usage + kvmesh extension

Whatever ends the request early (client gone, timeout, shutdown) cancels it in the fleet, so a
worker never keeps decoding for nobody.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import anyio
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from services.intake.errors import IntakeError, InvalidRequest
from services.intake.generation import ChoiceResult, Delta, Job
from services.intake.openai_models import MAX_SESSION_HINT, SamplingFields
from services.intake.request_body import decode, off_loop, read_body
from services.intake.sampling_fields import Prepared
from services.intake.service import IntakeService

B = TypeVar("B", bound=SamplingFields)


async def serve(
    request: Request,
    service: IntakeService,
    model: type[B],
    build: Callable[[B, str, str | None], Prepared],
    renderer: Callable[[B, Prepared], Renderer],
) -> Response:
    """One completions request, chat or legacy: auth (the tenant from the key) before anything, then
    read, decode and prepare (tokenize) the body, off the event loop when it is large, then run it.
    ``build(body, tenant, session hint)`` prepares it; ``renderer`` turns its outputs into bodies."""
    tenant = service.keys.tenant_for(request.headers.get("authorization"))
    header_hint = _session_header(request)
    raw = await read_body(request, service.settings.max_body_bytes)

    def work() -> tuple[B, Prepared]:
        body = decode(raw, model)
        hint = header_hint or body.user
        return body, build(body, tenant, hint)

    body, prepared = await off_loop(len(raw), work)
    return await run(service, prepared, bool(body.stream), renderer(body, prepared))


def _session_header(request: Request) -> str | None:
    """The ``X-Session-Id`` header (a session hint like ``user``), bounded as ``user`` is."""
    hint = request.headers.get("x-session-id")
    if hint is not None and len(hint) > MAX_SESSION_HINT:
        raise InvalidRequest(
            f"'X-Session-Id' is longer than {MAX_SESSION_HINT} characters.", param="X-Session-Id"
        )
    return hint or None


class Renderer(Protocol):
    """Turns a job's outputs into one endpoint's bodies (chat or legacy completions)."""

    include_usage: bool

    def opening(self) -> list[dict[str, Any]]: ...

    def delta(self, d: Delta) -> list[dict[str, Any]]: ...

    def final(self, r: ChoiceResult) -> list[dict[str, Any]]: ...

    def usage_chunk(self, results: list[ChoiceResult]) -> dict[str, Any]: ...

    def body(self, results: list[ChoiceResult]) -> dict[str, Any]: ...


def kvmesh_headers(prepared: Prepared, results: list[ChoiceResult] | None = None) -> dict[str, str]:
    req = prepared.requests[0]
    h = {"X-Kvmesh-Request-Id": prepared.id, "X-Kvmesh-Session-Id": req.session_id}
    if results:
        c = results[0].completion
        h["X-Kvmesh-Worker"] = c.worker_id
        h["X-Kvmesh-Reused-Tokens"] = str(c.reused_tokens)
        h["X-Kvmesh-Fetched-Tokens"] = str(c.fetched_tokens)
        h["X-Kvmesh-Recomputed-Tokens"] = str(c.recomputed_tokens)
    return h


def created_now() -> int:
    return int(time.time())


class FleetStream(StreamingResponse):
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


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def run(service: IntakeService, prepared: Prepared, stream: bool, renderer: Renderer) -> Response:
    """Run ``prepared`` in the fleet and answer it as JSON or as an SSE stream."""
    slot = contextlib.ExitStack()
    slot.enter_context(service.admit())
    job = Job(service, prepared)
    handed_over = False
    try:
        await job.submit()
        if stream:
            events = job.events()
            # The first output before the headers: a request that fails this early gets its status.
            first = await anext(events, None)
            response = _stream(service, job, events, first, renderer, slot)
            handed_over = True  # the streaming body owns the job and the slot from here on
            return response
        results = await job.collect()
        job.observe()
        return JSONResponse(renderer.body(results), headers=kvmesh_headers(prepared, results))
    finally:
        if not handed_over:
            await job.close("timeout_or_error")
            slot.close()


def _stream(
    service: IntakeService,
    job: Job,
    events: AsyncIterator[Delta | ChoiceResult],
    first: Delta | ChoiceResult | None,
    renderer: Renderer,
    slot: contextlib.ExitStack,
) -> StreamingResponse:
    closed: list[bool] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            for chunk in renderer.opening():
                yield sse(chunk)
            results: list[ChoiceResult] = []
            item = first
            while item is not None:
                if isinstance(item, Delta):
                    for chunk in renderer.delta(item):
                        yield sse(chunk)
                else:
                    results.append(item)
                    for chunk in renderer.final(item):
                        yield sse(chunk)
                item = await anext(events, None)
            job.observe()
            if renderer.include_usage:
                yield sse(renderer.usage_chunk(sorted(results, key=lambda r: r.index)))
            yield sse("[DONE]")
        except IntakeError as exc:
            service.metrics.requests.labels(exc.code or "error").inc()
            yield sse(exc.body())
            yield sse("[DONE]")
        finally:
            await cleanup()

    async def cleanup() -> None:
        # Client gone (the body task is cancelled or send failed), error, or done: the fleet stops.
        if closed:
            return
        closed.append(True)
        if any(not c.handle.done for c in job.choices):
            service.metrics.requests.labels("abandoned").inc()
        await job.close("client_disconnected")
        slot.close()

    headers = {**kvmesh_headers(job.prepared), "Cache-Control": "no-cache"}
    worker = job.first.handle.worker_id
    if worker:
        headers["X-Kvmesh-Worker"] = worker
    return FleetStream(body(), on_close=cleanup, media_type="text/event-stream", headers=headers)
