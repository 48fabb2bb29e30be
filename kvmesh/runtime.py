"""Running a service until SIGINT/SIGTERM, then stopping it cleanly (shared by every ``__main__``)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from typing import Protocol

#: Allocations of tracked objects between young collections in a running service (CPython's default: 700).
GC_GEN0_THRESHOLD = 50_000


def tune_gc(gen0: int = GC_GEN0_THRESHOLD) -> None:
    """Collector settings for a long-running service, once it has started.

    Everything alive now (modules, settings, loaded state) lives as long as the process: ``freeze``
    keeps it out of every later collection. A service's hot loop allocates a few tracked objects per
    record (the decoded dict, the message, its envelope) that die by reference counting a moment
    later; with the default threshold of 700 they set off a young collection every ~100 records and,
    through them, full walks of a large heap, which measurably cost throughput and tail latency (see
    ``kvmesh bench streams`` / ``kvmanager``). Cyclic garbage still gets collected, just in larger rounds.
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0, gen1, gen2)


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
    tune_gc()
    try:
        await stop.wait()
    finally:
        logging.getLogger("kvmesh").info("signal received: stopping")
        await service.stop()


def configure_logging(level: str = "INFO", prefix: str = "") -> None:
    """One log format for every service; ``prefix`` names the service in a shared terminal."""
    fmt = f"%(asctime)s {prefix + ' ' if prefix else ''}%(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt)
