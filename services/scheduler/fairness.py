"""Deadlines and tenant fairness: who gets decided next, and who is turned away.

Requests wait in one FIFO per tenant; :class:`FairDispatcher` serves the tenants by deficit round robin
with a quantum of prompt tokens, so a tenant flooding the fleet gets its share per round and every other
tenant's requests are decided before the flood drains::

    round 1:  A +quantum → A1 A2 A3 (until A's deficit is spent)   B +quantum → B1   C → C1 C2
    round 2:  A +quantum → A4 A5 A6 ...

A tenant at its in-flight cap (RouterSettings.tenant_max_inflight) is skipped until Completions free a
slot; a fleet-wide hold (no live worker, overload) stops the drain until the next event. A queued request
whose deadline passed is rejected at the next drain, wherever it is in its queue.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING

from schemas.messages import ChatRequest, Completion

if TYPE_CHECKING:
    from services.scheduler.router import Decision, Router


def rejection(req: ChatRequest, error: str) -> Completion:
    """The Completion that tells the client its request was not served, and why."""
    return Completion(
        request_id=req.request_id,
        session_id=req.session_id,
        worker_id="",
        finish_reason="rejected",
        prompt_tokens=len(req.token_ids),
        completion_tokens=0,
        error=error,
    )


def deadline_rejection(req: ChatRequest, now_ms: int) -> Completion | None:
    """A rejection when ``req`` is past its deadline at ``now_ms``, else None."""
    if req.deadline_ms is not None and req.deadline_ms < now_ms:
        late = now_ms - req.deadline_ms
        return rejection(req, f"deadline exceeded: deadline_ms={req.deadline_ms} passed {late} ms ago")
    return None


class FairDispatcher:
    """Owns the per-tenant queues of requests not yet decided and their DRR deficits.

    Invariants: a tenant is in ``_active`` iff its queue is non-empty; requests of one tenant are
    decided in arrival (submit) order; deferred requests stay at the head of their queue.
    """

    def __init__(self, router: Router, quantum_tokens: int = 4096) -> None:
        self.router = router
        self.quantum_tokens = max(1, quantum_tokens)
        self._queues: dict[str, deque[ChatRequest]] = {}
        self._deficit: dict[str, int] = {}
        self._active: deque[str] = deque()
        self._queued = 0
        #: Holds by reason, each try counted (a request held over three drains counts three times).
        self.deferrals: Counter[str] = Counter()

    def __len__(self) -> int:
        return self._queued

    def submit(self, req: ChatRequest) -> None:
        q = self._queues.get(req.tenant)
        if q is None:
            q = self._queues[req.tenant] = deque()
        if not q:
            self._active.append(req.tenant)
            self._deficit[req.tenant] = 0
        q.append(req)
        self._queued += 1

    def cancel(self, request_id: str) -> ChatRequest | None:
        """Remove a queued request (the client went away). None when it is not queued."""
        for tenant, q in self._queues.items():
            for req in q:
                if req.request_id == request_id:
                    q.remove(req)
                    self._queued -= 1
                    if not q:
                        self._active.remove(tenant)
                    return req
        return None

    def drain(self, now_ms: int) -> list[Decision]:
        """Decide queued requests at ``now_ms`` until every tenant is empty, capped or the fleet holds.

        Returns the assignments and rejections made, in decision order; deferred requests stay queued.
        """

        out: list[Decision] = []
        self._expire(now_ms, out)
        blocked: set[str] = set()
        decide = self.router.decide
        while self._active:
            progress = False
            for tenant in list(self._active):
                if tenant in blocked:
                    continue
                q = self._queues[tenant]
                self._deficit[tenant] += self.quantum_tokens
                while q:
                    req = q[0]
                    cost = max(1, len(req.token_ids))
                    if cost > self._deficit[tenant]:
                        progress = True  # it will fit after more quanta
                        break
                    d = decide(req, now_ms)
                    if d.deferred:
                        self.deferrals[d.reason or "other"] += 1
                        # A tenant at its cap, or whose next request's model has no live worker, waits;
                        # the others go on (a model without workers must not stall the rest).
                        if d.reason in ("tenant_cap", "no_live_workers"):
                            blocked.add(tenant)
                            self._deficit[tenant] = 0
                            break
                        self._finish_round()
                        return out  # fleet-wide hold: nothing else can be placed now either
                    q.popleft()
                    self._queued -= 1
                    self._deficit[tenant] -= cost
                    out.append(d)
                    progress = True
                if not q:
                    self._active.remove(tenant)
                    self._deficit[tenant] = 0
            if not progress or all(t in blocked for t in self._active):
                break
        self._finish_round()
        return out

    def _finish_round(self) -> None:
        # the next drain starts with the next tenant, so no tenant is always served first
        if len(self._active) > 1:
            self._active.rotate(-1)

    def _expire(self, now_ms: int, out: list[Decision]) -> None:
        from services.scheduler.router import Decision

        for tenant in list(self._active):
            q = self._queues[tenant]
            keep: deque[ChatRequest] = deque()
            for req in q:
                rejected = deadline_rejection(req, now_ms)
                if rejected is None:
                    keep.append(req)
                else:
                    out.append(Decision(None, rejected, [], reason="deadline"))
                    self._queued -= 1
            self._queues[tenant] = keep
            if not keep:
                self._active.remove(tenant)
                self._deficit[tenant] = 0
