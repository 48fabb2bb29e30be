"""FleetCopies (other workers' copies per block, from kv-events) and KvCacheManager.holdings_events."""

from __future__ import annotations

from pathlib import Path

from schemas.codec import decode, encode
from schemas.messages import KvEvent
from services.worker.fleet_view import FleetCopies
from services.worker.kv_cache_manager import KvCacheManager
from services.worker.kv_layout import BlockLayout

LAYOUT = BlockLayout(layers=1, kv_heads=1, block_size=4, head_dim=2, dtype="float32")
NS = b"t:acme"


def _ev(worker: str, kind: str, hashes: list[int], tier: str = "gpu") -> KvEvent:
    return KvEvent(worker, kind, tier, hashes)  # type: ignore[arg-type]


def test_counts_follow_stored_moved_removed_cleared_and_lost() -> None:
    v = FleetCopies("me")
    v.apply(_ev("a", "stored", [1, 2, 3]))
    v.apply(_ev("b", "stored", [2, 3]))
    v.apply(_ev("me", "stored", [1, 2, 3, 4]))  # our own events never count
    assert [v.copies(h) for h in (1, 2, 3, 4)] == [1, 2, 2, 0]
    v.apply(_ev("a", "stored", [2]))  # a repeat (re-announce) is not a second copy
    v.apply(_ev("b", "moved", [3, 5], tier="dram"))  # 5: stored before we listened, moved now
    assert [v.copies(h) for h in (2, 3, 5)] == [2, 2, 1]
    v.apply(_ev("a", "removed", [2, 9]))  # 9 was never seen: ignored
    assert v.copies(2) == 1 and v.copies(9) == 0
    v.apply(KvEvent("b", "cleared", "gpu", []))
    assert [v.copies(h) for h in (1, 2, 3, 5)] == [1, 0, 1, 0]
    assert v.drop_worker("a") == 2  # WorkerLost
    assert len(v) == 0 and v.workers() == [] and v.copies(1) == 0


def test_a_worker_lost_read_after_the_reannounce_it_caused_is_ignored() -> None:
    v = FleetCopies("me")
    v.apply(_ev("a", "stored", [1, 2]), event_ms=1000)
    assert v.worker_lost("a", declared_ms=1500) == 2  # silent since 1000: its copies are gone
    v.apply(_ev("a", "stored", [1, 2]), event_ms=1600)  # the re-announce, read first ...
    assert v.worker_lost("a", declared_ms=1550) == 0  # ... then the WorkerLost that caused it
    assert v.copies(1) == v.copies(2) == 1


def test_bound_refuses_new_pairs_and_only_undercounts() -> None:
    v = FleetCopies("me", max_entries=3)
    v.apply(_ev("a", "stored", [1, 2]))
    v.apply(_ev("b", "stored", [1, 2, 3]))  # room for one more pair only
    assert len(v) == 3 and v.refused == 2
    assert [v.copies(h) for h in (1, 2, 3)] == [2, 1, 0]  # fewer than the truth, never more
    v.apply(_ev("b", "removed", [2, 3]))  # 2 was refused, so it is not uncounted either
    assert [v.copies(h) for h in (1, 2)] == [2, 1] and len(v) == 3
    v.apply(_ev("a", "removed", [1]))
    v.apply(_ev("c", "stored", [7]))  # room again
    assert v.copies(7) == 1 and len(v) == 3


def _store(m: KvCacheManager, h: int, parent: int, value: float) -> None:
    [b] = m.allocate(1) or [None]
    assert b is not None
    m.pool.tensor[b].fill_(value)
    assert m.commit_computed(b, h, parent, NS, "sess")
    m.release([b])


def test_holdings_events_cover_every_tier_with_parents_in_chunks(tmp_path: Path) -> None:
    m = KvCacheManager(LAYOUT, 2, 3, 4, disk_dir=tmp_path, worker_id="w1")
    for i in range(1, 9):
        _store(m, 100 + i, 100 + i - 1 if i > 1 else 0, float(i))
    m.drain_kv_events()
    held = m.held_hashes()
    assert {t: len(v) for t, v in held.items()} == {"gpu": 2, "dram": 3, "disk": 3}
    events = m.holdings_events(max_blocks_per_event=2)
    assert all(e.kind == "stored" and e.worker_id == "w1" and len(e.block_hashes) <= 2 for e in events)
    per_tier: dict[str, list[int]] = {}
    for e in events:
        per_tier.setdefault(e.tier, []).extend(e.block_hashes)
        assert e.parent_hashes == [h - 1 if h > 101 else 0 for h in e.block_hashes]
        assert decode(encode(e, "w1", 1, 1)).message == e  # a valid wire record
    assert {t: sorted(v) for t, v in per_tier.items()} == {t: sorted(v) for t, v in held.items()}
    assert len(events) == 1 + 2 + 2
    assert m.drain_kv_events() == []  # a snapshot, not a change


def test_holdings_of_a_big_cache_stay_under_the_record_limit(tmp_path: Path) -> None:
    layout = BlockLayout(layers=1, kv_heads=1, block_size=1, head_dim=1, dtype="float32")
    m = KvCacheManager(layout, 10_000, worker_id="w1")
    ids = m.allocate(10_000)
    assert ids is not None
    for i, b in enumerate(ids):
        m.commit_computed(b, (1 << 63) + i, (1 << 63) + i - 1, NS)
    events = m.holdings_events()
    assert sum(len(e.block_hashes) for e in events) == 10_000 and len(events) == 3
    assert max(len(encode(e, "w1", 1, 1)) for e in events) < 200_000
