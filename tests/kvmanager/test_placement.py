"""Placement on exact small setups: hot prefixes, who replicates what from whom, caps, retain hints."""

from __future__ import annotations

from dataclasses import replace

from schemas.messages import ReplicateCommand, RetainHint
from services.kvmanager.directory import Directory
from services.kvmanager.placement import (
    HotPrefix,
    HotPrefixTracker,
    PlacementConfig,
    PlacementEngine,
    plan_replication,
)

from .helpers import load, request, stored

CFG = PlacementConfig(window_ms=10_000, min_sessions=4, max_replicas=3, bytes_per_s=1e9, burst_bytes=1e9)


def fleet() -> Directory:
    """w1 holds the whole prefix 1-2-3, w2 only block 1; w3..w5 hold nothing."""
    d = Directory()
    d.apply_kv_event(stored("w1", [1, 2, 3]))
    d.apply_kv_event(stored("w2", [1]))
    d.apply_load(load("w1", 1000, queued=1000))
    d.apply_load(load("w2", 1000, queued=50))
    d.apply_load(load("w3", 1000, queued=10))
    d.apply_load(load("w4", 1000, queued=0, draining=True))
    d.apply_load(load("w5", 1000, queued=0, dram_free=2))  # too little DRAM for 3 blocks
    return d


def test_hot_prefix_is_the_leaf_of_the_hot_tree_and_expires() -> None:
    t = HotPrefixTracker(CFG)
    for i in range(4):
        t.observe(request(f"s{i}", f"r{i}", [1, 2, 3], ms=1000 + i))
    t.observe(request("s9", "r9", [1, 2, 9], ms=1100))
    t.observe(request("s0", "r0b", [1, 2, 3], ms=1200))  # same session again: still 4 distinct
    assert t.sessions(1) == 5 and t.sessions(3) == 4 and t.sessions(9) == 1
    assert t.hot() == [HotPrefix((1, 2, 3), 4, b"t:t")]
    t.expire(1003 + 10_000)  # the first four entries leave the window
    assert t.sessions(3) == 1 and t.hot() == []


def test_public_prefix_gets_public_namespace() -> None:
    t = HotPrefixTracker(replace(CFG, min_sessions=2))
    t.observe(request("a", "ra", [1, 2, 3], ms=1, public_tokens=32))
    t.observe(request("b", "rb", [1, 2, 4], ms=2, public_tokens=32))
    assert t.hot() == [HotPrefix((1, 2), 2, b"public")]


def cmd(target: str, source: str, hashes: list[int], ms: int = 5000) -> ReplicateCommand:
    return ReplicateCommand(
        command_id=f"rep:{target}:{hashes[-1]:016x}:{ms}",
        target_worker=target,
        source_worker=source,
        source_address="127.0.0.1:9001",
        block_hashes=hashes,
        namespace=b"t:t",
        tier="dram",
    )


def test_least_loaded_eligible_workers_pull_missing_blocks() -> None:
    d = fleet()
    hot = [HotPrefix((1, 2, 3), 8, b"t:t")]  # 8 sessions: want min(3, 1 + 8 // 4) = 3 copies
    plan = plan_replication(hot, d, d.workers, [], 1e9, CFG, now_ms=5000)
    # w5 is least loaded but lacks DRAM, w4 drains; w3 pulls all three, w2 only what it lacks.
    assert plan.commands == [cmd("w3", "w1", [1, 2, 3]), cmd("w2", "w1", [2, 3])]
    assert plan.bytes == 5 * 1000


def test_replica_cap_per_block_is_respected() -> None:
    d = fleet()
    cfg = replace(CFG, max_replicas=2)
    plan = plan_replication([HotPrefix((1, 2, 3), 8, b"t:t")], d, d.workers, [], 1e9, cfg, now_ms=5000)
    # Block 1 already has 2 copies (w1, w2): w3 may not get it; w2 completes the run instead.
    assert plan.commands == [cmd("w2", "w1", [2, 3])]
    for h in (1, 2, 3):
        assert d.copies(h) + sum(h in c.block_hashes for c in plan.commands) <= 2


def test_fewer_sessions_want_fewer_copies_and_unheld_prefixes_are_skipped() -> None:
    d = fleet()
    hot = [HotPrefix((1, 2, 3), 4, b"t:t"), HotPrefix((7, 8), 50, b"t:t")]  # nobody holds 7-8
    plan = plan_replication(hot, d, d.workers, [], 1e9, CFG, now_ms=5000)
    assert plan.commands == [cmd("w3", "w1", [1, 2, 3])]


def test_byte_budget_limits_and_refills_on_event_time() -> None:
    d = fleet()
    eng = PlacementEngine(replace(CFG, bytes_per_s=1000.0, burst_bytes=3000.0))
    for i in range(8):
        eng.on_request(request(f"s{i}", f"r{i}", [1, 2, 3], ms=4000 + i), d)
    assert eng.plan(5000, d, d.workers) == [cmd("w3", "w1", [1, 2, 3])]  # 3000 B: burst spent
    assert eng.plan(5000, d, d.workers) == []  # pending w3 is not asked twice; no budget for w2
    assert eng.plan(6000, d, d.workers) == []  # 1000 B saved, w2 needs 2000
    assert eng.plan(7000, d, d.workers) == [cmd("w2", "w1", [2, 3], ms=7000)]
    # The copies appear in the directory: nothing pending, nothing more to do.
    d.apply_kv_event(stored("w3", [1, 2, 3], tier="dram"))
    d.apply_kv_event(stored("w2", [1, 2, 3], tier="dram"))
    assert eng.plan(9000, d, d.workers) == []
    assert eng.pending == []


def test_same_inputs_same_commands() -> None:
    def run() -> list:
        d = fleet()
        eng = PlacementEngine(CFG)
        out = []
        for i in range(12):
            eng.on_request(request(f"s{i % 9}", f"r{i}", [1, 2, 3], ms=4000 + 7 * i), d)
            out += eng.plan(4000 + 7 * i, d, d.workers)
        return out

    first = run()
    assert first and run() == first


def test_retain_hints_for_returning_sessions_only() -> None:
    d = fleet()
    eng = PlacementEngine(CFG)
    assert eng.on_request(request("s1", "r1", [1, 2, 3, 4], ms=1000), d) == []
    assert eng.on_request(request("s1", "r1", [1, 2, 3, 4], ms=1001), d) == []  # a redelivery, not a turn
    hints = eng.on_request(request("s1", "r2", [1, 2, 3, 4], ms=2000), d)
    assert hints == [
        RetainHint("w1", "s1", [1, 2, 3], until_ms=2000 + CFG.retain_ms),
        RetainHint("w2", "s1", [1], until_ms=2000 + CFG.retain_ms),
    ]
    assert eng.on_request(request("s2", "r3", [1, 2], ms=2000), d) == []


def test_sessions_forgotten_after_ttl() -> None:
    d = fleet()
    eng = PlacementEngine(replace(CFG, session_ttl_ms=1000))
    eng.on_request(request("s1", "r1", [1], ms=0), d)
    eng.on_request(request("s2", "r2", [1], ms=5000), d)  # s1 expires here
    assert eng.on_request(request("s1", "r3", [1], ms=5001), d) == []
