"""Exact replay: re-decide every recorded assignment on exactly the inputs the live scheduler had.

A live scheduler stamps each Assignment with :class:`~schemas.messages.DecisionInputs`: for every
state partition (kv-events, load, control, replies, and the assignments of every replica) the next
offset it had not applied, where it began reading each one, and its ``now_ms``. The replay keeps one
FleetView and Router per scheduler run (``scheduler_id``; a ``decision_seq`` that goes back starts a
new run), and for each recorded assignment, in ``decision_seq`` order (the FairDispatcher's order):

1. applies every state record of each partition from where it stands up to the recorded position,
   ordered across partitions by (timestamp, partition, offset) as the live loop interleaved them;
2. decides the request at the recorded ``now_ms`` with the chosen policy, the recorded count of
   requests the scheduler held, and on the recorded worker when a worker with room pulled it;
3. notes the *recorded* assignment in the view, as the live router noted its own.

With the recorded policy and settings the decisions match by construction; with another policy the
replay answers "what would have happened" on the very inputs the live scheduler had.

A decision is *unreproducible*, and never counted as a divergence, when the recording cannot give its
inputs: a record it needed is missing (a gap in a partition's offsets, or a record too damaged to
decode), the chain of positions is broken (an earlier assignment of the run is missing and no full
record has come since), or the scheduler started from a directory snapshot that the recording does
not cover. The replay says which, per decision.

It also measures the view's lag at each decision: the newest state record that already existed (its
broker timestamp not after the assignment's) but was not applied, minus ``now_ms`` (0 when the view had
everything). And it counts *needless fetches*: a recorded fetch plan where a view with every record
that existed applied would have found the blocks already on a worker at least as good (no fetch).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from kvmesh.percentiles import percentile
from kvmesh.replay.errors import ReplayError
from kvmesh.replay.report_check import env_report_check
from schemas.codec import decode
from schemas.errors import SchemaError
from schemas.messages import Assignment, ChatRequest, Completion, LoadReport
from services.scheduler.metrics import Outcome, compare, prediction_of
from services.scheduler.router import CandidateScore, Decision, Router, RouterSettings
from services.scheduler.view import FleetView, ViewSettings
from streams.recording import RawRecord
from streams.topics import ASSIGNMENTS, CONTROL, KV_EVENTS, LOAD, REPLIES

#: Topics whose records make up the scheduler's view.
STATE_TOPICS = (KV_EVENTS.name, LOAD.name, CONTROL.name, REPLIES.name, ASSIGNMENTS.name)


class HeldView(FleetView):
    """A FleetView whose ``note_assignment`` can be held back while the replayed router decides, so
    that the recorded assignment is noted instead. Invariant: nothing is noted while ``hold`` is set."""

    hold: bool = False

    def note_assignment(self, a: Assignment, now_ms: int) -> None:
        if not self.hold:
            super().note_assignment(a, now_ms)

    def decide_noting(
        self, router: Router, req: ChatRequest, now_ms: int, recorded: Assignment | None
    ) -> Decision:
        """``router``'s decision on this view, then the *recorded* assignment noted (when there is one)
        as the live router noted its own, so a what-if never changes the history later decisions see.
        The scheduler's own inputs come from the record: its held count, and the worker that pulled
        a held request (DecisionInputs)."""
        inputs = None if recorded is None else recorded.inputs
        self.held = 0 if inputs is None else inputs.held
        pull_to = (
            recorded.worker_id if recorded is not None and inputs is not None and inputs.pulled else None
        )
        self.hold = True
        try:
            d = router.decide(req, now_ms, pull_to=pull_to)
        finally:
            self.hold = False
        if recorded is not None:
            self.note_assignment(recorded, now_ms)
        return d


@dataclass(frozen=True, slots=True)
class _State:
    key: str  # "topic/partition"
    offset: int
    timestamp_ms: int
    message: Any  # None: the record did not decode


@dataclass(slots=True)
class ExactDecision:
    """One recorded assignment beside its replay on the same inputs."""

    request_id: str
    scheduler_id: str
    decision_seq: int
    now_ms: int
    recorded_worker: str
    replayed_worker: str | None
    outcome: str  # assigned, deferred, rejected
    reason: str
    candidates: list[CandidateScore]
    positions: dict[str, int]
    reproducible: bool = True
    why: str = ""  # what the recording lacks, when not reproducible
    lag_ms: int = 0
    recorded_ttft_ms: float | None = None
    replayed_ttft_ms: float | None = None
    fetch_planned: bool = False
    needless_fetch: bool = False
    completion: Completion | None = None
    #: The recorded decision's prediction beside its Completion: the live scheduler's own comparison
    #: (services.scheduler.metrics), None without a Completion.
    quality: Outcome | None = None

    @property
    def diverged(self) -> bool:
        return self.reproducible and self.recorded_worker != self.replayed_worker

    def to_json(self, top_k: int) -> dict[str, Any]:
        c = self.completion
        return {
            "request_id": self.request_id,
            "scheduler_id": self.scheduler_id,
            "decision_seq": self.decision_seq,
            "now_ms": self.now_ms,
            "recorded_worker": self.recorded_worker,
            "replayed_worker": self.replayed_worker,
            "outcome": self.outcome,
            "reason": self.reason,
            "diverged": self.diverged,
            "reproducible": self.reproducible,
            "why": self.why,
            "lag_ms": self.lag_ms,
            "recorded_ttft_ms": self.recorded_ttft_ms,
            "replayed_ttft_ms": self.replayed_ttft_ms,
            "fetch_planned": self.fetch_planned,
            "needless_fetch": self.needless_fetch,
            "positions": dict(sorted(self.positions.items())),
            "candidates": [dataclasses.asdict(x) for x in self.candidates[:top_k]],
            "prediction_vs_outcome": None if self.quality is None else dataclasses.asdict(self.quality),
            "outcome_measured": None
            if c is None
            else {
                "worker_id": c.worker_id,
                "ttft_ms": c.ttft_ms,
                "reused_tokens": c.reused_tokens,
                "fetched_tokens": c.fetched_tokens,
                "recomputed_tokens": c.recomputed_tokens,
            },
        }


@dataclass(slots=True)
class ExactReport:
    """Counts and every decision of an exact replay."""

    policy: str
    records: int = 0
    dead: int = 0
    decisions: list[ExactDecision] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)  # "topic/partition: offsets a..b missing"

    @property
    def divergences(self) -> int:
        return sum(d.diverged for d in self.decisions)

    @property
    def unreproducible(self) -> int:
        return sum(not d.reproducible for d in self.decisions)

    def lag_summary(self) -> dict[str, float]:
        lags = sorted(d.lag_ms for d in self.decisions if d.reproducible)
        if not lags:
            return {"p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0, "stale_decisions": 0}
        return {
            "p50_ms": percentile(lags, 50),
            "p99_ms": percentile(lags, 99),
            "max_ms": float(lags[-1]),
            "stale_decisions": sum(1 for x in lags if x > 0),
        }

    def to_json(self, only_divergent: bool = False, top_k: int = 3) -> dict[str, Any]:
        shown = [d for d in self.decisions if d.diverged or not d.reproducible or not only_divergent]
        return {
            "mode": "exact",
            "policy": self.policy,
            "records": self.records,
            "dead": self.dead,
            "requests": len(self.decisions),
            "divergences": self.divergences,
            "unreproducible": self.unreproducible,
            "gaps": self.gaps,
            "view_lag": self.lag_summary(),
            "fetch_plans": sum(d.fetch_planned for d in self.decisions),
            "needless_fetches": sum(d.needless_fetch for d in self.decisions),
            "prediction_quality": self.quality_summary(),
            "decisions": [d.to_json(top_k) for d in shown],
        }

    def quality_summary(self) -> dict[str, float]:
        """The recorded predictions against their Completions: TTFT error (observed − predicted)
        percentiles and the predicted and achieved hit tokens, as the live scheduler exports them."""
        qs = [d.quality for d in self.decisions if d.quality is not None]
        errors = [q.observed_ttft_ms - q.predicted_ttft_ms for q in qs]

        return {
            "requests": len(qs),
            "ttft_error_p50_ms": percentile(errors, 50),
            "ttft_error_p90_ms": percentile(errors, 90),
            "predicted_hit_tokens": sum(q.predicted_hit_tokens for q in qs),
            "achieved_hit_tokens": sum(q.achieved_hit_tokens for q in qs),
            "prompt_tokens": sum(q.prompt_tokens for q in qs),
        }


def has_inputs(assignments: list[Assignment]) -> bool:
    """Whether a recording's assignments carry their input positions (an exact replay is possible)."""
    return any(a.inputs is not None for a in assignments)


