"""``kvmesh bench scheduler``: decision latency, decisions per second and prefix-index memory.

For each fleet size (8, 64, 512 and 4,096 workers) the bench fills a prefix index with ``--blocks``
blocks (10^7 by default)
(chains of ``--chain`` blocks, each on one worker and on a second one with probability 0.3), then
times ``Router.decide`` on requests that reuse a random prefix of a random chain plus new blocks.
Every worker reports its load every 100 ms of event time (one decision per ms), as a live fleet does,
so pending work stays bounded. Reports are applied outside the timed section.

``--json`` prints one JSON object as the last stdout line: ``decision_p50_us`` / ``decision_p99_us``
(wall clock) and ``decision_cpu_p50_us`` / ``decision_cpu_p99_us`` (CPU time of the deciding thread,
which leaves out preemption by other processes on a shared machine), keyed by worker count,
``decisions_per_s`` (one replica at 64 workers, reports included),
``index_bytes_per_entry`` (sys.getsizeof accounting, per (block, holder) entry),
``index_bytes_per_block`` (the same per indexed block), ``index_bytes_per_entry_tracemalloc``, and
``decision_inputs``: the bytes exact replay's input positions add to an Assignment (a full record over 20
state partitions, a 3-partition delta) and the encode time with and without them.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import tracemalloc
from typing import Any

import msgspec
from tqdm import tqdm

from kvmesh.percentiles import percentile
from kvmesh_core.costmodel import PROFILES
from schemas.messages import ChatRequest, LoadReport, TierUsage
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.router import Router, RouterSettings
from services.scheduler.view import FleetView

BS = 16


def _report(worker: str, t: int, rng: random.Random) -> LoadReport:
    p = PROFILES["h100-llama3-8b"]
    depth = rng.randint(0, 6)
    return LoadReport(
        worker_id=worker,
        report_ms=t,
        queue_depth=depth,
        active_requests=rng.randint(0, 32),
        active_tokens=rng.randint(0, 60000),
        queued_prefill_tokens=depth * rng.randint(200, 4000),
        tiers=[TierUsage("gpu", 1000, p.gpu_blocks), TierUsage("dram", 1000, p.dram_blocks)],
        transfer_address=f"10.0.{int(worker[2:]) // 250}.{int(worker[2:]) % 250}:7000",
        block_size=BS,
        block_bytes=p.block_bytes,
        prefill_ms_per_token=p.prefill_ms_per_token,
        prefill_ms_per_token_per_ctx=p.prefill_ms_per_token_per_ctx,
        decode_ms_per_step=p.decode_ms_per_step,
        link_gbps=p.link_gbps,
        link_latency_ms=p.link_latency_ms,
    )


def _fill(
    index_owner: FleetView, workers: list[str], n_blocks: int, chain: int, rng: random.Random
) -> list[list[int]]:
    chains = []
    tiers = ("gpu", "gpu", "dram")
    for _ in tqdm(
        range(max(1, n_blocks // chain)), desc=f"index {len(workers)}w", file=sys.stderr, leave=False
    ):
        hashes = [rng.getrandbits(64) | 1 for _ in range(chain)]
        holder = rng.choice(workers)
        index_owner.index.store(holder, rng.choice(tiers), hashes)
        if rng.random() < 0.3:
            index_owner.index.store(rng.choice(workers), rng.choice(tiers), hashes[: rng.randint(1, chain)])
        chains.append(hashes)
    return chains


def _requests(chains: list[list[int]], n: int, t0: int, rng: random.Random) -> list[ChatRequest]:
    out = []
    for i in range(n):
        c = rng.choice(chains)
        k = rng.randint(0, len(c)) if rng.random() < 0.8 else 0
        extra = rng.randint(1, 16)
        hashes = c[:k] + [rng.getrandbits(64) | 1 for _ in range(extra)]
        tokens = [1] * (len(hashes) * BS + rng.randint(0, BS - 1))
        out.append(
            ChatRequest(
                request_id=f"b{i}",
                session_id=f"s{i % 997}",
                tenant=f"t{i % 7}",
                token_ids=tokens,
                block_hashes=hashes,
                block_size=BS,
                max_tokens=64,
                arrival_ms=t0 + i,
            )
        )
    return out


def bench_fleet(n_workers: int, n_blocks: int, n_decisions: int, chain: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    workers = [f"w-{i}" for i in range(n_workers)]
    view = FleetView(block_size=BS)
    t0 = 1_000_000
    for w in workers:
        view.apply_load(_report(w, t0, rng))
    chains = _fill(view, workers, n_blocks, chain, rng)
    reqs = _requests(chains, n_decisions, t0 + 1, rng)
    router = Router(view, RouterSettings())
    lat_us: list[float] = []
    cpu_us: list[float] = []
    next_report = {w: t0 + 1 + rng.randint(0, 99) for w in workers}
    gc.collect()
    gc.disable()  # a collection pause in the middle of one decision is not the router's latency
    wall0 = time.perf_counter()
    try:
        for req in tqdm(reqs, desc=f"decide {n_workers}w", file=sys.stderr, leave=False):
            now = req.arrival_ms
            for w in workers if now % 10 == 0 else ():
                if next_report[w] <= now:
                    view.apply_load(_report(w, now, rng))
                    next_report[w] = now + 100
            c = time.thread_time_ns()
            t = time.perf_counter_ns()
            d = router.decide(req, now)
            lat_us.append((time.perf_counter_ns() - t) / 1e3)
            cpu_us.append((time.thread_time_ns() - c) / 1e3)
            if d.assignment is None:
                raise RuntimeError(f"bench request not assigned: {d.reason}")
    finally:
        gc.enable()
    wall = time.perf_counter() - wall0
    return {
        "workers": n_workers,
        "blocks": len(view.index),
        "entries": view.index.entries,
        "p50_us": percentile(lat_us, 50),
        "p99_us": percentile(lat_us, 99),
        "mean_us": sum(lat_us) / len(lat_us),
        "cpu_p50_us": percentile(cpu_us, 50),
        "cpu_p99_us": percentile(cpu_us, 99),
        "decisions_per_s": n_decisions / wall,
        "bytes_per_entry": view.index.bytes_per_entry(),
    }


def decision_inputs_cost(partitions: int = 20, n: int = 2000) -> dict[str, float]:
    """What exact replay's input positions add to an Assignment: encoded bytes of a full record
    (every state partition and its start) and of a typical delta (3 partitions moved), beside the
    assignment without them, and the time to encode one with a delta."""
    from schemas.codec import encode
    from schemas.messages import Assignment, DecisionInputs, Estimate

    rng = random.Random(1)
    req = _requests([[rng.getrandbits(64) | 1 for _ in range(16)]], 1, 1, rng)[0]
    keys = [
        f"kvmesh.{t}/{p}" for t in ("kv-events", "load", "control", "replies") for p in range(partitions // 4)
    ]
    applied = {k: rng.randint(10_000, 10_000_000) for k in keys}
    base = Assignment(req, "w-1", 4, 100, Estimate(12.5, 1.0, 10.0, 1.5, "kvmesh"), decision_seq=12345)
    full = msgspec.structs.replace(base, inputs=DecisionInputs(1_700_000_000_000, applied, applied, True, 99))
    delta = msgspec.structs.replace(
        base, inputs=DecisionInputs(1_700_000_000_000, dict(list(applied.items())[:3]), {}, False, 100)
    )
    sizes = {
        name: len(encode(a, "scheduler-0", 1, 0))
        for name, a in (("none", base), ("full", full), ("delta", delta))
    }
    t = time.perf_counter()
    for _ in range(n):
        encode(delta, "scheduler-0", 1, 0)
    with_inputs = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for _ in range(n):
        encode(base, "scheduler-0", 1, 0)
    without = (time.perf_counter() - t) / n * 1e6
    return {
        "assignment_bytes": sizes["none"],
        "inputs_full_bytes": sizes["full"] - sizes["none"],
        "inputs_delta_bytes": sizes["delta"] - sizes["none"],
        "encode_us_with_delta_inputs": round(with_inputs, 2),
        "encode_us_without_inputs": round(without, 2),
    }


def tracemalloc_bytes_per_entry(n_blocks: int, chain: int, seed: int) -> float:
    """Bytes per (block, holder) entry as tracemalloc sees them while an index is filled."""
    rng = random.Random(seed)
    chains = [[rng.getrandbits(64) | 1 for _ in range(chain)] for _ in range(max(1, n_blocks // chain))]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex()
    for i, c in enumerate(chains):
        # the hash ints already exist (they arrive in messages); the index keeps them and its own values
        index.store(f"w-{i % 64}", "gpu", c)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / max(index.entries, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvmesh bench scheduler", description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=10_000_000, help="blocks in the prefix index")
    ap.add_argument("--workers", default="8,64,512,4096", help="comma-separated fleet sizes")
    ap.add_argument("--decisions", type=int, default=3000, help="timed decisions per fleet size")
    ap.add_argument("--chain", type=int, default=64, help="blocks per stored prefix chain")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)

    results = {}
    for n in (int(x) for x in args.workers.split(",")):
        results[str(n)] = bench_fleet(n, args.blocks, args.decisions, args.chain, args.seed)
        gc.collect()
    tm = tracemalloc_bytes_per_entry(min(args.blocks, 200_000), args.chain, args.seed)
    ref = results.get("64") or next(iter(results.values()))
    summary = {
        "blocks": args.blocks,
        "decisions": args.decisions,
        "decision_p50_us": {k: round(r["p50_us"], 2) for k, r in results.items()},
        "decision_p99_us": {k: round(r["p99_us"], 2) for k, r in results.items()},
        "decision_mean_us": {k: round(r["mean_us"], 2) for k, r in results.items()},
        # CPU time of the deciding thread: the same decisions without the time other processes took
        "decision_cpu_p50_us": {k: round(r["cpu_p50_us"], 2) for k, r in results.items()},
        "decision_cpu_p99_us": {k: round(r["cpu_p99_us"], 2) for k, r in results.items()},
        "decisions_per_s": round(ref["decisions_per_s"], 1),
        "decisions_per_s_by_workers": {k: round(r["decisions_per_s"], 1) for k, r in results.items()},
        "index_entries": {k: r["entries"] for k, r in results.items()},
        "index_bytes_per_entry": round(ref["bytes_per_entry"], 1),
        "index_bytes_per_block": {
            k: round(r["bytes_per_entry"] * r["entries"] / max(r["blocks"], 1), 1) for k, r in results.items()
        },
        "index_bytes_per_entry_tracemalloc": round(tm, 1),
        # exact replay: what each Assignment's DecisionInputs adds (a full record every 64 batches)
        "decision_inputs": decision_inputs_cost(),
    }
    if args.json:
        sys.stdout.write(json.dumps(summary) + "\n")
    else:
        for k, r in results.items():
            sys.stdout.write(
                f"{k:>4} workers: p50 {r['p50_us']:.1f} us  p99 {r['p99_us']:.1f} us  "
                f"(cpu p99 {r['cpu_p99_us']:.1f} us)  "
                f"{r['decisions_per_s']:.0f} decisions/s  {r['entries']} entries\n"
            )
        sys.stdout.write(
            f"index: {summary['index_bytes_per_entry']} B/entry (getsizeof), "
            f"{summary['index_bytes_per_entry_tracemalloc']} B/entry (tracemalloc)\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
