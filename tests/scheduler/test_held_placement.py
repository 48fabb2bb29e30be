"""Where held requests wait and who places them: parking on a busy worker, pulls by a worker with room,
the held backlog in kvmesh's charge for extra work, and prefixes that active requests are computing."""

from __future__ import annotations

import msgspec

from kvmesh.replay.exact import HeldView
from schemas.messages import Completion, DecisionInputs, LoadReport, WorkerLost
from services.scheduler.fairness import FairDispatcher
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.router import Router, RouterSettings
from services.scheduler.view import FleetView

from .factories import load, prompt, request, stored

CACHED = prompt(2048, 5)  # 128 blocks; about 144 ms to recompute on the cpu-tiny profile


def two_workers(view: FleetView, w0_tokens: int, w1_tokens: int = 0, now_ms: int = 1000) -> FleetView:
    """A slow link (fetching 128 blocks takes seconds), so a worker without the prompt recomputes it."""
    for w, tokens in (("w-0", w0_tokens), ("w-1", w1_tokens)):
        view.apply_load(idle(w, now_ms, queue_depth=int(tokens > 0), queued_prefill_tokens=tokens))
    return view


def idle(worker: str, now_ms: int, **kw: int) -> LoadReport:
    return load(worker, now_ms, link_gbps=0.01, **kw)  # type: ignore[arg-type]


def hit(rid: str, arrival_ms: int = 1000) -> object:
    return request(rid, [*CACHED, 1, 2, 3], arrival_ms=arrival_ms, session=f"s-{rid}")


def test_a_request_waiting_for_its_busy_worker_does_not_block_the_next() -> None:
    """The first request waits parked on w-0, which holds its prompt and has no room; the one behind
    it, cached nowhere, goes to w-1 at once (the dispatcher used to stop at the first)."""
    view = two_workers(FleetView(), w0_tokens=2000)  # ~140 ms queued
    view.apply_kv_event(stored("w-0", request("x", CACHED).block_hashes))
    disp = FairDispatcher(Router(view, RouterSettings(max_queue_ms=100)))
    disp.submit(hit("a"))  # type: ignore[arg-type]
    disp.submit(request("b", prompt(64, 9), arrival_ms=1001))
    out = disp.drain(1001)
    assert [(d.assignment.request.request_id, d.assignment.worker_id) for d in out if d.assignment] == [
        ("b", "w-1")
    ]
    # "a" is not pulled: recomputing its 2,051 tokens on w-1 takes longer than w-0's queue
    assert len(disp) == 1 and disp.pulled == 0 and disp.deferrals["overloaded"] == 1
    view.apply_load(idle("w-0", 1050))  # w-0 has room again
    again = disp.drain(1050)
    assert [(d.assignment.request.request_id, d.assignment.worker_id, d.pulled) for d in again] == [
        ("a", "w-0", False)
    ]
    assert again[0].assignment is not None and again[0].assignment.reuse_blocks == 128


def test_a_worker_with_room_pulls_what_waits_long_elsewhere() -> None:
    """w-0 has ~1.4 s queued: w-1, with room and nothing of its own, pulls the request parked on w-0,
    recompute included, and the decision says it was pulled."""
    view = two_workers(FleetView(), w0_tokens=20_000, w1_tokens=20_000)
    view.apply_kv_event(stored("w-0", request("x", CACHED).block_hashes))
    disp = FairDispatcher(Router(view, RouterSettings(max_queue_ms=100)))
    disp.submit(hit("a"))  # type: ignore[arg-type]
    assert disp.drain(1001) == [] and len(disp) == 1  # both full: parked on w-0, its holder
    view.apply_load(idle("w-1", 1100))
    out = disp.drain(1100)
    assert len(out) == 1 and out[0].pulled and disp.pulled == 1
    a = out[0].assignment
    assert a is not None and a.worker_id == "w-1" and a.reuse_blocks == 0
    assert out[0].held == 0 and len(disp) == 0


def test_a_pull_passes_the_next_in_line_only_by_more_than_the_work_it_adds() -> None:
    """Both workers are full, then w-1 has room. "old" (held for w-0, which holds its prompt) comes
    before "mine" (held for w-1, which holds its own) by 10 ms, but pulling it would cost w-1 a full
    recompute, charged once per request held per live worker: "mine" goes first, then w-1 pulls
    "old". The short prompt cached nowhere adds no work, so it is pulled in its order."""
    view = two_workers(FleetView(), w0_tokens=20_000, w1_tokens=20_000)  # ~1.4 s queued each
    view.apply_kv_event(stored("w-0", request("x", CACHED).block_hashes))
    own = prompt(2048, 7)
    view.apply_kv_event(stored("w-1", request("y", own).block_hashes))
    disp = FairDispatcher(Router(view, RouterSettings(max_queue_ms=100)))
    disp.submit(request("short", prompt(16, 1), arrival_ms=999))
    disp.submit(hit("old", arrival_ms=1000))  # type: ignore[arg-type]
    disp.submit(request("mine", [*own, 4, 5, 6], arrival_ms=1010))
    for i in range(20):  # more requests for w-0
        disp.submit(request(f"bg{i}", [*CACHED, 100 + i], arrival_ms=1185))
    assert disp.drain(1050) == [] and len(disp) == 23
    view.apply_load(idle("w-1", 1100))
    out = disp.drain(1100)
    placed = [(d.assignment.request.request_id, d.assignment.worker_id) for d in out if d.assignment]
    assert placed == [("short", "w-1"), ("mine", "w-1"), ("old", "w-1")]
    assert [d.pulled for d in out][1:] == [False, True]
    assert len(disp) == 20  # w-1 is full again: the rest wait for w-0


