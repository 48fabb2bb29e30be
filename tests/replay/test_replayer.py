"""Replaying a recorded window: the live decisions come back exactly; another policy shows its changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.replay.__main__ import main
from kvmesh.replay.replayer import read_window, replay
from kvmesh.sim.engine import SimConfig, simulate
from kvmesh.sim.recorder import SimRecorder
from kvmesh.workloads import MultiTurnSpec, make_request, multiturn
from kvmesh_core.costmodel import PROFILES
from schemas.codec import encode
from schemas.messages import KvEvent, LoadReport, TierUsage
from services.scheduler.router import Router, RouterSettings
from services.scheduler.view import FleetView
from streams.recording import RawRecord, write_recording
from streams.topics import ASSIGNMENTS, KV_EVENTS, LOAD, REQUESTS

SPEC = MultiTurnSpec(users=7, rounds=3, system_prompt_tokens=64, history_tokens=512, answer_tokens=8, qps=6)


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A window recorded from a simulated fleet whose live router ran the kvmesh policy."""
    rec = SimRecorder()
    simulate(multiturn(SPEC), PROFILES["h100-llama3-8b"], SimConfig(workers=3, policy="kvmesh"), tap=rec.tap)
    path = tmp_path_factory.mktemp("rec") / "window.rec"
    rec.write(path)
    return path


def test_faithful_replay_has_no_divergence(recording: Path) -> None:
    report = replay(read_window(recording))
    assert report.policy == "kvmesh"
    assert len(report.decisions) == SPEC.users * SPEC.rounds
    assert report.dead == 0
    assert report.divergences == 0
    assert all(d.outcome == "assigned" and d.candidates for d in report.decisions)
    assert all(d.replayed_ttft_ms == pytest.approx(d.recorded_ttft_ms) for d in report.decisions)


def test_other_policy_changes_decisions_and_reports_them(recording: Path) -> None:
    report = replay(read_window(recording), policy="round_robin")
    assert report.policy == "round_robin"
    assert report.divergences > 0
    diverged = [d for d in report.decisions if d.diverged]
    assert all(d.recorded_worker != d.replayed_worker for d in diverged)
    assert all(d.recorded_worker is not None and d.replayed_worker is not None for d in diverged)


def test_undecodable_records_are_counted_and_skipped(recording: Path) -> None:
    records = read_window(recording)
    records.append(RawRecord(REQUESTS.name, 0, 10**6, 0, None, b"\x00not an envelope"))
    report = replay(records)
    assert report.dead == 1
    assert report.divergences == 0


def _load(worker: str, ms: int) -> LoadReport:
    p = PROFILES["h100-llama3-8b"]
    return LoadReport(
        worker, ms, 0, 0, 0, 0, [TierUsage("gpu", 100, 100)], f"sim://{worker}", 16, p.block_bytes,
        p.prefill_ms_per_token, p.prefill_ms_per_token_per_ctx, p.decode_ms_per_step, p.link_gbps,
        p.link_latency_ms,
    )  # fmt: skip


def test_hand_built_window_replays_at_arrival_time(tmp_path: Path) -> None:
    """Events + the assignment a live Router made, encoded and written by hand."""
    import numpy as np

    req = make_request("r1", "s1", "t", np.arange(64), 4, arrival_ms=500, block_size=16)
    stored = KvEvent("w1", "stored", "gpu", req.block_hashes[:3], [0, *req.block_hashes[:2]], event_ms=100)
    state = [(LOAD, _load("w0", 90)), (LOAD, _load("w1", 90)), (KV_EVENTS, stored)]
    live = FleetView(16)
    live.apply_load(state[0][1])  # type: ignore[arg-type]
    live.apply_load(state[1][1])  # type: ignore[arg-type]
    live.apply_kv_event(stored)
    decision = Router(live, RouterSettings(policy="prefix_aware")).decide(req, req.arrival_ms)
    assert decision.assignment is not None and decision.assignment.worker_id == "w1"
    msgs = [*state, (REQUESTS, req), (ASSIGNMENTS, decision.assignment)]
    ts = [90, 90, 100, 500, 501]
    records = [
        RawRecord(topic.name, 0, i, t, None, encode(m, "live", i, t))
        for i, ((topic, m), t) in enumerate(zip(msgs, ts, strict=True))
    ]
    path = tmp_path / "hand.rec"
    write_recording(path, records)
    report = replay(read_window(path))
    (d,) = report.decisions
    assert (d.now_ms, d.recorded_worker, d.replayed_worker, d.diverged) == (500, "w1", "w1", False)
    assert d.candidates[0].cached_blocks == 3
    # round robin would have sent it to w0, and the replay says so
    (d2,) = replay(read_window(path), policy="round_robin").decisions
    assert (d2.replayed_worker, d2.diverged) == ("w0", True)


def test_cli_json(recording: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(recording), "--policy", "round_robin", "--only-divergent", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["policy"] == "round_robin"
    assert out["requests"] == SPEC.users * SPEC.rounds
    assert out["divergences"] == len(out["decisions"]) > 0
    assert any(line.startswith("DIVERGED") for line in lines)
    # a recording whose assignments carry no input positions (the simulator's, older versions)
    assert out["mode"] == "approximate" and "no input positions" in out["note"]
    assert "mode=approximate" in lines[-2]


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "missing.rec")]) == 2
    assert main([]) == 2
    assert "kvmesh replay" in capsys.readouterr().err
