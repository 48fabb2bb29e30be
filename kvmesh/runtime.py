"""Running a service until SIGINT/SIGTERM, then stopping it cleanly (shared by every ``__main__``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Protocol


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def serve_until_signalled(service: Service) -> None:
    """Start ``service``, wait for SIGINT or SIGTERM, stop it. A second signal is not needed."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await service.start()
    try:
        await stop.wait()
    finally:
        logging.getLogger("kvmesh").info("signal received: stopping")
        await service.stop()


def configure_logging(level: str = "INFO", prefix: str = "") -> None:
    """One log format for every service; ``prefix`` names the service in a shared terminal."""
    fmt = f"%(asctime)s {prefix + ' ' if prefix else ''}%(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt)
