"""FleetView bookkeeping: the maintained load ranking and pending totals stay exact."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.messages import Completion, WorkerLost
from services.scheduler.router import Router, RouterSettings
from services.scheduler.view import FleetView

from .factories import load, prompt, request

op = st.tuples(
    st.sampled_from(["load", "assign", "complete", "lost"]),
    st.integers(0, 5),
    st.integers(0, 3000),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op, max_size=40))
def test_ranking_and_pending_match_a_recount(ops: list[tuple[str, int, int]]) -> None:
    view = FleetView()
    for i in range(6):
        view.apply_load(load(f"w-{i}", 1000))
    router = Router(view, RouterSettings(policy="least_loaded", least_loaded_k=2))
    t = 1000
    assigned: list[tuple[str, str]] = []
    for n, (kind, w, x) in enumerate(ops):
        t += 1
        worker = f"w-{w}"
        if kind == "load":
            view.apply_load(load(worker, t, queue_depth=1, queued_prefill_tokens=x))
        elif kind == "assign":
            d = router.decide(request(f"r{n}", prompt(16 + x % 300, n)), t)
            if d.assignment is not None:
                assigned.append((d.assignment.request.request_id, d.assignment.worker_id))
        elif kind == "complete" and assigned:
            rid, wid = assigned.pop(0)
            view.note_completion(Completion(rid, "s", wid, "stop", 1, 1))
        elif kind == "lost":
            view.apply_worker_lost(WorkerLost(worker, t - 1, t))
    for ws in view.workers.values():
        assert abs(ws.pending_total_ms - sum(p.cost_ms for p in ws.pending)) < 1e-6
        assert view.load_key[ws.worker_id] == ws.base_queue_ms + ws.pending_total_ms
    assert set(view.load_key) == set(view.workers)
    live = view.live_workers(t)
    workers = view.workers
    expect = sorted(
        live,
        key=lambda w: (view.load_key[w], workers[w].report.active_tokens, workers[w].last_assign_ms, w),
    )
    assert view.least_loaded(3, live) == expect[:3]


def test_a_worker_announcing_another_block_size_is_refused() -> None:
    """Its hashes would never match a request's (or would be mis-indexed): no candidate, no events."""
    from .factories import stored

    view = FleetView(block_size=16)
    view.apply_load(load("w-0", 1000))
    req = request("r1", prompt(64))
    view.apply_kv_event(stored("w-1", req.block_hashes))  # before any report: kept until refused
    odd = msgspec.structs.replace(load("w-1", 1000), block_size=32)
    view.apply_load(odd)
    assert "w-1" not in view.workers and "block size 32" in view.refused["w-1"]
    assert view.index.worker_blocks("w-1") == 0
    view.apply_kv_event(stored("w-1", req.block_hashes))  # its later events are dropped
    assert view.index.worker_blocks("w-1") == 0
    d = Router(view, RouterSettings()).decide(req, 1001)
    assert d.assignment is not None and d.assignment.worker_id == "w-0"
    # the same worker back with the fleet's size is a member again
    view.apply_load(load("w-1", 1002))
    assert "w-1" in view.workers and "w-1" not in view.refused


def test_a_reported_prefill_budget_counts_the_decode_steps_long_prefills_carry() -> None:
    """Each iteration of a chunked prefill runs a decode step of the batch: a worker that reports its
    budget gets the queue's iterations, the new prompt's further ones and its pending work's priced."""
    from kvmesh_core.costmodel import decode_ms

    def view_with(chunk: int, active: int) -> FleetView:
        view = FleetView(block_size=16)
        report = load("w-0", 1000, queue_depth=2, queued_prefill_tokens=5000, active_requests=active)
        view.apply_load(msgspec.structs.replace(report, prefill_chunk_tokens=chunk))
        return view

    step = decode_ms(view_with(0, 4).workers["w-0"].profile, 1)
    plain, chunked = view_with(0, 4).workers["w-0"], view_with(512, 4).workers["w-0"]
    # the queue: ceil(5000 / 512) = 10 iterations beyond the step and a half counted without a budget
    assert chunked.base_queue_ms - plain.base_queue_ms == pytest.approx(10 * step)
    # no running batch: nothing to carry, budget or not
    assert view_with(512, 0).workers["w-0"].base_queue_ms == view_with(0, 0).workers["w-0"].base_queue_ms
    # the new prompt: 2,000 new tokens in 4 iterations, 3 more steps than one
    req = request("r1", prompt(2000))
    with_budget = Router(view_with(512, 4), RouterSettings()).price(req, 1001, "w-0")
    without = Router(view_with(0, 4), RouterSettings()).price(req, 1001, "w-0")
    assert with_budget.recompute_ms - without.recompute_ms == pytest.approx(3 * step)
    assert with_budget.ttft_ms - without.ttft_ms == pytest.approx(13 * step)
    # what is assigned to it waits ahead of the next request with its steps: 4 more than without
    views = {chunk: view_with(chunk, 4) for chunk in (0, 512)}
    for view in views.values():
        d = Router(view, RouterSettings()).decide(req, 1001)
        assert d.assignment is not None and d.assignment.worker_id == "w-0"
    pending = {chunk: view.workers["w-0"].pending_total_ms for chunk, view in views.items()}
    assert pending[512] - pending[0] == pytest.approx(4 * step)
