"""Decode and validation errors of the wire contracts.

Every failure to turn bytes into a message is a :class:`SchemaError`. Consumers catch that one class
and turn the record into a dead-letter record; nothing else about a bad record may crash a service.
"""

from kvmesh_core.errors import KvmeshError


class SchemaError(KvmeshError):
    """A record could not be decoded or validated."""


class MalformedRecord(SchemaError):
    """The bytes are not a MessagePack envelope, or the envelope lacks required fields."""


class UnknownSchema(SchemaError):
    """The envelope names a schema this build does not know."""


class UnknownVersion(SchemaError):
    """The envelope's schema version is newer (or older) than this build can read."""


class InvalidPayload(SchemaError):
    """The payload does not match the schema: a missing field, a wrong type, a bound violated."""


class RecordTooLarge(SchemaError):
    """The encoded record exceeds the configured maximum record size."""
