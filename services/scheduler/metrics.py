"""Prometheus metrics of one scheduler replica (``kvmesh_scheduler_*``), in a registry of its own.

Besides the decisions themselves this measures the router's predictions against what happened: each
Assignment's estimate (TTFT; blocks cached or fetched) is remembered until its Completion arrives,
which carries the observed TTFT and the reused and fetched tokens. Measurement only: the decisions
never read these numbers, so replay stays exact.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from schemas.messages import Assignment, Completion

#: Signed error buckets (seconds): negative is faster than predicted.
ERROR_BUCKETS = (
    -5.0,
    -2.0,
    -1.0,
    -0.5,
    -0.25,
    -0.1,
    -0.05,
    -0.02,
    0.0,
    0.02,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    5.0,
)
DECISION_BUCKETS = (2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2)
#: Predictions remembered until their Completion (the oldest are forgotten first).
MAX_PENDING_PREDICTIONS = 100_000


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft_ms: float
    hit_tokens: int  # cached + fetched blocks of the decision, in tokens
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's prediction against its Completion (what ``kvmesh replay`` prints too)."""

    request_id: str
    worker_id: str
    predicted_ttft_ms: float
    observed_ttft_ms: float
    predicted_hit_tokens: int
    achieved_hit_tokens: int
    prompt_tokens: int


def prediction_of(a: Assignment) -> Prediction:
    bs = a.request.block_size
    hit = min((a.estimate.cached_blocks + a.estimate.fetched_blocks) * bs, len(a.request.token_ids))
    return Prediction(a.estimate.ttft_ms, hit, len(a.request.token_ids))


def compare(p: Prediction, c: Completion) -> Outcome | None:
    """A decision's prediction beside its Completion; None when the request did not run to a first
    token (errors, cancels, rejections have nothing to compare)."""
    if c.finish_reason not in ("stop", "length") or c.ttft_ms <= 0:
        return None
    return Outcome(
        c.request_id,
        c.worker_id,
        p.ttft_ms,
        c.ttft_ms,
        p.hit_tokens,
        c.reused_tokens + c.fetched_tokens,
        p.prompt_tokens,
    )


