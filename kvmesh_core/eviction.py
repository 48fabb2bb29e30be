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

from collections import deque
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from itertools import compress, count, islice

#: LRU candidates the victim choice looks at.
VICTIM_WINDOW = 64

HeldElsewhere = Callable[[int], bool]


def pick_victim(
    window: Sequence[int], held_elsewhere: HeldElsewhere | None, retained: Container[int] = ()
) -> int | None:
    """Index into ``window`` (evictable blocks, least recent first) of the block to evict, looking at
    its first VICTIM_WINDOW only; None when there is none. The first block with the best possible key
    ends the search (this runs on every eviction)."""
    window = window[:VICTIM_WINDOW]
    if not retained:
        # the key is (held elsewhere? 0 : 1, 0): the first copy held elsewhere, else the least recent
        if held_elsewhere is not None:
            for i, h in enumerate(window):
                if held_elsewhere(h):
                    return i
        return 0 if window else None
    best: int | None = None
    best_key = (2, 2)
    for i, h in enumerate(window):
        key = (0 if held_elsewhere is not None and held_elsewhere(h) else 1, 1 if h in retained else 0)
        if key < best_key:
            best, best_key = i, key
            if key == (0, 0):
                break
    return best


def victims_in_turn(candidates: Iterable[int], held_elsewhere: HeldElsewhere | None) -> Iterator[int]:
    """The victims that repeated :func:`pick_victim` calls (no retained blocks) would pick, one per
    ``next``, when each victim leaves ``candidates`` and nothing else changes between the picks.

    One call of the rule checks up to VICTIM_WINDOW blocks; evicting k blocks that way checks up to
    64·k, all but one of them already checked by the call before. This remembers how many leading
    candidates are known not to be held elsewhere, so each block is checked once: an overloaded
    simulation spent a third of its time re-checking them. ``candidates`` is read lazily, at most
    VICTIM_WINDOW ahead of the victims taken."""
    source = iter(candidates)
    window: deque[int] = deque(islice(source, VICTIM_WINDOW))
    clean = 0  # window[:clean] are known not to be held elsewhere
    while window:
        found = None
        if held_elsewhere is not None and clean < len(window):
            # the first held block at or after ``clean``, found in C when held_elsewhere is a builtin
            hits = compress(count(clean), map(held_elsewhere, islice(window, clean, None)))
            found = next(hits, None)
            clean = len(window) if found is None else found
        if found is None:
            yield window.popleft()
            clean = max(clean - 1, 0)
        else:
            yield window[found]
            del window[found]  # the blocks before it are still clean
        window.extend(islice(source, 1))


def dram_victim_to_disk(h: int, held_elsewhere: HeldElsewhere | None, retained: Container[int] = ()) -> bool:
    """Whether a block leaving DRAM is kept on disk (when disk has room) rather than dropped."""
    return held_elsewhere is None or not held_elsewhere(h) or h in retained
