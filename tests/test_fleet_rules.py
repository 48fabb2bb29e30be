"""The fleet rules every layer shares (kvmesh_core): reusable blocks and the eviction choice."""

from __future__ import annotations

import random
from collections.abc import Iterator
from itertools import islice

from kvmesh_core.eviction import (
    VICTIM_WINDOW,
    dram_victim_to_disk,
    pick_victim,
    victims_in_turn,
)
from kvmesh_core.reuse import reusable_blocks


def test_the_last_token_is_always_computed() -> None:
    assert [reusable_blocks(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 0, 0, 1, 1, 2]


def test_victim_order_fleet_copy_then_unretained_then_lru() -> None:
    window = [10, 11, 12, 13]
    assert pick_victim(window, None) == 0  # plain LRU
    assert pick_victim([], None) is None
    elsewhere = {12, 13}.__contains__
    assert pick_victim(window, elsewhere) == 2  # the least recent block the fleet still has elsewhere
    assert pick_victim(window, elsewhere, retained={12}) == 3  # a retained one goes after
    assert pick_victim(window, None, retained={10, 11}) == 2  # hints alone: unretained first


def test_victims_in_turn_are_the_rule_applied_once_per_victim() -> None:
    """The batched victims are exactly what one pick_victim call per eviction picks, with held
    copies sparse, dense, absent, beyond the window, and more victims than candidates."""
    rng = random.Random(7)
    for trial in range(300):
        n = rng.randrange(0, 3 * VICTIM_WINDOW)
        blocks = list(range(n))
        density = rng.choice((0.0, 0.01, 0.1, 0.5, 1.0))
        held = {h for h in blocks if rng.random() < density}
        held_elsewhere = None if trial % 5 == 0 else held.__contains__
        k = rng.randrange(0, n + 3)
        left, expected = list(blocks), []
        for _ in range(k):
            i = pick_victim(left, held_elsewhere)
            if i is None:
                break
            expected.append(left.pop(i))
        assert list(islice(victims_in_turn(iter(blocks), held_elsewhere), k)) == expected


def test_victims_in_turn_reads_lazily() -> None:
    read: list[int] = []

    def source() -> Iterator[int]:
        for h in range(10_000):
            read.append(h)
            yield h

    taken = list(islice(victims_in_turn(source(), None), 3))
    assert taken == [0, 1, 2]
    assert len(read) <= VICTIM_WINDOW + 3


def test_dram_keeps_last_copies_on_disk() -> None:
    assert dram_victim_to_disk(1, None)
    assert dram_victim_to_disk(1, {2}.__contains__)
    assert not dram_victim_to_disk(2, {2}.__contains__)
    assert dram_victim_to_disk(2, {2}.__contains__, retained={2})


def test_fetch_extends_the_local_prefix_and_stops_at_a_gap() -> None:
    from kvmesh_core.fetching import Step, chain_parents, plan_step

    assert plan_step(2, 5, have=3) == (Step.PULL, 3)  # run 2..6, 0..2 here: pull 3..6
    assert plan_step(2, 2, have=4) == (Step.HELD, 4)  # run 2..3 already here
    assert plan_step(5, 2, have=3) == (Step.GAP, 3)  # 3 and 4 missing: a chained block is useless
    assert chain_parents([11, 12, 13, 14], 0, 2) == [0, 11]
    assert chain_parents([11, 12, 13, 14], 2, 2) == [12, 13]


def test_a_request_waits_for_the_pull_that_carries_its_next_block() -> None:
    from kvmesh_core.fetching import PullsInFlight

    pulls: PullsInFlight[str] = PullsInFlight()
    assert not pulls and pulls.carrier([1, 2, 3], 0) is None
    pulls.add([1, 2, 3], "a")
    pulls.add([3, 4], "b")  # a later pull of block 3 carries it from now on
    assert pulls.carrier([1, 2, 3, 4], 0) == "a"  # nothing held: its first block comes with a
    assert pulls.carrier([1, 2, 3, 4], 2) == "b"
    assert pulls.carrier([1, 2], 2) is None  # all of its prompt is held here
    assert pulls.carrier([9, 1], 0) is None  # its next block is on no pull
    pulls.remove([1, 2, 3], "a")  # a ended: b keeps block 3
    assert pulls.carrier([1, 2, 3], 0) is None and pulls.carrier([1, 2, 3], 2) == "b"
    pulls.remove([3, 4], "b")
    assert not pulls
