"""Router edge cases: deadlines, no workers, lost and stale workers, overload holds."""

from __future__ import annotations

from schemas.messages import Completion, KvEvent, WorkerLost
from services.scheduler.router import Router, RouterSettings
from services.scheduler.view import FleetView, ViewSettings

from .factories import load, prompt, request, stored


def two_workers() -> FleetView:
    view = FleetView()
    view.apply_load(load("w-0"))
    view.apply_load(load("w-1"))
    return view


def test_request_past_deadline_is_rejected_with_clear_error() -> None:
    router = Router(two_workers(), RouterSettings())
    d = router.decide(request("r1", prompt(40), deadline_ms=900), 1000)
    assert d.assignment is None and not d.deferred
    assert d.rejection is not None
    assert (d.rejection.request_id, d.rejection.finish_reason) == ("r1", "rejected")
    assert "deadline" in (d.rejection.error or "")
    ok = router.decide(request("r2", prompt(40), deadline_ms=1000), 1000)
    assert ok.assignment is not None  # deadline_ms == now is still on time


def test_no_live_workers_holds_then_rejects() -> None:
    router = Router(FleetView(), RouterSettings(no_worker_hold_ms=2000))
    req = request("r1", prompt(40), arrival_ms=1000)
    held = router.decide(req, 1500)
    assert held.deferred and held.reason == "no_live_workers" and held.rejection is None
    d = router.decide(req, 3000)
    assert d.rejection is not None and "no live worker" in (d.rejection.error or "")
    # with a deadline it waits until then, not no_worker_hold_ms
    timed = request("r2", prompt(40), arrival_ms=1000, deadline_ms=20_000)
    assert router.decide(timed, 19_000).deferred
    late = router.decide(timed, 20_001)
    assert late.rejection is not None and late.reason == "deadline"


def test_timed_out_and_draining_workers_are_not_live() -> None:
    view = FleetView(settings=ViewSettings(worker_timeout_ms=10_000))
    view.apply_load(load("w-0", 1000))
    view.apply_load(load("w-1", 5000))
    view.apply_load(load("w-2", 5000, draining=True))
    assert view.live_workers(11_000) == ["w-0", "w-1"]
    assert view.live_workers(11_001) == ["w-1"]
    view.apply_load(load("w-0", 11_001))  # it reports again
    assert view.live_workers(11_002) == ["w-0", "w-1"]
    assert view.live_workers(15_001) == ["w-0"]


def test_lost_worker_is_never_assigned_and_its_blocks_are_gone() -> None:
    view = two_workers()
    req = request("r1", prompt(100))
    view.apply_kv_event(stored("w-0", req.block_hashes))
    view.apply_worker_lost(WorkerLost("w-0", last_seen_ms=1000, declared_ms=1500))
    assert view.index.worker_blocks("w-0") == 0
    assert view.live_workers(1600) == ["w-1"]
    # stale records of the lost worker read after the WorkerLost change nothing
    view.apply_load(load("w-0", 1200))
    view.apply_kv_event(stored("w-0", req.block_hashes, event_ms=1400))
    assert view.live_workers(1600) == ["w-1"]
    assert view.index.longest_prefix(req.block_hashes) == {}
    router = Router(view, RouterSettings())
    for i in range(5):
        a = router.decide(request(f"q{i}", prompt(100)), 1600 + i).assignment
        assert a is not None and a.worker_id == "w-1" and a.fetch == []


def test_lost_worker_that_reports_again_comes_back() -> None:
    view = two_workers()
    view.apply_worker_lost(WorkerLost("w-0", last_seen_ms=1000, declared_ms=1500))
    view.apply_load(load("w-0", 2000))
    view.apply_kv_event(stored("w-0", [1, 2], event_ms=2001))
    assert view.live_workers(2100) == ["w-0", "w-1"]
    assert view.index.worker_blocks("w-0") == 2


def test_cleared_event_drops_worker_blocks() -> None:
    view = two_workers()
    view.apply_kv_event(stored("w-0", [1, 2, 3]))
    view.apply_kv_event(KvEvent("w-0", "cleared", "gpu", []))
    assert view.index.worker_blocks("w-0") == 0 and len(view.index) == 0


def test_overloaded_fleet_defers_until_max_hold() -> None:
    view = FleetView()
    view.apply_load(load("w-0", queue_depth=10, queued_prefill_tokens=20_000))
    router = Router(view, RouterSettings(max_queue_ms=100.0, max_hold_ms=5000))
    req = request("r1", prompt(40), arrival_ms=1000)
    d = router.decide(req, 1000)
    assert d.deferred and d.reason == "overloaded" and d.candidates[0].worker_id == "w-0"
    late = router.decide(req, 6000)
    assert late.assignment is not None and late.assignment.worker_id == "w-0"


def test_tenant_cap_defers_until_completion() -> None:
    view = two_workers()
    router = Router(view, RouterSettings(tenant_max_inflight=2))
    got = [router.decide(request(f"r{i}", prompt(20, i), tenant="a"), 1000) for i in range(3)]
    assert [d.assignment is not None for d in got] == [True, True, False]
    assert got[2].deferred and got[2].reason == "tenant_cap"
    assert router.decide(request("b1", prompt(20), tenant="b"), 1000).assignment is not None
    first = got[0].assignment
    assert first is not None
    view.note_completion(Completion("r0", first.request.session_id, first.worker_id, "stop", 20, 8))
    assert router.decide(request("r2", prompt(20, 2), tenant="a"), 1001).assignment is not None


def test_decision_seq_and_scheduler_id_are_stamped() -> None:
    router = Router(two_workers(), RouterSettings(), scheduler_id="scheduler-7")
    a1 = router.decide(request("r1", prompt(20)), 1000).assignment
    a2 = router.decide(request("r2", prompt(20, 1)), 1001).assignment
    assert a1 is not None and a2 is not None
    assert (a1.scheduler_id, a1.decision_seq, a2.decision_seq) == ("scheduler-7", 1, 2)


def test_note_assignment_is_idempotent() -> None:
    view = two_workers()
    router = Router(view, RouterSettings())
    a = router.decide(request("r1", prompt(200)), 1000).assignment
    assert a is not None
    before = view.queue_ms(view.workers[a.worker_id], 1000)
    view.note_assignment(a, 1000)  # a driver that also notes must not double-count
    assert view.queue_ms(view.workers[a.worker_id], 1000) == before
    assert view.tenant_inflight("acme") == 1
