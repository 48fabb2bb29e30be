"""Tenant fairness: a flood from one tenant does not starve another; queued deadlines expire."""

from __future__ import annotations

import msgspec

from schemas.messages import Completion
from services.scheduler.fairness import FairDispatcher
from services.scheduler.policies import least_prefill_ms
from services.scheduler.router import Router, RouterSettings
from services.scheduler.view import FleetView

from .factories import load, prompt, request, stored


def fleet() -> FleetView:
    view = FleetView()
    for i in range(4):
        view.apply_load(load(f"w-{i}"))
    return view


def test_flood_does_not_starve_other_tenant() -> None:
    disp = FairDispatcher(Router(fleet(), RouterSettings()), quantum_tokens=1024)
    for i in range(200):
        disp.submit(request(f"a{i}", prompt(256, i), tenant="flood", arrival_ms=1000))
    for i in range(3):
        disp.submit(request(f"b{i}", prompt(256, 1000 + i), tenant="quiet", arrival_ms=1001))
    out = disp.drain(1001)
    order = [d.assignment.request.request_id for d in out if d.assignment]
    assert len(order) == 203 and len(disp) == 0
    quiet = [order.index(f"b{i}") for i in range(3)]
    # one quantum = 4 requests of 256 tokens: the flood's first 4, then all 3 quiet ones in round 1
    assert quiet == [4, 5, 6]
    assert order[:4] == ["a0", "a1", "a2", "a3"]  # each tenant keeps its own order


def test_flood_at_inflight_cap_lets_other_tenant_through() -> None:
    view = fleet()
    disp = FairDispatcher(Router(view, RouterSettings(tenant_max_inflight=4)))
    for i in range(50):
        disp.submit(request(f"a{i}", prompt(64, i), tenant="flood"))
    first = disp.drain(1000)
    assert [d.assignment.request.request_id for d in first if d.assignment] == ["a0", "a1", "a2", "a3"]
    disp.submit(request("b0", prompt(64, 999), tenant="quiet"))
    second = disp.drain(1001)
    assert [d.assignment.request.request_id for d in second if d.assignment] == ["b0"]
    assert len(disp) == 46
    a0 = first[0].assignment
    assert a0 is not None
    view.note_completion(Completion("a0", a0.request.session_id, a0.worker_id, "stop", 64, 8))
    third = disp.drain(1002)
    assert [d.assignment.request.request_id for d in third if d.assignment] == ["a4"]


def test_queued_request_past_deadline_is_rejected_at_next_drain() -> None:
    disp = FairDispatcher(Router(FleetView(), RouterSettings(no_worker_hold_ms=10_000)))
    disp.submit(request("r1", prompt(32), deadline_ms=1500))
    disp.submit(request("r2", prompt(32)))
    assert disp.drain(1000) == []  # no workers yet: held
    out = disp.drain(1600)
    assert [(d.rejection.request_id, d.rejection.finish_reason) for d in out if d.rejection] == [
        ("r1", "rejected")
    ]
    assert len(disp) == 1


def test_each_held_deadline_expires_in_turn_after_earlier_ones_went() -> None:
    # The dispatcher skips the scan while no held deadline can have passed; after one expires (or its
    # holder is cancelled) the next earliest deadline must still be found.
    disp = FairDispatcher(Router(FleetView(), RouterSettings(no_worker_hold_ms=60_000)))
    disp.submit(
        request("r0", prompt(32, 0))
    )  # the head, held (no workers): only the scan can expire the rest
    disp.submit(request("r1", prompt(32, 1), deadline_ms=1500))
    disp.submit(request("r2", prompt(32, 2), deadline_ms=3000))
    disp.submit(request("r3", prompt(32, 3), deadline_ms=2000))
    assert disp.drain(1000) == []
    assert disp.cancel("r3") is not None
    rejected = []
    for now in (1600, 2500, 3100):
        rejected.append([d.rejection.request_id for d in disp.drain(now) if d.rejection])
    assert rejected == [["r1"], [], ["r2"]]
    assert len(disp) == 1


def test_cancel_removes_queued_request() -> None:
    disp = FairDispatcher(Router(FleetView(), RouterSettings()))
    disp.submit(request("r1", prompt(32)))
    assert disp.cancel("r1") is not None and len(disp) == 0
    assert disp.cancel("r1") is None


def test_a_model_without_workers_holds_only_its_tenant() -> None:
    """A request whose model has no live worker waits; the other tenants' requests are decided."""
    view = FleetView()
    view.apply_load(load("w-0", 1000))
    disp = FairDispatcher(Router(view, RouterSettings()))
    disp.submit(
        msgspec.structs.replace(
            request("orphan", prompt(32), tenant="globex", deadline_ms=60_000), model="m-x"
        )
    )
    disp.submit(request("ok", prompt(32), tenant="acme"))
    out = disp.drain(1500)
    assert [d.assignment.request.request_id for d in out if d.assignment] == ["ok"]
    assert len(disp) == 1


def test_held_positions_cap_the_commit_at_the_oldest_held_request() -> None:
    from services.scheduler.held_requests import HeldPositions

    held = HeldPositions()
    held.read("a", 0, 7)
    held.read("b", 0, 3)
    held.read("c", 2, 11)
    assert held.commit_limits() == {0: 3, 2: 11}
    held.done("b")
    held.done("c")
    assert held.commit_limits() == {0: 7} and len(held) == 1


