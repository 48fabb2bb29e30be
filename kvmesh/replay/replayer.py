"""Re-run the scheduler's decisions over a recorded window and set them beside the recorded ones.

Order and time follow the live scheduler (services/scheduler/service.py):

* records are replayed in one total order: ``(timestamp_ms, state topics before requests before
  assignments, partition, offset)`` -- the order a recording documents for a total replay;
* KvEvents, LoadReports, WorkerLost and Completions update the FleetView; each request is decided
  with ``now_ms`` = the largest message time seen so far (``event_ms``, ``report_ms``, ``declared_ms``,
  ``arrival_ms``), which is the live scheduler's event-time rule (for a request that arrives after
  every state record it has seen, that is its ``arrival_ms``);
* right after a decision the view notes the *recorded* Assignment of that request (as the live
  scheduler noted its own), not the replayed one, so a what-if decision (``policy`` override) never
  changes the fleet history the next decision sees; recorded assignments of requests outside the
  window are noted where they appear.

Undecodable records are counted (``dead``) and skipped, as a live consumer dead-letters them.

This is the *approximate* replay, for recordings whose assignments carry no input positions (older
versions, the simulator's recordings): the live loop decides a polled batch after the state records
of the same poll, so a decision made under load may diverge for that reason alone. Recordings of a
live scheduler that stamps its inputs replay exactly (:mod:`kvmesh.replay.exact`); :func:`replay_any`
picks the mode.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.replay.errors import ReplayError
from kvmesh.replay.exact import (
    STATE_TOPICS,
    ExactDecision,
    ExactReport,
    HeldView,
    assignment_records,
    has_inputs,
    replay_exact,
)
from kvmesh.replay.report_check import env_report_check
from schemas.codec import decode
from schemas.errors import SchemaError
from schemas.messages import Assignment, ChatRequest, Completion, KvEvent, LoadReport, WorkerLost
from services.scheduler.router import CandidateScore, Router, RouterSettings
from services.scheduler.view import ViewSettings
from streams.recording import RawRecord, read_recording, record_topics
from streams.settings import KafkaSettings
from streams.topics import ASSIGNMENTS, REQUESTS, TopicSpec

#: Sort rank of a topic among records with equal timestamps: state first, then requests, then outputs.
_TOPIC_RANK = {REQUESTS.name: 1, ASSIGNMENTS.name: 2}


@dataclass(frozen=True, slots=True)
class ReplayedDecision:
    """One request: what the live scheduler assigned and what the replay decided, at ``now_ms``."""

    request_id: str
    now_ms: int
    recorded_worker: str | None
    replayed_worker: str | None
    outcome: str  # assigned, deferred, rejected
    reason: str
    candidates: list[CandidateScore]
    recorded_ttft_ms: float | None = None
    replayed_ttft_ms: float | None = None

    @property
    def diverged(self) -> bool:
        return self.recorded_worker != self.replayed_worker

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "now_ms": self.now_ms,
            "recorded_worker": self.recorded_worker,
            "replayed_worker": self.replayed_worker,
            "outcome": self.outcome,
            "reason": self.reason,
            "diverged": self.diverged,
            "recorded_ttft_ms": self.recorded_ttft_ms,
            "replayed_ttft_ms": self.replayed_ttft_ms,
            "candidates": [dataclasses.asdict(c) for c in self.candidates],
        }


@dataclass(slots=True)
class ReplayReport:
    """The outcome of one replay: counts and every request's decision pair."""

    policy: str
    records: int = 0
    dead: int = 0
    decisions: list[ReplayedDecision] = field(default_factory=list)

    @property
    def divergences(self) -> int:
        return sum(d.diverged for d in self.decisions)

    def to_json(self, only_divergent: bool = False, top_k: int = 3) -> dict[str, Any]:
        shown = [d for d in self.decisions if d.diverged or not only_divergent]
        return {
            "mode": "approximate",
            "note": "the recording's assignments carry no input positions: decisions are replayed in "
            "timestamp order and may diverge from the live ones for that reason alone",
            "policy": self.policy,
            "records": self.records,
            "dead": self.dead,
            "requests": len(self.decisions),
            "divergences": self.divergences,
            "decisions": [d.to_json() for d in shown],
        }


def _order(r: RawRecord) -> tuple[int, int, int, int]:
    return (r.timestamp_ms, _TOPIC_RANK.get(r.topic, 0), r.partition, r.offset)


