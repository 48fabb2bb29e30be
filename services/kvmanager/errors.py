"""Errors of the KV manager (directory, liveness, placement, service)."""

from __future__ import annotations

from kvmesh_core.errors import KvmeshError


class KvManagerError(KvmeshError):
    """Base of every error the KV manager raises on purpose."""


class DirectoryUnavailable(KvManagerError):
    """Redis could not be reached; the manager keeps its state in memory and retries."""

    retriable = True


class SnapshotConflict(KvManagerError):
    """A consistent snapshot could not be read because the directory kept changing under it."""

    retriable = True
