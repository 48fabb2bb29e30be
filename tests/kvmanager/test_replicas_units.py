"""KV-manager replicas, the parts that need no broker: shard views, fencing, the lease, merging."""

from __future__ import annotations

import random

import pytest
import redis.asyncio as aioredis

from schemas.messages import KvEvent
from services.fleet_directory.layout import KEY_PREFIX, shard_prefix
from services.fleet_directory.snapshot import fleet_copies, read_snapshot
from services.kvmanager.directory import Directory
from services.kvmanager.lease import LeaderLease
from services.kvmanager.placement import PlacementConfig, retain_hints
from services.kvmanager.shards import CombinedView, OwnedShards, Shard, fetch_holders
from services.kvmanager.write_behind import DirectoryWriter, SliceTaken
from streams.producer import partition_for
from streams.topics import KV_EVENTS

from .helpers import load, removed, request, stored

PARTS = 4


def random_events(seed: int, workers: int = 8, n: int = 300) -> list[KvEvent]:
    rng = random.Random(seed)
    out: list[KvEvent] = []
    for i in range(n):
        w = f"w{rng.randrange(workers)}"
        # chains share leading blocks, so several workers hold the same runs
        run = [100 + k for k in range(rng.randrange(1, 7))]
        if rng.random() < 0.2:
            out.append(removed(w, run[rng.randrange(len(run)) :], ms=i))
        else:
            out.append(stored(w, run, tier=rng.choice(["gpu", "dram"]), ms=i))
    return out


def sharded(events: list[KvEvent], owned: set[int]) -> OwnedShards:
    shards = OwnedShards()
    for p in sorted(owned):
        shards.add(Shard.new(p))
    for ev in events:
        shard = shards.get(partition_for(KV_EVENTS, ev.worker_id, PARTS))
        if shard is not None:
            shard.directory.apply_kv_event(ev)
    return shards


@pytest.mark.parametrize("seed", range(5))
def test_retain_hints_from_shards_are_exactly_one_managers(seed: int) -> None:
    """Retain hints are per worker: the replicas' shards together send exactly what one manager does."""
    events = random_events(seed)
    one = Directory()
    for ev in events:
        one.apply_kv_event(ev)
    halves = (sharded(events, {0, 2}), sharded(events, {1, 3}))
    whole = sharded(events, set(range(PARTS)))
    cfg = PlacementConfig(retain_min_turns=1)
    rng = random.Random(seed)
    hinted = 0
    for i in range(40):
        hashes = [100 + k for k in range(rng.randrange(1, 8))]
        req = request(f"s{i}", f"r{i}", hashes, ms=1000 + i)
        expected = retain_hints(req, 2, one, cfg)
        split = sorted(
            (h for half in halves for h in retain_hints(req, 2, half, cfg)), key=lambda h: h.worker_id
        )
        assert split == expected
        assert retain_hints(req, 2, whole, cfg) == expected
        hinted += len(expected)
        for h in hashes:
            assert whole.holders(h) == one.holders(h)
        assert whole.holders_of_run(hashes) == one.holders_of_run(hashes)
    assert hinted > 0  # the comparison was not between empty lists


@pytest.mark.integration
async def test_combined_view_sees_the_other_slices(redis_settings) -> None:
    """The leader's replication view: its own shards in memory, the others' hot blocks from Redis."""
    events = random_events(7)
    client = redis_settings.connect()
    try:
        mine = sharded(events, {0, 1})
        others = sharded(events, {2, 3})
        for shard in others:
            assert await shard.writer.flush(client)
        one = Directory()
        for ev in events:
            one.apply_kv_event(ev)
        wanted = sorted(one.blocks)
        remote = await fetch_holders(client, [shard_prefix(2), shard_prefix(3)], wanted)
        view = CombinedView(mine, remote)
        for h in wanted:
            assert view.holders(h) == one.holders(h)
            assert view.copies(h) == one.copies(h)
        assert view.holders_of_run(wanted[:3]) == one.holders_of_run(wanted[:3])
        # fleet_copies counts across every slice too
        for shard in mine:
            assert await shard.writer.flush(client)
        assert await fleet_copies(client, wanted) == [one.copies(h) for h in wanted]
    finally:
        await client.aclose()


