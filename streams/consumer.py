"""TypedConsumer: decoded, deduplicated, at-least-once consumption of catalog topics.

Offsets are committed only for records that have been dealt with: handled (the handler returned),
skipped (a duplicate, or a key other than ``key_filter``) or dead-lettered (undecodable, or the
handler failed ``max_attempts`` times). A handler exception never stops the loop.

Three ways to read, chosen by the arguments:

=================  ===============  ==========================================================
group_id           assign           partitions read, where the start offset comes from
=================  ===============  ==========================================================
"g"                None             the group's share of ``topics`` (subscribe; rebalances)
"g" or None        [(spec, p)...]   exactly those; committed offsets of "g" if any
None               None             every partition of ``topics``; nothing committed
=================  ===============  ==========================================================

Without a committed offset a partition starts at its beginning (``from_beginning``) or its end.
Topic names in :class:`Record`, :meth:`seek`, :meth:`positions` and :meth:`end_offsets` are the
catalog names (``TopicSpec.name``), without ``KafkaSettings.topic_prefix``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import warnings
from collections import Counter as CounterType
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, ConsumerStoppedError, KafkaError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata

from schemas.codec import RecordDecoder, decoder_for
from schemas.envelope import AnyEnvelope
from schemas.errors import SchemaError
from schemas.messages import MESSAGE_TYPES
from streams.admin import topic_name
from streams.dedup import SeqDeduplicator
from streams.errors import NotStarted
from streams.producer import TypedProducer
from streams.settings import KafkaSettings
from streams.topics import DEAD_LETTER, TopicSpec

log = logging.getLogger(__name__)

Handler = Callable[["Record"], Awaitable[Any]]

#: Header names on dead-letter records.
DLQ_SOURCE_TOPIC = "kvmesh.source_topic"
DLQ_SOURCE_PARTITION = "kvmesh.source_partition"
DLQ_SOURCE_OFFSET = "kvmesh.source_offset"
DLQ_ERROR = "kvmesh.error"
DLQ_ERROR_KIND = "kvmesh.error_kind"


class Record(msgspec.Struct, frozen=True):
    """One decoded record. ``topic`` is the catalog name; ``key`` is the record key as text."""

    topic: str
    partition: int
    offset: int
    key: str | None
    envelope: AnyEnvelope
    timestamp_ms: int

    @property
    def message(self) -> Any:
        return self.envelope.message


@dataclass(slots=True)
class ConsumerMetrics:
    """Counters of one consumer since construction: plain numbers the hot loop bumps, exported by
    :class:`streams.consumer_metrics.ConsumerCollector` when Prometheus scrapes."""

    consumed: int = 0
    handled: int = 0
    deduplicated: int = 0
    filtered: int = 0
    dead_lettered: int = 0
    handler_errors: int = 0
    commits: int = 0
    #: catalog topic -> records fetched / dead-lettered (counted per fetched batch, not per record)
    records_by_topic: CounterType[str] = field(default_factory=CounterType)
    dead_letters_by_topic: CounterType[str] = field(default_factory=CounterType)
    #: (catalog topic, partition) -> records behind the high watermark after the last fetch
    lag: dict[tuple[str, int], int] = field(default_factory=dict)


#: A rebalance hook: called with the (catalog topic, partition) pairs revoked or assigned.
RebalanceHook = Callable[[set[tuple[str, int]]], Awaitable[None]]


class _CommitOnRevoke(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka is untyped
    """Commits what was dealt with before a rebalance takes partitions away, then runs the owner's
    hooks (aiokafka awaits them inside the rebalance: a revoke hook finishes before any other member
    is given the partitions, and an assign hook may seek them before the first fetch)."""

    def __init__(self, owner: TypedConsumer) -> None:
        self.owner = owner

    def _pairs(self, tps: Any) -> set[tuple[str, int]]:
        return {(self.owner._catalog_name(tp.topic), tp.partition) for tp in tps}

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self.owner._commit_done(only=set(revoked))
        if self.owner.on_revoked is not None:
            await self.owner.on_revoked(self._pairs(revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        log.debug("assigned %s", sorted((tp.topic, tp.partition) for tp in assigned))
        if self.owner.on_assigned is not None:
            await self.owner.on_assigned(self._pairs(assigned))


def consumer_options(kafka: KafkaSettings, group_id: str | None, from_beginning: bool) -> dict[str, Any]:
    """AIOKafkaConsumer arguments of a TypedConsumer beside ``kafka.client_kwargs()``.

    Also what benchmarks give a raw consumer, so that only the typed layer differs.
    """
    return {
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest" if from_beginning else "latest",
        "session_timeout_ms": kafka.session_timeout_ms,
        "rebalance_timeout_ms": kafka.rebalance_timeout_ms,
        "heartbeat_interval_ms": kafka.heartbeat_interval_ms,
        "fetch_max_wait_ms": kafka.fetch_max_wait_ms,
        "max_partition_fetch_bytes": max(kafka.max_record_bytes + 64 * 1024, 1 << 20),
    }


class TypedConsumer:
    """Owns one aiokafka consumer, the dedup marks and the "done up to" offsets awaiting commit.

    Invariant: ``_done[tp]`` is the offset after the last record of ``tp`` that was dealt with, and
    only such offsets are ever committed.
    """

    def __init__(
        self,
        kafka: KafkaSettings,
        topics: Sequence[TopicSpec],
        group_id: str | None = None,
        *,
        from_beginning: bool = True,
        dlq: TypedProducer | None = None,
        dedup: bool = True,
        assign: Sequence[tuple[TopicSpec, int]] | None = None,
        key_filter: str | None = None,
        max_attempts: int = 3,
        retry_backoff_s: float = 0.05,
        max_batch: int = 500,
        on_revoked: RebalanceHook | None = None,
        on_assigned: RebalanceHook | None = None,
    ) -> None:
        if not topics and not assign:
            raise ValueError("a consumer needs topics or an assignment")
        self.kafka = kafka
        self.topics = list(topics)
        self.group_id = group_id
        self.from_beginning = from_beginning
        self.dlq = dlq
        self.dedup = dedup
        self.assign = list(assign) if assign is not None else None
        self.key_filter = key_filter
        self.max_attempts = max(1, max_attempts)
        self.retry_backoff_s = retry_backoff_s
        self.max_batch = max_batch
        # Group rebalance hooks (subscribe mode only); see _CommitOnRevoke.
        self.on_revoked = on_revoked
        self.on_assigned = on_assigned
        self.metrics = ConsumerMetrics()
        self._dedup = SeqDeduplicator()
        self._done: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}
        self._caps: dict[TopicPartition, int] = {}  # commit no further (see commit)
        self._consumer: AIOKafkaConsumer | None = None
        # broker topic name -> catalog name
        self._catalog: dict[str, str] = {}
        # broker topic name -> the decoder of the message types its catalog entry carries: a record
        # of any other type is refused (dead-lettered) like any other undecodable one
        self._decoders: dict[str, RecordDecoder] = {}
        for spec in [*self.topics, *(s for s, _ in self.assign or [])]:
            self._catalog[topic_name(spec, kafka)] = spec.name
            self._decoders[topic_name(spec, kafka)] = decoder_for(spec.messages or MESSAGE_TYPES)

    # ------------------------------------------------------------------ lifecycle
    @property
    def started(self) -> bool:
        return self._consumer is not None

    async def start(self) -> None:
        """Connect, subscribe or assign. Safe to call twice."""
        if self._consumer is not None:
            return
        k = self.kafka
        consumer = AIOKafkaConsumer(
            **k.client_kwargs(), **consumer_options(k, self.group_id, self.from_beginning)
        )
        await consumer.start()
        try:
            if self.assign is not None:
                consumer.assign([TopicPartition(topic_name(s, k), p) for s, p in self.assign])
            elif self.group_id is not None:
                consumer.subscribe([topic_name(s, k) for s in self.topics], listener=_CommitOnRevoke(self))
            else:
                tps: list[TopicPartition] = []
                for spec in self.topics:
                    name = topic_name(spec, k)
                    parts = consumer.partitions_for_topic(name) or set(range(k.partitions_of(spec)))
                    tps.extend(TopicPartition(name, p) for p in sorted(parts))
                consumer.assign(tps)
            if self.group_id is None or self.assign is not None:
                # aiokafka resolves a start offset lazily, at the first fetch; "latest" would then skip
                # records produced between start() and that fetch. Resolve now: start() is the cut.
                for tp in consumer.assignment():
                    await consumer.position(tp)
        except BaseException:
            await consumer.stop()
            raise
        self._consumer = consumer

    async def stop(self) -> None:
        """Commit what was dealt with, leave the group, disconnect. Safe to call twice."""
        consumer = self._consumer
        if consumer is None:
            return
        with contextlib.suppress(Exception):
            await self._commit_done()
        self._consumer = None
        await consumer.stop()

    async def __aenter__(self) -> TypedConsumer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __del__(self) -> None:
        if getattr(self, "_consumer", None) is not None:
            warnings.warn("TypedConsumer was not stopped", ResourceWarning, stacklevel=1)

    def _require(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise NotStarted("consumer is not started")
        return self._consumer

    # ------------------------------------------------------------------ offsets
    def _tp(self, topic: str | TopicSpec, partition: int) -> TopicPartition:
        return TopicPartition(topic_name(topic, self.kafka), partition)

    def _catalog_name(self, broker_topic: str) -> str:
        name = self._catalog.get(broker_topic)
        if name is None:
            p = self.kafka.topic_prefix
            name = broker_topic[len(p) :] if p and broker_topic.startswith(p) else broker_topic
        return name

    def assignment(self) -> set[tuple[str, int]]:
        """The (catalog topic, partition) pairs this consumer reads now."""
        return {(self._catalog_name(tp.topic), tp.partition) for tp in self._require().assignment()}

    async def wait_assignment(self, timeout_s: float = 15.0) -> set[tuple[str, int]]:
        """Wait until the group has given this consumer its partitions (at once for manual ones).

        Returns them; the set may legitimately be empty only if the group has more members than
        partitions, in which case this waits the whole ``timeout_s``.
        """
        consumer = self._require()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not consumer.assignment() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return self.assignment()

    async def seek(self, offsets: dict[tuple[str, int], int]) -> None:
        """Move positions to the given offsets, e.g. the offsets a snapshot was taken at.

        Dedup marks are kept, so re-read records already handled here are skipped.
        """
        consumer = self._require()
        for (topic, partition), offset in offsets.items():
            consumer.seek(self._tp(topic, partition), offset)

    async def positions(self) -> dict[tuple[str, int], int]:
        """The next offset to be read, per assigned partition."""
        consumer = self._require()
        out = {}
        for tp in consumer.assignment():
            out[(self._catalog_name(tp.topic), tp.partition)] = await consumer.position(tp)
        return out

    async def end_offsets(self) -> dict[tuple[str, int], int]:
        """The offset the next produced record would get, per assigned partition."""
        consumer = self._require()
        tps = list(consumer.assignment())
        ends = await consumer.end_offsets(tps) if tps else {}
        return {(self._catalog_name(tp.topic), tp.partition): off for tp, off in ends.items()}

    async def commit(self, limits: dict[tuple[TopicSpec, int], int] | None = None) -> None:
        """Commit the offsets of every record dealt with so far (no-op without a group).

        ``limits`` caps the commit of some partitions at an offset (records from there on are read
        again by whoever takes the partition over): the owner still holds them undecided."""
        # kept: a rebalance that takes the partitions away commits under the same caps
        self._caps = {self._tp(t, p): off for (t, p), off in (limits or {}).items()}
        await self._commit_done()

    async def _commit_done(self, only: set[TopicPartition] | None = None) -> None:
        consumer = self._consumer
        if consumer is None or self.group_id is None:
            return
        caps = self._caps
        offsets = {
            tp: OffsetAndMetadata(min(off, caps.get(tp, off)), "")
            for tp, off in self._done.items()
            if (only is None or tp in only) and self._committed.get(tp) != min(off, caps.get(tp, off))
        }
        if not offsets:
            return
        try:
            await consumer.commit(offsets)
        except (CommitFailedError, KafkaError) as exc:
            # The partitions were rebalanced away; their new owner re-reads from the last commit.
            log.warning("commit of %d partitions failed: %s", len(offsets), exc)
            return
        self.metrics.commits += 1
        for tp, om in offsets.items():
            self._committed[tp] = om.offset

    def _mark_done(self, tp: TopicPartition, offset: int) -> None:
        if offset + 1 > self._done.get(tp, -1):
            self._done[tp] = offset + 1

    # ------------------------------------------------------------------ reading
    async def _fetch(
        self, timeout_ms: int, max_records: int | None, rebalance_wait_s: float | None = None
    ) -> list[tuple[TopicPartition, list[ConsumerRecord]]]:
        """One fetch, grouped by partition (as aiokafka returns it, in offset order per partition).

        ``rebalance_wait_s`` bounds the whole call: aiokafka's getmany waits for a rebalance to end
        without a timeout. Cancelling it there drops nothing (it takes records from its buffer only
        after its waits, without awaiting); a bounded call that runs out returns no records.
        """
        consumer = self._require()
        call = consumer.getmany(timeout_ms=timeout_ms, max_records=max_records or self.max_batch)
        if rebalance_wait_s is None:
            batches = await call
        else:
            try:
                async with asyncio.timeout(timeout_ms / 1000 + rebalance_wait_s):
                    batches = await call
            except TimeoutError:
                return []
        m = self.metrics
        for tp, raws in batches.items():
            if raws:
                topic = self._catalog_name(tp.topic)
                m.records_by_topic[topic] += len(raws)
                high = consumer.highwater(tp)
                if high is not None:
                    m.lag[(topic, tp.partition)] = max(high - raws[-1].offset - 1, 0)
        return list(batches.items())

    def _triage(self, tp: TopicPartition, topic: str, raw: ConsumerRecord) -> Record | SchemaError | None:
        """Decode one raw record of ``tp`` (catalog name ``topic``).

        Returns the Record to hand on; None if it needs no handler (a duplicate, or filtered out),
        already marked done; or the SchemaError it failed with, for the caller to dead-letter and mark.
        Synchronous, so a batch costs no await per record.
        """
        self.metrics.consumed += 1
        try:
            decoder = self._decoders.get(raw.topic) or decoder_for(MESSAGE_TYPES)
            env = decoder.decode(raw.value, self.kafka.max_record_bytes)
        except SchemaError as exc:
            return exc
        key = raw.key.decode("utf-8", errors="replace") if raw.key is not None else None
        if self.key_filter is not None and key != self.key_filter:
            self.metrics.filtered += 1
            self._mark_done(tp, raw.offset)
            return None
        if self.dedup and self._dedup.is_duplicate(raw.topic, raw.partition, env.producer, env.seq):
            self.metrics.deduplicated += 1
            self._mark_done(tp, raw.offset)
            return None
        return Record(topic, raw.partition, raw.offset, key, env, raw.timestamp)

    def _handled(self, tp: TopicPartition, raw: ConsumerRecord, record: Record) -> None:
        if self.dedup:
            self._dedup.mark(raw.topic, raw.partition, record.envelope.producer, record.envelope.seq)
        self._mark_done(tp, raw.offset)

    async def getmany(
        self, timeout_ms: int = 100, max_records: int | None = None, rebalance_wait_s: float | None = None
    ) -> list[Record]:
        """Fetch, decode and deduplicate a batch; dead-letter undecodable records.

        The records returned count as dealt with: the next :meth:`commit` covers them. With
        ``rebalance_wait_s``, a call that finds a group rebalance under way returns (empty) after at
        most ``timeout_ms`` plus that long instead of waiting for the rebalance to end.
        """
        out: list[Record] = []
        append = out.append
        dedup = self._dedup if self.dedup else None
        for tp, raws in await self._fetch(timeout_ms, max_records, rebalance_wait_s):
            topic = self._catalog_name(tp.topic)
            for raw in raws:
                got = self._triage(tp, topic, raw)
                if got is None:
                    continue
                if isinstance(got, SchemaError):
                    await self._dead_letter(raw, got, "schema")
                    continue
                if dedup is not None:
                    env = got.envelope
                    dedup.mark(raw.topic, raw.partition, env.producer, env.seq)
                append(got)
            if raws:
                # Every record of the partition's batch is dealt with: handed out, skipped or
                # dead-lettered; offsets only grow within a batch.
                self._mark_done(tp, raws[-1].offset)
        self.metrics.handled += len(out)
        return out

    async def run(self, handler: Handler, stop: asyncio.Event | None = None) -> None:
        """Hand every record to ``handler`` until ``stop`` is set, the task is cancelled or
        :meth:`stop` is called; commits after each batch and on the way out.

        A failing handler is retried ``max_attempts`` times, then its record is dead-lettered.
        """
        consumer = self._require()
        try:
            while (stop is None or not stop.is_set()) and self._consumer is not None:
                try:
                    batches = await self._fetch(timeout_ms=200, max_records=None)
                except ConsumerStoppedError:
                    return
                except KafkaError as exc:
                    log.warning("fetch failed (%s); retrying", exc)
                    await asyncio.sleep(0.2)
                    continue
                for tp, raws in batches:
                    topic = self._catalog_name(tp.topic)
                    for raw in raws:
                        if stop is not None and stop.is_set():
                            break
                        if tp not in consumer.assignment():
                            # Revoked by a rebalance since the fetch: the new owner reads it.
                            break
                        got = self._triage(tp, topic, raw)
                        if isinstance(got, SchemaError):
                            await self._dead_letter(raw, got, "schema")
                            self._mark_done(tp, raw.offset)
                        elif got is not None:
                            await self._handle(handler, tp, raw, got)
                if batches:
                    await self._commit_done()
        finally:
            with contextlib.suppress(Exception):
                await self._commit_done()

    async def _handle(
        self, handler: Handler, tp: TopicPartition, raw: ConsumerRecord, record: Record
    ) -> None:
        for attempt in range(1, self.max_attempts + 1):
            try:
                await handler(record)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.metrics.handler_errors += 1
                log.exception(
                    "handler failed on %s[%d]@%d (attempt %d/%d)",
                    record.topic,
                    record.partition,
                    record.offset,
                    attempt,
                    self.max_attempts,
                )
                if attempt == self.max_attempts:
                    await self._dead_letter(raw, exc, "handler")
                    self._handled(tp, raw, record)
                    return
                await asyncio.sleep(self.retry_backoff_s * attempt)
            else:
                self.metrics.handled += 1
                self._handled(tp, raw, record)
                return

    async def _dead_letter(self, raw: ConsumerRecord, exc: BaseException, kind: str) -> None:
        self.metrics.dead_lettered += 1
        source = self._catalog_name(raw.topic)
        self.metrics.dead_letters_by_topic[source] += 1
        log.warning("dead-lettering %s[%d]@%d (%s): %s", source, raw.partition, raw.offset, kind, exc)
        if self.dlq is None:
            return
        headers = dead_letter_headers(source, raw.partition, raw.offset, exc, kind)
        value = raw.value if isinstance(raw.value, bytes) else bytes(raw.value or b"")
        try:
            await self.dlq.send_raw(topic_name(DEAD_LETTER, self.dlq.kafka), value, source, headers)
        except Exception:
            # Losing a dead-letter copy must not stop the stream; the log line above keeps the facts.
            log.exception(
                "could not publish dead-letter record for %s[%d]@%d", source, raw.partition, raw.offset
            )


def dead_letter_headers(
    source_topic: str, partition: int, offset: int, exc: BaseException, kind: str
) -> list[tuple[str, bytes]]:
    """Headers of a dead-letter record: where it came from and why it could not be handled."""
    return [
        (DLQ_SOURCE_TOPIC, source_topic.encode()),
        (DLQ_SOURCE_PARTITION, str(partition).encode()),
        (DLQ_SOURCE_OFFSET, str(offset).encode()),
        (DLQ_ERROR, f"{type(exc).__name__}: {exc}"[:1000].encode()),
        (DLQ_ERROR_KIND, kind.encode()),
    ]


def headers_dict(headers: Iterable[tuple[str, bytes]]) -> dict[str, str]:
    """Record headers as text, for reading dead-letter records."""
    return {k: v.decode("utf-8", errors="replace") for k, v in headers}
