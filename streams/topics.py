"""The topic catalog: every Kafka topic kvmesh uses, its key, message types and partitions.

Services import these constants; no topic name appears as a string literal anywhere else.

=====================  ==============  =====================================  ==========================
topic                  key             messages                               retention intent
=====================  ==============  =====================================  ==========================
kvmesh.requests        session_id      ChatRequest, CancelRequest             delete (hours)
kvmesh.assignments     worker_id       Assignment, CancelRequest              delete (hours)
kvmesh.replies         request_id      TokenChunk, Completion                 delete (minutes)
kvmesh.kv-events       worker_id       KvEvent                                delete (replay window)
kvmesh.load            worker_id       LoadReport                             compact (latest per key)
kvmesh.control         worker_id       WorkerLost, ReplicateCommand, Retain,  delete (hours)
                                       Drain, ResyncRequest
kvmesh.heartbeats      instance_id     ServiceHeartbeat                       delete (minutes)
kvmesh.dead-letter     source topic    raw bytes of undecodable records       delete (days)
=====================  ==============  =====================================  ==========================
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.messages import (
    Assignment,
    CancelRequest,
    ChatRequest,
    Completion,
    DrainCommand,
    KvEvent,
    LoadReport,
    ReplicateCommand,
    ResyncRequest,
    RetainHint,
    ServiceHeartbeat,
    TokenChunk,
    WorkerLost,
)


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """What a topic carries and how it is partitioned."""

    name: str
    key: str
    messages: tuple[type, ...]
    partitions: int
    cleanup_policy: str = "delete"
    retention_ms: int = 6 * 3600 * 1000
    # (schema name, attribute) pairs for message types whose key field is not named ``key``
    # (e.g. ReplicateCommand is addressed to its ``target_worker``).
    key_overrides: tuple[tuple[str, str], ...] = ()

    def carries(self, message: object) -> bool:
        """Whether ``message``'s type is one of this topic's message types."""
        return type(message) in self.messages

    def key_of(self, message: object) -> str | None:
        """The record key of ``message`` on this topic, or None if the message has no such field."""
        attr = self.key
        if self.key_overrides:
            attr = dict(self.key_overrides).get(getattr(type(message), "SCHEMA", ""), attr)
        value = getattr(message, attr, None)
        return None if value is None else str(value)


REQUESTS = TopicSpec("kvmesh.requests", "session_id", (ChatRequest, CancelRequest), partitions=4)
ASSIGNMENTS = TopicSpec("kvmesh.assignments", "worker_id", (Assignment, CancelRequest), partitions=8)
REPLIES = TopicSpec(
    "kvmesh.replies", "request_id", (TokenChunk, Completion), partitions=4, retention_ms=15 * 60 * 1000
)
KV_EVENTS = TopicSpec(
    "kvmesh.kv-events", "worker_id", (KvEvent,), partitions=4, retention_ms=24 * 3600 * 1000
)
LOAD = TopicSpec("kvmesh.load", "worker_id", (LoadReport,), partitions=4, cleanup_policy="compact")
CONTROL = TopicSpec(
    "kvmesh.control",
    "worker_id",
    (WorkerLost, ReplicateCommand, RetainHint, DrainCommand, ResyncRequest),
    partitions=4,
    key_overrides=(("replicate_command", "target_worker"),),
)
HEARTBEATS = TopicSpec(
    "kvmesh.heartbeats", "instance_id", (ServiceHeartbeat,), partitions=1, retention_ms=10 * 60 * 1000
)
DEAD_LETTER = TopicSpec(
    "kvmesh.dead-letter", "source_topic", (), partitions=1, retention_ms=7 * 24 * 3600 * 1000
)

ALL_TOPICS: tuple[TopicSpec, ...] = (
    REQUESTS,
    ASSIGNMENTS,
    REPLIES,
    KV_EVENTS,
    LOAD,
    CONTROL,
    HEARTBEATS,
    DEAD_LETTER,
)

BY_NAME: dict[str, TopicSpec] = {t.name: t for t in ALL_TOPICS}