def _state_records(raw: list[RawRecord]) -> tuple[dict[str, dict[int, _State]], int]:
    parts: dict[str, dict[int, _State]] = defaultdict(dict)
    dead = 0
    for r in raw:
        if r.topic not in STATE_TOPICS:
            continue
        try:
            msg = decode(r.value).message
        except SchemaError:
            msg = None
            dead += 1
        parts[f"{r.topic}/{r.partition}"][r.offset] = _State(
            f"{r.topic}/{r.partition}", r.offset, r.timestamp_ms, msg
        )
    return parts, dead


def _gaps(parts: dict[str, dict[int, _State]]) -> dict[str, list[tuple[int, int]]]:
    """Per partition, the missing offset ranges [a, b) inside what the recording holds, plus
    undecodable records as ranges of one."""
    out: dict[str, list[tuple[int, int]]] = {}
    for key, recs in parts.items():
        offs = sorted(recs)
        missing = [(a + 1, b) for a, b in itertools.pairwise(offs) if b > a + 1]
        missing += [(o, o + 1) for o in offs if recs[o].message is None]
        if missing:
            out[key] = sorted(missing)
    return out


@dataclass(slots=True)
class _Run:
    """One scheduler run being replayed: its views (exact and fresh), routers and positions."""

    view: HeldView
    router: Router
    fresh: HeldView
    fresh_router: Router
    applied: dict[str, int] = field(default_factory=dict)  # next offset applied, per partition
    since: dict[str, int] = field(default_factory=dict)
    positions: dict[str, int] | None = field(default_factory=dict)  # None: chain broken
    last_seq: int = 0
    lost: list[str] = field(default_factory=list)  # inputs missing from the view since (taints the run)
    fresh_upto: int = 0  # index into the time-ordered state list applied to the fresh view


