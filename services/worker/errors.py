"""Errors the worker raises on purpose; all derive from :class:`WorkerError`."""

from __future__ import annotations

from kvmesh_core.errors import KvmeshError


class WorkerError(KvmeshError):
    """Base of every worker error."""


class ModelConfigError(WorkerError):
    """A model name, config or checkpoint that cannot be built or loaded."""


class CheckpointError(ModelConfigError):
    """A local checkpoint directory that is missing files or holds tensors of the wrong shape."""


class RequestRejected(WorkerError):
    """A request the engine will not run (too long, empty, malformed). Retrying it unchanged won't help."""


class BlockSizeMismatch(WorkerError):
    """Bytes handed to the KV cache that are not whole blocks of this worker's layout."""
