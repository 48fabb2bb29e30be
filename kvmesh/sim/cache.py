"""A simulated worker's KV cache: block hashes in GPU, DRAM and disk tiers, each an LRU.

The cache holds only identities (no bytes) and follows the live worker's KvCacheManager step for step:
room is made before a block is placed, victims and demote-or-drop come from ``kvmesh_core.eviction``
(the rules both call), a prompt's blocks are released last to first, and blocks pulled from a peer go
to the tier :meth:`TieredCache.insert` names (falling back to lower tiers). With a
:class:`FleetHolders` shared by the fleet's caches the choice is fleet-aware; the live worker counts
copies from kv-events a moment late, here the count is exact. ``tests/sim/test_cache_matches_worker.py``
feeds both the same accesses and checks they hold the same blocks in the same tiers. Every change is
recorded as a run of ``(kind, tier, from_tier, hashes, parents)`` so the worker can publish the same
KvEvents a real worker would::

    access([h0 h1 h2])   h0 in gpu   -> reused (no event)
                         h1 in dram  -> moved dram->gpu
                         h2 absent   -> stored gpu            (after room was made: LRU demotions)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from itertools import filterfalse, islice

from kvmesh_core.counts import add_counts, remove_counts
from kvmesh_core.event_runs import EventRun, EventRuns
from kvmesh_core.eviction import VICTIM_WINDOW, HeldElsewhere, dram_victim_to_disk, victims_in_turn
from schemas.messages import TIERS


class FleetHolders:
    """How many of the fleet's caches hold each block (any tier); shared by every TieredCache.

    ``shared`` is the set of blocks two or more caches hold, so that "held elsewhere?" for a block
    a cache holds is a set lookup the eviction rule can run in C (it runs ~30M times in an
    overloaded 12k-request simulation)."""

    __slots__ = ("counts", "held_elsewhere", "shared")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.shared: set[int] = set()
        #: For a block a cache holds: whether another cache holds it too.
        self.held_elsewhere: HeldElsewhere = self.shared.__contains__

    def add(self, h: int) -> None:
        n = self.counts.get(h, 0) + 1
        self.counts[h] = n
        if n == 2:
            self.shared.add(h)

    def remove(self, h: int) -> None:
        n = self.counts[h] - 1
        if n:
            self.counts[h] = n
            if n == 1:
                self.shared.discard(h)
        else:
            del self.counts[h]


class TieredCache:
    """Owns the block hashes of one worker. Invariants: a hash is in at most one tier
    (``_where`` names it), and no tier holds more than its capacity after a call returns."""

    __slots__ = ("_caps", "_fleet", "_parent", "_pinned", "_tiers", "_where")

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
        self._parent: dict[int, int] = {}  # what KvEvents name as each held block's parent
        self._fleet = fleet  # None: plain LRU
        # queued requests' prefixes, kept until their prefills read them (count per hash)
        self._pinned: dict[int, int] = {}

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

    def access(self, hashes: list[int], parents: list[int]) -> list[EventRun]:
        """One prompt, the way the live engine drives its KvCacheManager: the leading run held here
        is reused (lower-tier blocks promoted to the GPU tier, the run's blocks kept from eviction
        meanwhile), room is made for the rest, the missing blocks are stored, and the prompt's blocks
        become the most recent, last to first (kvmesh_core.eviction: the head is kept longest). A
        block held here after a gap in the run stays where it is (the live commit keeps its copy)."""
        log = EventRuns()
        where = self._where
        gpu = self._tiers[0]
        run = 0
        for h in hashes:
            if h not in where:
                break
            run += 1
        busy = set(hashes[:run])
        used: list[int] = []
        for h in hashes[:run]:
            t = where[h]
            if t != 0:
                if not self._make_room(0, 1, log, busy):
                    break  # no room: the hit ends here, the rest is computed
                del self._tiers[t][h]
                gpu[h] = None
                where[h] = 0
                log.add("moved", TIERS[0], h, self._parent[h], TIERS[t])
            used.append(h)
        rest = len(hashes) - len(used)
        if rest and self._make_room(0, rest, log, busy):
            for h, parent in zip(hashes[len(used) :], parents[len(used) :], strict=True):
                if h in where:
                    continue
                gpu[h] = None
                where[h] = 0
                log.add("stored", TIERS[0], h, parent)
                self._parent[h] = parent
                if self._fleet is not None:
                    self._fleet.add(h)
                used.append(h)
        for h in reversed(used):
            gpu.move_to_end(h)
        return log.drain()

    def insert(self, hashes: list[int], parents: list[int], tier: int) -> list[EventRun]:
        """Add the ``hashes`` held nowhere here to ``tier`` as its most recently used, falling back to
        lower tiers when it has no room (blocks pulled from a peer: the live ``commit_blocks``). A
        tier of capacity 0 means the GPU tier."""
        if self._caps[tier] == 0:
            tier = 0
        log = EventRuns()
        where = self._where
        for h, parent in zip(hashes, parents, strict=True):
            if h in where:
                continue
            placed = next(
                (t for t in range(tier, 3) if self._caps[t] and self._make_room(t, 1, log, set())), None
            )
            if placed is None:
                break
            self._tiers[placed][h] = None
            where[h] = placed
            log.add("stored", TIERS[placed], h, parent)
            self._parent[h] = parent
            if self._fleet is not None:
                self._fleet.add(h)
        return log.drain()

    def pin(self, hashes: list[int]) -> None:
        """Evict ``hashes`` only when nothing else is left, until :meth:`unpin`: a queued request's
        prefix, what its pull brought included (the live ``KvCacheManager.hold``)."""
        add_counts(self._pinned, hashes)

    def unpin(self, hashes: list[int]) -> None:
        remove_counts(self._pinned, hashes)

    def _held_elsewhere(self) -> HeldElsewhere | None:
        return self._fleet.held_elsewhere if self._fleet is not None else None

    def _make_room(
        self, tier: int, n: int, log: EventRuns, busy: AbstractSet[int], keep: int | None = None
    ) -> bool:
        """Evict from ``tier`` until ``n`` slots are free: the victim by the fleet rule among its
        least recent blocks other than ``busy`` and ``keep``, demoted or dropped. False when every
        block is busy."""
        store = self._tiers[tier]
        need = n - (self._caps[tier] - len(store))
        if need <= 0:
            return True
        # The victims one after another, each picked by the fleet rule once the one before has gone.
        # Batching them is exact: moving or dropping a victim changes no holder count of another
        # block of this tier (a hash sits in one tier per worker). Listed first, because the store
        # loses each victim while they are read.
        skip = busy if keep is None or keep not in store else {*busy, keep}
        pinned = self._pinned

        def window(of_pinned: bool) -> list[int]:
            free: Iterator[int]
            if of_pinned:
                free = (h for h in store if h in pinned and h not in skip)
            elif pinned:
                free = (h for h in store if h not in skip and h not in pinned)
            else:
                free = filterfalse(skip.__contains__, store)
            return list(islice(free, need + VICTIM_WINDOW))

        held = self._held_elsewhere()
        # pinned blocks go last, but they never block a store (as the live hold)
        for of_pinned in (False, True) if pinned else (False,):
            if not need:
                break
            for h in islice(victims_in_turn(window(of_pinned), held), need):
                del store[h]
                self._demote(tier, h, log, busy)
                need -= 1
        return need == 0

    def _demote(self, tier: int, h: int, log: EventRuns, busy: AbstractSet[int]) -> None:
        """A victim of ``tier`` goes one tier down with room made there, or is dropped
        (kvmesh_core.eviction: DRAM keeps a block on disk only when it is the fleet's last copy)."""
        below: tuple[int, ...] = ()
        if tier == 0:
            below = (1, 2)
        elif tier == 1 and dram_victim_to_disk(h, self._held_elsewhere()):
            below = (2,)
        for b in below:
            # the live worker pins the lower-tier copies of the run being reused: never their victims
            if self._caps[b] and self._make_room(b, 1, log, busy, keep=h):
                self._tiers[b][h] = None
                self._where[h] = b
                log.add("moved", TIERS[b], h, self._parent[h], TIERS[tier])
                return
        del self._where[h]
        if self._fleet is not None:
            self._fleet.remove(h)
        log.add("removed", TIERS[tier], h, self._parent.pop(h))
