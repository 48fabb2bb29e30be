"""The directory: idempotent apply in memory, and its Redis form (snapshot, offsets, rewrite)."""

from __future__ import annotations

import gc
import json

import pytest
import redis.asyncio as aioredis

from services.fleet_directory.layout import (
    HOLDERS_KEY,
    KEY_PREFIX,
    VERSION_KEY,
    WORKERS_KEY,
    count_holders,
    decode_holders,
    split_holders_value,
    worker_key,
)
from services.fleet_directory.snapshot import fleet_copies, read_raw, read_snapshot
from services.kvmanager.directory import Directory
from streams.topics import KV_EVENTS, LOAD

from .helpers import cleared, feed, load, moved, removed, stored, w

EVENTS: list[tuple[int, int, object]] = [
    (0, 10, stored("w1", [11, 12, 13], ms=100)),
    (1, 11, stored("w2", [11, 12], tier="dram", ms=110)),
    (2, 12, moved("w1", [13], to="dram", frm="gpu", ms=120)),
    (3, 13, removed("w2", [12], ms=130)),
    (4, 14, load("w1", 140)),
    (5, 15, stored("w3", [21], ms=150)),
    (6, 16, cleared("w3", ms=160)),
    (7, 17, load("w2", 170)),
]


def state(d: Directory) -> tuple:
    return (d.blocks, d.parents, d.worker_blocks, d.workers, d.offsets)


def test_apply_builds_expected_directory() -> None:
    d = Directory()
    feed(d, EVENTS)
    assert d.holders(11) == {"w1": "gpu", "w2": "dram"}
    assert d.holders(12) == {"w1": "gpu"}
    assert d.holders(13) == {"w1": "dram"}
    assert d.blocks[13] == (("w1", "dram", 120),)  # (worker, tier, last use ms), by worker id
    assert 21 not in d.blocks and 21 not in d.parents
    assert d.parents == {11: 0, 12: 11, 13: 12}
    assert d.worker_blocks == {"w1": {11, 12, 13}, "w2": {11}}
    assert d.copies(11) == 2 and d.copies(21) == 0
    assert d.holders_of_run([11, 12]) == {"w1"}
    assert d.offsets == {(KV_EVENTS.name, 0): 7, (LOAD.name, 0): 8}
    assert set(d.workers) == {"w1", "w2"}


def test_same_events_twice_and_replay_from_earlier_offset_change_nothing() -> None:
    once = Directory()
    feed(once, EVENTS)
    twice = Directory()
    feed(twice, EVENTS)
    feed(twice, EVENTS)
    assert state(twice) == state(once)
    replay = Directory()
    feed(replay, EVENTS)
    feed(replay, EVENTS[3:])  # consumer rewound to offset 3
    assert state(replay) == state(once)
    # Without the seq check a replayed "stored" would resurrect the block removed after it.
    naive = Directory()
    feed(naive, EVENTS)
    naive.apply_kv_event(EVENTS[1][2])  # type: ignore[arg-type]
    assert naive.holders(12) != once.holders(12)


def test_lost_worker_dropped_entirely() -> None:
    d = Directory()
    feed(d, EVENTS)
    assert d.drop_worker("w1") == 3
    assert d.blocks == {11: (("w2", "dram", 110),)}
    assert "w1" not in d.workers and "w1" not in d.worker_blocks


def test_old_load_report_never_moves_last_seen_back() -> None:
    d = Directory()
    d.apply_load(load("w1", 500))
    d.apply_load(load("w1", 400))
    assert d.workers["w1"]["last_seen_ms"] == 500


async def redis_contents(client: aioredis.Redis) -> dict:
    out = {}
    for key in sorted([k async for k in client.scan_iter(match=KEY_PREFIX + "*")]):
        kind = await client.type(key)
        if kind == b"hash":
            out[key] = await client.hgetall(key)
        elif kind == b"set":
            out[key] = await client.smembers(key)
        elif key != VERSION_KEY.encode():
            out[key] = await client.get(key)
    return out


