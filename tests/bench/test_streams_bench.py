"""`kvmesh bench streams` keeps its output contract on a real broker (tiny sizes: not a measurement)."""

from __future__ import annotations

import json

import pytest

from kvmesh.bench import streams as bench
from streams.settings import KafkaSettings


@pytest.mark.integration
def test_streams_bench_prints_its_contract_as_the_last_line(
    kafka_settings: KafkaSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--bootstrap", kafka_settings.bootstrap_servers, "--messages", "300", "--rounds", "2"]
    argv += ["--latency-messages", "10", "--rate", "100", "--tokens", "256", "--json"]
    assert bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("typed_msgs_per_s", "raw_msgs_per_s", "typed_vs_raw_throughput", "p50_ms", "p99_ms"):
        assert out[key] > 0, key
    assert out["typed_vs_raw_throughput"] == pytest.approx(out["typed_msgs_per_s"] / out["raw_msgs_per_s"])
    assert len(out["typed_msgs_per_s_rounds"]) == 2
    # both sides did real client work, and the typed side's includes at least the codec
    assert out["raw_cpu_us_per_msg"] > 0 and out["typed_cpu_us_per_msg"] > 0
    assert out["decode_us"] > 0 and out["encode_us"] > 0
    assert out["payload_bytes"] > 4 * 256  # the packed token ids alone
