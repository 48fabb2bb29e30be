"""``kvmesh bench kvmanager --replicas N``: the apply rate of 1 and of N KV-manager replicas, side by side.

Each count gets its own topics (a fresh topic prefix) pre-filled with the same ``--events`` KvEvents
and an empty directory. The replicas run as processes of their own (``sharded``: one consumer group
on kv-events, a shard slice per partition). The rate is measured from the moment the group has
settled (every partition owned, no change for ``SETTLE_S``) to the moment every event is applied,
on the events applied in between: group formation (seconds on tansu) is not part of it, the work of
each replica is. Each replica reports its owned partitions, applied events and CPU time through
shared memory.

The rate only grows with replicas where cores are free: on a 2-core box the broker, Redis and the
replicas share two cores. ``cpu_us_per_event`` (all replicas' CPU time over the events applied)
says whether the work splits without overhead, which is what more cores turn into rate.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
import uuid
from multiprocessing.sharedctypes import Synchronized
from typing import Any

from kvmesh_core.runtime import tune_gc
from services.kvmanager.config import KvManagerSettings
from services.kvmanager.replica import KvManagerReplica
from services.kvmanager.service import KvManagerService
from streams.admin import ensure_topics
from streams.producer import TypedProducer
from streams.settings import KafkaSettings, RedisSettings
from streams.topics import KV_EVENTS

#: The group counts as settled once its partitions have stayed owned this long.
SETTLE_S = 1.0


async def _replica_main(
    kafka: KafkaSettings, redis: RedisSettings, name: str, shared: list[Synchronized[int]], sharded: bool
) -> None:
    owned, applied, cpu_us = shared
    settings = KvManagerSettings(
        kafka=kafka,
        redis=redis,
        manager_id=name,
        sharded=sharded,
        liveness_timeout_ms=10**9,
        liveness_clock="event",
    )
    replica = KvManagerReplica(settings) if sharded else KvManagerService(settings)
    await replica.start()
    tune_gc()
    partitions = kafka.partitions_of(KV_EVENTS)
    try:
        while True:
            shards = replica.shards if isinstance(replica, KvManagerReplica) else None
            owned.value = partitions if shards is None else len(shards.partitions())
            applied.value = replica.metrics.events_applied
            cpu_us.value = int(time.process_time() * 1e6)
            await asyncio.sleep(0.02)
    finally:
        await replica.stop()


def replica_process(
    kafka: KafkaSettings, redis: RedisSettings, name: str, shared: list[Synchronized[int]], sharded: bool
) -> None:
    """Entry point of one replica process (runs until terminated); unsharded: the one manager."""
    asyncio.run(_replica_main(kafka, redis, name, shared, sharded))


async def _clear_directory(redis: RedisSettings) -> None:
    client = redis.connect()
    try:
        keys = [k async for k in client.scan_iter(match="{kvm*", count=1000)]
        for k in keys:
            await client.delete(k)
    finally:
        await client.aclose()


async def _fill(kafka: KafkaSettings, events: list[Any]) -> None:
    await ensure_topics(kafka)
    async with TypedProducer(kafka, "bench-kv-replicas") as producer:
        futures = [await producer.send(KV_EVENTS, ev, wait=False) for ev in events]
        await producer.flush()
        for f in futures:
            await f


async def measure(
    kafka: KafkaSettings, redis: RedisSettings, events: list[Any], replicas: int
) -> dict[str, Any]:
    """Apply ``events`` with ``replicas`` replica processes; their rate once the group settled.
    ``replicas=0``: the one (unsharded) manager in the same harness, the baseline."""
    sharded = replicas > 0
    replicas = max(replicas, 1)
    own = kafka.model_copy(
        update={"topic_prefix": f"{kafka.topic_prefix}r{replicas}-{uuid.uuid4().hex[:6]}."}
    )
    await _clear_directory(redis)
    await _fill(own, events)
    ctx = multiprocessing.get_context("spawn")
    owned = [ctx.Value("q", 0) for _ in range(replicas)]
    applied = [ctx.Value("q", 0) for _ in range(replicas)]
    cpu = [ctx.Value("q", 0) for _ in range(replicas)]
    procs = [
        ctx.Process(
            target=replica_process,
            args=(own, redis, f"bench-r{i}", [owned[i], applied[i], cpu[i]], sharded),
            daemon=True,
        )
        for i in range(replicas)
    ]
    partitions = own.partitions_of(KV_EVENTS)
    for p in procs:
        p.start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120
        stable_since: float | None = None
        layout: list[int] = []
        while True:
            if loop.time() > deadline:
                raise RuntimeError("the replicas' group did not settle in 120 s")
            dead = [p.name for p in procs if p.exitcode is not None]
            if dead:
                raise RuntimeError(f"replica processes exited: {dead}")
            now = [o.value for o in owned]
            if sum(now) == partitions and all(now) and now == layout:
                stable_since = stable_since or loop.time()
                if loop.time() - stable_since >= SETTLE_S:
                    break
            else:
                stable_since = None
            layout = now
            await asyncio.sleep(0.02)
        n0, t0, c0 = sum(a.value for a in applied), time.perf_counter(), sum(c.value for c in cpu)
        while sum(a.value for a in applied) < len(events):
            if loop.time() > deadline:
                raise RuntimeError("the replicas did not apply every event in time")
            await asyncio.sleep(0.01)
        dt = time.perf_counter() - t0
        await asyncio.sleep(0.05)  # the CPU counters are written every 20 ms
        cpu_s = (sum(c.value for c in cpu) - c0) / 1e6
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(timeout=10)
    measured = len(events) - n0
    return {
        "replicas": replicas if sharded else 0,
        "owned_partitions": layout,
        "events_measured": measured,
        "events_per_s": round(measured / dt, 1) if dt > 0 and measured > 0 else 0.0,
        "cpu_us_per_event": round(cpu_s * 1e6 / measured, 2) if measured > 0 else 0.0,
        "cores": os.cpu_count(),
    }