def _held_fleet() -> tuple[FleetView, FairDispatcher]:
    """Two workers with ~140 ms queued each and a 100 ms late-binding threshold: kvmesh holds."""
    view = FleetView()
    for i in range(2):
        view.apply_load(load(f"w-{i}", queue_depth=1, queued_prefill_tokens=2000))
    return view, FairDispatcher(Router(view, RouterSettings(max_queue_ms=100)))


def _release(view: FleetView, now_ms: int) -> None:
    for i in range(2):
        view.apply_load(load(f"w-{i}", report_ms=now_ms))


def test_held_requests_go_by_virtual_finish_time() -> None:
    """Arrival plus the request's own least prefill: a short prompt passes a long one that arrived a
    few ms earlier, a prompt cached on a worker counts as short, equal ones keep arrival order.

    Each held request waits parked on its best worker: ``hit`` on w-1, which holds its prompt, the
    rest on w-0 (the tie's first). Once "first" fills w-0, w-1 pulls the requests parked there in
    their order, ``hit`` among them: a prompt cached nowhere costs w-1 no more than w-0."""
    view, disp = _held_fleet()
    cached = prompt(2048, 5)
    view.apply_kv_event(stored("w-1", request("x", cached).block_hashes))
    disp.submit(request("first", prompt(2048, 1), arrival_ms=1000))  # the head: held first
    disp.submit(request("long", prompt(2048, 2), arrival_ms=1001))
    disp.submit(request("short", prompt(32, 3), arrival_ms=1005))
    disp.submit(request("hit", [*cached, 1, 2, 3], arrival_ms=1010))  # 2051 tokens, 2048 cached
    disp.submit(request("short2", prompt(32, 4), arrival_ms=1005))
    assert disp.drain(1011) == [] and len(disp) == 5
    _release(view, 1020)
    out = disp.drain(1020)
    order = [(d.assignment.request.request_id, d.assignment.worker_id, d.pulled) for d in out if d.assignment]
    assert order == [
        ("first", "w-0", False),
        ("short", "w-1", True),
        ("short2", "w-1", True),
        ("hit", "w-1", False),
        ("long", "w-1", True),
    ]
    assert disp.pulled == 3 and len(disp) == 0


def test_a_short_prompt_passes_a_long_one_only_within_its_lead() -> None:
    """No starvation: a prompt arriving later than the long one's own work goes after it."""
    view, disp = _held_fleet()
    long_req = request("long", prompt(2048, 2), arrival_ms=1001)
    disp.submit(request("first", prompt(64, 1), arrival_ms=1000))
    disp.submit(long_req)
    work = least_prefill_ms(view, long_req, 1001)
    assert work > 50
    disp.submit(request("late", prompt(32, 3), arrival_ms=1001 + int(work) + 5))
    disp.submit(request("early", prompt(32, 4), arrival_ms=1001 + int(work) - 20))
    assert disp.drain(1000 + int(work) + 10) == []
    _release(view, 5000)
    order = [d.assignment.request.request_id for d in disp.drain(5000) if d.assignment]
    assert order == ["first", "early", "long", "late"]


def test_cancel_and_expiry_keep_the_order_of_the_rest() -> None:
    view, disp = _held_fleet()
    disp.submit(request("a", prompt(64, 1), arrival_ms=1000))
    disp.submit(request("b", prompt(1024, 2), arrival_ms=1001))
    disp.submit(request("c", prompt(32, 3), arrival_ms=1002, deadline_ms=1500))
    disp.submit(request("d", prompt(32, 4), arrival_ms=1003))
    disp.submit(request("e", prompt(16, 5), arrival_ms=1004))
    assert disp.cancel("d") is not None and disp.cancel("d") is None
    assert disp.drain(1010) == []
    _release(view, 2000)
    out = disp.drain(2000)
    assert [d.assignment.request.request_id for d in out if d.assignment] == ["a", "e", "b"]
    assert [d.rejection.request_id for d in out if d.rejection] == ["c"]
    assert len(disp) == 0


def test_each_model_keeps_its_own_virtual_clock() -> None:
    """A small model's backlog does not slow the big model's clock: with its four workers and few
    held requests the big model's clock runs at real speed, so a prompt arriving later than a long
    one's own work still goes after it (no starvation), however deep the small model's queue is."""
    view, disp = _held_fleet()
    for i in range(2, 4):
        view.apply_load(load(f"w-{i}", queue_depth=1, queued_prefill_tokens=2000))
    view.apply_load(
        msgspec.structs.replace(load("s-0", queue_depth=1, queued_prefill_tokens=2000), model="small")
    )
    long_req = request("long", prompt(2048, 2), arrival_ms=1001)
    disp.submit(request("first", prompt(64, 1), arrival_ms=1000))
    disp.submit(long_req)
    work = least_prefill_ms(view, long_req, 1001)
    for i in range(8):  # the small model's backlog: eight held requests on its one worker
        small = request(f"small-{i}", prompt(64, 10 + i), arrival_ms=1002, tenant="globex")
        disp.submit(msgspec.structs.replace(small, model="small"))
    assert disp.drain(1001 + int(work)) == []
    disp.submit(request("late", prompt(32, 3), arrival_ms=1001 + int(work) + 5))
    for i in range(4):
        view.apply_load(load(f"w-{i}", report_ms=5000))
    order = [d.assignment.request.request_id for d in disp.drain(5000) if d.assignment]
    assert order == ["first", "long", "late"]
