"""kvmesh_core.runtime.tune_gc: what every long-running service does to its collector once started."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import gc, json
from kvmesh_core.runtime import GC_GEN0_THRESHOLD, tune_gc
before = gc.get_threshold()
keep = [[i] for i in range(1000)]  # alive at start: must end up frozen
tune_gc()
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": gc.get_freeze_count(),
                  "expected": GC_GEN0_THRESHOLD}))
"""


def test_tune_gc_freezes_startup_objects_and_raises_gen0() -> None:
    # In a child process: freezing the test runner's own heap would outlive this test.
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["after"][0] == got["expected"] > got["before"][0]
    assert got["after"][1:] == got["before"][1:]  # older generations keep their thresholds
    assert got["frozen"] >= 1000
