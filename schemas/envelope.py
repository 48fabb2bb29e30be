"""The versioned envelope around every payload.

On the wire an envelope is a MessagePack array, not a map, so field names are not repeated in every
record::

    [magic "kvm1", schema name, schema version, producer id, sequence, event time ms, payload map]

``(producer, seq)`` identifies a record: a producer's sequence increases by one per record it sends,
so a consumer drops a redelivered record whose sequence it has already handled on that partition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAGIC = "kvm1"


@dataclass(frozen=True, slots=True)
class Envelope:
    """A decoded record: header fields plus the typed message."""

    schema: str
    version: int
    producer: str
    seq: int
    event_ms: int
    message: Any
