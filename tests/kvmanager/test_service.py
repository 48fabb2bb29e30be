"""The KV manager service against a real broker and a real redis-server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from schemas.messages import KvEvent, LoadReport, WorkerLost
from services.fleet_directory.layout import STATS_KEY
from services.fleet_directory.snapshot import DirectorySnapshot, read_snapshot
from services.kvmanager.config import KvManagerSettings
from services.kvmanager.directory import Directory
from services.kvmanager.service import KvManagerService
from streams.consumer import TypedConsumer
from streams.producer import TypedProducer
from streams.topics import CONTROL, KV_EVENTS, LOAD, REQUESTS

from .helpers import cleared, load, moved, removed, request, stored

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def settings(kafka_settings, redis_settings, **kw: Any) -> KvManagerSettings:
    # Event-time liveness: the messages of these tests carry small made-up times.
    base: dict[str, Any] = {
        "liveness_timeout_ms": 600_000,
        "liveness_clock": "event",
        "poll_timeout_ms": 20,
        "redis_retry_ms": 100,
    }
    base.update(kw)
    return KvManagerSettings(kafka=kafka_settings, redis=redis_settings, **base)


def batch_a() -> list[Any]:
    return [
        load("w1", 1000),
        load("w2", 1000),
        stored("w1", [1, 2, 3], ms=1001),
        stored("w2", [1, 2], tier="dram", ms=1002),
        request("s1", "r1", [1, 2, 3, 4], ms=1003),
    ]


def batch_b() -> list[Any]:
    return [
        moved("w1", [3], to="dram", frm="gpu", ms=1010),
        removed("w2", [2], ms=1011),
        stored("w3", [5, 6], ms=1012),
        cleared("w3", ms=1013),
        stored("w3", [9], ms=1014),
        load("w3", 1015),
        request("s2", "r2", [1, 9], ms=1016),
    ]


def reference(messages: list[Any]) -> Directory:
    d = Directory()
    for m in messages:
        if isinstance(m, KvEvent):
            d.apply_kv_event(m)
        elif isinstance(m, LoadReport):
            d.apply_load(m)
        else:
            d.observe_lookup(m)
    return d


def as_snapshot_blocks(d: Directory) -> dict[int, dict[str, str]]:
    return {h: d.holders(h) for h in d.blocks}


async def publish(producer: TypedProducer, messages: list[Any]) -> None:
    for m in messages:
        topic = KV_EVENTS if isinstance(m, KvEvent) else LOAD if isinstance(m, LoadReport) else REQUESTS
        await producer.send(topic, m)


async def wait_for(pred: Callable[[], Any], timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        if await pred():
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def snapshot(url: str) -> DirectorySnapshot:
    client = aioredis.from_url(url)
    try:
        return await read_snapshot(client)
    finally:
        await client.aclose()


async def test_directory_snapshot_offsets_and_restart(kafka_settings, redis_settings) -> None:
    expected = reference(batch_a() + batch_b())
    async with TypedProducer(kafka_settings, "test-producer") as producer:
        await publish(producer, batch_a() + batch_b())
    async with KvManagerService(settings(kafka_settings, redis_settings)):

        async def caught_up() -> bool:
            snap = await snapshot(redis_settings.url)
            return (
                snap.offsets.get(REQUESTS.name) is not None and sum(snap.offsets[REQUESTS.name].values()) == 2
            )

        await wait_for(caught_up)
    snap = await snapshot(redis_settings.url)
    assert (
        snap.blocks
        == as_snapshot_blocks(expected)
        == {
            1: {"w1": "gpu", "w2": "dram"},
            2: {"w1": "gpu"},
            3: {"w1": "dram"},
            9: {"w3": "gpu"},
        }
    )
    assert snap.parents == {1: 0, 2: 1, 3: 2, 9: 0}
    assert sum(snap.offsets[KV_EVENTS.name].values()) == 7
    assert sum(snap.offsets[LOAD.name].values()) == 3
    assert set(snap.workers) == {"w1", "w2", "w3"}
    client = aioredis.from_url(redis_settings.url)
    stats = {k.decode(): int(v) for k, v in (await client.hgetall(STATS_KEY)).items()}
    await client.aclose()
    # r1: blocks 1-3 held, block 4 missing; r2: block 1 held, 9 not yet (its stored event comes first
    # on another topic, so only the count of lookups is order-independent here).
    assert stats["lookups"] == 2 and stats["hit_blocks"] + stats["miss_blocks"] == 6
    # A restarted manager resumes from Redis: replaying nothing new, it leaves the directory as it was.
    svc = KvManagerService(settings(kafka_settings, redis_settings))
    async with svc:
        assert as_snapshot_blocks(svc.directory) == snap.blocks
        await asyncio.sleep(0.3)
    assert (await snapshot(redis_settings.url)).blocks == snap.blocks
    assert svc.directory.stats["lookups"] == 2  # no request counted twice


async def test_redis_outage_is_caught_up(kafka_settings, redis_settings, redis_server) -> None:
    expected = reference(batch_a() + batch_b())
    svc = KvManagerService(settings(kafka_settings, redis_settings))
    async with TypedProducer(kafka_settings, "test-producer") as producer, svc:
        await publish(producer, batch_a())

        async def a_flushed() -> bool:
            return (await snapshot(redis_settings.url)).blocks == as_snapshot_blocks(reference(batch_a()))

        await wait_for(a_flushed)
        redis_server.stop()
        await publish(producer, batch_b())

        async def b_in_memory() -> bool:
            return as_snapshot_blocks(svc.directory) == as_snapshot_blocks(expected) and not svc.redis_ok

        await wait_for(b_in_memory)
        assert svc.directory.has_dirty()
        redis_server.start()  # same port, empty: the manager must write everything again

        async def caught_up() -> bool:
            try:
                snap = await snapshot(redis_settings.url)
            except OSError:
                return False
            return snap.blocks == as_snapshot_blocks(expected) and set(snap.workers) == {"w1", "w2", "w3"}

        await wait_for(caught_up)
    snap = await snapshot(redis_settings.url)
    assert snap.parents == expected.parents
    assert sum(snap.offsets[KV_EVENTS.name].values()) == 7
    assert svc.redis_ok


async def test_killed_worker_process_is_declared_lost(kafka_settings, redis_settings) -> None:
    cfg = settings(kafka_settings, redis_settings, liveness_timeout_ms=1500, liveness_clock="wall")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("heartbeat_worker.py")),
            kafka_settings.bootstrap_servers,
            "wk",
            kafka_settings.topic_prefix,
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
    )
    control = TypedConsumer(kafka_settings, [CONTROL], None, from_beginning=True)
    try:
        async with KvManagerService(cfg), control:

            async def listed() -> bool:
                snap = await snapshot(redis_settings.url)
                return "wk" in snap.workers and snap.blocks.get(778) == {"wk": "gpu"}

            await wait_for(listed)
            # It stays listed while it beats.
            await asyncio.sleep(0.5)
            assert "wk" in (await snapshot(redis_settings.url)).workers
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            lost: list[WorkerLost] = []

            async def lost_published() -> bool:
                for rec in await control.getmany(timeout_ms=100):
                    if isinstance(rec.message, WorkerLost):
                        lost.append(rec.message)
                return bool(lost)

            await wait_for(lost_published)
            assert lost[0].worker_id == "wk"
            assert lost[0].declared_ms - lost[0].last_seen_ms >= 1500
            snap = await snapshot(redis_settings.url)
            assert "wk" not in snap.workers
            assert 777 not in snap.blocks and 778 not in snap.blocks
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_hot_prefix_and_returning_session_publish_control_messages(
    kafka_settings, redis_settings
) -> None:
    cfg = settings(kafka_settings, redis_settings, hot_min_sessions=4, max_replicas=2)
    setup = [
        load("w1", 1000, queued=1000),
        load("w2", 1000, queued=50),
        load("w3", 1000, queued=10),
        stored("w1", [1, 2, 3], ms=1001),
    ]
    requests = [request(f"s{i}", f"r{i}", [1, 2, 3], ms=1100 + i) for i in range(4)]
    requests.append(request("s0", "r0-turn2", [1, 2, 3], ms=1200))
    control = TypedConsumer(kafka_settings, [CONTROL], None, from_beginning=True)
    async with TypedProducer(kafka_settings, "test-producer") as producer:
        await publish(producer, setup)
        async with KvManagerService(cfg) as svc, control:

            async def setup_seen() -> bool:
                return svc.directory.holders(3) == {"w1": "gpu"} and len(svc.directory.workers) == 3

            await wait_for(setup_seen)
            await publish(producer, requests)
            got: list[Any] = []

            async def both_published() -> bool:
                got.extend(await control.getmany(timeout_ms=100))
                kinds = {type(r.message).__name__ for r in got}
                return {"ReplicateCommand", "RetainHint"} <= kinds

            await wait_for(both_published)
    reps = [r for r in got if type(r.message).__name__ == "ReplicateCommand"]
    hints = [r for r in got if type(r.message).__name__ == "RetainHint"]
    # Two copies wanted (4 sessions), one exists: the least loaded worker w3 pulls the run from w1.
    assert len(reps) == 1 and reps[0].key == "w3"
    assert (reps[0].message.source_worker, reps[0].message.block_hashes) == ("w1", [1, 2, 3])
    assert [(h.key, h.message.session_id, h.message.block_hashes) for h in hints] == [("w1", "s0", [1, 2, 3])]
