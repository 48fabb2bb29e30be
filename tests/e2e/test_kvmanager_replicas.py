"""A real dev stack with two KV-manager replicas (``kvmesh dev --kvmanagers 2``): real workers' KV
events land in the replicas' directory slices; one replica is SIGKILLed and the other takes its
partitions, so the blocks of the chats after the kill reach the directory too, and no live worker is
declared lost."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvmesh.devstack import DevStack, DevStackSettings
from schemas.messages import WorkerLost
from services.fleet_directory.snapshot import read_snapshot
from streams.consumer import TypedConsumer
from streams.producer import partition_for
from streams.settings import KafkaSettings, RedisSettings
from streams.topics import CONTROL, KV_EVENTS

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    settings = DevStackSettings(
        workers=2,
        kvmanagers=2,
        intake_port=0,
        gpu_blocks=256,
        dram_blocks=256,
        # a short group session timeout, so the survivor takes over within the test's patience
        extra_env={"KVMESH_KAFKA_SESSION_TIMEOUT_MS": "3000"},
    )
    with DevStack(settings, sink=lambda _line: None) as s:
        yield s


def _chat(url: str, text: str, user: str) -> dict[str, Any]:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": "kvmesh-tiny",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 4,
            "temperature": 0,
            "user": user,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


async def _state(
    redis_url: str, kafka: KafkaSettings
) -> tuple[dict[int, int], dict[int, int], set[str], int]:
    """(kv-events offsets in the directory, the topic's end offsets, workers listed, blocks)."""
    client = RedisSettings(url=redis_url).connect()
    consumer = TypedConsumer(kafka, [KV_EVENTS], None)
    try:
        snap = await read_snapshot(client)
        await consumer.start()
        ends = {p: o for (_, p), o in (await consumer.end_offsets()).items()}
        return dict(snap.offsets.get(KV_EVENTS.name, {})), ends, set(snap.workers), len(snap.blocks)
    finally:
        await consumer.stop()
        await client.aclose()


def _owned(lines: list[str]) -> set[int]:
    """The kv-events partitions a replica's log says it owns now."""
    owned: set[int] = set()
    for line in lines:
        if m := re.search(r"(owns|released) kv-events partition (\d+)", line):
            (owned.add if m.group(1) == "owns" else owned.discard)(int(m.group(2)))
    return owned


def _wait(pred: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout_s} s: {what}")
        time.sleep(0.2)


def test_two_replicas_index_the_fleet_and_survive_a_kill(stack: DevStack) -> None:
    assert stack.redis is not None and stack.broker is not None
    redis_url = stack.redis.url
    assert redis_url is not None
    kafka = stack.kafka

    def chats(first: int) -> None:
        for i in range(first, first + 4):
            _chat(stack.intake_url, f"conversation {i}: " + f"subject {i} and caches " * 20, f"u{i}")

    def all_read() -> bool:
        offsets, ends, workers, blocks = asyncio.run(_state(redis_url, kafka))
        used = {p for p, end in ends.items() if end > 0}
        return (
            bool(used)
            and blocks > 0
            and workers == set(stack.worker_ids)
            and all(offsets.get(p, 0) >= ends[p] for p in used)
        )

    chats(0)
    _wait(all_read, 60, "the replicas indexed every kv-event and the leader wrote the workers")
    owned = {name: _owned(stack.children[name].lines) for name in stack.kvmanager_names}
    assert not owned["kvmanager-0"] & owned["kvmanager-1"]
    part_of = {w: partition_for(KV_EVENTS, w) for w in stack.worker_ids}
    # kill a replica that owns a partition a worker writes to, and send the next chats to that worker
    # (the other one drains): its new events must be taken over by the survivor
    victim = next(n for n in stack.kvmanager_names if owned[n] & set(part_of.values()))
    survivor = next(n for n in stack.kvmanager_names if n != victim)
    target = next(w for w, p in part_of.items() if p in owned[victim])
    others = [w for w in stack.worker_ids if w != target and part_of[w] != part_of[target]]
    _, ends_before, _, _ = asyncio.run(_state(redis_url, kafka))
    stack.kill(victim)
    for w in others:
        stack.set_drain(w, True, reason="replicas test")
    chats(4)
    _, ends_after, _, _ = asyncio.run(_state(redis_url, kafka))
    assert ends_after[part_of[target]] > ends_before[part_of[target]]  # events the victim would have read
    # the survivor owns every partition after the session timeout, and leads after the lease runs out
    _wait(all_read, 60, "the survivor read every kv-event written after the kill")
    assert part_of[target] in _owned(stack.children[survivor].lines)
    assert all(stack.children[w].alive() for w in stack.worker_ids)
    assert asyncio.run(_lost(kafka)) == []


async def _lost(kafka: KafkaSettings) -> list[str]:
    """Workers declared lost on the control topic so far."""
    consumer = TypedConsumer(kafka, [CONTROL], None, from_beginning=True)
    try:
        await consumer.start()
        records = await consumer.getmany(timeout_ms=1000)
        return [r.message.worker_id for r in records if isinstance(r.message, WorkerLost)]
    finally:
        await consumer.stop()
