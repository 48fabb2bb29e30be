"""Prometheus metrics of one KV manager (``kvmesh_kvmanager_*``), in a registry of its own.

The per-event count and the directory's size are read at scrape time (the hot loop applies tens of
thousands of events a second and pays nothing for them); the rest are prometheus_client metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class KvManagerMetrics:
    """Owns the registry; ``events_applied`` is a plain count the loop bumps, exported at scrape."""

    def __init__(
        self,
        directory_blocks: Callable[[], int],
        workers: Callable[[], tuple[int, int]],
        role: Callable[[], tuple[bool, int]] = lambda: (True, 0),
    ) -> None:
        self.registry = r = CollectorRegistry()
        self.events_applied = 0
        self.event_lag = Histogram(
            "kvmesh_kvmanager_event_lag_seconds",
            "From an event's publish to its flush into Redis (per flush, its oldest event).",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.replications = Counter(
            "kvmesh_kvmanager_replications", "Replicate commands published.", registry=r
        )
        self.published = Counter(
            "kvmesh_kvmanager_published", "Control records published, by kind.", ["kind"], registry=r
        )
        r.register(_Directory(self, directory_blocks, workers, role))

    def value(self, name: str, **labels: str) -> float:
        got = self.registry.get_sample_value(f"kvmesh_kvmanager_{name}", labels)
        return 0.0 if got is None else got


class _Directory(Collector):
    def __init__(
        self,
        owner: KvManagerMetrics,
        directory_blocks: Callable[[], int],
        workers: Callable[[], tuple[int, int]],
        role: Callable[[], tuple[bool, int]],
    ) -> None:
        self.owner = owner
        self.directory_blocks = directory_blocks
        self.workers = workers
        self.role = role

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "kvmesh_kvmanager_events_applied",
            "KV events applied to the directory.",
            value=self.owner.events_applied,
        )
        yield GaugeMetricFamily(
            "kvmesh_kvmanager_directory_blocks",
            "Block hashes in the directory.",
            value=self.directory_blocks(),
        )
        live, lost = self.workers()
        fam = GaugeMetricFamily("kvmesh_kvmanager_workers", "Workers by state.", labels=["state"])
        fam.add_metric(["live"], live)
        fam.add_metric(["lost"], lost)
        yield fam
        leader, shards = self.role()
        yield GaugeMetricFamily(
            "kvmesh_kvmanager_leader",
            "1 if this manager runs liveness and placement (always, without replicas), else 0.",
            value=float(leader),
        )
        yield GaugeMetricFamily(
            "kvmesh_kvmanager_owned_shards",
            "kv-events partitions whose directory slice this replica owns (0 without replicas).",
            value=shards,
        )
