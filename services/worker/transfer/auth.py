"""Fleet authentication of data-plane requests, and the settings that hold the fleet secret.

Every worker of a fleet shares one secret (``KVMESH_FLEET_SECRET``). A request carries
``HMAC-SHA256(secret, canonical_request)`` over all its fields, a random nonce and its send time; the
server accepts it only if the MAC matches, the time lies within ``window_ms`` of its own clock and the
nonce was not seen inside that window (a captured request cannot be replayed to pull the same blocks).

Tenant isolation is the server's job (``server.BlockServer``), not this module's: authentication says
the peer is a fleet worker; the namespace in the signed request says which tenant's blocks it may read.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections import OrderedDict
from collections.abc import Callable

import msgpack
from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.worker.transfer.errors import AuthFailed, InsecureSecret
from services.worker.transfer.frames import BlockRequest
from streams.clock import now_ms

_DOMAIN = b"kvmesh-transfer-v1\x00"
NONCE_BYTES = 16


class TransferSettings(BaseSettings):
    """Data-plane settings read from ``KVMESH_*`` (``KVMESH_FLEET_SECRET``, ``KVMESH_MAX_BLOCKS_PER_FETCH``,
    ``KVMESH_INSECURE_DEV_TRANSFER``)."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_", extra="ignore")

    fleet_secret: SecretStr = SecretStr("")
    # Dev only: lets a worker run the data plane without a secret (a fixed, public one is used).
    insecure_dev_transfer: bool = False
    max_blocks_per_fetch: int = 4096
    replay_window_ms: int = 30_000
    fetch_timeout_s: float = 5.0

    def secret_bytes(self) -> bytes:
        return resolve_secret(self.fleet_secret.get_secret_value().encode(), self.insecure_dev_transfer)


#: What an insecure dev fleet signs with; public, so it protects nothing.
INSECURE_DEV_SECRET = b"kvmesh-insecure-dev-secret"


def resolve_secret(secret: bytes | None, insecure_dev: bool = False) -> bytes:
    """The secret to sign with; an empty one is refused unless ``insecure_dev`` says so explicitly."""
    if secret:
        return secret
    if insecure_dev:
        return INSECURE_DEV_SECRET
    raise InsecureSecret("KVMESH_FLEET_SECRET is empty (set KVMESH_INSECURE_DEV_TRANSFER=1 for dev only)")


def canonical_request(req: BlockRequest) -> bytes:
    """The exact bytes the MAC covers: every field but the MAC, in a fixed order."""
    body: bytes = msgpack.packb(
        [req.block_hashes, req.namespace, req.layout, req.peer_id, req.nonce, req.ts_ms, req.probe_bytes],
        use_bin_type=True,
    )
    return _DOMAIN + body


def sign(secret: bytes, req: BlockRequest) -> bytes:
    return hmac.new(secret, canonical_request(req), hashlib.sha256).digest()


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


class FleetAuth:
    """Signs outgoing requests and verifies incoming ones.

    Owns the secret and the replay cache: nonces seen within the last ``window_ms``, oldest first, at
    most ``max_nonces`` of them (beyond that the oldest are forgotten, which only shortens the window).
    """

    def __init__(
        self,
        secret: bytes,
        *,
        window_ms: int = 30_000,
        max_nonces: int = 100_000,
        clock: Callable[[], int] = now_ms,
    ) -> None:
        if not secret:
            raise InsecureSecret("fleet secret must not be empty")
        self._secret = secret
        self._window_ms = window_ms
        self._max_nonces = max_nonces
        self._clock = clock
        self._seen: OrderedDict[bytes, int] = OrderedDict()

    def sign(self, req: BlockRequest) -> bytes:
        return sign(self._secret, req)

    def verify(self, req: BlockRequest) -> None:
        """Raise AuthFailed unless the MAC matches and (ts, nonce) is fresh and not a replay."""
        if len(req.hmac) != hashlib.sha256().digest_size or not hmac.compare_digest(req.hmac, self.sign(req)):
            raise AuthFailed("bad request MAC")
        now = self._clock()
        if abs(now - req.ts_ms) > self._window_ms:
            raise AuthFailed("request timestamp outside the replay window")
        if len(req.nonce) < NONCE_BYTES:
            raise AuthFailed("nonce too short")
        self._forget_before(now - self._window_ms)
        if req.nonce in self._seen:
            raise AuthFailed("replayed nonce")
        self._seen[req.nonce] = req.ts_ms
        while len(self._seen) > self._max_nonces:
            self._seen.popitem(last=False)

    def _forget_before(self, cutoff_ms: int) -> None:
        # Insertion order is arrival order; ts can be a little out of order, which only keeps a few
        # nonces longer than needed.
        while self._seen:
            nonce, ts = next(iter(self._seen.items()))
            if ts >= cutoff_ms:
                break
            del self._seen[nonce]