def test_a_request_parked_on_a_worker_that_is_lost_is_decided_again() -> None:
    view = two_workers(FleetView(), w0_tokens=20_000, w1_tokens=20_000)
    view.apply_kv_event(stored("w-0", request("x", CACHED).block_hashes))
    disp = FairDispatcher(Router(view, RouterSettings(max_queue_ms=100)))
    disp.submit(hit("a"))  # type: ignore[arg-type]
    assert disp.drain(1001) == []
    view.apply_worker_lost(WorkerLost("w-0", 1000, 1002))
    out = disp.drain(1003)  # w-1 is still full: "a" now waits for w-1, the one live worker
    assert out == [] and disp.deferrals["overloaded"] == 2
    view.apply_load(idle("w-1", 1010))
    out = disp.drain(1010)
    assert [(d.assignment.request.request_id, d.assignment.worker_id, d.pulled) for d in out] == [
        ("a", "w-1", False)
    ]


def test_a_parked_request_is_placed_anyway_past_the_longest_hold() -> None:
    """The safety valve (max_hold_ms) reaches requests parked on a worker that never has room."""
    view = two_workers(FleetView(), w0_tokens=20_000, w1_tokens=20_000)
    view.apply_kv_event(stored("w-0", request("x", CACHED).block_hashes))
    disp = FairDispatcher(Router(view, RouterSettings(max_queue_ms=100, max_hold_ms=500)))
    disp.submit(hit("a"))  # type: ignore[arg-type]
    disp.submit(request("b", prompt(64, 2), arrival_ms=1200))
    for now in (1001, 1250, 1499):
        assert disp.drain(now) == []
    out = disp.drain(1500)
    assert [(d.assignment.request.request_id, d.assignment.worker_id) for d in out if d.assignment] == [
        ("a", "w-0")
    ]
    assert len(disp) == 1
    late = disp.drain(1700)
    assert [d.assignment.request.request_id for d in late if d.assignment] == ["b"] and len(disp) == 0


def test_the_held_backlog_keeps_a_turn_with_the_worker_holding_its_history() -> None:
    """w-0 holds the prompt and has 300 ms queued; w-1 is idle. With nothing held, recomputing on w-1
    (144 ms plus the extra-work charge) wins; with 20 requests held, each of them would queue behind
    that extra work somewhere, and w-0 wins. Replay reads the count from the record."""
    view = two_workers(HeldView(), w0_tokens=4000)
    view.apply_kv_event(stored("w-0", request("x", CACHED).block_hashes))
    router = Router(view, RouterSettings())
    req = hit("a")
    assert view.decide_noting(router, req, 1000, None).candidates[0].worker_id == "w-1"  # type: ignore[arg-type]
    view.held = 20
    d = router.decide(req, 1000)  # type: ignore[arg-type]
    assert d.assignment is not None and d.assignment.worker_id == "w-0" and d.held == 20
    # a record of that decision replays to it on a view in the same state, held count included
    replay_view = two_workers(HeldView(), w0_tokens=4000)
    replay_view.apply_kv_event(stored("w-0", request("x", CACHED).block_hashes))
    rec = msgspec.structs.replace(d.assignment, inputs=DecisionInputs(1000, held=20))
    again = replay_view.decide_noting(Router(replay_view, RouterSettings()), req, 1000, rec)  # type: ignore[arg-type]
    assert again.assignment is not None and again.assignment.worker_id == "w-0"
    without = msgspec.structs.replace(d.assignment, inputs=DecisionInputs(1000, held=0))
    other = two_workers(HeldView(), w0_tokens=4000)
    other.apply_kv_event(stored("w-0", request("x", CACHED).block_hashes))
    moved = other.decide_noting(Router(other, RouterSettings()), req, 1000, without)  # type: ignore[arg-type]
    assert moved.assignment is not None and moved.assignment.worker_id == "w-1"


