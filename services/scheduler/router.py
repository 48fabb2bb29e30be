"""The router: one request and the fleet view in, one Decision out.

``decide`` applies, in order: the deadline (past it → rejection), the tenant's in-flight cap (→
deferred), the live workers serving the model (none → deferred for ``no_worker_hold_ms`` after arrival,
then rejection), the policy's ranking, and overload (best queue wait above ``max_queue_ms`` → deferred
until ``max_hold_ms`` after arrival, then assigned anyway; only for ``kvmesh``, whose choice is the
least wait in the fleet: the baselines and the peers' routers route at once, as they do). A held
request can also be *pulled* by a worker with room (``decide(..., pull_to=w)``: the same checks, that
worker's estimate; fairness.FairDispatcher says when). The
assignment carries the fetch plan and the estimate, and the router records it in the view
(``note_assignment``; idempotent per request id, so a driver that also calls it does not double-count).

Deterministic: ``now_ms`` comes from the input event, ties break by worker id, no randomness.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh_core.load_reports import LOAD_INTERVAL_MS
from schemas.messages import Assignment, ChatRequest, Completion, Estimate, FetchPlan
from services.scheduler.errors import UnknownPolicy
from services.scheduler.fairness import deadline_rejection, rejection
from services.scheduler.policies import (
    CandidateScore,
    ScoringParams,
    ahead_of,
    holders,
    is_live,
    prefix_workers,
    score_set,
)
from services.scheduler.registry import HOLDING_POLICIES, POLICIES, POLICY_FUNCS, Policy, prepare_view
from services.scheduler.view import FleetView

__all__ = ["POLICIES", "CandidateScore", "Decision", "Router", "RouterSettings"]


@dataclass(slots=True)
class RouterSettings:
    """How the router decides. Times in ms of event time."""

    policy: str = "kvmesh"
    # Late binding: while the best worker already has this much queued, the request waits in the
    # scheduler instead of piling on (held requests are placed later with a fresher view of caches and
    # queues, and in fair-queueing order). Two load intervals (kvmesh_core.load_reports): a queue
    # outlasts the time until the scheduler next hears from its worker, so no busy GPU runs dry.
    # Only HOLDING_POLICIES hold. On the Mooncake trace at 4x (16 workers), 1 s against 2 s: TTFT
    # p50 / p99 0.279 / 9.38 s against 0.286 / 10.9 s; with prefill 1.3, 3.31 / 37.2 s against
    # 4.17 / 35.2 s.
    max_queue_ms: float = 2.0 * LOAD_INTERVAL_MS
    fetch_min_blocks: int = 1  # plan a peer fetch only for at least this many blocks
    tenant_max_inflight: int | None = None  # per-tenant cap on assigned, not yet completed requests
    least_loaded_k: int = 2  # besides cache holders, how many least-loaded workers are scored
    no_worker_hold_ms: int = 2000  # hold a request this long after arrival waiting for a live worker
    # An overloaded fleet holds a request at most this long, then assigns it: a safety valve for a
    # view that never shows a short queue, not a pace. While the fleet drains, the virtual-finish
    # order (fairness.py) already bounds every held request's wait; placing one after a fixed hold
    # only moves the backlog from the scheduler into worker queues, committed early, where its
    # prefix is evicted before it runs. With 30 s, a fleet 4.7x over capacity (the Mooncake trace
    # tiled 3x at 4x speed, 16 workers) reused 0.22 of prompt tokens and took 1,190 s; with 10 min,
    # 0.62 and 596 s, as sglang's router (0.65, 606 s), which never holds.
    max_hold_ms: int = 600_000


@dataclass(slots=True)
class Decision:
    """The router's answer: exactly one of assignment, rejection, or deferred (hold and retry later)."""

    assignment: Assignment | None
    rejection: Completion | None
    candidates: list[CandidateScore]
    deferred: bool = False
    reason: str = ""  # why deferred or rejected: "tenant_cap", "no_live_workers", "overloaded", "deadline"
    held: int = 0  # the view's held count it was decided with (DecisionInputs.held)
    pulled: bool = False  # placed on a worker with room that pulled it (decide's ``pull_to``)


