"""Encoding and strict decoding of envelopes: the only way bytes become messages.

Each topic reads with one :class:`RecordDecoder` for the union of the message types it carries, built
once: msgspec decodes the envelope, picks the payload's type by its tag and validates every field in
one C pass (exact types, so a bool is not an int; literals; the types' ``__post_init__`` bounds).
Records that pass need nothing more. A record that fails that pass is decoded again step by step,
header first: that path reads records written before payloads were tagged (every older version
still decodes, see tests/schemas/recorded) and names what is wrong with a bad one.

A decoder never raises anything but :class:`~schemas.errors.SchemaError` for bad bytes, so a consumer
can catch that one class and dead-letter the record.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Any, Union

import msgspec

from schemas.envelope import MAGIC, AnyEnvelope, Envelope, RawEnvelope
from schemas.errors import InvalidPayload, MalformedRecord, RecordTooLarge, UnknownSchema, UnknownVersion
from schemas.messages import MESSAGE_TYPES
from schemas.token_ids import from_wire, wire_value

#: Records larger than this are refused on encode and on decode (Kafka's default max is 1 MiB).
DEFAULT_MAX_RECORD_BYTES = 1 << 20

# (SCHEMA is a ClassVar of every message type; the tuple's element type does not say so)
REGISTRY: dict[str, type] = {cls.SCHEMA: cls for cls in MESSAGE_TYPES}  # type: ignore[attr-defined]

_encoder = msgspec.msgpack.Encoder(enc_hook=wire_value)
_header = msgspec.msgpack.Decoder(RawEnvelope)


def readable_versions(cls: type) -> tuple[int, ...]:
    """Versions of ``cls`` this build can decode: its own, plus any it lists in ``READS``."""
    return tuple(getattr(cls, "READS", (cls.VERSION,)))  # type: ignore[attr-defined]  # as SCHEMA


def encode(
    message: Any,
    producer: str,
    seq: int,
    event_ms: int,
    max_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> bytes:
    """Encode ``message`` in an envelope. Raises RecordTooLarge past ``max_bytes``."""
    cls = type(message)
    if REGISTRY.get(getattr(cls, "SCHEMA", "")) is not cls:
        raise UnknownSchema(f"{cls.__name__} is not a registered message type")
    data = _encoder.encode((MAGIC, cls.SCHEMA, cls.VERSION, producer, seq, event_ms, message))
    if len(data) > max_bytes:
        raise RecordTooLarge(f"{cls.SCHEMA} record of {len(data)} bytes exceeds {max_bytes}")
    return data


@cache
def _payload_decoder(cls: type) -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(cls, dec_hook=from_wire)


class RecordDecoder:
    """Decodes the records of a topic that carries ``types`` (build it with :func:`decoder_for`)."""

    def __init__(self, types: Iterable[type]) -> None:
        self.types: dict[str, type] = {t.SCHEMA: t for t in types}  # type: ignore[attr-defined]  # as above
        if not self.types:
            raise ValueError("a decoder needs at least one message type")
        union: Any = Union[tuple(self.types.values())]  # noqa: UP007 (built at run time)
        self._fast = msgspec.msgpack.Decoder(Envelope[union], dec_hook=from_wire)
        self._readable = {name: readable_versions(t) for name, t in self.types.items()}

    def decode(self, data: bytes, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> AnyEnvelope:
        """Decode and validate one record. Raises a SchemaError subclass for anything wrong."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise MalformedRecord(f"record value must be bytes, got {type(data).__name__}")
        if len(data) > max_bytes:
            raise RecordTooLarge(f"record of {len(data)} bytes exceeds {max_bytes}")
        try:
            env: AnyEnvelope = self._fast.decode(data)
        except (msgspec.DecodeError, RecursionError):
            return self._checked(data)
        readable = self._readable.get(env.schema)
        if readable is not None and env.version in readable and env.schema == type(env.message).SCHEMA:
            return env
        return self._checked(data)  # the header and the payload's tag disagree: say which is wrong

    def _checked(self, data: bytes | bytearray | memoryview) -> AnyEnvelope:
        """The step-by-step path: header, schema, version, then the payload as its named type."""
        try:
            head = _header.decode(data)
        except msgspec.ValidationError as exc:
            raise MalformedRecord(f"not a kvmesh envelope: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise MalformedRecord(f"not a MessagePack record: {exc}") from exc
        cls = self.types.get(head.schema)
        if cls is None:
            if head.schema in REGISTRY:
                raise UnknownSchema(f"{head.schema} records do not travel on this topic")
            raise UnknownSchema(f"unknown schema {head.schema!r}")
        if head.version not in self._readable[head.schema]:
            raise UnknownVersion(
                f"{head.schema} version {head.version} not readable (reads {self._readable[head.schema]})"
            )
        try:
            message = _payload_decoder(cls).decode(head.message)
        except RecursionError as exc:
            raise InvalidPayload(f"{head.schema}: payload nested too deeply") from exc
        except (
            msgspec.DecodeError
        ) as exc:  # ValidationError included: a field missing, mistyped, out of bounds
            raise InvalidPayload(f"{head.schema}: {exc}") from exc
        return Envelope(
            schema=head.schema,
            version=head.version,
            producer=head.producer,
            seq=head.seq,
            event_ms=head.event_ms,
            message=message,
        )


@cache
def decoder_for(types: tuple[type, ...]) -> RecordDecoder:
    """The decoder of a topic that carries ``types`` (one per distinct tuple, built on first use)."""
    return RecordDecoder(types)


def decode(data: bytes, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> AnyEnvelope:
    """Decode and validate one record of any message type (readers that are not bound to a topic)."""
    return decoder_for(MESSAGE_TYPES).decode(data, max_bytes)
