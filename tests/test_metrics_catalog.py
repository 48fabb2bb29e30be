"""docs/metrics.md lists exactly the metric families the services export (no more, no fewer)."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from services.intake.metrics import IntakeMetrics
from services.kvmanager.metrics import KvManagerMetrics
from services.scheduler.metrics import SchedulerMetrics
from services.worker.metrics import WorkerMetrics
from services.worker.transfer.metrics import TransferMetrics
from streams.consumer import ConsumerMetrics
from streams.consumer_metrics import ConsumerCollector

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
SERVICES = ("worker", "scheduler", "kvmanager", "intake")


def _exported() -> set[str]:
    """Every sample-family name the services' registries expose, as Prometheus shows it."""
    registries: list[CollectorRegistry] = [
        WorkerMetrics(TransferMetrics(), lambda: [], lambda: 0).registry,
        SchedulerMetrics("kvmesh", lambda: {}, lambda: 0).registry,
        KvManagerMetrics(lambda: 0, lambda: (0, 0)).registry,
        IntakeMetrics().registry,
    ]
    for service in SERVICES:
        r = CollectorRegistry()
        r.register(ConsumerCollector(service, lambda: [ConsumerMetrics()]))
        registries.append(r)
    names: set[str] = set()
    for r in registries:
        for fam in r.collect():
            if fam.type == "counter":
                names.add(f"{fam.name}_total")
            else:
                names.add(fam.name)
    return names


def _documented() -> set[str]:
    names: set[str] = set()
    for row in DOC.read_text().splitlines():
        m = re.match(r"\| `(kvmesh_[a-z0-9_<>]+)` \|", row)
        if not m:
            continue
        name = m.group(1)
        if "<service>" in name:
            names.update(name.replace("<service>", s) for s in SERVICES)
        else:
            names.add(name)
    return names


def test_the_doc_lists_every_exported_family_and_nothing_else() -> None:
    exported, documented = _exported(), _documented()
    assert exported - documented == set(), "exported but not documented"
    assert documented - exported == set(), "documented but not exported"
