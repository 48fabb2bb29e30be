"""``kvmesh worker`` / ``python -m services.worker``: wiring only."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh worker", description="Run one kvmesh worker.")
    parser.add_argument("--worker-id", help="overrides KVMESH_WORKER_WORKER_ID")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (overrides the settings)")
    parser.add_argument("--log-level", default=os.environ.get("KVMESH_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)

    from kvmesh.runtime import configure_logging, serve_until_signalled
    from services.worker.config import WorkerSettings
    from services.worker.service import WorkerService

    configure_logging(args.log_level)

    overrides: dict[str, object] = {}
    if args.worker_id:
        overrides["worker_id"] = args.worker_id
    settings = WorkerSettings(**overrides)  # type: ignore[arg-type]
    if args.bootstrap:
        settings.kafka.bootstrap_servers = args.bootstrap
    asyncio.run(serve_until_signalled(WorkerService(settings)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
