"""The live fleet benchmark's own error."""

from __future__ import annotations

from kvmesh_core.errors import KvmeshError


class FleetBenchError(KvmeshError):
    """The live benchmark cannot run as asked (bad arguments, a stack that never answers)."""
