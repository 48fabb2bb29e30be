"""A consistent read of the whole directory, for a scheduler's (or the manager's own) cold start.

Consistency: every flush of the manager is one Lua call (atomic in Redis), and the reader takes the
holders (with their parents), workers, offsets, seqs, stats and version in one MULTI/EXEC, so the result is
always the state after some whole number of flushes: the blocks are exactly those produced by every
record before ``offsets``.

A scheduler resumes its KvEvent consumer at ``offsets[KV_EVENTS.name][partition]`` after loading
``blocks``; the records from there on are the ones not yet in the snapshot.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from services.fleet_directory.layout import (
    HOLDERS_KEY,
    OFFSETS_KEY,
    SEQS_KEY,
    STATS_KEY,
    VERSION_KEY,
    WORKERS_KEY,
    count_holders,
    decode_holders,
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


async def read_raw(redis_client: aioredis.Redis) -> RawDirectory:
    """Read the whole directory in one MULTI/EXEC (see module docstring)."""
    async with redis_client.pipeline(transaction=True) as pipe:
        for key in (HOLDERS_KEY, OFFSETS_KEY, WORKERS_KEY, SEQS_KEY, STATS_KEY):
            pipe.hgetall(key)
        pipe.get(VERSION_KEY)
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


async def read_snapshot(redis_client: aioredis.Redis) -> DirectorySnapshot:
    """The directory as the scheduler needs it: {hash: {worker: tier}}, parents, offsets, workers."""
    raw = await read_raw(redis_client)
    blocks = {h: {w: tier for w, (tier, _) in holders.items()} for h, holders in raw.blocks.items()}
    return DirectorySnapshot(blocks=blocks, parents=raw.parents, offsets=raw.offsets, workers=raw.workers)


async def fleet_copies(redis_client: aioredis.Redis, block_hashes: Sequence[int]) -> list[int]:
    """How many workers of the fleet hold each block (0 if none), in the order asked; one HMGET.

    The contract for a worker's eviction: before dropping a block from its last tier, a worker asks
    this; if the answer is 1 or less (only itself), it demotes the block to disk instead of dropping
    it, so the fleet keeps its last copy. Counts lag the worker's own KvEvents by one manager flush.
    """
    if not block_hashes:
        return []
    values = await redis_client.hmget(HOLDERS_KEY, [str(h) for h in block_hashes])
    return [count_holders(_s(v)) if v is not None else 0 for v in values]
