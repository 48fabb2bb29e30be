"""The service shell every ``__main__`` shares: settings from flags and the environment, one logging
setup, ``/metrics``, and running a service until SIGINT/SIGTERM, then stopping it cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry, start_http_server
from pydantic import Field
from pydantic_settings import BaseSettings, CliSettingsSource, SettingsError

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


# ---- the service shell: settings, logging, metrics, start/stop ---------------------------------------


class ShellSettings(BaseSettings):
    """What every service reads the same way, under its own env prefix (``KVMESH_WORKER_LOG_LEVEL``, ...)
    and the same flags (``--log-level``, ``--metrics-host``, ``--metrics-port``)."""

    #: Falls back to ``KVMESH_LOG_LEVEL``, which ``kvmesh dev`` sets for the whole stack.
    log_level: str = Field(default_factory=lambda: os.environ.get("KVMESH_LOG_LEVEL", "INFO"))
    #: Where ``/metrics`` is served (Prometheus text format). None: no metrics server; 0: any free port.
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(default=None, ge=0, le=65535)


S = TypeVar("S", bound=BaseSettings)


def load_settings(cls: type[S], argv: Sequence[str] | None, prog: str) -> S:
    """``cls`` from flags over the environment over defaults. Flags are the field names in kebab case,
    nested with dots (``--kafka.bootstrap-servers``, ``--metrics-port``), the same in every service."""
    source: CliSettingsSource[S] = CliSettingsSource(
        cls,
        cli_prog_name=prog,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_exit_on_error=False,
    )
    args = list(sys.argv[1:] if argv is None else argv)
    return cls(_cli_settings_source=source(args=args))


class MetricsServer:
    """``/metrics`` of one registry on its own port (prometheus_client's threaded server).

    Owns the server; ``url`` is set while it runs. ``stop()`` is safe twice.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.url: str | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self, host: str, port: int) -> str:
        if self.url is not None:
            return self.url
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        bound = self._server.server_port
        self.url = f"http://{host}:{bound}/metrics"
        logging.getLogger("kvmesh").info("metrics on %s", self.url)
        return self.url

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        self.url = None


class MeteredService(Service, Protocol):
    @property
    def registry(self) -> CollectorRegistry:
        """The registry the service's metrics live in (one per service instance)."""
        ...


@contextlib.asynccontextmanager
async def rolled_back_on_failure(stop: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
    """Run a ``start()``'s steps; if one fails, ``stop()`` closes what the earlier ones opened, and the
    error goes on. ``stop`` must cope with a half-started service (every service's does)."""
    try:
        yield
    except BaseException:
        try:
            await stop()
        except Exception:  # the start's own error is the one to report
            logging.getLogger("kvmesh").exception("rolling back a failed start")
        raise


async def serve_metered(service: MeteredService, settings: ShellSettings) -> None:
    """:func:`serve_until_signalled` with ``/metrics`` served while the service runs."""
    metrics = MetricsServer(service.registry)
    if settings.metrics_port is not None:
        metrics.start(settings.metrics_host, settings.metrics_port)
    try:
        await serve_until_signalled(service)
    finally:
        metrics.stop()


def run_service(
    prog: str,
    settings_cls: type[S],
    make: Callable[[S], MeteredService],
    argv: Sequence[str] | None = None,
    fatal: tuple[type[Exception], ...] = (),
) -> int:
    """A service's ``main``: settings (flags > env > defaults), logging, serve until a signal.

    Bad settings exit 2 with the reason; so does an exception of a ``fatal`` type (an operator's
    error such as a model that cannot load), logged without a traceback.
    """
    try:
        settings = load_settings(settings_cls, argv, prog)
    except (ValueError, SettingsError) as exc:
        sys.stderr.write(f"{prog}: bad settings: {exc}\n")
        return 2
    assert isinstance(settings, ShellSettings)
    configure_logging(settings.log_level.upper())
    try:
        asyncio.run(serve_metered(make(settings), settings))
    except fatal as exc:
        logging.getLogger("kvmesh").error("%s cannot start: %s", prog, exc)
        return 2
    return 0
