"""Topic administration: create the catalog's topics (idempotently) and name them with a prefix."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from streams.errors import StreamsError
from streams.settings import KafkaSettings
from streams.topics import ALL_TOPICS, TopicSpec

log = logging.getLogger(__name__)


class TopicCreationError(StreamsError):
    """The broker refused to create a topic for a reason other than "it already exists"."""


def topic_name(spec: TopicSpec | str, kafka: KafkaSettings) -> str:
    """The broker-side name of a catalog topic: ``kafka.topic_prefix + spec.name``."""
    name = spec if isinstance(spec, str) else spec.name
    return f"{kafka.topic_prefix}{name}"


def _topic_configs(spec: TopicSpec) -> dict[str, str]:
    configs = {"cleanup.policy": spec.cleanup_policy}
    if spec.cleanup_policy == "delete":
        configs["retention.ms"] = str(spec.retention_ms)
    return configs


def _already_exists(err: object) -> bool:
    return err == TopicAlreadyExistsError.errno or err is TopicAlreadyExistsError


async def ensure_topics(kafka: KafkaSettings, topics: Iterable[TopicSpec] = ALL_TOPICS) -> None:
    """Create each topic with its partitions and retention configs; an existing topic is fine.

    Some brokers (tansu among them) reject or ignore topic configs; a topic refused with configs is
    created again without them, since the partition count is what the code depends on.
    """
    specs = list(topics)
    if not specs:
        return
    admin = AIOKafkaAdminClient(**kafka.client_kwargs())
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [s for s in specs if topic_name(s, kafka) not in existing]
        for spec in missing:
            await _create_one(admin, spec, kafka)
    finally:
        await admin.close()


async def _create_one(admin: AIOKafkaAdminClient, spec: TopicSpec, kafka: KafkaSettings) -> None:
    name = topic_name(spec, kafka)
    last_error: object = None
    for configs in (_topic_configs(spec), {}):
        topic = NewTopic(
            name, num_partitions=kafka.partitions_of(spec), replication_factor=1, topic_configs=configs
        )
        try:
            response = await admin.create_topics([topic])
        except TopicAlreadyExistsError:
            return
        except KafkaError as exc:
            last_error = exc
            log.info("creating %s with configs %s failed (%s); retrying without", name, configs, exc)
            continue
        errors = [(t[0], t[1]) for t in getattr(response, "topic_errors", [])]
        codes = [code for _, code in errors if code != 0]
        if not codes or all(_already_exists(c) for c in codes):
            log.debug("topic %s ready (%d partitions)", name, kafka.partitions_of(spec))
            return
        last_error = codes
        log.info("broker refused %s with configs %s (error %s); retrying without", name, configs, codes)
    raise TopicCreationError(f"could not create topic {name}: {last_error}")
