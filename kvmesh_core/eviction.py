"""The fleet's eviction rules, once: the live worker's KvCacheManager and the simulator's cache both
call them, so the simulator keeps and drops what the product keeps and drops.

- **Which victim.** Among the ``VICTIM_WINDOW`` least recently used evictable blocks of a tier, the
  smallest of (held by another worker? 0 : 1, retained by a placement hint? 1 : 0, LRU rank): a copy
  the fleet still has elsewhere goes first, a block placement asked to keep goes last, and otherwise
  the least recent. Without fleet copies or hints that is plain LRU. The window keeps the choice O(1).
- **Demote or drop.** A GPU victim moves to DRAM, or to disk when there is no DRAM, or is dropped.
  A DRAM victim moves to disk only if disk is its last copy in the fleet (or it is retained): disk
  keeps what only this worker has. A disk victim is dropped.
- **Order of use.** A request's blocks are released last to first, so its tail is older than its head
  and eviction trims a prefix from its end, keeping the shared head longest.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence
from itertools import islice

#: LRU candidates the victim choice looks at.
VICTIM_WINDOW = 64

HeldElsewhere = Callable[[int], bool]


def pick_victim(
    window: Sequence[int], held_elsewhere: HeldElsewhere | None, retained: Container[int] = ()
) -> int | None:
    """Index into ``window`` (evictable blocks, least recent first, at most VICTIM_WINDOW) of the
    block to evict; None when there is none."""
    found = victim_among(window, held_elsewhere, retained)
    return None if found is None else found[0]


def victim_among(
    candidates: Iterable[int], held_elsewhere: HeldElsewhere | None, retained: Container[int] = ()
) -> tuple[int, int] | None:
    """``(index, block)`` of the victim among the first VICTIM_WINDOW of ``candidates`` (evictable,
    least recent first, read lazily); None when there is none. The first block with the best
    possible key ends the search: this runs on every eviction, and a lazy window with an early stop
    keeps it from building and scanning 64 candidates for each victim."""
    window = islice(candidates, VICTIM_WINDOW)
    first: tuple[int, int] | None = None
    if not retained:
        # the key is (held elsewhere? 0 : 1, 0): the first copy held elsewhere, else the least recent
        for i, h in enumerate(window):
            if held_elsewhere is None or held_elsewhere(h):
                return i, h
            if first is None:
                first = (i, h)
        return first
    best_key = (2, 2)
    for i, h in enumerate(window):
        key = (0 if held_elsewhere is not None and held_elsewhere(h) else 1, 1 if h in retained else 0)
        if key < best_key:
            first, best_key = (i, h), key
            if key == (0, 0):
                break
    return first


def dram_victim_to_disk(h: int, held_elsewhere: HeldElsewhere | None, retained: Container[int] = ()) -> bool:
    """Whether a block leaving DRAM is kept on disk (when disk has room) rather than dropped."""
    return held_elsewhere is None or not held_elsewhere(h) or h in retained
