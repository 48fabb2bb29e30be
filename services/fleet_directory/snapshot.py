"""A consistent read of the whole directory, for a scheduler's (or the manager's own) cold start.

Consistency: every flush of the manager is one Lua call (atomic in Redis), and the reader takes the
holders (with their parents), workers, offsets, seqs, stats and version in one MULTI/EXEC, so the result is
always the state after some whole number of flushes: the blocks are exactly those produced by every
record before ``offsets``.

A scheduler resumes its KvEvent consumer at ``offsets[KV_EVENTS.name][partition]`` after loading
``blocks``; the records from there on are the ones not yet in the snapshot.

With KV-manager replicas the directory is several slices (see :mod:`services.fleet_directory.layout`),
each read in its own MULTI/EXEC and then merged: each kv-events partition's blocks are exactly those
of every record before that partition's offset, because one slice holds both.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from services.fleet_directory.layout import (
    HOLDERS_KEY,
    KEY_PREFIX,
    SHARD_VERSION_MATCH,
    count_holders,
    decode_holders,
    shard_of_prefix,
    split_holders_value,
)


@dataclass
class DirectorySnapshot:
    """The directory at one instant: holders per block, parents, consumed offsets, worker info."""

    blocks: dict[int, dict[str, str]]  # block hash → {worker: tier}
    parents: dict[int, int]  # block hash → parent hash
    offsets: dict[str, dict[int, int]]  # topic name → partition → next offset to consume
    workers: dict[str, dict[str, Any]]  # worker → info (last_seen_ms, transfer_address, tiers, …)


@dataclass
class RawDirectory:
    """Everything in Redis, decoded; holders keep (tier, last_ms)."""

    blocks: dict[int, dict[str, tuple[str, int]]] = field(default_factory=dict)
    parents: dict[int, int] = field(default_factory=dict)
    offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    seqs: dict[tuple[str, int, str], int] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)
    version: int = 0


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _split_offset_key(key: str) -> tuple[str, int]:
    topic, _, part = key.partition(":")
    return topic, int(part)


async def read_raw(redis_client: aioredis.Redis, prefix: str = KEY_PREFIX) -> RawDirectory:
    """Read one slice of the directory in one MULTI/EXEC (see module docstring)."""
    async with redis_client.pipeline(transaction=True) as pipe:
        for name in ("holders", "offsets", "workers", "seqs", "stats"):
            pipe.hgetall(prefix + name)
        pipe.get(prefix + "version")
        holders, offsets, workers, seqs, stats, version = await pipe.execute()
    raw = RawDirectory()
    for key, value in holders.items():
        h = int(_s(key))
        parent, entries = split_holders_value(_s(value))
        raw.blocks[h] = decode_holders(entries)
        if parent is not None:
            raw.parents[h] = parent
    for k, v in offsets.items():
        topic, part = _split_offset_key(_s(k))
        raw.offsets.setdefault(topic, {})[part] = int(_s(v))
    raw.workers = {_s(w): json.loads(_s(v)) for w, v in workers.items()}
    for k, v in seqs.items():
        # Topic names hold no ':' (streams/topics.py); a producer id may.
        seq_topic, seq_part, producer = _s(k).split(":", 2)
        raw.seqs[(seq_topic, int(seq_part), producer)] = int(_s(v))
    raw.stats = {_s(k): int(_s(v)) for k, v in stats.items()}
    raw.version = int(_s(version)) if version is not None else 0
    return raw


async def shard_prefixes(redis_client: aioredis.Redis) -> list[str]:
    """The prefixes of the shard slices in Redis (KV-manager replicas), by partition; [] for one
    manager. (A cluster client scans every master.)"""
    found: set[str] = set()
    async for key in redis_client.scan_iter(match=SHARD_VERSION_MATCH, count=1000):
        found.add(_s(key)[: -len("version")])
    return sorted(found, key=lambda p: shard_of_prefix(p) or 0)


def merge_raw(parts: Sequence[RawDirectory]) -> RawDirectory:
    """One directory from slices: holders united per block (a worker in two slices, possible after
    kv-events partitions were added, keeps its newer entry), offsets and seqs united (the larger
    where two slices name the same one), workers, stats and version from the first (the fleet
    slice) unless only another has them."""
    out = RawDirectory()
    for raw in parts:
        for h, holders in raw.blocks.items():
            have = out.blocks.get(h)
            if have is None:
                out.blocks[h] = dict(holders)
                continue
            for w, entry in holders.items():
                if w not in have or entry[1] > have[w][1]:
                    have[w] = entry
        for h, parent in raw.parents.items():
            out.parents.setdefault(h, parent)
        for topic, parts_ in raw.offsets.items():
            mine = out.offsets.setdefault(topic, {})
            for p, o in parts_.items():
                mine[p] = max(o, mine.get(p, 0))
        for key, seq in raw.seqs.items():
            out.seqs[key] = max(seq, out.seqs.get(key, -1))
        for w, info in raw.workers.items():
            out.workers.setdefault(w, info)
        for k, v in raw.stats.items():
            out.stats.setdefault(k, v)
        out.version = out.version or raw.version
    return out


async def read_merged(redis_client: aioredis.Redis) -> RawDirectory:
    """The whole directory: the fleet slice and every shard slice, merged (see :func:`merge_raw`)."""
    parts = [await read_raw(redis_client, KEY_PREFIX)]
    for prefix in await shard_prefixes(redis_client):
        parts.append(await read_raw(redis_client, prefix))
    return parts[0] if len(parts) == 1 else merge_raw(parts)


async def read_snapshot(redis_client: aioredis.Redis) -> DirectorySnapshot:
    """The directory as the scheduler needs it: {hash: {worker: tier}}, parents, offsets, workers."""
    raw = await read_merged(redis_client)
    blocks = {h: {w: tier for w, (tier, _) in holders.items()} for h, holders in raw.blocks.items()}
    return DirectorySnapshot(blocks=blocks, parents=raw.parents, offsets=raw.offsets, workers=raw.workers)


async def fleet_copies(redis_client: aioredis.Redis, block_hashes: Sequence[int]) -> list[int]:
    """How many workers of the fleet hold each block (0 if none), in the order asked; one HMGET per
    slice.

    The contract for a worker's eviction: before dropping a block from its last tier, a worker asks
    this; if the answer is 1 or less (only itself), it demotes the block to disk instead of dropping
    it, so the fleet keeps its last copy. Counts lag the worker's own KvEvents by one manager flush.
    """
    if not block_hashes:
        return []
    fields = [str(h) for h in block_hashes]
    counts = [0] * len(fields)
    keys = [HOLDERS_KEY] + [p + "holders" for p in await shard_prefixes(redis_client)]
    for key in keys:
        values = await redis_client.hmget(key, fields)
        counts = [
            c + (count_holders(_s(v)) if v is not None else 0) for c, v in zip(counts, values, strict=True)
        ]
    return counts
