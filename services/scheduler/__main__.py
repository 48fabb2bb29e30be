"""``kvmesh scheduler``: run one scheduler replica until SIGINT/SIGTERM (wiring only).

Flags are the settings' field names (``--policy``, ``--scheduler-id``, ``--kafka.bootstrap-servers``,
``--redis.url``, ``--no-use-snapshot``, ``--metrics-port``, ...); ``--help`` lists them all.
"""

from __future__ import annotations

import sys

from kvmesh_core.runtime import run_service
from services.scheduler.config import SchedulerSettings
from services.scheduler.service import SchedulerService


def main(argv: list[str] | None = None) -> int:
    return run_service("kvmesh scheduler", SchedulerSettings, SchedulerService, argv)


if __name__ == "__main__":
    sys.exit(main())
