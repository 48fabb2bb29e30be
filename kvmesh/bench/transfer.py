"""``kvmesh bench transfer``: data-plane throughput and latency between two worker processes on loopback.

A server process (multiprocessing, spawn) holds 256 MiB of KV blocks of the ``cpu-tiny`` layout and
serves them with a real ``BlockServer``; beside it a raw socket server sends the very same bytes with a
plain ``socket.sendall``. This process fetches 1, 16 and 256 MiB of blocks with ``BlockClient`` (into a
reused staging buffer, checksums verified, commit a no-op so the pool's copy is not measured) and the
same sizes raw (``recv_into`` one buffer), so the ratio is the protocol's cost against the machine's
loopback ceiling.

``fetch_vs_recompute_speedup_4k``: with ``services.worker.engine`` present, the server process runs a
real 4096-token prefill of the tiny model and serves its 256 blocks; this process fetches them into a
real KvCacheManager. Otherwise recompute time comes from ``kvmesh_core.costmodel.PROFILES['cpu-tiny']``.

``--json``: the last stdout line is one JSON object (``gbps``, ``raw_gbps``, ``p50_ms``, ``p99_ms`` keyed
by size in MiB as strings; ``fraction_of_raw_ceiling_256MiB``; ``fetch_vs_recompute_speedup_4k``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from tqdm import tqdm

from kvmesh.percentiles import percentile
from kvmesh_core.costmodel import PROFILES, recompute_ms
from services.worker.kv_layout import BlockLayout
from services.worker.transfer import sockets as transfer_sockets

SECRET = b"kvmesh-bench-transfer-secret"
NAMESPACE = b"t:bench"
#: The cpu-tiny profile's layout (tiny model: 4 layers, 2 kv heads, head_dim 32, fp32): 32 KiB blocks.
LAYOUT = BlockLayout(layers=4, kv_heads=2, block_size=16, head_dim=32, dtype="float32")
SIZES_MIB = (1, 16, 256)
ROUNDS = {1: 40, 16: 15, 256: 5}
PREFIX_TOKENS = 4096


class _ArraySource:
    """A BlockSource over one contiguous array: block i is bytes [i*nb, (i+1)*nb) (hash i + 1)."""

    def __init__(self, layout: BlockLayout, data: np.ndarray) -> None:
        self.layout = layout
        self.data = data
        self.nb = layout.nbytes
        self.n = data.size // self.nb

    def read_block(self, block_hash: int) -> tuple[str, memoryview] | None:
        i = block_hash - 1
        if not 0 <= i < self.n:
            return None
        nb = self.nb
        return "dram", memoryview(self.data[i * nb : (i + 1) * nb])  # type: ignore[arg-type]  # a buffer

    def release_read(self, block_hash: int) -> None:
        return None

    def namespace_of(self, block_hash: int) -> bytes | None:
        return NAMESPACE


class _StagingSink:
    """A BlockSink that reuses one staging buffer and only counts commits (the pool copy is not measured)."""

    def __init__(self, layout: BlockLayout, max_blocks: int) -> None:
        self.layout = layout
        self._buf = memoryview(bytearray(max_blocks * layout.nbytes))
        self.committed = 0

    def staging_buffer(self, n_blocks: int) -> memoryview:
        return self._buf[: n_blocks * self.layout.nbytes]

    def commit_blocks(self, blocks: list[tuple[int, int, bytes | memoryview]], namespace: bytes) -> int:
        self.committed += len(blocks)
        return len(blocks)


def _raw_server(listener: socket.socket, data: memoryview) -> None:
    """Per connection: read an 8-byte size, sendall that many bytes of ``data``, close."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            want = int.from_bytes(conn.recv(8), "little")
            conn.sendall(data[:want])


def _engine_prefix(n_tokens: int) -> tuple[Any, list[int], float] | None:
    """Run a real ``n_tokens`` prefill on the tiny engine; (engine, its block hashes, prefill ms)."""
    try:
        from services.worker.engine import Engine, EngineConfig, EngineRequest
    except ImportError:
        return None
    from schemas.blocks import block_hashes
    from schemas.messages import SamplingParams

    bs = LAYOUT.block_size
    engine = Engine(
        EngineConfig(
            model="tiny",
            device="cpu",
            dtype="float32",
            block_size=bs,
            gpu_blocks=n_tokens // bs + 64,
            dram_blocks=0,
            max_context=n_tokens * 2,
            prefill_chunk=n_tokens,
            worker_id="bench-server",
        )
    )
    rng = np.random.default_rng(0)
    best = float("inf")
    hashes: list[int] = []
    for r in range(2):  # the second run recomputes a new prefix: the first warms up torch
        toks = rng.integers(1, 250, size=n_tokens).tolist()
        hashes = block_hashes(toks, bs, NAMESPACE)
        engine.add_request(
            EngineRequest(f"bench-{r}", "bench", toks, hashes, NAMESPACE, 1, SamplingParams(temperature=0.0))
        )
        t0 = time.perf_counter()
        while engine.has_work():
            engine.step()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return engine, hashes, best


