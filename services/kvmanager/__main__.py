"""``kvmesh kvmanager``: run the KV manager (directory, liveness, placement) until SIGINT/SIGTERM.

Flags are the settings' field names (``--manager-id``, ``--liveness-timeout-ms``,
``--kafka.bootstrap-servers``, ``--redis.url``, ``--metrics-port``, ...); ``--help`` lists them all.
"""

from __future__ import annotations

import sys

from kvmesh_core.runtime import run_service
from services.kvmanager.config import KvManagerSettings
from services.kvmanager.replica import KvManagerReplica
from services.kvmanager.service import KvManagerService


def make_manager(settings: KvManagerSettings) -> KvManagerService:
    """The one manager, or a replica when ``sharded`` is set."""
    return KvManagerReplica(settings) if settings.sharded else KvManagerService(settings)


def main(argv: list[str] | None = None) -> int:
    return run_service("kvmesh kvmanager", KvManagerSettings, make_manager, argv)


if __name__ == "__main__":
    sys.exit(main())
