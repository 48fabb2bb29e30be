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
Known limit: the live loop decides a polled batch of requests after the state records of the same
poll, and a multi-tenant FairDispatcher may reorder requests; a replay decides one request at a time
in record order, so a decision made under load may diverge for that reason alone.
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
from schemas.codec import decode
from schemas.errors import SchemaError
from schemas.messages import Assignment, ChatRequest, Completion, KvEvent, LoadReport, WorkerLost
from services.scheduler.router import CandidateScore, Router, RouterSettings
from services.scheduler.view import FleetView, ViewSettings
from streams.recording import RawRecord, read_recording, record_topics
from streams.settings import KafkaSettings
from streams.topics import ASSIGNMENTS, REQUESTS, TopicSpec

#: Sort rank of a topic among records with equal timestamps: state first, then requests, then outputs.
_TOPIC_RANK = {REQUESTS.name: 1, ASSIGNMENTS.name: 2}


class _ReplayView(FleetView):
    """A FleetView whose router-side ``note_assignment`` can be held back, so that the replayer notes
    the recorded assignment instead. Invariant: while ``hold`` is set, nothing is noted."""

    hold: bool = False

    def note_assignment(self, a: Assignment, now_ms: int) -> None:
        if not self.hold:
            super().note_assignment(a, now_ms)


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

    def to_json(self, only_divergent: bool = False) -> dict[str, Any]:
        shown = [d for d in self.decisions if d.diverged or not only_divergent]
        return {
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
    view = _ReplayView(block_size, view_settings)
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
        if isinstance(msg, KvEvent):
            view.apply_kv_event(msg)
            now = max(now, msg.event_ms)
        elif isinstance(msg, LoadReport):
            view.apply_load(msg)
            now = max(now, msg.report_ms)
        elif isinstance(msg, WorkerLost):
            view.apply_worker_lost(msg)
            now = max(now, msg.declared_ms)
        elif isinstance(msg, Completion):
            view.note_completion(msg)
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


def _decide(
    router: Router, view: _ReplayView, req: ChatRequest, now: int, rec: Assignment | None, top_k: int
) -> ReplayedDecision:
    view.hold = True
    try:
        d = router.decide(req, now)
    finally:
        view.hold = False
    if rec is not None:
        view.note_assignment(rec, now)
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


def format_decision(d: ReplayedDecision) -> str:
    """One line per request: recorded vs replayed worker, a divergence flag, the top candidates."""
    flag = "DIVERGED" if d.diverged else "same    "
    top = " | ".join(
        f"{c.worker_id} ttft={c.ttft_ms:.1f} q={c.queue_ms:.1f} cached={c.cached_blocks} "
        f"fetch={c.fetch_blocks}"
        for c in d.candidates
    )
    replayed = d.replayed_worker or d.outcome
    return (
        f"{flag} {d.request_id:<24} now={d.now_ms:<14} recorded={d.recorded_worker or '-':<10} "
        f"replayed={replayed:<10} top: {top}"
    )
