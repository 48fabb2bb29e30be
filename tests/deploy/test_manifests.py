"""deploy/k8s: one manifest per service, and every environment variable they set is a setting that
service reads (a misspelt variable is silently ignored at run time, so it is caught here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from settings_env import reads

from services.intake.config import IntakeSettings
from services.kvmanager.config import KvManagerSettings
from services.scheduler.config import SchedulerSettings
from services.worker.config import WorkerSettings

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
SETTINGS: dict[str, tuple[Any, str]] = {
    "intake": (IntakeSettings, "KVMESH_INTAKE_"),
    "scheduler": (SchedulerSettings, "KVMESH_SCHEDULER_"),
    "kvmanager": (KvManagerSettings, "KVMESH_KVMANAGER_"),
    "worker": (WorkerSettings, "KVMESH_WORKER_"),
}
#: Read outside a service's own prefix: the log level every service falls back to.
SHARED = {"KVMESH_LOG_LEVEL"}


def _containers() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in spec.get("containers", []):
                cmd = c.get("command") or []
                if cmd[:1] == ["kvmesh"]:
                    out.append((cmd[1], c))
    return out


def test_one_manifest_per_service() -> None:
    assert sorted(name for name, _ in _containers()) == sorted(SETTINGS)


def test_every_variable_is_a_setting_of_its_service() -> None:
    for service, container in _containers():
        cls, prefix = SETTINGS[service]
        for env in container.get("env", []):
            name = env["name"]
            assert name in SHARED or reads(cls, prefix, name), f"{service}: {name} is read by nothing"
            if env["name"].endswith("KAFKA__PARTITIONS"):
                counts = json.loads(env["value"])
                assert all(isinstance(n, int) and n > 0 for n in counts.values())


def test_the_check_refuses_a_misspelt_variable() -> None:
    assert not reads(SchedulerSettings, "KVMESH_SCHEDULER_", "KVMESH_SCHEDULER_POLICI")
    assert not reads(SchedulerSettings, "KVMESH_SCHEDULER_", "KVMESH_SCHEDULER_KAFKA__BOOTSTRAP")
    assert reads(SchedulerSettings, "KVMESH_SCHEDULER_", "KVMESH_SCHEDULER_KAFKA__BOOTSTRAP_SERVERS")
