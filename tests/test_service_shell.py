"""The service shell every service runs in: the same flags everywhere (flags over env over defaults),
bad settings refused with exit 2, ``/metrics`` served and stopped, and a start that rolls back."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from kvmesh_core.runtime import (
    MetricsServer,
    ShellSettings,
    load_settings,
    rolled_back_on_failure,
    run_service,
)
from services.intake.config import IntakeSettings
from services.kvmanager.config import KvManagerSettings
from services.scheduler.__main__ import main as scheduler_main
from services.scheduler.config import SchedulerSettings
from services.worker.config import WorkerSettings

SERVICES: list[tuple[type[ShellSettings], str]] = [
    (WorkerSettings, "WORKER"),
    (SchedulerSettings, "SCHEDULER"),
    (KvManagerSettings, "KVMANAGER"),
    (IntakeSettings, "INTAKE"),
]


@pytest.mark.parametrize(("cls", "prefix"), SERVICES)
def test_every_service_takes_the_same_flags_over_its_environment(
    cls: type[ShellSettings], prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVMESH_WORKER_INSECURE_DEV_TRANSFER", "1")
    monkeypatch.setenv(f"KVMESH_{prefix}_METRICS_PORT", "9100")
    monkeypatch.setenv(f"KVMESH_{prefix}_LOG_LEVEL", "WARNING")
    from_env = load_settings(cls, [], "t")
    assert (from_env.metrics_port, from_env.log_level) == (9100, "WARNING")
    argv = ["--kafka.bootstrap-servers", "127.0.0.1:1", "--log-level", "DEBUG", "--metrics-port", "0"]
    s = load_settings(cls, argv, "t")
    assert (s.metrics_port, s.log_level, s.metrics_host) == (0, "DEBUG", "127.0.0.1")
    assert s.kafka.bootstrap_servers == "127.0.0.1:1"  # type: ignore[attr-defined]


def test_service_specific_flags_and_the_global_log_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_WORKER_INSECURE_DEV_TRANSFER", "1")
    monkeypatch.setenv("KVMESH_LOG_LEVEL", "ERROR")
    s = load_settings(SchedulerSettings, ["--policy", "prefix_aware", "--no-use-snapshot"], "t")
    assert (s.policy, s.use_snapshot, s.log_level) == ("prefix_aware", False, "ERROR")
    k = load_settings(KvManagerSettings, ["--liveness-timeout-ms", "900", "--manager-id", "m2"], "t")
    assert (k.liveness_timeout_ms, k.manager_id) == (900, "m2")
    w = load_settings(WorkerSettings, ["--worker-id", "w9", "--engine", "builtin"], "t")
    assert (w.worker_id, w.engine) == ("w9", "builtin")


def test_bad_settings_exit_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert scheduler_main(["--policy", "random"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert scheduler_main(["--metrics-port", "70000"]) == 2
    assert scheduler_main(["--no-such-flag", "1"]) == 2


def test_metrics_server_serves_its_registry_and_stops_twice() -> None:
    registry = CollectorRegistry()
    Counter("kvmesh_test_things", "Things.", registry=registry).inc(3)
    server = MetricsServer(registry)
    url = server.start("127.0.0.1", 0)
    assert server.start("127.0.0.1", 0) == url  # a second start is a no-op
    body = httpx.get(url, timeout=5).text
    assert "kvmesh_test_things_total 3.0" in body
    server.stop()
    server.stop()
    with pytest.raises(httpx.HTTPError):
        httpx.get(url, timeout=2)


class _Parts:
    """A service whose start opens two parts and fails at the third."""

    def __init__(self) -> None:
        self.open: list[str] = []
        self.stops = 0

    async def stop(self) -> None:
        self.stops += 1
        self.open.clear()

    async def start(self) -> None:
        async with rolled_back_on_failure(self.stop):
            self.open += ["producer", "consumer"]
            raise ConnectionError("broker unreachable")


def test_a_failed_start_closes_what_it_opened_and_the_error_goes_on() -> None:
    svc = _Parts()
    with pytest.raises(ConnectionError, match="unreachable"):
        asyncio.run(svc.start())
    assert svc.open == [] and svc.stops == 1


def test_run_service_serves_metrics_until_signalled(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_service wires settings, logging, /metrics and the signal; SIGTERM stops it cleanly."""
    import os
    import signal

    seen: dict[str, object] = {}

    class Svc:
        def __init__(self, settings: KvManagerSettings) -> None:
            self.registry = CollectorRegistry()
            Counter("kvmesh_kvmanager_probe", "Probe.", registry=self.registry).inc()
            self.settings = settings

        async def start(self) -> None:
            seen["started"] = True

            async def scrape_then_signal() -> None:
                await asyncio.sleep(0.2)
                port = self.settings.metrics_port
                assert port is not None
                seen["body"] = await asyncio.to_thread(_scrape_any, port)
                os.kill(os.getpid(), signal.SIGTERM)

            seen["task"] = asyncio.get_running_loop().create_task(scrape_then_signal())

        async def stop(self) -> None:
            seen["stopped"] = True

    port = _free_port()
    code = run_service("t", KvManagerSettings, Svc, ["--metrics-port", str(port)])
    assert code == 0 and seen["started"] and seen["stopped"]
    assert "kvmesh_kvmanager_probe_total 1.0" in str(seen["body"])


def _free_port() -> int:
    from streams.embedded import free_port

    return free_port()


def _scrape_any(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
