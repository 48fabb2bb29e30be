"""Errors of the replay tools."""

from kvmesh_core.errors import KvmeshError


class ReplayError(KvmeshError):
    """A recording cannot be replayed: no requests in it, a bad override, an unreadable source."""
