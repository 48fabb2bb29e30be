"""``kvmesh worker`` / ``python -m services.worker``: wiring only.

Flags are the settings' field names (``--worker-id``, ``--engine``, ``--model``,
``--kafka.bootstrap-servers``, ``--metrics-port``, ...); ``--help`` lists them all.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from kvmesh_core.runtime import run_service
    from services.worker.config import WorkerSettings
    from services.worker.errors import ModelConfigError
    from services.worker.service import WorkerService

    # A model or engine that cannot load is the operator's to fix: say what, exit 2, no traceback.
    return run_service("kvmesh worker", WorkerSettings, WorkerService, argv, fatal=(ModelConfigError,))


if __name__ == "__main__":
    sys.exit(main())
