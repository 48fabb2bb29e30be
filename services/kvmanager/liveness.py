"""Worker liveness: LoadReports are the heartbeat; a worker silent for too long is declared lost.

The decision is a pure function of the last report time per worker, a "now" and the timeout, so it
is the same live, in replay and in tests. The service decides what "now" is: the largest event time
it has seen (fully deterministic) or that and its own clock tick (so a fleet where every worker died
still gets its WorkerLost messages although no message arrives any more)::

    last_seen_ms ──────────────┤ timeout_ms ├──▶ lost when now_ms - last_seen_ms >= timeout_ms
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from schemas.messages import WorkerLost


@dataclass(frozen=True, slots=True)
class LostWorker:
    worker_id: str
    last_seen_ms: int


def lost_workers(last_seen: Mapping[str, int], now_ms: int, timeout_ms: int) -> list[LostWorker]:
    """Workers whose last report is at least ``timeout_ms`` older than ``now_ms``, by worker id."""
    if timeout_ms <= 0:
        raise ValueError("timeout_ms must be positive")
    return [LostWorker(w, seen) for w, seen in sorted(last_seen.items()) if now_ms - seen >= timeout_ms]


def liveness_now(max_event_ms: int, clock_ms: int | None) -> int:
    """The time liveness is judged at: the latest event seen, or the manager's clock if later."""
    return max_event_ms if clock_ms is None else max(max_event_ms, clock_ms)


def worker_lost_message(lost: LostWorker, declared_ms: int) -> WorkerLost:
    return WorkerLost(worker_id=lost.worker_id, last_seen_ms=lost.last_seen_ms, declared_ms=declared_ms)
