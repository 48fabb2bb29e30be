"""Scheduler replicas share their load accounting: each reads every replica's assignments, so what
one replica sent a worker is pending load in the other's queue estimate (SGLang's smg #2150: each
router saw 1/N of the load). On a real broker, two replicas in one consumer group."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from schemas.messages import Assignment
from services.scheduler.config import SchedulerSettings
from services.scheduler.service import SchedulerService
from streams.clock import now_ms
from streams.consumer import TypedConsumer
from streams.producer import TypedProducer
from streams.settings import KafkaSettings
from streams.topics import ASSIGNMENTS, KV_EVENTS, LOAD, REQUESTS

from .factories import load, prompt, request, stored

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WORKERS = ("w-0", "w-1", "w-2", "w-3")


def _settings(kafka: KafkaSettings, sid: str, share: bool) -> SchedulerSettings:
    # pending work stays pending for the whole test (the fake workers never report again)
    return SchedulerSettings(
        kafka=kafka,
        scheduler_id=sid,
        share_load=share,
        use_snapshot=False,
        create_topics=False,
        catch_up_timeout_s=10,
        pending_decay_ms=600_000,
        worker_timeout_ms=600_000,
        max_queue_ms=600_000,
    )


async def _replicas(kafka: KafkaSettings, n: int, share: bool) -> list[SchedulerService]:
    out = [SchedulerService(_settings(kafka, f"scheduler-{k}", share)) for k in range(n)]
    for s in out:
        await s.start()
    # until the group has given every replica some request partitions
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not all(s._requests is not None and s._requests._require().assignment() for s in out):
        assert loop.time() < deadline, "the consumer group never split the partitions"
        await asyncio.sleep(0.1)
    return out


async def _fleet(prod: TypedProducer, t0: int, held: list[int]) -> None:
    # a slow link: the other workers would recompute the prefix, so w-0 is worth a queue
    for w in WORKERS:
        await prod.send(LOAD, load(w, t0, link_gbps=0.001))
    await prod.send(KV_EVENTS, stored("w-0", held, event_ms=t0))


async def test_a_replica_counts_the_other_replicas_assignments_as_pending(
    kafka_settings: KafkaSettings,
) -> None:
    t0 = now_ms()
    shared = prompt(512)
    async with TypedProducer(kafka_settings, "fake-workers") as prod:
        first = request("r-0", shared + prompt(64, seed=1), arrival_ms=t0 + 10, session="s-a")
        await _fleet(prod, t0, list(first.block_hashes)[:32])
        for share in (True, False):
            reps = await _replicas(kafka_settings, 2, share)
            try:
                rid = f"r-{share}"
                await prod.send(REQUESTS, request(rid, shared + prompt(64, seed=2), arrival_ms=t0 + 20))
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 20
                decider: SchedulerService | None = None
                while decider is None:
                    assert loop.time() < deadline, "the request was never decided"
                    decider = next((s for s in reps if rid in s.view._inflight), None)
                    await asyncio.sleep(0.05)
                other = next(s for s in reps if s is not decider)
                worker = decider.view._inflight[rid].worker_id

                def pending_on_other(o: SchedulerService = other, w: str = worker, r: str = rid) -> bool:
                    return any(p.request_id == r for p in o.view.workers[w].pending)

                deadline = loop.time() + 10
                while not pending_on_other() and loop.time() < deadline:
                    await asyncio.sleep(0.05)
                # shared: the other replica prices the worker's queue with it; not shared: 1/N
                assert pending_on_other() is share
            finally:
                for s in reps:
                    await s.stop()


async def _burst(kafka: KafkaSettings, replicas: int, share: bool, tag: str) -> Counter[str]:
    """16 requests sharing a 32-block prefix that only w-0 holds, paced so the replicas see each
    other's decisions; where they went."""
    t0 = now_ms()
    shared = prompt(512, seed=hash(tag) % 1000)
    reqs = [
        request(
            f"{tag}-{i}", shared + prompt(512, seed=100 + i), arrival_ms=t0 + 10 + i, session=f"{tag}-s{i}"
        )
        for i in range(16)
    ]
    out = TypedConsumer(kafka, [ASSIGNMENTS], None, from_beginning=False)
    await out.start()
    got: list[Any] = []
    async with TypedProducer(kafka, f"fake-{tag}") as prod:
        await _fleet(prod, t0, list(reqs[0].block_hashes)[:128])
        reps = await _replicas(kafka, replicas, share)
        try:
            for r in reqs:
                await prod.send(REQUESTS, r)
                await asyncio.sleep(0.25)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while len([m for m in got if isinstance(m, Assignment)]) < len(reqs):
                assert loop.time() < deadline, got
                got.extend(rec.message for rec in await out.getmany(timeout_ms=200))
        finally:
            for s in reps:
                await s.stop()
            await out.stop()
    mine = {r.request_id for r in reqs}
    return Counter(m.worker_id for m in got if isinstance(m, Assignment) and m.request.request_id in mine)


async def test_two_sharing_replicas_spread_a_burst_as_well_as_one(kafka_settings: KafkaSettings) -> None:
    one = await _burst(kafka_settings, 1, True, "one")
    two = await _burst(kafka_settings, 2, True, "two")
    assert sum(one.values()) == sum(two.values()) == 16
    # the most loaded worker takes no more than with one replica (one decision of slack for the
    # moments when both replicas decide before either has read the other's assignment)
    assert max(two.values()) <= max(one.values()) + 1, (one, two)
