"""The simulated worker's tiered LRU: demotion order and the changes it reports."""

from __future__ import annotations

from kvmesh.sim.cache import TieredCache


def test_store_then_demote_down_the_tiers() -> None:
    c = TieredCache(gpu_blocks=2, dram_blocks=1, disk_blocks=0)
    assert c.access([1, 2], [0, 1]) == [("stored", "gpu", None, [1, 2], [0, 1])]
    changes = c.access([3], [2])
    # 1 is the least recently used: gpu -> dram
    assert changes == [("stored", "gpu", None, [3], [2]), ("moved", "dram", "gpu", [1], [])]
    changes = c.access([4], [3])
    # 2 leaves the gpu; dram is full, so 1 (disk has no room) is dropped
    assert changes == [
        ("stored", "gpu", None, [4], [3]),
        ("moved", "dram", "gpu", [2], []),
        ("removed", "dram", None, [1], []),
    ]
    assert c.tier_of(1) is None and c.tier_of(2) == 1 and c.tier_of(4) == 0
    assert c.used(0) == 2 and c.used(1) == 1


def test_access_promotes_and_refreshes() -> None:
    c = TieredCache(gpu_blocks=2, dram_blocks=4)
    c.access([1, 2, 3], [0, 1, 2])  # 1 demoted to dram
    assert c.prefix_tiers([1, 2, 3, 9]) == [1, 0, 0]
    changes = c.access([1], [0])
    assert changes[0] == ("moved", "gpu", "dram", [1], [])
    assert changes[1] == ("moved", "dram", "gpu", [2], [])  # 2 was the LRU of the gpu
    assert c.access([3], [2]) == []  # a hit in the gpu only refreshes recency
    assert c.prefix_tiers([9, 1]) == []


def test_insert_lands_in_the_named_tier_and_skips_held_blocks() -> None:
    c = TieredCache(gpu_blocks=2, dram_blocks=2, disk_blocks=0)
    c.access([1], [0])
    assert c.insert([1, 2, 3], [0, 1, 2], 1) == [("stored", "dram", None, [2, 3], [1, 2])]
    assert c.prefix_tiers([1, 2, 3]) == [0, 1, 1]
    # a tier of capacity 0: straight to the GPU tier
    g = TieredCache(gpu_blocks=2)
    assert g.insert([5], [0], 1) == [("stored", "gpu", None, [5], [0])]
