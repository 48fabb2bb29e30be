"""API keys → tenants. The tenant of a request comes from its key, never from its body.

Keys are kept only as SHA-256 digests, so neither a repr, a log line nor a heap dump of the table
shows one; a lookup hashes the presented key and compares digests in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path

from services.intake.config import IntakeSettings
from services.intake.errors import AuthenticationFailed

log = logging.getLogger("kvmesh.intake.auth")

#: The tenant of every request when no keys are configured (dev mode).
DEV_TENANT = "default"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def parse_key_spec(spec: str) -> dict[str, str]:
    """``"key1:tenantA,key2:tenantB"`` (commas or newlines; ``#`` starts a comment) → key → tenant."""
    table: dict[str, str] = {}
    for raw in spec.replace("\n", ",").split(","):
        item = raw.split("#", 1)[0].strip()
        if not item:
            continue
        key, sep, tenant = item.rpartition(":")
        key, tenant = key.strip(), tenant.strip()
        if not sep or not key or not tenant:
            # The offending entry may be a key: say where, never what.
            raise ValueError("API key entries must look like key:tenant")
        table[key] = tenant
    return table


class ApiKeyTable:
    """Owns the key digests and their tenants. Empty table = dev mode (every request is ``default``)."""

    def __init__(self, keys: dict[str, str] | None = None) -> None:
        self._tenants: dict[bytes, str] = {_digest(k): t for k, t in (keys or {}).items()}

    @classmethod
    def from_settings(cls, settings: IntakeSettings) -> ApiKeyTable:
        keys: dict[str, str] = {}
        if settings.api_keys is not None:
            keys.update(parse_key_spec(settings.api_keys.get_secret_value()))
        if settings.api_keys_file:
            keys.update(parse_key_spec(Path(settings.api_keys_file).read_text(encoding="utf-8")))
        table = cls(keys)
        if table.dev_mode:
            log.warning("no API keys configured: every request is served as tenant %r (dev mode)", DEV_TENANT)
        else:
            log.info("API keys configured for %d tenant(s)", len(set(keys.values())))
        return table

    def __repr__(self) -> str:
        return f"ApiKeyTable(keys={len(self._tenants)})"

    @property
    def dev_mode(self) -> bool:
        return not self._tenants

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant named by an ``Authorization: Bearer <key>`` header, or AuthenticationFailed."""
        if self.dev_mode:
            return DEV_TENANT
        if not authorization:
            raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationFailed("Malformed Authorization header: expected 'Bearer <key>'.")
        presented = _digest(key.strip())
        found: str | None = None
        for digest, tenant in self._tenants.items():  # no early exit: time does not depend on position
            if hmac.compare_digest(digest, presented):
                found = tenant
        if found is None:
            raise AuthenticationFailed("Incorrect API key provided.")
        return found
