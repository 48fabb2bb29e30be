"""``kvmesh bench kvmanager``: KvEvents applied per second into Redis, and event → directory lag.

Two phases against a broker and a Redis (embedded ones started here unless addresses are given):

1. throughput: ``--events`` KvEvents of ``--blocks-per-event`` blocks each (70 % stored, 20 % moved,
   10 % removed, spread over ``--workers`` workers) are produced first; then a KvManagerService
   consumes, applies and flushes them (one Lua call per batch, overlapped with the next batch).
   The topic is filled before the manager starts, so the producer's own CPU time is not part of
   this phase (``throughput_phase``). ``events_per_s`` counts
   KvEvents from the first record consumed to the flush that made the last one durable;
   ``block_updates_per_s`` counts the block-level updates they carry. ``apply_flush_events_per_s`` is
   the same work without Kafka (Directory.apply + flush only).
2. lag: events are produced at ``--rate`` per second for ``--lag-seconds`` by a separate process
   (``--producer process``, the default: in a fleet, workers produce from their own processes; an
   inline producer shares the manager's event loop and GIL and inflates the lag it measures); the
   lag of each is the time from its envelope time (stamped by the producer at send) to the end of the
   Redis transaction that wrote it. p50/p99 in ms. Part of it is the broker hop: tansu answers a
   fetch only when ``fetch_max_wait_ms`` (25 ms) runs out, so ~12 ms of the median is waiting there.

The last stdout line with ``--json`` is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import random
import sys
import time
from typing import Any

from tqdm import tqdm

from kvmesh.percentiles import percentile
from kvmesh_core.runtime import GC_GEN0_THRESHOLD, tune_gc
from schemas.messages import KvEvent
from services.kvmanager.config import KvManagerSettings
from services.kvmanager.directory import Directory
from services.kvmanager.service import KvManagerService
from services.kvmanager.write_behind import DirectoryWriter
from streams.admin import ensure_topics
from streams.clock import now_ms
from streams.embedded import EmbeddedBroker, EmbeddedRedis
from streams.producer import TypedProducer
from streams.settings import KafkaSettings, RedisSettings
from streams.topics import KV_EVENTS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh bench kvmanager", description=__doc__)
    p.add_argument("--events", type=int, default=50_000)
    p.add_argument("--blocks-per-event", type=int, default=8)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--rate", type=float, default=2000.0, help="events per second in the lag phase")
    p.add_argument("--lag-seconds", type=float, default=5.0)
    p.add_argument(
        "--producer",
        choices=("process", "inline"),
        default="process",
        help="lag phase: produce from a separate process (like real workers) or the manager's own loop",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="also measure the one manager, 1 and N replica processes side by side (0: skip)",
    )
    p.add_argument("--replica-events", type=int, default=300_000, help="events of the replicas phase")
    p.add_argument("--kafka", help="bootstrap servers of an existing broker")
    p.add_argument("--redis", help="URL of an existing Redis (its {kvm}:* keys are overwritten)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    return p


class EventMaker:
    """Deterministic KvEvents: each worker grows chains of blocks, moves some, removes some."""

    def __init__(self, workers: int, blocks_per_event: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.workers = [f"bench-w{i}" for i in range(workers)]
        self.n = blocks_per_event
        self.held: dict[str, list[tuple[int, ...]]] = {w: [] for w in self.workers}
        self.next_hash = 1

    def make(self, i: int) -> KvEvent:
        w = self.workers[i % len(self.workers)]
        runs = self.held[w]
        roll = self.rng.random()
        if runs and roll < 0.10:
            run = runs.pop(self.rng.randrange(len(runs)))
            return KvEvent(w, "removed", "gpu", list(run), event_ms=now_ms())
        if runs and roll < 0.30:
            run = runs[self.rng.randrange(len(runs))]
            return KvEvent(w, "moved", "dram", list(run), from_tier="gpu", event_ms=now_ms())
        run = tuple(range(self.next_hash, self.next_hash + self.n))
        self.next_hash += self.n
        runs.append(run)  # tuples of ints: the collector does not track them (see Directory)
        return KvEvent(w, "stored", "gpu", list(run), [0, *run[:-1]], event_ms=now_ms())


async def apply_flush_only(redis: RedisSettings, events: list[KvEvent]) -> float:
    """Events per second of Directory.apply + pipelined flush in batches of 5000, no Kafka."""
    client = redis.connect()
    try:
        await client.flushdb()
        d = Directory()
        writer = DirectoryWriter(d)
        t0 = time.perf_counter()
        for start in range(0, len(events), 5000):
            for ev in events[start : start + 5000]:
                d.apply_kv_event(ev)
            await writer.flush(client)
        dt = time.perf_counter() - t0
        await client.flushdb()
    finally:
        await client.aclose()
    return len(events) / dt


async def produce_paced(
    kafka: KafkaSettings, maker: EventMaker, first: int, n: int, rate: float, progress: bool = False
) -> None:
    """Produce ``n`` events at ``rate`` per second; each envelope is stamped when it is sent."""
    async with TypedProducer(kafka, "bench-kv-lag") as producer:
        start = time.perf_counter()
        for i in tqdm(range(n), desc="lag", disable=not progress, mininterval=0.5):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await producer.send(KV_EVENTS, maker.make(first + i), wait=False)
        await producer.flush()


def produce_paced_process(kafka: KafkaSettings, maker: EventMaker, first: int, n: int, rate: float) -> None:
    """Entry point of the lag phase's producer process (collector tuned as a worker's is)."""
    tune_gc()
    asyncio.run(produce_paced(kafka, maker, first, n, rate))


async def run(args: argparse.Namespace, kafka: KafkaSettings, redis: RedisSettings) -> dict[str, Any]:
    await ensure_topics(kafka)
    maker = EventMaker(args.workers, args.blocks_per_event, args.seed)
    events = [maker.make(i) for i in range(args.events)]
    blocks = sum(len(e.block_hashes) for e in events)
    apply_rate = await apply_flush_only(redis, events)

    async with TypedProducer(kafka, "bench-kv") as producer:
        futures = []
        for ev in tqdm(events, desc="produce", disable=args.json, mininterval=0.5):
            futures.append(await producer.send(KV_EVENTS, ev, wait=False))
        await producer.flush()
        for f in futures:
            await f
    # The produced events are not the manager's memory: drop them before it runs, or every full
    # collection of this process walks them.
    del events, futures

    flushed = {"n": 0, "t_first": 0.0, "t_last": 0.0}
    lags: list[float] = []
    measure_lag = {"on": False}

    def on_flush(event_ms: list[int], flushed_ms: int) -> None:
        if flushed["n"] == 0:
            flushed["t_first"] = time.perf_counter()
        flushed["n"] += len(event_ms)
        flushed["t_last"] = time.perf_counter()
        if measure_lag["on"]:
            lags.extend(flushed_ms - e for e in event_ms)

    settings = KvManagerSettings(kafka=kafka, redis=redis, liveness_timeout_ms=10**9, liveness_clock="event")
    svc = KvManagerService(settings, on_flush=on_flush)
    bar = tqdm(total=args.events, desc="apply", disable=args.json, mininterval=0.5)
    await svc.start()
    # As `kvmesh kvmanager` does once started (kvmesh_core.runtime.tune_gc).
    tune_gc()
    try:
        t0 = time.perf_counter()
        while flushed["n"] < args.events:
            await asyncio.sleep(0.01)
            bar.n = flushed["n"]
            bar.refresh()
        t_end = flushed["t_last"]
        bar.close()
        consume_rate = args.events / (t_end - t0)

        # Lag phase: paced production while the manager runs.
        measure_lag["on"] = True
        n_lag = int(args.rate * args.lag_seconds)
        if args.producer == "process":
            # Workers produce from their own processes: a producer sharing the manager's event loop
            # and GIL would add its own CPU time to the lag it is measuring.
            proc = multiprocessing.get_context("spawn").Process(
                target=produce_paced_process,
                args=(kafka, maker, args.events, n_lag, args.rate),
                name="bench-kv-lag-producer",
            )
            proc.start()
            await asyncio.to_thread(proc.join)
            if proc.exitcode != 0:
                raise RuntimeError(f"lag producer process failed (exit code {proc.exitcode})")
        else:
            await produce_paced(kafka, maker, args.events, n_lag, args.rate, progress=not args.json)
        target = args.events + n_lag
        deadline = time.perf_counter() + 30
        while flushed["n"] < target and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
    finally:
        await svc.stop()
    replicas: dict[str, Any] = {}
    if args.replicas > 0:
        from kvmesh.bench.kvmanager_replicas import measure

        more = EventMaker(args.workers, args.blocks_per_event, args.seed + 1)
        batch = [more.make(i) for i in range(args.replica_events)]
        runs = [await measure(kafka, redis, batch, n) for n in sorted({0, 1, args.replicas})]
        one = runs[1]["events_per_s"]
        replicas = {
            "replica_runs": runs,
            "replica_events_per_s": {str(r["replicas"]): r["events_per_s"] for r in runs},
            "replica_speedup": round(runs[-1]["events_per_s"] / one, 2) if one else 0.0,
            "replica_cpu_us_per_event": {str(r["replicas"]): r["cpu_us_per_event"] for r in runs},
        }
    return {
        **replicas,
        "bench": "kvmanager",
        "events": args.events,
        "blocks_per_event": args.blocks_per_event,
        "block_updates": blocks,
        "events_per_s": round(consume_rate, 1),
        "block_updates_per_s": round(consume_rate * blocks / args.events, 1),
        "apply_flush_events_per_s": round(apply_rate, 1),
        "lag_events": len(lags),
        "lag_rate_per_s": args.rate,
        "lag_producer": args.producer,
        "lag_p50_ms": round(percentile(lags, 50), 2),
        "lag_p99_ms": round(percentile(lags, 99), 2),
        "lag_max_ms": round(max(lags, default=0.0), 2),
        "throughput_phase": "topic pre-loaded, then the manager drains it: first record to last flush",
        "lag_phase": f"paced at {args.rate:g}/s from a {args.producer} producer; envelope time to flush end",
        "gc_gen0_threshold": GC_GEN0_THRESHOLD,
        "goal_events_per_s": 50_000,
        "goal_lag_p99_ms": 50,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING)
    broker = EmbeddedBroker() if not args.kafka else None
    rds = EmbeddedRedis() if not args.redis else None
    try:
        kafka = KafkaSettings(bootstrap_servers=args.kafka if broker is None else broker.start())
        redis = RedisSettings(url=args.redis if rds is None else rds.start())
        result = asyncio.run(run(args, kafka, redis))
    finally:
        if broker is not None:
            broker.stop()
        if rds is not None:
            rds.stop()
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        for k, v in result.items():
            sys.stdout.write(f"{k:>26}: {v}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
