"""Integration: typed publish/consume on a real (embedded) broker."""

from __future__ import annotations

import asyncio

import pytest

from schemas.messages import CancelRequest, LoadReport, ReplicateCommand, TierUsage
from streams import topics
from streams.consumer import Record, TypedConsumer
from streams.errors import WrongTopic
from streams.producer import TypedProducer, partition_for
from streams.settings import KafkaSettings

pytestmark = pytest.mark.integration


def load_report(worker: str, ms: int) -> LoadReport:
    return LoadReport(
        worker_id=worker,
        report_ms=ms,
        queue_depth=1,
        active_requests=2,
        active_tokens=300,
        queued_prefill_tokens=40,
        tiers=[TierUsage("gpu", 10, 64)],
        transfer_address="127.0.0.1:1",
        block_size=16,
        block_bytes=4096,
        prefill_ms_per_token=0.02,
    )


async def test_typed_round_trip_keys_partitions_and_envelope(kafka_settings: KafkaSettings) -> None:
    workers = [f"w{i}" for i in range(6)]
    async with TypedProducer(kafka_settings, "p-test", clock=lambda: 1000) as producer:
        for i, w in enumerate(workers):
            await producer.send(topics.LOAD, load_report(w, 100 + i))
        with pytest.raises(WrongTopic):
            await producer.send(topics.REQUESTS, load_report("w0", 1))
    got: list[Record] = []
    async with TypedConsumer(kafka_settings, [topics.LOAD]) as consumer:
        for _ in range(50):
            got.extend(await consumer.getmany(timeout_ms=200))
            if len(got) >= len(workers):
                break
    assert sorted(r.message.worker_id for r in got) == workers
    for r in got:
        assert r.topic == "kvmesh.load"
        assert r.key == r.message.worker_id
        # aiokafka's partitioner put it exactly where partition_for says.
        assert r.partition == partition_for(topics.LOAD, r.key)
        assert r.envelope.producer == "p-test"
        assert r.envelope.event_ms == 1000
    seqs = sorted(r.envelope.seq for r in got)
    assert seqs == list(range(1000 * 1000, 1000 * 1000 + len(workers)))


async def test_manual_assignment_with_key_filter_reads_only_own_key(kafka_settings: KafkaSettings) -> None:
    async with TypedProducer(kafka_settings, "kvm") as producer:
        for w in ["w1", "w2", "w3", "w4", "w5", "w6", "w7", "w8"]:
            await producer.send(topics.CONTROL, ReplicateCommand("c-" + w, w, "src", "a:1", [1, 2], b"ns"))
        await producer.send(topics.ASSIGNMENTS, CancelRequest("r1", "s1", worker_id="w3"), key="w3")
    part = partition_for(topics.CONTROL, "w3")
    seen: list[Record] = []
    async with TypedConsumer(
        kafka_settings, [topics.CONTROL], assign=[(topics.CONTROL, part)], key_filter="w3"
    ) as consumer:
        stop = asyncio.Event()

        async def handler(record: Record) -> None:
            seen.append(record)
            stop.set()

        async with asyncio.timeout(10):
            await consumer.run(handler, stop)
        # ReplicateCommand is keyed by its target_worker (TopicSpec.key_overrides).
        assert [r.message.target_worker for r in seen] == ["w3"]
        assert consumer.assignment() == {("kvmesh.control", part)}


async def test_topic_prefix_namespaces_topics() -> None:
    # Pure naming check; the fixture-based tests cover prefixed brokers when KVMESH_TEST_KAFKA is set.
    from streams.admin import topic_name

    k = KafkaSettings(topic_prefix="ci-7.")
    assert topic_name(topics.REQUESTS, k) == "ci-7.kvmesh.requests"
    assert topic_name(topics.REQUESTS, KafkaSettings()) == "kvmesh.requests"


async def test_record_topics_copies_a_window(kafka_settings: KafkaSettings, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from schemas.codec import decode
    from streams.recording import read_recording, record_topics

    async with TypedProducer(kafka_settings, "p") as producer:
        for i in range(12):
            await producer.send(topics.LOAD, load_report(f"w{i % 5}", i))
    path = tmp_path / "load.kvr"
    n = await record_topics(kafka_settings, [topics.LOAD], path, idle_timeout_s=1.0)
    recs = list(read_recording(path))
    assert n == len(recs) == 12
    assert {r.topic for r in recs} == {"kvmesh.load"}
    assert sorted(decode(r.value).message.report_ms for r in recs) == list(range(12))
    # Resuming from offsets skips what came before them.
    offsets = {(r.topic, r.partition): r.offset + 1 for r in recs}
    assert await record_topics(kafka_settings, [topics.LOAD], path, from_offsets=offsets) == 0
    assert await record_topics(kafka_settings, [topics.LOAD], path, max_records=3) == 3


async def test_from_latest_starts_at_start_time_not_first_fetch(kafka_settings: KafkaSettings) -> None:
    async with TypedProducer(kafka_settings, "p") as producer:
        await producer.send(topics.LOAD, load_report("old", 1))
        async with TypedConsumer(kafka_settings, [topics.LOAD], from_beginning=False) as consumer:
            # Sent after start() but before the first fetch: must be read, the older one must not.
            await producer.send(topics.LOAD, load_report("new", 2))
            got: list[Record] = []
            for _ in range(50):
                got.extend(await consumer.getmany(timeout_ms=100))
                if got:
                    break
    assert [r.message.worker_id for r in got] == ["new"]
