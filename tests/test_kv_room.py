"""Room in a worker's GPU KV tier (kvmesh_core/kv_room.py): what a report lists and the wait it gives."""

from __future__ import annotations

from kvmesh_core.kv_room import kv_release, kv_wait_steps


def test_releases_go_soonest_first_merged_by_step_and_capped() -> None:
    assert kv_release([(50, 120), (12, 300), (12, 5), (0, 7), (9, 0)]) == [(1, 7), (12, 305), (50, 120)]
    many = [(s, 10) for s in range(1, 31)]
    capped = kv_release(many, limit=4)
    # the 27 latest are merged at the last one's step: the wait for their blocks is not understated
    assert capped == [(1, 10), (2, 10), (3, 10), (30, 270)]
    assert sum(b for _, b in capped) == 300


def test_a_prompt_waits_until_enough_running_requests_end() -> None:
    release = [(12, 300), (50, 120), (90, 900)]
    assert kv_wait_steps(40, release, 40) == 0
    assert kv_wait_steps(40, release, 41) == 12
    assert kv_wait_steps(40, release, 400) == 50
    assert kv_wait_steps(40, release, 1360) == 90
    # the queue already waits for room (negative free): even a small prompt waits behind it
    assert kv_wait_steps(-100, release, 1) == 12
    # larger than all the running requests free: after the last of them (then it runs alone)
    assert kv_wait_steps(40, release, 5000) == 90
    assert kv_wait_steps(0, [], 5000) == 0
