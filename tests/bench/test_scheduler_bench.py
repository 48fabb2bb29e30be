"""``kvmesh bench scheduler``: the JSON contract, on a small index."""

from __future__ import annotations

import json

import pytest

from kvmesh.bench import scheduler


def test_json_last_line_has_latency_per_fleet_size_and_memory_per_block(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert scheduler.main(["--workers", "4,32", "--blocks", "4096", "--decisions", "60", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["decision_p99_us"]) == {"4", "32"}
    for k in ("4", "32"):
        assert 0 < out["decision_p50_us"][k] <= out["decision_p99_us"][k]
        # each chain sits on one worker and, 30 % of the time, on a second: between 1 and 2 entries a block
        assert out["index_entries"][k] >= 4096
        assert (
            out["index_bytes_per_entry"]
            <= out["index_bytes_per_block"][k]
            <= 2 * out["index_bytes_per_entry"]
        )
    assert out["decisions_per_s"] > 0
