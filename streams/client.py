"""The producer SDK: build, submit and follow chat requests from Python (intake uses it too).

Owns one :class:`~streams.producer.TypedProducer` (requests and cancels out) and one reply consumer
(the reply topic in, no consumer group, positioned at the end when the client starts). One background
task reads replies and hands each to the :class:`ReplyRouter`, which fans out by ``request_id`` to the
waiting :class:`RequestHandle`; replies for ids nobody waits for (other clients sharing the topic,
requests already finished) are dropped there.

Ordering of a request's life::

    start(): reply consumer positioned at the topic end   ← before anything is published,
    submit(): handle registered in the router              ← so no reply can be missed
              ChatRequest published to kvmesh.requests (key = session_id)
    replies:  TokenChunk(index 0..) … Completion           → handle.stream() / handle.result()
    cancel(): CancelRequest published, handle closed
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import msgspec

from kvmesh_core.errors import KvmeshError
from kvmesh_core.tokenizer import ByteTokenizer, ChatMessage, Tokenizer, render_chat
from schemas.blocks import DEFAULT_BLOCK_SIZE
from schemas.chat_requests import chat_request
from schemas.messages import CancelRequest, ChatRequest, Completion, SamplingParams, TokenChunk
from streams import topics
from streams.clock import now_ms
from streams.settings import KafkaSettings

log = logging.getLogger("kvmesh.client")


class ClientError(KvmeshError):
    """Base of the errors the producer SDK raises on purpose."""


class RequestTimeout(ClientError):
    """No Completion arrived for a request within the caller's timeout."""

    retriable = True


class PublishTimeout(ClientError):
    """The broker did not take a request within the client's publish timeout (it is down or stuck)."""


class RequestClosed(ClientError):
    """The handle was cancelled or closed before its Completion arrived."""


class RequestHandle:
    """The client side of one submitted request: its chunks in order and its Completion.

    Invariants: chunks come out of :meth:`stream` in index order, each token exactly once (a chunk
    that repeats tokens already delivered is trimmed or dropped; one that leaves a gap waits until the
    gap is filled); the Completion is the last thing delivered, and when it lists more output tokens
    than the chunks carried, the missing tail is delivered as one synthetic chunk before it ends.
    """

    def __init__(self, request: ChatRequest, client: KvmeshClient | None = None) -> None:
        self.request = request
        self._client = client
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

    def close(self) -> None:
        """Stop waiting: wake any reader; later replies are ignored."""
        if not self._done.is_set():
            self._closed = True
            self._done.set()
            self._queue.put_nowait(None)
        if self._client is not None:
            self._client.router.unregister(self.request_id)

    # -- read by the caller -----------------------------------------------------------------------
    async def stream(self, timeout: float | None = None) -> AsyncIterator[TokenChunk]:
        """Yield the request's TokenChunks in order until its Completion (see :meth:`result`).

        ``timeout`` bounds the wait for each next reply; past it, :class:`RequestTimeout`.
        """
        while True:
            try:
                item = await asyncio.wait_for(self._queue.get(), timeout)
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
                await asyncio.wait_for(self._done.wait(), timeout)
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


def _public_prefix_tokens(tokenizer: Tokenizer, prompts: Mapping[str, str]) -> list[tuple[str, list[int]]]:
    # A public prefix is a whole leading system message, rendered exactly as render_chat renders it.
    rendered = [
        (name, render_chat(tokenizer, [ChatMessage("system", text)], add_generation_prompt=False))
        for name, text in prompts.items()
    ]
    return sorted(rendered, key=lambda item: -len(item[1]))  # longest match wins


