"""A simulated worker's KV cache: block hashes in GPU, DRAM and disk tiers, each an LRU.

The cache holds only identities (no bytes). Prefill writes go to the GPU tier, blocks pulled from a
peer to the tier :meth:`TieredCache.insert` names; when a tier is over capacity
its least recently used block is demoted one tier down (GPU -> DRAM -> disk -> dropped), the way the
real worker's ``tiers.py`` demotes. A tier of capacity 0 is skipped.

Fleet-aware eviction, as the live worker's ``kv_cache_manager`` does it: with a :class:`FleetHolders`
shared by the fleet's caches, the victim is the least recently used block *that another worker also
holds* among the ``VICTIM_WINDOW`` least recent ones (else the least recent), and a DRAM victim with
a copy elsewhere is dropped rather than demoted to disk (disk keeps last copies). The live worker
counts copies from kv-events a moment late; here the count is exact. Every change is recorded as a
run of ``(kind, tier, from_tier, hashes, parents)`` so the worker can publish the same KvEvents a
real worker would::

    access([h0 h1 h2])   h0 in gpu   -> touched (no event)
                         h1 in dram  -> moved dram->gpu
                         h2 absent   -> stored gpu            (then LRU demotions if gpu is full)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import islice

from schemas.messages import TIERS

#: One recorded change: (kind, tier, from_tier, block hashes, parent hashes (stored only)).
Change = tuple[str, str, str | None, list[int], list[int]]


#: LRU candidates the fleet-aware victim choice looks at (the live worker's window too).
VICTIM_WINDOW = 64


class FleetHolders:
    """How many of the fleet's caches hold each block (any tier); shared by every TieredCache."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def add(self, h: int) -> None:
        self.counts[h] = self.counts.get(h, 0) + 1

    def remove(self, h: int) -> None:
        n = self.counts[h] - 1
        if n:
            self.counts[h] = n
        else:
            del self.counts[h]

    def held_elsewhere(self, h: int) -> bool:
        """For a block this cache holds: whether another cache holds it too."""
        return self.counts.get(h, 0) > 1


@dataclass(slots=True)
class _ChangeLog:
    """Consecutive changes of the same (kind, tier, from_tier) merged into one run."""

    runs: list[Change] = field(default_factory=list)

    def add(self, kind: str, tier: str, from_tier: str | None, h: int, parent: int | None = None) -> None:
        if self.runs:
            last = self.runs[-1]
            if last[0] == kind and last[1] == tier and last[2] == from_tier:
                last[3].append(h)
                if parent is not None:
                    last[4].append(parent)
                return
        self.runs.append((kind, tier, from_tier, [h], [] if parent is None else [parent]))


class TieredCache:
    """Owns the block hashes of one worker. Invariants: a hash is in at most one tier
    (``_where`` names it), and no tier holds more than its capacity after a call returns."""

    __slots__ = ("_caps", "_fleet", "_tiers", "_where")

    def __init__(
        self,
        gpu_blocks: int,
        dram_blocks: int = 0,
        disk_blocks: int = 0,
        fleet: FleetHolders | None = None,
    ) -> None:
        self._caps = (gpu_blocks, dram_blocks, disk_blocks)
        self._tiers: tuple[OrderedDict[int, None], ...] = (OrderedDict(), OrderedDict(), OrderedDict())
        self._where: dict[int, int] = {}
        self._fleet = fleet  # None: plain LRU

    def tier_of(self, h: int) -> int | None:
        """Index into ``TIERS`` of the tier holding ``h``, or None."""
        return self._where.get(h)

    def prefix_tiers(self, hashes: list[int]) -> list[int]:
        """Tier index of each leading block of ``hashes`` held here, up to the first missing one."""
        out: list[int] = []
        where = self._where
        for h in hashes:
            t = where.get(h)
            if t is None:
                break
            out.append(t)
        return out

    def used(self, tier: int) -> int:
        return len(self._tiers[tier])

    def capacity(self, tier: int) -> int:
        return self._caps[tier]

    def access(self, hashes: list[int], parents: list[int]) -> list[Change]:
        """Bring ``hashes`` (with their ``parents``) into the GPU tier as most recently used."""
        log = _ChangeLog()
        gpu = self._tiers[0]
        where = self._where
        busy = frozenset(hashes) if self._fleet is not None else frozenset()
        for h, parent in zip(hashes, parents, strict=True):
            t = where.get(h)
            if t == 0:
                gpu.move_to_end(h)
                continue
            if t is None:
                log.add("stored", TIERS[0], None, h, parent)
                if self._fleet is not None:
                    self._fleet.add(h)
            else:
                del self._tiers[t][h]
                log.add("moved", TIERS[0], TIERS[t], h)
            gpu[h] = None
            where[h] = 0
            self._settle(0, log, busy)
        return log.runs

    def insert(self, hashes: list[int], parents: list[int], tier: int) -> list[Change]:
        """Add the ``hashes`` held nowhere here to ``tier`` as its most recently used (blocks pulled
        from a peer: the live ``commit_blocks`` skips blocks already held and leaves the rest where
        it put them). A tier of capacity 0 puts them in the GPU tier instead."""
        if self._caps[tier] == 0:
            tier = 0
        log = _ChangeLog()
        store = self._tiers[tier]
        where = self._where
        busy = frozenset(hashes) if self._fleet is not None else frozenset()
        for h, parent in zip(hashes, parents, strict=True):
            if h in where:
                continue
            log.add("stored", TIERS[tier], None, h, parent)
            if self._fleet is not None:
                self._fleet.add(h)
            store[h] = None
            where[h] = tier
            self._settle(tier, log, busy)
        return log.runs

    def _settle(self, tier: int, log: _ChangeLog, busy: AbstractSet[int] = frozenset()) -> None:
        """Demote (or drop) victims from ``tier`` down while any tier is over capacity.

        ``busy``: the blocks of the call in progress, which the fleet-aware choice leaves alone (the
        live worker never evicts blocks a running request references).
        """
        while tier < len(self._tiers) and len(self._tiers[tier]) > self._caps[tier]:
            h = self._victim(tier, busy)
            del self._tiers[tier][h]
            below = tier + 1
            while below < len(self._tiers) and self._caps[below] == 0:
                below += 1
            if below >= len(self._tiers) or (
                # from DRAM, a block with a copy elsewhere is dropped: disk keeps last copies
                tier == 1 and self._fleet is not None and self._fleet.held_elsewhere(h)
            ):
                del self._where[h]
                if self._fleet is not None:
                    self._fleet.remove(h)
                log.add("removed", TIERS[tier], None, h)
                continue
            self._tiers[below][h] = None
            self._where[h] = below
            log.add("moved", TIERS[below], TIERS[tier], h)
            self._settle(below, log, busy)

    def _victim(self, tier: int, busy: AbstractSet[int]) -> int:
        """The least recent block of ``tier``, preferring (fleet-aware) one held elsewhere too."""
        store = self._tiers[tier]
        fleet = self._fleet
        if fleet is not None:
            for h in islice(store, VICTIM_WINDOW):
                if h not in busy and fleet.held_elsewhere(h):
                    return h
        return next(iter(store))
