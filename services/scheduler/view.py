"""The scheduler's view of the fleet: who holds which blocks, how loaded each worker is, how fast.

The view is built only from ordered input events (KvEvents, LoadReports, WorkerLost, the router's own
assignments and the Completions it sees); it never reads the clock, so the live service, ``kvmesh
replay`` and the simulator reach the same view from the same events.

It lags the truth: a worker's LoadReport says nothing about assignments made after ``report_ms``. So
the router's own assignments count as *pending* load on their worker until a report newer than the
assignment arrives, or until the worker could have finished it (the wait before it and its own prefill)
and ``pending_decay_ms`` more have passed (the report may be lost or the worker slow). A fixed age would
forget a long prompt while it is still being prefilled: a 100k-token prompt pending for 8 s of work
counted as nothing 2 s after it was sent, and the next request was sent behind it::

    assign a1 (t=100)   assign a2 (t=130)   report (report_ms=120)   now=140
    pending = {a1, a2}                       pending = {a2}           queue = report + a2
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvmesh_core.costmodel import (
    PerfProfile,
    decode_ms,
    prefill_iterations,
    pull_ms,
    queued_prefill_ms,
    recompute_ms,
)
from kvmesh_core.kv_room import kv_wait_steps
from schemas.kv_sequence import KvSequence
from schemas.messages import Assignment, Completion, KvEvent, LoadReport, WorkerLost
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.router_state import ActiveBlocks, RoutedPrefixes

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ViewSettings:
    """How long the view trusts what it was told."""

    pending_decay_ms: int = 2000
    worker_timeout_ms: int = 10000  # a worker whose last report is older than this (vs now_ms) is not live
    inflight_timeout_ms: int = 600_000  # an assignment with no Completion after this stops counting
    # Learn each worker's real prefill speed from its Completions (measured prefill time against the
    # published profile's) and price its work with the corrected profile. Memory: about this many
    # Completions, weighted by their predicted prefill time.
    learn_speed: bool = True
    speed_memory: int = 16
    # Completions needed before the learned factor is used: a cold engine's first prefills (warm-up,
    # compilation) are not its speed.
    speed_min_samples: int = 8


@dataclass(slots=True)
class PendingWork:
    """One of the router's own assignments not yet reflected in its worker's LoadReport."""

    assign_ms: int
    request_id: str
    prefill_tokens: int
    cached_tokens: int
    cost_ms: float = 0.0
    # when the view stops counting it with no report: the earliest it could be done, plus the decay;
    # never before the entry ahead of it (a worker's pending work runs in order)
    until_ms: float = 0.0


@dataclass(slots=True)
class WorkerState:
    """What the view knows of one worker: its latest report, the profile from it, pending work.

    ``base_queue_ms`` is the wait the latest report implies (queued prefill + one decode step when it
    is decoding), computed once per report so that a decision only adds the pending part.
    """

    worker_id: str
    report: LoadReport
    profile: PerfProfile  # the published profile with the learned speed applied (SpeedEstimate)
    report_ms: int
    base_queue_ms: float
    pending: deque[PendingWork] = field(default_factory=deque)
    pending_total_ms: float = 0.0  # prefill ms of everything in ``pending`` (decay not applied)
    pending_in_order: bool = True  # ``pending`` sorted by assign_ms (false only for out-of-order drivers)
    # When the pulls the router planned onto this worker end (event time): a worker pulls one request's
    # blocks at a time on its link, before the request joins its queue, and no report says how far
    # behind its link is. Deterministic given the ordered decisions, as ``pending`` is.
    link_free_ms: float = 0.0
    # The router's latest assignment to it (event time; -1: none yet). Among workers that look equally
    # loaded, the one assigned to longest ago goes first: over an idle fleet, cache misses then rotate
    # over every worker instead of piling on the lowest id, whose cache churns while the others' sit
    # empty (a skew of 82 % busy to 11 % at light load). Deterministic given the ordered decisions.
    last_assign_ms: int = -1

    @property
    def tie_key(self) -> tuple[int, int, str]:
        """How equally loaded workers are ordered, everywhere the router ranks them: the smaller decode
        batch (it frees up sooner), then the oldest last assignment, then the id."""
        return (self.report.active_tokens, self.last_assign_ms, self.worker_id)

    @property
    def transfer_address(self) -> str:
        return self.report.transfer_address


def _uncovered(ws: WorkerState, now_ms: int) -> Iterator[PendingWork]:
    """The pending entries that still count at ``now_ms``: assigned by then, after the latest report,
    and not yet expired."""
    return (w for w in ws.pending if w.until_ms > now_ms and ws.report_ms <= w.assign_ms <= now_ms)


def _report_queue_ms(report: LoadReport, profile: PerfProfile) -> float:
    """The wait implied by a report: its queued prefill (priced with its context term when the worker
    reports it; else split evenly over the queued requests, as if nothing were cached)."""
    wait = 0.0
    if report.queued_prefill_tokens > 0 and report.queued_prefill_ctx_tokens > 0:
        wait += queued_prefill_ms(profile, report.queued_prefill_tokens, report.queued_prefill_ctx_tokens)
    elif report.queued_prefill_tokens > 0:
        n = max(report.queue_depth, 1)
        wait += n * recompute_ms(profile, report.queued_prefill_tokens // n)
    if report.active_requests > 0:
        # A running batch: the new prefill waits for the step in flight (half a step on average), then
        # runs in an iteration with one more decode step. Where the worker reports its chunked-prefill
        # budget, each iteration that the queued prompts take carries a step too (a 16k-token prompt
        # queued on vLLM's 2,048-token budget: eight); without it, as before, the queue carries none.
        steps = 1.5
        if profile.prefill_chunk_tokens > 0 and report.queued_prefill_tokens > 0:
            steps += prefill_iterations(profile, report.queued_prefill_tokens)
        wait += steps * decode_ms(profile, 1)
    # a full batch: the decode steps until a place frees up for it (the worker's own expectation)
    wait += decode_ms(profile, report.slot_wait_steps)
    return wait


def carried_steps(ws: WorkerState, new_tokens: int) -> int:
    """The decode steps of ``ws``'s running batch that a prefill of ``new_tokens`` carries there, one
    per iteration under the worker's reported chunked-prefill budget; 0 while its batch is empty or
    where it reports no budget (the queue estimate's step and a half then stand for it, as before)."""
    p = ws.profile
    if p.prefill_chunk_tokens <= 0 or ws.report.active_requests <= 0:
        return 0
    return prefill_iterations(p, new_tokens)


@dataclass(slots=True)
class SpeedEstimate:
    """How much slower (> 1) or faster than its published profile a worker really prefills.

    A decayed ratio of sums, measured over predicted prefill ms: a Completion weighs as much as its
    prefill lasted, so short prefills (mostly fixed overheads) barely move it. Clamped to [1/5, 5] so
    that one absurd report cannot take a worker out of the fleet or make it a sink.

    New samples wait in plain sums and are folded in at the next decision (``fold``). Completions reach
    the scheduler over several partitions in no set order; sums do not depend on it, so a replay that
    applies the same records between two decisions in another order learns exactly the same factor.
    """

    measured_ms: float = 0.0
    predicted_ms: float = 0.0
    samples: int = 0
    new_measured: list[float] = field(default_factory=list)
    new_predicted: list[float] = field(default_factory=list)

    def add(self, measured_ms: float, predicted_ms: float) -> None:
        self.new_measured.append(measured_ms)
        self.new_predicted.append(predicted_ms)

    def fold(self, memory: int) -> bool:
        """Fold the new samples in (each ages the old ones by 1 - 1/memory); False: there were none."""
        n = len(self.new_measured)
        if not n:
            return False
        keep = (1.0 - 1.0 / max(memory, 1)) ** n
        # fsum is exactly rounded, so the result does not depend on the samples' order either
        self.measured_ms = self.measured_ms * keep + math.fsum(self.new_measured)
        self.predicted_ms = self.predicted_ms * keep + math.fsum(self.new_predicted)
        self.samples += n
        self.new_measured.clear()
        self.new_predicted.clear()
        return True

    def factor_after(self, min_samples: int) -> float:
        """The learned factor once ``min_samples`` samples are in (1 before)."""
        if self.samples < min_samples or self.predicted_ms <= 0:
            return 1.0
        return self.factor

    @property
    def factor(self) -> float:
        if self.predicted_ms <= 0:
            return 1.0
        return min(max(self.measured_ms / self.predicted_ms, 0.2), 5.0)


def _scaled(p: PerfProfile, factor: float) -> PerfProfile:
    if factor == 1.0:
        return p
    return dataclasses.replace(
        p,
        prefill_ms_per_token=p.prefill_ms_per_token * factor,
        prefill_ms_per_token_per_ctx=p.prefill_ms_per_token_per_ctx * factor,
    )


@dataclass(slots=True)
class _Inflight:
    worker_id: str
    tenant: str
    assign_ms: int


def assigned_ms(a: Assignment) -> int:
    """When an assignment was made, from its own fields (deterministic in replay): the deciding
    replica's now_ms, or the request's arrival for a record without input positions."""
    return a.inputs.now_ms if a.inputs is not None else a.request.arrival_ms


class FleetView:
    """Owns the prefix index, the per-worker load state, pending work and in-flight requests.

    Invariants: ``workers`` holds only workers that sent a LoadReport and were not declared lost
    since; a lost worker holds no blocks in ``index``; pending entries are ordered by assignment.
    """

    def __init__(self, block_size: int = 16, settings: ViewSettings | None = None) -> None:
        self.block_size = block_size
        self.settings = settings or ViewSettings()
        self.index = PrefixIndex()
        self.workers: dict[str, WorkerState] = {}
        # KV event numbering per worker (schemas.kv_sequence); workers whose events had a gap, for
        # the scheduler service to ask for a resync (a replay only collects them).
        self.kv_sequence = KvSequence()
        self.resync_wanted: list[str] = []
        self.assignments_noted = 0
        # Requests the scheduler holds besides the one being decided (late binding), set by the
        # dispatcher before each decision and recorded with it (DecisionInputs.held) for exact replay.
        self.held = 0
        self._lost: dict[str, int] = {}  # worker → declared_ms of its last WorkerLost
        self.refused: dict[str, str] = {}  # worker → why its announce was refused (block size)
        self._inflight: dict[str, _Inflight] = {}
        self._inflight_order: deque[str] = deque()
        self._tenant_inflight: dict[str, int] = {}
        self._sessions: dict[str, str] = {}  # session → worker of its last assignment
        self._worker_inflight: dict[str, int] = {}  # worker → routed, not completed (SGLang's load)
        self.speed: dict[str, SpeedEstimate] = {}  # worker → learned prefill speed (learn_speed)
        self._speed_news: set[str] = set()  # workers with samples not yet folded in
        # router-side bookkeeping of the peers' policies, kept only when the policy reads it (track())
        self.active_blocks: ActiveBlocks | None = None
        self.routed: RoutedPrefixes | None = None
        # worker → base queue + pending ms (decay not applied): ranks workers for least-loaded picks
        # in C (heapq with a dict getter) instead of one Python call per worker per decision
        self.load_key: dict[str, float] = {}
        # (load_key, *WorkerState.tie_key) sorted: least loaded first. Equal waits (idle, or one decode
        # step) are common, and breaking them by id alone would pile them on the lowest ids
        self._load_rank: list[tuple[float, int, int, str]] = []
        self._rank_entry: dict[str, tuple[float, int, int, str]] = {}
        # live-worker cache: valid while no membership change and now_ms in [computed_at, valid_until)
        self._version = 0
        self._live_key: tuple[int, str | None] = (-1, None)
        self._live: list[str] = []
        self._live_set: frozenset[str] = frozenset()
        self._live_at = 0
        self._live_until = -1

    def track(self, active_blocks: bool = False, routed_max_blocks: int | None = None) -> None:
        """Keep the router-side bookkeeping a policy reads (see router_state); from now on."""
        if active_blocks and self.active_blocks is None:
            self.active_blocks = ActiveBlocks()
        if routed_max_blocks is not None and self.routed is None:
            self.routed = RoutedPrefixes(routed_max_blocks)

    # -- events ----------------------------------------------------------------------------------
    def apply(self, msg: object, own_scheduler: str | None = None) -> int | None:
        """Apply one state message (KvEvent, LoadReport, WorkerLost, Completion, another replica's
        Assignment), the one dispatch the scheduler, replay and the simulator share; returns the event
        time it carries (ms; None for a Completion, an Assignment or any other type). Callers check
        report signatures before (schemas.report_signing). An Assignment of ``own_scheduler`` is
        skipped: the router noted it when it made it."""
        if isinstance(msg, KvEvent):
            self.apply_kv_event(msg)
            return msg.event_ms
        if isinstance(msg, LoadReport):
            self.apply_load(msg)
            return msg.report_ms
        if isinstance(msg, WorkerLost):
            self.apply_worker_lost(msg)
            return msg.declared_ms
        if isinstance(msg, Completion):
            self.note_completion(msg)
        elif isinstance(msg, Assignment) and msg.scheduler_id != own_scheduler:
            self.note_assignment(msg, assigned_ms(msg))
        return None

    def apply_kv_event(self, ev: KvEvent) -> None:
        if ev.worker_id in self.refused:
            return
        verdict = self.kv_sequence.observe(ev)
        if verdict != "apply":
            # missed events of this worker: what we hold of it may be wrong until it resyncs
            if verdict == "gap":
                self.resync_wanted.append(ev.worker_id)
            return
        lost_ms = self._lost.get(ev.worker_id)
        if lost_ms is not None:
            # a stale event of a worker declared lost: its blocks went with it. Events without a time
            # count only once the worker is back (reported after its WorkerLost).
            stale = ev.event_ms <= lost_ms if ev.event_ms else ev.worker_id not in self.workers
            if stale:
                return
        if ev.kind == "stored":
            self.index.store(ev.worker_id, ev.tier, ev.block_hashes, ev.parent_hashes)
        elif ev.kind == "removed":
            self.index.remove(ev.worker_id, ev.block_hashes)
        elif ev.kind == "moved":
            self.index.move(ev.worker_id, ev.tier, ev.block_hashes)
        elif ev.kind == "cleared":
            self.index.remove_worker(ev.worker_id)

    def apply_load(self, lr: LoadReport) -> None:
        if lr.block_size != self.block_size:
            self._refuse(lr)
            return
        if self.refused.pop(lr.worker_id, None) is not None:
            log.info("worker %s now announces the fleet's block size %d", lr.worker_id, lr.block_size)
        lost_ms = self._lost.get(lr.worker_id)
        if lost_ms is not None and lr.report_ms <= lost_ms:
            return  # older than the WorkerLost that dropped it (out-of-order or replayed report)
        ws = self.workers.get(lr.worker_id)
        if ws is not None and lr.report_ms < ws.report_ms:
            return  # out of order: keep the newest
        profile = PerfProfile.from_load_report(lr)
        speed = self.speed.get(lr.worker_id)
        if speed is not None:
            profile = _scaled(profile, speed.factor_after(self.settings.speed_min_samples))
        if ws is None:
            ws = WorkerState(lr.worker_id, lr, profile, lr.report_ms, _report_queue_ms(lr, profile))
            self.workers[lr.worker_id] = ws
            self._version += 1
        else:
            if (
                ws.report.draining != lr.draining
                or ws.report.model != lr.model
                or lr.worker_id not in self._live_set
            ):
                # membership of the cached live list may change (a stale worker reporting again)
                self._version += 1
            ws.report = lr
            ws.profile = profile
            ws.report_ms = lr.report_ms
            ws.base_queue_ms = _report_queue_ms(lr, profile)
        # the report now covers every assignment made before it
        pending = ws.pending
        while pending and pending[0].assign_ms < lr.report_ms:
            ws.pending_total_ms -= pending.popleft().cost_ms
        if not pending:
            ws.pending_total_ms = 0.0  # no float drift
        self._set_load_key(lr.worker_id, ws.base_queue_ms + ws.pending_total_ms)

    def _refuse(self, lr: LoadReport) -> None:
        """A worker cut its blocks at another size than the fleet: its hashes would never match a
        request's, and its blocks would be mis-indexed. It is not a candidate and its events are dropped."""
        reason = (
            f"worker {lr.worker_id} announces block size {lr.block_size}, the fleet's is {self.block_size}: "
            "refused (set the same KVMESH_*_BLOCK_SIZE on every worker, scheduler and intake)"
        )
        first = self.refused.get(lr.worker_id) != reason
        if first:
            log.error("%s", reason)
            self.refused[lr.worker_id] = reason
        was_member = self.workers.pop(lr.worker_id, None) is not None
        if was_member:
            self._version += 1
            self._set_load_key(lr.worker_id, None)
        if first or was_member:
            self.index.remove_worker(lr.worker_id)  # a scan: once per refusal, not per report

    def apply_worker_lost(self, wl: WorkerLost) -> None:
        prev = self._lost.get(wl.worker_id, -1)
        self._lost[wl.worker_id] = max(prev, wl.declared_ms)
        ws = self.workers.pop(wl.worker_id, None)
        if ws is not None and ws.report_ms > wl.declared_ms:
            # it reported after being declared lost (records of two topics crossed): it is back, but its
            # blocks go as they did in the KV manager's directory; it re-announces what it still has
            self.workers[wl.worker_id] = ws
        else:
            self._set_load_key(wl.worker_id, None)
            self.speed.pop(wl.worker_id, None)  # a replacement may run elsewhere
            if self.routed is not None:
                self.routed.drop_worker(wl.worker_id)
            if self.active_blocks is not None:
                self.active_blocks.drop_worker(wl.worker_id)
        self._version += 1
        dropped = self.index.remove_worker(wl.worker_id)
        for rid in [r for r, f in self._inflight.items() if f.worker_id == wl.worker_id]:
            self._drop_inflight(rid)
        log.info("worker %s lost (%s): dropped %d blocks", wl.worker_id, wl.reason, dropped)

    def note_assignment(self, a: Assignment, now_ms: int) -> None:
        """Count the router's own assignment as pending on its worker (idempotent per request id)."""
        req = a.request
        if req.request_id in self._inflight:
            return
        ws = self.workers.get(a.worker_id)
        if ws is not None:
            cached = len(req.token_ids) - a.prefill_tokens
            # its prefill and the decode steps it carries: what a request assigned after it waits for
            steps = carried_steps(ws, a.prefill_tokens)
            cost = recompute_ms(ws.profile, a.prefill_tokens, cached) + decode_ms(ws.profile, steps)
            pending = ws.pending
            while pending and pending[0].until_ms <= now_ms:
                ws.pending_total_ms -= pending.popleft().cost_ms
            until = now_ms + self.queue_ms(ws, now_ms) + cost + self.settings.pending_decay_ms
            if not pending:
                ws.pending_in_order = True
            else:
                until = max(until, pending[-1].until_ms)
                if now_ms < pending[-1].assign_ms:
                    ws.pending_in_order = False
            pending.append(PendingWork(now_ms, req.request_id, a.prefill_tokens, cached, cost, until))
            if a.fetch:
                pulls = 0.0
                for plan in a.fetch:
                    peer = self.workers.get(plan.peer_worker)
                    pulls += pull_ms(ws.profile, len(plan.block_hashes), peer.profile if peer else None)
                ws.link_free_ms = max(ws.link_free_ms, float(now_ms)) + pulls
            ws.pending_total_ms += cost
            ws.last_assign_ms = max(ws.last_assign_ms, now_ms)
            self._set_load_key(a.worker_id, ws.base_queue_ms + ws.pending_total_ms)
        self.assignments_noted += 1
        self._sessions[req.session_id] = a.worker_id
        self._inflight[req.request_id] = _Inflight(a.worker_id, req.tenant, now_ms)
        self._worker_inflight[a.worker_id] = self._worker_inflight.get(a.worker_id, 0) + 1
        if self.active_blocks is not None:
            self.active_blocks.add(req.request_id, a.worker_id, req.block_hashes)
        if self.routed is not None:
            self.routed.insert(a.worker_id, req.block_hashes)
        self._inflight_order.append(req.request_id)
        self._tenant_inflight[req.tenant] = self._tenant_inflight.get(req.tenant, 0) + 1
        self._expire_inflight(now_ms)

    def note_completion(self, c: Completion) -> None:
        self._drop_inflight(c.request_id)
        ws = self.workers.get(c.worker_id)
        if ws is None:
            return
        if self.settings.learn_speed:
            self._learn_speed(ws, c)
        if ws.pending:
            ws.pending = deque(p for p in ws.pending if p.request_id != c.request_id)
            ws.pending_total_ms = sum(p.cost_ms for p in ws.pending)
            self._set_load_key(c.worker_id, ws.base_queue_ms + ws.pending_total_ms)

    def _learn_speed(self, ws: WorkerState, c: Completion) -> None:
        """Take one measured prefill as a sample of the worker's speed (folded in at the next decision)."""
        if c.error or c.prefill_ms <= 0 or c.recomputed_tokens <= 0:
            return
        published = PerfProfile.from_load_report(ws.report)
        predicted = recompute_ms(published, c.recomputed_tokens, c.reused_tokens + c.fetched_tokens)
        if predicted <= 0:
            return
        speed = self.speed.get(c.worker_id)
        if speed is None:
            speed = self.speed[c.worker_id] = SpeedEstimate()
        # one sample moves the estimate at most 4x either way (a stall, a clock hiccup)
        speed.add(min(max(c.prefill_ms, predicted / 4), predicted * 4), predicted)
        self._speed_news.add(c.worker_id)

    def fold_speed(self) -> None:
        """Fold the samples since the last decision into each worker's speed and re-price the workers
        whose factor moved. The router calls it before every decision."""
        if not self._speed_news:
            return
        for w in sorted(self._speed_news):
            speed = self.speed.get(w)
            ws = self.workers.get(w)
            if speed is None or not speed.fold(self.settings.speed_memory) or ws is None:
                continue
            ws.profile = _scaled(
                PerfProfile.from_load_report(ws.report), speed.factor_after(self.settings.speed_min_samples)
            )
            ws.base_queue_ms = _report_queue_ms(ws.report, ws.profile)
            self._set_load_key(w, ws.base_queue_ms + ws.pending_total_ms)
        self._speed_news.clear()

    def worker_inflight(self, worker_id: str) -> int:
        """Requests routed to the worker and not completed (the router's own count)."""
        return self._worker_inflight.get(worker_id, 0)

    def load_snapshot(self, snapshot: Any) -> None:
        """Start from a KV manager DirectorySnapshot (``blocks`` hash → {worker: tier}, ``parents``)."""
        self.index.load(snapshot.blocks, getattr(snapshot, "parents", None))

    # -- queries ---------------------------------------------------------------------------------
    def live_workers(self, now_ms: int, model: str | None = None) -> list[str]:
        """Workers that reported within ``worker_timeout_ms`` of ``now_ms`` and are not draining, sorted.

        With ``model``, only those serving it. Cached until the membership changes or a worker may time out.
        """
        key = (self._version, model)
        if key == self._live_key and self._live_at <= now_ms < self._live_until:
            return self._live
        cutoff = now_ms - self.settings.worker_timeout_ms
        live = sorted(
            w
            for w, ws in self.workers.items()
            if ws.report_ms >= cutoff
            and not ws.report.draining
            and (model is None or ws.report.model == model)
        )
        until = min(
            (self.workers[w].report_ms + self.settings.worker_timeout_ms + 1 for w in live), default=1 << 62
        )
        # a worker outside the list becomes live only by reporting, which bumps the version (apply_load)
        self._live_key, self._live, self._live_at, self._live_until = key, live, now_ms, until
        self._live_set = frozenset(live)
        return live

    def pending_ms(self, ws: WorkerState, now_ms: int) -> float:
        """Prefill time of the router's own assignments to ``ws`` that its reports do not cover yet."""
        if not ws.pending:
            return 0.0
        first = ws.pending[0]
        if (
            ws.pending_in_order
            and first.until_ms > now_ms  # the earliest expiry: none decayed
            and first.assign_ms >= ws.report_ms
            and now_ms >= ws.pending[-1].assign_ms
        ):
            return ws.pending_total_ms  # in order and none decayed: the running total is exact
        return sum(w.cost_ms for w in _uncovered(ws, now_ms))

    def link_wait_ms(self, ws: WorkerState, now_ms: int) -> float:
        """How long a pull planned onto ``ws`` now would wait for the pulls planned before it."""
        return max(ws.link_free_ms - now_ms, 0.0)

    def pending_prefill_tokens(self, ws: WorkerState, now_ms: int) -> int:
        """Prompt tokens still to prefill of the router's own assignments its reports do not cover."""
        if not ws.pending:
            return 0
        return sum(w.prefill_tokens for w in _uncovered(ws, now_ms))

    def kv_wait_ms(self, ws: WorkerState, prompt_tokens: int, now_ms: int) -> float:
        """How much longer than its queue a prompt of ``prompt_tokens`` waits on ``ws`` for room in its
        GPU tier (kvmesh_core/kv_room.py). Its report's free blocks, less those of the router's own
        assignments it does not count yet, and its running requests' releases give the decode steps
        until the prompt fits after the queued ones. Each prefill iteration of the queue runs one of
        those steps; the rest are decode-only steps added to the queue. 0 where the worker reports no
        room."""
        r = ws.report
        if r.kv_free_blocks is None:
            return 0.0
        bs = max(r.block_size, 1)
        free = r.kv_free_blocks
        ahead = r.queue_depth
        for w in _uncovered(ws, now_ms):
            free -= -(-(w.prefill_tokens + w.cached_tokens) // bs)
            ahead += 1
        steps = kv_wait_steps(free, r.kv_release, -(-prompt_tokens // bs))
        return decode_ms(ws.profile, max(steps - ahead, 0))

    def queue_ms(self, ws: WorkerState, now_ms: int) -> float:
        """Estimated wait before a new request's prefill starts on ``ws``."""
        return ws.base_queue_ms + self.pending_ms(ws, now_ms)

    def tenant_inflight(self, tenant: str) -> int:
        return self._tenant_inflight.get(tenant, 0)

    def inflight_worker(self, request_id: str) -> str | None:
        """The worker the router sent ``request_id`` to, while it is in flight."""
        f = self._inflight.get(request_id)
        return None if f is None else f.worker_id

    def session_worker(self, session_id: str) -> str | None:
        return self._sessions.get(session_id)

    def least_loaded(self, k: int, live: list[str]) -> list[str]:
        """The ``k`` workers of ``live`` with the least load key (ties by the active tokens of their
        latest report, then the oldest last assignment, then id), from the maintained ranking."""
        live_set = self._live_set if live is self._live else frozenset(live)
        out: list[str] = []
        for _, _, _, w in self._load_rank:
            if w in live_set:
                out.append(w)
                if len(out) == k:
                    break
        return out

    # -- internals -------------------------------------------------------------------------------
    def _set_load_key(self, worker_id: str, value: float | None) -> None:
        rank = self._load_rank
        self.load_key.pop(worker_id, None)
        old = self._rank_entry.pop(worker_id, None)
        if old is not None:
            del rank[bisect.bisect_left(rank, old)]
        if value is not None:
            self.load_key[worker_id] = value
            ws = self.workers.get(worker_id)
            entry = (value, *ws.tie_key) if ws is not None else (value, 0, -1, worker_id)
            self._rank_entry[worker_id] = entry
            bisect.insort(rank, entry)

    def _drop_inflight(self, request_id: str) -> None:
        f = self._inflight.pop(request_id, None)
        if f is None:
            return
        left = self._worker_inflight.get(f.worker_id, 0) - 1
        if left > 0:
            self._worker_inflight[f.worker_id] = left
        else:
            self._worker_inflight.pop(f.worker_id, None)
        if self.active_blocks is not None:
            self.active_blocks.remove(request_id)
        n = self._tenant_inflight.get(f.tenant, 0) - 1
        if n > 0:
            self._tenant_inflight[f.tenant] = n
        else:
            self._tenant_inflight.pop(f.tenant, None)

    def _expire_inflight(self, now_ms: int) -> None:
        oldest = now_ms - self.settings.inflight_timeout_ms
        order = self._inflight_order
        while order:
            f = self._inflight.get(order[0])
            if f is not None and f.assign_ms > oldest:
                break
            rid = order.popleft()
            if f is not None:
                self._drop_inflight(rid)
