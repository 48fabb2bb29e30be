"""A real Prometheus scrapes every service of the dev stack (``DevStackSettings(metrics=True)``).

Three chats go through intake; Prometheus (the Debian ``prometheus`` binary, on loopback, scraping
each service's ``metrics_url`` from ``stack.status()`` every second) must see every target up, count
the three first tokens in ``kvmesh_worker_ttft_seconds`` and compute a median TTFT from its buckets.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from prometheus_helpers import EmbeddedPrometheus

from kvmesh.devstack import DevStack, DevStackSettings

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="no `prometheus` binary on PATH"),
]

MODEL = "kvmesh-tiny"
CHATS = 3


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    logs: list[str] = []
    settings = DevStackSettings(workers=2, intake_port=0, metrics=True)
    with DevStack(settings, sink=logs.append) as s:
        yield s


def _eventually(cond: Callable[[], bool], what: Callable[[], str], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what()
        time.sleep(0.5)


def _values(result: list[dict[str, Any]]) -> list[float]:
    return [float(r["value"][1]) for r in result]


def _chat(client: openai.OpenAI, text: str) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=4, temperature=0
    )
    assert r.choices


def test_prometheus_scrapes_every_service(stack: DevStack) -> None:
    client = openai.OpenAI(base_url=f"{stack.intake_url}/v1", api_key="x", timeout=60)
    for i in range(CHATS):
        _chat(client, f"prometheus chat {i}")

    services = stack.status()["services"]
    jobs = {name: info["metrics_url"] for name, info in services.items()}
    assert jobs, services
    assert any(name.startswith("worker") for name in jobs), jobs

    with EmbeddedPrometheus(jobs) as prom:

        def all_up() -> bool:
            targets = prom.targets()
            return len(targets) == len(jobs) and all(t["health"] == "up" for t in targets)

        _eventually(all_up, lambda: f"targets not all up: {prom.targets()}")
        targets = prom.targets()
        assert sorted(t["job"] for t in targets) == sorted(jobs)
        assert all(t["health"] == "up" for t in targets), targets

        count = "sum(kvmesh_worker_ttft_seconds_count)"
        _eventually(
            lambda: sum(_values(prom.query(count))) >= CHATS,
            lambda: f"{count} = {prom.query(count)}; targets: {prom.targets()}",
        )

        # The chats above were all counted before the first scrape, so every bucket's rate() is 0
        # and the quantile NaN: a few more while Prometheus watches give it increases to see.
        for i in range(CHATS):
            _chat(client, f"prometheus chat {CHATS + i}")
        median = "histogram_quantile(0.5, sum by (le) (rate(kvmesh_worker_ttft_seconds_bucket[1m])))"
        _eventually(
            lambda: any(not math.isnan(v) for v in _values(prom.query(median))),
            lambda: f"{median} = {prom.query(median)}",
        )
        result = prom.query(median)
        assert result, median
        finite = [v for v in _values(result) if not math.isnan(v)]
        assert finite and all(v >= 0 for v in finite), result