@pytest.mark.integration
async def test_flush_snapshot_and_offsets(redis_settings) -> None:
    client = aioredis.from_url(redis_settings.url)
    try:
        d = Directory()
        feed(d, EVENTS[:4])
        assert await w(d).flush(client)
        feed(d, EVENTS[4:])
        assert await w(d).flush(client)
        snap = await read_snapshot(client)
        assert snap.blocks == {11: {"w1": "gpu", "w2": "dram"}, 12: {"w1": "gpu"}, 13: {"w1": "dram"}}
        assert snap.parents == {11: 0, 12: 11, 13: 12}
        assert snap.offsets == {KV_EVENTS.name: {0: 7}, LOAD.name: {0: 8}}
        assert set(snap.workers) == {"w1", "w2"}
        assert snap.workers["w1"]["last_seen_ms"] == 140
        assert snap.workers["w1"]["transfer_address"] == "127.0.0.1:9001"
        assert await fleet_copies(client, [13, 11, 21, 12]) == [1, 2, 0, 1]
        assert await client.smembers(worker_key("w2")) == {b"11"}
        assert not await client.exists(worker_key("w3"))
        # one field per block: parent, then the holders by worker id (no hash of parents or counts)
        assert await client.hgetall(HOLDERS_KEY) == {
            b"11": b"0|w1=gpu:100,w2=dram:110",
            b"12": b"11|w1=gpu:100",
            b"13": b"12|w1=dram:120",
        }
        assert {k.decode() for k in await client.keys("*")} == {
            *("{kvm}:holders", "{kvm}:wrk:w1", "{kvm}:wrk:w2", "{kvm}:workers"),
            *("{kvm}:offsets", "{kvm}:seqs", "{kvm}:stats", "{kvm}:version"),
        }
        # A manager restarted from Redis holds the same directory and skips what it already applied.
        again = Directory()
        await w(again).load(client)
        assert state(again) == state(d)
        feed(again, EVENTS)
        assert not again.has_dirty() or await w(again).flush(client)
        assert (await read_snapshot(client)).blocks == snap.blocks
    finally:
        await client.aclose()


@pytest.mark.integration
async def test_flushing_in_any_batches_gives_the_same_redis(redis_settings) -> None:
    client = aioredis.from_url(redis_settings.url)
    try:
        whole = Directory()
        feed(whole, EVENTS)
        await w(whole).flush(client)
        expected = await redis_contents(client)
        await client.flushdb()
        step = Directory()
        for rec in EVENTS:
            feed(step, [rec])
            await w(step).flush(client)
        assert await redis_contents(client) == expected
    finally:
        await client.aclose()


@pytest.mark.integration
async def test_redis_restart_without_data_is_rewritten_whole(redis_server, redis_settings) -> None:
    client = aioredis.from_url(redis_settings.url)
    try:
        d = Directory()
        feed(d, EVENTS[:5])
        await w(d).flush(client)
        await client.aclose()
        redis_server.stop()
        client = aioredis.from_url(redis_settings.url, socket_connect_timeout=0.5)
        feed(d, EVENTS[5:])
        assert not await w(d).flush(client)  # down: changes stay buffered
        assert d.has_dirty()
        redis_server.start()
        assert await w(d).flush(client)
        assert w(d).full_rewrites == 1
        reference = Directory()
        feed(reference, EVENTS)
        await client.flushdb()
        await w(reference).flush(client)
        ref_snap = await read_raw(client)
        await client.flushdb()
        await w(d).verify(client)  # notices the empty Redis, rewrites
        got = await read_raw(client)
        assert (got.blocks, got.parents, got.offsets, got.workers, got.seqs) == (
            ref_snap.blocks,
            ref_snap.parents,
            ref_snap.offsets,
            ref_snap.workers,
            ref_snap.seqs,
        )
        assert json.loads((await client.hget(WORKERS_KEY, "w2")).decode())["last_seen_ms"] == 170
    finally:
        await client.aclose()


def test_block_holders_are_invisible_to_the_garbage_collector() -> None:
    """Holders are tuples of str/int: within two collections the collector stops tracking them,
    so full collections (pauses that land in the event → Redis lag) do not grow with the directory."""
    d = Directory()
    d.apply_kv_event(stored("w2", [11, 12], ms=5))
    d.apply_kv_event(stored("w1", [11], ms=6))
    d.apply_kv_event(moved("w2", [12], to="dram", frm="gpu", ms=7))
    assert d.blocks[11] == (("w1", "gpu", 6), ("w2", "gpu", 5))  # by worker id
    gc.collect()  # untracks the inner (worker, tier, ms) tuples ...
    gc.collect()  # ... and then the tuples holding them
    assert not any(gc.is_tracked(v) for v in d.blocks.values())
    d.apply_kv_event(removed("w1", [11], ms=8))
    assert d.blocks == {11: (("w2", "gpu", 5),), 12: (("w2", "dram", 7),)}


