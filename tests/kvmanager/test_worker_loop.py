"""The KV manager and real WorkerServices closing the loop over the real broker and Redis: retain hints
keep a returning session's blocks, a hot prefix gets a replica, a worker declared lost while alive
re-announces what it holds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from fleet_helpers import BS, NS, block_tokens, chat_request, wait_for

from schemas.blocks import block_hashes
from schemas.messages import Assignment, ChatRequest, Completion, Estimate
from services.fleet_directory.snapshot import read_snapshot
from services.kvmanager.config import KvManagerSettings
from services.kvmanager.service import KvManagerService
from services.worker.config import WorkerSettings
from services.worker.service import WorkerService
from streams import topics
from streams.clock import now_ms
from streams.consumer import TypedConsumer
from streams.producer import TypedProducer
from streams.settings import KafkaSettings, RedisSettings
from streams.tasks import stop_task

pytestmark = pytest.mark.integration


class Stack:
    """The real KV manager, real workers, and a producer standing in for intake + scheduler: a
    request is published on ``kvmesh.requests`` (what the manager reads) and assigned to a worker."""

    def __init__(self, kafka: KafkaSettings, redis: RedisSettings) -> None:
        self.kafka = kafka
        self.redis = redis
        self.offset_ms = 0  # added to the manager's clock (to fake a long pause of a worker)
        self.manager = KvManagerService(
            KvManagerSettings(kafka=kafka, redis=redis, poll_timeout_ms=20),
            clock=lambda: now_ms() + self.offset_ms,
        )
        self.workers: dict[str, WorkerService] = {}
        self.producer = TypedProducer(kafka, "test-front")
        self.replies = TypedConsumer(kafka, [topics.REPLIES], group_id=None)
        self.completions: dict[str, Completion] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self, workers: dict[str, dict[str, Any]]) -> None:
        await self.manager.start()
        for wid, kw in workers.items():
            base: dict[str, Any] = {
                "insecure_dev_transfer": True,
                "calibrate": False,
                "load_interval_ms": 200,
            }
            w = WorkerService(WorkerSettings(worker_id=wid, kafka=self.kafka, **{**base, **kw}))
            await w.start()
            self.workers[wid] = w
        await self.producer.start()
        await self.replies.start()

        async def on_reply(rec: Any) -> None:
            if isinstance(rec.message, Completion):
                self.completions[rec.message.request_id] = rec.message

        self._task = asyncio.create_task(self.replies.run(on_reply))
        await wait_for(lambda: set(workers) <= set(self.manager.directory.workers))

    async def serve(self, req: ChatRequest, worker: str) -> Completion:
        await self.producer.send(topics.REQUESTS, req)
        a = Assignment(
            request=req,
            worker_id=worker,
            reuse_blocks=0,
            prefill_tokens=len(req.token_ids),
            estimate=Estimate(ttft_ms=1.0, queue_ms=0.0, recompute_ms=1.0, transfer_ms=0.0, policy="test"),
        )
        await self.producer.send(topics.ASSIGNMENTS, a)
        await wait_for(lambda: req.request_id in self.completions, 60)
        return self.completions[req.request_id]

    def listed(self, worker: str, hashes: list[int]) -> bool:
        """Whether the manager's directory has ``worker`` holding every block of ``hashes``."""
        return all(worker in self.manager.directory.holders(h) for h in hashes)

    async def stop(self) -> None:
        await stop_task(self._task)
        await self.replies.stop()
        await self.producer.stop()
        for w in self.workers.values():
            await w.stop()
        await self.manager.stop()


@pytest.fixture
async def stack(kafka_settings: KafkaSettings, redis_settings: RedisSettings) -> AsyncIterator[Stack]:
    s = Stack(kafka_settings, redis_settings)
    try:
        yield s
    finally:
        await s.stop()


