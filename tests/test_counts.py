"""kvmesh_core.counts: a key stays while anything counts it, and leaves at 0."""

from __future__ import annotations

from kvmesh_core.counts import add_counts, remove_counts


def test_a_key_leaves_when_its_count_reaches_zero() -> None:
    counts: dict[int, int] = {}
    add_counts(counts, [1, 2, 1])
    assert counts == {1: 2, 2: 1}
    remove_counts(counts, [1, 2])
    assert counts == {1: 1}
    remove_counts(counts, [1, 3])  # a key never counted is no error, and no negative count
    assert counts == {}
