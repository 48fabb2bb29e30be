"""Prometheus metrics of one intake, in a registry of its own (two apps in one process never clash)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from schemas.messages import Completion

__all__ = ["CONTENT_TYPE_LATEST", "IntakeMetrics"]


class IntakeMetrics:
    """Owns the registry and every metric the intake exports; labels are bounded (no ids, no tenants)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvmesh_intake_requests",
            "Chat completion requests by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        self.in_flight = Gauge("kvmesh_intake_in_flight", "Requests in flight.", registry=self.registry)
        self.prompt_tokens = Counter(
            "kvmesh_intake_prompt_tokens",
            "Prompt tokens by how they were served (reused, fetched, recomputed).",
            ["how"],
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "kvmesh_intake_completion_tokens", "Generated tokens.", registry=self.registry
        )
        self.ttft = Histogram(
            "kvmesh_intake_ttft_ms",
            "Time to first token reported by workers (ms).",
            buckets=(5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000),
            registry=self.registry,
        )

    def observe_completion(self, c: Completion) -> None:
        self.prompt_tokens.labels("reused").inc(c.reused_tokens)
        self.prompt_tokens.labels("fetched").inc(c.fetched_tokens)
        self.prompt_tokens.labels("recomputed").inc(c.recomputed_tokens)
        self.completion_tokens.inc(c.completion_tokens)
        if c.ttft_ms > 0:
            self.ttft.observe(c.ttft_ms)

    def render(self) -> bytes:
        return generate_latest(self.registry)
