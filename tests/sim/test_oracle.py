"""The simulator's perfect-information reference (kvmesh.sim.oracle): exact, greedy, sim-only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sim_helpers import tiny_trace

from kvmesh.sim.__main__ import main
from kvmesh.sim.engine import SimConfig, simulate
from kvmesh.sim.errors import SimError
from kvmesh.sim.oracle import ORACLE
from kvmesh.sim.truth import TruthScale
from kvmesh.workloads import MultiTurnSpec, multiturn, trace_requests
from kvmesh_core.costmodel import PROFILES
from services.scheduler.errors import UnknownPolicy
from services.scheduler.registry import POLICIES
from services.scheduler.router import Router, RouterSettings
from services.scheduler.view import FleetView

PROFILE = PROFILES["h100-llama3-8b"]


def _busy_trace(tmp_path: Path, n: int) -> list[str]:
    """``tiny_trace`` at 40 ms apart with long outputs: every worker decodes and queues build up."""
    path = tiny_trace(tmp_path / "t.jsonl", n)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r["timestamp"] //= 5
        r["output_length"] = 60
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [str(path)]


@pytest.mark.parametrize("truth", [TruthScale(), TruthScale(prefill=1.3, decode=0.8, noise=0.2, seed=3)])
def test_oracle_predicts_every_ttft_it_causes(tmp_path: Path, truth: TruthScale) -> None:
    """Its estimate is read from the workers' real state: each request's simulated TTFT is what it
    predicted, queues, decode steps in flight, carried steps, truth and noise included."""
    (trace,) = _busy_trace(tmp_path, 60)
    cfg = SimConfig(workers=3, policy=ORACLE, block_size=512, truth=truth)
    res = simulate(trace_requests(trace, 1.0, None, 512), PROFILE, cfg)
    assert len(res.records) == 60
    waited = [r for r in res.records if r.first_token_ms - r.decided_ms > r.predicted_ms * 0.5]
    assert waited, "the run must queue or wait for decode steps, or it tests nothing"
    assert any(r.fetched_tokens for r in res.records), "pulling a prefix from a peer must be priced too"
    err = np.array([(r.first_token_ms - r.decided_ms) - r.predicted_ms for r in res.records])
    # exact but for a queued prompt that stores blocks a later one shares (it can only get cheaper)
    assert np.mean(np.abs(err) < 1e-6) >= 0.9
    assert err.max() < 1e-6


def test_oracle_is_greedy_best_among_workers(tmp_path: Path) -> None:
    """With what it knows it is never worse than the lagged, estimated kvmesh policy on a light load
    (there the greedy choice is the best one), and its estimates are exact."""
    spec = MultiTurnSpec(users=12, rounds=4, qps=6.0, seed=5)
    runs = {}
    for policy in (ORACLE, "kvmesh", "round_robin"):
        cfg = SimConfig(workers=4, policy=policy, block_size=16)
        runs[policy] = simulate(multiturn(spec, 16), PROFILE, cfg).summary()
    assert runs[ORACLE]["ttft_p50_s"] < runs["round_robin"]["ttft_p50_s"]
    assert runs[ORACLE]["ttft_mean_s"] <= runs["kvmesh"]["ttft_mean_s"] * 1.05
    assert runs[ORACLE]["prediction_ratio_p50"] == pytest.approx(1.0)


def test_oracle_is_not_a_scheduler_policy() -> None:
    """No live scheduler can read its workers' futures: the registry does not name it."""
    assert ORACLE not in POLICIES
    with pytest.raises(UnknownPolicy):
        Router(FleetView(16), RouterSettings(policy=ORACLE))
    with pytest.raises(SimError):
        SimConfig(policy="oracle")


def test_sweep_runs_the_oracle_beside_the_peers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tiny_trace(tmp_path / "trace.jsonl", 30)
    policies = f"kvmesh,sglang,{ORACLE}"
    argv = ["--trace", str(trace), "--workers", "3", "--policies", policies, "--time-scales", "1", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = out["sweep"]
    assert set(row["policies"]) == {"kvmesh", "sglang", ORACLE}
    assert row["policies"][ORACLE]["ttft_p50_s"] >= row["bound"]["ttft_p50_s"] - 1e-9
    assert main(["--trace", str(trace), "--policies", "kvmesh,oracle"]) == 2


def test_a_recorded_oracle_run_replays_only_with_another_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvmesh.replay.__main__ import main as replay_main

    trace = tiny_trace(tmp_path / "trace.jsonl", 12)
    rec = tmp_path / "rec.jsonl"
    argv = ["--trace", str(trace), "--workers", "3", "--policies", ORACLE, "--record", str(rec)]
    assert main([*argv, "--no-progress"]) == 0
    capsys.readouterr()
    assert replay_main([str(rec)]) == 2
    assert "--policy NAME" in capsys.readouterr().err
    assert replay_main([str(rec), "--policy", "kvmesh", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["requests"] == 12
