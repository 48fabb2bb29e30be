"""Workload generators: prefix structure, trace block identity, determinism."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from kvmesh.workloads import (
    MultiTurnSpec,
    SharedPrefixSpec,
    WorkloadError,
    azure_trace,
    mooncake_trace,
    multiturn,
    multiturn_sessions,
    shared_prefix,
    shared_prefix_sessions,
    tokens_for_id,
    trace_requests,
)


def _write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_multiturn_prompt_extends_previous_turn() -> None:
    spec = MultiTurnSpec(users=3, rounds=3, system_prompt_tokens=64, history_tokens=32, qps=10.0)
    reqs = list(multiturn(spec, block_size=16))
    assert len(reqs) == 9
    assert [r.arrival_ms for r in reqs] == [k * 100 for k in range(9)]
    by_user: dict[str, list] = {}
    for r in reqs:
        by_user.setdefault(r.session_id, []).append(r)
    for turns in by_user.values():
        for prev, nxt in itertools.pairwise(turns):
            n = len(prev.token_ids)
            assert nxt.token_ids[:n] == prev.token_ids
            assert nxt.block_hashes[: len(prev.block_hashes)] == prev.block_hashes
            # the answer (64 tokens) and the next question (64) follow the previous prompt
            assert len(nxt.token_ids) == n + 64 + 64
    # the system prompt is public and shared: its 4 blocks are equal across users, the history differs
    u0, u1 = by_user["mt-u0"][0], by_user["mt-u1"][0]
    assert u0.block_hashes[:4] == u1.block_hashes[:4]
    assert u0.block_hashes[4] != u1.block_hashes[4]


def test_the_simulator_and_the_live_bench_get_the_same_prompts_from_one_spec() -> None:
    """One generator: the simulator's requests are the live sessions' turns with placeholder answers."""
    spec = MultiTurnSpec(users=2, rounds=3, system_prompt_tokens=48, history_tokens=16, seed=5)
    sessions = {s.session_id: s for s in multiturn_sessions(spec).sessions}
    sim = list(multiturn(spec, block_size=16))
    for r in sim:
        session = sessions[r.session_id]
        turn = int(r.request_id.rsplit("-r", 1)[1])
        asked = session.turns[turn].append_tokens
        # turn 0 is exactly what the live run sends; a later turn ends with the question it appends
        assert (
            (r.token_ids.tolist() == list(asked)) if turn == 0 else r.token_ids[-len(asked) :] == list(asked)
        )
        assert r.public_prefix_tokens == session.public_prefix_tokens == 48
        assert r.arrival_ms == round(session.turns[turn].due_s * 1000)
    sp = SharedPrefixSpec(groups=2, per_group=3, prefix_tokens=32, question_tokens=8)
    live = {s.session_id: s.turns[0].append_tokens for s in shared_prefix_sessions(sp).sessions}
    assert {r.session_id: tuple(r.token_ids.tolist()) for r in shared_prefix(sp)} == live


def test_multiturn_is_deterministic_per_seed() -> None:
    a = [r.block_hashes for r in multiturn(MultiTurnSpec(users=2, rounds=2, seed=3))]
    b = [r.block_hashes for r in multiturn(MultiTurnSpec(users=2, rounds=2, seed=3))]
    c = [r.block_hashes for r in multiturn(MultiTurnSpec(users=2, rounds=2, seed=4))]
    assert a == b
    assert a != c


def test_shared_prefix_groups_share_their_prefix_only() -> None:
    spec = SharedPrefixSpec(groups=3, per_group=4, prefix_tokens=64, question_tokens=16)
    reqs = list(shared_prefix(spec, block_size=16))
    assert len(reqs) == 12
    groups: dict[str, set[tuple[int, ...]]] = {}
    for r in reqs:
        groups.setdefault(r.request_id.split("-")[1], set()).add(tuple(r.block_hashes[:4]))
    assert all(len(prefixes) == 1 for prefixes in groups.values())
    assert len({next(iter(p)) for p in groups.values()}) == 3


def test_tokens_for_id_equal_ids_equal_tokens() -> None:
    a = tokens_for_id(np.array([5, 7]), 8)
    b = tokens_for_id(np.array([5, 9]), 8)
    assert a.shape == (16,)
    assert np.array_equal(a[:8], b[:8])
    assert not np.array_equal(a[8:], b[8:])
    assert a.min() >= 0 and a.max() < 32000


def test_mooncake_trace_maps_hash_ids_to_blocks(tmp_path: Path) -> None:
    path = _write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
            {"timestamp": 40, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]},
            {"timestamp": 80, "input_length": 600, "output_length": 1, "hash_ids": [3, 4]},
        ],
    )
    reqs = list(mooncake_trace(path, time_scale=0.5))
    assert [r.arrival_ms for r in reqs] == [0, 20, 40]
    assert [len(r.token_ids) for r in reqs] == [1100, 1024, 600]
    # only full blocks have a hash: 1100 tokens = 2 full 512-token blocks
    assert [len(r.block_hashes) for r in reqs] == [2, 2, 1]
    assert reqs[0].block_hashes == reqs[1].block_hashes
    assert reqs[2].block_hashes[0] != reqs[0].block_hashes[0]
    assert [r.max_tokens for r in reqs] == [3, 5, 1]
    # a smaller block size cuts each trace block into several
    small = list(mooncake_trace(path, block_size=128, max_requests=2))
    assert len(small) == 2
    assert len(small[0].block_hashes) == 1100 // 128
    assert small[0].block_hashes[:8] == small[1].block_hashes[:8]


def test_mooncake_trace_rejects_bad_rows(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10}\n')
    with pytest.raises(WorkloadError):
        list(mooncake_trace(path))
    with pytest.raises(WorkloadError):
        list(mooncake_trace(tmp_path / "missing.jsonl"))


def test_azure_trace_has_no_shared_prefix(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,1030,10\n"
        "2023-11-16 18:17:04.0319600,600,8\n"
    )
    reqs = list(trace_requests(path))
    assert [r.arrival_ms for r in reqs] == [0, 52]
    assert [len(r.block_hashes) for r in reqs] == [2, 1]
    assert reqs[0].block_hashes[0] != reqs[1].block_hashes[0]
    assert [r.max_tokens for r in azure_trace(path, max_requests=1)] == [10]


def test_a_tiled_trace_plays_copies_together_that_share_no_block(tmp_path: Path) -> None:
    trace = _write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]},
            {"timestamp": 500, "input_length": 1024, "output_length": 4, "hash_ids": [1, 3]},
        ],
    )
    one = list(trace_requests(trace, block_size=512))
    three = list(trace_requests(trace, block_size=512, tile=3))
    assert [r.request_id for r in one] == ["trace-0", "trace-1"]
    # the copies arrive together, each shifted by a third of a second at most (lockstep broken)
    assert len(three) == 6 and [r.arrival_ms for r in three] == [0, 333, 500, 666, 833, 1166]
    assert len({r.request_id for r in three}) == 6 and len({r.session_id for r in three}) == 6
    # within a copy the trace's sharing holds (ids 1 shared by both rows); across copies nothing is shared
    by_copy = {j: [r for r in three if r.request_id.endswith(f"-c{j}")] for j in range(3)}
    for rows in by_copy.values():
        assert rows[0].block_hashes[0] == rows[1].block_hashes[0] != rows[0].block_hashes[1]
    firsts = {rows[0].block_hashes[0] for rows in by_copy.values()}
    assert len(firsts) == 3
    with pytest.raises(WorkloadError):
        next(trace_requests(trace, tile=0))
