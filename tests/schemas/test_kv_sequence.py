"""Gaps in a worker's numbered KV events: dropped and reordered records are detected, a resync
(``cleared`` then a snapshot) heals them, a restart starts the count again."""

from __future__ import annotations

from schemas.kv_sequence import ASK_AGAIN_AFTER, KvSequence
from schemas.messages import KvEvent


def ev(seq: int, kind: str = "stored", epoch: int = 100, worker: str = "w-0") -> KvEvent:
    return KvEvent(
        worker,
        kind,
        "gpu",
        [] if kind == "cleared" else [seq],
        [0] if kind != "cleared" else [],
        seq=seq,
        epoch=epoch,
    )  # type: ignore[arg-type]


def test_in_order_applies_and_a_dropped_record_asks_for_a_resync() -> None:
    s = KvSequence()
    assert [s.observe(ev(i)) for i in (1, 2, 3)] == ["apply"] * 3
    assert s.observe(ev(5)) == "gap"  # 4 was lost
    assert s.observe(ev(6)) == "drop"  # nothing more from w-0 until it resyncs
    assert s.observe(ev(7, "cleared")) == "apply"
    assert [s.observe(ev(i)) for i in (8, 9)] == ["apply", "apply"]
    assert s.gaps == 1


def test_reordered_and_redelivered_records_are_dropped() -> None:
    s = KvSequence()
    assert [s.observe(ev(i)) for i in (1, 2, 4, 3)] == ["apply", "apply", "gap", "drop"]
    t = KvSequence()
    assert [t.observe(ev(i)) for i in (1, 2, 2, 1, 3)] == ["apply", "apply", "drop", "drop", "apply"]


def test_a_restart_starts_the_count_again_and_the_old_instance_is_ignored() -> None:
    s = KvSequence()
    assert [s.observe(ev(i)) for i in (1, 2, 3)] == ["apply"] * 3
    assert s.observe(ev(1, epoch=200)) == "apply"  # restarted
    assert s.observe(ev(4, epoch=100)) == "drop"  # a late record of the previous instance
    assert s.observe(ev(2, epoch=200)) == "apply"


def test_a_cleared_heals_without_being_asked_and_a_lost_request_is_asked_again() -> None:
    s = KvSequence()
    s.observe(ev(1))
    assert s.observe(ev(9, "cleared")) == "apply"  # the worker resynced on its own (its sends failed)
    assert s.observe(ev(10)) == "apply"
    assert s.observe(ev(12)) == "gap"
    verdicts = [s.observe(ev(13 + i)) for i in range(ASK_AGAIN_AFTER)]
    assert verdicts[-1] == "gap" and set(verdicts[:-1]) == {"drop"}


def test_unnumbered_events_are_applied() -> None:
    s = KvSequence()
    assert s.observe(KvEvent("w-0", "stored", "gpu", [1], [0])) == "apply"
