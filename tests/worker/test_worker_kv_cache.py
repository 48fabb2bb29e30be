"""KvCacheManager: ref counts, LRU demotion GPU → DRAM → disk → drop, promotion, events, Source/Sink."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.errors import BlockSizeMismatch
from services.worker.kv_cache_manager import KvCacheManager
from services.worker.kv_layout import BlockLayout, BlockSink, BlockSource


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny matmuls on a shared 2-core box run far faster on one thread (no spinning workers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


LAYOUT = BlockLayout(layers=1, kv_heads=1, block_size=4, head_dim=2, dtype="float32")
NS = b"t:acme"


def _mgr(tmp_path: Path, gpu: int = 2, dram: int = 2, disk: int = 2) -> KvCacheManager:
    return KvCacheManager(LAYOUT, gpu, dram, disk, disk_dir=tmp_path, worker_id="w1")


def _store(m: KvCacheManager, h: int, parent: int, value: float) -> int:
    """Compute a block the way the engine does: allocate, write, name, release."""
    [b] = m.allocate(1) or [None]
    assert b is not None
    m.pool.tensor[b].fill_(value)
    assert m.commit_computed(b, h, parent, NS, "sess")
    m.release([b])
    return b


def _events(m: KvCacheManager) -> list[tuple[str, str, str | None, list[int]]]:
    """Drained events, one per block (the manager merges consecutive events of one kind)."""
    return [(e.kind, e.tier, e.from_tier, [h]) for e in m.drain_kv_events() for h in e.block_hashes]


def test_protocols_are_implemented(tmp_path: Path) -> None:
    m = _mgr(tmp_path)
    assert isinstance(m, KvCacheManager)
    source: BlockSource = m
    sink: BlockSink = m
    assert source.layout == sink.layout == LAYOUT


def test_lru_demotion_order_and_events(tmp_path: Path) -> None:
    m = _mgr(tmp_path)
    for i in range(1, 7):
        _store(m, 100 + i, 100 + i - 1 if i > 1 else 0, float(i))
    # GPU holds the two newest, DRAM the next two, disk the oldest two.
    assert sorted(m.held_hashes()["gpu"]) == [105, 106]
    assert sorted(m.held_hashes()["dram"]) == [103, 104]
    assert sorted(m.held_hashes()["disk"]) == [101, 102]
    ev = _events(m)
    assert ev[0] == ("stored", "gpu", None, [101])
    assert ("moved", "dram", "gpu", [101]) in ev
    assert ("moved", "disk", "dram", [101]) in ev
    # One more block: the oldest (on disk) is dropped.
    _store(m, 107, 106, 7.0)
    ev = _events(m)
    assert ("removed", "disk", None, [101]) in ev
    assert m.tier_of(101) is None and m.lookup_prefix([101, 102]) == 0
    assert m.lookup_prefix([102, 103, 104, 105, 106, 107]) == 6


def test_parent_hashes_travel_with_events(tmp_path: Path) -> None:
    m = _mgr(tmp_path, gpu=4)
    [a, b] = m.allocate(2) or []
    m.commit_computed(a, 11, 0, NS, "s")
    m.commit_computed(b, 12, 11, NS, "s")
    [e] = m.drain_kv_events()
    assert (e.kind, e.tier, e.block_hashes, e.parent_hashes, e.session_id) == (
        "stored",
        "gpu",
        [11, 12],
        [0, 11],
        "s",
    )
    assert e.worker_id == "w1"
    assert m.drain_kv_events() == []


def test_referenced_blocks_are_never_evicted(tmp_path: Path) -> None:
    m = _mgr(tmp_path, gpu=3, dram=0, disk=0)
    held = m.allocate(2)
    assert held is not None
    for i, b in enumerate(held):
        m.commit_computed(b, 200 + i, 0, NS)
    assert m.allocate(2) is None  # only one unreferenced block exists; out of blocks is a value
    one = m.allocate(1)
    assert one is not None and m.allocate(1) is None
    assert m.gpu_ref_count(200) == 1 and m.tier_of(201) == "gpu"
    m.release(held)
    assert m.allocate(2) is not None  # now the cached ones may go (dropped: no lower tier)
    assert m.tier_of(200) is None and m.tier_of(201) is None
    assert [k for k, *_ in _events(m)] == ["stored", "stored", "removed", "removed"]


def test_acquire_prefix_promotes_from_lower_tiers_with_same_bytes(tmp_path: Path) -> None:
    m = _mgr(tmp_path, gpu=3, dram=1, disk=4)
    for i in range(1, 6):
        _store(m, i, i - 1, float(i))
    assert m.tier_of(1) == "disk" and m.tier_of(2) == "dram" and m.tier_of(3) == "gpu"
    m.drain_kv_events()
    hit = m.acquire_prefix([1, 2, 3, 9])
    assert len(hit.block_ids) == 3 and hit.promoted == 2
    for h, b in zip([1, 2, 3], hit.block_ids, strict=True):
        assert m.tier_of(h) == "gpu"
        assert torch.all(m.pool.tensor[b] == float(h))
        assert m.gpu_ref_count(h) == 1
    ev = _events(m)
    assert ("moved", "gpu", "disk", [1]) in ev and ("moved", "gpu", "dram", [2]) in ev
    m.release(hit.block_ids)
    assert m.gpu_ref_count(1) == 0


def test_acquire_prefix_stops_where_gpu_is_full(tmp_path: Path) -> None:
    m = _mgr(tmp_path, gpu=2, dram=4, disk=0)
    for i in range(1, 5):
        _store(m, i, i - 1, float(i))
    hold = m.allocate(1)
    assert hold is not None
    assert m.tier_of(4) == "gpu" and m.tier_of(1) == "dram"
    # Block 1 cannot come up without evicting block 4 of the same run: the hit is empty and
    # nothing stays referenced.
    hit = m.acquire_prefix([1, 2, 3, 4])
    assert hit.block_ids == [] and m.gpu_ref_count(4) == 0
    m.release(hold)
    hit = m.acquire_prefix([1, 2, 3, 4])
    assert len(hit.block_ids) == 1 and hit.promoted == 1  # block 2 has no room left
    assert m.gpu_ref_count(1) == 1 and m.gpu_ref_count(4) == 0


def test_read_block_pins_without_promoting(tmp_path: Path) -> None:
    m = _mgr(tmp_path, gpu=1, dram=1, disk=0)
    _store(m, 1, 0, 1.5)
    _store(m, 2, 1, 2.5)  # 1 → DRAM
    got = m.read_block(1)
    assert got is not None
    tier, view = got
    assert tier == "dram" and view.nbytes == LAYOUT.nbytes
    assert torch.all(torch.frombuffer(bytearray(view), dtype=torch.float32) == 1.5)
    assert m.namespace_of(1) == NS and m.namespace_of(99) is None and m.read_block(99) is None
    # DRAM is full and its only block is pinned: demoting 2 must drop 2, not evict the pinned 1.
    _store(m, 3, 2, 3.5)
    assert m.tier_of(1) == "dram" and m.tier_of(2) is None
    m.release_read(1)
    _store(m, 4, 3, 4.5)
    assert m.tier_of(1) is None and m.tier_of(3) == "dram"


def test_pinned_slot_survives_promotion_until_released(tmp_path: Path) -> None:
    m = _mgr(tmp_path, gpu=2, dram=1, disk=0)
    _store(m, 1, 0, 1.0)
    _store(m, 2, 1, 2.0)
    _store(m, 3, 2, 3.0)  # 1 → DRAM
    got = m.read_block(1)
    assert got is not None
    hit = m.acquire_prefix([1])  # promotes 1; its DRAM slot stays reserved for the reader
    assert m.tier_of(1) == "gpu"
    _store(m, 4, 3, 4.0)  # needs a DRAM slot for a demotion; the pinned slot must not be reused
    assert torch.all(torch.frombuffer(bytearray(got[1]), dtype=torch.float32) == 1.0)
    m.release_read(1)
    m.release(hit.block_ids)


def test_commit_blocks_inserts_into_dram_and_announces(tmp_path: Path) -> None:
    m = _mgr(tmp_path, gpu=2, dram=4, disk=0)
    buf = m.staging_buffer(2)
    assert buf.nbytes == 2 * LAYOUT.nbytes
    t = torch.frombuffer(buf, dtype=torch.float32)
    t[:16] = 7.0
    t[16:] = 8.0
    n = LAYOUT.nbytes
    assert m.commit_blocks([(21, 0, buf[:n]), (22, 21, bytes(buf[n:]))], NS) == 2
    assert m.commit_blocks([(21, 0, buf[:n])], NS) == 0  # already held
    assert m.tier_of(21) == "dram" and m.namespace_of(22) == NS
    [e] = m.drain_kv_events()
    assert (e.kind, e.tier, e.block_hashes, e.parent_hashes) == ("stored", "dram", [21, 22], [0, 21])
    hit = m.acquire_prefix([21, 22])
    assert torch.all(m.pool.tensor[hit.block_ids[1]] == 8.0)
    with pytest.raises(BlockSizeMismatch):
        m.commit_blocks([(23, 22, b"xx")], NS)
    # GPU is full of referenced blocks: a GPU-bound block falls back to DRAM.
    assert m.commit_blocks([(24, 0, bytes(n))], NS, tier="gpu") == 1 and m.tier_of(24) == "dram"
    assert m.commit_blocks([(25, 0, bytes(n))], NS, tier="disk") == 0  # no disk tier → nothing placed


def test_fleet_copies_are_dropped_first_and_last_copies_go_to_disk(tmp_path: Path) -> None:
    m = _mgr(tmp_path, gpu=1, dram=2, disk=4)
    m.set_fleet_copies(lambda h: 1 if h == 1 else 0)
    for i in range(1, 4):
        _store(m, i, i - 1, float(i))  # 1, 2 in DRAM, 3 in GPU
    _store(m, 4, 3, 4.0)  # DRAM must make room: 1 has a copy elsewhere → dropped, not demoted
    assert m.tier_of(1) is None and m.tier_of(2) == "dram"
    _store(m, 5, 4, 5.0)  # 2 is a last copy → disk
    assert m.tier_of(2) == "disk"
    ev = _events(m)
    assert ("removed", "dram", None, [1]) in ev and ("moved", "disk", "dram", [2]) in ev


def test_retained_blocks_are_evicted_last_and_kept_on_disk(tmp_path: Path) -> None:
    m = _mgr(tmp_path, gpu=1, dram=2, disk=2)
    m.set_fleet_copies(lambda h: 1)  # everything has copies elsewhere...
    m.retain([1], until_ms=1000)  # ...but block 1 belongs to a live session
    for i in range(1, 4):
        _store(m, i, i - 1, float(i))
    _store(m, 4, 3, 4.0)
    assert m.tier_of(1) == "dram" and m.tier_of(2) is None  # LRU says 1, the hint says 2
    m.expire_retains(now_ms=1000)
    _store(m, 5, 4, 5.0)
    assert m.tier_of(1) is None


def test_a_pulled_prefix_is_held_for_its_request_until_it_is_admitted(tmp_path: Path) -> None:
    """Blocks pulled from a peer are held elsewhere too, so the fleet rule takes them first; a hold
    keeps them for the waiting request, and only as long as something else can go."""
    m = _mgr(tmp_path, gpu=1, dram=3, disk=0)
    m.set_fleet_copies(lambda h: 1 if h in (10, 11) else 0)  # the peer still holds what we pulled
    n = LAYOUT.nbytes
    assert m.commit_blocks([(10, 0, bytes(n)), (11, 10, bytes(n))], NS) == 2  # pulled into DRAM
    assert m.hold("req-1", [10, 11, 12]) == 2  # the leading run held here
    _store(m, 1, 0, 1.0)
    _store(m, 2, 1, 2.0)  # 1 demoted into DRAM's last free slot
    _store(m, 3, 2, 3.0)  # 2 demoted into a full DRAM: the rule would drop 10, the hold drops 1
    assert m.tier_of(10) == m.tier_of(11) == "dram" and m.tier_of(1) is None
    # a DRAM tier of held blocks alone: the hold gives way rather than block the store
    assert m.hold("req-2", [2]) == 1
    _store(m, 4, 3, 4.0)
    assert m.tier_of(3) == "dram" and m.lookup_prefix([10, 11]) == 0
    m.unhold("req-1")
    m.unhold("req-1")  # twice, or for a request that held nothing: no effect
    m.unhold("req-2")


def test_unheld_pulled_blocks_are_the_first_victims_again(tmp_path: Path) -> None:
    m = _mgr(tmp_path, gpu=1, dram=2, disk=0)
    m.set_fleet_copies(lambda h: 1 if h == 10 else 0)
    n = LAYOUT.nbytes
    m.commit_blocks([(10, 0, bytes(n))], NS)
    _store(m, 1, 0, 1.0)
    m.hold("req-1", [10])
    _store(m, 2, 1, 2.0)  # 1 demoted to DRAM beside 10: DRAM full
    _store(m, 3, 2, 3.0)  # DRAM makes room: 10 is held, so the last copy 1 goes instead
    assert m.tier_of(10) == "dram" and m.tier_of(1) is None
    m.unhold("req-1")
    _store(m, 4, 3, 4.0)  # unheld, the pulled block is the first victim again (a copy elsewhere)
    assert m.tier_of(10) is None and m.tier_of(2) == "dram"


def test_clear_drops_everything(tmp_path: Path) -> None:
    m = _mgr(tmp_path)
    for i in range(1, 4):
        _store(m, i, i - 1, float(i))
    [e] = m.clear()
    assert e.kind == "cleared" and e.block_hashes == []
    assert m.lookup_prefix([1]) == 0 and m.drain_kv_events() == []
    assert m.tier_usage()[0].free_blocks == 2
    assert (tmp_path / "w1.kvblocks").is_file()
    m.close()


def test_eviction_windows_read_only_the_head_and_skip_pins(tmp_path: Path) -> None:
    m = _mgr(tmp_path, gpu=4, dram=4, disk=0)
    ids = [_store(m, 10 + i, 10 + i - 1 if i else 0, float(i)) for i in range(4)]
    assert m.pool.lru_cached(2) == ids[:2]  # least recent first, only n of them
    assert m.pool.lru_cached(3, skip={ids[0]: 1}) == ids[1:4]
    for i in range(4, 8):
        _store(m, 10 + i, 10 + i - 1, float(i))  # 10..13 are now in DRAM, 10 the least recent
    assert m.dram.lru_unpinned(2) == [10, 11]
    assert m.read_block(10) is not None  # a reader pins 10's slot
    assert m.dram.lru_unpinned(2) == [11, 12]
    assert m.dram.lru_unpinned(2, keep=11) == [12, 13]
    m.release_read(10)
    assert m.dram.lru_unpinned(1) == [10]
