"""The fleet simulation: N simulated workers, the live FleetView + Router, and the lagged flow between them.

Message flow (the same as live, minus Kafka)::

    ChatRequest --decide(req, now)--> Router --Assignment (no lag)--> SimWorker
        ^                                                               |
        |               FleetView <--- KvEvent / LoadReport / Completion -+  (each delivered lag_ms later)

The router is the scheduler's own code (``services.scheduler.router.Router`` over
``services.scheduler.view.FleetView``), called with ``now_ms`` = the simulated time of the decision,
which for a first attempt is the request's ``arrival_ms`` -- what the live scheduler passes. Requests go
through the live scheduler's FairDispatcher: when the fleet holds (the head request is deferred) the
held requests wait in it and one retry tick every ``retry_ms`` drains it again, as the live loop does
(so an overloaded run costs one decision per tick, not one per held request per tick); a rejected
request is counted and dropped.

The engine runs at the *truth* (:mod:`kvmesh.sim.truth`): the published profile times the truth's
factors. Workers publish the profile, so policies never see the truth except through what they observe.

Workers report after every iteration and, when quiet, every ``heartbeat_ms``: by default the live
worker's load interval (``kvmesh_core.load_reports``), so the view follows a long prefill's progress
as it does live, and keeps them live. The view is built only from delivered messages, so it lags
the truth by ``lag_ms``; a decision naming blocks a worker no longer holds falls back to recompute
inside the worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.sim.cache import FleetHolders
from kvmesh.sim.errors import SimError
from kvmesh.sim.events import EventQueue
from kvmesh.sim.metrics import RequestRecord, summarize
from kvmesh.sim.oracle import ORACLE, oracle_policy
from kvmesh.sim.truth import TruthScale
from kvmesh.sim.worker import Admission, Job, Load, SimWorker
from kvmesh_core.costmodel import PerfProfile
from kvmesh_core.load_reports import LOAD_INTERVAL_MS
from schemas.messages import ChatRequest, Completion, KvEvent, LoadReport, WorkerLost
from services.scheduler.fairness import FairDispatcher
from services.scheduler.router import POLICIES, Router, RouterSettings
from services.scheduler.view import FleetView, ViewSettings
from services.scheduler.virtual_clock import AHEAD
from streams.topics import ASSIGNMENTS, CONTROL, KV_EVENTS, LOAD, REPLIES, REQUESTS, TopicSpec

log = logging.getLogger(__name__)

#: What a simulation runs: every policy of the scheduler's registry, and the perfect-information
#: reference (kvmesh.sim.oracle), which only a simulator can run.
SIM_POLICIES: tuple[str, ...] = (*POLICIES, ORACLE)

_ARRIVE, _RETRY, _WORKER, _DELIVER, _HEARTBEAT = range(5)

#: The topic each delivered message travels on live (for a Tap).
_TOPIC_OF: dict[type, TopicSpec] = {
    KvEvent: KV_EVENTS,
    LoadReport: LOAD,
    Completion: REPLIES,
    WorkerLost: CONTROL,
}

#: Sees every message the scheduler sees or sends, in order: (topic, message, simulated ms).
Tap = Callable[[TopicSpec, object, float], None]


def profile_for_block_size(profile: PerfProfile, block_size: int) -> PerfProfile:
    """``profile`` addressed in ``block_size``-token blocks (capacities kept in tokens, see
    :meth:`PerfProfile.with_block_size`)."""
    return profile.with_block_size(block_size)


@dataclass(slots=True)
class SimConfig:
    """One simulated run. ``router`` holds RouterSettings overrides (not ``policy``)."""

    workers: int = 16
    policy: str = "kvmesh"
    block_size: int = 16
    lag_ms: float = 10.0
    heartbeat_ms: float = float(LOAD_INTERVAL_MS)  # quiet workers report as often as live ones
    retry_ms: float = 50.0
    # how a worker admits assignments while a pull is on its link (kvmesh.sim.worker): "overlap" as the
    # live worker (WorkerSettings.admission); "serial" the live worker's rule before; "pass" a what-if
    admission: Admission = "overlap"
    # As live workers do: evict blocks other workers also hold first (kvmesh.sim.cache). False: LRU.
    fleet_aware_eviction: bool = True
    # As the live engine admits: a prefill starts only when its blocks fit in the GPU tier beside the
    # running requests' (kvmesh.sim.worker, "KV capacity"). False: the batch grows without bound.
    kv_capacity: bool = True
    # How a prefill's lower-tier prefix reaches the GPU tier (kvmesh.sim.worker, "Loads"): "sync" in
    # the prefill iteration, as the live worker's default; "async" copied off it, as with
    # WorkerSettings.vllm_async_load on a GPU host.
    load: Load = "sync"
    router: dict[str, Any] = field(default_factory=dict)
    view: ViewSettings = field(default_factory=ViewSettings)
    truth: TruthScale = field(default_factory=TruthScale)  # the engine's real speed vs the published
    quantum_tokens: int = 4096  # the FairDispatcher's per-tenant quantum (SchedulerSettings' default)
    held_ahead: float = AHEAD  # the FairDispatcher's virtual clock (SchedulerSettings.held_ahead)

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= 16384:
            raise SimError("workers must be in [1, 16384]")
        if self.policy not in SIM_POLICIES:
            raise SimError(f"unknown policy {self.policy!r}; choose from {', '.join(SIM_POLICIES)}")
        if self.lag_ms < 0 or self.heartbeat_ms <= 0 or self.retry_ms <= 0:
            raise SimError("lag_ms must be >= 0, heartbeat_ms and retry_ms > 0")
        if not self.held_ahead >= 0:  # NaN too
            raise SimError("held_ahead must be >= 0")


@dataclass(slots=True)
class SimResult:
    """Everything a run measured; ``summary()`` gives the JSON figures of metrics.summarize."""

    policy: str
    records: list[RequestRecord]
    busy_ms: list[float]
    worker_ids: list[str]
    rejected: int
    deferrals: int
    arrivals: int

    def summary(self) -> dict[str, Any]:
        return summarize(
            self.policy, self.records, self.busy_ms, self.worker_ids, self.rejected, self.deferrals
        )


class Simulation:
    """Owns the event queue, the workers, and the view + router of one policy's run."""

    def __init__(self, profile: PerfProfile, config: SimConfig, tap: Tap | None = None) -> None:
        self.config = config
        self.tap = tap
        self.profile = profile_for_block_size(profile, config.block_size)
        if self.profile.gpu_blocks < 1:
            raise SimError("the profile's GPU tier holds no block at this block size")
        self.view = FleetView(config.block_size, config.view)
        self._retry_due = False
        self.queue = EventQueue()
        self.peers: dict[str, SimWorker] = {}
        width = len(str(config.workers - 1))
        fleet = FleetHolders() if config.fleet_aware_eviction else None
        self.workers = [
            SimWorker(
                i,
                f"w{i:0{width}d}",
                self.profile,
                self._emit,
                self._schedule,
                self.peers,
                config.admission,
                fleet,
                config.truth,
                config.kv_capacity,
                config.load,
            )
            for i in range(config.workers)
        ]
        self.peers.update((w.worker_id, w) for w in self.workers)
        settings = RouterSettings(policy=config.policy, **config.router)
        # the reference policy reads the workers themselves, at the engine's (fractional) time
        oracle = oracle_policy(self.peers, lambda: self.now) if config.policy == ORACLE else None
        self.router = Router(self.view, settings, scheduler_id="sim-scheduler", policy_func=oracle)
        self.dispatcher = FairDispatcher(self.router, config.quantum_tokens, config.held_ahead)
        self.now = 0.0
        self.rejected = 0
        self.deferrals = 0
        self.arrivals = 0

    def _emit(self, message: object, at_ms: float) -> None:
        self.queue.push(at_ms + self.config.lag_ms, _DELIVER, message)

    def _schedule(self, at_ms: float, worker: SimWorker, job: Job | None) -> None:
        self.queue.push(at_ms, _WORKER, (worker, worker.gen if job is None else -1, job))

    def _arrive(self, req: ChatRequest, now: float) -> None:
        if self.tap is not None:
            self.tap(REQUESTS, req, now)
        self.dispatcher.submit(req)
        self._drain(now)

    def _drain(self, now: float) -> None:
        """Decide what the dispatcher can place now; while anything is held, keep one retry tick due."""
        tap = self.tap
        for decision in self.dispatcher.drain(int(now)):
            a = decision.assignment
            if a is not None:
                if tap is not None:
                    tap(ASSIGNMENTS, a, now)
                self.peers[a.worker_id].assign(a, a.request.arrival_ms, now)
            else:
                self.rejected += 1
        if len(self.dispatcher) and not self._retry_due:
            self._retry_due = True
            self.deferrals += 1
            self.queue.push(now + self.config.retry_ms, _RETRY, None)

    def run(
        self, requests: Iterable[ChatRequest], progress: Callable[[int], None] | None = None
    ) -> SimResult:
        """Run ``requests`` (in arrival order) to the last completion; ``progress(n)`` per n arrivals."""
        it = iter(requests)
        first = next(it, None)
        q = self.queue
        if first is not None:
            # Every worker announces itself before the first request, as a fleet does when it starts.
            t0 = float(first.arrival_ms) - 1.0
            for w in self.workers:
                w.report(t0)
            while len(q):
                _, _, msg = q.pop()
                if self.tap is not None:
                    self.tap(LOAD, msg, t0)
                self.view.apply(msg)
            q.push(float(first.arrival_ms), _ARRIVE, first)
            q.push(float(first.arrival_ms) + self.config.heartbeat_ms, _HEARTBEAT)
        apply = self.view.apply
        tap = self.tap
        pending_progress = 0
        last_arrival = float(first.arrival_ms) if first is not None else 0.0
        while len(q):
            now, kind, payload = q.pop()
            self.now = now
            if kind == _DELIVER:
                if tap is not None:
                    tap(_TOPIC_OF[type(payload)], payload, now)
                apply(payload)
            elif kind == _WORKER:
                worker, gen, job = payload
                if job is not None:
                    if job.loading:
                        worker.on_load_done(job, now)
                    else:
                        worker.on_fetch_done(job, now)
                elif gen == worker.gen:
                    worker.on_iteration_end(now)
            elif kind == _ARRIVE:
                self.arrivals += 1
                pending_progress += 1
                if progress is not None and pending_progress >= 64:
                    progress(pending_progress)
                    pending_progress = 0
                nxt = next(it, None)
                if nxt is not None:
                    if nxt.arrival_ms < last_arrival:
                        raise SimError(f"requests out of arrival order at {nxt.request_id}")
                    last_arrival = float(nxt.arrival_ms)
                    q.push(last_arrival, _ARRIVE, nxt)
                self._arrive(payload, now)
            elif kind == _RETRY:
                self._retry_due = False
                self._drain(now)
            elif kind == _HEARTBEAT:
                quiet = now - self.config.heartbeat_ms
                sent = 0
                for w in self.workers:
                    if w.last_report_ms <= quiet:
                        w.report(now)
                        sent += 1
                # Keep beating while anything else is due: arrivals, iterations, deliveries.
                if len(q) > sent:
                    q.push(now + self.config.heartbeat_ms, _HEARTBEAT)
        if progress is not None and pending_progress:
            progress(pending_progress)
        records = [r for w in self.workers for r in w.finished]
        records.sort(key=lambda r: (r.arrival_ms, r.worker))
        return SimResult(
            policy=self.config.policy,
            records=records,
            busy_ms=[w.busy_ms for w in self.workers],
            worker_ids=[w.worker_id for w in self.workers],
            rejected=self.rejected,
            deferrals=self.deferrals,
            arrivals=self.arrivals,
        )


def simulate(
    requests: Iterable[ChatRequest],
    profile: PerfProfile,
    config: SimConfig,
    progress: Callable[[int], None] | None = None,
    tap: Tap | None = None,
) -> SimResult:
    """Run one policy over ``requests`` and return what it measured."""
    return Simulation(profile, config, tap).run(requests, progress)
