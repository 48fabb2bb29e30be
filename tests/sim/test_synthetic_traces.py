"""The seeded Mooncake-format traces for routing checks on unseen shapes (kvmesh/sim/synthetic_traces.py)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from kvmesh.sim.synthetic_traces import BLOCK_TOKENS, main
from kvmesh.workloads import trace_requests


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_traces_are_seeded_well_formed_and_shaped_as_described(tmp_path: Path) -> None:
    main([str(tmp_path / "a")])
    main([str(tmp_path / "b")])
    for name in ("toolagent.jsonl", "convo.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()  # seeded
        rows = _rows(tmp_path / "a" / name)
        stamps = [r["timestamp"] for r in rows]
        assert stamps == sorted(stamps)
        for r in rows:
            ids = r["hash_ids"]
            assert isinstance(ids, list) and isinstance(r["input_length"], int)
            # the last block is partial: the prompt ends inside it
            assert (len(ids) - 1) * BLOCK_TOKENS < r["input_length"] <= len(ids) * BLOCK_TOKENS
        # the simulator reads them: one request a line, block hashes chained per prompt
        reqs = list(trace_requests(tmp_path / "a" / name, block_size=BLOCK_TOKENS))
        assert len(reqs) == len(rows) and all(len(q.block_hashes) >= 1 for q in reqs)

    tool = _rows(tmp_path / "a" / "toolagent.jsonl")
    assert len(tool) == 4000
    # skewed popularity: the hottest tool prompt opens about a quarter of the requests
    firsts = Counter(r["hash_ids"][0] for r in tool)
    assert 0.18 < firsts.most_common(1)[0][1] / len(tool) < 0.35 and len(firsts) == 30

    talk = _rows(tmp_path / "a" / "convo.jsonl")
    # every turn opens with one of five system prompts, and most turns are later turns of a history
    assert {tuple(r["hash_ids"][:8]) for r in talk} == {tuple(range(i * 8, i * 8 + 8)) for i in range(5)}
    assert sum(1 for r in talk if len(r["hash_ids"]) > 12) > len(talk) / 2
    # a burst: half the turns come in the first fifth of the trace
    end = talk[-1]["timestamp"]
    assert sum(1 for r in talk if r["timestamp"] < end / 5) > len(talk) / 2
