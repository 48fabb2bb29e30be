"""Every service's ``stop()`` is safe twice and leaves it restartable, on the real broker and Redis; a
start that fails half way (Kafka unreachable) closes what it had opened."""

from __future__ import annotations

from typing import Any

import pytest

from services.kvmanager.config import KvManagerSettings
from services.kvmanager.service import KvManagerService
from services.scheduler.config import SchedulerSettings
from services.scheduler.service import SchedulerService
from services.worker.config import WorkerSettings
from services.worker.service import WorkerService
from streams.settings import KafkaSettings, RedisSettings

pytestmark = [pytest.mark.integration]


def _services(kafka: KafkaSettings, redis: RedisSettings) -> list[Any]:
    return [
        SchedulerService(
            SchedulerSettings(kafka=kafka, redis=redis, create_topics=False, catch_up_timeout_s=5)
        ),
        KvManagerService(KvManagerSettings(kafka=kafka, redis=redis, poll_timeout_ms=20)),
        WorkerService(
            WorkerSettings(
                worker_id="w-restart", insecure_dev_transfer=True, calibrate=False, gpu_blocks=64, kafka=kafka
            )
        ),
    ]


async def test_stop_twice_then_start_again(
    kafka_settings: KafkaSettings, redis_settings: RedisSettings
) -> None:
    for svc in _services(kafka_settings, redis_settings):
        await svc.start()
        await svc.stop()
        await svc.stop()  # a second stop is a no-op
        await svc.start()  # and the service comes back whole
        assert svc.registry is not None
        await svc.stop()


async def test_a_failed_start_rolls_back(redis_settings: RedisSettings) -> None:
    """Kafka unreachable: start raises, and what it opened before (Redis clients, producers) is closed,
    so a later start begins from nothing."""
    dead = KafkaSettings(bootstrap_servers="127.0.0.1:9")
    svc = KvManagerService(KvManagerSettings(kafka=dead, redis=redis_settings))
    with pytest.raises(Exception):  # noqa: B017 - aiokafka's connection error type varies by version
        await svc.start()
    assert svc.redis is None and svc.producer is None and svc.consumer is None
    sched = SchedulerService(SchedulerSettings(kafka=dead, redis=redis_settings, create_topics=False))
    with pytest.raises(Exception):  # noqa: B017
        await sched.start()
    assert not sched.started and sched._producer is None
