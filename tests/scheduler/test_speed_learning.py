"""The view learns each worker's real prefill speed from its Completions, deterministically."""

from __future__ import annotations

import pytest

from kvmesh_core.costmodel import recompute_ms
from schemas.messages import Completion
from services.scheduler.router import Router, RouterSettings
from services.scheduler.view import FleetView, ViewSettings

from .factories import BS, CPU, load, prompt, request

NOW = 1000


def _done(rid: str, worker: str, recomputed: int, cached: int, factor: float) -> Completion:
    measured = recompute_ms(CPU, recomputed, cached) * factor
    return Completion(
        rid,
        f"s-{rid}",
        worker,
        "stop",
        recomputed + cached,
        4,
        reused_tokens=cached,
        recomputed_tokens=recomputed,
        prefill_ms=measured,
    )


def _view(learn: bool = True) -> FleetView:
    view = FleetView(BS, ViewSettings(learn_speed=learn))
    for w in ("w-0", "w-1"):
        view.apply_load(load(w, NOW, queued_prefill_tokens=2000, queue_depth=2))
    return view


def test_a_slow_worker_is_priced_slower_and_gets_less_work() -> None:
    view = _view()
    before = view.queue_ms(view.workers["w-0"], NOW)
    for i in range(7):
        view.note_completion(_done(f"a{i}", "w-0", 500 + 100 * i, 64, factor=2.0))
        view.note_completion(_done(f"b{i}", "w-1", 500 + 100 * i, 64, factor=1.0))
    view.fold_speed()
    assert view.queue_ms(view.workers["w-0"], NOW) == before  # 7 samples: a cold engine's, maybe
    view.note_completion(_done("a7", "w-0", 1200, 64, factor=2.0))
    assert view.queue_ms(view.workers["w-0"], NOW) == before  # samples wait for the next decision
    view.fold_speed()
    assert view.speed["w-0"].factor == pytest.approx(2.0)
    assert view.speed["w-1"].factor == pytest.approx(1.0)
    assert view.queue_ms(view.workers["w-0"], NOW) == pytest.approx(2 * before, rel=0.05)
    # a new report keeps the learned factor (the worker still publishes its old profile)
    view.apply_load(load("w-0", NOW + 1, queued_prefill_tokens=2000, queue_depth=2))
    assert view.workers["w-0"].profile.prefill_ms_per_token == pytest.approx(2 * CPU.prefill_ms_per_token)
    d = Router(view, RouterSettings(policy="kvmesh")).decide(request("r", prompt(300)), NOW + 1)
    assert d.assignment is not None and d.assignment.worker_id == "w-1"


def test_learning_off_keeps_the_published_profile() -> None:
    view = _view(learn=False)
    view.note_completion(_done("a", "w-0", 800, 0, factor=3.0))
    assert "w-0" not in view.speed
    assert view.workers["w-0"].profile.prefill_ms_per_token == CPU.prefill_ms_per_token


def test_errors_and_absurd_reports_are_bounded() -> None:
    view = _view()
    view.note_completion(Completion("e", "s", "w-0", "error", 10, 0, error="boom", prefill_ms=1e9))
    assert "w-0" not in view.speed
    for i in range(8):
        view.note_completion(_done(f"x{i}", "w-0", 800, 0, factor=1000.0))
    view.fold_speed()
    assert view.speed["w-0"].factor == pytest.approx(4.0)  # each sample moves it at most 4x
    assert view.workers["w-0"].profile.prefill_ms_per_token == pytest.approx(4 * CPU.prefill_ms_per_token)


def test_completions_between_two_decisions_teach_the_same_in_any_order() -> None:
    # they arrive over several reply partitions, in no set order: a replay must learn the same
    events = [
        _done(f"r{i}", "w-0", 100 + 37 * i, 16 * (i % 3), factor=1.0 + 0.1 * (i % 5)) for i in range(20)
    ]
    a, b = _view(), _view()
    for batch in (events[:12], events[12:]):
        for c in batch:
            a.note_completion(c)
        for c in sorted(batch, key=lambda c: -c.prefill_ms):
            b.note_completion(c)
        a.fold_speed()
        b.fold_speed()
    assert a.speed["w-0"].factor == b.speed["w-0"].factor != 1.0
    assert a.workers["w-0"].base_queue_ms == b.workers["w-0"].base_queue_ms