@pytest.mark.integration
async def test_changes_applied_while_a_flush_is_in_flight_or_after_it_failed_are_not_lost(
    redis_server, redis_settings
) -> None:
    """The service overlaps a flush's Redis call with the next batch: whatever is applied between
    take_flush and send_flush, and whatever a failed flush carried, reaches Redis with a later flush."""
    client = aioredis.from_url(redis_settings.url)
    try:
        reference = Directory()
        feed(reference, EVENTS)
        await w(reference).flush(client)
        expected = await redis_contents(client)
        await client.flushdb()

        d = Directory()
        feed(d, EVENTS[:3])
        first = w(d).take_flush()
        assert first is not None and not d.has_dirty()
        feed(d, EVENTS[3:5])  # applied while `first` is on its way
        assert await w(d).send_flush(client, first)
        assert d.has_dirty()
        await client.aclose()
        redis_server.stop()
        client = aioredis.from_url(redis_settings.url, socket_connect_timeout=0.5)
        second = w(d).take_flush()
        assert second is not None
        feed(d, EVENTS[5:])  # w3 stored then cleared, w2 reports: newer than `second`
        assert not await w(d).send_flush(client, second)  # Redis down: folded back
        redis_server.start()  # empty again: the next flush notices and rewrites
        assert await w(d).flush(client)
        assert await redis_contents(client) == expected
        assert not d.has_dirty()
    finally:
        await client.aclose()


@pytest.mark.integration
async def test_failed_flush_restores_worker_set_changes_from_memory(redis_server, redis_settings) -> None:
    client = aioredis.from_url(redis_settings.url)
    try:
        d = Directory()
        feed(d, [(0, 1, stored("w1", [1, 2], ms=10))])
        assert await w(d).flush(client)
        feed(d, [(1, 2, removed("w1", [2], ms=11))])
        pending = w(d).take_flush()
        assert pending is not None
        feed(d, [(2, 3, stored("w1", [2], ms=12)), (3, 4, moved("w1", [1], to="dram", frm="gpu", ms=13))])
        await client.aclose()
        redis_server.stop()
        client = aioredis.from_url(redis_settings.url, socket_connect_timeout=0.5)
        assert not await w(d).send_flush(client, pending)
        redis_server.start()
        await client.aclose()
        client = aioredis.from_url(redis_settings.url)
        await w(d).flush(client)  # Redis came back empty: rewritten whole from memory
        assert await client.smembers(worker_key("w1")) == {b"1", b"2"}
        assert await fleet_copies(client, [1, 2]) == [1, 1]
        assert await client.hget(HOLDERS_KEY, "1") == b"0|w1=dram:13"
    finally:
        await client.aclose()


def test_restore_rederives_worker_set_members_from_memory() -> None:
    d = Directory()
    feed(d, [(0, 1, stored("w1", [1, 2], ms=10))])
    d.take_changes()  # as if flushed
    feed(d, [(1, 2, removed("w1", [2], ms=11))])
    pending = w(d).take_flush()
    assert pending is not None
    feed(d, [(2, 3, stored("w1", [2], ms=12))])  # re-stored after the flush was taken
    d.restore_changes(pending.dirty)
    assert d._dirty.worker_add["w1"] == {2} and not d._dirty.worker_rem["w1"]
    assert 2 in d._dirty.blocks


def test_holders_value_round_trips_parent_and_entries() -> None:
    assert split_holders_value("12|w1=gpu:5,w2=dram:7") == (12, "w1=gpu:5,w2=dram:7")
    assert split_holders_value("w1=gpu:5") == (None, "w1=gpu:5")
    assert decode_holders("0|w1=gpu:5,w2=dram:7") == {"w1": ("gpu", 5), "w2": ("dram", 7)}
    assert [count_holders(v) for v in ("0|w1=gpu:5,w2=dram:7", "w1=gpu:5", "3|", "")] == [2, 1, 0, 0]
