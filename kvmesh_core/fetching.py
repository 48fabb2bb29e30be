"""Which planned blocks a worker pulls from a peer: the rule the live worker and the simulator share.

A block is useful only after every block before it (the chain), so a planned run is pulled from where
the local prefix ends, a run already held is skipped, and a gap before a run ends the plan: the rest
of the prompt is recomputed::

    prompt blocks   0 1 2 3 4 5 6 7
    held locally    ■ ■ ■
    run 2..6        pull 3..6 (2 is here)
    run 5..6        gap (3 and 4 missing): stop
"""

from __future__ import annotations

from enum import Enum


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
