"""The kvmesh KV connector under one real vLLM engine: tiers below vLLM's pool, loads from them, and
blocks that arrive over the data plane, good or bad.

The reference for every answer is the same engine computing the same prompt from scratch (its caches
reset first): a load that put wrong bytes in a block would change the greedy tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvmesh.modeldir import init_model_dir
from kvmesh_core.tokenizer import ChatMessage, render_chat
from schemas.blocks import ROOT_HASH, block_hashes, tenant_namespace
from services.worker.engine_api import EngineRequest, RequestStats
from services.worker.transfer import BlockClient, BlockServer
from services.worker.transfer.frames import REQUEST_PREFIX, BlockRequest, Status, checksum, pack_header
from services.worker.transfer.memory import MemoryBlockStore
from services.worker.vllm_engine import VllmEngine, VllmEngineConfig

pytestmark = [pytest.mark.slow]  # a real vLLM, no broker or Redis

BS = 32
NS_A = tenant_namespace("A")
NS_B = tenant_namespace("B")
SECRET = b"connector-test-secret"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    model = init_model_dir(tmp_path_factory.mktemp("conn") / "tiny-llama", seed=5)
    eng = VllmEngine(
        VllmEngineConfig(
            model_dir=str(model),
            block_size=BS,
            gpu_blocks=48,  # small on purpose: other prompts push a conversation out of vLLM's pool
            max_context=1024,
            dtype="float32",
            dram_blocks=512,
        )
    )
    yield eng
    eng.release_all()


def _run(
    eng: VllmEngine, rid: str, ids: list[int], ns: bytes = NS_A, n: int = 10
) -> tuple[list[int], RequestStats]:
    eng.add_request(EngineRequest(rid, f"s-{rid}", ids, block_hashes(ids, BS, ns), ns, n, block_size=BS))
    out: list[int] = []
    stats = None
    while eng.has_work():
        for o in eng.step():
            if o.request_id == rid:
                out += o.new_token_ids
                stats = o.stats or stats
    assert stats is not None
    return out, stats


def _turns(eng: VllmEngine, topic: str) -> tuple[list[int], list[int]]:
    """Turn 1's prompt and turn 2's (turn 1 + its greedy answer + a question), from scratch."""
    tok = eng.tokenizer
    t1 = [ChatMessage("system", f"Talk about {topic}. " * 12), ChatMessage("user", f"What is {topic}?")]
    eng.reset_cache()
    p1 = render_chat(tok, t1)
    out1, _ = _run(eng, f"{topic}-t1", p1)
    p2 = render_chat(tok, [*t1, ChatMessage("assistant", tok.decode(out1)), ChatMessage("user", "More?")])
    assert p2[: len(p1)] == p1
    return p1, p2


def _reference(eng: VllmEngine, rid: str, ids: list[int]) -> list[int]:
    eng.reset_cache()
    out, stats = _run(eng, rid, ids)
    assert stats.reused_tokens == 0
    return out


def _settle(eng: VllmEngine) -> None:
    time.sleep(0.2)
    eng.drain_kv_events()


def test_every_computed_block_is_saved_below_and_announced(engine: VllmEngine) -> None:
    p1, _ = _turns(engine, "caches")
    _settle(engine)
    assert engine.store is not None
    hashes = block_hashes(p1, BS, NS_A)
    assert all(engine.store.tier_of(h) == "dram" for h in hashes)
    held = {h: tier for h, _p, tier in engine.tiers.held()}
    assert all(held[h] == "gpu" for h in hashes)  # the fleet sees the best copy: vLLM's pool
    stats = engine.connector_stats
    assert stats.saved_blocks >= len(hashes) and stats.save_s > 0


def test_a_block_evicted_from_vllm_is_loaded_from_dram_next_turn(engine: VllmEngine) -> None:
    p1, p2 = _turns(engine, "tiers")
    want = _reference(engine, "tiers-ref", p2)
    p1, p2 = _turns(engine, "tiers")
    # other prompts push turn 1 out of vLLM's 48-block pool; the DRAM tier keeps it
    for i in range(4):
        _run(
            engine,
            f"fill-{i}",
            render_chat(engine.tokenizer, [ChatMessage("user", f"filler {i} " * 150)]),
            n=1,
        )
    _settle(engine)
    h1 = block_hashes(p1, BS, NS_A)
    assert engine.tiers.tier_of(h1[0]) == "dram", "turn 1 is still in vLLM's pool: the test proves nothing"
    out, stats = _run(engine, "tiers-t2", p2)
    assert stats.promoted_blocks >= len(p1) // BS  # loaded by the connector, not recomputed
    assert stats.reused_tokens >= (len(p1) // BS) * BS
    assert out == want


async def _fetch(eng: VllmEngine, address: str, hashes: list[int], ns: bytes) -> int:
    client = BlockClient(SECRET, timeout_s=5.0)
    assert eng.store is not None
    parents = [ROOT_HASH, *hashes[:-1]]
    result = await client.fetch(address, hashes, parents, ns, eng.store, peer_id="test")
    return len(result.received)


def _peer_copy(eng: VllmEngine, hashes: list[int], ns: bytes) -> MemoryBlockStore:
    """A peer holding exactly this engine's bytes of ``hashes`` (what worker A would serve)."""
    assert eng.store is not None
    peer = MemoryBlockStore(eng.store.layout)
    for i, h in enumerate(hashes):
        got = eng.store.read_block(h)
        assert got is not None
        peer.put(h, bytes(got[1]), ns, parent=hashes[i - 1] if i else ROOT_HASH)
        eng.store.release_read(h)
    return peer


