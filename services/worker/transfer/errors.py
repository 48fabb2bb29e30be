"""Errors of the data plane (block server, block client, fleet authentication).

Faults of a transfer (a dead peer, a corrupt block, a refused request) are *results*, not errors:
``BlockClient.fetch`` returns them in its ``FetchResult``. These classes are raised only for misuse
(a missing fleet secret, a server used before ``start``) and, inside the package, to carry a fault from
the frame reader to the place that turns it into a result.
"""

from __future__ import annotations

from kvmesh_core.errors import KvmeshError


class TransferError(KvmeshError):
    """Base of every error the transfer package raises on purpose."""


class InsecureSecret(TransferError):
    """The fleet secret is empty and the explicit insecure dev flag is not set."""


class AuthFailed(TransferError):
    """A request's HMAC, timestamp or nonce did not pass fleet authentication."""


class FrameError(TransferError):
    """Bytes on the wire that are not a valid frame (bad magic, bad length, malformed request)."""

    retriable = True


class ServerNotStarted(TransferError):
    """The block server was asked for its address before ``start()``."""
