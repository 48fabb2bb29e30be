"""How each request of a live run went, and the run as the simulator's result (same summary, same
plots)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.sim.engine import SimResult
from kvmesh.sim.metrics import RequestRecord


@dataclass(slots=True)
class TurnRecord:
    """How one request of the live run went; times in seconds since the run started (client clock)."""

    session_id: str
    turn: int
    request_id: str
    worker_id: str
    submit_s: float
    first_token_s: float
    done_s: float
    prompt_tokens: int
    reused_tokens: int
    fetched_tokens: int
    recomputed_tokens: int
    output_tokens: int
    worker_ttft_ms: float  # assignment receipt -> first token, measured by the worker
    worker_e2e_ms: float  # assignment receipt -> Completion, measured by the worker (0: unknown)
    finish_reason: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("stop", "length")

    def busy_interval(self) -> tuple[float, float]:
        """When the worker held this request: its own duration, measured back from the Completion's
        arrival (the reply lag shifts both ends alike), never before the request was submitted."""
        if self.worker_e2e_ms > 0:
            start = self.done_s - self.worker_e2e_ms / 1000.0
        else:  # HTTP gives no worker e2e: the worker's TTFT back from the first token's arrival
            start = self.first_token_s - self.worker_ttft_ms / 1000.0
        return max(start, self.submit_s), self.done_s


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once; empty or reversed ones ignored)."""
    total = 0.0
    start: float | None = None
    end = 0.0
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if start is None or a > end:
            if start is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if start is not None:
        total += end - start
    return total


def to_sim_result(policy: str, records: Sequence[TurnRecord], worker_ids: Sequence[str]) -> SimResult:
    """The live run as a :class:`SimResult` (ms), so the simulator's summary and plots apply unchanged.

    Failed requests are left out of the records and counted as ``rejected``.
    """
    ids = list(worker_ids)
    for r in records:
        if r.ok and r.worker_id not in ids:
            ids.append(r.worker_id)  # a worker the caller did not know of (an existing stack)
    index = {w: i for i, w in enumerate(ids)}
    ok = [r for r in records if r.ok]
    sim_records = [
        RequestRecord(
            worker=index[r.worker_id],
            arrival_ms=r.submit_s * 1000.0,
            first_token_ms=r.first_token_s * 1000.0,
            done_ms=r.done_s * 1000.0,
            prompt_tokens=r.prompt_tokens,
            reused_tokens=r.reused_tokens,
            fetched_tokens=r.fetched_tokens,
            recomputed_tokens=r.recomputed_tokens,
            output_tokens=r.output_tokens,
        )
        for r in ok
    ]
    sim_records.sort(key=lambda rec: (rec.arrival_ms, rec.worker))
    busy_ms = [1000.0 * union_length([r.busy_interval() for r in ok if r.worker_id == w]) for w in ids]
    return SimResult(
        policy=policy,
        records=sim_records,
        busy_ms=busy_ms,
        worker_ids=ids,
        rejected=len(records) - len(ok),
        deferrals=0,
        arrivals=len(records),
    )


def summarize_live(policy: str, records: Sequence[TurnRecord], worker_ids: Sequence[str]) -> dict[str, Any]:
    """The simulator's summary of a live run, plus ``errors`` and ``worker_ids``."""
    result = to_sim_result(policy, records, worker_ids)
    summary = result.summary()
    summary["errors"] = result.rejected
    summary["worker_ids"] = list(result.worker_ids)
    return summary