def _apply(view: FleetView, msg: Any, own_scheduler: str) -> None:
    if isinstance(msg, LoadReport) and not env_report_check().accept(msg):
        return  # the live scheduler dropped what does not verify
    # other replicas' assignments are pending load, as the live replica counted them
    view.apply(msg, own_scheduler=own_scheduler)


def _order(s: _State) -> tuple[int, str, int]:
    return (s.timestamp_ms, s.key, s.offset)


def replay_exact(
    raw: list[RawRecord],
    assignments: list[tuple[RawRecord, Assignment]],
    policy: str | None = None,
    router_overrides: dict[str, Any] | None = None,
    view_settings: ViewSettings | None = None,
    block_size: int | None = None,
    dead: int = 0,
) -> ExactReport:
    """Replay ``assignments`` (with their records) over the state records of ``raw``. ``dead``: the
    undecodable records of the other topics (the state topics' are counted here)."""
    parts, state_dead = _state_records(raw)
    dead += state_dead
    gaps = _gaps(parts)
    offsets = {k: sorted(recs) for k, recs in parts.items()}
    timeline = sorted((s for recs in parts.values() for s in recs.values()), key=_order)
    completions: dict[str, Completion] = {}
    for s in timeline:
        if isinstance(s.message, Completion):
            completions.setdefault(s.message.request_id, s.message)
    first = assignments[0][1] if assignments else None
    if policy is None:
        policy = first.estimate.policy if first is not None else "kvmesh"
    if block_size is None:
        block_size = first.request.block_size if first is not None else 16
    try:
        settings = RouterSettings(**{**(router_overrides or {}), "policy": policy})
    except TypeError as exc:
        raise ReplayError(f"bad router override: {exc}") from exc
    report = ExactReport(policy=policy, records=len(raw), dead=dead)
    report.gaps = [f"{k}: offsets {a}..{b - 1} missing" for k, rs in sorted(gaps.items()) for a, b in rs]

    # needless fetches are judged by the recorded policy, whatever policy the replay decides with
    recorded_policy = first.estimate.policy if first is not None else policy
    judge = RouterSettings(policy=recorded_policy)

    def new_run(sid: str) -> _Run:
        view = HeldView(block_size, view_settings)
        fresh = HeldView(block_size, view_settings)
        return _Run(view, Router(view, settings, sid), fresh, Router(fresh, judge, sid))

    runs: dict[str, _Run] = {}
    # dispatch order: per scheduler, by decision_seq (a smaller seq than the last starts a new run)
    by_sched: dict[str, list[tuple[RawRecord, Assignment]]] = defaultdict(list)
    for rec, a in assignments:
        by_sched[a.scheduler_id].append((rec, a))
    for sid in sorted(by_sched):
        items = by_sched[sid]
        # records of one scheduler are in produce order; seq only restarts when the scheduler does
        run: _Run | None = None
        for rec, a in items:
            if run is None or a.decision_seq <= run.last_seq:
                run = runs[sid] = new_run(sid)
            report.decisions.append(_replay_one(run, rec, a, parts, offsets, gaps, timeline, completions))
    return report


