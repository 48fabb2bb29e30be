"""``kvmesh bench chaos`` at a small scale: every fault is a SIGKILL and a restart of a real process,
and the run's JSON line reports no lost, duplicated or wrong request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.bench import chaos

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_fault_plan_is_seeded_and_covers_every_part() -> None:
    assert chaos.fault_plan(False, 3) == chaos.fault_plan(False, 3)
    plan = chaos.fault_plan(True, 3)
    assert {"scheduler", "kvmanager", "redis", "broker", "object_store"} <= set(plan) and len(plan) == 6
    assert not {"broker", "object_store"} & set(chaos.fault_plan(False, 3))


def test_a_small_chaos_run_loses_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "timeline.png"
    argv = ["--users", "2", "--turns", "10", "--think-s", "0.5", "--down-s", "1.5", "--every-s", "2.5"]
    rc = chaos.main([*argv, "--plot", str(png), "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["sent"] == 20 and report["reference_completed"] == 20
    assert report["lost"] == 0 and report["duplicated"] == 0 and report["wrong_output"] == 0, report
    assert report["completed"] + report["failed_retriable"] == 20
    assert [f["component"] for f in report["faults"]] and all(
        f["restarted_s"] > f["killed_s"] for f in report["faults"]
    )
    assert png.stat().st_size > 10_000
    assert rc == (0 if report["completed_ratio"] >= 0.95 else 1)
