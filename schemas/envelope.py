"""The versioned envelope around every payload.

On the wire an envelope is a MessagePack array, not a map, so field names are not repeated in every
record::

    [magic "kvm1", schema name, schema version, producer id, sequence, event time ms, payload map]

``(producer, seq)`` identifies a record: a producer's sequence increases by one per record it sends,
so a consumer drops a redelivered record whose sequence it has already handled on that partition.
The payload map carries its type's tag too (``"type": schema name``), which lets a topic's decoder
read the union of its types in one pass; records written before the tag (and trailing elements a
newer writer may append to the array) still decode.
"""

from __future__ import annotations

from typing import Any, Final, Generic, Literal, TypeVar

import msgspec

MAGIC: Final = "kvm1"

M = TypeVar("M")


class Envelope(msgspec.Struct, Generic[M], array_like=True, frozen=True, kw_only=True):
    """A decoded record: header fields plus the typed message (the wire array, field for field)."""

    magic: Literal["kvm1"] = MAGIC
    schema: str
    version: int
    producer: str
    seq: int
    event_ms: int
    message: M


#: An envelope whose payload is left undecoded, for reading the header alone.
RawEnvelope = Envelope[msgspec.Raw]
#: The usual annotation where the message type is not known statically.
AnyEnvelope = Envelope[Any]
