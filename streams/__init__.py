"""The streams layer: typed Kafka producer/consumer over the topic catalog, admin, dev stack.

Import the submodules directly (``from streams.producer import TypedProducer``) or these names.
"""

from streams.admin import ensure_topics, topic_name
from streams.clock import now_ms
from streams.consumer import ConsumerMetrics, Record, TypedConsumer
from streams.embedded import EmbeddedBroker, EmbeddedRedis, docker_available
from streams.errors import StreamsError
from streams.producer import PublishError, TypedProducer, partition_for
from streams.settings import KafkaSettings, RedisSettings
from streams.topics import ALL_TOPICS, BY_NAME, TopicSpec

__all__ = [
    "ALL_TOPICS",
    "BY_NAME",
    "ConsumerMetrics",
    "EmbeddedBroker",
    "EmbeddedRedis",
    "KafkaSettings",
    "PublishError",
    "Record",
    "RedisSettings",
    "StreamsError",
    "TopicSpec",
    "TypedConsumer",
    "TypedProducer",
    "docker_available",
    "ensure_topics",
    "now_ms",
    "partition_for",
    "topic_name",
]