class KvmeshClient:
    """Submit chat requests to a kvmesh fleet over Kafka and follow their replies.

    ``public_prefixes`` maps names to system prompts whose blocks are shared across tenants; it is
    empty by default (nothing is shared unless a deployment says so). ``reply_topic`` is the catalog
    name of the topic this client reads; several clients may share one (each ignores foreign ids).
    With ``create_topics`` the client creates the requests topic and its reply topic if missing
    (idempotent; turn off where the client may not create topics).
    """

    def __init__(
        self,
        kafka: KafkaSettings,
        *,
        client_id: str,
        reply_topic: str = topics.REPLIES.name,
        block_size: int = DEFAULT_BLOCK_SIZE,
        tokenizer: Tokenizer | None = None,
        public_prefixes: Mapping[str, str] | None = None,
        model: str = "kvmesh-tiny",
        create_topics: bool = True,
        publish_timeout_s: float = 5.0,
    ) -> None:
        self.kafka = kafka
        self.client_id = client_id
        self.reply_spec = dataclasses.replace(topics.REPLIES, name=reply_topic)
        self.block_size = block_size
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.model = model
        self.create_topics = create_topics
        self.public_prefixes = _public_prefix_tokens(self.tokenizer, public_prefixes or {})
        self.router = ReplyRouter()
        # Bounds every publish: past it the broker is taken as down (a clear error now beats
        # aiokafka's own 40 s request timeout), and a cancel never holds up its caller.
        self.publish_timeout_s = publish_timeout_s
        #: Publishes that failed or timed out since the last one that succeeded (0: the broker takes
        #: records); intake reports itself unready while it is not 0.
        self.publish_failures = 0
        self._cancels: set[asyncio.Task[None]] = set()
        self._producer: Any = None
        self._consumer: Any = None
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        # Never the settings object itself: it holds the Kafka password.
        return f"KvmeshClient(client_id={self.client_id!r}, reply_topic={self.reply_spec.name!r})"

    # -- lifecycle --------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._task is not None

    async def start(self) -> None:
        """Connect; the reply consumer is at the end of the reply topic when this returns."""
        if self._task is not None:
            return
        from streams.admin import ensure_topics
        from streams.consumer import TypedConsumer
        from streams.producer import TypedProducer

        producer = TypedProducer(self.kafka, producer_id=self.client_id)
        await producer.start()
        consumer = TypedConsumer(self.kafka, topics=[self.reply_spec], group_id=None, from_beginning=False)
        try:
            if self.create_topics:
                await ensure_topics(self.kafka, [topics.REQUESTS, self.reply_spec])
            await consumer.start()
            # aiokafka resets a fresh consumer's offsets lazily, at its first fetch; a reply written
            # before that would be skipped. Asking for the positions resolves "latest" now.
            await consumer.positions()
        except BaseException:
            await producer.stop()
            with contextlib.suppress(Exception):
                await consumer.stop()
            raise
        self._producer, self._consumer = producer, consumer
        self._task = asyncio.create_task(self._route_replies(), name=f"kvmesh-replies-{self.client_id}")
        log.info("client %s started (replies from %s)", self.client_id, self.reply_spec.name)

    async def stop(self) -> None:
        """Disconnect; waiting handles are closed. Safe to call twice."""
        if self._cancels:
            # cancels already queued go out before the producer closes (each is bounded)
            await asyncio.gather(*self._cancels, return_exceptions=True)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.router.close_all()
        consumer, self._consumer = self._consumer, None
        producer, self._producer = self._producer, None
        if consumer is not None:
            await consumer.stop()
        if producer is not None:
            await producer.stop()

    async def __aenter__(self) -> KvmeshClient:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def _route_replies(self) -> None:
        while True:
            try:
                records = await self._consumer.getmany(timeout_ms=100)
            except asyncio.CancelledError:
                raise
            except Exception:
                # A broker hiccup must not kill the only reader of replies; aiokafka reconnects.
                log.exception("reply consumer failed; retrying")
                await asyncio.sleep(0.5)
                continue
            for record in records:
                self.router.dispatch(record.message)

    # -- requests ---------------------------------------------------------------------------------
    def match_public_prefix(self, token_ids: Sequence[int]) -> tuple[str | None, int]:
        """The configured public prefix ``token_ids`` starts with (name, length), or (None, 0)."""
        for name, prefix in self.public_prefixes:
            if len(token_ids) >= len(prefix) and list(token_ids[: len(prefix)]) == prefix:
                return name, len(prefix)
        return None, 0

    def build_request(
        self,
        messages: Sequence[ChatMessage] | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        session_id: str | None = None,
        tenant: str = "default",
        max_tokens: int = 64,
        sampling: SamplingParams | None = None,
        deadline_ms: int | None = None,
        request_id: str | None = None,
        stop_token_ids: Sequence[int] = (),
        arrival_ms: int | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> ChatRequest:
        """Tokenize (or take ``token_ids``) and hash a prompt into a ChatRequest for ``tenant``.

        ``tools`` (OpenAI function definitions) are rendered by the model's chat template; ValueError
        when it has none that renders them, as for any prompt that cannot be built."""
        if (messages is None) == (token_ids is None):
            raise ValueError("give exactly one of messages or token_ids")
        ids = (
            list(token_ids)
            if token_ids is not None
            else render_chat(self.tokenizer, list(messages or ()), tools=tools)
        )
        _, public_tokens = self.match_public_prefix(ids)
        return chat_request(
            ids,
            request_id=request_id or uuid.uuid4().hex,
            session_id=session_id or uuid.uuid4().hex,
            tenant=tenant,
            block_size=self.block_size,
            max_tokens=max_tokens,
            arrival_ms=now_ms() if arrival_ms is None else arrival_ms,
            public_prefix_tokens=public_tokens,
            sampling=sampling or SamplingParams(),
            deadline_ms=deadline_ms,
            model=self.model,
            reply_topic=self.reply_spec.name,
            stop_token_ids=list(stop_token_ids),
        )

    async def submit(self, request: ChatRequest) -> RequestHandle:
        """Publish ``request`` and return its handle (registered first, so no reply is missed).

        Raises PublishTimeout when the broker does not take it within ``publish_timeout_s``; the
        record may still be queued then, so a cancel follows it and the fleet drops it if it arrives.
        """
        if self._producer is None:
            raise ClientError("client is not started")
        handle = RequestHandle(request, self)
        self.router.register(handle)
        try:
            await self._publish(request)
        except TimeoutError:
            self.router.unregister(request.request_id)
            self._spawn_cancel(request, "publish_timeout", None)
            raise PublishTimeout(
                f"the broker did not take request {request.request_id} in {self.publish_timeout_s}s"
            ) from None
        except BaseException:
            self.router.unregister(request.request_id)
            raise
        return handle

    async def _publish(self, message: ChatRequest | CancelRequest) -> None:
        from streams.producer import PublishError

        try:
            await asyncio.wait_for(self._producer.send(topics.REQUESTS, message), self.publish_timeout_s)
        except (TimeoutError, OSError, PublishError):
            # the broker, not the record: a record refused by the codec says nothing about it
            self.publish_failures += 1
            raise
        self.publish_failures = 0

    async def probe(self) -> bool:
        """After failed publishes: whether the broker answers again. It also recreates this client's
        topics (a broker that restarted without durable storage comes back empty), so a True here
        means requests can flow; the failure count is reset then."""
        from streams.admin import ensure_topics

        try:
            await asyncio.wait_for(
                ensure_topics(self.kafka, [topics.REQUESTS, self.reply_spec]), self.publish_timeout_s
            )
        except Exception as exc:  # timeout, OSError, aiokafka's errors while the broker is away
            log.info("broker probe failed: %s", exc)
            return False
        self.publish_failures = 0
        return True

    async def send_cancel(self, request: ChatRequest, reason: str, worker_id: str | None = None) -> None:
        """Queue a CancelRequest for ``request`` (keyed by its session, like the request).

        Returns at once: the publish runs in the background, bounded by ``publish_timeout_s``, so a
        request's deadline or a disconnect never waits on a slow or dead broker. ``stop()`` waits for
        the cancels still going out."""
        self._spawn_cancel(request, reason, worker_id)

    def _spawn_cancel(self, request: ChatRequest, reason: str, worker_id: str | None) -> None:
        if self._producer is None:
            return
        cancel = CancelRequest(request.request_id, request.session_id, reason, worker_id)
        task = asyncio.create_task(self._send_cancel(cancel), name=f"kvmesh-cancel-{request.request_id}")
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _send_cancel(self, cancel: CancelRequest) -> None:
        try:
            await self._publish(cancel)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the fleet then drops the request at its deadline
            log.warning("cancel of %s not published: %s", cancel.request_id, exc)