def _replay_one(
    run: _Run,
    rec: RawRecord,
    a: Assignment,
    parts: dict[str, dict[int, _State]],
    offsets: dict[str, list[int]],
    gaps: dict[str, list[tuple[int, int]]],
    timeline: list[_State],
    completions: dict[str, Completion],
) -> ExactDecision:
    why: list[str] = []
    inputs = a.inputs
    if inputs is None:
        run.positions = None
        why.append("the assignment carries no input positions")
        now = a.request.arrival_ms
    else:
        now = inputs.now_ms
        if inputs.full:
            run.positions = dict(inputs.applied)
            run.since = dict(inputs.since)
        elif run.positions is not None and a.decision_seq == run.last_seq + 1:
            run.positions.update(inputs.applied)
        else:
            missing = f"{run.last_seq + 1}..{a.decision_seq - 1}" if a.decision_seq > run.last_seq + 1 else ""
            run.positions = None
            why.append(f"earlier decisions {missing} of {a.scheduler_id} are missing".replace("  ", " "))
    run.last_seq = a.decision_seq
    positions = dict(run.positions or {})
    if run.positions is None and not why:
        why.append("the chain of input positions is broken (no full record since a missing decision)")
    # 1. state up to the recorded positions, in time order across partitions
    batch: list[_State] = []
    for key, upto in positions.items():
        recs = parts.get(key, {})
        start = run.applied.get(key, run.since.get(key, min(recs, default=upto)))
        since = run.since.get(key)
        if since is not None and key.startswith(KV_EVENTS.name) and since > 0 and key not in run.applied:
            # a snapshot covered [0, since): the same directory comes from replaying those events
            start = 0
        have_from = min(recs, default=upto)
        # what the view lacks from now on: every later decision of the run is built on it too
        if start < have_from and start < upto:
            run.lost.append(f"{key}: offsets {start}..{min(have_from, upto) - 1} are not in the recording")
        for lo, hi in gaps.get(key, []):
            if lo < upto and hi > start:
                run.lost.append(f"{key}: offsets {max(lo, start)}..{min(hi, upto) - 1} missing or damaged")
        batch.extend(s for o, s in recs.items() if start <= o < upto and s.message is not None)
        run.applied[key] = max(run.applied.get(key, 0), upto)
    for s in sorted(batch, key=_order):
        _apply(run.view, s.message, run.router.scheduler_id)
    why.extend(run.lost)
    # the fresh view: every state record that existed by the assignment's time
    while run.fresh_upto < len(timeline) and timeline[run.fresh_upto].timestamp_ms <= rec.timestamp_ms:
        s = timeline[run.fresh_upto]
        run.fresh_upto += 1
        if s.message is not None:
            _apply(run.fresh, s.message, run.router.scheduler_id)
    lag = (
        _lag(parts, offsets, positions, run.since, rec.timestamp_ms, now) if run.positions is not None else 0
    )
    # 2. decide on the exact view, 3. note the recorded assignment
    run.router.decision_seq = a.decision_seq - 1
    d = run.view.decide_noting(run.router, a.request, now, a)
    fetch_planned = bool(a.fetch)
    needless = False
    if fetch_planned:
        f = run.fresh.decide_noting(run.fresh_router, a.request, now, a)
        best = f.candidates[0] if f.candidates else None
        needless = (
            best is not None
            and best.fetch_blocks == 0
            and best.cached_blocks >= a.reuse_blocks + sum(len(p.block_hashes) for p in a.fetch)
        )
    else:
        run.fresh.note_assignment(a, now)
    out = d.assignment
    return ExactDecision(
        request_id=a.request.request_id,
        scheduler_id=a.scheduler_id,
        decision_seq=a.decision_seq,
        now_ms=now,
        recorded_worker=a.worker_id,
        replayed_worker=None if out is None else out.worker_id,
        outcome="assigned" if out is not None else ("deferred" if d.deferred else "rejected"),
        reason=d.reason,
        candidates=d.candidates,
        positions=positions,
        reproducible=not why,
        why="; ".join(dict.fromkeys(why)),
        lag_ms=lag,
        recorded_ttft_ms=a.estimate.ttft_ms,
        replayed_ttft_ms=None if out is None else out.estimate.ttft_ms,
        fetch_planned=fetch_planned,
        needless_fetch=needless,
        completion=completions.get(a.request.request_id),
        quality=_quality(a, completions.get(a.request.request_id)),
    )


