"""Simulated workers report as often as live ones (kvmesh_core.load_reports), and the scheduler's
late-binding threshold follows that cadence.

With reports every 2 s, a worker in a long prefill looked as busy as when it began until it ended:
that kept kvmesh's simulated queues shorter than a live fleet's would be (README, "The simulator
reports as often as the live worker")."""

from __future__ import annotations

from itertools import pairwise

from kvmesh.sim.engine import SimConfig, Simulation
from kvmesh.workloads import MultiTurnSpec, multiturn
from kvmesh_core.costmodel import PROFILES
from kvmesh_core.load_reports import LOAD_INTERVAL_MS
from schemas.messages import LoadReport
from services.scheduler.config import SchedulerSettings
from services.scheduler.router import RouterSettings
from services.worker.config import WorkerSettings
from streams.topics import TopicSpec


def test_one_cadence_for_live_and_simulated_workers_and_the_threshold_follows_it() -> None:
    assert WorkerSettings.model_fields["load_interval_ms"].default == LOAD_INTERVAL_MS
    assert SimConfig().heartbeat_ms == LOAD_INTERVAL_MS
    # a queue outlasts the time until the scheduler next hears from its worker
    assert RouterSettings().max_queue_ms == SchedulerSettings().max_queue_ms == 2 * LOAD_INTERVAL_MS


def test_a_long_prefill_reports_its_progress_at_that_cadence() -> None:
    """One prompt whose prefill takes seconds: while it runs, the worker reports every interval, and
    each report owes less of it."""
    spec = MultiTurnSpec(users=1, rounds=1, system_prompt_tokens=0, history_tokens=60_000, qps=1)
    reports: list[tuple[float, int]] = []

    def tap(_topic: TopicSpec, msg: object, at_ms: float) -> None:
        if isinstance(msg, LoadReport) and msg.queue_depth > 0:
            reports.append((at_ms, msg.queued_prefill_tokens))

    sim = Simulation(PROFILES["h100-llama3-8b"], SimConfig(workers=1), tap=tap)
    result = sim.run(multiturn(spec))
    (rec,) = result.records
    prefill_ms = rec.first_token_ms - rec.decided_ms
    assert prefill_ms > 4 * LOAD_INTERVAL_MS  # the regime under test: a prefill of several intervals
    during = [(t, q) for t, q in reports if rec.decided_ms < t < rec.first_token_ms]
    assert len(during) >= int(prefill_ms // LOAD_INTERVAL_MS) - 1
    gaps = [b[0] - a[0] for a, b in pairwise(during)]
    assert max(gaps) <= LOAD_INTERVAL_MS + 1
    owed = [q for _, q in during]
    assert owed == sorted(owed, reverse=True) and owed[0] > owed[-1]
