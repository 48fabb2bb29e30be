"""Errors of the simulator."""

from kvmesh_core.errors import KvmeshError


class SimError(KvmeshError):
    """Base of the simulator's errors: a bad configuration or an unknown policy or profile."""
