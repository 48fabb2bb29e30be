"""The errors the producer SDK raises on purpose (all KvmeshErrors; ``retriable`` says whether trying
again may help)."""

from __future__ import annotations

from kvmesh_core.errors import KvmeshError


class ClientError(KvmeshError):
    """Base of the errors the producer SDK raises on purpose."""


class RequestTimeout(ClientError):
    """No Completion arrived for a request within the caller's timeout."""

    retriable = True


class PublishTimeout(ClientError):
    """The broker did not take a request within the client's publish timeout (it is down or stuck)."""


class RequestClosed(ClientError):
    """The handle was cancelled or closed before its Completion arrived."""
