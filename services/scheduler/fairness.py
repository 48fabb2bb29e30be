"""Deadlines and tenant fairness: who gets decided next, and who is turned away.

Requests wait in one queue per tenant; :class:`FairDispatcher` serves the tenants by deficit round robin
with a quantum of prompt tokens, so a tenant flooding the fleet gets its share per round and every other
tenant's requests are decided before the flood drains::

    round 1:  A +quantum → A1 A2 A3 (until A's deficit is spent)   B +quantum → B1   C → C1 C2
    round 2:  A +quantum → A4 A5 A6 ...

Within a tenant, requests go by *virtual finish time*: arrival plus the least prefill the fleet could do
for them when they were queued (``policies.least_prefill_ms``: the rest of the prompt after its longest
cached prefix), ties in arrival order. While the fleet holds (late binding), a request that costs 10 ms
does not wait behind one that arrived 5 ms earlier and costs 2 s, while one that arrived seconds
earlier still goes first: a short job's lead is bounded by its own work, so nothing starves, and the
order needs no tuned constant. A request that finds its tenant's queue empty is decided at once (or
is the oldest held one), so it is not priced.

A tenant at its in-flight cap (RouterSettings.tenant_max_inflight) is skipped until Completions free a
slot; a fleet-wide hold (no live worker, overload) stops the drain until the next event. A queued request
whose deadline passed is rejected at the next drain, wherever it is in its queue.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from schemas.messages import ChatRequest, Completion
from services.scheduler.policies import least_prefill_ms

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


class TenantQueue:
    """One tenant's held requests, lowest virtual finish time first (ties by submit order).

    A binary heap of ``(key, seq, request)``: the head and a pop cost O(log n) however many requests an
    overloaded fleet holds; removing from the middle (a cancel, an expired deadline) rebuilds it.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, ChatRequest]] = []
        # No held request's deadline is earlier than this (it may be stale-low after a pop: a scan then
        # finds nothing and makes it exact). Without it, every drain scanned every held request for
        # expired deadlines: a quarter of an overloaded simulation's time.
        self.min_deadline_ms: float = math.inf

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[ChatRequest]:
        """In no particular order."""
        return (e[2] for e in self._heap)

    def push(self, key: float, seq: int, req: ChatRequest) -> None:
        heapq.heappush(self._heap, (key, seq, req))
        if req.deadline_ms is not None and req.deadline_ms < self.min_deadline_ms:
            self.min_deadline_ms = req.deadline_ms

    def head(self) -> ChatRequest:
        return self._heap[0][2]

    def pop(self) -> ChatRequest:
        return heapq.heappop(self._heap)[2]

    def remove_if(self, drop: Callable[[ChatRequest], bool]) -> list[ChatRequest]:
        """Remove every request ``drop`` selects; return them in queue order."""
        keep: list[tuple[float, int, ChatRequest]] = []
        gone: list[tuple[float, int, ChatRequest]] = []
        for e in self._heap:
            (gone if drop(e[2]) else keep).append(e)
        if gone:
            self._heap = keep
            heapq.heapify(keep)
        self.min_deadline_ms = min(
            (e[2].deadline_ms for e in self._heap if e[2].deadline_ms is not None), default=math.inf
        )
        return [e[2] for e in sorted(gone)]


class FairDispatcher:
    """Owns the per-tenant queues of requests not yet decided and their DRR deficits.

    Invariants: a tenant is in ``_active`` iff its queue is non-empty; requests of one tenant are
    decided in virtual-finish order (see the module doc), which is submit order among equals; a
    deferred request stays at the head of its queue unless one that should finish sooner arrives.
    """

    def __init__(self, router: Router, quantum_tokens: int = 4096) -> None:
        self.router = router
        self.quantum_tokens = max(1, quantum_tokens)
        self._queues: dict[str, TenantQueue] = {}
        self._seq = 0
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
            q = self._queues[req.tenant] = TenantQueue()
        if not q:
            self._active.append(req.tenant)
            self._deficit[req.tenant] = 0
            key = -math.inf  # decided at the next drain, or the oldest request held: not priced
        else:
            # priced at its arrival (event time): the same ordered input orders the same way
            key = req.arrival_ms + least_prefill_ms(self.router.view, req, req.arrival_ms)
        self._seq += 1
        q.push(key, self._seq, req)
        self._queued += 1

    def cancel(self, request_id: str) -> ChatRequest | None:
        """Remove a queued request (the client went away). None when it is not queued."""
        for tenant, q in self._queues.items():
            gone = q.remove_if(lambda r: r.request_id == request_id)
            if gone:
                self._queued -= len(gone)
                if not q:
                    self._active.remove(tenant)
                return gone[0]
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
                    req = q.head()
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
                    q.pop()
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
            if q.min_deadline_ms >= now_ms:
                continue  # no held request is past its deadline (deadline_rejection's rule)
            for req in q.remove_if(lambda r: deadline_rejection(r, now_ms) is not None):
                rejected = deadline_rejection(req, now_ms) or rejection(req, "deadline exceeded")
                out.append(Decision(None, rejected, [], reason="deadline"))
                self._queued -= 1
            if not q:
                self._active.remove(tenant)
                self._deficit[tenant] = 0
