"""``kvmesh record`` from a real broker, then ``kvmesh replay`` of the file: the live decision comes back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from kvmesh.replay import record
from kvmesh.replay.__main__ import main as replay_main
from kvmesh.workloads import make_request
from kvmesh_core.costmodel import PROFILES
from schemas.messages import KvEvent, LoadReport, TierUsage
from services.scheduler.router import Router, RouterSettings
from services.scheduler.view import FleetView
from streams.producer import TypedProducer
from streams.settings import KafkaSettings
from streams.topics import ASSIGNMENTS, KV_EVENTS, LOAD, REQUESTS


def _load(worker: str, ms: int) -> LoadReport:
    p = PROFILES["h100-llama3-8b"]
    return LoadReport(
        worker, ms, 0, 0, 0, 0, [TierUsage("gpu", 100, 100)], f"sim://{worker}", 16, p.block_bytes,
        p.prefill_ms_per_token, p.prefill_ms_per_token_per_ctx, p.decode_ms_per_step, p.link_gbps,
        p.link_latency_ms,
    )  # fmt: skip


@pytest.mark.integration
def test_record_then_replay(
    kafka_settings: KafkaSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    req = make_request("r1", "s1", "t", np.arange(64), 4, arrival_ms=500, block_size=16)
    stored = KvEvent("w1", "stored", "gpu", req.block_hashes[:3], [0, *req.block_hashes[:2]], event_ms=100)
    loads = [_load("w0", 90), _load("w1", 90)]
    live = FleetView(16)
    for lr in loads:
        live.apply_load(lr)
    live.apply_kv_event(stored)
    assignment = Router(live, RouterSettings(policy="prefix_aware")).decide(req, req.arrival_ms).assignment
    assert assignment is not None

    async def publish() -> None:
        async with TypedProducer(kafka_settings, "test-live") as producer:
            for lr in loads:
                await producer.send(LOAD, lr)
            await producer.send(KV_EVENTS, stored)
            await producer.send(REQUESTS, req)
            await producer.send(ASSIGNMENTS, assignment)

    asyncio.run(publish())
    out = tmp_path / "window.rec"
    argv = ["--bootstrap", kafka_settings.bootstrap_servers, "--topic-prefix", kafka_settings.topic_prefix]
    assert record.main([*argv, "--out", str(out), "--idle-timeout-s", "1"]) == 0
    capsys.readouterr()
    assert replay_main([str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["requests"], result["divergences"], result["dead"]) == (1, 0, 0)
    assert result["decisions"][0]["replayed_worker"] == "w1"
