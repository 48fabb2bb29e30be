"""The fleet side of one HTTP request: its choices submitted together, read together, ended together.

Per choice::

    ChatRequest ──submit──▶ handle ──TokenChunks──▶ TextStream (stop strings, held-back text)
                                    ──Completion──▶ ChoiceResult (text cut at the stop, finish reason)

A reader task per choice feeds one queue, so a streamed response interleaves its choices as they
arrive and the one deadline of the request bounds every wait. Whatever ends the request early (client
gone, timeout, a failed choice, shutdown) cancels every choice still running in the fleet.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from kvmesh_client import RequestClosed, RequestHandle
from kvmesh_core.text_stream import TextStream
from schemas.messages import Completion, TokenChunk, TokenLogprob
from services.intake.errors import IntakeError, ServiceUnavailable, UpstreamFailed, UpstreamTimeout
from services.intake.replies import completion_error
from services.intake.sampling_fields import Prepared
from services.intake.service import IntakeService
from streams.tasks import stop_tasks

log = logging.getLogger("kvmesh.intake.generation")


@dataclass
class Delta:
    """New output of one choice: text that may be shown now and the logprobs of its new tokens."""

    index: int
    text: str
    logprobs: list[TokenLogprob]


@dataclass
class ChoiceResult:
    """A finished choice: its whole text (cut at a stop string) and how it ended."""

    index: int
    completion: Completion
    text: str
    tail: str  # text released only at the end (held back while a stop string could still match)
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str  # "stop" | "length"
    completion_tokens: int


@dataclass
class _Choice:
    index: int
    handle: RequestHandle
    text: TextStream
    want_logprobs: bool
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    result: ChoiceResult | None = None

    def push(self, chunk: TokenChunk) -> Delta:
        ids = list(chunk.token_ids)
        lps = list(chunk.logprobs)
        if self.text.stopped:
            return Delta(self.index, "", [])
        before = len(self.text.token_ids)
        delta = self.text.push(ids)
        if self.text.stopped_at is not None:
            # Tokens past the one that completed the stop string are not output.
            keep = self.text.stopped_at - before
            ids, lps = ids[:keep], lps[:keep]
        self.ids += ids
        if self.want_logprobs:
            if len(lps) != len(ids):
                # A chunk lost on the way (its tokens came back in the Completion, without logprobs):
                # a client that asked for logprobs gets an error, not a list that silently misses some.
                raise UpstreamFailed(
                    f"Request {self.handle.request_id}: logprobs of {len(ids) - len(lps)} tokens were lost.",
                    code="logprobs_lost",
                )
            self.logprobs += lps
        return Delta(self.index, delta, lps if self.want_logprobs else [])

    def finish(self, c: Completion) -> ChoiceResult:
        tail = self.text.flush()
        stopped_at = self.text.stopped_at
        reason = "stop" if stopped_at is not None or c.finish_reason == "stop" else "length"
        tokens = c.completion_tokens if stopped_at is None else min(c.completion_tokens, stopped_at)
        self.result = ChoiceResult(
            self.index, c, self.text.text, tail, self.ids, self.logprobs, reason, tokens or len(self.ids)
        )
        return self.result


class _Deadline:
    """The one deadline of a request: every wait on the fleet takes what is left of it."""

    def __init__(self, seconds: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._end = self._loop.time() + seconds
        self.seconds = seconds

    def remaining(self) -> float:
        return self._end - self._loop.time()


class Job:
    """The choices of one prepared request in the fleet. ``close()`` is safe twice."""

    def __init__(self, service: IntakeService, prepared: Prepared) -> None:
        self.service = service
        self.prepared = prepared
        self.deadline = _Deadline(service.settings.request_timeout_s)
        self.choices: list[_Choice] = []
        self._queue: asyncio.Queue[tuple[int, TokenChunk | Completion | BaseException]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    @property
    def request_id(self) -> str:
        return self.prepared.id

    @property
    def first(self) -> _Choice:
        return self.choices[0]

    async def submit(self) -> None:
        for i, req in enumerate(self.prepared.requests):
            handle = await self.service.submit(req)
            s = req.sampling
            self.choices.append(
                _Choice(
                    i,
                    handle,
                    TextStream(self.service.tokenizer, s.stop, s.min_tokens),
                    s.logprobs is not None,
                )
            )
            self._tasks.append(
                asyncio.create_task(self._read(i, handle), name=f"kvmesh-choice-{req.request_id}")
            )

    async def _read(self, i: int, handle: RequestHandle) -> None:
        try:
            async for chunk in handle.stream():
                self._queue.put_nowait((i, chunk))
            self._queue.put_nowait((i, await handle.result(0)))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # closed, or the client failed: the consumer raises it
            self._queue.put_nowait((i, exc))

    async def events(self) -> AsyncIterator[Delta | ChoiceResult]:
        """Deltas and results of every choice in arrival order, until all have finished.

        Raises the IntakeError that ends the request: timeout, a failed choice, shutdown."""
        pending = len(self.choices)
        while pending:
            remaining = self.deadline.remaining()
            try:
                if remaining <= 0:
                    raise TimeoutError
                async with asyncio.timeout(remaining):
                    i, item = await self._queue.get()
            except TimeoutError:
                raise UpstreamTimeout(
                    f"Request {self.request_id} did not complete within {self.deadline.seconds:g}s."
                ) from None
            choice = self.choices[i]
            if isinstance(item, RequestClosed):
                raise ServiceUnavailable("The intake is shutting down.")
            if isinstance(item, BaseException):
                raise UpstreamFailed(f"Request {self.request_id} failed in the intake: {item}.") from item
            if isinstance(item, TokenChunk):
                yield choice.push(item)
                continue
            err = completion_error(item)
            if err is not None:
                raise err
            pending -= 1
            yield choice.finish(item)

    async def collect(self) -> list[ChoiceResult]:
        """Every choice's result (the non-streaming response)."""
        async for _ in self.events():
            pass
        return [c.result for c in self.choices if c.result is not None]

    def observe(self) -> None:
        """Count the finished request in the intake's metrics."""
        for c in self.choices:
            if c.result is not None:
                self.service.metrics.observe_completion(c.result.completion)
        self.service.metrics.requests.labels("ok").inc()

    async def close(self, reason: str) -> None:
        """Stop every choice still running in the fleet (shielded: the caller may be cancelled)."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await stop_tasks(self._tasks, swallow_errors=True)
            for c in self.choices:
                await _cancel(c.handle, reason)


async def _cancel(handle: RequestHandle, reason: str) -> None:
    if handle.done:
        handle.close()
        return
    try:
        await handle.cancel(reason)
    except Exception:
        log.warning("could not publish the cancel of request %s", handle.request_id, exc_info=True)
        handle.close()


__all__ = ["ChoiceResult", "Delta", "IntakeError", "Job"]
