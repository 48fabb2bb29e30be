"""The fleet simulator over the live router: policies rank as they should, runs are deterministic."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from sim_helpers import tiny_trace

from kvmesh.sim.__main__ import main
from kvmesh.sim.engine import SimConfig, profile_for_block_size, simulate
from kvmesh.sim.errors import SimError
from kvmesh.workloads import MultiTurnSpec, multiturn
from kvmesh_core.costmodel import PROFILES

PROFILE = PROFILES["h100-llama3-8b"]
# Long private histories, a short shared system prompt: reuse depends on routing turns to their cache.
SPEC = MultiTurnSpec(
    users=13,
    rounds=4,
    system_prompt_tokens=128,
    history_tokens=2048,
    question_tokens=64,
    answer_tokens=16,
    qps=8,
)


@pytest.fixture(scope="module")
def summaries() -> dict[str, dict]:
    out = {}
    for policy in ("round_robin", "least_loaded", "prefix_aware", "kvmesh"):
        out[policy] = simulate(multiturn(SPEC), PROFILE, SimConfig(workers=4, policy=policy)).summary()
    return out


def test_every_request_completes(summaries: dict[str, dict]) -> None:
    for s in summaries.values():
        assert s["requests"] == SPEC.users * SPEC.rounds
        assert s["rejected"] == 0
        fractions = s["reused_token_fraction"] + s["fetched_token_fraction"] + s["recomputed_token_fraction"]
        assert fractions == pytest.approx(1.0)


def test_cache_aware_policies_reuse_far_more(summaries: dict[str, dict]) -> None:
    rr = summaries["round_robin"]["kv_hit_fraction"]
    assert summaries["prefix_aware"]["kv_hit_fraction"] > rr + 0.4
    assert summaries["kvmesh"]["kv_hit_fraction"] > rr + 0.4
    assert summaries["round_robin"]["fetched_token_fraction"] == 0.0
    assert summaries["kvmesh"]["ttft_p50_s"] < summaries["round_robin"]["ttft_p50_s"]
    assert summaries["kvmesh"]["ttft_p50_s"] < summaries["least_loaded"]["ttft_p50_s"]


def test_runs_are_deterministic() -> None:
    a = simulate(multiturn(SPEC), PROFILE, SimConfig(workers=4, policy="kvmesh")).summary()
    b = simulate(multiturn(SPEC), PROFILE, SimConfig(workers=4, policy="kvmesh")).summary()
    assert a == b


def test_profile_keeps_capacity_in_tokens() -> None:
    p = profile_for_block_size(PROFILE, 512)
    assert p.block_size == 512
    assert p.gpu_blocks * 512 == PROFILE.gpu_blocks * PROFILE.block_size
    assert p.block_bytes == PROFILE.block_bytes * 32


def test_bad_config_is_refused() -> None:
    with pytest.raises(SimError):
        SimConfig(policy="nope")
    with pytest.raises(SimError):
        SimConfig(workers=0)


def test_cli_on_a_trace_prints_json_last(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tiny_trace(tmp_path / "trace.jsonl", 40)
    rc = main(
        [
            "--trace",
            str(trace),
            "--workers",
            "4",
            "--policies",
            "round_robin,kvmesh",
            "--time-scale",
            "0.5",
            "--max-requests",
            "30",
            "--plot",
            str(tmp_path / "plots"),
            "--json",
            "--no-progress",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["policies"]) == {"round_robin", "kvmesh"}
    for s in out["policies"].values():
        assert s["requests"] == 30
        for key in ("ttft_p50_s", "ttft_p99_s", "reused_token_fraction", "busy_fraction_spread"):
            assert key in s
    assert out["policies"]["kvmesh"]["kv_hit_fraction"] > out["policies"]["round_robin"]["kv_hit_fraction"]
    assert (tmp_path / "plots" / "ttft_cdf.png").stat().st_size > 0
    assert (tmp_path / "plots" / "busy_fraction.png").stat().st_size > 0


def test_cli_refuses_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--workload", "multiturn", "--policies", "magic", "--no-progress"]) == 2
    assert "magic" in capsys.readouterr().err


def test_async_loads_take_promotions_off_the_engines_iterations() -> None:
    """With a GPU tier too small for every history, turns find their history in DRAM. Sticky routing
    (the same assignments either way) makes the runs comparable: every request is served under both
    loads, the promotions happen under both, and under ``async`` the engines' iterations no longer
    carry them, so the fleet's busy time is shorter by about what they took."""
    from kvmesh.sim.worker import LOADS
    from kvmesh_core.costmodel import promote_ms
    from schemas.messages import KvEvent

    small = dataclasses.replace(PROFILE, gpu_blocks=300)
    moved: dict[str, int] = {}
    busy: dict[str, float] = {}
    for load in LOADS:
        moved[load] = 0

        def tap(_topic: object, msg: object, _t: float, load: str = load) -> None:
            if isinstance(msg, KvEvent) and msg.kind == "moved" and msg.tier == "gpu":
                moved[load] += len(msg.block_hashes)

        config = SimConfig(workers=4, policy="session_affinity", load=load)  # type: ignore[arg-type]
        result = simulate(multiturn(SPEC), small, config, tap=tap)
        assert len(result.records) == SPEC.users * SPEC.rounds and result.rejected == 0
        busy[load] = sum(result.busy_ms)
    assert moved["sync"] > 100 and moved["async"] > 100
    saved = busy["sync"] - busy["async"]
    assert saved == pytest.approx(promote_ms(small, "dram", moved["sync"]), rel=0.25)


def test_cli_load_is_echoed_and_refused_when_unknown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tiny_trace(tmp_path / "trace.jsonl", 20)
    args = ["--trace", str(trace), "--workers", "2", "--policies", "kvmesh", "--json", "--no-progress"]
    assert main([*args, "--load", "async"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["load"] == "async" and out["policies"]["kvmesh"]["requests"] == 20
    with pytest.raises(SystemExit):
        main([*args, "--load", "eager"])
    assert "invalid choice" in capsys.readouterr().err
