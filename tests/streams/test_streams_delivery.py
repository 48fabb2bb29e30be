"""Integration: consumer groups, redelivery, dedup and the dead-letter path on a real broker."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas.codec import encode
from schemas.messages import CancelRequest
from streams import topics
from streams.admin import topic_name
from streams.consumer import (
    DLQ_ERROR_KIND,
    DLQ_SOURCE_OFFSET,
    DLQ_SOURCE_TOPIC,
    Record,
    TypedConsumer,
    headers_dict,
)
from streams.producer import TypedProducer
from streams.settings import KafkaSettings
from streams.tasks import stop_task

pytestmark = pytest.mark.integration


def cancel(i: int, session: str | None = None) -> CancelRequest:
    return CancelRequest(request_id=f"r{i}", session_id=session or f"s{i}")


async def wait_until(cond, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def test_group_rebalance_second_member_takes_partitions_nothing_lost(
    kafka_settings: KafkaSettings,
) -> None:
    handled: dict[str, list[str]] = {"a": [], "b": []}

    def collector(name: str):  # type: ignore[no-untyped-def]
        async def handler(record: Record) -> None:
            handled[name].append(record.message.request_id)

        return handler

    async with TypedProducer(kafka_settings, "intake-1") as producer:
        for i in range(40):
            await producer.send(topics.REQUESTS, cancel(i))
        a = TypedConsumer(kafka_settings, [topics.REQUESTS], group_id="g-rebalance")
        b = TypedConsumer(kafka_settings, [topics.REQUESTS], group_id="g-rebalance")
        await a.start()
        task_a = asyncio.create_task(a.run(collector("a")))
        try:
            assert len(await a.wait_assignment()) == topics.REQUESTS.partitions
            await wait_until(lambda: len(handled["a"]) == 40)
            await b.start()
            task_b = asyncio.create_task(b.run(collector("b")))
            try:
                # After the rebalance the partitions are split between the two members (each member
                # learns its share at its own sync: wait for both rather than sample one in between).
                await wait_until(
                    lambda: (
                        len(b.assignment()) > 0
                        and 0 < len(a.assignment()) < topics.REQUESTS.partitions
                        and len(a.assignment() | b.assignment()) == topics.REQUESTS.partitions
                    )
                )
                assert a.assignment().isdisjoint(b.assignment())
                for i in range(40, 80):
                    await producer.send(topics.REQUESTS, cancel(i))
                await wait_until(lambda: len(handled["a"]) + len(handled["b"]) >= 80)
                await asyncio.sleep(0.3)  # a late duplicate would show up here
            finally:
                await stop_task(task_b)
                await b.stop()
        finally:
            await stop_task(task_a)
            await a.stop()
    everything = Counter(handled["a"] + handled["b"])
    assert set(everything) == {f"r{i}" for i in range(80)}
    assert max(everything.values()) == 1
    assert handled["b"], "the second member never got a record"
    assert all(int(r[1:]) >= 40 for r in handled["b"])


async def test_redelivery_after_consumer_dies_before_commit(kafka_settings: KafkaSettings) -> None:
    # One session key: every record on one partition, in order.
    handled: list[str] = []
    blocked = asyncio.Event()

    async def dying_handler(record: Record) -> None:
        if record.message.request_id == "r5":
            blocked.set()
            await asyncio.Event().wait()  # the process "dies" here, r5 never handled
        handled.append(record.message.request_id)

    async def handler(record: Record) -> None:
        handled.append(record.message.request_id)

    # tansu keeps a departed member until its session times out; short timeouts keep the rejoin quick.
    kafka = kafka_settings.model_copy(
        update={"session_timeout_ms": 2000, "rebalance_timeout_ms": 1000, "heartbeat_interval_ms": 300}
    )
    async with TypedProducer(kafka, "intake-1") as producer:
        for i in range(10):
            await producer.send(topics.REQUESTS, cancel(i, session="one"))
    first = TypedConsumer(kafka, [topics.REQUESTS], group_id="g-redeliver")
    await first.start()
    task = asyncio.create_task(first.run(dying_handler))
    async with asyncio.timeout(12):
        await blocked.wait()
    await stop_task(task)
    await first.stop()
    assert handled == [f"r{i}" for i in range(5)]

    second = TypedConsumer(kafka, [topics.REQUESTS], group_id="g-redeliver")
    await second.start()
    task = asyncio.create_task(second.run(handler))
    try:
        await wait_until(lambda: len(handled) >= 10)
        await asyncio.sleep(0.3)
    finally:
        await stop_task(task)
        await second.stop()
    assert handled == [f"r{i}" for i in range(10)]


async def test_dedup_skips_redelivered_and_resent_records(kafka_settings: KafkaSettings) -> None:
    async with TypedProducer(kafka_settings, "intake-1") as producer:
        for i in range(4):
            await producer.send(topics.REQUESTS, cancel(i, session="one"))
        # A producer retry that wrote the same record twice: same producer, same seq.
        dup = encode(cancel(3, session="one"), "intake-1", producer.next_seq() - 1, 0)
        await producer.send_raw(topic_name(topics.REQUESTS, kafka_settings), dup, "one")
    async with TypedConsumer(kafka_settings, [topics.REQUESTS]) as consumer:
        got: list[Record] = []
        while len(got) < 4 or consumer.metrics.consumed < 5:
            got.extend(await consumer.getmany(timeout_ms=200))
        assert [r.message.request_id for r in got] == ["r0", "r1", "r2", "r3"]
        assert consumer.metrics.deduplicated == 1
        # Seek back (a cold start from an older snapshot): nothing is handed out twice.
        ((topic, partition),) = {(r.topic, r.partition) for r in got}
        assert (await consumer.end_offsets())[(topic, partition)] == 5
        await consumer.seek({(topic, partition): 0})
        assert (await consumer.positions())[(topic, partition)] == 0
        again: list[Record] = []
        while consumer.metrics.consumed < 10:
            again.extend(await consumer.getmany(timeout_ms=200))
        assert again == []
        assert consumer.metrics.deduplicated == 6


async def test_poison_and_failing_records_are_dead_lettered_and_loop_goes_on(
    kafka_settings: KafkaSettings,
) -> None:
    handled: list[str] = []
    done = asyncio.Event()

    async def handler(record: Record) -> None:
        if record.message.request_id == "bad-handler":
            raise RuntimeError("boom")
        handled.append(record.message.request_id)
        if record.message.request_id == "r-last":
            done.set()

    requests_name = topic_name(topics.REQUESTS, kafka_settings)
    async with TypedProducer(kafka_settings, "intake-1") as producer:
        await producer.send(topics.REQUESTS, cancel(1, session="one"))
        await producer.send_raw(requests_name, b"\xc1garbage not msgpack", "one")
        await producer.send(topics.REQUESTS, CancelRequest("bad-handler", "one"))
        await producer.send(topics.REQUESTS, CancelRequest("r-last", "one"))
        consumer = TypedConsumer(
            kafka_settings, [topics.REQUESTS], group_id="g-poison", dlq=producer, retry_backoff_s=0.01
        )
        await consumer.start()
        task = asyncio.create_task(consumer.run(handler))
        try:
            async with asyncio.timeout(12):
                await done.wait()
        finally:
            await stop_task(task)
            await consumer.stop()
    assert handled == ["r1", "r-last"]
    assert consumer.metrics.dead_lettered == 2
    assert consumer.metrics.handler_errors == 3  # max_attempts

    dl = AIOKafkaConsumer(
        topic_name(topics.DEAD_LETTER, kafka_settings),
        bootstrap_servers=kafka_settings.bootstrap_servers,
        auto_offset_reset="earliest",
    )
    await dl.start()
    try:
        records = []
        for _ in range(50):
            for batch in (await dl.getmany(timeout_ms=200)).values():
                records.extend(batch)
            if len(records) >= 2:
                break
    finally:
        await dl.stop()
    assert len(records) == 2
    poison, failed = records
    assert poison.value == b"\xc1garbage not msgpack"
    assert poison.key == b"kvmesh.requests"
    h = headers_dict(poison.headers)
    assert h[DLQ_SOURCE_TOPIC] == "kvmesh.requests"
    assert h[DLQ_SOURCE_OFFSET] == "1"
    assert h[DLQ_ERROR_KIND] == "schema"
    assert headers_dict(failed.headers)[DLQ_ERROR_KIND] == "handler"

    # Everything was committed, the poison record included: a restart reads nothing again.
    check = AIOKafkaConsumer(bootstrap_servers=kafka_settings.bootstrap_servers, group_id="g-poison")
    await check.start()
    try:
        tps = [TopicPartition(requests_name, p) for p in range(topics.REQUESTS.partitions)]
        committed = {tp.partition: await check.committed(tp) for tp in tps}
    finally:
        await check.stop()
    assert sorted(v for v in committed.values() if v) == [4]
