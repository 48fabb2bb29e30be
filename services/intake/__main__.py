"""``kvmesh intake`` / ``python -m services.intake``: wiring only.

Flags are the settings' field names (``--host``, ``--port``, ``--kafka.bootstrap-servers``,
``--log-level``, ...); ``--help`` lists them all. ``/metrics`` is served on the API's port.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    import uvicorn
    from pydantic_settings import SettingsError

    from kvmesh_core.runtime import configure_logging, load_settings
    from services.intake.app import create_app
    from services.intake.config import IntakeSettings

    try:
        settings = load_settings(IntakeSettings, argv, "kvmesh intake")
    except (ValueError, SettingsError) as exc:
        sys.stderr.write(f"kvmesh intake: bad settings: {exc}\n")
        return 2
    configure_logging(settings.log_level.upper())
    # log_config=None keeps our logging format; access logs carry no headers, so no keys.
    uvicorn.run(
        create_app(settings, tune_gc_on_start=True),
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level.lower(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
