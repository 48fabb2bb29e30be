"""The directory's change set: which Redis keys a change touched since the last flush.

Only keys are kept, never values: the write-behind (:mod:`services.kvmanager.write_behind`) reads the
values from memory when it builds a flush, so a key changed a thousand times is written once.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass(slots=True)
class DirtyKeys:
    """Keys changed since the last successful flush. Values are read from memory when the flush is
    built, so each key is written once with its latest value however often it changed."""

    blocks: set[int] = field(default_factory=set)  # {kvm}:holders fields (holders or parent changed)
    worker_add: defaultdict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    worker_rem: defaultdict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    worker_reset: set[str] = field(default_factory=set)  # rewrite the whole set (after a clear)
    workers: set[str] = field(default_factory=set)
    offsets: bool = False
    seqs: set[tuple[str, int, str]] = field(default_factory=set)
    stats: bool = False

    def size(self) -> int:
        return (
            len(self.blocks)
            + sum(len(s) for s in self.worker_add.values())
            + sum(len(s) for s in self.worker_rem.values())
            + len(self.workers)
            + len(self.seqs)
        )

    def empty(self) -> bool:
        return not (
            self.blocks
            or self.worker_add
            or self.worker_rem
            or self.worker_reset
            or self.workers
            or self.offsets
            or self.seqs
            or self.stats
        )
