"""TypedProducer: publishes catalog messages in envelopes, one sequence per producer.

Every record carries ``(producer_id, seq)``; ``seq`` grows by one per record. Consumers drop a record
whose seq is not above the last one seen from that producer on that partition (see
streams.consumer). Records of one producer reach one partition in send order, because sends are
enqueued under a lock in seq order and aiokafka keeps per-partition order.

Partitioning is aiokafka's default (murmur2 of the key); :func:`partition_for` computes the same
partition so a worker can read only the partition its own key lands on.
"""

from __future__ import annotations

import asyncio
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.partitioner import murmur2

from schemas.codec import encode
from streams.admin import topic_name
from streams.clock import now_ms
from streams.errors import MissingKey, NotStarted, StreamsError, WrongTopic
from streams.settings import KafkaSettings
from streams.topics import TopicSpec

log = logging.getLogger(__name__)

#: Headroom over the largest record for the request that carries it (batch and request headers).
_REQUEST_OVERHEAD_BYTES = 64 * 1024


class PublishError(StreamsError):
    """The broker did not accept a record (after aiokafka's own retries). Trying again may help."""

    retriable = True


def partition_for(topic: TopicSpec, key: str, partitions: int | None = None) -> int:
    """The partition aiokafka's DefaultPartitioner picks for ``key`` on ``topic`` when the topic has
    ``partitions`` partitions (default: the catalog's count; pass the broker's actual count, from
    :meth:`TypedProducer.partition_count`, where it may differ)."""
    return int(murmur2(key.encode()) & 0x7FFFFFFF) % (partitions or topic.partitions)


def producer_options(kafka: KafkaSettings) -> dict[str, Any]:
    """AIOKafkaProducer arguments of a TypedProducer beside ``kafka.client_kwargs()``.

    Also what benchmarks give a raw producer, so that only the typed layer differs.
    """
    return {
        "enable_idempotence": kafka.enable_idempotence,
        "max_request_size": kafka.max_record_bytes + _REQUEST_OVERHEAD_BYTES,
    }


class TypedProducer:
    """Owns one aiokafka producer and the ``(producer_id, seq)`` numbering of its records.

    Invariant: ``seq`` values handed out are strictly increasing over the life of the object. The
    first one is ``clock() * 1000`` at construction, so a producer restarted under the same id
    continues above its predecessor (unless that one averaged over 1000 records per millisecond) and
    consumers do not take its records for duplicates.
    """

    def __init__(self, kafka: KafkaSettings, producer_id: str, *, clock: Callable[[], int] = now_ms) -> None:
        if not producer_id:
            raise ValueError("producer_id must be non-empty")
        self.kafka = kafka
        self.producer_id = producer_id
        self._clock = clock
        self._next_seq = clock() * 1000
        self._producer: AIOKafkaProducer | None = None
        self._lock = asyncio.Lock()
        # (topic, message type) -> broker topic name, once the type is known to travel on it
        self._routes: dict[tuple[TopicSpec, type], str] = {}
        self.sent = 0

    @property
    def started(self) -> bool:
        return self._producer is not None

    def next_seq(self) -> int:
        """Take the next sequence number (used by send; exposed for tests and tools)."""
        seq = self._next_seq
        self._next_seq += 1
        return seq

    async def start(self) -> None:
        """Connect to the broker. Safe to call twice."""
        if self._producer is not None:
            return
        producer = AIOKafkaProducer(**self.kafka.client_kwargs(), **producer_options(self.kafka))
        await producer.start()
        self._producer = producer

    async def stop(self) -> None:
        """Flush what is queued and disconnect. Safe to call twice."""
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()

    async def __aenter__(self) -> TypedProducer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __del__(self) -> None:
        if getattr(self, "_producer", None) is not None:
            warnings.warn(
                f"TypedProducer {self.producer_id!r} was not stopped", ResourceWarning, stacklevel=1
            )

    def _require(self) -> AIOKafkaProducer:
        if self._producer is None:
            raise NotStarted(f"producer {self.producer_id!r} is not started")
        return self._producer

    async def partition_count(self, topic: TopicSpec) -> int:
        """How many partitions ``topic`` has on the broker now (metadata; the catalog's count if the
        broker does not say): what a record's key is hashed over."""
        parts = await self._require().partitions_for(topic_name(topic, self.kafka))
        return len(parts) if parts else self.kafka.partitions_of(topic)

    async def send(self, topic: TopicSpec, message: Any, key: str | None = None, *, wait: bool = True) -> Any:
        """Encode ``message`` in an envelope and publish it on ``topic``.

        ``key`` defaults to the message's key field for this topic (``topic.key_of``). With
        ``wait=True`` (default) returns once the broker has the record (its RecordMetadata); with
        ``wait=False`` returns an awaitable of it as soon as the record is queued (use ``flush()``).
        Raises WrongTopic, MissingKey, a SchemaError (e.g. RecordTooLarge) or PublishError.
        """
        route = self._routes.get((topic, type(message)))
        if route is None:
            if not topic.carries(message):
                raise WrongTopic(f"{type(message).__name__} does not travel on {topic.name}")
            route = self._routes[(topic, type(message))] = topic_name(topic, self.kafka)
        if key is None:
            key = topic.key_of(message)
            if key is None:
                raise MissingKey(f"{type(message).__name__} has no key field for {topic.name}")
        producer = self._require()
        async with self._lock:
            # Seq taken and record queued under one lock: queue order is seq order.
            seq = self.next_seq()
            value = encode(message, self.producer_id, seq, self._clock(), self.kafka.max_record_bytes)
            try:
                fut = await producer.send(route, value, key=key.encode())
            except KafkaError as exc:
                raise PublishError(f"send to {topic.name} failed: {exc}") from exc
        self.sent += 1
        if not wait:
            return fut
        try:
            return await fut
        except KafkaError as exc:
            raise PublishError(f"send to {topic.name} failed: {exc}") from exc

    async def send_raw(
        self,
        topic: str,
        value: bytes,
        key: bytes | str | None = None,
        headers: Sequence[tuple[str, bytes]] | None = None,
        partition: int | None = None,
    ) -> Any:
        """Publish bytes as they are on the broker topic named ``topic`` (no envelope, no prefix added).

        For the dead-letter path and for tools (and tests) that need records the codec would refuse.
        """
        producer = self._require()
        kbytes = key.encode() if isinstance(key, str) else key
        try:
            fut = await producer.send(
                topic, value, key=kbytes, headers=list(headers or []), partition=partition
            )
            return await fut
        except KafkaError as exc:
            raise PublishError(f"raw send to {topic} failed: {exc}") from exc

    async def flush(self) -> None:
        """Wait until every queued record has been delivered (or failed)."""
        await self._require().flush()
