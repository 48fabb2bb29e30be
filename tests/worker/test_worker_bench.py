"""``kvmesh bench worker`` runs end to end on a tiny case and prints its JSON contract last."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvmesh.bench import worker as bench


def test_bench_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    plot = tmp_path / "ttft.png"
    try:
        rc = bench.main(
            "--lengths 64,128 --cached 0,90 --repeats 1 --decode-batch 2 --decode-tokens 3 "
            f"--prefill-chunk 64 --json --plot {plot}".split()
        )
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["ttft_ms"]) == {"64", "128"} and set(result["ttft_ms"]["128"]) == {"0", "90"}
    assert result["reused_tokens"]["128"] == {"0": 0, "90": 112}
    assert result["ratio_length"] == 128 and result["ttft_ratio_90pct_cached_4k"] > 0
    assert result["profile"]["block_size"] == 16
    assert plot.stat().st_size > 0