class Router:
    """Owns the decision sequence number of one scheduler replica; reads and notes into the view."""

    def __init__(
        self,
        view: FleetView,
        settings: RouterSettings,
        scheduler_id: str = "scheduler-0",
        policy_func: Policy | None = None,
    ) -> None:
        """``policy_func``: a policy that is not in the registry, named ``settings.policy`` (the
        simulator's perfect-information reference, which reads the simulated workers themselves)."""
        if policy_func is None and settings.policy not in POLICY_FUNCS:
            raise UnknownPolicy(f"unknown policy {settings.policy!r}; choose one of {', '.join(POLICIES)}")
        self.view = view
        self.settings = settings
        self.scheduler_id = scheduler_id
        self.decision_seq = 0
        self._policy = policy_func or POLICY_FUNCS[settings.policy]
        prepare_view(view, settings.policy)
        # Holding pays only when the policy's choice is the least wait in the fleet: a baseline that
        # picks one busy worker (round robin, most cached blocks) would hold everything behind it
        # while other workers idle. Routers that users run instead of kvmesh do not hold either.
        self._holds_when_overloaded = settings.policy in HOLDING_POLICIES
        self._params = ScoringParams(settings.fetch_min_blocks, settings.least_loaded_k)

    def has_room(self, worker_id: str, now_ms: int) -> bool:
        """Whether ``worker_id``'s estimated queue is short enough to take a request now (the
        overload rule of ``decide``: a request whose best worker has no room is held)."""
        ws = self.view.workers.get(worker_id)
        return ws is not None and self.view.queue_ms(ws, now_ms) <= self.settings.max_queue_ms

    def takes_work(self, worker_id: str, now_ms: int) -> bool:
        """Whether ``worker_id`` is still one to wait for: known, reporting, not draining."""
        ws = self.view.workers.get(worker_id)
        return ws is not None and is_live(self.view, ws, now_ms, ws.report.model)

    def price(self, req: ChatRequest, now_ms: int, worker_id: str) -> CandidateScore:
        """The estimate for ``req`` on one worker, fetch from the best holder included."""
        return self._scored(req, now_ms, worker_id, beside_holders=False)[0]

    def price_beside_holders(
        self, req: ChatRequest, now_ms: int, worker_id: str
    ) -> tuple[CandidateScore, list[CandidateScore]]:
        """The estimate for ``req`` on ``worker_id``, and on every other live worker that stores a
        leading run of its prompt or is computing one for a request assigned before it (by id): the
        workers where it costs less work than on one holding none of it. One prefix lookup for all."""
        there, *others = self._scored(req, now_ms, worker_id, beside_holders=True)
        return there, others

    def _scored(
        self, req: ChatRequest, now_ms: int, worker_id: str, beside_holders: bool
    ) -> list[CandidateScore]:
        view = self.view
        found = holders(view, req, now_ms, as_source=True)
        ahead = ahead_of(view, req, now_ms)
        ids = [worker_id]
        if beside_holders:
            ids += sorted(prefix_workers(found, ahead) - {worker_id})
        return score_set(view, req, now_ms, ids, found, self._params, allow_fetch=True, ahead=ahead)

    def decide(self, req: ChatRequest, now_ms: int, pull_to: str | None = None) -> Decision:
        """Decide ``req`` at ``now_ms``. With ``pull_to``, a live worker with room that pulls a held
        request (fairness.FairDispatcher): the checks are the same, but the request is placed there."""
        s = self.settings
        view = self.view
        view.fold_speed()
        rejected = deadline_rejection(req, now_ms)
        if rejected is not None:
            return Decision(None, rejected, [], reason="deadline")
        cap = s.tenant_max_inflight
        if cap is not None and view.tenant_inflight(req.tenant) >= cap:
            return Decision(None, None, [], deferred=True, reason="tenant_cap")
        live = view.live_workers(now_ms, req.model)
        if not live:
            # A request with a deadline waits for a worker until then (the check above rejects it
            # past it): a fleet whose workers are restarting is late, not down. Without a deadline
            # the wait is no_worker_hold_ms.
            if req.deadline_ms is not None or now_ms - req.arrival_ms < s.no_worker_hold_ms:
                return Decision(None, None, [], deferred=True, reason="no_live_workers")
            msg = f"no live worker serves model {req.model!r}"
            return Decision(None, rejection(req, msg), [], reason="no_live_workers")
        if pull_to is not None and pull_to in live:
            candidates = [self.price(req, now_ms, pull_to)]
        else:
            candidates = self._policy(view, req, now_ms, live, self._params)
            pull_to = None
        best = candidates[0]
        if (
            pull_to is None
            and self._holds_when_overloaded
            and best.queue_ms > s.max_queue_ms
            and now_ms - req.arrival_ms < s.max_hold_ms
        ):
            return Decision(None, None, candidates, deferred=True, reason="overloaded", held=view.held)
        self.decision_seq += 1
        assignment = self._assignment(req, best)
        view.note_assignment(assignment, now_ms)
        return Decision(assignment, None, candidates, held=view.held, pulled=pull_to is not None)

    def _assignment(self, req: ChatRequest, best: CandidateScore) -> Assignment:
        fetch: list[FetchPlan] = []
        if best.fetch_from is not None and best.fetch_blocks > 0:
            peer = self.view.workers[best.fetch_from]
            first = best.cached_blocks
            fetch.append(
                FetchPlan(
                    peer_worker=best.fetch_from,
                    peer_address=peer.transfer_address,
                    block_hashes=list(req.block_hashes[first : first + best.fetch_blocks]),
                    first_block=first,
                )
            )
        reused_tokens = (best.cached_blocks + best.fetch_blocks) * req.block_size
        return Assignment(
            request=req,
            worker_id=best.worker_id,
            worker_epoch=self.view.workers[best.worker_id].report.started_ms,
            reuse_blocks=best.cached_blocks,
            prefill_tokens=len(req.token_ids) - reused_tokens,
            estimate=Estimate(
                ttft_ms=best.ttft_ms,
                queue_ms=best.queue_ms,
                recompute_ms=best.recompute_ms,
                transfer_ms=best.transfer_ms,
                policy=self.settings.policy,
                cached_blocks=best.cached_blocks,
                fetched_blocks=best.fetch_blocks,
            ),
            fetch=fetch,
            scheduler_id=self.scheduler_id,
            decision_seq=self.decision_seq,
        )


def decide_all(router: Router, requests: list[ChatRequest]) -> list[Decision]:
    """Decide each request at its own arrival time, in order (replays and tests)."""
    return [router.decide(r, r.arrival_ms) for r in requests]
