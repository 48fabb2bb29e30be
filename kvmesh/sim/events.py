"""The simulator's event queue: a binary heap ordered by (time, insertion order).

Insertion order breaks ties so two events at the same simulated millisecond run in the order they
were scheduled, which keeps a run deterministic.
"""

from __future__ import annotations

import heapq
from typing import Any


class EventQueue:
    """Owns the pending events. Invariant: ``pop`` returns events in non-decreasing time."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0

    def push(self, time_ms: float, kind: int, payload: Any = None) -> None:
        """Schedule an event of ``kind`` (a small int the engine dispatches on) at ``time_ms``."""
        self._seq += 1
        heapq.heappush(self._heap, (time_ms, self._seq, kind, payload))

    def pop(self) -> tuple[float, int, Any]:
        """The earliest event as ``(time_ms, kind, payload)``."""
        time_ms, _, kind, payload = heapq.heappop(self._heap)
        return time_ms, kind, payload

    def __len__(self) -> int:
        return len(self._heap)