def _scenario(eng: VllmEngine, topic: str) -> tuple[list[int], list[int], MemoryBlockStore, list[int]]:
    """Turn 2's prompt, turn 1's block hashes, a peer holding them, and turn 2's recompute-only answer."""
    p1, p2 = _turns(eng, topic)
    _settle(eng)
    hashes = block_hashes(p1, BS, NS_A)
    peer = _peer_copy(eng, hashes, NS_A)
    return p2, hashes, peer, _reference(eng, f"{topic}-ref", p2)


def test_blocks_fetched_from_a_peer_are_loaded_and_give_the_same_answer(engine: VllmEngine) -> None:
    p2, hashes, peer, want = _scenario(engine, "peers")

    async def run() -> int:
        async with BlockServer(peer, secret=SECRET) as server:
            engine.reset_cache()
            return await _fetch(engine, server.address, hashes, NS_A)

    assert asyncio.run(run()) == len(hashes)
    out, stats = _run(engine, "peers-t2", p2)
    assert stats.promoted_blocks == len(hashes) and stats.reused_tokens == len(hashes) * BS
    assert out == want


def test_a_request_waiting_for_its_pull_keeps_its_place_and_loads_the_blocks_once_they_land(
    engine: VllmEngine,
) -> None:
    """Overlap admission on vLLM: while the worker pulls a request's blocks, the connector answers
    "not known yet", vLLM passes the request over and runs the others; once the pull has landed the
    request loads the blocks and answers as if it had computed them. So does a request of the same
    prompt that waits for that pull without one of its own (``WorkerService._wait_for_pull``)."""
    p2, hashes, peer, want = _scenario(engine, "overlap")
    engine.reset_cache()
    expected = len(p2) - len(hashes) * BS  # what the scheduler expects computed after the pull
    for rid in ("overlap-t2", "overlap-waiter"):
        engine.add_request(
            EngineRequest(
                rid,
                "s-o",
                p2,
                block_hashes(p2, BS, NS_A),
                NS_A,
                10,
                block_size=BS,
                kv_pending=True,
                expected_prefill_tokens=expected,
            )
        )
    other = render_chat(engine.tokenizer, [ChatMessage("user", "Meanwhile, something short.")])
    engine.add_request(
        EngineRequest("overlap-other", "s-x", other, block_hashes(other, BS, NS_A), NS_A, 4, block_size=BS)
    )
    done: set[str] = set()
    while engine.has_work():
        done |= {o.request_id for o in engine.step() if o.finished}
    assert done == {"overlap-other"}  # the waiting ones never ran, and the loop did not spin on them
    load = engine.load()
    assert load.queue_depth == 2 and load.queued_prefill_tokens == 2 * expected

    async def pull() -> int:
        async with BlockServer(peer, secret=SECRET) as server:
            return await _fetch(engine, server.address, hashes, NS_A)

    assert asyncio.run(pull()) == len(hashes)
    engine.kv_arrived("overlap-t2", len(hashes))
    # what landed is held in the store for it until vLLM has loaded it (KvCacheManager.hold)
    assert engine.store is not None and engine.store._holds == {"overlap-t2": hashes}
    engine.kv_arrived("overlap-waiter", len(hashes))  # its puller's pull ended
    out: dict[str, list[int]] = {"overlap-t2": [], "overlap-waiter": []}
    stats = {}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.stats is not None:
                stats[o.request_id] = o.stats
    assert stats["overlap-t2"].promoted_blocks == len(hashes)
    # the waiter computed none of the pulled blocks: loaded from the store, or shared on the GPU with
    # what t2 computed past them
    waiter = stats["overlap-waiter"]
    assert waiter.reused_tokens >= len(hashes) * BS
    assert waiter.recomputed_tokens == len(p2) - waiter.reused_tokens <= len(p2) - len(hashes) * BS
    assert out["overlap-t2"] == out["overlap-waiter"] == want
    assert engine.store._holds == {} and engine.store._held == {}


