"""deploy/k8s: one manifest per service, and every environment variable they set is a setting that
service reads (a misspelt variable is silently ignored at run time, so it is caught here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

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


def _aliases(cls: Any) -> set[str]:
    names: set[str] = set()
    for f in cls.model_fields.values():
        alias = f.validation_alias
        choices = getattr(alias, "choices", None) or ([alias] if isinstance(alias, str) else [])
        names.update(c for c in choices if isinstance(c, str) and c.isupper())
    return names


def reads(cls: Any, prefix: str, var: str) -> bool:
    """Whether settings ``cls`` reads ``var`` (``PREFIX + FIELD``, nested with ``__``, or an alias)."""
    if var in _aliases(cls) or var in SHARED:
        return True
    if not var.startswith(prefix):
        return False
    model: Any = cls
    parts = var[len(prefix) :].lower().split("__")
    for i, part in enumerate(parts):
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return False
        if i < len(parts) - 1:
            model = fields[part].annotation
    return True


def test_one_manifest_per_service() -> None:
    assert sorted(name for name, _ in _containers()) == sorted(SETTINGS)


def test_every_variable_is_a_setting_of_its_service() -> None:
    for service, container in _containers():
        cls, prefix = SETTINGS[service]
        for env in container.get("env", []):
            assert reads(cls, prefix, env["name"]), f"{service}: {env['name']} is read by nothing"
            if env["name"].endswith("KAFKA__PARTITIONS"):
                counts = json.loads(env["value"])
                assert all(isinstance(n, int) and n > 0 for n in counts.values())


def test_the_check_refuses_a_misspelt_variable() -> None:
    assert not reads(SchedulerSettings, "KVMESH_SCHEDULER_", "KVMESH_SCHEDULER_POLICI")
    assert not reads(SchedulerSettings, "KVMESH_SCHEDULER_", "KVMESH_SCHEDULER_KAFKA__BOOTSTRAP")
    assert reads(SchedulerSettings, "KVMESH_SCHEDULER_", "KVMESH_SCHEDULER_KAFKA__BOOTSTRAP_SERVERS")