def _quality(a: Assignment, c: Completion | None) -> Outcome | None:
    """What the scheduler's metrics compare live (kvmesh_scheduler_ttft_prediction_error_seconds and
    the predicted/achieved hit tokens), for one recorded decision."""
    return compare(prediction_of(a), c) if c is not None else None


def _lag(
    parts: dict[str, dict[int, _State]],
    offsets: dict[str, list[int]],
    positions: dict[str, int],
    since: dict[str, int],
    at_ms: int,
    now: int,
) -> int:
    """The newest state record that existed by ``at_ms`` but was not applied, minus ``now`` (>= 0)."""
    newest = None
    for key, recs in parts.items():
        first = max(positions.get(key, since.get(key, 0)), since.get(key, 0))
        offs = offsets[key]
        for o in offs[bisect.bisect_left(offs, first) :]:
            ts = recs[o].timestamp_ms
            if ts <= at_ms and (newest is None or ts > newest):
                newest = ts
    return 0 if newest is None else max(newest - now, 0)


def assignment_records(raw: list[RawRecord]) -> tuple[list[tuple[RawRecord, Assignment]], int]:
    """The recorded assignments (with their records, in produce order) and how many did not decode."""
    out: list[tuple[RawRecord, Assignment]] = []
    dead = 0
    for r in sorted((r for r in raw if r.topic == ASSIGNMENTS.name), key=lambda r: (r.partition, r.offset)):
        try:
            msg = decode(r.value).message
        except SchemaError:
            dead += 1
            continue
        if isinstance(msg, Assignment):
            out.append((r, msg))
    # produce order across the assignment partitions (keyed by worker): by time, then decision_seq
    # (a scheduler that restarts numbers its decisions from 1 again, later in time)
    out.sort(key=lambda ra: (ra[1].scheduler_id, ra[0].timestamp_ms, ra[1].decision_seq))
    return out, dead