@pytest.mark.integration
async def test_merged_snapshot_unites_the_slices(redis_settings) -> None:
    events = random_events(3)
    client = redis_settings.connect()
    try:
        fleet = Directory()
        fleet.apply_load(load("w1", 5000))
        fleet.accept("kvmesh.load", 0, 41, "p", 1)
        assert await DirectoryWriter(fleet, KEY_PREFIX).flush(client)
        shards = sharded(events, set(range(PARTS)))
        for shard in shards:
            shard.directory.accept(KV_EVENTS.name, shard.partition, 10 + shard.partition, "p", 1)
            assert await shard.writer.flush(client)
        snap = await read_snapshot(client)
        one = Directory()
        for ev in events:
            one.apply_kv_event(ev)
        assert snap.blocks == {h: one.holders(h) for h in one.blocks}
        assert snap.offsets[KV_EVENTS.name] == {p: 11 + p for p in range(PARTS)}
        assert snap.offsets["kvmesh.load"] == {0: 42}
        assert set(snap.workers) == {"w1"}
    finally:
        await client.aclose()


@pytest.mark.integration
async def test_fenced_writer_never_overwrites_a_slice_another_replica_took(redis_settings) -> None:
    client = redis_settings.connect()
    try:
        old, new = Shard.new(1), Shard.new(1)
        old.directory.apply_kv_event(stored("w1", [1, 2]))
        assert await old.writer.flush(client)
        await new.writer.load(client)  # the next owner loads the slice ...
        new.directory.apply_kv_event(removed("w1", [2]))
        assert await new.writer.flush(client)  # ... and writes it
        old.directory.apply_kv_event(stored("w1", [3]))  # the old owner, paused, goes on
        with pytest.raises(SliceTaken) as taken:
            await old.writer.flush(client)
        assert taken.value.found > taken.value.expected
        snap = await read_snapshot(client)
        assert snap.blocks == {1: {"w1": "gpu"}}  # the new owner's state, untouched
        # Redis restarted empty: the version went back, so the owner rewrites the slice from memory.
        await client.flushdb()
        new.directory.apply_kv_event(stored("w1", [5]))
        assert await new.writer.flush(client)
        snap = await read_snapshot(client)
        assert snap.blocks == {1: {"w1": "gpu"}, 5: {"w1": "gpu"}}
    finally:
        await client.aclose()


@pytest.mark.integration
async def test_one_lease_holder_and_takeover_after_expiry(redis_settings) -> None:
    now = {"t": 0}
    client: aioredis.Redis = redis_settings.connect()
    try:
        a = LeaderLease("a", 3000, lambda: now["t"])
        b = LeaderLease("b", 3000, lambda: now["t"])
        assert await a.tick(client) is True
        assert await b.tick(client) is False
        assert a.held() and not b.held()
        now["t"] = 1500
        assert await a.tick(client) is False  # renewed, not newly taken
        assert await b.tick(client) is False
        # a stops renewing: on its own clock it stops acting as leader when its lease runs out ...
        now["t"] = 4600
        assert not a.held()
        # ... and b takes the key once Redis has expired it (its TTL runs on Redis's clock: deleted
        # here, as the expiry would).
        await client.delete(a.key)
        assert await b.tick(client) is True
        # Redis restarts empty while b leads: its next renewal finds the key gone and says "became",
        # so b writes what it leads (the fleet slice) again.
        now["t"] = 5700
        await client.delete(b.key)
        assert b.held() and await b.tick(client) is True
        assert b.held()
        now["t"] = 6000
        assert await a.tick(client) is False and not a.held()
        await b.release(client)
        now["t"] = 7000
        assert await a.tick(client) is True
    finally:
        await client.aclose()