def test_another_tenant_fetches_nothing_and_recomputes(engine: VllmEngine) -> None:
    p2, hashes, peer, want = _scenario(engine, "tenants")

    async def run() -> int:
        async with BlockServer(peer, secret=SECRET) as server:
            engine.reset_cache()
            return await _fetch(engine, server.address, hashes, NS_B)  # B asks for A's blocks

    assert asyncio.run(run()) == 0
    out, stats = _run(engine, "tenants-t2", p2)
    assert stats.promoted_blocks == 0 and out == want


def test_corrupt_bytes_from_a_peer_stop_at_the_bad_block_and_the_rest_is_recomputed(
    engine: VllmEngine,
) -> None:
    p2, hashes, peer, want = _scenario(engine, "corruption")
    assert len(hashes) >= 3
    bad = 2  # blocks 0 and 1 arrive intact, block 2's bytes are flipped after the checksum

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        (length,) = REQUEST_PREFIX.unpack(await reader.readexactly(4))
        req = BlockRequest.decode(await reader.readexactly(length))
        for i, h in enumerate(req.block_hashes):
            data = bytearray(peer.block_bytes(h))
            digest = checksum(data)
            if i == bad:
                data[len(data) // 2] ^= 0xFF
            writer.write(pack_header(Status.OK, h, len(data), digest, 1) + bytes(data))
        await writer.drain()
        writer.close()

    async def run() -> int:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        try:
            engine.reset_cache()
            return await _fetch(engine, f"127.0.0.1:{server.sockets[0].getsockname()[1]}", hashes, NS_A)
        finally:
            server.close()

    assert asyncio.run(run()) == bad
    out, stats = _run(engine, "corrupt-t2", p2)
    assert stats.promoted_blocks == bad and stats.reused_tokens == bad * BS
    assert out == want


def test_the_store_serves_peers_through_the_block_server(engine: VllmEngine) -> None:
    p1, _ = _turns(engine, "serving")
    _settle(engine)
    hashes = block_hashes(p1, BS, NS_A)
    assert engine.block_source() is engine.store is not None
    sink = MemoryBlockStore(engine.store.layout)

    async def run() -> tuple[int, int]:
        async with BlockServer(engine.store, secret=SECRET) as server:
            client = BlockClient(SECRET, timeout_s=5.0)
            parents = [ROOT_HASH, *hashes[:-1]]
            ok = await client.fetch(server.address, hashes, parents, NS_A, sink, peer_id="peer")
            other = await client.fetch(server.address, hashes, parents, NS_B, sink, peer_id="peer")
            return len(ok.received), len(other.received)

    assert asyncio.run(run()) == (len(hashes), 0)
    got = engine.store.read_block(hashes[0])
    assert got is not None and bytes(got[1]) == sink.block_bytes(hashes[0])
    engine.store.release_read(hashes[0])


def test_the_asynchronous_load_path_gives_the_same_answer(engine: VllmEngine) -> None:
    """Loads copied by a background thread while vLLM parks the request (WAITING_FOR_REMOTE_KVS)."""
    p1, p2 = _turns(engine, "async")
    want = _reference(engine, "async-ref", p2)
    p1, p2 = _turns(engine, "async")
    for i in range(4):
        fill = render_chat(engine.tokenizer, [ChatMessage("user", f"filler {i} " * 150)])
        _run(engine, f"async-fill-{i}", fill, n=1)
    _settle(engine)
    assert engine._hub is not None
    engine._hub.async_load = True
    try:
        out, stats = _run(engine, "async-t2", p2)
    finally:
        engine._hub.async_load = False
    assert stats.promoted_blocks >= len(p1) // BS and out == want
    assert not engine._hub.loading and not engine._hub.delay_free


@pytest.mark.parametrize("background", [False, True])
def test_a_load_whose_copy_fails_is_recomputed_and_gives_the_same_answer(
    engine: VllmEngine, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    """The store holds turn 1's blocks, but copying them into vLLM's blocks raises: the connector
    reports them as load errors, vLLM recomputes them, and the answer is the reference's."""
    from services.worker.vllm_engine.block_copy import BlockCopier

    topic = f"broken-{int(background)}"
    p1, p2 = _turns(engine, topic)
    want = _reference(engine, f"{topic}-ref", p2)
    p1, p2 = _turns(engine, topic)
    for i in range(4):
        fill = render_chat(engine.tokenizer, [ChatMessage("user", f"filler {i}{int(background)} " * 120)])
        _run(engine, f"{topic}-fill-{i}", fill, n=1)
    _settle(engine)

    def fail(self: BlockCopier, items: object) -> list[int]:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(BlockCopier, "copy_in", fail)
    assert engine._hub is not None
    errors = engine.connector_stats.load_errors
    engine._hub.async_load = background
    try:
        out, _ = _run(engine, f"{topic}-t2", p2)
    finally:
        engine._hub.async_load = False
    # every block offered failed once and was recomputed: none is offered again (no retry loop)
    assert engine.connector_stats.load_errors - errors == len(p1) // BS
    assert out == want
    assert not engine._hub.loading and not engine._hub.delay_free and not engine._hub.load_failed


_DYING_PEER = """
import asyncio, os, pickle, sys
from services.worker.transfer.frames import REQUEST_PREFIX, BlockRequest, Status, checksum, pack_header

blocks = pickle.load(open(sys.argv[1], "rb"))
survive = int(sys.argv[2])

async def serve(reader, writer):
    (length,) = REQUEST_PREFIX.unpack(await reader.readexactly(4))
    req = BlockRequest.decode(await reader.readexactly(length))
    for i, h in enumerate(req.block_hashes):
        if i == survive:
            os._exit(9)  # the peer process dies in the middle of the transfer
        data = blocks[h]
        writer.write(pack_header(Status.OK, h, len(data), checksum(data), 1) + data)
        await writer.drain()

async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()

asyncio.run(main())
"""


def test_a_peer_process_that_dies_mid_fetch_leaves_a_verified_prefix_and_the_same_answer(
    engine: VllmEngine, tmp_path: Path
) -> None:
    import pickle
    import subprocess
    import sys

    p2, hashes, peer, want = _scenario(engine, "dying")
    assert len(hashes) >= 3
    blob = tmp_path / "blocks.pkl"
    blob.write_bytes(pickle.dumps({h: peer.block_bytes(h) for h in hashes}))
    proc = subprocess.Popen(
        [sys.executable, "-c", _DYING_PEER, str(blob), "2"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        engine.reset_cache()
        got = asyncio.run(_fetch(engine, f"127.0.0.1:{port}", hashes, NS_A))
        assert proc.wait(10) == 9  # it really died
    finally:
        if proc.poll() is None:
            proc.kill()
    assert got == 2
    out, stats = _run(engine, "dying-t2", p2)
    assert stats.promoted_blocks == 2 and out == want


def test_calibration_measures_the_connector_speed(engine: VllmEngine) -> None:
    p = engine.calibrate(short=64, long=256, decode_ctx=64)
    stats = engine.connector_stats
    assert stats.saved_blocks > 0
    assert p.dram_gbps == pytest.approx(engine.block_bytes * stats.saved_blocks / stats.save_s / 1e9)
    assert p.dram_blocks == 512 and p.block_bytes == engine.block_bytes
    assert engine.store is not None and engine.store.tier_usage()[1].free_blocks == 512  # nothing left over
