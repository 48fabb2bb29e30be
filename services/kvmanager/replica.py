"""KV-manager replicas (``sharded``): each owns a share of the kv-events partitions.

::

    kv-events ── consumer group ──▶ replica A: shards p0, p2 ──fenced flush──▶ {kvm.p0}:*, {kvm.p2}:*
                                └─▶ replica B: shards p1, p3 ──fenced flush──▶ {kvm.p1}:*, {kvm.p3}:*
    load, requests ── every replica reads every partition (small topics)
    lease holder (one replica): liveness → WorkerLost, hot-prefix replication, fleet slice {kvm}:*

What each replica does:
- **Its shards.** The group gives it partitions; for each it loads the shard slice from Redis and
  seeks the partition to the offset stored with it, so it continues exactly where the slice's last
  flush ended (records after it are re-read; their seqs say which were applied). Before a rebalance
  takes a partition away its shard is flushed and dropped (what a failed flush held is re-read by
  the next owner: Redis offsets only advance with a flush). Flushes are fenced by the slice's
  version: a replica that lost a shard without noticing (paused past the session timeout) is
  refused and reloads, and never overwrites the new owner.
- **Every replica** reads all load and request records: liveness drops a silent worker's blocks
  from the shards it owns (every replica judges the same reports the same way), and retain hints are
  per worker, so each replica sends those of the workers in its shards (together: exactly what one
  manager sends).
- **The leader** (Redis lease, :mod:`services.kvmanager.lease`) publishes WorkerLost, plans
  hot-prefix replication over its shards united with the holders of the hot blocks in the other
  slices (read every ``placement_view_ms``), and writes the fleet slice (worker info, load and
  request offsets). A new leader rewrites the fleet slice from its memory, which is current: it has
  read every load record all along.

Killing a replica loses no event (its partitions move to the others after the group's session
timeout; they resume at the offsets in Redis) and declares no live worker lost (liveness is judged
from LoadReports, which every replica reads, not from a replica's own progress).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from kvmesh_core.runtime import rolled_back_on_failure
from schemas.messages import ChatRequest, KvEvent, LoadReport
from services.fleet_directory.layout import KEY_PREFIX, REDIS_DOWN_ERRORS, shard_prefix
from services.kvmanager.config import KvManagerSettings
from services.kvmanager.lease import LeaderLease
from services.kvmanager.service import FlushHook, KvManagerService
from services.kvmanager.shards import CombinedView, OwnedShards, Shard, fetch_holders
from services.kvmanager.write_behind import DirectoryWriter, PendingFlush, SliceTaken
from streams.admin import ensure_topics
from streams.clock import now_ms
from streams.consumer import Record, TypedConsumer
from streams.heartbeat import Heartbeat
from streams.producer import TypedProducer
from streams.topics import CONTROL, KV_EVENTS, LOAD, REQUESTS, TopicSpec

log = logging.getLogger(__name__)

#: What every replica reads in full (manually assigned): small, and each replica needs all of it.
FLEET_TOPICS: tuple[TopicSpec, ...] = (LOAD, REQUESTS)


class KvManagerReplica(KvManagerService):
    """One replica. ``self.directory`` is the fleet slice (workers, load and request offsets);
    ``self.shards`` the shard slices this replica owns now."""

    def __init__(
        self,
        settings: KvManagerSettings,
        *,
        clock: Callable[[], int] = now_ms,
        on_flush: FlushHook | None = None,
    ) -> None:
        super().__init__(settings, clock=clock, on_flush=on_flush)
        self.writer = DirectoryWriter(self.directory, KEY_PREFIX, fenced=True)
        self.shards = OwnedShards()
        self.lease = LeaderLease(settings.manager_id, settings.lease_ms, clock)
        self.fleet_consumer: TypedConsumer | None = None
        self._flush_lock = asyncio.Lock()
        self._reload: set[int] = set()
        self._kv_partitions = 0
        self._remote: dict[int, dict[str, str]] = {}
        self._next_view = 0

    def _block_count(self) -> int:
        return self.shards.block_count()

    def _role(self) -> tuple[bool, int]:
        return self.lease.held(), len(self.shards.partitions())

    @property
    def is_leader(self) -> bool:
        return self.lease.held()

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        s = self.settings
        async with rolled_back_on_failure(self.stop):
            self.redis = s.redis.connect()
            await self._load_directory()
            self._forget_unsharded()
            await ensure_topics(s.kafka)
            self.producer = TypedProducer(s.kafka, s.manager_id)
            await self.producer.start()
            counts = [await self.producer.partition_count(spec) for spec in FLEET_TOPICS]
            assign = [(spec, p) for spec, n in zip(FLEET_TOPICS, counts, strict=True) for p in range(n)]
            self.fleet_consumer = TypedConsumer(
                s.kafka, [], None, from_beginning=True, dedup=False, assign=assign
            )
            await self.fleet_consumer.start()
            fleet_names = {t.name for t in FLEET_TOPICS}
            resume = {tp: o for tp, o in self.directory.offsets.items() if tp[0] in fleet_names}
            if resume:
                await self.fleet_consumer.seek(resume)
            await self._note_load_backlog(self.fleet_consumer)
            self._kv_partitions = await self.producer.partition_count(KV_EVENTS)
            self.consumer = TypedConsumer(
                s.kafka,
                [KV_EVENTS],
                s.group_id,
                from_beginning=True,
                dedup=False,
                on_revoked=self._release,
                on_assigned=self._adopt,
            )
            await self.consumer.start()
            log.info(
                "kvmanager replica %s started: %d workers; kv-events shards come from group %s",
                s.manager_id,
                len(self.directory.workers),
                s.group_id,
            )
        self._task = asyncio.create_task(self._run(), name="kvmanager-replica-loop")
        self._heartbeat = Heartbeat(self.producer, "kvmanager", s.manager_id)
        self._heartbeat.start()

    def _forget_unsharded(self) -> None:
        """Drop what a single manager left in the fleet slice (blocks, kv-events offsets): with
        replicas they live in the shard slices, rebuilt from the kv-events topic; the leader's first
        write rewrites the fleet slice without them."""
        d = self.directory
        if d.blocks or any(t == KV_EVENTS.name for t, _ in d.offsets):
            log.warning(
                "the fleet slice holds a single manager's directory (%d blocks): the shards are rebuilt "
                "from the kv-events topic",
                len(d.blocks),
            )
        d.blocks.clear()
        d.parents.clear()
        d.worker_blocks.clear()
        d.offsets = {tp: o for tp, o in d.offsets.items() if tp[0] != KV_EVENTS.name}
        d.seqs = {k: v for k, v in d.seqs.items() if k[0] != KV_EVENTS.name}

    async def _before_close(self) -> None:
        if self.redis is not None and self.lease.held():
            await self.lease.release(self.redis)
        if self.fleet_consumer is not None:
            await self.fleet_consumer.stop()
            self.fleet_consumer = None

    # ---- shard ownership (run by the group's rebalance, inside the consumer) -----------------------

    async def _adopt(self, pairs: set[tuple[str, int]]) -> None:
        for topic, p in sorted(pairs):
            if topic != KV_EVENTS.name or p in self.shards:
                continue
            shard = await self._load_shard(p)
            self.shards.add(shard)
            log.info(
                "%s owns kv-events partition %d (%d blocks)",
                self.settings.manager_id,
                p,
                len(shard.directory.blocks),
            )

    async def _load_shard(self, p: int) -> Shard:
        """Load shard ``p`` from its slice and seek the partition to the slice's offset."""
        assert self.redis is not None and self.consumer is not None
        shard = Shard.new(p)
        while True:
            try:
                await shard.writer.load(self.redis)
                break
            except REDIS_DOWN_ERRORS as exc:
                log.warning("Redis unreachable loading shard %d (%s); waiting", p, exc)
                await asyncio.sleep(self.settings.redis_retry_ms / 1000)
        # aiokafka drops records it fetched before a seek or a rebalance, so no stale record of the
        # partition reaches the loop after this.
        await self.consumer.seek({(KV_EVENTS.name, p): shard.directory.offsets.get((KV_EVENTS.name, p), 0)})
        return shard

    async def _release(self, pairs: set[tuple[str, int]]) -> None:
        """Flush and drop the shards a rebalance takes away (before any other replica gets them)."""
        parts = sorted(p for t, p in pairs if t == KV_EVENTS.name and p in self.shards)
        if not parts:
            return
        async with self._flush_lock:
            await self._wait_inflight()
            for p in parts:
                shard = self.shards.pop(p)
                assert shard is not None
                pending = shard.writer.take_flush()
                if pending is not None and self.redis is not None:
                    try:
                        ok = await shard.writer.send_flush(self.redis, pending)
                    except SliceTaken:
                        ok = False
                    if not ok:
                        # Nothing is lost: the next owner re-reads from the slice's stored offset.
                        log.warning("shard %d released unflushed; its next owner re-reads the rest", p)
                log.info("%s released kv-events partition %d", self.settings.manager_id, p)

    # ---- the loop --------------------------------------------------------------------------------

    async def step(self) -> None:
        assert self.consumer is not None and self.fleet_consumer is not None and self.redis is not None
        s = self.settings
        out: list[tuple[TopicSpec, Any]] = []
        if self.shards.dirty_size() + self.directory.dirty_size() < s.buffer_max_dirty:
            fleet = await self.fleet_consumer.getmany(timeout_ms=0, max_records=s.batch_max_records)
            kv = await self._kv_batch()
            # Applied with no await in between: no rebalance hook runs between fetch and apply.
            for record in fleet:
                out.extend(self._apply_fleet(record))
            for record in kv:
                out.extend(self._apply_shard(record))
        else:
            await asyncio.sleep(s.redis_retry_ms / 1000)
        await self._reload_taken()
        if await self.lease.tick(self.redis):
            await self._take_fleet_slice()
        out.extend(self._liveness())
        now = self.directory.max_event_ms
        if self.lease.held():
            out.extend((CONTROL, cmd) for cmd in await self._plan(now))
        else:
            self.placement.tracker.expire(now)
        await self._flush()
        await self._publish(out)

    async def _kv_batch(self) -> list[Record]:
        """The next kv-events batch, or none while a rebalance is under way: the loop must go on
        meanwhile (lease renewal, load records, flushes), and aiokafka would wait for its end."""
        assert self.consumer is not None
        s = self.settings
        return await self.consumer.getmany(
            timeout_ms=s.poll_timeout_ms, max_records=s.batch_max_records, rebalance_wait_s=0.25
        )

    def _apply_fleet(self, record: Record) -> list[tuple[TopicSpec, Any]]:
        env = record.envelope
        if not self.directory.accept(record.topic, record.partition, record.offset, env.producer, env.seq):
            return []
        msg = env.message
        if isinstance(msg, LoadReport):
            self._apply_load(msg)
        elif isinstance(msg, ChatRequest):
            # No fleet hit/miss counts here: "held anywhere" needs every shard.
            self.directory.max_event_ms = max(self.directory.max_event_ms, msg.arrival_ms)
            return [(CONTROL, hint) for hint in self.placement.on_request(msg, self.shards)]
        return []

    def _apply_shard(self, record: Record) -> list[tuple[TopicSpec, Any]]:
        shard = self.shards.get(record.partition)
        if shard is None:
            return []  # revoked since the fetch: its next owner reads it
        env = record.envelope
        msg = env.message
        if not shard.directory.accept(record.topic, record.partition, record.offset, env.producer, env.seq):
            return []
        if not isinstance(msg, KvEvent) or not self._block_size_ok(msg, self.settings.block_size):
            return []
        return self._apply_event(msg, env.event_ms, shard.directory)

    async def _reload_taken(self) -> None:
        """Reload the shards whose slice another replica wrote (see SliceTaken)."""
        if not self._reload:
            return
        async with self._flush_lock:
            await self._wait_inflight()
            for p in sorted(self._reload):
                if p in self.shards:
                    log.warning("shard %d was written by another replica: reloading it", p)
                    self.shards.add(await self._load_shard(p))
            self._reload.clear()

    async def _take_fleet_slice(self) -> None:
        assert self.redis is not None
        async with self._flush_lock:
            await self._wait_inflight()
            try:
                await self.writer.take_over(self.redis)
            except REDIS_DOWN_ERRORS as exc:
                log.warning("new leader could not write the fleet slice (%s); stepping down", exc)
                self.lease.step_down()

    # Liveness (the base class's rule): every replica drops a silent worker from its shards; only
    # the leader announces it.
    def _load_consumer(self) -> TypedConsumer | None:
        return self.fleet_consumer

    def _announces(self) -> bool:
        return self.lease.held()

    def _drop_lost(self, worker_id: str) -> int:
        self.directory.drop_worker(worker_id)
        return self.shards.drop_worker_blocks(worker_id)

    async def _plan(self, now: int) -> list[Any]:
        """The leader's replication plan over every shard (the others' holders as last fetched)."""
        assert self.redis is not None
        wall = self.clock()
        if wall >= self._next_view:
            self._next_view = wall + self.settings.placement_view_ms
            wanted = self.placement.wanted_hashes(now)
            others = [shard_prefix(p) for p in range(self._kv_partitions) if p not in self.shards]
            with contextlib.suppress(*REDIS_DOWN_ERRORS):  # else plan on what was fetched last
                self._remote = await fetch_holders(self.redis, others, wanted)
        return self.placement.plan(now, CombinedView(self.shards, self._remote), self.directory.workers)

    # ---- flushing --------------------------------------------------------------------------------

    async def _flush(self, force: bool = False) -> None:
        """Start writing every owned shard's changes (and the fleet slice's, when leader)."""
        assert self.redis is not None
        async with self._flush_lock:
            await self._wait_inflight()
            wall = self.clock()
            if not force and not self._redis_ok and wall < self._next_redis_try:
                return
            jobs: list[tuple[DirectoryWriter, PendingFlush, int | None]] = []
            for shard in self.shards:
                pending = shard.writer.take_flush()
                if pending is not None:
                    jobs.append((shard.writer, pending, shard.partition))
            if self.lease.held():
                pending = self.writer.take_flush()
                if pending is not None:
                    jobs.append((self.writer, pending, None))
            else:
                self.directory.take_changes()  # the leader writes the fleet slice, not us
            if not jobs:
                await self._verify_idle(wall)
                return
            event_ms, self._unflushed_event_ms = self._unflushed_event_ms, []
            jobs[0][1].event_ms = event_ms
            self._inflight = asyncio.create_task(self._send_all(jobs), name="kvmanager-flush")
        for _ in range(4):
            await asyncio.sleep(0)

    async def _verify_idle(self, wall: int) -> None:
        """Idle: check that Redis still holds the slices this replica last wrote (rewrite them if Redis
        came back empty; reload a shard another replica wrote)."""
        if not self._redis_ok or wall < self._next_verify:
            return
        self._next_verify = wall + 1000
        assert self.redis is not None
        slices: list[tuple[DirectoryWriter, int | None]] = [(sh.writer, sh.partition) for sh in self.shards]
        if self.lease.held():
            slices.append((self.writer, None))
        for writer, partition in slices:
            try:
                await writer.verify(self.redis)
            except SliceTaken as exc:
                self._slice_taken(exc, partition)
            except REDIS_DOWN_ERRORS:
                return

    async def _send_all(self, jobs: list[tuple[DirectoryWriter, PendingFlush, int | None]]) -> bool:
        for i, (writer, pending, partition) in enumerate(jobs):
            try:
                ok = await self._send(pending, writer)
            except SliceTaken as exc:
                self._slice_taken(exc, partition)
                continue
            if not ok:
                # Redis is down: the rest would fail too; give their changes back for the next try.
                for other_writer, other, _ in jobs[i + 1 :]:
                    other_writer.directory.restore_changes(other.dirty)
                    self._unflushed_event_ms[:0] = other.event_ms
                return False
        return True

    def _slice_taken(self, exc: SliceTaken, partition: int | None) -> None:
        """Another writer moved a slice of ours: reload that shard, or (the fleet slice) step down."""
        log.warning("%s", exc)
        if partition is None:
            self.lease.step_down()
        else:
            self._reload.add(partition)