async def test_retain_hint_keeps_a_returning_sessions_blocks_under_pressure(stack: Stack) -> None:
    await stack.start({"worker-a": {"gpu_blocks": 16, "dram_blocks": 8}})  # no disk: evicted = gone
    a = stack.workers["worker-a"]
    turn1 = block_tokens("0: the returning session's first turn. ", 5)
    hs = block_hashes(turn1, BS, NS)
    await stack.serve(chat_request("s-1", turn1, session="sess-s"), "worker-a")
    await wait_for(lambda: stack.listed("worker-a", hs))
    # Turn 2 of the session reaches the manager: A holds its prefix, so A is told to retain it.
    turn2 = turn1 + block_tokens("1: and the second turn. ", 2)
    await stack.producer.send(topics.REQUESTS, chat_request("s-2", turn2, session="sess-s"))
    await wait_for(lambda: all(a.engine.kv.is_retained(h) for h in hs))
    assert stack.manager.metrics.value("published_total", kind="retain_hint") == 1

    # A one-turn session after it, then 25 blocks of pressure: 11 of these 35 blocks must go.
    other = block_tokens("2: a session that never comes back. ", 5)
    await stack.serve(chat_request("t-1", other, session="sess-t"), "worker-a")
    for i in range(5):
        await stack.serve(
            chat_request(f"p-{i}", block_tokens(f"{i + 3}: pressure. ", 5), session=f"sess-p{i}"), "worker-a"
        )
    kv = a.engine.kv
    assert all(kv.tier_of(h) is not None for h in hs)  # oldest in LRU order, but retained
    assert [kv.tier_of(h) for h in block_hashes(other, BS, NS)] == [None] * 5  # dropped instead
    assert {kv.tier_of(h) for h in hs} <= {"gpu", "dram"}


async def test_hot_system_prompt_on_one_worker_is_replicated_to_another(stack: Stack) -> None:
    await stack.start({"worker-a": {}, "worker-b": {}})
    b = stack.workers["worker-b"]
    system = block_tokens("You are the shared assistant of a replication test. ", 5)
    shared = block_hashes(system, BS, NS)
    for i in range(4):  # hot_min_sessions (4) distinct sessions, all sent to A
        prompt = system + block_tokens(f"{i}: user {i} asks something. ", 2)
        await stack.serve(chat_request(f"r-{i}", prompt, session=f"sess-{i}"), "worker-a")
    await wait_for(lambda: stack.listed("worker-b", shared))
    assert b.engine.lookup_prefix(shared) == 5 and b.metrics.value("replications_total") >= 1
    assert stack.listed("worker-a", shared)
    assert stack.manager.metrics.value("published_total", kind="replicate_command") >= 1
    # Only the hot prefix travelled: the sessions' own blocks stay on A alone.
    own = block_hashes(system + block_tokens("0: user 0 asks something. ", 2), BS, NS)[5:]
    assert b.engine.lookup_prefix(own) == 0


async def test_worker_declared_lost_while_alive_reannounces_its_blocks(
    stack: Stack, redis_settings: RedisSettings
) -> None:
    await stack.start({"worker-a": {}, "worker-b": {}})
    a, b = stack.workers["worker-a"], stack.workers["worker-b"]
    hs = block_hashes(block_tokens("Blocks that survive a pause of their worker. ", 6), BS, NS)
    await stack.serve(
        chat_request(
            "r-1", block_tokens("Blocks that survive a pause of their worker. ", 6), session="sess-1"
        ),
        "worker-a",
    )
    await wait_for(lambda: stack.listed("worker-a", hs) and all(b.fleet.copies(h) == 1 for h in hs))

    # A pauses (its LoadReports stop) past a short liveness timeout: the manager declares it lost.
    # A real pause, not a faked clock, so the WorkerLost is stamped before A's re-announce, as live.
    stack.manager.settings.liveness_timeout_ms = 1500
    publish_load = a._publish_load

    async def paused(*args: Any, **kwargs: Any) -> None:
        return None

    a._publish_load = paused  # type: ignore[method-assign]
    try:
        await wait_for(lambda: stack.manager.metrics.value("published_total", kind="worker_lost") >= 1)
    finally:
        a._publish_load = publish_load  # type: ignore[method-assign]
    # A hears about itself and re-announces; the directory and B's fleet view list its blocks again.
    await wait_for(lambda: a.metrics.value("reannounced_blocks_total") >= len(hs))
    await wait_for(lambda: stack.listed("worker-a", hs) and all(b.fleet.copies(h) == 1 for h in hs))
    client = aioredis.from_url(redis_settings.url, **redis_settings.client_kwargs())
    try:

        async def in_redis() -> bool:
            snap = await read_snapshot(client)
            return all("worker-a" in snap.blocks.get(h, {}) for h in hs)

        async with asyncio.timeout(15):
            while not await in_redis():
                await asyncio.sleep(0.1)
    finally:
        await client.aclose()
