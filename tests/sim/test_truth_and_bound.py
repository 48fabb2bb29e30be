"""The simulated engine's truth (``--truth-scale``), the TTFT bound, and issue #22's sweep contract."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sim_helpers import tiny_trace

from kvmesh.sim.__main__ import main
from kvmesh.sim.bound import bound_ttfts_s, per_request_excess
from kvmesh.sim.engine import SimConfig, simulate
from kvmesh.sim.errors import SimError
from kvmesh.sim.metrics import RequestRecord
from kvmesh.sim.peer_goal import peer_goal
from kvmesh.sim.truth import TruthScale
from kvmesh.workloads import trace_requests
from kvmesh_core.costmodel import PROFILES, recompute_ms

PROFILE = PROFILES["h100-llama3-8b"]


def test_truth_scale_parses_and_refuses() -> None:
    t = TruthScale.parse("prefill=1.3, decode=0.8,link=0.5,noise=0.2,seed=4")
    assert (t.prefill, t.decode, t.link, t.tier, t.noise, t.seed) == (1.3, 0.8, 0.5, 1.0, 0.2, 4)
    real = t.apply(PROFILE)
    assert real.prefill_ms_per_token == pytest.approx(1.3 * PROFILE.prefill_ms_per_token)
    assert real.decode_ms_per_step == pytest.approx(0.8 * PROFILE.decode_ms_per_step)
    assert real.link_gbps == pytest.approx(2 * PROFILE.link_gbps)
    for bad in ("prefill=0", "speed=2", "prefill", "noise=-1", "link=x"):
        with pytest.raises(SimError):
            TruthScale.parse(bad)


def test_noise_is_seeded_per_request_and_log_normal() -> None:
    t = TruthScale(noise=0.3, seed=1)
    draws = np.array([t.prefill_noise(f"r{i}") for i in range(4000)])
    assert t.prefill_noise("r7") == TruthScale(noise=0.3, seed=1).prefill_noise("r7")
    assert TruthScale(noise=0.3, seed=2).prefill_noise("r7") != t.prefill_noise("r7")
    assert np.median(np.log(draws)) == pytest.approx(0.0, abs=0.03)
    assert np.std(np.log(draws)) == pytest.approx(0.3, rel=0.08)
    assert TruthScale().prefill_noise("r7") == 1.0


def test_bound_reuses_every_earlier_prefix_and_computes_the_last_token(tmp_path: Path) -> None:
    trace = tiny_trace(tmp_path / "t.jsonl", 4)  # blocks of 512 tokens: [10 11 *], [0 1 2 *], ...
    reqs = list(trace_requests(str(trace), 1.0, None, 512))
    got = bound_ttfts_s(reqs, PROFILE, TruthScale())
    # request 2 repeats request 0's two shared blocks: it prefills its last 2 blocks after 2 cached
    n2 = len(reqs[2].token_ids)
    assert got[2] == pytest.approx(recompute_ms(PROFILE, n2 - 2 * 512, 2 * 512) / 1000)
    assert got[0] == pytest.approx(recompute_ms(PROFILE, len(reqs[0].token_ids)) / 1000)
    slow = bound_ttfts_s(reqs, TruthScale(prefill=2).apply(PROFILE), TruthScale(prefill=2))
    assert np.allclose(slow, 2 * got)


def test_truth_slows_the_engine_not_what_policies_see(tmp_path: Path) -> None:
    trace = str(tiny_trace(tmp_path / "t.jsonl", 30))
    runs = {}
    for prefill in (1.0, 2.0):
        cfg = SimConfig(workers=2, policy="kvmesh", block_size=512, truth=TruthScale(prefill=prefill))
        runs[prefill] = simulate(trace_requests(trace, 1.0, None, 512), PROFILE, cfg)
    fast, slow = runs[1.0].summary(), runs[2.0].summary()
    assert slow["ttft_p50_s"] > 1.5 * fast["ttft_p50_s"]
    # the first decisions are priced from the published profile: half the truth's time
    first = min(runs[2.0].records, key=lambda r: r.arrival_ms)
    assert first.predicted_ms == pytest.approx((first.first_token_ms - first.decided_ms) / 2, rel=0.05)
    assert 0.9 < fast["prediction_ratio_p50"] <= 1.1


def test_peer_goal_compares_excess_over_the_bound() -> None:
    bound = {"ttft_p50_s": 1.0, "ttft_p99_s": 5.0}
    pol = {
        "kvmesh": {"ttft_p50_s": 1.1, "ttft_p99_s": 6.0},
        "dynamo": {"ttft_p50_s": 1.5, "ttft_p99_s": 8.0},
        "llm_d": {"ttft_p50_s": 2.0, "ttft_p99_s": 9.0},
        "sglang": {"ttft_p50_s": 1.3, "ttft_p99_s": 9.0},
    }
    g = peer_goal(pol, bound)
    assert g is not None
    assert g["p50"]["best_peer"] == "sglang" and g["p50"]["ratio"] == pytest.approx(0.1 / 0.3)
    assert g["p99"]["best_peer"] == "dynamo" and g["p99"]["ratio"] == pytest.approx(1 / 3)
    assert g["met"]
    assert not peer_goal(pol, bound, max_ratio=0.3)["met"]
    del pol["llm_d"]
    assert peer_goal(pol, bound) is None


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_sweep_runs_every_peer_with_the_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tiny_trace(tmp_path / "trace.jsonl", 40)
    policies = "dynamo,llm_d,sglang,kvmesh"
    argv = ["--trace", str(trace), "--workers", "3", "--policies", policies, "--time-scales", "0.5,1"]
    out = _run([*argv, "--truth-scale", "prefill=1.3,noise=0.1", "--json"], capsys)
    assert out["truth_scale"]["prefill"] == 1.3
    for row in out["sweep"]:
        assert set(row["policies"]) == set(policies.split(","))
        assert row["bound"]["ttft_p50_s"] > 0 and row["bound"]["requests"] == 40
        for s in row["policies"].values():
            for key in ("ttft_p50_s", "ttft_p99_s", "kv_hit_fraction", "busy_fraction_spread"):
                assert key in s
            # no policy beats the bound at these percentiles, nor any request its own bound
            assert s["ttft_p50_s"] >= row["bound"]["ttft_p50_s"] - 1e-9
            assert s["ttft_request_excess_p50_s"] >= -1e-9
            assert s["ttft_request_excess_p99_s"] >= s["ttft_request_excess_p50_s"]
            assert s["prediction_ratio_p50"] > 0
        assert row["peer_goal"]["max_ratio"] == 0.5  # the truth's prefill is slower than published
    again = _run([*argv, "--truth-scale", "prefill=1.3,noise=0.1", "--json"], capsys)
    for a, b in zip(out["sweep"], again["sweep"], strict=True):
        for p in a["policies"]:
            a["policies"][p].pop("wall_s")
            b["policies"][p].pop("wall_s")
        assert a == b  # deterministic, noise included


def _record(request_id: str, ttft_ms: float) -> RequestRecord:
    return RequestRecord(0, 1000.0, 1000.0 + ttft_ms, 5000.0, 64, 0, 0, 64, 8, request_id=request_id)


def test_per_request_excess_is_each_request_against_its_own_bound() -> None:
    # The percentiles of TTFT can agree while the requests' own excesses differ: two long prompts
    # at their bound, two short ones a second late. The difference of p99s is 0; the requests' is not.
    bounds = {"long-1": 6.0, "long-2": 6.0, "short-1": 0.05, "short-2": 0.05, "gone": 1.0}
    records = [_record("long-1", 6000), _record("long-2", 6000), _record("short-1", 1050)]
    records.append(_record("short-2", 1050))
    records.append(_record("unbounded", 99000))  # no bound for it: left out
    ex = per_request_excess(records, bounds)
    assert ex["ttft_request_excess_p50_s"] == pytest.approx(0.5)
    assert ex["ttft_request_excess_p99_s"] == pytest.approx(1.0, abs=0.02)
    assert ex["ttft_request_excess_mean_s"] == pytest.approx(0.5)
    assert per_request_excess([], bounds) == {}