def test_replay_places_a_pulled_request_where_it_was_pulled() -> None:
    """The policy alone would pick w-0 (it holds the prompt); the record says w-1 pulled it."""
    view = two_workers(HeldView(), w0_tokens=0)
    view.apply_kv_event(stored("w-0", request("x", CACHED).block_hashes))
    router = Router(view, RouterSettings())
    req = hit("a")
    assert router.decide(req, 1000).candidates[0].worker_id == "w-0"  # type: ignore[arg-type]
    pulled = router.decide(req, 1000, pull_to="w-1")  # type: ignore[arg-type]
    assert pulled.pulled and pulled.assignment is not None and pulled.assignment.worker_id == "w-1"
    fresh = two_workers(HeldView(), w0_tokens=0)
    fresh.apply_kv_event(stored("w-0", request("x", CACHED).block_hashes))
    rec = msgspec.structs.replace(pulled.assignment, inputs=DecisionInputs(1000, pulled=True))
    d = fresh.decide_noting(Router(fresh, RouterSettings()), req, 1000, rec)  # type: ignore[arg-type]
    assert d.assignment is not None and d.assignment.worker_id == "w-1" and d.pulled
    # and the scheduler's metrics count it
    metrics = SchedulerMetrics("kvmesh", lambda: {}, lambda: 0)
    metrics.assigned(msgspec.structs.replace(pulled.assignment, inputs=DecisionInputs(1000)))
    assert metrics.value("pulled_total") == 0
    metrics.assigned(rec)
    assert metrics.value("pulled_total") == 1


def test_a_prefix_an_active_request_is_computing_counts_as_cached_on_its_worker() -> None:
    """The first turn is assigned to w-1 and has not run (no KV events yet); the next turn, which
    extends it, goes to w-1 too and expects its blocks there. Once the first turn completes without
    its blocks showing up, the credit is gone."""
    view = two_workers(FleetView(), w0_tokens=0)
    router = Router(view, RouterSettings())
    turn1 = prompt(1024, 3)
    a1 = router.decide(request("t1", turn1, session="s"), 1000).assignment
    assert a1 is not None
    w = a1.worker_id
    turn2 = request("t2", [*turn1, *prompt(64, 4)], session="s", arrival_ms=1001)
    a2 = router.decide(turn2, 1001).assignment
    assert a2 is not None and a2.worker_id == w and a2.reuse_blocks == 64
    view.note_completion(Completion("t1", "s", w, "stop", 1024, 8))
    view.note_completion(Completion("t2", "s", w, "stop", 1088, 8))
    a3 = router.decide(request("t3", [*turn1, *prompt(64, 4)], session="s", arrival_ms=1002), 1002).assignment
    assert a3 is not None and a3.reuse_blocks == 0


def test_a_turn_is_not_pulled_to_compute_a_history_its_predecessor_is_computing_elsewhere() -> None:
    """Far past capacity a conversation's turns queue together. Both turns were parked before either
    was assigned, when their history was cached nowhere: the first on w-0, the second on w-1. w-0
    then takes the first turn, and w-2 gets room. Pulling the second turn there would compute the
    same 2,048-token history a second time, beside w-0: the pull charges that work against the least
    the fleet could do now (on w-0, behind the first turn), not against its price when parked, and
    the turn moves to wait for w-0, where it reuses the history."""
    view = FleetView()
    for w, tokens in (("w-0", 20_000), ("w-1", 21_000), ("w-2", 22_000)):
        view.apply_load(idle(w, 1000, queue_depth=1, queued_prefill_tokens=tokens))
    history = prompt(2048, 11)
    disp = FairDispatcher(Router(view, RouterSettings(max_queue_ms=100)))
    disp.submit(request("t1", [*history, 1], arrival_ms=1000, session="chat"))
    assert disp.drain(1001) == []  # parked on w-0, the least loaded
    view.apply_load(idle("w-0", 1010, queue_depth=1, queued_prefill_tokens=23_000))
    disp.submit(request("t2", [*history, 1, *prompt(256, 12)], arrival_ms=1011, session="chat"))
    assert disp.drain(1012) == []  # parked on w-1, the least loaded now
    view.apply_load(idle("w-0", 1100))
    first = disp.drain(1100)
    assert [(d.assignment.request.request_id, d.assignment.worker_id) for d in first if d.assignment] == [
        ("t1", "w-0")
    ]
    # a backlog of held requests, after the second turn in the order
    view.apply_kv_event(stored("w-1", request("x", CACHED).block_hashes))
    for i in range(40):
        disp.submit(request(f"bg{i}", [*CACHED, 100 + i], arrival_ms=1185))
    assert disp.drain(1190) == [] and len(disp) == 41
    view.apply_load(idle("w-2", 1200))
    assert "t2" not in [d.assignment.request.request_id for d in disp.drain(1200) if d.assignment]
    assert disp.moved == 1 and disp.pulled == 0
    metrics = SchedulerMetrics("kvmesh", lambda: disp.deferrals, lambda: len(disp), lambda: disp.moved)
    assert metrics.value("parked_moves_total") == 1
    # it waits parked on w-0 now (not w-1), so w-0, once it has stored the history and has room,
    # places it at once, where it reuses the history
    view.apply_kv_event(stored("w-0", request("y", [*history, 1]).block_hashes, event_ms=1290))
    view.apply_load(idle("w-0", 1300))
    placed = [d for d in disp.drain(1300) if d.assignment and d.assignment.request.request_id == "t2"]
    assert len(placed) == 1 and not placed[0].pulled
    a = placed[0].assignment
    assert a is not None and a.worker_id == "w-0" and a.reuse_blocks == 128
