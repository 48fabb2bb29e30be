"""The directory on a real three-master Redis Cluster (``redis-server --cluster-enabled yes`` three
times, joined by ``redis-cli --cluster create``), and on a plain Redis that held the layout before
the hash tag."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from schemas.messages import KvEvent, LoadReport
from services.fleet_directory.layout import KEY_PREFIX, VERSION_KEY
from services.fleet_directory.snapshot import fleet_copies, read_snapshot
from services.kvmanager.directory import Directory
from services.kvmanager.service import KvManagerService
from services.scheduler.held_requests import DecidedMarks
from streams.producer import TypedProducer
from streams.settings import KafkaSettings, RedisSettings
from streams.topics import KV_EVENTS, LOAD, REQUESTS

from .helpers import feed, load, request, stored, w
from .test_service import as_snapshot_blocks, batch_a, batch_b, reference, settings

pytestmark = pytest.mark.integration


async def _publish(kafka: KafkaSettings, messages: list[Any]) -> None:
    async with TypedProducer(kafka, "cluster-test") as producer:
        for m in messages:
            topic = KV_EVENTS if isinstance(m, KvEvent) else LOAD if isinstance(m, LoadReport) else REQUESTS
            await producer.send(topic, m)


async def _all_keys(client: Any) -> list[str]:
    return sorted([k.decode() if isinstance(k, bytes) else k async for k in client.scan_iter(match="*")])


async def test_the_kv_manager_keeps_its_directory_on_a_redis_cluster(
    kafka_settings: KafkaSettings, redis_cluster_settings: RedisSettings
) -> None:
    client = redis_cluster_settings.connect()
    try:
        nodes = await client.cluster_nodes()
        assert sum("master" in n["flags"] for n in nodes.values()) == 3  # a real three-master cluster

        await _publish(kafka_settings, batch_a())
        async with KvManagerService(settings(kafka_settings, redis_cluster_settings)):
            async with asyncio.timeout(30):
                while sum((await read_snapshot(client)).offsets.get(REQUESTS.name, {}).values()) < 1:
                    await asyncio.sleep(0.05)
        # a restarted manager loads the directory from the cluster and goes on from its offsets
        await _publish(kafka_settings, batch_b())
        async with KvManagerService(settings(kafka_settings, redis_cluster_settings)) as again:
            assert again.writer.full_rewrites == 0
            async with asyncio.timeout(30):
                while sum((await read_snapshot(client)).offsets.get(REQUESTS.name, {}).values()) < 2:
                    await asyncio.sleep(0.05)
        snap = await read_snapshot(client)  # one MULTI/EXEC on the directory's node
        assert snap.blocks == as_snapshot_blocks(reference(batch_a() + batch_b()))
        assert sum(snap.offsets[KV_EVENTS.name].values()) == 7 and set(snap.workers) == {"w1", "w2", "w3"}
        assert await fleet_copies(client, [1, 2, 9, 77]) == [2, 1, 1, 0]

        keys = await _all_keys(client)
        assert keys and all(k.startswith(KEY_PREFIX) for k in keys)
        slots = {await client.cluster_keyslot(k) for k in keys}
        assert len(slots) == 1  # every flush is one script call on one node
    finally:
        await client.aclose()


async def test_a_flush_on_a_cluster_notices_a_lost_directory_and_rewrites_it(
    redis_cluster_settings: RedisSettings,
) -> None:
    client = redis_cluster_settings.connect()
    try:
        d = Directory()
        feed(d, [(0, 1, load("w1", 100)), (0, 2, stored("w1", [1, 2, 3], ms=101))])
        assert await w(d).flush(client)
        for node in client.get_primaries():  # the cluster loses its data (a restart without persistence)
            await client.flushall(target_nodes=node)
        feed(d, [(0, 3, stored("w1", [4], ms=102))])
        assert await w(d).flush(client)
        assert w(d).full_rewrites == 1
        assert (await read_snapshot(client)).blocks == {h: {"w1": "gpu"} for h in (1, 2, 3, 4)}
    finally:
        await client.aclose()


async def test_decided_marks_spread_over_the_clusters_slots_are_all_found(
    redis_cluster_settings: RedisSettings,
) -> None:
    client = redis_cluster_settings.connect()
    try:
        marks = DecidedMarks(client)
        ids = [f"req-{i}" for i in range(40)]
        await marks.mark([(rid, None) for rid in ids[:30]], now_ms=0)
        assert marks.written == 30
        slots = {await client.cluster_keyslot(f"kvmesh:sched:decided:{rid}") for rid in ids[:30]}
        assert len(slots) > 1  # the marks do span slots (and nodes), and are still read in one call
        assert await marks.already_decided(ids) == set(ids[:30])
    finally:
        await client.aclose()


async def test_a_directory_in_the_layout_before_the_hash_tag_is_renamed_at_load(
    redis_settings: RedisSettings,
) -> None:
    client = redis_settings.connect()
    try:
        d = Directory()
        feed(d, [(0, 1, load("w1", 100)), (0, 2, stored("w1", [1, 2], ms=101))])
        d.observe_lookup(request("s", "r", [1, 2, 3], ms=102))
        assert await w(d).flush(client)
        for key in await _all_keys(client):  # as an earlier release left it
            await client.rename(key, "kvm:" + key[len(KEY_PREFIX) :])
        assert not await client.exists(VERSION_KEY)

        again = Directory()
        await w(again).load(client)
        assert again.blocks == d.blocks and again.workers == d.workers and again.stats == d.stats
        assert all(k.startswith(KEY_PREFIX) for k in await _all_keys(client))
        feed(again, [(0, 3, stored("w1", [3], ms=103))])
        assert await w(again).flush(client) and w(again).full_rewrites == 0
    finally:
        await client.aclose()


def test_cluster_settings_build_a_cluster_client() -> None:
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

    assert isinstance(RedisSettings(url="redis://127.0.0.1:1/0", cluster=True).connect(), RedisCluster)
    assert isinstance(RedisSettings(url="redis://127.0.0.1:1/0").connect(), Redis)


async def test_replicas_spread_their_shard_slices_over_the_clusters_masters(
    kafka_settings: KafkaSettings, redis_cluster_settings: RedisSettings
) -> None:
    """Two KV-manager replicas on the cluster: each shard slice is one slot (one script call per
    flush), the slices land on several masters, and a reader merges them back into one directory."""
    from services.fleet_directory.layout import shard_of_prefix
    from services.fleet_directory.snapshot import shard_prefixes
    from services.kvmanager.replica import KvManagerReplica
    from streams.producer import partition_for

    messages = batch_a() + batch_b()
    await _publish(kafka_settings, messages)
    client = redis_cluster_settings.connect()
    try:
        replicas = [
            KvManagerReplica(
                settings(kafka_settings, redis_cluster_settings, sharded=True, manager_id=f"r{i}")
            )
            for i in range(2)
        ]
        expected = as_snapshot_blocks(reference(messages))
        try:
            for r in replicas:
                await r.start()

            def split() -> bool:
                # the first replica may index everything before the second one's join rebalances the
                # group; mid-rebalance neither owns a shard, so wait for the split rather than sample it
                owned = [set(r.shards.partitions()) for r in replicas]
                return all(owned) and owned[0] | owned[1] == set(range(KV_EVENTS.partitions))

            async with asyncio.timeout(90):
                while (
                    (await read_snapshot(client)).blocks != expected
                    or not any(r.is_leader for r in replicas)
                    or not split()
                ):
                    await asyncio.sleep(0.1)
            assert sum(r.is_leader for r in replicas) == 1
            owned = [set(r.shards.partitions()) for r in replicas]
            assert not owned[0] & owned[1]
        finally:
            for r in replicas:
                await r.stop()
        prefixes = await shard_prefixes(client)
        # one slice per partition that carried events (a silent partition writes nothing)
        assert [shard_of_prefix(p) for p in prefixes] == sorted(
            {partition_for(KV_EVENTS, x) for x in ("w1", "w2", "w3")}
        )
        slot_of = {
            p: {await client.cluster_keyslot(k) for k in await _all_keys(client) if k.startswith(p)}
            for p in prefixes
        }
        assert all(len(slots) == 1 for slots in slot_of.values())
        masters = {client.get_node_from_key(p + "version").name for p in prefixes}
        assert len(masters) > 1
        snap = await read_snapshot(client)
        assert snap.blocks == expected and set(snap.workers) == {"w1", "w2", "w3"}
        assert await fleet_copies(client, [1, 2, 9, 77]) == [2, 1, 1, 0]
    finally:
        await client.aclose()
