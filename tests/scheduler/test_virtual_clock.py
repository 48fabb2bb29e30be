"""Fair-queueing virtual time for held requests (services/scheduler/virtual_clock.py), alone and in
the dispatcher: the deeper the held backlog, the further a short prompt passes a long one."""

from __future__ import annotations

import math

import pytest

from services.scheduler.fairness import FairDispatcher
from services.scheduler.policies import least_prefill_ms
from services.scheduler.router import Router, RouterSettings
from services.scheduler.view import FleetView
from services.scheduler.virtual_clock import VirtualClock

from .factories import load, prompt, request


def test_the_clock_runs_at_real_speed_until_the_backlog_outgrows_the_fleet() -> None:
    clock = VirtualClock(ahead=0.5)
    clock.advance(1000, held=0, live=4)
    assert clock.at(1000) == 1000.0
    clock.advance(1100, held=8, live=4)  # half of 8 held ahead of each: fits 4 workers
    assert clock.at(1100) == 1100.0
    clock.advance(1200, held=16, live=4)  # 8 ahead of each over 4 workers: half speed
    assert clock.at(1200) == pytest.approx(1150.0)
    clock.advance(1300, held=16, live=0)  # no live worker serves anything: time stands still
    assert clock.at(1300) == pytest.approx(1150.0)
    # an event time before the last advance (a lagging consumer, a request re-decided after its
    # worker was lost) counts back at real speed: it never lands after requests that came later
    assert clock.at(1250) == pytest.approx(1100.0)
    clock.advance(1250, held=100, live=4)  # and does not move the clock
    assert clock.at(1300) == pytest.approx(1150.0)


def test_a_share_of_zero_is_arrival_time_and_a_negative_one_is_refused() -> None:
    clock = VirtualClock(ahead=0.0)
    clock.advance(0, held=0, live=1)
    clock.advance(500, held=10_000, live=1)
    assert clock.at(500) == 500.0
    for bad in (-0.1, math.nan):
        with pytest.raises(ValueError):
            VirtualClock(ahead=bad)


def _deep_backlog(ahead: float) -> tuple[FleetView, FairDispatcher, float]:
    """Two workers over the 100 ms late-binding threshold; 40 short prompts held, then a long one,
    then a short one arriving later than the long one's own work."""
    view = FleetView()
    for i in range(2):
        view.apply_load(load(f"w-{i}", queue_depth=1, queued_prefill_tokens=2000))
    disp = FairDispatcher(Router(view, RouterSettings(max_queue_ms=100)), ahead=ahead)
    for i in range(40):
        disp.submit(request(f"bg{i}", prompt(32, 100 + i), arrival_ms=1000))
    long_req = request("long", prompt(2048, 2), arrival_ms=1001)
    disp.submit(long_req)
    work = least_prefill_ms(view, long_req, 1001)
    assert work > 50
    late = 1001 + int(work) + 5
    disp.submit(request("late", prompt(32, 3), arrival_ms=late))
    assert disp.drain(late) == [] and len(disp) == 42
    return view, disp, work


def _order(view: FleetView, disp: FairDispatcher) -> list[str]:
    for i in range(2):
        view.apply_load(load(f"w-{i}", report_ms=60_000))
    return [d.assignment.request.request_id for d in disp.drain(60_000) if d.assignment]


@pytest.mark.parametrize("ahead", [0.5, 1.0])
def test_behind_a_deep_backlog_a_short_prompt_passes_a_long_one_that_came_before_it(ahead: float) -> None:
    """41 held over 2 live workers: virtual time runs at 2 / (ahead * 41) of real time, so "late",
    which arrived after the long prompt's own work had passed in real time, goes before it."""
    view, disp, _ = _deep_backlog(ahead)
    order = _order(view, disp)
    assert len(order) == 42
    assert order.index("late") < order.index("long")


def test_in_arrival_order_plus_work_it_does_not() -> None:
    view, disp, _ = _deep_backlog(0.0)
    order = _order(view, disp)
    assert order.index("long") < order.index("late")


def test_a_long_prompt_is_not_passed_forever() -> None:
    """A short prompt that arrives after the long one's work has passed in *virtual* time goes after
    it: with 41 held over 2 workers and a share of 0.5, about 10x its work in real time."""
    view, disp, work = _deep_backlog(0.5)
    slow = 2 / (0.5 * 42)  # the rate once "late" is held too
    much_later = int(1001 + int(work) + 5 + work / slow * 1.2)
    disp.submit(request("much_later", prompt(32, 4), arrival_ms=much_later))
    order = _order(view, disp)
    assert order.index("late") < order.index("long") < order.index("much_later")


def test_the_share_is_a_scheduler_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from services.scheduler.config import SchedulerSettings
    from services.scheduler.service import SchedulerService
    from services.scheduler.virtual_clock import AHEAD

    assert SchedulerSettings().held_ahead == AHEAD
    monkeypatch.setenv("KVMESH_SCHEDULER_HELD_AHEAD", "0")
    service = SchedulerService(SchedulerSettings())  # builds view, router and dispatcher; no I/O yet
    assert service.dispatcher.held_ahead == 0.0
    monkeypatch.setenv("KVMESH_SCHEDULER_HELD_AHEAD", "-1")
    with pytest.raises(ValidationError):
        SchedulerSettings()
