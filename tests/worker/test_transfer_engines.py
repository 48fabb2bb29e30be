"""Two real engines: worker B serves turn 2 of a conversation whose turn 1 ran on worker A, with A's KV
blocks fetched over a real BlockServer; B's greedy tokens equal A's exactly."""

from __future__ import annotations

import pytest

from schemas.blocks import block_hashes, tenant_namespace
from schemas.messages import SamplingParams
from services.worker.transfer import BlockClient, BlockServer, TransferMetrics

engine_mod = pytest.importorskip("services.worker.engine")
Engine, EngineConfig, EngineRequest = engine_mod.Engine, engine_mod.EngineConfig, engine_mod.EngineRequest

SECRET = b"fleet-secret-for-tests"
NS = tenant_namespace("acme")
BS = 16


def make_engine(worker_id: str) -> Engine:
    cfg = EngineConfig(
        model="tiny",
        device="cpu",
        dtype="float32",
        block_size=BS,
        gpu_blocks=64,
        dram_blocks=64,
        seed=0,
        worker_id=worker_id,
    )
    return Engine(cfg)


def run(engine: Engine, request_id: str, tokens: list[int], max_tokens: int):  # type: ignore[no-untyped-def]
    engine.add_request(
        EngineRequest(
            request_id=request_id,
            session_id="conv-1",
            token_ids=tokens,
            block_hashes=block_hashes(tokens, BS, NS),
            namespace=NS,
            max_tokens=max_tokens,
            sampling=SamplingParams(temperature=0.0),
        )
    )
    out: list[int] = []
    stats = None
    while engine.has_work():
        for o in engine.step():
            assert o.error is None, o.error
            out += o.new_token_ids
            stats = o.stats or stats
    return out, stats


async def test_turn_two_on_b_with_blocks_fetched_from_a_matches_a() -> None:
    a, b = make_engine("A"), make_engine("B")
    turn1 = [(7 * i + 3) % 250 + 1 for i in range(75)]
    answer1, _ = run(a, "t1", turn1, max_tokens=21)
    turn2 = turn1 + answer1 + [(5 * i + 11) % 250 + 1 for i in range(30)]
    hashes2 = block_hashes(turn2, BS, NS)
    held = a.lookup_prefix(hashes2)
    assert held >= (len(turn1) + len(answer1) - 1) // BS  # prompt and answer blocks of turn 1 are cached
    assert b.lookup_prefix(hashes2) == 0

    metrics = TransferMetrics()
    async with BlockServer(a.kv, secret=SECRET, metrics=metrics) as server:
        result = await BlockClient(SECRET, metrics=metrics).fetch(
            server.address, hashes2[:held], [0, *hashes2[: held - 1]], NS, b.kv, peer_id="B"
        )
    assert result.ok and result.received == hashes2[:held]
    assert b.lookup_prefix(hashes2) == held
    assert metrics.blocks_sent == held and metrics.blocks_committed == held
    # B announces the fetched blocks, with their parents, so the scheduler can route turn 3 to it too
    stored = [
        (h, p)
        for e in b.drain_kv_events()
        if e.kind == "stored"
        for h, p in zip(e.block_hashes, e.parent_hashes, strict=True)
    ]
    assert stored == list(zip(hashes2[:held], [0, *hashes2[: held - 1]], strict=True))

    answer_b, stats_b = run(b, "t2-b", turn2, max_tokens=12)
    answer_a, stats_a = run(a, "t2-a", turn2, max_tokens=12)
    assert answer_b == answer_a
    assert len(answer_b) == 12
    assert stats_b.reused_tokens == held * BS == stats_a.reused_tokens  # B really used the fetched KV