def _server_main(conn: Connection, total_bytes: int, with_engine: bool) -> None:
    """The server worker process: block server + raw server over the same bytes, and the 4k prefix."""
    from services.worker.transfer import BlockServer

    data = np.random.default_rng(1).integers(0, 256, size=total_bytes, dtype=np.uint8)
    source = _ArraySource(LAYOUT, data)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, transfer_sockets.SOCKET_BUFFER_BYTES)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    raw_view = memoryview(data)  # type: ignore[arg-type]  # ndarray is a buffer
    threading.Thread(target=_raw_server, args=(listener, raw_view), daemon=True).start()
    prefix = _engine_prefix(PREFIX_TOKENS) if with_engine else None

    async def serve() -> None:
        async with contextlib.AsyncExitStack() as stack:
            server = await stack.enter_async_context(BlockServer(source, secret=SECRET, max_blocks=source.n))
            info: dict[str, Any] = {
                "blocks": server.address,
                "raw": f"127.0.0.1:{listener.getsockname()[1]}",
                "n_blocks": source.n,
            }
            if prefix is not None:
                engine, hashes, prefill_ms = prefix
                eserver = await stack.enter_async_context(BlockServer(engine.kv, secret=SECRET))
                info.update(engine=eserver.address, engine_hashes=hashes, prefill_ms=prefill_ms)
            conn.send(info)
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # wait for "stop"

    asyncio.run(serve())
    listener.close()


def _raw_fetch(address: str, buf: memoryview, nbytes: int) -> float:
    host, port = address.rsplit(":", 1)
    t0 = time.perf_counter()
    with socket.create_connection((host, int(port))) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, transfer_sockets.SOCKET_BUFFER_BYTES)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(nbytes.to_bytes(8, "little"))
        got = 0
        while got < nbytes:
            n = s.recv_into(buf[got:nbytes])
            if n == 0:
                raise ConnectionError("raw server closed early")
            got += n
    return time.perf_counter() - t0


async def _run(info: dict[str, Any], sizes: list[int], rounds: dict[int, int]) -> dict[str, Any]:
    from services.worker.transfer import BlockClient, TransferMetrics

    nb = LAYOUT.nbytes
    metrics = TransferMetrics()
    client = BlockClient(SECRET, timeout_s=120, metrics=metrics)
    sink = _StagingSink(LAYOUT, info["n_blocks"])
    raw_buf = memoryview(bytearray(info["n_blocks"] * nb))
    loop = asyncio.get_running_loop()
    out: dict[str, Any] = {"gbps": {}, "raw_gbps": {}, "p50_ms": {}, "p99_ms": {}, "raw_p50_ms": {}}
    total = sum(2 * (rounds[s] + 1) for s in sizes)
    with tqdm(total=total, desc="transfer bench", file=sys.stderr) as bar:
        for size in sizes:
            n = size * (1 << 20) // nb
            hashes = list(range(1, n + 1))
            fetch_s: list[float] = []
            raw_s: list[float] = []
            for r in range(rounds[size] + 1):  # round 0 warms up both paths
                # Alternate the two paths so a noisy neighbour hurts both alike.
                dt_raw = await loop.run_in_executor(None, _raw_fetch, info["raw"], raw_buf, n * nb)
                bar.update()
                t0 = time.perf_counter()
                res = await client.fetch(info["blocks"], hashes, 0, NAMESPACE, sink, peer_id="bench")
                dt = time.perf_counter() - t0
                bar.update()
                if not res.ok:
                    raise RuntimeError(f"bench fetch failed: {res.error} {res.detail}")
                if r:
                    fetch_s.append(dt)
                    raw_s.append(dt_raw)
            key = str(size)
            out["gbps"][key] = n * nb / statistics.median(fetch_s) / 1e9
            out["raw_gbps"][key] = n * nb / statistics.median(raw_s) / 1e9
            out["p50_ms"][key] = percentile(fetch_s, 50) * 1e3
            out["p99_ms"][key] = percentile(fetch_s, 99) * 1e3
            out["raw_p50_ms"][key] = percentile(raw_s, 50) * 1e3
    if "256" in out["gbps"]:
        out["fraction_of_raw_ceiling_256MiB"] = out["gbps"]["256"] / out["raw_gbps"]["256"]
    out["metrics"] = metrics.snapshot()
    out["speedup"] = await _speedup(client, info)
    return out


