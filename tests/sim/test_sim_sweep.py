"""``kvmesh simulate --time-scales``: issue #8's goal check and the sweep's JSON and figure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sim_helpers import tiny_trace

from kvmesh.sim.__main__ import main
from kvmesh.sim.metrics import issue8_goal
from kvmesh.sim.plots import _shade_spans


def _summaries(rr: float, ll: float, pa: float, kv: float, spread_ll: float, spread_kv: float) -> dict:
    p50 = {"round_robin": rr, "least_loaded": ll, "prefix_aware": pa, "kvmesh": kv}
    spread = {"round_robin": 20.0, "least_loaded": spread_ll, "prefix_aware": 15.0, "kvmesh": spread_kv}
    return {p: {"ttft_p50_s": p50[p], "busy_fraction_spread": spread[p]} for p in p50}


def test_goal_met() -> None:
    # The 0.28 row of the earlier sweep.
    g = issue8_goal(_summaries(27.845, 21.833, 0.258, 0.168, 9.96, 6.41))
    assert g["kv_over_rr_p50"] == pytest.approx(0.168 / 27.845)
    assert g["kv_over_pa_p50"] == pytest.approx(0.168 / 0.258)
    assert g["spread_kv_minus_ll_pt"] == pytest.approx(6.41 - 9.96)
    assert g["rr_p50_s"] == 27.845
    assert g["rr_loaded"] and g["kv_vs_rr_ok"] and g["kv_vs_pa_ok"] and g["spread_ok"]
    assert g["met"] is True


def test_goal_fails_on_the_prefix_aware_ratio_alone() -> None:
    # The 0.30 row: KV/PA = 0.803 > 0.80, everything else holds.
    g = issue8_goal(_summaries(21.657, 12.151, 0.158, 0.127, 12.21, 4.85))
    assert g["kv_over_pa_p50"] == pytest.approx(0.8038, abs=1e-3)
    assert g["rr_loaded"] and g["kv_vs_rr_ok"] and g["spread_ok"]
    assert g["kv_vs_pa_ok"] is False
    assert g["met"] is False


@pytest.mark.parametrize(
    ("args", "failing"),
    [
        ((1.5, 0.5, 0.1, 0.05, 5.0, 5.0), "rr_loaded"),  # not loaded enough: RR p50 < 2 s
        ((3.0, 2.0, 10.0, 1.5, 5.0, 5.0), "kv_vs_rr_ok"),  # 0.5 of RR
        ((10.0, 5.0, 1.0, 0.5, 5.0, 15.5), "spread_ok"),  # 10.5 points more imbalanced than LL
    ],
)
def test_goal_fails_per_condition(args: tuple[float, ...], failing: str) -> None:
    g = issue8_goal(_summaries(*args))
    conditions = ("rr_loaded", "kv_vs_rr_ok", "kv_vs_pa_ok", "spread_ok")
    assert [c for c in conditions if not g[c]] == [failing]
    assert g["met"] is False


def test_goal_boundaries_are_inclusive_and_zero_denominators_fail() -> None:
    g = issue8_goal(_summaries(2.0, 1.0, 1.0, 0.8, 5.0, 15.0))
    assert g["rr_loaded"] and g["kv_vs_pa_ok"] and g["spread_ok"]
    g = issue8_goal(_summaries(2.0, 1.0, 0.0, 0.0, 5.0, 5.0))
    assert g["kv_over_pa_p50"] is None and g["kv_vs_pa_ok"] is False and g["met"] is False


def test_goal_needs_all_four_policies() -> None:
    s = _summaries(27.0, 21.0, 0.25, 0.17, 9.0, 6.0)
    del s["least_loaded"]
    with pytest.raises(KeyError):
        issue8_goal(s)


def test_shade_spans_reach_halfway_to_neighbours() -> None:
    assert _shade_spans([0.25, 0.3, 0.5], [0.3]) == [pytest.approx((0.275, 0.4))]
    assert _shade_spans([0.25, 0.3], [0.25, 0.3]) == [
        pytest.approx((0.225, 0.275)),
        pytest.approx((0.275, 0.325)),
    ]
    assert _shade_spans([0.5], [0.5]) == [pytest.approx((0.475, 0.525))]
    assert _shade_spans([0.25, 0.3], []) == []


POLICIES = ("round_robin", "least_loaded", "prefix_aware", "kvmesh")


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_sweep_prints_one_json_object_last(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tiny_trace(tmp_path / "trace.jsonl", 40)
    common = ["--trace", str(trace), "--workers", "4", "--policies", ",".join(POLICIES)]
    common += ["--max-requests", "30", "--json"]
    out = _run([*common, "--time-scales", "0.5,1", "--plot", str(tmp_path / "plots")], capsys)
    assert [row["time_scale"] for row in out["sweep"]] == [0.5, 1.0]
    for row in out["sweep"]:
        assert set(row) == {"time_scale", "policies", "bound", "goal", "peer_goal"}
        assert row["peer_goal"] is None  # the peers' routers did not run
        assert set(row["policies"]) == set(POLICIES)
        for s in row["policies"].values():
            assert s["requests"] == 30
            for key in ("ttft_p50_s", "ttft_p99_s", "reused_token_fraction", "busy_fraction_spread"):
                assert key in s
        assert row["goal"] == issue8_goal(row["policies"])
    assert out["goal_met_at"] == [r["time_scale"] for r in out["sweep"] if r["goal"]["met"]]
    png = tmp_path / "plots" / "time_scale_sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out["plots"] == [str(png)]

    # Each sweep row is exactly the single-scale run at that scale (bar wall time).
    single = _run([*common, "--time-scale", "0.5", "--no-progress"], capsys)
    assert "sweep" not in single and "goal_met_at" not in single
    for p in POLICIES:
        a, b = dict(out["sweep"][0]["policies"][p]), dict(single["policies"][p])
        a.pop("wall_s")
        b.pop("wall_s")
        assert a.pop("ttft_p50_excess_s") >= 0 and a.pop("ttft_p99_excess_s") >= 0  # sweep rows only
        for key in ("p50", "p99", "mean"):
            assert a.pop(f"ttft_request_excess_{key}_s") >= -1e-9  # each request against its own bound
        assert a == b


def test_cli_sweep_without_the_goal_policies_has_no_goal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tiny_trace(tmp_path / "trace.jsonl", 20)
    argv = ["--trace", str(trace), "--workers", "2", "--policies", "round_robin,kvmesh"]
    out = _run([*argv, "--time-scales", "1", "--json"], capsys)
    assert out["sweep"][0]["goal"] is None and out["goal_met_at"] == []


def test_cli_sweep_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--workload", "multiturn", "--time-scales", "0.5", "--no-progress"]) == 2
    assert "--time-scales needs --trace" in capsys.readouterr().err
    trace = tiny_trace(tmp_path / "trace.jsonl", 10)
    argv = ["--trace", str(trace), "--policies", "kvmesh", "--time-scales", "0.5"]
    assert main([*argv, "--record", str(tmp_path / "r.jsonl")]) == 2
    assert "--record" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--trace", str(trace), "--time-scales", "0.5,-1"])


def test_cli_kv_capacity_is_the_default_and_no_kv_capacity_the_what_if(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GPU tier that holds about one prompt (6 blocks of 512 tokens): with KV capacity, the default,
    a prompt waits for the running one's decode steps to end, so the fleet is slower than the
    simulator without the rule (``--no-kv-capacity``); the JSON says which ran."""
    import dataclasses

    from kvmesh_core.costmodel import PROFILES

    small = dataclasses.replace(
        PROFILES["h100-llama3-8b"], gpu_blocks=6 * 512 // 16, dram_blocks=0, disk_blocks=0
    )
    profile = tmp_path / "small.json"
    profile.write_text(json.dumps(dataclasses.asdict(small)))
    trace = tiny_trace(tmp_path / "trace.jsonl", 24)
    argv = ["--trace", str(trace), "--workers", "1", "--policies", "kvmesh", "--profile", str(profile)]
    argv += ["--time-scale", "0.25", "--json", "--no-progress"]
    capped = _run(argv, capsys)
    free = _run([*argv, "--no-kv-capacity"], capsys)
    assert capped["kv_capacity"] is True and free["kv_capacity"] is False
    a, b = capped["policies"]["kvmesh"], free["policies"]["kvmesh"]
    assert a["requests"] == b["requests"] == 24
    assert a["ttft_p50_s"] > b["ttft_p50_s"] and a["makespan_s"] > b["makespan_s"]
