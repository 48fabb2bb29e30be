"""Two real WorkerServices on a real broker closing the fleet loop without a KV manager: fleet-aware
eviction fed from kv-events, and a ReplicateCommand pulling blocks over the data plane."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fleet_helpers import BS, NS, assignment, block_tokens, chat_request, wait_for

from schemas.blocks import block_hashes
from schemas.messages import Assignment, Completion, KvEvent, ReplicateCommand
from services.worker.config import WorkerSettings
from services.worker.service import WorkerService
from streams import topics
from streams.consumer import TypedConsumer
from streams.producer import TypedProducer
from streams.settings import KafkaSettings
from streams.tasks import stop_task

pytestmark = pytest.mark.integration


class Fleet:
    """Workers, a producer standing in for scheduler and KV manager, a reply and a kv-events reader."""

    def __init__(self, kafka: KafkaSettings) -> None:
        self.kafka = kafka
        self.workers: dict[str, WorkerService] = {}
        self.producer = TypedProducer(kafka, "test-scheduler")
        self.reader = TypedConsumer(kafka, [topics.REPLIES, topics.KV_EVENTS], group_id=None)
        self.completions: dict[str, Completion] = {}
        self.kv_events: list[KvEvent] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self, ids: list[str], **worker_kw: Any) -> None:
        for wid in ids:
            kw: dict[str, Any] = {
                "insecure_dev_transfer": True,
                "calibrate": False,
                "gpu_blocks": 256,
                "dram_blocks": 256,
                "load_interval_ms": 200,
            }
            kw.update(worker_kw)
            w = WorkerService(WorkerSettings(worker_id=wid, kafka=self.kafka, **kw))
            await w.start()
            self.workers[wid] = w
        await self.producer.start()
        await self.reader.start()

        async def on_record(rec: Any) -> None:
            msg = rec.message
            if isinstance(msg, Completion):
                self.completions[msg.request_id] = msg
            elif isinstance(msg, KvEvent):
                self.kv_events.append(msg)

        self._task = asyncio.create_task(self.reader.run(on_record))

    async def run(self, a: Assignment, timeout: float = 60.0) -> Completion:
        await self.producer.send(topics.ASSIGNMENTS, a)
        await wait_for(lambda: a.request.request_id in self.completions, timeout)
        return self.completions[a.request.request_id]

    def announced(self, worker: str, kind: str) -> set[int]:
        return {h for e in self.kv_events if e.worker_id == worker and e.kind == kind for h in e.block_hashes}

    async def stop(self) -> None:
        await stop_task(self._task)
        await self.reader.stop()
        await self.producer.stop()
        for w in self.workers.values():
            await w.stop()


@pytest.fixture
async def fleet(kafka_settings: KafkaSettings) -> AsyncIterator[Fleet]:
    f = Fleet(kafka_settings)
    try:
        yield f
    finally:
        await f.stop()


async def test_under_pressure_a_block_held_elsewhere_is_dropped_and_last_copies_go_to_disk(
    fleet: Fleet, tmp_path: Path
) -> None:
    await fleet.start(
        ["worker-a", "worker-b"], gpu_blocks=16, dram_blocks=8, disk_blocks=64, disk_dir=str(tmp_path)
    )
    a, b = fleet.workers["worker-a"], fleet.workers["worker-b"]
    shared = block_tokens("A system prompt both workers serve. ", 5)
    only_a = block_tokens("Something only worker A has computed. ", 5)
    hs, ha = block_hashes(shared, BS, NS), block_hashes(only_a, BS, NS)
    await fleet.run(assignment(chat_request("shared-a", shared), "worker-a"))
    await fleet.run(assignment(chat_request("only-a", only_a), "worker-a"))
    await fleet.run(assignment(chat_request("shared-b", shared), "worker-b"))
    # A learns B's copies from B's kv-events; B's view counts A's copies the same way.
    await wait_for(lambda: all(a.fleet.copies(h) == 1 for h in hs))
    assert all(a.fleet.copies(h) == 0 for h in ha) and all(b.fleet.copies(h) == 1 for h in ha + hs)

    # 25 more blocks: A's GPU (16) and DRAM (8) cannot keep them next to the 10 it has.
    pressure = [block_tokens(f"{i}: a pressure prompt. ", 5) for i in range(5)]
    for i, p in enumerate(pressure):
        await fleet.run(assignment(chat_request(f"p{i}", p), "worker-a"))
    kv = a.engine.kv
    assert [kv.tier_of(h) for h in hs] == [None] * 5  # held by B: dropped first
    last_copies = ha + [h for p in pressure for h in block_hashes(p, BS, NS)]
    tiers = [kv.tier_of(h) for h in last_copies]
    assert None not in tiers  # no last copy was dropped ...
    held = kv.held_hashes()
    # ... the ones that had to leave DRAM went to disk: everything stored is still here but B's.
    assert len(set(last_copies)) == 30 == sum(len(v) for v in held.values())
    assert tiers.count("disk") == len(held["disk"]) >= 5
    assert kv.tier_of(ha[-1]) == "disk"  # LRU among last copies (a request's tail is older)
    await wait_for(lambda: set(hs) <= fleet.announced("worker-a", "removed"))
    assert not set(last_copies) & fleet.announced("worker-a", "removed")
    assert b.engine.lookup_prefix(hs) == 5  # the fleet still has the shared prefix


async def test_replicate_command_pulls_blocks_that_a_request_then_reuses(fleet: Fleet) -> None:
    await fleet.start(["worker-a", "worker-b"])
    a, b = fleet.workers["worker-a"], fleet.workers["worker-b"]
    prompt = block_tokens("A long shared system prompt for the replication test. ", 6)
    h = block_hashes(prompt, BS, NS)
    ref = await fleet.run(assignment(chat_request("src", prompt, max_tokens=8), "worker-a"))
    assert a.engine.lookup_prefix(h) == 6 and b.engine.lookup_prefix(h) == 0

    cmd = ReplicateCommand(
        command_id="rep-test-1",
        target_worker="worker-b",
        source_worker="worker-a",
        source_address=a.transfer_address,
        block_hashes=h,
        namespace=NS,
    )
    await fleet.producer.send(topics.CONTROL, cmd)
    await wait_for(lambda: set(h) <= fleet.announced("worker-b", "stored"))
    assert b.engine.lookup_prefix(h) == 6 and b.metrics.value("replications_total") == 1
    assert {b.engine.kv.tier_of(x) for x in h} == {"dram"}

    c = await fleet.run(assignment(chat_request("on-b", prompt, max_tokens=8), "worker-b", reuse=6))
    assert c.worker_id == "worker-b" and c.fallback is None
    assert c.reused_tokens >= 5 * BS and c.fetched_tokens == 0 and c.recomputed_tokens <= BS
    assert c.output_token_ids == ref.output_token_ids  # the pulled KV is the KV A computed
