"""``kvmesh demo --embedded --engine vllm --model DIR --json``: the multi-turn demo on two vLLM workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvmesh.demo import main as demo_main
from kvmesh.modeldir import init_model_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_demo_on_vllm_fetches_after_the_drain_and_matches_a_recompute_only_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = init_model_dir(tmp_path / "tiny-llama", seed=2)
    rc = demo_main(
        ["--embedded", "--engine", "vllm", "--model", str(model), "--users", "2", "--turns", "2",
         "--max-tokens", "8", "--json"]
    )  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert summary["engine"] == "vllm" and summary["model"] == "kvmesh-tiny-llama"
    assert summary["outputs_match_reference"] is True, summary.get("mismatches")
    turns = summary["turns"]
    assert len(turns) == 4
    last = [t for t in turns if t["turn"] == 2]
    # worker-0 was drained before turn 2: its users ran on worker-1 and fetched their history
    assert all(t["worker"] == "worker-1" for t in last)
    moved = [t for t in turns if t["turn"] == 1 and t["worker"] == "worker-0"]
    if moved:
        assert summary["fetched_tokens"] > 0
    assert summary["reused_tokens"] + summary["fetched_tokens"] + summary["recomputed_tokens"] == sum(
        t["prompt_tokens"] for t in turns
    )
    assert "prompt tokens served from cache" in "\n".join(out[:-1])