class SchedulerMetrics:
    """Owns the registry and every metric a scheduler replica exports; labels are bounded."""

    def __init__(
        self,
        policy: str,
        deferrals: Callable[[], dict[str, int]],
        held: Callable[[], int],
        moves: Callable[[], int] = lambda: 0,
    ) -> None:
        self.policy = policy
        self.registry = r = CollectorRegistry()
        self.decision_seconds = Histogram(
            "kvmesh_scheduler_decision_seconds",
            "Time to decide one request (a batch's time over its decisions).",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "kvmesh_scheduler_decisions",
            "Decisions by policy and outcome.",
            ["policy", "outcome"],
            registry=r,
        )
        self.rejections = Counter(
            "kvmesh_scheduler_rejections",
            "Requests answered with an error, by reason.",
            ["reason"],
            registry=r,
        )
        self.redispatches = Counter(
            "kvmesh_scheduler_redispatches",
            "Requests decided again (their worker lost, restarted or silent).",
            registry=r,
        )
        self.pulled = Counter(
            "kvmesh_scheduler_pulled",
            "Held requests placed on a worker with room that pulled them from a busier one.",
            registry=r,
        )
        self.requests = Counter("kvmesh_scheduler_requests", "Request-topic records read.", registry=r)
        self.duplicate_requests = Counter(
            "kvmesh_scheduler_duplicate_requests",
            "Requests dropped because one with the same id was still queued or running.",
            registry=r,
        )
        self.skipped_decided = Counter(
            "kvmesh_scheduler_skipped_decided",
            "Requests read again after a replica's crash that it had already decided.",
            registry=r,
        )
        self.cancels = Counter(
            "kvmesh_scheduler_cancels",
            "Cancels: of a queued request (answered here) or forwarded to its worker.",
            ["where"],
            registry=r,
        )
        self.state_records = Counter(
            "kvmesh_scheduler_state_records", "State records applied to the view.", registry=r
        )
        self.state_applied_before_decide = Counter(
            "kvmesh_scheduler_state_applied_before_decide",
            "State records fetched while waiting for requests and applied before deciding them.",
            registry=r,
        )
        self.stale_batches = Counter(
            "kvmesh_scheduler_stale_batches",
            "Decision batches made on a view that missed a record already in the broker.",
            registry=r,
        )
        self.view_lag = Gauge(
            "kvmesh_scheduler_view_lag_seconds",
            "How far behind the newest record the view was at the last stale batch.",
            registry=r,
        )
        self.ttft_prediction_error = Histogram(
            "kvmesh_scheduler_ttft_prediction_error_seconds",
            "Observed TTFT minus predicted TTFT (negative: faster than predicted).",
            buckets=ERROR_BUCKETS,
            registry=r,
        )
        self.predicted_hit_tokens = Counter(
            "kvmesh_scheduler_predicted_hit_tokens",
            "Prompt tokens the decision expected cached or fetched.",
            registry=r,
        )
        self.achieved_hit_tokens = Counter(
            "kvmesh_scheduler_achieved_hit_tokens",
            "Prompt tokens the Completion reports reused or fetched.",
            registry=r,
        )
        self.completed_prompt_tokens = Counter(
            "kvmesh_scheduler_completed_prompt_tokens",
            "Prompt tokens of the Completions matched to a decision.",
            registry=r,
        )
        self._pending: OrderedDict[str, Prediction] = OrderedDict()
        r.register(_Dispatcher(deferrals, held, moves))

    def value(self, name: str, **labels: str) -> float:
        """The current value of one sample (``redispatches_total``): for tests and logs."""
        got = self.registry.get_sample_value(f"kvmesh_scheduler_{name}", labels)
        return 0.0 if got is None else got

    def assigned(self, a: Assignment) -> None:
        self.decisions.labels(self.policy, "assigned").inc()
        if a.inputs is not None and a.inputs.pulled:
            self.pulled.inc()
        self._pending[a.request.request_id] = prediction_of(a)
        while len(self._pending) > MAX_PENDING_PREDICTIONS:
            self._pending.popitem(last=False)

    def rejected(self, reason: str) -> None:
        self.decisions.labels(self.policy, "rejected").inc()
        self.rejections.labels(reason or "other").inc()

    def completed(self, c: Completion) -> Outcome | None:
        """Compare a Completion with its decision's prediction (once; None if it had none)."""
        p = self._pending.pop(c.request_id, None)
        o = compare(p, c) if p is not None else None
        if o is None:
            return None
        self.ttft_prediction_error.observe((o.observed_ttft_ms - o.predicted_ttft_ms) / 1e3)
        self.predicted_hit_tokens.inc(o.predicted_hit_tokens)
        self.achieved_hit_tokens.inc(o.achieved_hit_tokens)
        self.completed_prompt_tokens.inc(o.prompt_tokens)
        return o


class _Dispatcher(Collector):
    """The fair dispatcher's own counts, read when Prometheus scrapes."""

    def __init__(
        self, deferrals: Callable[[], dict[str, int]], held: Callable[[], int], moves: Callable[[], int]
    ) -> None:
        self.deferrals = deferrals
        self.held = held
        self.moves = moves

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(
            "kvmesh_scheduler_deferrals",
            "Times a request was held instead of decided, by reason (counted at each try).",
            labels=["reason"],
        )
        for reason, n in sorted(dict(self.deferrals()).items()):
            fam.add_metric([reason], n)
        yield fam
        yield GaugeMetricFamily(
            "kvmesh_scheduler_held_requests", "Requests queued undecided.", value=self.held()
        )
        yield CounterMetricFamily(
            "kvmesh_scheduler_parked_moves",
            "Held requests moved to wait on a worker that stores or is computing more of their prompt.",
            value=self.moves(),
        )