def replay(
    records: Iterable[RawRecord],
    policy: str | None = None,
    router_overrides: dict[str, Any] | None = None,
    view_settings: ViewSettings | None = None,
    block_size: int | None = None,
    top_k: int = 3,
) -> ReplayReport:
    """Replay ``records``; ``policy`` None means the policy of the recorded assignments (else kvmesh)."""
    decoded: list[tuple[RawRecord, Any]] = []
    dead = 0
    raw = sorted(records, key=_order)
    for r in raw:
        try:
            decoded.append((r, decode(r.value).message))
        except SchemaError:
            dead += 1
    recorded: dict[str, Assignment] = {}
    first_request: ChatRequest | None = None
    for _, msg in decoded:
        if isinstance(msg, Assignment):
            recorded.setdefault(msg.request.request_id, msg)
        elif isinstance(msg, ChatRequest) and first_request is None:
            first_request = msg
    if policy is None:
        first = next(iter(recorded.values()), None)
        policy = first.estimate.policy if first is not None else "kvmesh"
    if block_size is None:
        block_size = first_request.block_size if first_request is not None else 16
    view = HeldView(block_size, view_settings)
    try:
        settings = RouterSettings(**{**(router_overrides or {}), "policy": policy})
    except TypeError as exc:
        raise ReplayError(f"bad router override: {exc}") from exc
    scheduler_id = next((a.scheduler_id for a in recorded.values()), "replay")
    router = Router(view, settings, scheduler_id=scheduler_id or "replay")
    report = ReplayReport(policy=policy, records=len(raw), dead=dead)
    decided: set[str] = set()
    now = 0
    for _, msg in decoded:
        if isinstance(msg, LoadReport) and not env_report_check().accept(msg):
            continue  # as the live scheduler: a report that does not verify never happened
        if isinstance(msg, KvEvent | LoadReport | WorkerLost | Completion):
            t = view.apply(msg)
            if t is not None:
                now = max(now, t)
        elif isinstance(msg, ChatRequest):
            if msg.request_id in decided:
                continue  # a redelivered request: the live scheduler decided it once
            decided.add(msg.request_id)
            now = max(now, msg.arrival_ms)
            report.decisions.append(_decide(router, view, msg, now, recorded.get(msg.request_id), top_k))
        elif isinstance(msg, Assignment) and msg.request.request_id not in decided:
            # Assignments of requests decided before the window still count as pending/in flight.
            view.note_assignment(msg, now)
    return report


def replay_any(
    records: Iterable[RawRecord],
    policy: str | None = None,
    router_overrides: dict[str, Any] | None = None,
    view_settings: ViewSettings | None = None,
    block_size: int | None = None,
    top_k: int = 3,
) -> ReplayReport | ExactReport:
    """Exact replay when the recorded assignments carry their input positions, else approximate."""
    raw = list(records)
    assignments, dead = assignment_records(raw)
    if not has_inputs([a for _, a in assignments]):
        return replay(raw, policy, router_overrides, view_settings, block_size, top_k)
    # state records are decoded (and their dead counted) by the exact replay itself; requests only here
    others_dead = 0
    for r in raw:
        if r.topic != ASSIGNMENTS.name and r.topic not in STATE_TOPICS:
            try:
                decode(r.value)
            except SchemaError:
                others_dead += 1
    return replay_exact(
        raw, assignments, policy, router_overrides, view_settings, block_size, dead + others_dead
    )


def _decide(
    router: Router, view: HeldView, req: ChatRequest, now: int, rec: Assignment | None, top_k: int
) -> ReplayedDecision:
    d = view.decide_noting(router, req, now, rec)
    a = d.assignment
    outcome = "assigned" if a is not None else ("deferred" if d.deferred else "rejected")
    return ReplayedDecision(
        request_id=req.request_id,
        now_ms=now,
        recorded_worker=None if rec is None else rec.worker_id,
        replayed_worker=None if a is None else a.worker_id,
        outcome=outcome,
        reason=d.reason,
        candidates=d.candidates[:top_k],
        recorded_ttft_ms=None if rec is None else rec.estimate.ttft_ms,
        replayed_ttft_ms=None if a is None else a.estimate.ttft_ms,
    )


def read_window(path: str | Path) -> list[RawRecord]:
    """Every record of a recording file."""
    try:
        return list(read_recording(path))
    except OSError as exc:
        raise ReplayError(f"cannot read recording {path}: {exc}") from exc


