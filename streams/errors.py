"""Errors of the streams layer (producer, consumer, admin, embedded dev stack)."""

from __future__ import annotations

from kvmesh_core.errors import KvmeshError


class StreamsError(KvmeshError):
    """Base of every error the streams package raises on purpose."""


class NotStarted(StreamsError):
    """A producer or consumer was used before ``start()`` (or after ``stop()``)."""


class WrongTopic(StreamsError):
    """A message was sent to a topic that does not carry its type."""


class MissingKey(StreamsError):
    """No key was given and the message has no attribute named by the topic's key."""


class EmbeddedStartError(StreamsError):
    """An embedded broker or redis-server could not be started (binary missing, never became ready)."""
