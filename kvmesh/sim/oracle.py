"""A perfect-information greedy router: the simulator's reference for what routing alone can win.

``greedy_oracle`` sends each request to the worker where its true TTFT is least, read from the
simulated workers' real state at the moment of the decision: the iteration in flight, every queued
prompt priced on the real caches at the engine's true speed (``--truth-scale`` and its noise
included), the decode steps each iteration carries. It sees no lagged view, no published profile, no
estimate. It pulls a prefix from the worker holding the longest one when that is faster, and never
holds requests.

It is not a product policy (no live scheduler can read its workers' futures) and is not in the
scheduler's registry; ``kvmesh simulate --policies ...,greedy_oracle`` adds it beside the others. What
it shows:

- against the bound: the part of the excess that no choice of worker at arrival time avoids (the
  decode step in flight, the step a prefill iteration carries, queues that every worker has);
- against kvmesh: what kvmesh's estimates and lagged view lose. Being greedy, it is no limit under
  overload, where one request's choice delays the ones after it (kvmesh prices that, it does not).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvmesh.sim.worker import SimWorker
from schemas.messages import ChatRequest
from services.scheduler.policies import CandidateScore, ScoringParams
from services.scheduler.registry import Policy
from services.scheduler.view import FleetView

ORACLE = "greedy_oracle"


def oracle_policy(workers: Mapping[str, SimWorker], clock: Callable[[], float]) -> Policy:
    """The ``greedy_oracle`` policy over ``workers``; ``clock()`` is the simulated time of the decision
    (the router is handed whole milliseconds, the engine's events are not)."""

    def greedy_oracle(
        view: FleetView, req: ChatRequest, now_ms: int, live: list[str], params: ScoringParams
    ) -> list[CandidateScore]:
        now = clock()
        # the two workers holding the longest prefix now: each candidate may pull from the other one
        held = sorted((-workers[w].held_prefix(req), w) for w in live)[:2]
        out = []
        for w in live:
            src = next((workers[h] for n, h in held if h != w and n < 0), None)
            pr = workers[w].probe(req, now, src)
            out.append(
                CandidateScore(
                    worker_id=w,
                    ttft_ms=pr.ttft_ms,
                    queue_ms=pr.ttft_ms - pr.prefill_ms,
                    recompute_ms=pr.prefill_ms,
                    transfer_ms=0.0,
                    cached_blocks=pr.cached_blocks,
                    fetch_blocks=pr.fetch_blocks,
                    fetch_from=src.worker_id if pr.fetch_blocks and src is not None else None,
                    work_ms=pr.prefill_ms,
                )
            )
        out.sort(key=lambda c: (c.ttft_ms, c.worker_id))
        return out

    return greedy_oracle
