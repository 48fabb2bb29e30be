"""Gaps in a worker's KV events, seen by a consumer (KV manager, scheduler).

Workers number their KV events (``KvEvent.seq``, 1, 2, ... within ``epoch``, the worker's start
time). A consumer that sees the next number applies the event. One that sees a jump has missed events
(a record lost, a partition read from the wrong place): what it knows of that worker may be wrong, so
it asks the worker to resync (:class:`~schemas.messages.ResyncRequest`), and applies nothing more from
that worker until a ``cleared`` arrives (a ``cleared`` always applies: it resets the worker's whole
state, whoever asked for it). An event older than the last one applied (a
redelivery, or one that arrives after a later one) is dropped: the resync, if any, covers it. A new
epoch is a restarted worker: it starts at 1 with nothing held, so the count starts again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from schemas.messages import KvEvent

Verdict = Literal["apply", "drop", "gap"]

#: While a resync is awaited, every this many dropped events the worker is asked again.
ASK_AGAIN_AFTER = 256


@dataclass(slots=True)
class _Worker:
    epoch: int
    seq: int
    awaiting_resync: bool = False
    dropped: int = 0  # events dropped while awaiting the resync


class KvSequence:
    """Per worker: the last (epoch, seq) applied, and whether a resync is awaited. Pure."""

    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        self.gaps = 0
        self.dropped = 0

    def observe(self, ev: KvEvent) -> Verdict:
        """``apply`` the event, ``drop`` it, or ``gap``: drop it and ask the worker to resync (only
        the first event of a gap says ``gap``; the rest are dropped until the resync begins)."""
        if ev.seq <= 0:
            return "apply"  # unnumbered (an older worker): nothing to check
        w = self._workers.get(ev.worker_id)
        if w is None or ev.epoch > w.epoch:
            # first sight of this worker, or a restarted one: take the count from here
            self._workers[ev.worker_id] = _Worker(ev.epoch, ev.seq)
            return "apply"
        if ev.epoch < w.epoch or ev.seq <= w.seq:
            self.dropped += 1
            return "drop"  # a previous instance's, a redelivery, or overtaken
        if ev.kind == "cleared":
            # a full reset (a resync begins with it): whatever was missed before no longer matters
            w.seq, w.awaiting_resync, w.dropped = ev.seq, False, 0
            return "apply"
        if w.awaiting_resync:
            w.seq = ev.seq
            w.dropped += 1
            self.dropped += 1
            # the request (or the resync's first record) may itself have been lost: ask again
            return "gap" if w.dropped % ASK_AGAIN_AFTER == 0 else "drop"
        if ev.seq == w.seq + 1:
            w.seq = ev.seq
            return "apply"
        w.seq, w.awaiting_resync = ev.seq, True
        self.gaps += 1
        return "gap"

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
