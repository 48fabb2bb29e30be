"""LoadReports signed with the fleet secret, so that whoever can write to Kafka cannot forge a worker.

A forged LoadReport (a fake worker id, or a real one with false figures) would draw requests for as
long as its heartbeats continue. Workers sign each report with the fleet secret (the data plane's
HMAC key); schedulers, KV managers, intake and replay, given the same secret, drop every report that
does not verify. Without a secret (dev mode) reports are taken as they come.

The MAC covers the report's msgpack encoding with an empty signature, behind a domain tag, so a MAC
made for anything else never verifies here.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Protocol

import msgspec

from schemas.messages import LoadReport

log = logging.getLogger(__name__)

_TAG = b"kvmesh.load_report.v1\0"
SIGNATURE_BYTES = 16
#: LoadReport fields added since signatures began, in the order they came.
_ADDED_FIELDS = (
    "prefill_chunk_tokens",
    "slot_wait_steps",
    "recent_decode_ms_per_step",
    "kv_free_blocks",
    "kv_release",
)
_DEFAULTS = {
    f.name: f.default_factory() if f.default is msgspec.NODEFAULT else f.default
    for f in msgspec.structs.fields(LoadReport)
    if f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT
}


def _mac(report: LoadReport, secret: bytes) -> bytes:
    # Canonical bytes: encoded, decoded as the type and encoded again, so that a figure the worker
    # held as an int and a consumer decodes as a float (or a tuple that comes back a list) signs alike.
    # The tag is left out: the bytes are those of the untagged report, which signatures were made
    # over before messages were tagged, so a recorded stream still verifies.
    raw = msgspec.msgpack.encode(msgspec.structs.replace(report, signature=b""))
    plain = msgspec.to_builtins(msgspec.msgpack.decode(raw, type=LoadReport), builtin_types=(bytes,))
    del plain["type"]
    # Fields added to LoadReport after signing began sign only when set: a report from an older worker
    # (which lacks them) decodes with their defaults and must give the bytes that worker signed.
    for name in _ADDED_FIELDS:
        if plain.get(name) == _DEFAULTS[name]:
            del plain[name]
    body = msgspec.msgpack.encode(plain)
    return hmac.new(secret, _TAG + body, hashlib.sha256).digest()[:SIGNATURE_BYTES]


def sign(report: LoadReport, secret: bytes) -> LoadReport:
    return msgspec.structs.replace(report, signature=_mac(report, secret))


def verify(report: LoadReport, secret: bytes) -> bool:
    return len(report.signature) == SIGNATURE_BYTES and hmac.compare_digest(
        report.signature, _mac(report, secret)
    )


class _Secret(Protocol):
    """A settings secret (pydantic's SecretStr)."""

    def get_secret_value(self) -> str: ...


class ReportCheck:
    """Which LoadReports to take: all without a secret, else only those that verify. Counts the rest
    and logs once per worker id."""

    def __init__(self, secret: bytes | None) -> None:
        self.secret = secret or None
        self.refused = 0
        self._warned: set[str] = set()

    @classmethod
    def from_setting(cls, secret: _Secret | None) -> ReportCheck:
        """The check of a service's ``fleet_secret`` setting (None or empty: dev mode)."""
        return cls(secret.get_secret_value().encode() if secret is not None else None)

    def accept(self, report: LoadReport) -> bool:
        if self.secret is None or verify(report, self.secret):
            return True
        self.refused += 1
        if report.worker_id not in self._warned and len(self._warned) < 1000:
            self._warned.add(report.worker_id)
            log.warning(
                "LoadReport of %r does not verify under the fleet secret: dropped (forged or misconfigured)",
                report.worker_id,
            )
        return False
