"""KvmeshClient: build, submit and follow chat requests from Python (intake uses it too).

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

Delivery: a publish that fails on a retriable error (the broker away, a leader moving, a timeout) is
tried again, with backoff, until ``publish_timeout_s`` has passed in all; a try that did land after
all makes a duplicate that the scheduler drops by request id. ``max_in_flight`` bounds the requests
submitted and not finished: ``submit`` waits for a slot (backpressure instead of an unbounded queue
in front of a slow fleet), and a caller's cancellation of that wait publishes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from kvmesh_client.errors import ClientError, PublishTimeout
from kvmesh_client.handle import ReplyRouter, RequestHandle
from kvmesh_core.tokenizer import ByteTokenizer, ChatMessage, Tokenizer, render_chat
from schemas.blocks import DEFAULT_BLOCK_SIZE
from schemas.chat_requests import chat_request
from schemas.messages import CancelRequest, ChatRequest, SamplingParams
from streams import topics
from streams.clock import now_ms
from streams.settings import KafkaSettings
from streams.tasks import stop_task

log = logging.getLogger("kvmesh.client")


class KvmeshClient:
    """Submit chat requests to a kvmesh fleet over Kafka and follow their replies.

    ``public_prefixes`` maps names to system prompts whose blocks are shared across tenants; it is
    empty by default (nothing is shared unless a deployment says so). ``reply_topic`` is the catalog
    name of the topic this client reads; several clients may share one (each ignores foreign ids).
    With ``create_topics`` the client creates the requests topic and its reply topic if missing
    (idempotent; turn off where the client may not create topics). ``max_in_flight`` bounds the
    requests submitted and not yet finished (None: unbounded); ``publish_retries`` is how many more
    times a publish that failed on a retriable error is tried, all within ``publish_timeout_s``.
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
        publish_retries: int = 3,
        retry_backoff_s: float = 0.05,
        max_in_flight: int | None = 1024,
    ) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1 (or None: unbounded)")
        if publish_retries < 0 or retry_backoff_s < 0:
            raise ValueError("publish_retries and retry_backoff_s must not be negative")
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
        self.publish_retries = publish_retries
        self.retry_backoff_s = retry_backoff_s
        self.max_in_flight = max_in_flight
        self._slots = asyncio.Semaphore(max_in_flight) if max_in_flight is not None else None
        #: Publishes tried again after a retriable failure (a counter for tests and dashboards).
        self.publish_retried = 0
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
        await stop_task(task, swallow_errors=True)
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
        public_prefix_tokens: int | None = None,
    ) -> ChatRequest:
        """Tokenize (or take ``token_ids``) and hash a prompt into a ChatRequest for ``tenant``.

        ``tools`` (OpenAI function definitions) are rendered by the model's chat template; ValueError
        when it has none that renders them, as for any prompt that cannot be built.
        ``public_prefix_tokens`` declares how many leading tokens are a public prefix (shared across
        tenants); by default the longest configured ``public_prefixes`` entry the prompt starts with."""
        if (messages is None) == (token_ids is None):
            raise ValueError("give exactly one of messages or token_ids")
        ids = (
            list(token_ids)
            if token_ids is not None
            else render_chat(self.tokenizer, list(messages or ()), tools=tools)
        )
        if public_prefix_tokens is None:
            _, public_tokens = self.match_public_prefix(ids)
        else:
            public_tokens = min(max(public_prefix_tokens, 0), len(ids))
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

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished (completed, cancelled or closed)."""
        return len(self.router)

    async def chat(
        self,
        messages: Sequence[ChatMessage] | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        **fields: Any,
    ) -> RequestHandle:
        """Build a request (see :meth:`build_request`) and submit it: one call per chat turn."""
        return await self.submit(self.build_request(messages, token_ids=token_ids, **fields))

    async def submit(self, request: ChatRequest) -> RequestHandle:
        """Publish ``request`` and return its handle (registered first, so no reply is missed).

        Waits for a slot while ``max_in_flight`` requests are unfinished. Raises PublishTimeout when
        the broker does not take it within ``publish_timeout_s`` (retriable failures are tried again
        inside that time); the record may still be queued then, so a cancel follows it and the fleet
        drops it if it arrives. Cancelling the caller while it publishes sends that cancel too.
        """
        if self._producer is None:
            raise ClientError("client is not started")
        if self._slots is not None:
            await self._slots.acquire()
        handle = RequestHandle(request, self, on_finished=self._release_slot)
        try:
            self.router.register(handle)
        except BaseException:
            self._release_slot()
            raise
        try:
            await self._publish_with_retries(request)
        except TimeoutError:
            handle.close()
            self._spawn_cancel(request, "publish_timeout", None)
            raise PublishTimeout(
                f"the broker did not take request {request.request_id} in {self.publish_timeout_s}s"
            ) from None
        except asyncio.CancelledError:
            # the record may be in the producer's queue already: make sure the fleet drops it
            handle.close()
            self._spawn_cancel(request, "client_cancelled", None)
            raise
        except BaseException:
            handle.close()
            raise
        return handle

    def _release_slot(self) -> None:
        if self._slots is not None:
            self._slots.release()

    async def _publish_with_retries(self, request: ChatRequest) -> None:
        from streams.producer import PublishError

        deadline = time.monotonic() + self.publish_timeout_s
        attempt = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            try:
                await self._publish(request, timeout_s=left)
                return
            except (TimeoutError, OSError, PublishError):
                # retriable: the broker, not the record (the codec's refusals are not caught here)
                attempt += 1
                backoff = self.retry_backoff_s * 2 ** (attempt - 1)
                if attempt > self.publish_retries or time.monotonic() + backoff >= deadline:
                    raise
                self.publish_retried += 1
                log.info("publish of %s failed; trying again in %.2fs", request.request_id, backoff)
                await asyncio.sleep(backoff)

    async def _publish(self, message: ChatRequest | CancelRequest, timeout_s: float | None = None) -> None:
        from streams.producer import PublishError

        bound = self.publish_timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(bound):
                await self._producer.send(topics.REQUESTS, message)
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
            async with asyncio.timeout(self.publish_timeout_s):
                await ensure_topics(self.kafka, [topics.REQUESTS, self.reply_spec])
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


def _public_prefix_tokens(tokenizer: Tokenizer, prompts: Mapping[str, str]) -> list[tuple[str, list[int]]]:
    # A public prefix is a whole leading system message, rendered exactly as render_chat renders it.
    rendered = [
        (name, render_chat(tokenizer, [ChatMessage("system", text)], add_generation_prompt=False))
        for name, text in prompts.items()
    ]
    return sorted(rendered, key=lambda item: -len(item[1]))  # longest match wins
