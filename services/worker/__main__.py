"""``kvmesh worker`` / ``python -m services.worker``: wiring only."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh worker", description="Run one kvmesh worker.")
    parser.add_argument("--worker-id", help="overrides KVMESH_WORKER_WORKER_ID")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (overrides the settings)")
    parser.add_argument("--engine", choices=["builtin", "vllm"], help="overrides KVMESH_WORKER_ENGINE")
    parser.add_argument("--model", help="a built-in size or a local model directory (KVMESH_WORKER_MODEL)")
    parser.add_argument("--log-level", default=os.environ.get("KVMESH_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)

    from kvmesh.runtime import configure_logging, serve_until_signalled
    from services.worker.config import WorkerSettings
    from services.worker.errors import ModelConfigError
    from services.worker.service import WorkerService

    configure_logging(args.log_level)

    overrides: dict[str, object] = {}
    if args.worker_id:
        overrides["worker_id"] = args.worker_id
    if args.engine:
        overrides["engine"] = args.engine
    if args.model:
        overrides["model"] = args.model
    settings = WorkerSettings(**overrides)  # type: ignore[arg-type]
    if args.bootstrap:
        settings.kafka.bootstrap_servers = args.bootstrap
    try:
        asyncio.run(serve_until_signalled(WorkerService(settings)))
    except ModelConfigError as e:
        # A model or engine that cannot load is the operator's to fix: say what, exit non-zero, no trace.
        logging.getLogger("kvmesh.worker").error("worker %s cannot start: %s", settings.worker_id, e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
