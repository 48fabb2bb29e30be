"""``kvmesh simulate --time-scales ... --seeds N``: a sweep row over seeds of engine noise
(kvmesh.sim.seeds), its medians, each seed's figures and the goal's tally."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from sim_helpers import tiny_trace

from kvmesh.sim.__main__ import main
from kvmesh.sim.peer_goal import peer_goal
from kvmesh.sim.plots import _seed_spans
from kvmesh.sim.seeds import SEED_NOISE, goal_tally, median_figures, seeded_truths
from kvmesh.sim.truth import TruthScale

POLICIES = ("kvmesh", "dynamo", "llm_d", "sglang")


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _without_wall(sweep: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sweep with each run's wall time left out (the only figure that is not deterministic)."""
    rows = json.loads(json.dumps(sweep))
    for row in rows:
        for s in row["policies"].values():
            s.pop("wall_s")
    return rows


def test_seeded_truths_add_noise_only_where_the_truth_has_none() -> None:
    drift = TruthScale(prefill=1.3)
    assert seeded_truths(drift, 0) == [drift]
    three = seeded_truths(drift, 3)
    assert [t.seed for t in three] == [1, 2, 3]
    assert all(t.noise == SEED_NOISE and t.prefill == 1.3 for t in three)
    noisy = TruthScale(noise=0.1, seed=9)
    assert [(t.noise, t.seed) for t in seeded_truths(noisy, 2)] == [(0.1, 1), (0.1, 2)]


def test_median_figures_takes_numbers_and_keeps_the_rest() -> None:
    samples = [
        {"policy": "kvmesh", "ttft_p50_s": 3.0, "requests": 10, "flag": True},
        {"policy": "kvmesh", "ttft_p50_s": 1.0, "requests": 10, "flag": False},
        {"policy": "kvmesh", "ttft_p50_s": 2.0, "requests": 12, "flag": False},
    ]
    m = median_figures(samples)
    assert m == {"policy": "kvmesh", "ttft_p50_s": 2.0, "requests": 10, "flag": True}


def test_goal_tally_counts_the_seeds_where_the_goal_held() -> None:
    digests = [
        {"seed": 1, "peer_goal": {"met": True, "p50_ratio": 0.3, "p99_ratio": 0.2}},
        {"seed": 2, "peer_goal": {"met": False, "p50_ratio": 0.4, "p99_ratio": 0.2}},
    ]
    assert goal_tally(digests) == {"met": 1, "of": 2, "p50_ratios": [0.3, 0.4], "p99_ratios": [0.2, 0.2]}
    assert goal_tally([{"seed": 1}]) is None


def test_a_seeded_sweep_reports_medians_each_seed_and_the_tally(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tiny_trace(tmp_path / "trace.jsonl", 120)
    argv = ["--trace", str(trace), "--workers", "3", "--policies", ",".join(POLICIES)]
    argv += ["--time-scales", "0.05", "--json", "--no-progress"]
    out = _run([*argv, "--seeds", "3", "--plot", str(tmp_path / "plots")], capsys)
    assert out["seeds"] == 3
    assert (tmp_path / "plots" / "time_scale_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    row = out["sweep"][0]
    assert [d["seed"] for d in row["seeds"]] == [1, 2, 3]
    for p in POLICIES:
        for key in ("ttft_p50_s", "ttft_p99_s"):
            per_seed = [d["policies"][p][key] for d in row["seeds"]]
            assert row["policies"][p][key] == statistics.median(per_seed)
        assert row["policies"][p]["ttft_p99_excess_s"] == pytest.approx(
            max(row["policies"][p]["ttft_p99_s"] - row["bound"]["ttft_p99_s"], 0.0)
        )
    bounds = [d["bound"]["ttft_p50_s"] for d in row["seeds"]]
    assert row["bound"]["ttft_p50_s"] == statistics.median(bounds)
    assert len(set(bounds)) > 1  # each seed's noise moves the bound: the seeds differ
    assert row["peer_goal"] == peer_goal(row["policies"], row["bound"])
    tally = row["peer_goal_seeds"]
    assert tally["of"] == 3
    assert tally["met"] == sum(1 for d in row["seeds"] if d["peer_goal"]["met"])

    # The same figures whether the runs go one at a time or in two processes, and a seeded row is
    # the single run under that seed's truth.
    parallel = _run([*argv, "--seeds", "3", "--jobs", "2"], capsys)["sweep"]
    assert _without_wall(parallel) == _without_wall(out["sweep"])
    single = _run([*argv, "--truth-scale", f"noise={SEED_NOISE},seed=2"], capsys)
    for p in POLICIES:
        assert single["sweep"][0]["policies"][p]["ttft_p99_s"] == row["seeds"][1]["policies"][p]["ttft_p99_s"]
    assert "seeds" not in single["sweep"][0] and single["seeds"] == 0


def test_the_plot_spans_each_scale_over_its_seeds() -> None:
    def row(scale: float, p99s: list[float]) -> dict[str, Any]:
        seeds = [{"policies": {"kvmesh": {"ttft_p99_s": v}}} for v in p99s]
        return {"time_scale": scale, "policies": {"kvmesh": {}}, "seeds": seeds}

    rows = [row(0.25, [9.3, 11.1, 10.6]), row(1.0, [6.5, 6.4])]
    assert _seed_spans(rows, "kvmesh", "ttft_p99_s") == ([9.3, 6.4], [11.1, 6.5])
    assert _seed_spans([{"time_scale": 1.0, "policies": {}}], "kvmesh", "ttft_p99_s") is None


def test_seeded_sweep_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tiny_trace(tmp_path / "trace.jsonl", 10)
    argv = ["--trace", str(trace), "--policies", "kvmesh", "--time-scales", "0.5", "--no-progress"]
    assert main([*argv, "--seeds", "-1"]) == 2
    assert "--seeds" in capsys.readouterr().err
    assert main([*argv, "--jobs", "0"]) == 2
    single = ["--trace", str(trace), "--policies", "kvmesh", "--time-scale", "0.5", "--no-progress"]
    assert main([*single, "--seeds", "3"]) == 2  # a single run has no rows to take medians of
    assert "need --time-scales" in capsys.readouterr().err
