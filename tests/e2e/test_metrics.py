"""Every service of a real dev stack serves Prometheus metrics, and they move as the traffic says.

A conversation runs three turns on one worker, which then drains, so the fourth turn is served by the
other worker fetching the blocks. Then every service is scraped over HTTP: each named family is
there, the TTFT histograms count exactly the completions, fetched tokens are > 0, the scheduler has
compared every prediction with its outcome, and `kvmesh dev --status-file` lists every process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.devstack import DevStack, DevStackSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SYSTEM = "You are the fleet's archivist; you remember every block. " * 6


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    settings = DevStackSettings(workers=2, intake_port=0, gpu_blocks=256, dram_blocks=256, metrics=True)
    with DevStack(settings, sink=lambda _line: None) as s:
        yield s


def _scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """{sample name: {sorted labels: value}} of one /metrics page."""
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200, url
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(r.text):
        for sample in fam.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _total(page: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str) -> float:
    return sum(
        v for k, v in page.get(name, {}).items() if all((key, val) in k for key, val in labels.items())
    )


def _chat(url: str, history: list[dict[str, str]]) -> dict:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "kvmesh-tiny", "messages": history, "max_tokens": 6, "temperature": 0, "user": "ann"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    data: dict = r.json()
    history.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
    return data


def test_every_service_exports_its_families_and_they_move(stack: DevStack, tmp_path: Path) -> None:
    history = [{"role": "system", "content": SYSTEM}]
    served: list[dict] = []
    for turn in range(3):
        history.append({"role": "user", "content": f"turn {turn}: what is cached?"})
        served.append(_chat(stack.intake_url, history))
    first = served[-1]["kvmesh"]["worker"]
    stack.set_drain(first, True, reason="metrics test")
    history.append({"role": "user", "content": "and after the drain?"})
    served.append(_chat(stack.intake_url, history))
    stack.set_drain(first, False, reason="metrics test")
    assert served[-1]["kvmesh"]["worker"] != first and served[-1]["kvmesh"]["fetched_tokens"] > 0

    status = stack.write_status(tmp_path / "status.json")
    assert json.loads((tmp_path / "status.json").read_text()) == status
    names = set(status["services"])
    assert names == {"intake", "scheduler", "kvmanager", *stack.worker_ids}
    assert all(e["ready"] and e["pid"] > 0 and e["metrics_url"] for e in status["services"].values())
    pages = {name: _scrape(e["metrics_url"]) for name, e in status["services"].items()}
    workers = [pages[w] for w in stack.worker_ids]

    # worker: TTFT counted once per completion, tokens by source, hits by tier, tiers, transfer
    assert sum(_total(p, "kvmesh_worker_ttft_seconds_count") for p in workers) == len(served)
    assert sum(_total(p, "kvmesh_worker_requests_total", outcome="completed") for p in workers) == len(served)
    fetched = sum(_total(p, "kvmesh_worker_prompt_tokens_total", source="fetched") for p in workers)
    assert fetched == served[-1]["kvmesh"]["fetched_tokens"] > 0
    reused = sum(_total(p, "kvmesh_worker_prompt_tokens_total", source="reused") for p in workers)
    assert reused == sum(d["kvmesh"]["reused_tokens"] for d in served) > 0
    assert sum(_total(p, "kvmesh_worker_prefix_hit_blocks_total", tier="peer") for p in workers) > 0
    assert sum(_total(p, "kvmesh_worker_transfer_bytes_total", direction="in") for p in workers) > 0
    assert sum(_total(p, "kvmesh_worker_transfer_bytes_total", direction="out") for p in workers) > 0
    assert all(_total(p, "kvmesh_worker_tier_capacity_blocks", tier="gpu") == 256 for p in workers)
    for family in (
        "kvmesh_worker_queue_depth",
        "kvmesh_worker_prefix_lookup_blocks_total",
        "kvmesh_worker_consumer_records_total",
        "kvmesh_worker_consumer_lag_records",
    ):
        assert all(family in p for p in workers), family

    # scheduler: decisions, their time, and every prediction compared with its outcome
    sched = pages["scheduler"]
    assert _total(sched, "kvmesh_scheduler_decisions_total", outcome="assigned") >= len(served)
    assert _total(sched, "kvmesh_scheduler_decision_seconds_count") >= len(served)
    assert _total(sched, "kvmesh_scheduler_ttft_prediction_error_seconds_count") == len(served)
    assert _total(sched, "kvmesh_scheduler_completed_prompt_tokens_total") == sum(
        d["usage"]["prompt_tokens"] for d in served
    )
    achieved = sum(d["kvmesh"]["reused_tokens"] + d["kvmesh"]["fetched_tokens"] for d in served)
    assert _total(sched, "kvmesh_scheduler_achieved_hit_tokens_total") == achieved
    assert _total(sched, "kvmesh_scheduler_predicted_hit_tokens_total") > 0
    assert _total(sched, "kvmesh_scheduler_consumer_records_total", topic="kvmesh.requests") >= len(served)

    # KV manager: events applied, the directory, live workers
    kvm = pages["kvmanager"]
    assert _total(kvm, "kvmesh_kvmanager_events_applied_total") > 0
    assert _total(kvm, "kvmesh_kvmanager_directory_blocks") > 0
    assert _total(kvm, "kvmesh_kvmanager_workers", state="live") == 2
    assert "kvmesh_kvmanager_event_lag_seconds_count" in kvm

    # intake: as before, plus its consumers
    intake = pages["intake"]
    assert _total(intake, "kvmesh_intake_requests_total") >= len(served)
    assert _total(intake, "kvmesh_intake_consumer_records_total") > 0