async def _speedup(client: Any, info: dict[str, Any]) -> dict[str, Any]:
    n_blocks = PREFIX_TOKENS // LAYOUT.block_size
    if "engine" in info:
        from services.worker.kv_cache_manager import KvCacheManager

        hashes = info["engine_hashes"]
        best = float("inf")
        for _ in range(3):
            sink = KvCacheManager(LAYOUT, gpu_blocks=16, dram_blocks=n_blocks + 16, worker_id="bench-client")
            t0 = time.perf_counter()
            res = await client.fetch(info["engine"], hashes, 0, NAMESPACE, sink, peer_id="bench-client")
            best = min(best, time.perf_counter() - t0)
            if len(res.received) != len(hashes):
                raise RuntimeError(f"engine-block fetch failed: {res.error} {res.detail}")
            sink.close()
        recompute = float(info["prefill_ms"])
        source = "measured: tiny Engine 4096-token prefill vs BlockClient fetch into a KvCacheManager"
    else:
        staging = _StagingSink(LAYOUT, n_blocks)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            await client.fetch(info["blocks"], list(range(1, n_blocks + 1)), 0, NAMESPACE, staging)
            best = min(best, time.perf_counter() - t0)
        recompute = recompute_ms(PROFILES["cpu-tiny"], PREFIX_TOKENS)
        source = "recompute from kvmesh_core.costmodel.PROFILES['cpu-tiny'] (no engine); fetch measured"
    fetch_ms = best * 1e3
    return {
        "fetch_vs_recompute_speedup_4k": recompute / fetch_ms,
        "recompute_4k_ms": recompute,
        "fetch_4k_ms": fetch_ms,
        "speedup_source": source,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvmesh bench transfer", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES_MIB)), help="MiB per fetch, comma-separated")
    ap.add_argument("--rounds", type=int, default=0, help="timed rounds per size (default: by size)")
    ap.add_argument("--no-engine", action="store_true", help="recompute time from the cpu-tiny profile")
    ap.add_argument(
        "--engine",
        choices=["builtin", "vllm"],
        default="builtin",
        help="vllm: a 4k prompt through vLLM, 90%% fetched through the kvmesh connector vs recomputed",
    )
    ap.add_argument("--model", default=None, help="with --engine vllm: a local model directory")
    ap.add_argument("--dtype", default="auto", help="with --engine vllm")
    ap.add_argument("--tokens", type=int, default=4096, help="with --engine vllm: prompt length")
    ap.add_argument("--fraction", type=float, default=0.9, help="with --engine vllm: share fetched")
    ap.add_argument(
        "--repeats", type=int, default=3, help="with --engine vllm: fresh prompts; fastest counts"
    )
    ap.add_argument(
        "--async-load",
        action="store_true",
        help="with --engine vllm: the connector copies in a background thread (vllm_async_load)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.engine == "vllm":
        if not args.model:
            ap.error("--engine vllm needs --model DIR (kvmesh model init DIR writes one)")
        from kvmesh.bench.transfer_vllm import main_vllm

        return main_vllm(args)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    rounds = {s: args.rounds or ROUNDS.get(s, 5) for s in sizes}

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    total = max(max(sizes), 16) * (1 << 20)
    proc = ctx.Process(target=_server_main, args=(child, total, not args.no_engine), daemon=True)
    proc.start()
    try:
        if not parent.poll(600):
            raise RuntimeError("bench server process did not start")
        info = parent.recv()
        res = asyncio.run(_run(info, sizes, rounds))
    finally:
        with contextlib.suppress(OSError):
            parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    speed = res.pop("speedup")
    result: dict[str, Any] = {
        "bench": "transfer",
        "layout": asdict(LAYOUT),
        "block_bytes": LAYOUT.nbytes,
        **{k: {s: round(v, 3) for s, v in res[k].items()} for k in ("gbps", "raw_gbps", "p50_ms", "p99_ms")},
        "raw_p50_ms": {s: round(v, 3) for s, v in res["raw_p50_ms"].items()},
        "fraction_of_raw_ceiling_256MiB": round(res.get("fraction_of_raw_ceiling_256MiB", 0.0), 3),
        **{k: round(v, 3) if isinstance(v, float) else v for k, v in speed.items()},
        "sink": "reused staging buffer, checksums verified, commit counted only",
        "metrics": res["metrics"],
    }
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        for size in sizes:
            key = str(size)
            sys.stdout.write(
                f"{size:>4} MiB  fetch {result['gbps'][key]:7.2f} GB/s"
                f"  raw {result['raw_gbps'][key]:7.2f} GB/s"
                f"  p50 {result['p50_ms'][key]:8.2f} ms  p99 {result['p99_ms'][key]:8.2f} ms\n"
            )
        sys.stdout.write(
            f"fraction of raw ceiling at 256 MiB: {result['fraction_of_raw_ceiling_256MiB']:.2f}\n"
            f"fetch vs recompute (4k tokens): {result['fetch_vs_recompute_speedup_4k']:.1f}x "
            f"({result['speedup_source']})\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
