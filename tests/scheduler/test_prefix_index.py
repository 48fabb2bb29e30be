"""PrefixIndex against a naive model (hypothesis), plus exact small cases."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.prefix_index import TIER_CODE, PrefixIndex, PrefixMatch

WORKERS = ["w-0", "w-1", "w-2", "w-3"]
TIERS = ["gpu", "dram", "disk"]
HASHES = [1000 + i for i in range(12)] + [2**64 - 1, 2**63]


class Naive:
    """hash → {worker: tier}, with the same 'fastest tier wins' rule on store."""

    def __init__(self) -> None:
        self.blocks: dict[int, dict[str, str]] = {}

    def store(self, w: str, tier: str, hashes: list[int]) -> None:
        for h in hashes:
            cur = self.blocks.setdefault(h, {})
            if w not in cur or TIER_CODE[tier] < TIER_CODE[cur[w]]:
                cur[w] = tier

    def move(self, w: str, tier: str, hashes: list[int]) -> None:
        for h in hashes:
            if w in self.blocks.get(h, {}):
                self.blocks[h][w] = tier

    def remove(self, w: str, hashes: list[int]) -> None:
        for h in hashes:
            cur = self.blocks.get(h)
            if cur is not None:
                cur.pop(w, None)
                if not cur:
                    del self.blocks[h]

    def remove_worker(self, w: str) -> None:
        self.remove(w, list(self.blocks))

    def match(self, hashes: list[int]) -> dict[str, PrefixMatch]:
        out = {}
        for w in WORKERS:
            n = 0
            tiers = {"gpu": 0, "dram": 0, "disk": 0}
            for h in hashes:
                t = self.blocks.get(h, {}).get(w)
                if t is None:
                    break
                n += 1
                tiers[t] += 1
            if n:
                out[w] = PrefixMatch(n, **tiers)
        return out


op = st.one_of(
    st.tuples(
        st.just("store"),
        st.sampled_from(WORKERS),
        st.sampled_from(TIERS),
        st.lists(st.sampled_from(HASHES), max_size=6),
    ),
    st.tuples(
        st.just("move"),
        st.sampled_from(WORKERS),
        st.sampled_from(TIERS),
        st.lists(st.sampled_from(HASHES), max_size=6),
    ),
    st.tuples(
        st.just("remove"),
        st.sampled_from(WORKERS),
        st.just(""),
        st.lists(st.sampled_from(HASHES), max_size=6),
    ),
    st.tuples(st.just("remove_worker"), st.sampled_from(WORKERS), st.just(""), st.just([])),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=25), query=st.lists(st.sampled_from(HASHES), max_size=10))
def test_index_matches_naive_model(ops: list[tuple[str, str, str, list[int]]], query: list[int]) -> None:
    idx, naive = PrefixIndex(), Naive()
    for kind, w, tier, hashes in ops:
        if kind == "store":
            idx.store(w, tier, hashes)
            naive.store(w, tier, hashes)
        elif kind == "move":
            idx.move(w, tier, hashes)
            naive.move(w, tier, hashes)
        elif kind == "remove":
            idx.remove(w, hashes)
            naive.remove(w, hashes)
        else:
            idx.remove_worker(w)
            naive.remove_worker(w)
    assert {h: hs for h, _, hs in idx.items()} == naive.blocks
    assert idx.entries == sum(len(v) for v in naive.blocks.values())
    for w in WORKERS:
        assert idx.worker_blocks(w) == sum(w in v for v in naive.blocks.values())
    assert idx.match(query) == naive.match(query)
    assert idx.longest_prefix(query) == {w: m.blocks for w, m in naive.match(query).items()}


def test_longest_prefix_exact_counts_and_tiers() -> None:
    idx = PrefixIndex()
    chain = [11, 12, 13, 14, 15]
    idx.store("w-0", "gpu", chain)  # all five
    idx.store("w-1", "gpu", chain[:2])
    idx.store("w-1", "dram", chain[2:3])
    idx.store("w-2", "gpu", chain[1:])  # no first block: no prefix at all
    m = idx.match(chain)
    assert m == {"w-0": PrefixMatch(5, gpu=5), "w-1": PrefixMatch(3, gpu=2, dram=1)}
    assert idx.longest_prefix([11, 99, 13]) == {"w-0": 1, "w-1": 1}
    assert idx.longest_prefix([]) == {}
    assert idx.parent(13) == 12
    assert idx.parent(11) == 0
    assert idx.parent(99) is None


def test_faster_tier_kept_and_move_changes_it() -> None:
    idx = PrefixIndex()
    idx.store("w-0", "gpu", [1])
    idx.store("w-0", "disk", [1])  # an offloaded copy does not hide the GPU one
    assert idx.holders(1) == {"w-0": "gpu"}
    idx.move("w-0", "dram", [1])
    assert idx.holders(1) == {"w-0": "dram"}
    idx.move("w-9", "gpu", [1])  # unknown worker: nothing happens
    assert idx.holders(1) == {"w-0": "dram"}


def test_remove_worker_drops_only_its_blocks() -> None:
    idx = PrefixIndex()
    idx.store("w-0", "gpu", [1, 2, 3])
    idx.store("w-1", "gpu", [1, 2])
    assert idx.remove_worker("w-0") == 3
    assert idx.longest_prefix([1, 2, 3]) == {"w-1": 2}
    assert 3 not in idx
    assert idx.entries == 2
    assert idx.remove_worker("w-0") == 0


def test_load_snapshot_equals_incremental_build() -> None:
    a = PrefixIndex()
    a.store("w-0", "gpu", [1, 2, 3])
    a.store("w-1", "dram", [1, 2])
    b = PrefixIndex()
    b.load({h: hs for h, _, hs in a.items()}, {h: p for h, p, _ in a.items()})
    assert b.to_dict() == a.to_dict()


def test_memory_per_entry_is_small() -> None:
    idx = PrefixIndex()
    for i in range(5000):
        idx.store(f"w-{i % 8}", "gpu", [(i * 2654435761) % 2**64 or 1])
    assert 50 < idx.bytes_per_entry() < 200
