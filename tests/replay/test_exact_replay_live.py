"""Exact replay of a live stack: every decision carries its input positions, so replaying the recording
with the recorded policy reproduces every live decision, and a damaged recording names what it lost.

One embedded stack (real broker, real Redis, scheduler, KV manager, two workers, intake) serves several
concurrent multi-turn conversations, one worker is drained half way, and the topics are recorded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvmesh.devstack import DevStack, DevStackSettings
from kvmesh.replay import record
from kvmesh.replay.__main__ import main as replay_main
from schemas.codec import decode
from streams.recording import RawRecord, read_recording, write_recording
from streams.topics import ASSIGNMENTS, KV_EVENTS, LOAD

pytestmark = [pytest.mark.integration, pytest.mark.slow]

USERS = 4
TURNS = 3


def _conversation(url: str, user: int, turns: range) -> None:
    messages = [{"role": "system", "content": "You are the kvmesh replay test assistant. " * 4}]
    for t in turns:
        messages.append({"role": "user", "content": f"User {user} asks question number {t} about caches."})
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "kvmesh-tiny", "messages": messages, "max_tokens": 6, "temperature": 0,
                  "user": f"u{user}"},
            timeout=120,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    settings = DevStackSettings(
        workers=2, intake_port=0, log_level="WARNING", gpu_blocks=512, dram_blocks=512
    )
    out = tmp_path_factory.mktemp("exact") / "live.kvrec"
    with DevStack(settings, sink=lambda _line: None) as stack:
        with ThreadPoolExecutor(USERS) as pool:
            list(pool.map(lambda u: _conversation(stack.intake_url, u, range(2)), range(USERS)))
        stack.set_drain(stack.worker_ids[0])  # its sessions move to the other worker, fetching blocks
        with ThreadPoolExecutor(USERS) as pool:
            list(pool.map(lambda u: _conversation(stack.intake_url, u, range(2, TURNS + 1)), range(USERS)))
        argv = ["--bootstrap", stack.kafka.bootstrap_servers, "--topic-prefix", stack.kafka.topic_prefix]
        assert record.main([*argv, "--out", str(out), "--idle-timeout-s", "1"]) == 0
    yield out


def _replay(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[dict, str]:
    capsys.readouterr()
    assert replay_main([str(path), "--json", *extra]) == 0
    out = capsys.readouterr().out
    return json.loads(out.strip().splitlines()[-1]), out


def test_replay_with_the_recorded_policy_reproduces_every_live_decision(
    recording: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result, text = _replay(recording, capsys)
    assert result["mode"] == "exact"
    assert result["requests"] >= USERS * (TURNS + 1)
    assert (result["divergences"], result["unreproducible"], result["dead"]) == (0, 0, 0), text
    assert result["view_lag"]["max_ms"] >= 0
    assert all(d["positions"] for d in result["decisions"])
    # each decision's prediction beside what its request got, as the live scheduler measures it
    compared = [d for d in result["decisions"] if d["prediction_vs_outcome"] is not None]
    assert len(compared) >= USERS * (TURNS + 1)
    for d in compared:
        q, got = d["prediction_vs_outcome"], d["outcome_measured"]
        assert q["achieved_hit_tokens"] == got["reused_tokens"] + got["fetched_tokens"]
        assert q["observed_ttft_ms"] == got["ttft_ms"] and q["predicted_ttft_ms"] == d["recorded_ttft_ms"]
    quality = result["prediction_quality"]
    assert quality["requests"] == len(compared) and quality["achieved_hit_tokens"] > 0
    assert "ttft predicted=" in text and "hit predicted=" in text and "hit_achieved=" in text
    # two replays of one recording print the same bytes
    _, again = _replay(recording, capsys)
    assert again == text


def test_another_policy_diverges_and_explains(recording: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A live run's kvmesh choices can happen to match one baseline's on a small fleet (two workers
    # alternating is also what round robin does), so take the first baseline that differs somewhere.
    diverged = []
    policy = ""
    for policy in ("round_robin", "least_loaded", "prefix_aware", "session_affinity"):
        result, _ = _replay(recording, capsys, "--policy", policy)
        assert result["policy"] == policy and result["unreproducible"] == 0
        diverged = [d for d in result["decisions"] if d["diverged"]]
        if diverged:
            break
    assert diverged, "every baseline made kvmesh's choices: the recording tests nothing"
    rid = diverged[0]["request_id"]
    capsys.readouterr()
    assert replay_main([str(recording), "--policy", policy, "--explain", rid]) == 0
    text = capsys.readouterr().out
    assert f"request {rid}: recorded {diverged[0]['recorded_worker']}" in text
    assert "inputs applied up to: " in text and f"{LOAD.name}/" in text
    assert "outcome on " in text and "recomputed" in text
    assert "queue" in text and "recompute" in text  # the candidate table's columns


def _rewrite(src: Path, dst: Path, keep: object) -> None:
    write_recording(dst, [r for r in (keep(r) for r in read_recording(src)) if r is not None])  # type: ignore[operator]


def _applied(
    recording: Path, capsys: pytest.CaptureFixture[str], topic: str, fraction: int
) -> tuple[str, RawRecord]:
    """A record of ``topic`` that the decisions applied: on the partition the last decision had read
    furthest, 1/``fraction`` of the way to its position. (A record past the last decision's position,
    an eviction at the end say, damages no decision; which partition's records come last varies run
    to run.) Its partition key and the record."""
    intact, _ = _replay(recording, capsys)
    last = intact["decisions"][-1]["positions"]
    key = max((k for k in last if k.startswith(f"{topic}/")), key=lambda k: last[k])
    part = int(key.rsplit("/", 1)[1])
    records = read_recording(recording)
    return key, next(
        r for r in records if r.topic == topic and r.partition == part and r.offset == last[key] // fraction
    )


def test_a_gap_in_a_state_partition_marks_only_the_decisions_after_it(
    recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a LoadReport the decisions applied, about half way through
    key, victim = _applied(recording, capsys, LOAD.name, 2)
    gapped = tmp_path / "gap.kvrec"
    _rewrite(recording, gapped, lambda r: None if r == victim else r)
    result, _ = _replay(gapped, capsys)
    bad = [d for d in result["decisions"] if not d["reproducible"]]
    good = [d for d in result["decisions"] if d["reproducible"]]
    assert result["divergences"] == 0
    assert any(f"{key}: offsets {victim.offset}..{victim.offset}" in g for g in result["gaps"])
    assert bad and all(d["positions"][key] > victim.offset and str(victim.offset) in d["why"] for d in bad)
    assert all(d["positions"].get(key, 0) <= victim.offset for d in good)


def test_a_truncated_record_is_named_not_counted_as_a_divergence(
    recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = list(read_recording(recording))
    _, victim = _applied(recording, capsys, KV_EVENTS.name, 3)

    def cut(r: RawRecord) -> RawRecord:
        if r is victim or r == victim:
            return RawRecord(
                r.topic, r.partition, r.offset, r.timestamp_ms, r.key, r.value[: len(r.value) // 2]
            )
        return r

    damaged = tmp_path / "cut.kvrec"
    _rewrite(recording, damaged, cut)
    result, text = _replay(damaged, capsys)
    assert result["dead"] == 1 and result["divergences"] == 0
    assert result["unreproducible"] > 0
    assert "UNREPRODUCIBLE" in text and "missing or damaged" in text
    # an assignment record lost: the decisions after it until the next full record say so
    assignments = [r for r in records if r.topic == ASSIGNMENTS.name]
    seqs = sorted((decode(r.value).message.decision_seq, i) for i, r in enumerate(assignments))
    lost = assignments[seqs[2][1]]
    holed = tmp_path / "hole.kvrec"
    _rewrite(recording, holed, lambda r: None if r == lost else r)
    result, _ = _replay(holed, capsys)
    assert result["divergences"] == 0
    broken = [d for d in result["decisions"] if not d["reproducible"]]
    assert broken and "missing" in broken[0]["why"]
