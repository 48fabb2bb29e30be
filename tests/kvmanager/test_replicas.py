"""KV-manager replicas against a real broker and a real redis-server: shards split, a SIGKILLed
replica's shards move to the survivor, no event is lost and no live worker is declared lost."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from schemas.messages import KvEvent, WorkerLost
from services.fleet_directory.snapshot import read_snapshot, shard_prefixes
from services.kvmanager.config import KvManagerSettings
from services.kvmanager.directory import Directory
from services.kvmanager.replica import KvManagerReplica
from streams.clock import now_ms
from streams.consumer import TypedConsumer
from streams.embedded import free_port
from streams.producer import TypedProducer, partition_for
from streams.settings import RedisSettings
from streams.topics import CONTROL, KV_EVENTS, LOAD, REQUESTS

from .helpers import load, removed, request, stored

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
WORKERS = [f"w{i}" for i in range(8)]
SESSION_TIMEOUT_MS = 3000
LIVENESS_MS = 4000


def events(round_: int) -> list[KvEvent]:
    """Each worker stores a run of its own plus a shared one; the second round removes some."""
    out: list[KvEvent] = []
    for i, w in enumerate(WORKERS):
        base = 1000 * (i + 1) + 100 * round_
        out.append(stored(w, [base, base + 1, base + 2], ms=now_ms()))
        out.append(stored(w, [7, 8 + round_], tier="dram", ms=now_ms()))
        if round_:
            out.append(removed(w, [1000 * (i + 1) + 1], ms=now_ms()))
    return out


def reference(evs: list[KvEvent]) -> dict[int, dict[str, str]]:
    d = Directory()
    for ev in evs:
        d.apply_kv_event(ev)
    return {h: d.holders(h) for h in d.blocks}


def worker_in_partition(partition: int, partitions: int) -> str:
    """A worker id whose kv-events land on ``partition``."""
    return next(f"h{i}" for i in range(1000) if partition_for(KV_EVENTS, f"h{i}", partitions) == partition)


async def wait_for(pred: Any, timeout_s: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await pred():
        if loop.time() > deadline:
            raise AssertionError(f"not reached in {timeout_s} s: {what}")
        await asyncio.sleep(0.1)


async def test_sigkilled_replica_loses_no_event_and_no_live_worker(kafka_settings, redis_server) -> None:
    kafka = kafka_settings.model_copy(update={"session_timeout_ms": SESSION_TIMEOUT_MS})
    redis = RedisSettings(url=redis_server.url)
    assert {partition_for(KV_EVENTS, w) for w in WORKERS} == set(range(KV_EVENTS.partitions))
    common: dict[str, Any] = {
        "sharded": True,
        "liveness_timeout_ms": LIVENESS_MS,
        "lease_ms": 2000,
        "poll_timeout_ms": 20,
        "redis_retry_ms": 100,
    }
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "KVMESH_KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "KVMESH_KAFKA_TOPIC_PREFIX": kafka.topic_prefix,
        "KVMESH_KAFKA_SESSION_TIMEOUT_MS": str(SESSION_TIMEOUT_MS),
        "KVMESH_REDIS_URL": redis.url,
        "KVMESH_KVMANAGER_MANAGER_ID": "kvm-a",
        "KVMESH_KVMANAGER_METRICS_PORT": str(free_port()),
        **{f"KVMESH_KVMANAGER_{k.upper()}": str(v).lower() for k, v in common.items()},
    }
    control = TypedConsumer(kafka, [CONTROL], None, from_beginning=True)
    client = redis.connect()
    proc = subprocess.Popen([sys.executable, "-m", "services.kvmanager"], cwd=REPO, env=env)
    stop_beats = asyncio.Event()
    try:
        async with TypedProducer(kafka, "fake-workers") as prod, control:

            async def beat() -> None:  # every worker stays alive throughout
                while not stop_beats.is_set():
                    for w in WORKERS:
                        await prod.send(LOAD, load(w, now_ms()))
                    await asyncio.sleep(0.3)

            beats = asyncio.create_task(beat())
            first = events(0)
            for ev in first:
                await prod.send(KV_EVENTS, ev)

            async def slices_hold(expected: dict[int, dict[str, str]]) -> bool:
                return (await read_snapshot(client)).blocks == expected

            # replica A alone takes every partition and writes every shard slice
            await wait_for(lambda: slices_hold(reference(first)), 40, "replica A indexed the first round")
            assert len(await shard_prefixes(client)) == KV_EVENTS.partitions
            cfg = KvManagerSettings(kafka=kafka, redis=redis, manager_id="kvm-b", **common)
            async with KvManagerReplica(cfg) as b:

                async def split() -> bool:
                    return 0 < len(b.shards.partitions()) < KV_EVENTS.partitions

                await wait_for(split, 40, "the group split the partitions between A and B")
                b_had = set(b.shards.partitions())
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)
                second = events(1)
                for ev in second:  # published while A's partitions still belong to the dead A
                    await prod.send(KV_EVENTS, ev)

                async def took_all() -> bool:
                    return len(b.shards.partitions()) == KV_EVENTS.partitions

                await wait_for(took_all, SESSION_TIMEOUT_MS / 1000 + 30, "B took A's partitions")
                await wait_for(lambda: slices_hold(reference(first + second)), 30, "every event indexed")

                async def leads() -> bool:
                    return b.is_leader and set((await read_snapshot(client)).workers) == set(WORKERS)

                await wait_for(leads, 30, "B leads and writes the fleet slice")
                assert b.metrics.value("leader") == 1.0
                assert b.metrics.value("owned_shards") == KV_EVENTS.partitions
                # liveness outlasts the takeover: give it time to (wrongly) declare someone lost
                await asyncio.sleep(LIVENESS_MS / 1000 + 0.5)
                snap = await read_snapshot(client)
                assert snap.blocks == reference(first + second)
                assert set(snap.workers) == set(WORKERS)
            stop_beats.set()
            await beats
            published = await control.getmany(timeout_ms=1000)
            lost = [r.message.worker_id for r in published if isinstance(r.message, WorkerLost)]
            assert lost == []
            assert b_had != set(range(KV_EVENTS.partitions))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await client.aclose()


async def test_the_leader_replicates_a_hot_prefix_held_in_another_replicas_shard(
    kafka_settings, redis_server
) -> None:
    """Placement across shards: the run is held by a worker whose shard the *other* replica owns; the
    leader still plans exactly one copy, and the retain hint is sent once (by the shard's owner)."""
    redis = RedisSettings(url=redis_server.url)
    base: dict[str, Any] = {
        "sharded": True,
        "liveness_timeout_ms": 600_000,
        "liveness_clock": "event",
        "hot_min_sessions": 4,
        "max_replicas": 2,
        "placement_view_ms": 50,
    }
    replicas = [
        KvManagerReplica(KvManagerSettings(kafka=kafka_settings, redis=redis, manager_id=f"r{i}", **base))
        for i in range(2)
    ]
    control = TypedConsumer(kafka_settings, [CONTROL], None, from_beginning=True)
    try:
        for r in replicas:
            await r.start()

        async def settled() -> bool:
            owned = [r.shards.partitions() for r in replicas]
            return all(owned) and sum(r.is_leader for r in replicas) == 1

        await wait_for(settled, 40, "two replicas, one leader, shards split")
        leader = next(r for r in replicas if r.is_leader)
        other = next(r for r in replicas if not r.is_leader)
        holder = worker_in_partition(other.shards.partitions()[0], KV_EVENTS.partitions)
        setup = [load(holder, 1000, queued=1000), load("w2", 1000, queued=50), load("w3", 1000, queued=10)]
        async with TypedProducer(kafka_settings, "test-producer") as prod, control:
            for m in setup:
                await prod.send(LOAD, m)
            await prod.send(KV_EVENTS, stored(holder, [1, 2, 3], ms=1001))

            async def indexed() -> bool:
                return other.shards.holders(3) == {holder: "gpu"} and len(leader.directory.workers) == 3

            await wait_for(indexed, 30, "the run indexed in the other replica's shard")
            for i in range(4):
                await prod.send(REQUESTS, request(f"s{i}", f"r{i}", [1, 2, 3], ms=1100 + i))
            await prod.send(REQUESTS, request("s0", "r0-turn2", [1, 2, 3], ms=1200))
            got: list[Any] = []

            async def published() -> bool:
                got.extend(await control.getmany(timeout_ms=100))
                kinds = {type(r.message).__name__ for r in got}
                return {"ReplicateCommand", "RetainHint"} <= kinds

            await wait_for(published, 30, "replication and retain hint published")
            await asyncio.sleep(1.0)  # a second (duplicate) command would arrive by now
            got.extend(await control.getmany(timeout_ms=500))
    finally:
        for r in replicas:
            await r.stop()
    reps = [r for r in got if type(r.message).__name__ == "ReplicateCommand"]
    hints = [r for r in got if type(r.message).__name__ == "RetainHint"]
    assert [(r.key, r.message.source_worker, r.message.block_hashes) for r in reps] == [
        ("w3", holder, [1, 2, 3])
    ]
    assert [(h.key, h.message.session_id) for h in hints] == [(holder, "s0")]


async def test_a_replica_rides_out_a_redis_outage_and_rewrites_its_slices(
    kafka_settings, redis_server
) -> None:
    """Redis goes away and comes back empty: the replica keeps applying in memory, then writes every
    slice it owns again (fenced writers see the version went back) and takes the lease again."""
    redis = RedisSettings(url=redis_server.url)
    cfg = KvManagerSettings(
        kafka=kafka_settings,
        redis=redis,
        manager_id="solo",
        sharded=True,
        liveness_timeout_ms=600_000,
        liveness_clock="event",
        redis_retry_ms=100,
        lease_ms=1000,
    )
    first, second = events(0), events(1)
    async with TypedProducer(kafka_settings, "test-producer") as prod, KvManagerReplica(cfg) as rep:
        for w in WORKERS:
            await prod.send(LOAD, load(w, 1000))
        for ev in first:
            await prod.send(KV_EVENTS, ev)

        async def holds(expected: dict[int, dict[str, str]]) -> bool:
            client = redis.connect()
            try:
                snap = await read_snapshot(client)
            except OSError:
                return False
            finally:
                await client.aclose()
            return snap.blocks == expected and set(snap.workers) == set(WORKERS)

        await wait_for(lambda: holds(reference(first)), 40, "first round written")
        redis_server.stop()
        for ev in second:
            await prod.send(KV_EVENTS, ev)

        async def in_memory() -> bool:
            return {h: rep.shards.holders(h) for h in reference(first + second)} == reference(first + second)

        await wait_for(in_memory, 30, "second round applied in memory while Redis is down")
        assert not rep.redis_ok
        redis_server.start()  # same port, empty
        await wait_for(lambda: holds(reference(first + second)), 40, "every slice written again")

        async def leads() -> bool:
            return rep.is_leader

        await wait_for(leads, 10, "leader again")


async def test_a_scheduler_cold_starts_from_the_replicas_slices(kafka_settings, redis_server) -> None:
    """Two replicas write the directory in slices; a scheduler starting from the merged snapshot (and
    the kv-events offsets of each slice) reaches the same index as one that read every record."""
    from services.scheduler.config import SchedulerSettings
    from services.scheduler.service import SchedulerService

    redis = RedisSettings(url=redis_server.url)
    rounds = events(0) + events(1)
    base: dict[str, Any] = {"sharded": True, "liveness_timeout_ms": 600_000, "liveness_clock": "event"}
    replicas = [
        KvManagerReplica(KvManagerSettings(kafka=kafka_settings, redis=redis, manager_id=f"r{i}", **base))
        for i in range(2)
    ]
    client = redis.connect()
    try:
        async with TypedProducer(kafka_settings, "fake-workers") as prod:
            for w in WORKERS:
                await prod.send(LOAD, load(w, now_ms()))
            for ev in rounds:
                await prod.send(KV_EVENTS, ev)
            for r in replicas:
                await r.start()

            async def written() -> bool:
                # both own shards (not sampled mid-rebalance, when neither does) and every slice is in
                snap = await read_snapshot(client)
                return (
                    all(r.shards.partitions() for r in replicas)
                    and snap.blocks == reference(rounds)
                    and sum(snap.offsets.get(KV_EVENTS.name, {}).values()) == len(rounds)
                )

            await wait_for(written, 60, "both replicas own shards and wrote their slices")
            late = [stored(w, [50_000 + i], ms=now_ms()) for i, w in enumerate(WORKERS)]
            for ev in late:  # after the snapshot: the scheduler must read these from Kafka
                await prod.send(KV_EVENTS, ev)
        sched = {"create_topics": False, "catch_up_timeout_s": 20, "redis": redis}
        cold = SchedulerService(SchedulerSettings(kafka=kafka_settings, use_snapshot=True, **sched))
        warm = SchedulerService(
            SchedulerSettings(kafka=kafka_settings, use_snapshot=False, scheduler_id="scheduler-1", **sched)
        )
        async with cold, warm:
            assert cold.snapshot_loaded
            assert cold.metrics.value("state_records_total") < warm.metrics.value("state_records_total")
            want = reference(rounds + late)
            assert cold.view.index.to_dict() == warm.view.index.to_dict()
            assert {h for h, _, _ in cold.view.index.items()} == set(want)
    finally:
        for r in replicas:
            await r.stop()
        await client.aclose()
