"""One submitted request's replies, in order, and the router that hands each reply to its request.

Both are pure (no Kafka), so ordering, dedup and closing are unit-testable: the client feeds the
router from its reply consumer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import msgspec

from kvmesh_client.errors import ClientError, RequestClosed, RequestTimeout
from schemas.messages import ChatRequest, Completion, TokenChunk

if TYPE_CHECKING:
    from kvmesh_client.client import KvmeshClient


class RequestHandle:
    """The client side of one submitted request: its chunks in order and its Completion.

    Invariants: chunks come out of :meth:`stream` in index order, each token exactly once (a chunk
    that repeats tokens already delivered is trimmed or dropped; one that leaves a gap waits until the
    gap is filled); the Completion is the last thing delivered, and when it lists more output tokens
    than the chunks carried, the missing tail is delivered as one synthetic chunk before it ends.
    """

    def __init__(
        self,
        request: ChatRequest,
        client: KvmeshClient | None = None,
        on_finished: Callable[[], None] | None = None,
    ) -> None:
        self.request = request
        self._client = client
        # called once, when the Completion arrives or the handle is closed (the client's slot)
        self._on_finished = on_finished
        self._queue: asyncio.Queue[TokenChunk | Completion | None] = asyncio.Queue()
        self._next_index = 0  # index of the next token to deliver
        self._early: dict[int, TokenChunk] = {}  # chunks that arrived ahead of a gap, by index
        self._completion: Completion | None = None
        self._done = asyncio.Event()
        self._closed = False
        self.worker_id: str | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def completion(self) -> Completion | None:
        return self._completion

    # -- fed by the router ------------------------------------------------------------------------
    def deliver(self, message: TokenChunk | Completion) -> None:
        """Take one reply for this request (called by the router, in topic order)."""
        if self._done.is_set():
            return  # duplicates after the end, or replies after a cancel
        if isinstance(message, Completion):
            self._finish(message)
            return
        self.worker_id = self.worker_id or message.worker_id
        self._early.setdefault(message.index, message)
        self._drain_early()

    def _drain_early(self) -> None:
        # Deliver from the smallest buffered index while it touches what was already delivered.
        while self._early:
            index = min(self._early)
            if index > self._next_index:
                return  # a gap: wait for the missing chunk (or the Completion)
            chunk = self._early.pop(index)
            end = index + len(chunk.token_ids)
            if end <= self._next_index:
                continue  # wholly a duplicate
            if index != self._next_index:
                fresh = chunk.token_ids[self._next_index - index :]
                chunk = msgspec.structs.replace(chunk, index=self._next_index, token_ids=fresh, text="")
            self._queue.put_nowait(chunk)
            self._next_index = end

    def _finish(self, completion: Completion) -> None:
        self.worker_id = completion.worker_id or self.worker_id
        tail = completion.output_token_ids[self._next_index :]
        if tail:
            # Chunks lost or never sent: the Completion is authoritative for the output tokens.
            self._queue.put_nowait(
                TokenChunk(self.request_id, completion.worker_id, self._next_index, list(tail))
            )
            self._next_index += len(tail)
        self._early.clear()
        self._completion = completion
        self._queue.put_nowait(completion)
        self._done.set()
        self._finished()

    def _finished(self) -> None:
        callback, self._on_finished = self._on_finished, None
        if callback is not None:
            callback()

    def close(self) -> None:
        """Stop waiting: wake any reader; later replies are ignored."""
        if not self._done.is_set():
            self._closed = True
            self._done.set()
            self._queue.put_nowait(None)
        if self._client is not None:
            self._client.router.unregister(self.request_id)
        self._finished()

    async def __aenter__(self) -> RequestHandle:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Leaving the block before the Completion (an error, a break, a cancelled caller) cancels
        the request on the fleet, so no worker keeps generating for nobody."""
        if not self.done:
            await self.cancel("client_disconnected")

    # -- read by the caller -----------------------------------------------------------------------
    async def stream(self, timeout: float | None = None) -> AsyncIterator[TokenChunk]:
        """Yield the request's TokenChunks in order until its Completion (see :meth:`result`).

        ``timeout`` bounds the wait for each next reply; past it, :class:`RequestTimeout`.
        """
        while True:
            try:
                async with asyncio.timeout(timeout):
                    item = await self._queue.get()
            except TimeoutError:
                raise RequestTimeout(f"no reply for request {self.request_id} in {timeout}s") from None
            if item is None:
                raise RequestClosed(f"request {self.request_id} was closed")
            if isinstance(item, Completion):
                self._queue.put_nowait(item)  # keep it for result()
                return
            yield item

    async def result(self, timeout: float | None = None) -> Completion:
        """Wait for the Completion (chunks not read through :meth:`stream` are skipped)."""
        try:
            if not self._done.is_set():
                async with asyncio.timeout(timeout):
                    await self._done.wait()
        except TimeoutError:
            raise RequestTimeout(f"no completion for request {self.request_id} in {timeout}s") from None
        if self._completion is None:
            raise RequestClosed(f"request {self.request_id} was closed")
        return self._completion

    async def cancel(self, reason: str = "client_disconnected") -> None:
        """Tell the fleet to stop this request (no-op once it has completed) and close the handle."""
        if not self._done.is_set() and self._client is not None:
            await self._client.send_cancel(self.request, reason, self.worker_id)
        self.close()


class ReplyRouter:
    """Request id → waiting handle. Pure (no Kafka) so that ordering and dedup are unit-testable.

    Invariant: a handle is registered before its request is published and stays registered until its
    Completion is dispatched or it is closed; replies for any other id are counted and dropped.
    """

    def __init__(self) -> None:
        self._handles: dict[str, RequestHandle] = {}
        self.ignored = 0

    def __len__(self) -> int:
        return len(self._handles)

    def register(self, handle: RequestHandle) -> None:
        if handle.request_id in self._handles:
            raise ClientError(f"request id {handle.request_id} is already waiting")
        self._handles[handle.request_id] = handle

    def unregister(self, request_id: str) -> None:
        self._handles.pop(request_id, None)

    def dispatch(self, message: Any) -> bool:
        """Route one reply; True when a handle took it."""
        if not isinstance(message, TokenChunk | Completion):
            self.ignored += 1
            return False
        handle = self._handles.get(message.request_id)
        if handle is None:
            self.ignored += 1
            return False
        handle.deliver(message)
        if isinstance(message, Completion):
            self._handles.pop(message.request_id, None)
        return True

    def close_all(self) -> None:
        for handle in list(self._handles.values()):
            handle.close()
        self._handles.clear()
