"""Which planned blocks a worker pulls from a peer: the rule the live worker and the simulator share.

A block is useful only after every block before it (the chain), so a planned run is pulled from where
the local prefix ends, a run already held is skipped, and a gap before a run ends the plan: the rest
of the prompt is recomputed::

    prompt blocks   0 1 2 3 4 5 6 7
    held locally    ■ ■ ■
    run 2..6        pull 3..6 (2 is here)
    run 5..6        gap (3 and 4 missing): stop

While a pull is on the link its blocks are coming (:class:`PullsInFlight`): a request queued after it
whose next blocks it carries waits for it and reuses them, rather than compute them beside it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import Enum
from typing import Generic, TypeVar

T = TypeVar("T")


class Step(Enum):
    HELD = "held"  # every block of the run is already here: next run
    GAP = "gap"  # blocks before the run are missing: stop, recompute the rest
    PULL = "pull"  # pull from the returned position on


def plan_step(first_block: int, n_blocks: int, have: int) -> tuple[Step, int]:
    """What to do with the run ``[first_block, first_block + n_blocks)`` when the first ``have``
    blocks of the prompt are held: (step, first position to pull)."""
    if have >= first_block + n_blocks:
        return Step.HELD, have
    if have < first_block:
        return Step.GAP, have
    return Step.PULL, have


def chain_parents(hashes: list[int], start: int, n: int) -> list[int]:
    """The parent hash of each block of ``hashes[start:start + n]`` (0 for a prompt's first block)."""
    return [hashes[i - 1] if i > 0 else 0 for i in range(start, start + n)]


class PullsInFlight(Generic[T]):
    """The blocks on a worker's link now, by the request (``T``: the caller's record of it) whose pull
    carries them: which pull a request queued now waits for (overlap admission)."""

    def __init__(self) -> None:
        self._by_block: dict[int, T] = {}

    def __bool__(self) -> bool:
        return bool(self._by_block)

    def add(self, hashes: Iterable[int], owner: T) -> None:
        """``owner``'s pull brings ``hashes``."""
        for h in hashes:
            self._by_block[h] = owner

    def remove(self, hashes: Iterable[int], owner: T) -> None:
        """``owner``'s pull ended: its blocks are no longer coming (those a later pull also brings stay
        that pull's)."""
        for h in hashes:
            if self._by_block.get(h) is owner:
                del self._by_block[h]

    def carrier(self, hashes: Sequence[int], local: int) -> T | None:
        """The request whose pull brings the next block of a prompt (``hashes``, ``local`` of them held
        here), which a request of that prompt waits for; None when none does."""
        return self._by_block.get(hashes[local]) if local < len(hashes) else None
