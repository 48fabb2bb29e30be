"""``kvmesh bench transfer --engine vllm --model DIR``: a 4k-token prompt through vLLM, its first 90 %
fetched from a peer through the kvmesh connector, against the same prompt recomputed by vLLM.

One vLLM engine (in process, with the connector's DRAM tier) and one peer on loopback: a real
``BlockServer`` serving the blocks that engine computed for the prefix (copied out of its store, so the
bytes are exactly what a peer vLLM worker would serve). Per repeat, with a fresh random prompt:

    recompute   caches reset → add_request(prompt) → first token                  (vLLM prefill)
    fetch       caches reset → BlockClient.fetch(90 % of the blocks) into the store
                → add_request(prompt) → the connector loads them → first token     (one timer for all)

The fastest of ``--repeats`` counts for each. The connector's own cost is reported per block: the load
(store → vLLM block, in the forward) and the save (vLLM block → store, after the forward), so the cost
model's figures for vLLM workers are measured. ``--json``: the last stdout line is one JSON object.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from tqdm import tqdm

from schemas.blocks import ROOT_HASH, block_hashes, tenant_namespace
from services.worker.config import WorkerSettings
from services.worker.engine_api import EngineRequest
from services.worker.engines import build_engine
from services.worker.transfer import BlockClient, BlockServer
from services.worker.transfer.memory import MemoryBlockStore
from services.worker.vllm_engine import VllmEngine

SECRET = b"kvmesh-bench-transfer-vllm"
NS = tenant_namespace("bench")


def _first_token_ms(eng: VllmEngine, rid: str, ids: list[int]) -> float:
    t0 = time.perf_counter()
    eng.add_request(EngineRequest(rid, rid, ids, block_hashes(ids, eng.block_size, NS), NS, 1))
    ms = 0.0
    while eng.has_work():
        for o in eng.step():
            if o.request_id == rid and o.first_token:
                ms = (time.perf_counter() - t0) * 1e3
    return ms


def _peer_main(conn: Connection) -> None:
    """The peer process: serve the blocks it was last sent, until told to stop."""

    async def serve() -> None:
        server: BlockServer | None = None
        loop = asyncio.get_running_loop()
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg == "stop":
                break
            layout, blocks = msg
            store = MemoryBlockStore(layout)
            for h, parent, data in blocks:
                store.put(h, data, NS, parent=parent)
            if server is not None:
                await server.stop()
            server = BlockServer(store, secret=SECRET)
            conn.send(await server.start())
        if server is not None:
            await server.stop()

    asyncio.run(serve())


async def _measure(
    eng: VllmEngine, conn: Connection, tokens: int, frac: float, repeats: int, seed: int
) -> dict[str, Any]:
    assert eng.store is not None
    bs = eng.block_size
    rng = np.random.default_rng(seed)
    vocab = min(eng.vocab_size, 1000)
    k = int(tokens * frac) // bs
    recompute, fetch_total, fetch_net = [], [], []
    client = BlockClient(SECRET, timeout_s=30.0)
    _first_token_ms(eng, "warmup", rng.integers(0, vocab, 256).tolist())
    for r in tqdm(range(repeats), desc="vllm fetch vs recompute", file=sys.stderr, disable=None):
        ids = rng.integers(0, vocab, tokens).tolist()
        eng.reset_cache()
        recompute.append(_first_token_ms(eng, f"recompute-{r}", ids))
        # the peer gets the blocks of the prompt's first 90 %, as this engine computed and saved them
        hashes = block_hashes(ids, bs, NS)[:k]
        blocks = []
        for i, h in enumerate(hashes):
            got = eng.store.read_block(h)
            assert got is not None, "the connector did not save a computed block"
            blocks.append((h, hashes[i - 1] if i else ROOT_HASH, bytes(got[1])))
            eng.store.release_read(h)
        conn.send((eng.store.layout, blocks))
        address = conn.recv()
        eng.reset_cache()
        t0 = time.perf_counter()
        parents = [ROOT_HASH, *hashes[:-1]]
        res = await client.fetch(address, hashes, parents, NS, eng.store, peer_id="bench")
        net = (time.perf_counter() - t0) * 1e3
        assert len(res.received) == k, res.failed
        ttft = _first_token_ms(eng, f"fetch-{r}", ids)
        fetch_total.append(net + ttft)
        fetch_net.append(net)
    return {"recompute": min(recompute), "fetch": min(fetch_total), "net": min(fetch_net), "blocks": k}


def main_vllm(args: Any) -> int:
    eng = build_engine(
        WorkerSettings(
            worker_id="bench",
            engine="vllm",
            model=args.model,
            dtype=args.dtype,
            block_size=32,
            gpu_blocks=2 * (args.tokens // 32) + 64,
            dram_blocks=2 * (args.tokens // 32) + 64,
            max_context=args.tokens + 64,
            calibrate=False,
            insecure_dev_transfer=True,
            vllm_async_load=args.async_load,
        )
    )
    assert isinstance(eng, VllmEngine) and eng.store is not None
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    peer = ctx.Process(target=_peer_main, args=(child,), daemon=True)
    peer.start()
    try:
        m = asyncio.run(_measure(eng, parent, args.tokens, args.fraction, args.repeats, args.seed))
        st = eng.connector_stats
    finally:
        eng.release_all()
        with contextlib.suppress(OSError):
            parent.send("stop")
        peer.join(10)
        if peer.is_alive():
            peer.kill()
    speedup = m["recompute"] / m["fetch"] if m["fetch"] > 0 else 0.0
    result = {
        "bench": "transfer",
        "engine": "vllm",
        "model": eng.model_name,
        "dtype": eng.dtype,
        "block_size": eng.block_size,
        "block_bytes": eng.block_bytes,
        "prompt_tokens": args.tokens,
        "fetched_fraction": args.fraction,
        "fetched_blocks": m["blocks"],
        "ttft_recompute_ms": round(m["recompute"], 3),
        "ttft_fetch_ms": round(m["fetch"], 3),
        "fetch_network_ms": round(m["net"], 3),
        "fetch_vs_recompute_speedup_4k": round(speedup, 3),
        "async_load": args.async_load,
        "connector_load_us_per_block": round(st.load_s / max(st.loaded_blocks, 1) * 1e6, 2),
        "connector_save_us_per_block": round(st.save_s / max(st.saved_blocks, 1) * 1e6, 2),
        "connector_loaded_blocks": st.loaded_blocks,
        "connector_saved_blocks": st.saved_blocks,
        "repeats": args.repeats,
    }
    sys.stdout.write(
        f"vLLM {args.tokens}-token prompt: recompute {m['recompute']:.1f} ms, {int(args.fraction * 100)}% "
        f"fetched from a peer {m['fetch']:.1f} ms (network {m['net']:.1f} ms) -> {speedup:.1f}x; connector "
        f"load {result['connector_load_us_per_block']} us/block, "
        f"save {result['connector_save_us_per_block']} us/block\n"
    )
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    return 0
