"""The wait for a place in a full batch: what each engine reports as ``slot_wait_steps``."""

from __future__ import annotations

import msgspec
import pytest

from services.worker.batch_slots import OUTPUT_MEMORY, OutputLengths, slot_wait_steps


def test_the_queued_requests_take_the_first_places_that_free_up() -> None:
    # the module docstring's example: places free after 10, 35, 60 and 100 steps; two are queued
    assert slot_wait_steps([100, 10, 60, 35], queued=2, slots=4, typical=100) == 60
    assert slot_wait_steps([100, 10, 60, 35], queued=0, slots=4, typical=100) == 10
    # room in the batch, or no limit: no wait
    assert slot_wait_steps([100, 10], queued=0, slots=4, typical=100) == 0
    assert slot_wait_steps([100, 10, 60, 35], queued=9, slots=0, typical=100) == 0
    # past one turnover: the fourth place after the two that free first and the two after them
    assert slot_wait_steps([5, 20], queued=3, slots=2, typical=50) == 20 + 50
    assert slot_wait_steps([5, 20], queued=4, slots=2, typical=50) == 5 + 2 * 50


def test_a_running_request_is_expected_to_end_at_the_typical_length_and_never_past_its_limit() -> None:
    lengths = OutputLengths()
    assert lengths.steps_left(generated=10, max_tokens=64) == 54  # nothing finished yet: its limit
    lengths.add(40)
    assert lengths.mean == 40
    assert lengths.steps_left(10, 64) == 30 and lengths.steps_left(10, 20) == 10
    assert lengths.steps_left(45, 64) == 1  # past the typical length: about to end
    lengths.add(40 + OUTPUT_MEMORY)  # one long answer moves the mean by one token
    assert lengths.mean == pytest.approx(41)


def test_the_builtin_engine_reports_the_wait_of_a_full_batch() -> None:
    from tests.worker.test_worker_engine import _engine, _prompt, _req, _run

    eng = _engine(max_batch=2)
    for i, n in enumerate((30, 40)):
        eng.add_request(_req(f"r{i}", _prompt(n, seed=i), max_tokens=20))
    eng.step()  # both admitted; the shorter prompt is prefilled and has its first token
    left = sorted(20 - len(s.output) for s in eng._running)
    assert left == [19, 20]
    # the batch is full: a request queued now takes the first place that frees up
    assert eng.load().slot_wait_steps == 19
    eng.add_request(_req("r2", _prompt(20, seed=7), max_tokens=8))
    load = eng.load()
    assert (load.queue_depth, load.active_requests) == (1, 2)
    assert load.slot_wait_steps == 20  # behind the queued one: the second place
    _run(eng)
    # the answers ran to their limits (20, 20, 8): the typical length follows them
    assert eng._outputs.mean is not None and 8 < eng._outputs.mean <= 20


def test_the_wait_is_priced_with_the_workers_decode_step() -> None:
    from kvmesh_core.costmodel import decode_ms
    from services.scheduler.view import FleetView
    from tests.scheduler.factories import CPU, load

    def base(steps: int) -> float:
        view = FleetView(block_size=16)
        view.apply_load(msgspec.structs.replace(load("w-0", 1000, active_requests=8), slot_wait_steps=steps))
        return view.workers["w-0"].base_queue_ms

    step = decode_ms(CPU, 1)
    assert base(40) - base(0) == pytest.approx(40 * step)


def test_calibration_leaves_no_answer_length_and_decode_steps_are_timed_as_they_run() -> None:
    from tests.worker.test_worker_engine import _engine, _prompt, _req, _run

    eng = _engine(max_batch=2)
    eng.calibrate(short=32, long=64, decode_ctx=32)
    assert eng._outputs.mean is None  # its one-token answers would say real ones end at once
    assert eng.load().recent_decode_ms_per_step == 0  # none run yet: the report keeps the calibrated step
    _run(eng, *(_req(f"r{i}", _prompt(30, seed=i), max_tokens=12) for i in range(2)))
    assert eng._outputs.mean == 12
    assert eng.load().recent_decode_ms_per_step == eng._step_meter.ms > 0
    # what the LoadReport says: the measured step, else the calibrated one
    import dataclasses

    from kvmesh_core.costmodel import PerfProfile
    from services.worker.reports import WorkerIdentity, build_load_report

    ident = WorkerIdentity("w", "m", "builtin", 16, 1024, 4096, "127.0.0.1:1", True, 0)
    profile = eng.calibrate(short=32, long=64, decode_ctx=32)
    report = build_load_report(ident, eng.load(), profile, 0, False)
    assert report.recent_decode_ms_per_step == eng._step_meter.ms
    assert report.decode_ms_per_step == profile.decode_ms_per_step  # the intake's: calibrated
    # the scheduler prices waits with the recent step, and with the calibrated one until there is one
    assert PerfProfile.from_load_report(report).decode_ms_per_step == eng._step_meter.ms
    unmeasured = build_load_report(
        ident, dataclasses.replace(eng.load(), recent_decode_ms_per_step=0.0), profile, 0, False
    )
    assert PerfProfile.from_load_report(unmeasured).decode_ms_per_step == profile.decode_ms_per_step
