"""The simulated worker's tiered LRU: demotion order and the changes it reports."""

from __future__ import annotations

from kvmesh.sim.cache import FleetHolders, TieredCache
from kvmesh_core.event_runs import EventRun


def runs(rs: list[EventRun]) -> list[tuple[str, str, str | None, list[int], list[int]]]:
    return [(r.kind, r.tier, r.from_tier, r.hashes, r.parents) for r in rs]


def test_store_then_demote_down_the_tiers() -> None:
    c = TieredCache(gpu_blocks=2, dram_blocks=1, disk_blocks=0)
    assert runs(c.access([1, 2], [0, 1])) == [("stored", "gpu", None, [1, 2], [0, 1])]
    changes = runs(c.access([3], [2]))
    # room first, then the store; released last to first, 2 (the tail) is the least recent
    assert changes == [("moved", "dram", "gpu", [2], [1]), ("stored", "gpu", None, [3], [2])]
    changes = runs(c.access([4], [3]))
    # 1 leaves the gpu; dram is full, so 2 (disk has no room) is dropped to make room for it
    assert changes == [
        ("removed", "dram", None, [2], [1]),
        ("moved", "dram", "gpu", [1], [0]),
        ("stored", "gpu", None, [4], [3]),
    ]
    assert c.tier_of(2) is None and c.tier_of(1) == 1 and c.tier_of(4) == 0
    assert c.used(0) == 2 and c.used(1) == 1


def test_access_promotes_and_refreshes() -> None:
    c = TieredCache(gpu_blocks=2, dram_blocks=4)
    c.access([1, 2], [0, 1])
    c.access([3], [2])  # 2, the tail of the first prompt, demoted to dram
    assert c.prefix_tiers([1, 2, 3, 9]) == [0, 1, 0]
    changes = runs(c.access([1, 2], [0, 1]))
    assert changes[0] == ("moved", "dram", "gpu", [3], [2])  # 3 was the LRU of the gpu (1 is in use)
    assert changes[1] == ("moved", "gpu", "dram", [2], [1])
    assert c.access([1], [0]) == []  # a hit in the gpu only refreshes recency
    assert c.prefix_tiers([9, 1]) == []


def test_a_prompt_larger_than_the_gpu_tier_stores_nothing() -> None:
    """As the live allocate() that finds no room: the request cannot run there."""
    c = TieredCache(gpu_blocks=2, dram_blocks=4)
    assert c.access([1, 2, 3], [0, 1, 2]) == []
    assert c.used(0) == 0


def test_insert_lands_in_the_named_tier_and_skips_held_blocks() -> None:
    c = TieredCache(gpu_blocks=2, dram_blocks=2, disk_blocks=0)
    c.access([1], [0])
    assert runs(c.insert([1, 2, 3], [0, 1, 2], 1)) == [("stored", "dram", None, [2, 3], [1, 2])]
    assert c.prefix_tiers([1, 2, 3]) == [0, 1, 1]
    # a tier of capacity 0: straight to the GPU tier
    g = TieredCache(gpu_blocks=2)
    assert runs(g.insert([5], [0], 1)) == [("stored", "gpu", None, [5], [0])]


def test_fleet_aware_eviction_takes_a_block_held_elsewhere_first() -> None:
    fleet = FleetHolders()
    a = TieredCache(gpu_blocks=3, dram_blocks=4, fleet=fleet)
    b = TieredCache(gpu_blocks=8, fleet=fleet)
    a.access([1, 2, 3], [0, 1, 2])
    b.access([2], [0])  # b holds a copy of 2
    assert fleet.counts == {1: 1, 2: 2, 3: 1}
    changes = runs(a.access([4], [3]))
    # 3 is the least recent (a prompt's tail goes first), but 2 has a copy on b: 2 leaves a's GPU
    assert changes[0] == ("moved", "dram", "gpu", [2], [1])
    assert a.tier_of(3) == 0 and a.tier_of(2) == 1
    # the same calls without the shared counts evict plain LRU
    lru = TieredCache(gpu_blocks=3, dram_blocks=4)
    lru.access([1, 2, 3], [0, 1, 2])
    assert runs(lru.access([4], [3]))[0] == ("moved", "dram", "gpu", [3], [2])


def test_dram_drops_blocks_held_elsewhere_and_demotes_last_copies() -> None:
    fleet = FleetHolders()
    a = TieredCache(gpu_blocks=1, dram_blocks=1, disk_blocks=4, fleet=fleet)
    b = TieredCache(gpu_blocks=8, fleet=fleet)
    b.access([1], [0])
    a.access([1], [0])
    a.access([2], [0])  # 1 -> dram
    changes = runs(a.access([3], [0]))  # 2 -> dram; dram's victim is 1, held by b: dropped, not to disk
    assert ("removed", "dram", None, [1], [0]) in changes
    assert a.tier_of(1) is None and fleet.counts[1] == 1
    changes = runs(a.access([4], [0]))  # 3 -> dram; 2 is a last copy: demoted to disk
    assert ("moved", "disk", "dram", [2], [0]) in changes
    assert a.tier_of(2) == 2 and fleet.counts[2] == 1


def test_fleet_aware_choice_leaves_the_blocks_of_the_call_in_progress() -> None:
    fleet = FleetHolders()
    a = TieredCache(gpu_blocks=2, dram_blocks=4, fleet=fleet)
    b = TieredCache(gpu_blocks=8, fleet=fleet)
    b.access([1, 2, 3], [0, 1, 2])
    a.access([9], [0])
    # 1 and 2 are held by b, but they are the blocks of this access: 9 (no copy elsewhere) goes
    changes = runs(a.access([1, 2], [0, 1]))
    assert [c for c in changes if c[0] == "moved"] == [("moved", "dram", "gpu", [9], [0])]
    assert a.tier_of(1) == 0 and a.tier_of(2) == 0
