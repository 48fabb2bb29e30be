"""Worker-keyed topics reach their worker whatever their partition counts: the counts are settings
(KVMESH_KAFKA_PARTITIONS), the worker hashes its key over the broker's actual count, and when the
count grows under a running worker it follows its key to the new partition while still reading the
old one. tansu has no CreatePartitions, so the growth is shown by a worker that first believed the
topic had fewer partitions than it has."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from fleet_helpers import assignment, chat_request

from services.worker.config import WorkerSettings
from services.worker.service import WorkerService
from streams import topics
from streams.admin import ensure_topics
from streams.producer import TypedProducer, partition_for
from streams.settings import KafkaSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WID = "worker-keyed"


def _settings(kafka: KafkaSettings) -> WorkerSettings:
    return WorkerSettings(
        worker_id=WID,
        insecure_dev_transfer=True,
        calibrate=False,
        gpu_blocks=64,
        load_interval_ms=100,
        kafka=kafka,
    )


async def _completed(worker: WorkerService, n: int, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while worker.metrics.value("requests_total", outcome="completed") < n:
        assert loop.time() < deadline, (
            f"only {worker.metrics.value('requests_total', outcome='completed')} done"
        )
        await asyncio.sleep(0.1)


async def test_partition_counts_are_settings_and_the_worker_follows_growth(
    kafka_settings: KafkaSettings,
) -> None:
    counts = {topics.ASSIGNMENTS.name: 6, topics.CONTROL.name: 5}
    kafka = kafka_settings.model_copy(
        update={"topic_prefix": f"k{uuid.uuid4().hex[:8]}.", "partitions": counts}
    )
    await ensure_topics(kafka)
    worker = WorkerService(_settings(kafka))
    real = TypedProducer.partition_count

    async def believed(self: TypedProducer, spec: topics.TopicSpec) -> int:
        # before the growth: the worker's metadata said assignments had 3 partitions
        return 3 if spec is topics.ASSIGNMENTS else await real(self, spec)

    TypedProducer.partition_count = believed  # type: ignore[method-assign]
    try:
        await worker.start()
    finally:
        TypedProducer.partition_count = real  # type: ignore[method-assign]
    try:
        old = partition_for(topics.ASSIGNMENTS, WID, 3)
        new = partition_for(topics.ASSIGNMENTS, WID, 6)
        assert worker._keyed_parts[topics.CONTROL.name] == {partition_for(topics.CONTROL, WID, 5)}
        async with TypedProducer(kafka, "test-scheduler") as prod:
            # within a few load intervals the worker sees 6 partitions and follows its key
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 15
            while worker._keyed_counts[0] != 6:
                assert loop.time() < deadline, "the worker never followed the new partition count"
                await asyncio.sleep(0.1)
            assert worker._keyed_parts[topics.ASSIGNMENTS.name] == {old, new}
            # a record keyed as the producers key it now lands on the new partition, and is run
            await prod.send(topics.ASSIGNMENTS, assignment(chat_request("r-new", list(range(40))), WID))
            await _completed(worker, 1)
            # one already sitting on the old partition (sent before the growth) is run too
            await prod.send_raw(
                f"{kafka.topic_prefix}{topics.ASSIGNMENTS.name}",
                _encoded(prod, assignment(chat_request("r-old", list(range(50, 90))), WID)),
                key=WID,
                partition=old,
            )
            await _completed(worker, 2)
    finally:
        await worker.stop()


def _encoded(prod: TypedProducer, message: object) -> bytes:
    from schemas.codec import encode

    return encode(message, "test-scheduler", prod.next_seq(), 0, prod.kafka.max_record_bytes)