def fetch_window(
    kafka: KafkaSettings,
    topics: list[TopicSpec],
    *,
    from_offsets: dict[tuple[str, int], int] | None = None,
    since_ms: int | None = None,
    until_ms: int | None = None,
    max_records: int | None = None,
) -> list[RawRecord]:
    """Record a window straight from Kafka (through a temporary file) and read it back."""
    with tempfile.TemporaryDirectory(prefix="kvmesh-replay-") as tmp:
        path = Path(tmp) / "window.rec"
        asyncio.run(
            record_topics(
                kafka,
                topics,
                path,
                from_offsets=from_offsets,
                since_ms=since_ms,
                until_ms=until_ms,
                max_records=max_records,
            )
        )
        return read_window(path)


def format_decision(d: ReplayedDecision | ExactDecision, top_k: int = 3) -> str:
    """One line per request: recorded vs replayed worker, a divergence flag, the top candidates."""
    if isinstance(d, ExactDecision) and not d.reproducible:
        return f"UNREPRODUCIBLE {d.request_id:<24} seq={d.decision_seq:<6} {d.why}"
    flag = "DIVERGED" if d.diverged else "same    "
    top = " | ".join(
        f"{c.worker_id} ttft={c.ttft_ms:.1f} q={c.queue_ms:.1f} cached={c.cached_blocks} "
        f"fetch={c.fetch_blocks}"
        for c in d.candidates[:top_k]
    )
    replayed = d.replayed_worker or d.outcome
    line = (
        f"{flag} {d.request_id:<24} now={d.now_ms:<14} recorded={d.recorded_worker or '-':<10} "
        f"replayed={replayed:<10} top: {top}"
    )
    q = d.quality if isinstance(d, ExactDecision) else None
    if q is not None:
        # the recorded decision's prediction against what the request really got
        line += (
            f" | ttft predicted={q.predicted_ttft_ms:.1f} observed={q.observed_ttft_ms:.1f}"
            f" hit predicted={q.predicted_hit_tokens} achieved={q.achieved_hit_tokens}/{q.prompt_tokens}"
        )
    return line


def explain(d: ExactDecision | ReplayedDecision) -> str:
    """Every candidate of one decision with each part of its estimate, the decision's input positions,
    and what the request really got (its Completion), beside the recorded and replayed choices."""
    lines = [
        f"request {d.request_id}: recorded {d.recorded_worker or '-'}, replayed "
        f"{d.replayed_worker or d.outcome}" + (f" ({d.reason})" if d.reason else ""),
        f"now_ms {d.now_ms}",
    ]
    if isinstance(d, ExactDecision):
        lines.append(f"scheduler {d.scheduler_id} decision_seq {d.decision_seq}; view lag {d.lag_ms} ms")
        if not d.reproducible:
            lines.append(f"NOT REPRODUCIBLE: {d.why}")
        pos = ", ".join(f"{k}={v}" for k, v in sorted(d.positions.items())) or "-"
        lines.append(f"inputs applied up to: {pos}")
    head = (
        f"{'worker':<12}{'ttft ms':>10}{'queue':>10}{'promote+fetch':>15}{'recompute':>11}"
        f"{'cached':>8}{'fetch':>7}  from"
    )
    lines.append(head)
    for c in d.candidates:
        lines.append(
            f"{c.worker_id:<12}{c.ttft_ms:>10.1f}{c.queue_ms:>10.1f}{c.transfer_ms:>15.1f}"
            f"{c.recompute_ms:>11.1f}{c.cached_blocks:>8}{c.fetch_blocks:>7}  {c.fetch_from or '-'}"
        )
    if isinstance(d, ExactDecision):
        done = d.completion
        if done is None:
            lines.append("outcome: no Completion in the recording")
        else:
            lines.append(
                f"outcome on {done.worker_id}: ttft {done.ttft_ms:.1f} ms "
                f"(estimated {d.recorded_ttft_ms or 0:.1f}); reused {done.reused_tokens}, "
                f"fetched {done.fetched_tokens}, recomputed {done.recomputed_tokens} tokens"
            )
        if d.fetch_planned:
            verdict = "needless: a fresher view had the blocks on a worker at least as good"
            lines.append("fetch plan: " + (verdict if d.needless_fetch else "needed"))
    return "\n".join(lines)
