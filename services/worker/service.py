"""The worker process: Kafka in, tokens out, KV blocks served to and fetched from peers.

Owns one engine behind :class:`~services.worker.engine_api.WorkerEngine` (the built-in torch engine or
vLLM, per ``KVMESH_WORKER_ENGINE``), one block server (the data plane, for peers) and one block client
(to fetch) when the engine moves KV bytes, a producer, two consumers of its own
(assignments and control commands) and one fleet-state consumer (every worker's kv-events and every
WorkerLost, no group, from the end) that keeps :class:`~services.worker.fleet_view.FleetCopies`, the
count of other workers' copies per block that eviction reads (a last copy is demoted, not dropped).
Threads: the engine steps in a worker thread via ``asyncio.to_thread`` so that the event loop keeps
serving peers and Kafka; only the engine loop task touches the engine's request state, so new
assignments and cancels are queued for it.

Per assignment::

    deadline passed? ── yes ─▶ Completion(rejected)
        │ no
    fetch planned blocks from peers (verified blocks only enter the pool; anything missing is
        │                             recomputed and counted as a fallback)
    engine.add_request ── rejected (too long, …) ─▶ Completion(error)
        │
    continuous batching: TokenChunk per step, Completion with reused / fetched / recomputed + TTFT
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import CollectorRegistry

from kvmesh_core.costmodel import fetch_beats_recompute
from kvmesh_core.fetching import PullsInFlight
from kvmesh_core.runtime import rolled_back_on_failure
from kvmesh_core.text_stream import TextStream
from schemas.messages import (
    Assignment,
    CancelRequest,
    ChatRequest,
    DrainCommand,
    KvEvent,
    ReplicateCommand,
    ResyncRequest,
    RetainHint,
    TierUsage,
    TokenChunk,
    WorkerLost,
)
from schemas.report_signing import sign as sign_report
from schemas.token_ids import int_list
from services.worker.config import WorkerSettings
from services.worker.engine_api import EngineRequest, RequestRejected, StepOutput, WorkerEngine
from services.worker.fetch_planning import fetch_planned, replicate
from services.worker.fleet_view import FleetCopies
from services.worker.metrics import WorkerMetrics
from services.worker.reports import RunningRequest, WorkerIdentity, build_completion, build_load_report
from streams import topics
from streams.clock import now_ms
from streams.consumer import Record, TypedConsumer
from streams.consumer_metrics import ConsumerCollector
from streams.producer import TypedProducer, partition_for
from streams.tasks import stop_tasks

if TYPE_CHECKING:
    from kvmesh_core.costmodel import PerfProfile
    from services.worker.kv_layout import BlockSink
    from services.worker.transfer import BlockClient, BlockServer

#: How many admitted request ids a worker remembers to refuse a second Assignment of the same id
#: (far more than requests can arrive within any deadline).
ADMITTED_IDS_KEPT = 100_000

log = logging.getLogger("kvmesh.worker")


@functools.lru_cache(maxsize=64)
def _reply_spec(reply_topic: str) -> topics.TopicSpec:
    """The reply topic a request names: the catalog's, or another intake's with the same shape."""
    if reply_topic == topics.REPLIES.name:
        return topics.REPLIES
    return dataclasses.replace(topics.REPLIES, name=reply_topic)


class WorkerService:
    """One worker of the fleet. ``start()``/``stop()`` are safe to call twice; ``async with`` works."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id
        # Built in start() (the engine loads a model, off the constructor's path); None until then.
        self.engine: WorkerEngine = None  # type: ignore[assignment]  # set in start(), used only after it
        self._profile: PerfProfile | None = None
        self._producer: TypedProducer = None  # type: ignore[assignment]  # likewise
        self._assignments: TypedConsumer | None = None
        self._control: TypedConsumer | None = None
        self._fleet_state: TypedConsumer | None = None
        self.fleet = FleetCopies(self.worker_id, settings.fleet_view_max_entries)
        # One publisher of KV events at a time, each draining under it: the fleet then sees this
        # worker's events in the order they happened (a re-announce cannot overtake a removal).
        self._kv_publish = asyncio.Lock()
        self._server: BlockServer | None = None
        self._client: BlockClient | None = None
        self.transfer_address = ""
        self._tasks: list[asyncio.Task[None]] = []
        self._inbox: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        self._running: dict[str, RunningRequest] = {}
        # Taken on but not yet in the engine (waiting to be admitted, pulling, or in the inbox), by
        # request id. Admission runs in its own task, one assignment at a time as before, so the
        # assignment reader stays free: a CancelRequest for one of these (or one queued behind a pull)
        # is answered at once rather than after the pull, and a stop fails them instead of losing them.
        self._pending: dict[str, RunningRequest] = {}
        self._admissions: asyncio.Queue[Assignment] = asyncio.Queue()
        # Overlap admission: pulls of requests already in the engine's queue, one at a time on the link
        self._pulls: asyncio.Queue[tuple[Assignment, RunningRequest, BlockSink]] = asyncio.Queue()
        # the blocks those pulls bring (planned), by the request whose pull carries them
        self._pulling: PullsInFlight[RunningRequest] = PullsInFlight()
        # Request ids this worker has taken on (running or done), newest last: an Assignment for one
        # of them (decided again after a rebalance, or by a second replica) is not run twice.
        self._admitted: OrderedDict[str, None] = OrderedDict()
        self._kv_resync = False  # KV events were lost: the next publish sends a full snapshot
        self._kv_seq = 0  # KV events published by this instance (KvEvent.seq)
        self._ident: WorkerIdentity | None = None
        self._started = False
        self._stopping = False
        self._draining = False
        self._last_load: tuple[int, int, int] | None = None
        self._started_ms = 0
        self._keyed_counts = (0, 0)  # partitions of assignments and control the consumers follow
        self._keyed_parts: dict[str, set[int]] = {}  # every partition this worker's key mapped to
        from services.worker.transfer import TransferMetrics

        self.transfer_metrics = TransferMetrics()
        self._tiers: list[TierUsage] = []  # as of the last LoadReport, for /metrics
        self._pulls_open = 0  # requests whose pull has not ended (queued for the link or on it)
        self.metrics = WorkerMetrics(
            self.transfer_metrics, lambda: self._tiers, lambda: len(self._running), lambda: self._pulls_open
        )
        self.metrics.registry.register(
            ConsumerCollector(
                "worker",
                lambda: [
                    c.metrics if c else None for c in (self._assignments, self._control, self._fleet_state)
                ],
            )
        )

    # ----------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> WorkerService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        from services.worker.engines import build_engine
        from services.worker.transfer import BlockClient, BlockServer

        s = self.settings
        try:
            self.engine = await asyncio.to_thread(build_engine, s)
        except BaseException:
            self._started = False
            raise
        async with rolled_back_on_failure(self.stop):
            await self._start_parts(BlockClient, BlockServer)

    async def _start_parts(self, client_cls: type[BlockClient], server_cls: type[BlockServer]) -> None:
        """Everything after the engine; a failure rolls back what started (see start)."""
        s = self.settings
        if s.calibrate:
            self._profile = await asyncio.to_thread(self.engine.calibrate)
        source = self.engine.block_source()
        if source is not None:
            self._server = server_cls(
                source,
                host=s.transfer_host,
                port=s.transfer_port,
                secret=s.secret_bytes(),
                max_blocks=s.max_blocks_per_fetch,
                metrics=self.transfer_metrics,
            )
            self.transfer_address = await self._server.start()
        if s.calibrate and self._profile is not None and self._server is not None:
            # The engine measures compute; the data plane measures the link this host really has.
            with contextlib.suppress(Exception):
                link = await self._server.measure_self(probe_bytes=8 << 20, rounds=2)
                self._profile = dataclasses.replace(
                    self._profile, link_gbps=link.link_gbps, link_latency_ms=link.latency_ms
                )
        if self.engine.block_sink() is not None:
            self._client = client_cls(
                s.secret_bytes(), timeout_s=s.fetch_timeout_s, metrics=self.transfer_metrics
            )
        self._started_ms = now_ms()
        self._ident = WorkerIdentity(
            worker_id=self.worker_id,
            model=s.served_model,
            engine=self.engine.kind,
            block_size=self.engine.block_size,
            block_bytes=self.engine.block_bytes,
            max_context=self.engine.max_context,
            transfer_address=self.transfer_address,
            peer_transfer=self._server is not None and self._client is not None,
            started_ms=self._started_ms,
            features=tuple(self.engine.features),
            prefill_chunk_tokens=self.engine.prefill_chunk_tokens,
        )

        self._producer = TypedProducer(s.kafka, producer_id=self.worker_id)
        await self._producer.start()
        await self._open_keyed_consumers(await self._keyed_counts_now())
        # Other workers' copies: read from the end (what was stored before we started is unknown,
        # which only makes eviction keep more than it must), no group, nothing committed.
        self._fleet_state = TypedConsumer(
            s.kafka, [topics.KV_EVENTS, topics.CONTROL], group_id=None, from_beginning=False
        )
        await self._fleet_state.start()
        self.engine.set_fleet_copies(self.fleet.copies)
        # Announce ourselves (and our measured speed) before any assignment can arrive.
        await self._publish_load(force=True)
        await self._publish_kv_events()
        self._tasks = [
            *self._keyed_tasks(),
            asyncio.create_task(self._fleet_state.run(self._on_fleet_record), name="worker-fleet-state"),
            asyncio.create_task(self._admission_loop(), name="worker-admission"),
            asyncio.create_task(self._pull_loop(), name="worker-pulls"),
            asyncio.create_task(self._engine_loop(), name="worker-engine"),
            asyncio.create_task(self._load_loop(), name="worker-load"),
        ]
        log.info(
            "worker %s up: %s; transfer %s",
            self.worker_id,
            self.engine.describe(),
            self.transfer_address or "off",
        )

    async def _keyed_counts_now(self) -> tuple[int, int]:
        """Partitions of the assignments and control topics on the broker now."""
        assert self._producer is not None
        return (
            await self._producer.partition_count(topics.ASSIGNMENTS),
            await self._producer.partition_count(topics.CONTROL),
        )

    async def _open_keyed_consumers(self, counts: tuple[int, int]) -> None:
        """Consumers of this worker's partition of the assignments and control topics, hashed over
        the broker's actual partition ``counts`` (the producers hash keys over them; deployments set
        them per fleet size). Every partition the worker's key ever mapped to stays assigned, so
        records sent before partitions were added are still read; the key filter skips other
        workers'."""
        self._keyed_counts = counts

        def keyed(spec: topics.TopicSpec, n: int, group: str) -> TypedConsumer:
            parts = self._keyed_parts.setdefault(spec.name, set())
            parts.add(partition_for(spec, self.worker_id, n))
            return TypedConsumer(
                self.settings.kafka,
                [spec],
                group_id=group,
                assign=[(spec, p) for p in sorted(parts)],
                key_filter=self.worker_id,
                dlq=self._producer,
            )

        self._assignments = keyed(topics.ASSIGNMENTS, counts[0], f"kvmesh-worker-{self.worker_id}")
        self._control = keyed(topics.CONTROL, counts[1], f"kvmesh-worker-{self.worker_id}-control")
        await self._assignments.start()
        await self._control.start()

    def _keyed_tasks(self) -> list[asyncio.Task[None]]:
        assert self._assignments is not None and self._control is not None
        return [
            asyncio.create_task(self._assignments.run(self._on_assignment_record), name="worker-assignments"),
            asyncio.create_task(self._control.run(self._on_control_record), name="worker-control"),
        ]

    async def _follow_partition_changes(self) -> None:
        """Partitions added to the assignments or control topic move this worker's key: read the new
        partition too (from the load loop, so a fleet can grow its topics under running workers)."""
        if self._producer is None:
            return
        counts = await self._keyed_counts_now()
        if counts == self._keyed_counts:
            return
        log.warning(
            "worker %s: partitions of assignments/control went from %s to %s; following its key",
            self.worker_id,
            self._keyed_counts,
            counts,
        )
        keyed = [t for t in self._tasks if t.get_name() in ("worker-assignments", "worker-control")]
        await stop_tasks(keyed, swallow_errors=True)
        for c in (self._assignments, self._control):
            if c is not None:
                with contextlib.suppress(Exception):
                    await c.stop()
        await self._open_keyed_consumers(counts)
        self._tasks = [t for t in self._tasks if t not in keyed] + self._keyed_tasks()

    @property
    def registry(self) -> CollectorRegistry:
        return self.metrics.registry

    async def stop(self) -> None:
        if not self._started or self._stopping:
            return
        self._stopping = True
        await stop_tasks(self._tasks, swallow_errors=True)
        # Requests still running or not yet started get an error completion so no caller waits forever.
        for rid in [*self._running, *self._pending]:
            await self._finish_error(rid, "worker shutting down")
        self._admissions = asyncio.Queue()
        self._pulls = asyncio.Queue()
        self._pulling = PullsInFlight()
        self._pulls_open = 0
        if self.engine is not None and self._producer is not None:
            # Graceful shutdown: tell the fleet our blocks are gone (bounded: if the broker is already
            # gone, the KV manager's liveness check drops our blocks instead).
            async def farewell() -> None:
                for ev in self.engine.release_all():
                    await self._send_kv(ev)
                await self._publish_load(force=True, draining=True)

            with contextlib.suppress(Exception):
                async with asyncio.timeout(3.0):
                    await farewell()
        for c in (self._assignments, self._control, self._fleet_state):
            if c is not None:
                with contextlib.suppress(Exception):
                    await c.stop()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.stop()
        if self._producer is not None:
            with contextlib.suppress(Exception):
                await self._producer.stop()
        # Restartable: a later start() builds every part again.
        self._assignments = self._control = self._fleet_state = None
        self._server = None
        self._client = None
        self._tasks = []
        self._started = False
        self._stopping = False
        log.info("worker %s stopped", self.worker_id)

    async def run_forever(self) -> None:
        await self.start()
        try:
            while True:
                await asyncio.sleep(3600)
        finally:
            await self.stop()

    # ----------------------------------------------------------------- inputs
    async def _on_assignment_record(self, record: Record) -> None:
        msg = record.message
        if isinstance(msg, Assignment):
            if msg.worker_id != self.worker_id:
                return
            rid = msg.request.request_id
            if msg.worker_epoch and msg.worker_epoch != self._started_ms:
                # Decided for this worker's previous instance (before a restart): the scheduler decides
                # it again (it sees the new instance, or the old one declared lost); running it here
                # too would run it twice.
                self.metrics.assignments.labels("stale").inc()
                log.info("request %s was decided for a previous instance of this worker; skipping it", rid)
                return
            if rid in self._admitted:
                self.metrics.assignments.labels("duplicate").inc()
                log.info("request %s was already assigned here; not running it twice", rid)
                return
            self._admitted[rid] = None
            if len(self._admitted) > ADMITTED_IDS_KEPT:
                self._admitted.popitem(last=False)
            self.metrics.assignments.labels("accepted").inc()
            self._pending[rid] = RunningRequest(
                request=msg.request,
                started=time.perf_counter(),
                expected_blocks=msg.reuse_blocks,
                expected_prefill_tokens=msg.prefill_tokens,
            )
            self._admissions.put_nowait(msg)
        elif isinstance(msg, CancelRequest):
            entry = self._pending.pop(msg.request_id, None)
            if entry is not None:
                # Not in the engine yet: answer now; admission skips it (a pull in flight still lands:
                # its blocks are good cache, and aborting it half-way gains nothing).
                self.metrics.requests.labels("cancelled").inc()
                await self._send_completion(entry.request, finish_reason="cancelled", entry=entry)
            else:
                await self._inbox.put(("cancel", msg))

    async def _on_control_record(self, record: Record) -> None:
        msg = record.message
        if isinstance(msg, ReplicateCommand) and msg.target_worker == self.worker_id:
            await self._replicate(msg)
        elif isinstance(msg, RetainHint) and msg.worker_id == self.worker_id:
            self.engine.retain(list(msg.block_hashes), msg.until_ms)
        elif isinstance(msg, DrainCommand) and msg.worker_id == self.worker_id:
            # Draining: the scheduler stops sending new work, peers keep fetching our blocks.
            self._draining = msg.drain
            log.info(
                "worker %s %s (%s)", self.worker_id, "draining" if msg.drain else "undrained", msg.reason
            )
            await self._publish_load(force=True)
        elif isinstance(msg, ResyncRequest) and msg.worker_id == self.worker_id and not self._stopping:
            # A consumer missed some of our KV events: replace what the fleet knows of us.
            log.info("worker %s resyncing its KV holdings (asked by %s)", self.worker_id, msg.requested_by)
            self._kv_resync = True
            await self._publish_kv_events()
        elif isinstance(msg, WorkerLost) and msg.worker_id == self.worker_id and not self._stopping:
            # We were declared lost (a long pause): re-announce everything we still hold.
            await self._reannounce()

    async def _on_fleet_record(self, record: Record) -> None:
        msg = record.message
        if isinstance(msg, KvEvent):
            self.fleet.apply(msg, record.envelope.event_ms)
        elif isinstance(msg, WorkerLost) and msg.worker_id != self.worker_id:
            # The fleet forgot that worker's blocks; so do we (it re-announces them if it is alive).
            self.fleet.worker_lost(msg.worker_id, msg.declared_ms)

    async def _admission_loop(self) -> None:
        """Admit assignments in arrival order. Under ``serial`` each waits for its own pull, and one that
        arrives during a pull waits for it too; under ``overlap`` (the default) a pulling request is
        queued in the engine at once and passed over until its blocks land, and its pull goes to
        :meth:`_pull_loop`. The simulator prices both rules (``kvmesh.sim.worker``, ``admission``)."""
        while True:
            a = await self._admissions.get()
            entry = self._pending.get(a.request.request_id)
            if entry is None:  # cancelled (and answered) while it waited
                continue
            try:
                await self._admit(a, entry)
            except Exception as e:  # one bad admission must not stall every request queued behind it
                log.exception("request %s: admission failed", a.request.request_id)
                await self._finish_error(a.request.request_id, f"admission failed: {e}")

    async def _admit(self, a: Assignment, entry: RunningRequest) -> None:
        req = a.request
        if req.deadline_ms is not None and now_ms() > req.deadline_ms:
            self._pending.pop(req.request_id, None)
            self.metrics.requests.labels("rejected").inc()
            await self._send_completion(req, finish_reason="rejected", error="deadline passed before start")
            return
        # Fetch planned blocks before prefill, but only those that extend what we already have:
        # a chained block is useless after a gap.
        sink = self.engine.block_sink()
        if a.fetch and self._client is not None and sink is not None:
            self._pulls_open += 1
            if self.settings.admission == "overlap":
                entry.kv_pending = True
                for plan in a.fetch:
                    self._pulling.add(plan.block_hashes, entry)
                await self._inbox.put(("add", entry))  # before the pull's ("kv", id): the inbox is FIFO
                self._pulls.put_nowait((a, entry, sink))
                return
            try:
                await self._pull(a, entry, sink)
            finally:
                self._pulls_open -= 1
        elif a.fetch:
            entry.fallback = f"engine {self.engine.kind} takes no peer blocks; recomputing"
        elif self._pulling:
            self._wait_for_pull(entry)
        await self._inbox.put(("add", entry))

    def _wait_for_pull(self, entry: RunningRequest) -> None:
        """Overlap admission: when the next blocks of ``entry``'s prompt are on the link for a request
        queued before it (the scheduler counted them as here when it chose this worker), it waits in
        the engine's queue for that pull as the puller does, rather than start at once and compute
        them again. A hot prompt being replicated here then costs one pull, not a pull and a prefill
        of it per request that arrives meanwhile (README, "Traces it was not tuned on")."""
        hashes = int_list(entry.request.block_hashes)
        puller = self._pulling.carrier(hashes, self.engine.lookup_prefix(hashes))
        if puller is not None and puller.kv_pending:
            entry.kv_pending = True
            puller.waiters.append(entry)

    async def _pull(self, a: Assignment, entry: RunningRequest, sink: BlockSink) -> None:
        assert self._client is not None  # checked by _admit
        got = await fetch_planned(
            a, entry, self._client, sink, self.engine.lookup_prefix, self.worker_id, self._worth_fetching
        )
        self.metrics.fetched_blocks.inc(got.fetched_blocks)
        self.metrics.fetches_declined += got.declined

    async def _pull_loop(self) -> None:
        """Overlap admission's pulls, in arrival order, one at a time (the link is one; the scheduler
        prices each pull behind those it planned before). Whatever happens to a pull, the engine is
        told it ended: the request then starts with the blocks that landed and recomputes the rest."""
        while True:
            a, entry, sink = await self._pulls.get()
            rid = a.request.request_id
            try:
                if rid in self._pending or rid in self._running:  # not cancelled meanwhile
                    await self._pull(a, entry, sink)
            except Exception as e:  # the request still runs: a failed pull means recomputing
                log.exception("request %s: pull failed", rid)
                entry.fallback = f"pull failed ({e}); recomputing"
            finally:
                self._pulls_open -= 1
                entry.kv_pending = False
                await self._inbox.put(("kv", entry))
                for plan in a.fetch:
                    self._pulling.remove(plan.block_hashes, entry)
                # those waiting for its blocks start with what landed and recompute the rest
                waiters, entry.waiters = entry.waiters, []
                for waiter in waiters:
                    waiter.kv_pending = False
                    await self._inbox.put(("kv", waiter))

    def _worth_fetching(self, n_blocks: int, cached_tokens: int) -> bool:
        """The shared cost model with this worker's measured figures (no profile yet: trust the plan)."""
        if self._profile is None:
            return True
        return fetch_beats_recompute(self._profile, n_blocks, cached_tokens)

    async def _replicate(self, cmd: ReplicateCommand) -> None:
        sink = self.engine.block_sink()
        if self._client is None or sink is None:
            log.info(
                "replication %s ignored: engine %s takes no peer blocks", cmd.command_id, self.engine.kind
            )
            return
        got = await replicate(cmd, self._client, sink, self.engine.lookup_prefix, self.worker_id)
        if got is None:
            return
        self.metrics.replications.inc()
        await self._publish_kv_events()

    # ----------------------------------------------------------------- engine loop
    async def _engine_loop(self) -> None:
        while True:
            # Apply queued adds/cancels between steps: only this task touches engine request state.
            while not self._inbox.empty() or not self.engine.has_work():
                kind, item = await self._inbox.get()
                if kind == "add":
                    entry = item
                    assert isinstance(entry, RunningRequest)
                    req = entry.request
                    if self._pending.pop(req.request_id, None) is None:
                        continue  # cancelled after its pull, and already answered
                    try:
                        self.engine.add_request(
                            EngineRequest(
                                request_id=req.request_id,
                                session_id=req.session_id,
                                token_ids=req.token_ids,
                                block_hashes=int_list(req.block_hashes),
                                namespace=req.namespace,
                                max_tokens=req.max_tokens,
                                sampling=req.sampling,
                                stop_token_ids=req.stop_token_ids,
                                public_prefix_tokens=req.public_prefix_tokens,
                                expected_reuse_blocks=entry.expected_blocks,
                                block_size=req.block_size,
                                kv_pending=entry.kv_pending,
                                expected_prefill_tokens=entry.expected_prefill_tokens,
                            )
                        )
                    except RequestRejected as exc:
                        self.metrics.requests.labels("error").inc()
                        await self._send_completion(req, finish_reason="error", error=str(exc))
                        continue
                    if req.sampling.stop:
                        entry.stops = TextStream(
                            self.engine.tokenizer, req.sampling.stop, req.sampling.min_tokens
                        )
                    self._running[req.request_id] = entry
                elif kind == "kv":
                    assert isinstance(item, RunningRequest)
                    self.engine.kv_arrived(item.request.request_id, item.expected_blocks)
                elif kind == "cancel":
                    assert isinstance(item, CancelRequest)
                    # The next step reports the request as finished with reason "cancelled"; that
                    # output sends the one Completion.
                    if item.request_id in self._running and self.engine.abort(item.request_id):
                        self.metrics.requests.labels("cancelled").inc()
            outputs = await asyncio.to_thread(self.engine.step)
            for out in outputs:
                await self._handle_output(out)
            await self._publish_kv_events()
            await self._publish_load()

    async def _handle_output(self, out: StepOutput) -> None:
        entry = self._running.get(out.request_id)
        if entry is None:
            return
        req = entry.request
        if out.first_token and entry.first_token_ms is None:
            entry.first_token_ms = (time.perf_counter() - entry.started) * 1e3
        if out.stats is not None:
            entry.stats = out.stats
        new = list(out.new_token_ids)
        logprobs = list(out.logprobs or [])
        finished, reason = out.finished, out.finish_reason
        if new and entry.stops is not None:
            entry.stops.push(new)
            if entry.stops.stopped_at is not None:
                # A stop string ended the output: the tokens up to the one that completed it are the
                # output (their text is cut at the match), and the engine stops decoding for nobody.
                keep = entry.stops.stopped_at - len(entry.output)
                new, logprobs = new[:keep], logprobs[:keep]
                if not finished:
                    self.engine.abort(req.request_id)
                finished, reason = True, "stop"
        if new:
            index = len(entry.output)
            entry.output.extend(new)
            text = self.engine.tokenizer.decode(new)
            await self._producer.send(
                _reply_spec(req.reply_topic),
                TokenChunk(
                    request_id=req.request_id,
                    worker_id=self.worker_id,
                    index=index,
                    token_ids=new,
                    text=text,
                    logprobs=logprobs,
                ),
            )
        if finished:
            self._running.pop(req.request_id, None)
            reason = reason or "stop"
            if reason == "error":
                self.metrics.requests.labels("error").inc()
            else:
                self.metrics.requests.labels("completed").inc()
            await self._send_completion(
                req, finish_reason=reason, entry=entry, error=getattr(out, "error", None)
            )

    # ----------------------------------------------------------------- outputs
    async def _send_completion(
        self,
        req: ChatRequest,
        *,
        finish_reason: str,
        entry: RunningRequest | None = None,
        error: str | None = None,
    ) -> None:
        c, fell_back = build_completion(
            req, self.worker_id, finish_reason, entry, error, self.engine.tokenizer if self.engine else None
        )
        if fell_back:
            self.metrics.completion_fallbacks.inc()
        stats = entry.stats if entry is not None else None
        self.metrics.observe_completion(c, req.block_size, stats.promoted_blocks if stats is not None else 0)
        assert self._producer is not None
        await self._producer.send(_reply_spec(req.reply_topic), c)

    async def _finish_error(self, request_id: str, error: str) -> None:
        entry = self._running.pop(request_id, None) or self._pending.pop(request_id, None)
        if entry is not None and self._producer is not None:
            with contextlib.suppress(Exception):
                await self._send_completion(entry.request, finish_reason="error", entry=entry, error=error)

    async def _publish_kv_events(self) -> None:
        if self.engine is None or self._producer is None:
            return
        async with self._kv_publish:
            if self._kv_resync:
                try:
                    await self._resync_locked()
                except Exception as exc:  # still away: the flag stays, the next publish retries
                    log.warning("worker %s could not resync its KV holdings yet: %s", self.worker_id, exc)
                return
            events = self.engine.drain_kv_events()
            try:
                # Queued together, they leave in one batch per partition (one record batch on the
                # broker, not one per event), in order; then every one is confirmed.
                acks = [await self._send_kv(ev, wait=False) for ev in events]
                for ack in acks:
                    await ack
            except Exception as exc:
                # Some of these events are lost (the broker was away): the fleet's view of this
                # worker has a gap. The next publish replaces it whole (cleared + holdings).
                self._kv_resync = True
                self.metrics.kv_event_gaps.inc()
                log.warning(
                    "worker %s may have lost up to %d KV events (%s); resyncing the fleet's view of it",
                    self.worker_id,
                    len(events),
                    exc,
                )
                return  # callers (the engine loop among them) go on; the resync repairs it

    async def _send_kv(self, ev: KvEvent, wait: bool = True) -> Any:
        """Publish one KV event, numbered (seq within this instance's epoch) so that consumers can
        tell a gap; a number lost with a failed send is such a gap, and they ask for a resync.
        ``wait=False``: return once queued, with the awaitable of its acknowledgement."""
        assert self._producer is not None
        self._kv_seq += 1
        self.metrics.observe_kv_event(ev)
        return await self._producer.send(
            topics.KV_EVENTS, msgspec.structs.replace(ev, seq=self._kv_seq, epoch=self._started_ms), wait=wait
        )

    def _holdings_chunk(self) -> int:
        """Blocks per snapshot event: a stored record is ~18 bytes per block; stay well inside the
        record size limit."""
        return max(64, min(4096, self.settings.kafka.max_record_bytes // 64))

    async def _resync_locked(self) -> None:
        """Publish ``cleared`` then everything held (caller holds ``_kv_publish``): what the fleet
        knew of this worker is replaced, so events lost in a gap leave nothing wrong behind."""
        assert self._producer is not None
        self.engine.drain_kv_events()  # superseded by the snapshot below
        cleared = KvEvent(self.worker_id, "cleared", "gpu", [], event_ms=now_ms())
        await self._send_kv(cleared)
        for ev in self.engine.holdings_events(self._holdings_chunk()):
            await self._send_kv(ev)
        self._kv_resync = False
        log.info("worker %s resynced its KV holdings with the fleet", self.worker_id)

    async def _reannounce(self) -> None:
        """Publish everything still held as stored events (the KV manager dropped our blocks)."""
        if self._producer is None:
            return
        async with self._kv_publish:
            # Pending events first, then the snapshot; later changes follow in later drains.
            events = self.engine.drain_kv_events() + self.engine.holdings_events(self._holdings_chunk())
            for ev in events:
                await self._send_kv(ev)
        n = sum(len(ev.block_hashes) for ev in events if ev.kind == "stored")
        self.metrics.reannounced_blocks.inc(n)
        log.warning("worker %s was declared lost while alive: re-announced %d blocks", self.worker_id, n)

    async def _load_loop(self) -> None:
        interval = self.settings.load_interval_ms / 1e3
        while True:
            await asyncio.sleep(interval)
            # Retain hints carry absolute deadlines; the worker's own clock retires them.
            self.engine.expire_retains(now_ms())
            try:
                await self._publish_kv_events()
                await self._publish_load(force=True)
                await self._follow_partition_changes()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # The broker is away: keep beating; a heartbeat that dies here never comes back.
                log.warning("worker %s could not publish load/events: %s", self.worker_id, exc)

    async def _publish_load(self, force: bool = False, draining: bool = False) -> None:
        if self.engine is None or self._producer is None:
            return
        load = self.engine.load()
        self._tiers = load.tiers
        self.metrics.decode_step.set(load.recent_decode_ms_per_step / 1e3)
        self.metrics.slot_wait_steps.set(load.slot_wait_steps)
        if load.kv_free_blocks is not None:
            self.metrics.kv_free_blocks.set(load.kv_free_blocks)
        key = (load.queue_depth, load.active_requests, load.active_tokens // 256)
        # Between intervals, report only large changes (a new request queued, one finished).
        if not force and key == self._last_load:
            return
        self._last_load = key
        if self._ident is None:
            return
        report = build_load_report(self._ident, load, self._profile, now_ms(), draining or self._draining)
        secret = self.settings.fleet_secret
        if secret is not None and secret.get_secret_value():
            # signed, so that nobody else who can write to Kafka passes for a worker
            report = sign_report(report, secret.get_secret_value().encode())
        await self._producer.send(topics.LOAD, report)
