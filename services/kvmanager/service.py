"""The KV manager's long-running loop: consume → apply → liveness → placement → flush → publish.

One task does everything in order; only the Redis round trip of a flush overlaps the next batch
(its payload is built from memory before it is sent, and at most one flush is in flight)::

    kv-events ┐                  ┌─ Directory (memory) ──flush (MULTI/EXEC, with offsets)──▶ Redis
    load      ├─ TypedConsumer ──┤  liveness: silent workers → drop blocks, WorkerLost ───────▶ control
    requests  ┘  (all partitions)└─ placement: hot prefixes, sessions → Replicate / Retain ──▶ control

Cold start: the directory is loaded from Redis and the consumer seeks to the offsets stored with it,
so a restarted manager continues exactly where its last flush ended (records after it are re-read;
those already applied are recognised by their seq and skipped).

Redis outage: the loop keeps consuming and applying; changes stay coalesced in memory and each flush
retries every ``redis_retry_ms``. Past ``buffer_max_dirty`` dirty entries consumption pauses (Kafka
keeps the records; nothing is lost). When Redis answers again the next flush writes everything —
the whole directory if Redis came back empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from kvmesh_core.runtime import rolled_back_on_failure
from schemas.kv_sequence import KvSequence
from schemas.messages import ChatRequest, KvEvent, LoadReport, ReplicateCommand, ResyncRequest
from schemas.report_signing import ReportCheck
from services.fleet_directory.layout import REDIS_DOWN_ERRORS
from services.kvmanager.config import KvManagerSettings
from services.kvmanager.directory import Directory
from services.kvmanager.liveness import liveness_now, lost_workers, worker_lost_message
from services.kvmanager.metrics import KvManagerMetrics
from services.kvmanager.placement import PlacementConfig, PlacementEngine
from services.kvmanager.write_behind import DirectoryWriter, PendingFlush
from streams.admin import ensure_topics
from streams.clock import now_ms
from streams.consumer import Record, TypedConsumer
from streams.consumer_metrics import ConsumerCollector
from streams.heartbeat import Heartbeat
from streams.producer import TypedProducer
from streams.tasks import stop_task
from streams.topics import CONTROL, KV_EVENTS, LOAD, REQUESTS, TopicSpec

log = logging.getLogger(__name__)

#: The topics the manager consumes, every partition of each.
INPUT_TOPICS: tuple[TopicSpec, ...] = (KV_EVENTS, LOAD, REQUESTS)

FlushHook = Callable[[list[int], int], None]


def placement_config(s: KvManagerSettings) -> PlacementConfig:
    return PlacementConfig(
        window_ms=s.hot_window_ms,
        min_sessions=s.hot_min_sessions,
        min_blocks=s.hot_min_blocks,
        max_replicas=s.max_replicas,
        bytes_per_s=s.replicate_bytes_per_s,
        burst_bytes=s.replicate_burst_bytes,
        tier=s.replicate_tier,
        pending_ms=s.replicate_pending_ms,
        min_free_blocks=s.replicate_min_free_blocks,
        retain_min_turns=s.retain_min_turns,
        retain_ms=s.retain_ms,
        session_ttl_ms=s.session_ttl_ms,
    )


class KvManagerService:
    """Owns the Redis client, the consumer of kv-events/load/requests, the control producer, the
    in-memory :class:`Directory` and the :class:`PlacementEngine`. ``start()``/``stop()`` are safe
    twice; ``async with`` works too.

    ``on_flush(event_ms_list, flushed_ms)`` (optional) is called after each successful flush with the
    envelope times of the KvEvents it made durable (the benchmark measures lag with it).
    """

    def __init__(
        self,
        settings: KvManagerSettings,
        *,
        clock: Callable[[], int] = now_ms,
        on_flush: FlushHook | None = None,
    ) -> None:
        self.settings = settings
        self.refused_workers: set[str] = set()  # announced another block size than the fleet's
        self.clock = clock
        self.on_flush = on_flush
        self.directory = Directory()
        self.writer = DirectoryWriter(self.directory)
        self.placement = PlacementEngine(placement_config(settings))
        self.redis: aioredis.Redis | None = None
        self.consumer: TypedConsumer | None = None
        self.producer: TypedProducer | None = None
        self._task: asyncio.Task[None] | None = None
        self._heartbeat: Heartbeat | None = None
        self._kv_sequence = KvSequence()
        self._reports = ReportCheck.from_setting(settings.fleet_secret)
        self._redis_ok = True
        self._next_redis_try = 0
        self._next_verify = 0
        self._paused_logged = False
        self._unflushed_event_ms: list[int] = []
        # The flush being written to Redis while the loop consumes and applies the next batch.
        self._inflight: asyncio.Task[bool] | None = None
        self._lost: set[str] = set()  # declared lost and not heard from since
        # LOAD partition → its end offset when this manager started, until the manager has read that
        # far: liveness waits for it (the reports loaded from Redis may be old; the newer ones are
        # still to be read).
        self._load_backlog: dict[int, int] = {}
        self.metrics = KvManagerMetrics(
            self._block_count, lambda: (len(self.directory.workers), len(self._lost)), self._role
        )
        self.metrics.registry.register(
            ConsumerCollector("kvmanager", lambda: [self.consumer.metrics if self.consumer else None])
        )

    def _block_count(self) -> int:
        return len(self.directory.blocks)

    def _role(self) -> tuple[bool, int]:
        """(runs liveness and placement, shards owned): the one manager does, and owns no shards."""
        return True, 0

    @property
    def redis_ok(self) -> bool:
        """False while the last flush attempt found Redis unreachable."""
        return self._redis_ok

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        s = self.settings
        async with rolled_back_on_failure(self.stop):
            self.redis = s.redis.connect()
            await self._load_directory()
            await ensure_topics(s.kafka)
            self.producer = TypedProducer(s.kafka, s.manager_id)
            await self.producer.start()
            counts = [await self.producer.partition_count(spec) for spec in INPUT_TOPICS]
            assign = [(spec, p) for spec, n in zip(INPUT_TOPICS, counts, strict=True) for p in range(n)]
            self.consumer = TypedConsumer(s.kafka, [], None, from_beginning=True, dedup=False, assign=assign)
            await self.consumer.start()
            resume = {
                tp: off
                for tp, off in self.directory.offsets.items()
                if tp[0] in {t.name for t in INPUT_TOPICS}
            }
            if resume:
                await self.consumer.seek(resume)
            await self._note_load_backlog(self.consumer)
            log.info(
                "kvmanager %s started: %d blocks, %d workers, resuming %d partitions from Redis offsets",
                s.manager_id,
                len(self.directory.blocks),
                len(self.directory.workers),
                len(resume),
            )
        self._task = asyncio.create_task(self._run(), name="kvmanager-loop")
        self._heartbeat = Heartbeat(self.producer, "kvmanager", s.manager_id)
        self._heartbeat.start()

    async def _load_directory(self) -> None:
        """Load the directory from Redis, waiting for Redis to answer (nothing can start without it)."""
        assert self.redis is not None
        warned = False
        while True:
            try:
                await self.writer.load(self.redis)
                return
            except REDIS_DOWN_ERRORS as exc:
                if not warned:
                    log.warning(
                        "Redis at %s unreachable at start (%s); waiting",
                        self.settings.redis.redacted_url,
                        exc,
                    )
                    warned = True
                await asyncio.sleep(self.settings.redis_retry_ms / 1000)

    async def stop(self) -> None:
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            await heartbeat.stop()
        task, self._task = self._task, None
        await stop_task(task)
        if self.redis is not None:
            with contextlib.suppress(*REDIS_DOWN_ERRORS):
                await self._flush(force=True)
                await self._wait_inflight()
        await self._before_close()
        if self.consumer is not None:
            await self.consumer.stop()
            self.consumer = None
        if self.producer is not None:
            await self.producer.stop()
            self.producer = None
        if self.redis is not None:
            await self.redis.aclose()
            self.redis = None

    async def _before_close(self) -> None:
        """Stop-time work after the last flush, while Redis and Kafka are still open (replicas)."""

    @property
    def registry(self) -> CollectorRegistry:
        return self.metrics.registry

    async def __aenter__(self) -> KvManagerService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- the loop --------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                # A bug in one batch must not stop the fleet's directory; the batch stays unflushed.
                log.exception("kvmanager step failed")
                await asyncio.sleep(0.1)

    async def step(self) -> None:
        """One round: consume a batch (unless paused), apply it, judge liveness, plan, flush, publish."""
        assert self.consumer is not None
        s = self.settings
        out: list[tuple[TopicSpec, Any]] = []
        if self.directory.dirty_size() < s.buffer_max_dirty:
            self._paused_logged = False
            records = await self.consumer.getmany(
                timeout_ms=s.poll_timeout_ms, max_records=s.batch_max_records
            )
            for record in records:
                out.extend(self._apply(record))
        else:
            if not self._paused_logged:
                log.warning(
                    "Redis unreachable and %d changes buffered (limit %d): consumption paused",
                    self.directory.dirty_size(),
                    s.buffer_max_dirty,
                )
                self._paused_logged = True
            await asyncio.sleep(s.redis_retry_ms / 1000)
        out.extend(self._liveness())
        now = self.directory.max_event_ms
        view_workers = self.directory.workers
        out.extend((CONTROL, cmd) for cmd in self.placement.plan(now, self.directory, view_workers))
        await self._flush()
        await self._publish(out)

    def _apply(self, record: Record) -> list[tuple[TopicSpec, Any]]:
        env = record.envelope
        if not self.directory.accept(record.topic, record.partition, record.offset, env.producer, env.seq):
            return []
        msg = env.message
        if isinstance(msg, KvEvent):
            if not self._block_size_ok(msg, self.settings.block_size):
                return []
            return self._apply_event(msg, env.event_ms, self.directory)
        if isinstance(msg, LoadReport):
            self._apply_load(msg)
        elif isinstance(msg, ChatRequest):
            self.directory.observe_lookup(msg)
            return [(CONTROL, hint) for hint in self.placement.on_request(msg, self.directory)]
        return []

    def _apply_load(self, msg: LoadReport) -> None:
        """Record a worker's report, unless its block size is not the fleet's or (under a fleet
        secret) it is forged or unsigned."""
        if self._block_size_ok(msg, self.settings.block_size) and self._reports.accept(msg):
            self.directory.apply_load(msg)
            self._lost.discard(msg.worker_id)

    def _block_size_ok(self, msg: LoadReport | KvEvent, block_size: int | None) -> bool:
        """False for a worker that announced another block size than the fleet's: its blocks would be
        mis-indexed, so neither its report nor its events enter the directory (logged once)."""
        if block_size is None:
            return True
        if isinstance(msg, LoadReport):
            if msg.block_size != block_size:
                if msg.worker_id not in self.refused_workers:
                    log.error(
                        "worker %s announces block size %d, the fleet's is %d: refused",
                        msg.worker_id,
                        msg.block_size,
                        block_size,
                    )
                self.refused_workers.add(msg.worker_id)
                return False
            self.refused_workers.discard(msg.worker_id)
            return True
        return msg.worker_id not in self.refused_workers

    async def _note_load_backlog(self, consumer: TypedConsumer) -> None:
        ends = await consumer.end_offsets()
        self._load_backlog = {
            p: end
            for (topic, p), end in ends.items()
            if topic == LOAD.name and end > self.directory.offsets.get((LOAD.name, p), 0)
        }

    def _load_behind(self, consumer: TypedConsumer | None) -> bool:
        """Whether LoadReports are still unread: the backlog at start, or records behind the high
        watermark at the last fetch. A worker is never declared lost on reports not yet read (a
        restarted or stalled manager would otherwise declare the whole fleet lost)."""
        for p, end in list(self._load_backlog.items()):
            if self.directory.offsets.get((LOAD.name, p), 0) >= end:
                del self._load_backlog[p]
        if self._load_backlog:
            return True
        lag = consumer.metrics.lag if consumer is not None else {}
        return any(n > 0 for (topic, _), n in lag.items() if topic == LOAD.name)

    def _liveness(self) -> list[tuple[TopicSpec, Any]]:
        """Declare workers silent for ``liveness_timeout_ms`` lost: drop them, and (if this manager
        announces them, see :meth:`_announces`) publish WorkerLost."""
        if self._load_behind(self._load_consumer()):
            return []
        s = self.settings
        clock = self.clock() if s.liveness_clock == "wall" else None
        now = liveness_now(self.directory.max_event_ms, clock)
        last_seen = {w: int(info.get("last_seen_ms", 0)) for w, info in self.directory.workers.items()}
        out: list[tuple[TopicSpec, Any]] = []
        announce = self._announces()
        for lost in lost_workers(last_seen, now, s.liveness_timeout_ms):
            dropped = self._drop_lost(lost.worker_id)
            self._lost.add(lost.worker_id)
            log.warning(
                "worker %s lost: no LoadReport since %d (%d ms); dropped %d blocks",
                lost.worker_id,
                lost.last_seen_ms,
                now - lost.last_seen_ms,
                dropped,
            )
            if announce:
                out.append((CONTROL, worker_lost_message(lost, now)))
        return out

    def _load_consumer(self) -> TypedConsumer | None:
        """The consumer that reads the load topic."""
        return self.consumer

    def _announces(self) -> bool:
        """Whether this manager publishes WorkerLost (the one manager always does)."""
        return True

    def _drop_lost(self, worker_id: str) -> int:
        """Forget a lost worker; returns how many blocks it held."""
        return self.directory.drop_worker(worker_id)

    def _apply_event(self, msg: KvEvent, event_ms: int, directory: Directory) -> list[tuple[TopicSpec, Any]]:
        """Apply a KvEvent to ``directory`` unless it is out of sequence (a gap asks for a resync)."""
        verdict = self._kv_sequence.observe(msg)
        if verdict == "gap":
            log.warning("gap in the KV events of %s: asking it to resync", msg.worker_id)
            return [(CONTROL, ResyncRequest(msg.worker_id, self.settings.manager_id))]
        if verdict == "drop":
            return []
        directory.apply_kv_event(msg, event_ms)
        self.metrics.events_applied += 1
        self._unflushed_event_ms.append(event_ms)
        return []

    async def _flush(self, force: bool = False) -> None:
        """Start writing the changes applied so far; returns once the previous flush is confirmed.

        The Redis call runs in its own task while the loop goes on with the next batch (pipelined:
        the manager's CPU and Redis's work overlap). A failed flush folds its changes back into the
        directory's current ones, so the next flush carries them.
        """
        assert self.redis is not None
        await self._wait_inflight()
        wall = self.clock()
        if not self.directory.has_dirty():
            if self._redis_ok and wall >= self._next_verify:
                # Idle: check that Redis still holds our directory (it may have restarted empty).
                self._next_verify = wall + 1000
                with contextlib.suppress(*REDIS_DOWN_ERRORS):
                    await self.writer.verify(self.redis)
                # redis-py can absorb a cancellation (stop()) that lands in its read and retry or
                # raise a connection error instead: do not let it swallow the cancel, or stop()
                # waits for a loop that never ends.
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError
            return
        if not force and not self._redis_ok and wall < self._next_redis_try:
            return
        pending = self.writer.take_flush()
        if pending is None:
            return
        pending.event_ms, self._unflushed_event_ms = self._unflushed_event_ms, []
        self._inflight = asyncio.create_task(self._send(pending), name="kvmanager-flush")
        # Let the task write its request now: the next getmany often returns prefetched records
        # without suspending, and the request would otherwise leave only when the loop next waits,
        # i.e. after the whole next batch, with no overlap at all.
        for _ in range(4):
            await asyncio.sleep(0)

    async def _wait_inflight(self) -> None:
        task = self._inflight
        if task is None:
            return
        try:
            # Shielded: cancelling the loop must not cancel a write half done; stop() awaits it.
            await asyncio.shield(task)
        finally:
            if task.done():
                self._inflight = None

    async def _send(self, pending: PendingFlush, writer: DirectoryWriter | None = None) -> bool:
        assert self.redis is not None
        ok: bool = await (writer or self.writer).send_flush(self.redis, pending)
        if ok:
            if not self._redis_ok:
                log.warning("Redis reachable again: buffered directory changes written")
            self._redis_ok = True
            if pending.event_ms:
                now = self.clock()
                self.metrics.event_lag.observe(max(now - min(pending.event_ms), 0) / 1e3)
                if self.on_flush is not None:
                    self.on_flush(pending.event_ms, now)
        else:
            # Its changes are back in the directory's dirty set; their event times go back too.
            self._unflushed_event_ms[:0] = pending.event_ms
            if self._redis_ok:
                log.warning(
                    "Redis at %s unreachable: buffering directory changes in memory (limit %d), retrying "
                    "every %d ms",
                    self.settings.redis.redacted_url,
                    self.settings.buffer_max_dirty,
                    self.settings.redis_retry_ms,
                )
            self._redis_ok = False
            self._next_redis_try = self.clock() + self.settings.redis_retry_ms
        return ok

    async def _publish(self, out: list[tuple[TopicSpec, Any]]) -> None:
        if not out:
            return
        assert self.producer is not None
        futures = []
        for topic, msg in out:
            try:
                futures.append(await self.producer.send(topic, msg, wait=False))
            except Exception as exc:  # control messages are advisory; a lost one is re-decided later
                log.error("could not publish %s: %s", type(msg).__name__, exc)
                continue
            self.metrics.published.labels(type(msg).SCHEMA).inc()
            if isinstance(msg, ReplicateCommand):
                self.metrics.replications.inc()
        for fut in futures:
            try:
                await fut
            except Exception as exc:
                log.error("control message not delivered: %s", exc)
