"""``kvmesh intake`` / ``python -m services.intake``: wiring only."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvmesh intake", description="Run the OpenAI-compatible HTTP intake."
    )
    parser.add_argument("--host", help="bind address (default KVMESH_INTAKE_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default KVMESH_INTAKE_PORT or 8000)")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (overrides the settings)")
    parser.add_argument("--log-level", default=os.environ.get("KVMESH_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)

    import uvicorn

    from kvmesh.runtime import configure_logging
    from services.intake.app import create_app
    from services.intake.config import IntakeSettings

    configure_logging(args.log_level)
    settings = IntakeSettings()
    if args.host:
        settings.host = args.host
    if args.port is not None:
        settings.port = args.port
    if args.bootstrap:
        settings.kafka.bootstrap_servers = args.bootstrap
    # log_config=None keeps our logging format; access logs carry no headers, so no keys.
    uvicorn.run(
        create_app(settings, tune_gc_on_start=True),
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=args.log_level.lower(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
