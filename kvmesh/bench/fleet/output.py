"""The benchmark's table and JSON object."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh.bench.fleet.run import PolicyRun
from kvmesh.workloads import Workload

_COLUMNS = (
    ("ttft_p50_s", "p50 s"),
    ("ttft_p90_s", "p90 s"),
    ("ttft_p99_s", "p99 s"),
    ("e2e_p50_s", "e2e p50"),
    ("throughput_rps", "req/s"),
    ("reused_token_fraction", "reused"),
    ("fetched_token_fraction", "fetched"),
    ("recomputed_token_fraction", "recomp"),
    ("busy_fraction_mean", "busy"),
    ("busy_fraction_spread", "spread pt"),
)


def format_table(summaries: dict[str, dict[str, Any]]) -> str:
    """One row per policy of the headline figures."""
    lines = [f"{'policy':<17}" + "".join(f"{h:>10}" for _, h in _COLUMNS) + f"{'errors':>8}"]
    for name, s in summaries.items():
        row = "".join(f"{float(s[k]):>10.3f}" for k, _ in _COLUMNS)
        lines.append(f"{name:<17}{row}{int(s.get('errors', 0)):>8}")
    return "\n".join(lines)


def build_output(workload: Workload, runs: Sequence[PolicyRun], workers: int | None) -> dict[str, Any]:
    """The JSON object of a benchmark run."""
    return {
        "bench": "fleet",
        "workload": workload.name,
        "workload_params": workload.params,
        "requests": workload.requests,
        "workers": workers,
        "policies": {run.policy: run.summary() for run in runs},
    }
