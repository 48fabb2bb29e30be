"""Static checks of compose/docker-compose.yml (no Docker engine needed).

Every kvmesh service runs a command that `kvmesh` knows, passes only environment variables its
settings class reads, and publishes ports on 127.0.0.1 only.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings
from settings_env import reads

from kvmesh.cli import COMMANDS

COMPOSE = Path(__file__).resolve().parents[2] / "compose" / "docker-compose.yml"

#: kvmesh command → (settings class, env prefix). Prefix convention: KVMESH_<SERVICE>_, nested "__".
SETTINGS: dict[str, tuple[str, str]] = {
    "intake": ("services.intake.config:IntakeSettings", "KVMESH_INTAKE_"),
    "scheduler": ("services.scheduler.config:SchedulerSettings", "KVMESH_SCHEDULER_"),
    "kvmanager": ("services.kvmanager.config:KvManagerSettings", "KVMESH_KVMANAGER_"),
    "worker": ("services.worker.config:WorkerSettings", "KVMESH_WORKER_"),
}

#: Variables read outside the settings classes (argparse defaults, field aliases).
EXTRA_VARS = {"KVMESH_LOG_LEVEL"}


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def _kvmesh_services() -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in _compose()["services"].items()
        if (svc.get("command") or [None])[0] == "kvmesh"
    }


def _env(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _load(path: str) -> type[BaseSettings]:
    module, _, cls = path.partition(":")
    try:
        return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"{path} does not exist yet ({exc})")


def test_compose_parses_and_has_the_stack() -> None:
    services = _compose()["services"]
    assert {"kafka", "redis", "intake", "scheduler", "kvmanager"} <= set(services)
    workers = [n for n, s in services.items() if s.get("command") == ["kvmesh", "worker"]]
    assert len(workers) == 2
    assert services["kafka"]["image"].startswith("apache/kafka")
    assert "broker,controller" in services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]  # KRaft
    for name, svc in services.items():
        assert "healthcheck" in svc, f"{name} has no health check"
    # One image for every kvmesh service.
    builds = {repr(s.get("build")) for s in _kvmesh_services().values()}
    assert len(builds) == 1
    assert (COMPOSE.parent / "Dockerfile").read_text().startswith("#")


def test_every_service_runs_a_known_kvmesh_command() -> None:
    services = _kvmesh_services()
    assert len(services) == 5
    for name, svc in services.items():
        cmd = svc["command"]
        assert cmd[1] in COMMANDS, f"{name}: kvmesh {cmd[1]} is not a command"
        assert cmd[1] in SETTINGS


@pytest.mark.parametrize("command", sorted(SETTINGS))
def test_env_vars_are_settings_fields(command: str) -> None:
    path, prefix = SETTINGS[command]
    cls = _load(path)
    services = {n: s for n, s in _kvmesh_services().items() if s["command"][1] == command}
    assert services
    for name, svc in services.items():
        env = _env(svc)
        assert env, f"{name} passes no settings"
        for var in env:
            if not var.startswith("KVMESH_") or var in EXTRA_VARS:
                continue
            assert reads(cls, prefix, var), f"{name}: {var} is not read by {cls.__name__}"


def test_env_var_check_rejects_unknown_names() -> None:
    from services.intake.config import IntakeSettings

    assert reads(IntakeSettings, "KVMESH_INTAKE_", "KVMESH_INTAKE_KAFKA__BOOTSTRAP_SERVERS")
    assert reads(IntakeSettings, "KVMESH_INTAKE_", "KVMESH_API_KEYS")
    assert not reads(IntakeSettings, "KVMESH_INTAKE_", "KVMESH_INTAKE_KAFKA__NOPE")
    assert not reads(IntakeSettings, "KVMESH_INTAKE_", "KVMESH_INTAKE_BOGUS")
    assert not reads(IntakeSettings, "KVMESH_INTAKE_", "KVMESH_SCHEDULER_POLICY")


def test_host_ports_bind_loopback_only() -> None:
    published = 0
    for name, svc in _compose()["services"].items():
        for port in svc.get("ports") or []:
            if isinstance(port, dict):
                assert port.get("host_ip") == "127.0.0.1", f"{name}: {port}"
            else:
                assert str(port).startswith("127.0.0.1:"), f"{name}: {port} is not bound to 127.0.0.1"
            published += 1
    assert published >= 1


def test_secrets_come_from_the_environment_not_the_file() -> None:
    for name, svc in _kvmesh_services().items():
        for var, value in _env(svc).items():
            if any(s in var for s in ("SECRET", "PASSWORD", "API_KEYS")):
                assert value.startswith("${"), f"{name}: {var} is hard-coded"
