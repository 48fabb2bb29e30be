"""Liveness decisions: a pure function of last report times, now and the timeout."""

from __future__ import annotations

import pytest

from services.kvmanager.liveness import LostWorker, liveness_now, lost_workers, worker_lost_message


def test_lost_exactly_at_timeout_sorted_by_id() -> None:
    seen = {"w2": 1000, "w1": 1000, "w3": 1001, "w0": 5000}
    assert lost_workers(seen, now_ms=6000, timeout_ms=5000) == [
        LostWorker("w1", 1000),
        LostWorker("w2", 1000),
    ]
    assert lost_workers(seen, now_ms=5999, timeout_ms=5000) == []


def test_nothing_lost_when_all_report() -> None:
    assert lost_workers({"a": 100, "b": 200}, now_ms=300, timeout_ms=5000) == []
    assert lost_workers({}, now_ms=10**12, timeout_ms=1) == []


def test_now_is_latest_of_events_and_clock() -> None:
    assert liveness_now(5000, None) == 5000
    assert liveness_now(5000, 4000) == 5000
    assert liveness_now(5000, 9000) == 9000


def test_bad_timeout_refused() -> None:
    with pytest.raises(ValueError):
        lost_workers({"a": 1}, 2, 0)


def test_worker_lost_message_fields() -> None:
    msg = worker_lost_message(LostWorker("w1", 1234), declared_ms=9999)
    assert (msg.worker_id, msg.last_seen_ms, msg.declared_ms, msg.reason) == (
        "w1",
        1234,
        9999,
        "heartbeat_timeout",
    )
