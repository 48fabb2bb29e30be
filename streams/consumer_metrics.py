"""Prometheus export of a service's stream consumers (``kvmesh_<service>_consumer_*``).

The consumers count in plain numbers per fetched batch (``ConsumerMetrics``); this collector reads
them when Prometheus scrapes, summed over the service's consumers, by catalog topic.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from streams.consumer import ConsumerMetrics


class ConsumerCollector(Collector):
    """Records, dead letters and lag per topic of the consumers ``consumers()`` returns now."""

    def __init__(self, service: str, consumers: Callable[[], Iterable[ConsumerMetrics | None]]) -> None:
        self.prefix = f"kvmesh_{service}_consumer"
        self.consumers = consumers

    def collect(self) -> Iterator[Metric]:
        records: Counter[str] = Counter()
        dead: Counter[str] = Counter()
        lag: Counter[str] = Counter()
        for m in self.consumers():
            if m is None:
                continue
            records.update(dict(m.records_by_topic))
            dead.update(dict(m.dead_letters_by_topic))
            for (topic, _), n in list(m.lag.items()):
                lag[topic] += n
        fam = CounterMetricFamily(f"{self.prefix}_records", "Records read, by topic.", labels=["topic"])
        for topic, n in sorted(records.items()):
            fam.add_metric([topic], n)
        yield fam
        fam = CounterMetricFamily(
            f"{self.prefix}_dead_letters", "Records dead-lettered, by topic.", labels=["topic"]
        )
        for topic, n in sorted(dead.items()):
            fam.add_metric([topic], n)
        yield fam
        gauge = GaugeMetricFamily(
            f"{self.prefix}_lag_records",
            "Records behind the high watermark after the last fetch, summed over partitions.",
            labels=["topic"],
        )
        for topic, n in sorted(lag.items()):
            gauge.add_metric([topic], n)
        yield gauge
