"""Encoding and strict decoding of envelopes: the only way bytes become messages.

A decoder never raises anything but :class:`~schemas.errors.SchemaError` for bad bytes, so a consumer
can catch that one class and dead-letter the record.
"""

from __future__ import annotations

from typing import Any

import msgpack

from schemas.construct import constructor
from schemas.envelope import MAGIC, Envelope
from schemas.errors import InvalidPayload, MalformedRecord, RecordTooLarge, UnknownSchema, UnknownVersion
from schemas.messages import MESSAGE_TYPES
from schemas.validate import from_owned_plain, to_plain

#: Records larger than this are refused on encode and on decode (Kafka's default max is 1 MiB).
DEFAULT_MAX_RECORD_BYTES = 1 << 20

_REGISTRY: dict[str, type] = {}


def register(cls: type) -> type:
    """Make ``cls`` (a message dataclass with SCHEMA and VERSION) known to the decoder."""
    _REGISTRY[cls.SCHEMA] = cls  # type: ignore[attr-defined]
    return cls


for _cls in MESSAGE_TYPES:
    register(_cls)

_make_envelope = constructor(Envelope)


def readable_versions(cls: type) -> tuple[int, ...]:
    """Versions of ``cls`` this build can decode: its own, plus any it lists in ``READS``."""
    return tuple(getattr(cls, "READS", (cls.VERSION,)))  # type: ignore[attr-defined]


def _check_header(version: Any, producer: Any, seq: Any, event_ms: Any) -> None:
    for name, value in (("version", version), ("seq", seq), ("event_ms", event_ms)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise MalformedRecord(f"envelope {name} must be an integer")
    if not isinstance(producer, str):
        raise MalformedRecord("envelope producer must be a string")


def encode(
    message: Any,
    producer: str,
    seq: int,
    event_ms: int,
    max_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> bytes:
    """Encode ``message`` in an envelope. Raises RecordTooLarge past ``max_bytes``."""
    cls = type(message)
    if _REGISTRY.get(getattr(cls, "SCHEMA", "")) is not cls:
        raise UnknownSchema(f"{cls.__name__} is not a registered message type")
    data: bytes = msgpack.packb(
        [MAGIC, cls.SCHEMA, cls.VERSION, producer, seq, event_ms, to_plain(message)],
        use_bin_type=True,
    )
    if len(data) > max_bytes:
        raise RecordTooLarge(f"{cls.SCHEMA} record of {len(data)} bytes exceeds {max_bytes}")
    return data


def decode(data: bytes, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Envelope:
    """Decode and validate one record. Raises a SchemaError subclass for anything wrong."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MalformedRecord(f"record value must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise RecordTooLarge(f"record of {len(data)} bytes exceeds {max_bytes}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise MalformedRecord(f"not a MessagePack record: {exc}") from exc
    if not isinstance(raw, list) or len(raw) != 7 or raw[0] != MAGIC:
        raise MalformedRecord("not a kvmesh envelope")
    _, schema, version, producer, seq, event_ms, payload = raw
    if not isinstance(schema, str):
        raise MalformedRecord("schema name must be a string")
    if not (type(version) is int and type(seq) is int and type(event_ms) is int and type(producer) is str):
        _check_header(version, producer, seq, event_ms)  # the exact types are the common case
    cls = _REGISTRY.get(schema)
    if cls is None:
        raise UnknownSchema(f"unknown schema {schema!r}")
    if version not in readable_versions(cls):
        raise UnknownVersion(f"{schema} version {version} not readable (reads {readable_versions(cls)})")
    try:
        # The payload is fresh from unpackb and held by nobody else: the message may keep its lists.
        message: Any = from_owned_plain(cls, payload, schema)
    except InvalidPayload:
        raise
    except RecursionError as exc:
        raise InvalidPayload(f"{schema}: payload nested too deeply") from exc
    return _make_envelope(schema, version, producer, seq, event_ms, message)
