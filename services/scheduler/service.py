"""A scheduler replica's long-running loop: fleet state in, decisions out.

One task does everything in order, so the view never changes during a decision::

    kv-events, load, control (all partitions, no group) ─┐
    replies (Completions only, from the end)             ├─▶ FleetView
    requests (group "kvmesh-scheduler": this replica's   │
              share of the sessions)  ──▶ FairDispatcher ─┴─▶ Router ─▶ assignments (key worker_id)
                                                                     └▶ rejections → request.reply_topic
    CancelRequest: dropped from the queue (→ "cancelled" Completion) or forwarded to the worker it got

Cold start: the KV manager's directory snapshot (Redis) seeds the prefix index and the kv-events
consumer resumes at the snapshot's offsets; load and control are read from the beginning (load is
compacted). Without a snapshot every partition is replayed from the beginning. Before taking requests
the replica reads the state topics up to their end, so its first decisions see the current fleet.

Event time: decisions take ``now_ms`` from the largest message time seen (arrival_ms, report_ms,
declared_ms). Only while requests are held and nothing arrives does the loop advance it by the wall
clock, so that held requests eventually expire. The requests topic is committed up to the oldest
request still held, and while any is held decisions are marked in Redis, so a replica that takes over
after a crash decides the held ones and skips the rest (``held_requests.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from kvmesh_core.runtime import rolled_back_on_failure
from schemas.messages import (
    Assignment,
    CancelRequest,
    ChatRequest,
    Completion,
    DecisionInputs,
    KvEvent,
    LoadReport,
    ResyncRequest,
    WorkerLost,
)
from schemas.report_signing import ReportCheck
from services.scheduler.config import SchedulerSettings
from services.scheduler.fairness import FairDispatcher
from services.scheduler.held_requests import DecidedMarks, HeldPositions
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.router import Decision, Router
from services.scheduler.view import FleetView
from streams.admin import ensure_topics
from streams.clock import now_ms as wall_ms
from streams.consumer import Record, TypedConsumer
from streams.consumer_metrics import ConsumerCollector
from streams.heartbeat import Heartbeat
from streams.producer import TypedProducer
from streams.tasks import stop_task
from streams.topics import ASSIGNMENTS, BY_NAME, CONTROL, KV_EVENTS, LOAD, REPLIES, REQUESTS, TopicSpec

log = logging.getLogger(__name__)

GROUP_ID = "kvmesh-scheduler"


#: Assignments remembered for re-dispatch when their worker is lost (oldest forgotten first).
MAX_TRACKED_INFLIGHT = 100_000


class SchedulerService:
    """Owns the view, router and dispatcher of one replica, its producer and its two consumers.

    ``start()``/``stop()`` are safe to call twice; ``async with`` works.
    """

    def __init__(self, settings: SchedulerSettings, *, redis_client: Any | None = None) -> None:
        self.settings = settings
        self.view = FleetView(settings.block_size, settings.view_settings())
        self.router = Router(self.view, settings.router_settings(), settings.scheduler_id)
        self.dispatcher = FairDispatcher(self.router, settings.quantum_tokens, settings.held_ahead)
        self.metrics = SchedulerMetrics(
            settings.policy,
            lambda: self.dispatcher.deferrals,
            lambda: len(self.dispatcher),
            lambda: self.dispatcher.moved,
        )
        self.metrics.registry.register(
            ConsumerCollector(
                "scheduler", lambda: [c.metrics if c else None for c in (self._state, self._requests)]
            )
        )
        self.now_ms = 0
        self.snapshot_loaded = False
        self._redis = redis_client
        self._producer: TypedProducer | None = None
        self._state: TypedConsumer | None = None
        self._requests: TypedConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._reply_topics: dict[str, str] = {}  # queued request → its reply topic
        self._seen_in_snapshot: dict[str, int] = {}  # worker → last_seen_ms in the snapshot
        # Assigned but not completed: re-decided if their worker is declared lost, so a worker that
        # vanishes mid-request loses no request (bounded: oldest dropped past max_tracked_inflight).
        self._assigned: dict[str, Assignment] = {}
        self._heartbeat: Heartbeat | None = None
        self._reports = ReportCheck.from_setting(settings.fleet_secret)
        self._silent: dict[str, int] = {}  # worker -> report_ms of the silence already acted on
        # Held requests survive a crash (held_requests.py): positions of undecided requests cap the
        # commit; while any is held, decisions are marked in Redis so a successor skips them.
        self._held = HeldPositions()
        self._marks = DecidedMarks(None)
        self._own_marks_client = False
        self._started_wall_ms = 0
        # Input positions for exact replay (schemas.messages.DecisionInputs): per "topic/partition" the
        # next offset not applied, where reading began, and what the previous decision recorded.
        self._applied: dict[str, int] = {}
        self._since: dict[str, int] = {}
        self._sent: dict[str, int] = {}
        self._batch = 0
        self._until_full = 0
        self._decided_at = (-1, 0, False)  # last batch: (wall ms, now_ms, already counted as stale)

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._task is not None

    async def start(self) -> None:
        if self._task is not None:
            return
        s = self.settings
        async with rolled_back_on_failure(self._close):
            if s.create_topics:
                await ensure_topics(s.kafka)
            self._producer = TypedProducer(s.kafka, s.scheduler_id)
            await self._producer.start()
            offsets = await self._cold_start()
            topics = [KV_EVENTS, LOAD, CONTROL] + ([REPLIES] if s.track_completions else [])
            # Every replica's assignments: what another replica just sent a worker is pending load
            # there in this replica's estimate too (otherwise each sees 1/N of the fleet's queue).
            topics += [ASSIGNMENTS] if s.share_load else []
            self._state = TypedConsumer(s.kafka, topics, None, from_beginning=True, dlq=self._producer)
            await self._state.start()
            # only Completions of requests decided from now on matter, and only assignments made from
            # now on are still pending (older ones decayed or completed)
            recent = {REPLIES.name} if s.track_completions else set()
            recent |= {ASSIGNMENTS.name} if s.share_load else set()
            if recent:
                ends = await self._state.end_offsets()
                offsets.update({tp: off for tp, off in ends.items() if tp[0] in recent})
            if offsets:
                await self._state.seek(offsets)
                # reading starts there: replies at their end, kv-events after the snapshot
                self._since.update({f"{t}/{p}": off for (t, p), off in offsets.items()})
            await self._catch_up()
            self._marks = DecidedMarks(self._marks_client())
            self._started_wall_ms = wall_ms()
            self._requests = TypedConsumer(
                s.kafka, [REQUESTS], GROUP_ID, from_beginning=True, dlq=self._producer
            )
            await self._requests.start()
        self._task = asyncio.create_task(self._loop(), name=f"scheduler-{s.scheduler_id}")
        self._heartbeat = Heartbeat(self._producer, "scheduler", s.scheduler_id)
        self._heartbeat.start()
        log.info(
            "scheduler %s started: policy %s, %d blocks, %d workers, snapshot %s",
            s.scheduler_id,
            s.policy,
            len(self.view.index),
            len(self.view.workers),
            "loaded" if self.snapshot_loaded else "not used",
        )

    @property
    def registry(self) -> CollectorRegistry:
        return self.metrics.registry

    async def stop(self) -> None:
        if self._heartbeat is not None:
            await self._heartbeat.stop()
            self._heartbeat = None
        task, self._task = self._task, None
        await stop_task(task)
        await self._close()

    async def __aenter__(self) -> SchedulerService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _marks_client(self) -> Any | None:
        if not self.settings.mark_decided:
            return None
        if self._redis is not None:
            return self._redis

        self._own_marks_client = True
        return self.settings.redis.connect()

    async def _close(self) -> None:
        if self._own_marks_client and self._marks.redis is not None:
            with contextlib.suppress(Exception):
                await self._marks.redis.aclose()
            self._marks = DecidedMarks(None)
            self._own_marks_client = False
        for name in ("_requests", "_state", "_producer"):
            part = getattr(self, name)
            setattr(self, name, None)
            if part is not None:
                with contextlib.suppress(Exception):
                    await part.stop()

    # -- cold start ------------------------------------------------------------------------------
    async def _cold_start(self) -> dict[tuple[str, int], int]:
        """Load the directory snapshot; return the kv-events offsets to resume at (empty: replay all)."""
        s = self.settings
        if not s.use_snapshot:
            return {}
        own = self._redis is None
        client = self._redis
        try:
            from services.fleet_directory.snapshot import read_snapshot

            if client is None:
                client = s.redis.connect()
            snap = await read_snapshot(client)
        except Exception as exc:
            log.warning("no directory snapshot (%s): replaying kv-events from the beginning", exc)
            return {}
        finally:
            if own and client is not None:
                with contextlib.suppress(Exception):
                    await client.aclose()
        parts = snap.offsets.get(KV_EVENTS.name, {})
        if not parts:
            return {}  # the manager has consumed nothing yet: nothing to skip
        self.view.load_snapshot(snap)
        self.snapshot_loaded = True
        for w, info in snap.workers.items():
            seen = info.get("last_seen_ms") if isinstance(info, dict) else None
            if isinstance(seen, int):
                self._seen_in_snapshot[w] = seen
        return {(KV_EVENTS.name, int(p)): int(off) for p, off in parts.items()}

    async def _catch_up(self) -> None:
        """Read the state topics up to the end offsets they had when we started (bounded in time)."""
        state = self._state
        assert state is not None
        ends = await state.end_offsets()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.catch_up_timeout_s
        while loop.time() < deadline:
            pos = await state.positions()
            if all(pos.get(tp, 0) >= end for tp, end in ends.items()):
                return
            for record in await state.getmany(timeout_ms=100):
                self._apply_state(record)
        log.warning(
            "state topics not caught up within %.1f s; starting anyway", self.settings.catch_up_timeout_s
        )

    # -- the loop --------------------------------------------------------------------------------
    async def _loop(self) -> None:
        assert self._state is not None and self._requests is not None
        poll = self.settings.poll_timeout_ms
        while True:
            try:
                records = await self._state.getmany(timeout_ms=0)
                for record in records:
                    self._apply_state(record)
                if self.view.resync_wanted:
                    await self._ask_resync()
                requests = await self._requests.getmany(timeout_ms=poll)
                skip = await self._decided_before(requests)
                for record in requests:
                    await self._on_request(record, skip)
                if self.settings.drain_state_before_decide and (requests or len(self.dispatcher)):
                    # state that arrived while we waited for requests: decide on it, not without it
                    late = await self._state.getmany(timeout_ms=0)
                    for record in late:
                        self._apply_state(record)
                    self.metrics.state_applied_before_decide.inc(len(late))
                    records = records or late
                if not records and not requests and len(self.dispatcher):
                    self.now_ms = max(self.now_ms, wall_ms())
                self._check_silent()
                t0 = time.perf_counter()  # measured, never read by a decision
                decisions = self.dispatcher.drain(self.now_ms)
                if decisions:
                    per = (time.perf_counter() - t0) / len(decisions)
                    for _ in decisions:
                        self.metrics.decision_seconds.observe(per)
                await self._publish(decisions)
                if requests or decisions:
                    await self._settle(decisions)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("scheduler loop iteration failed; continuing")
                await asyncio.sleep(0.2)

    def _check_silent(self) -> None:
        """Re-decide the in-flight requests of a worker silent past ``worker_timeout_ms`` (event
        time), from this replica's own view: it does not wait for the KV manager's WorkerLost, which
        may be down too. Once per silence (a report from the worker starts a new one)."""
        # over the workers, not the in-flight requests: this runs on every loop iteration
        timeout = self.view.settings.worker_timeout_ms
        for worker, ws in self.view.workers.items():
            if self.now_ms - ws.report_ms <= timeout or self._silent.get(worker) == ws.report_ms:
                continue
            self._silent[worker] = ws.report_ms
            log.warning("worker %s silent for %d ms", worker, self.now_ms - ws.report_ms)
            self._redispatch_from(worker)

    async def _ask_resync(self) -> None:
        """Workers whose KV events had a gap in our view: ask each to resync (ResyncRequest)."""
        assert self._producer is not None
        wanted, self.view.resync_wanted = sorted(set(self.view.resync_wanted)), []
        for worker in wanted:
            log.warning("gap in the KV events of %s: asking it to resync", worker)
            with contextlib.suppress(Exception):  # the KV manager asks too; the next gap asks again
                await self._producer.send(CONTROL, ResyncRequest(worker, self.settings.scheduler_id))

    def _advance(self, t: int) -> None:
        if t > self.now_ms:
            self.now_ms = t

    def _apply_state(self, record: Record) -> None:
        wall, now, counted = self._decided_at
        if record.timestamp_ms <= wall:
            lag = max(record.timestamp_ms - now, 0)
            self.metrics.view_lag.set(lag / 1e3)
            if not counted:
                self.metrics.stale_batches.inc()
                self._decided_at = (wall, now, True)
        key = f"{record.topic}/{record.partition}"
        self._since.setdefault(key, record.offset)
        self._applied[key] = record.offset + 1
        msg = record.message
        self.metrics.state_records.inc()
        if isinstance(msg, KvEvent):
            self._advance(msg.event_ms)
            self.view.apply(msg)
        elif isinstance(msg, LoadReport):
            if not self._reports.accept(msg):
                return  # forged or unsigned under a fleet secret: no worker is invented from it
            known = self.view.workers.get(msg.worker_id)
            before = known.report.started_ms if known is not None else None
            self.view.apply(msg)
            self._advance(msg.report_ms)
            if before is not None and msg.started_ms > before:
                # The worker restarted: what its previous instance held in flight is gone with it, and
                # the new instance skips every assignment decided for another instance
                # (Assignment.worker_epoch), so each of those is decided again here, once.
                self._redispatch_from(msg.worker_id, keep_epoch=msg.started_ms)
        elif isinstance(msg, WorkerLost):
            if self._seen_in_snapshot.get(msg.worker_id, -1) > msg.declared_ms:
                return  # the snapshot already holds what the worker stored after coming back
            known = self.view.workers.get(msg.worker_id)
            # Heard from after the last report the KV manager had (a manager that restarted, or read
            # late): that instance is alive and runs what was decided for it.
            alive = known.report.started_ms if known and known.report_ms > msg.last_seen_ms else None
            self.view.apply(msg)
            self._advance(msg.declared_ms)
            # A worker that reported after it was declared lost is back: likewise.
            back = self.view.workers.get(msg.worker_id)
            keep = alive if alive is not None else (back.report.started_ms if back else None)
            self._redispatch_from(msg.worker_id, keep_epoch=keep)
        elif isinstance(msg, Completion):
            self.view.apply(msg)
            self._assigned.pop(msg.request_id, None)
            self.metrics.completed(msg)
        elif isinstance(msg, Assignment):
            # another replica's decision (our own were noted when made): pending on its worker here too
            self.view.apply(msg, own_scheduler=self.settings.scheduler_id)

    def _redispatch_from(self, worker_id: str, keep_epoch: int | None = None) -> None:
        """Queue again every request assigned to a lost (or restarted) worker that never completed,
        except those decided for its instance ``keep_epoch`` (alive: it runs them)."""
        orphans = [
            a
            for a in self._assigned.values()
            if a.worker_id == worker_id and (keep_epoch is None or a.worker_epoch != keep_epoch)
        ]
        for a in orphans:
            del self._assigned[a.request.request_id]
            self._reply_topics[a.request.request_id] = a.request.reply_topic
            self.dispatcher.submit(a.request)
            self.metrics.redispatches.inc()
        if orphans:
            log.warning(
                "worker %s lost with %d requests in flight: re-deciding them", worker_id, len(orphans)
            )

    async def _decided_before(self, records: list[Record]) -> set[str]:
        """Requests read again after a replica's crash that it had decided (their marks exist).
        Only requests published before this replica started can be such."""
        old = [
            r.message.request_id
            for r in records
            if isinstance(r.message, ChatRequest) and r.message.arrival_ms < self._started_wall_ms
        ]
        return await self._marks.already_decided(old) if old else set()

    async def _settle(self, decisions: list[Decision]) -> None:
        """After a batch is published: forget what was decided, mark it while anything is still
        held, and commit up to the oldest held request."""
        assert self._requests is not None
        decided: list[tuple[str, int | None]] = []
        for d in decisions:
            req = d.assignment.request if d.assignment is not None else None
            rid = req.request_id if req is not None else (d.rejection.request_id if d.rejection else None)
            if rid is None:
                continue
            self._held.done(rid)
            decided.append((rid, req.deadline_ms if req is not None else None))
        if len(self._held):
            await self._marks.mark(decided, wall_ms())
        limits = {(REQUESTS, p): off for p, off in self._held.commit_limits().items()}
        await self._requests.commit(limits)

    async def _on_request(self, record: Record, skip: set[str] | frozenset[str] = frozenset()) -> None:
        msg = record.message
        self.metrics.requests.inc()
        if isinstance(msg, ChatRequest):
            if msg.request_id in skip:
                self.metrics.skipped_decided.inc()
                return
            if msg.request_id in self._held or msg.request_id in self._assigned:
                # a producer's retried publish whose first try landed too (the SDK retries on
                # retriable errors): the request is queued or running already
                self.metrics.duplicate_requests.inc()
                return
            self._held.read(msg.request_id, record.partition, record.offset)
            self._advance(msg.arrival_ms)
            self._reply_topics[msg.request_id] = msg.reply_topic
            self.dispatcher.submit(msg)
        elif isinstance(msg, CancelRequest):
            await self._on_cancel(msg)

    async def _on_cancel(self, msg: CancelRequest) -> None:
        producer = self._producer
        assert producer is not None
        queued = self.dispatcher.cancel(msg.request_id)
        if queued is not None:
            self.metrics.cancels.labels("queued").inc()
            self.metrics.decisions.labels(self.settings.policy, "cancelled").inc()
            self._held.done(msg.request_id)
            if len(self._held):
                await self._marks.mark([(msg.request_id, queued.deadline_ms)], wall_ms())
            done = Completion(
                msg.request_id, msg.session_id, "", "cancelled", len(queued.token_ids), 0, error=msg.reason
            )
            await producer.send(self._reply_spec(self._reply_topics.pop(msg.request_id, "")), done)
            return
        worker = self.view.inflight_worker(msg.request_id) or msg.worker_id
        if worker is None:
            log.info("cancel of unknown request %s dropped", msg.request_id)
            return
        self.metrics.cancels.labels("forwarded").inc()
        await producer.send(ASSIGNMENTS, msgspec.structs.replace(msg, worker_id=worker), key=worker)

    async def _publish(self, decisions: list[Decision]) -> None:
        if not decisions:
            return
        producer = self._producer
        assert producer is not None
        futures = []
        inputs = self._inputs() if any(d.assignment is not None for d in decisions) else None
        self._decided_at = (wall_ms(), self.now_ms, False)
        for d in decisions:
            if d.assignment is not None:
                own = inputs
                if own is not None and (d.held or d.pulled):
                    own = msgspec.structs.replace(own, held=d.held, pulled=d.pulled)
                a: Assignment = msgspec.structs.replace(d.assignment, inputs=own)
                if inputs is not None and inputs.applied:
                    # the batch's other decisions saw the same inputs: nothing moved since
                    inputs = msgspec.structs.replace(inputs, applied={}, since={}, full=False)
                self._reply_topics.pop(a.request.request_id, None)
                if self.settings.track_completions:
                    self._assigned[a.request.request_id] = a
                    while len(self._assigned) > MAX_TRACKED_INFLIGHT:
                        del self._assigned[next(iter(self._assigned))]
                futures.append(await producer.send(ASSIGNMENTS, a, wait=False))
                self.metrics.assigned(a)
            elif d.rejection is not None:
                c = d.rejection
                topic = self._reply_spec(self._reply_topics.pop(c.request_id, ""))
                futures.append(await producer.send(topic, c, wait=False))
                self.metrics.rejected(d.reason)
                log.info("rejected %s: %s", c.request_id, c.error)
        await asyncio.gather(*futures)

    def _inputs(self) -> DecisionInputs:
        """The positions this batch of decisions saw: the partitions that moved since the previous
        decision, or all of them (with where reading began) on the first and every FULL_EVERY-th."""
        self._batch += 1
        if self._until_full <= 0:
            self._until_full = DecisionInputs.FULL_EVERY
            self._sent = dict(self._applied)
            return DecisionInputs(self.now_ms, dict(self._applied), dict(self._since), True, self._batch)
        self._until_full -= 1
        moved = {k: v for k, v in self._applied.items() if self._sent.get(k) != v}
        self._sent.update(moved)
        return DecisionInputs(self.now_ms, moved, {}, False, self._batch)

    @staticmethod
    def _reply_spec(name: str) -> TopicSpec:
        if not name:
            return REPLIES
        spec = BY_NAME.get(name)
        if spec is not None:
            return spec
        # an intake with its own reply topic: same shape as the shared one
        return dataclasses.replace(REPLIES, name=name)
