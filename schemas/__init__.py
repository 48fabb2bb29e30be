"""Wire contracts of kvmesh: versioned MessagePack envelopes, message types, and block identity.

Every message between services is an :class:`~schemas.envelope.Envelope` whose payload is one of the
message dataclasses in :mod:`schemas.messages`. :func:`schemas.codec.encode` / :func:`schemas.codec.decode`
are the only way bytes become messages, and decoding validates strictly.
"""

from schemas.blocks import DEFAULT_BLOCK_SIZE, PUBLIC_NAMESPACE, block_hashes, tenant_namespace
from schemas.codec import decode, encode
from schemas.envelope import Envelope
from schemas.errors import (
    InvalidPayload,
    MalformedRecord,
    RecordTooLarge,
    SchemaError,
    UnknownSchema,
    UnknownVersion,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "PUBLIC_NAMESPACE",
    "Envelope",
    "InvalidPayload",
    "MalformedRecord",
    "RecordTooLarge",
    "SchemaError",
    "UnknownSchema",
    "UnknownVersion",
    "block_hashes",
    "decode",
    "encode",
    "tenant_namespace",
]
