"""Prometheus metrics of one worker (``kvmesh_worker_*``), in a registry of its own.

Counters that the event loop bumps once per request are prometheus_client Counters. What hot or
threaded code already counts (the data plane's ``TransferMetrics``, the engine's tier usage as of
the last LoadReport) is read at scrape time by a collector, so the hot paths pay nothing and no
number is kept twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from schemas.messages import Completion, KvEvent, TierUsage
from services.worker.transfer.metrics import TransferMetrics

#: TTFT buckets (seconds): a cached prompt on an idle worker is a few ms, a long cold one seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TIER_RANK = {"gpu": 0, "dram": 1, "disk": 2}


class WorkerMetrics:
    """Owns the registry and every metric a worker exports; labels are bounded (no request ids)."""

    def __init__(
        self,
        transfer: TransferMetrics,
        tiers: Callable[[], list[TierUsage]],
        queue_depth: Callable[[], int],
        pulls: Callable[[], int] = lambda: 0,
    ) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "kvmesh_worker_ttft_seconds",
            "Time to first token of each request, as the worker measured it.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvmesh_worker_prompt_tokens",
            "Prompt tokens by how they were served.",
            ["source"],
            registry=r,
        )
        self.completion_tokens = Counter("kvmesh_worker_completion_tokens", "Generated tokens.", registry=r)
        self.requests = Counter(
            "kvmesh_worker_requests", "Finished requests by outcome.", ["outcome"], registry=r
        )
        self.assignments = Counter(
            "kvmesh_worker_assignments",
            "Assignments read: accepted, stale (for another instance of this worker), duplicate (already "
            "admitted).",
            ["kind"],
            registry=r,
        )
        self.prefix_hit_blocks = Counter(
            "kvmesh_worker_prefix_hit_blocks",
            "Prompt blocks found, by where: gpu (in place), host (promoted from DRAM or disk), peer "
            "(fetched for this request).",
            ["tier"],
            registry=r,
        )
        self.prefix_lookup_blocks = Counter(
            "kvmesh_worker_prefix_lookup_blocks", "Prompt blocks looked up.", registry=r
        )
        self.evictions = Counter(
            "kvmesh_worker_evictions",
            "Blocks evicted from a tier (demoted or dropped).",
            ["tier"],
            registry=r,
        )
        self.fetched_blocks = Counter(
            "kvmesh_worker_fetched_blocks", "Blocks fetched from peers and kept.", registry=r
        )
        self.replications = Counter(
            "kvmesh_worker_replications", "Replicate commands carried out.", registry=r
        )
        self.kv_event_gaps = Counter(
            "kvmesh_worker_kv_event_gaps", "KV-event publishes that failed (a resync follows).", registry=r
        )
        self.reannounced_blocks = Counter(
            "kvmesh_worker_reannounced_blocks", "Blocks re-announced after being declared lost.", registry=r
        )
        self.completion_fallbacks = Counter(
            "kvmesh_worker_completion_fallbacks",
            "Completions whose engine found fewer cached blocks than the decision expected.",
            registry=r,
        )
        self.queue_depth = Gauge(
            "kvmesh_worker_queue_depth", "Requests admitted and not finished.", registry=r
        )
        self.queue_depth.set_function(queue_depth)
        self.pulls = Gauge(
            "kvmesh_worker_pulls",
            "Requests whose planned peer blocks are being pulled or wait for the link (under overlap "
            "admission they wait in the engine's queue meanwhile).",
            registry=r,
        )
        self.pulls.set_function(pulls)
        # what the latest LoadReport told the scheduler about the waits it counts in decode steps
        self.decode_step = Gauge(
            "kvmesh_worker_decode_step_seconds",
            "Recent mean time of the engine's decode-only steps (0 before the first).",
            registry=r,
        )
        self.slot_wait_steps = Gauge(
            "kvmesh_worker_slot_wait_steps",
            "Decode steps until a request queued now gets a place in the engine's full batch.",
            registry=r,
        )
        self.kv_free_blocks = Gauge(
            "kvmesh_worker_kv_free_blocks",
            "GPU blocks free for the next prompt after the queued ones (negative: the queue waits for room).",
            registry=r,
        )
        #: Fetches the cost model turned down (recompute was cheaper); the data plane counts the rest.
        self.fetches_declined = 0
        r.register(_ScrapeTime(self, transfer, tiers))

    def value(self, name: str, **labels: str) -> float:
        """The current value of one sample (``requests_total``, outcome="completed"): for tests and logs."""
        got = self.registry.get_sample_value(f"kvmesh_worker_{name}", labels)
        return 0.0 if got is None else got

    def observe_completion(self, c: Completion, block_size: int, promoted_blocks: int) -> None:
        """Tokens by source, TTFT and the prefix hit by tier of one finished request."""
        if c.finish_reason in ("rejected", "cancelled"):
            return
        self.prompt_tokens.labels("reused").inc(c.reused_tokens)
        self.prompt_tokens.labels("fetched").inc(c.fetched_tokens)
        self.prompt_tokens.labels("recomputed").inc(c.recomputed_tokens)
        self.completion_tokens.inc(c.completion_tokens)
        if c.ttft_ms > 0:
            self.ttft.observe(c.ttft_ms / 1e3)
        bs = max(block_size, 1)
        peer = c.fetched_tokens // bs
        # Fetched blocks may have landed in a host tier and been promoted from there: not a host hit.
        host = min(max(promoted_blocks - peer, 0), c.reused_tokens // bs)
        self.prefix_lookup_blocks.inc(c.prompt_tokens // bs)
        self.prefix_hit_blocks.labels("peer").inc(peer)
        self.prefix_hit_blocks.labels("host").inc(host)
        self.prefix_hit_blocks.labels("gpu").inc(c.reused_tokens // bs - host)

    def observe_kv_event(self, ev: KvEvent) -> None:
        """A move down the tiers is an eviction from the upper tier; a removal, a drop from its tier."""
        n = len(ev.block_hashes)
        if ev.kind == "removed":
            self.evictions.labels(ev.tier).inc(n)
        elif (
            ev.kind == "moved"
            and ev.from_tier is not None
            and _TIER_RANK.get(ev.tier, 0) > _TIER_RANK.get(ev.from_tier, 0)
        ):
            self.evictions.labels(ev.from_tier).inc(n)


class _ScrapeTime(Collector):
    """What other owners count, read when Prometheus scrapes."""

    def __init__(
        self, owner: WorkerMetrics, transfer: TransferMetrics, tiers: Callable[[], list[TierUsage]]
    ) -> None:
        self.owner = owner
        self.transfer = transfer
        self.tiers = tiers

    def collect(self) -> Iterator[Metric]:
        used = GaugeMetricFamily("kvmesh_worker_tier_used_blocks", "Blocks held per tier.", labels=["tier"])
        cap = GaugeMetricFamily("kvmesh_worker_tier_capacity_blocks", "Capacity per tier.", labels=["tier"])
        for t in self.tiers():
            used.add_metric([t.tier], t.total_blocks - t.free_blocks)
            cap.add_metric([t.tier], t.total_blocks)
        yield used
        yield cap
        moved = CounterMetricFamily(
            "kvmesh_worker_transfer_bytes",
            "KV bytes fetched from peers (in) and served to peers (out).",
            labels=["direction"],
        )
        moved.add_metric(["in"], self.transfer.bytes_received)
        moved.add_metric(["out"], self.transfer.bytes_sent)
        yield moved
        fallbacks = CounterMetricFamily(
            "kvmesh_worker_fetch_fallbacks",
            "Planned fetches that ended in recompute, by reason (declined: the cost model chose recompute).",
            labels=["reason"],
        )
        fallbacks.add_metric(["declined"], self.owner.fetches_declined)
        for reason, n in sorted(dict(self.transfer.fetch_failures).items()):
            fallbacks.add_metric([reason], n)
        yield fallbacks
