"""A consistent read of the whole directory, for a scheduler's (or the manager's own) cold start.

Consistency: the manager INCRs ``kvm:version`` in every flush transaction. The reader WATCHes that
key, lists the blocks (``HKEYS kvm:copies``), then reads every block hash, the parents, the workers
and the offsets inside one MULTI/EXEC. If a flush lands in between, EXEC fails (WatchError) and the
read starts over, so the result is always the state after some whole number of flushes: the blocks
are exactly those produced by every record before ``offsets``.

A scheduler resumes its KvEvent consumer at ``offsets[KV_EVENTS.name][partition]`` after loading
``blocks``; the records from there on are the ones not yet in the snapshot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from services.kvmanager.directory import (
    BLOCK_PREFIX,
    COPIES_KEY,
    OFFSETS_KEY,
    PARENTS_KEY,
    SEQS_KEY,
    STATS_KEY,
    VERSION_KEY,
    WORKERS_KEY,
    decode_holder,
)
from services.kvmanager.errors import SnapshotConflict

_MAX_ATTEMPTS = 50


@dataclass
class DirectorySnapshot:
    """The directory at one instant: holders per block, parents, consumed offsets, worker info."""

    blocks: dict[int, dict[str, str]]  # block hash → {worker: tier}
    parents: dict[int, int]  # block hash → parent hash
    offsets: dict[str, dict[int, int]]  # topic name → partition → next offset to consume
    workers: dict[str, dict]  # worker → info (last_seen_ms, transfer_address, tiers, …)


@dataclass
class RawDirectory:
    """Everything in Redis, decoded but unsimplified (holder values keep ``tier:last_ms``)."""

    blocks: dict[int, dict[str, str]] = field(default_factory=dict)
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


async def read_raw(client: aioredis.Redis) -> RawDirectory:
    """Read the whole directory under WATCH + MULTI (see module docstring)."""
    for _ in range(_MAX_ATTEMPTS):
        async with client.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(VERSION_KEY)
                hashes = [_s(h) for h in await pipe.hkeys(COPIES_KEY)]
                pipe.multi()
                for h in hashes:
                    pipe.hgetall(f"{BLOCK_PREFIX}{h}")
                pipe.hgetall(PARENTS_KEY)
                pipe.hgetall(OFFSETS_KEY)
                pipe.hgetall(WORKERS_KEY)
                pipe.hgetall(SEQS_KEY)
                pipe.hgetall(STATS_KEY)
                pipe.get(VERSION_KEY)
                res = await pipe.execute()
            except WatchError:
                continue
        raw = RawDirectory()
        for h, fields in zip(hashes, res[: len(hashes)], strict=True):
            if fields:
                raw.blocks[int(h)] = {_s(w): _s(v) for w, v in fields.items()}
        parents, offsets, workers, seqs, stats, version = res[len(hashes) :]
        raw.parents = {int(_s(h)): int(_s(p)) for h, p in parents.items()}
        for k, v in offsets.items():
            topic, part = _split_offset_key(_s(k))
            raw.offsets.setdefault(topic, {})[part] = int(_s(v))
        raw.workers = {_s(w): json.loads(_s(v)) for w, v in workers.items()}
        for k, v in seqs.items():
            # Topic names hold no ':' (streams/topics.py); a producer id may.
            topic, part, producer = _s(k).split(":", 2)
            raw.seqs[(topic, int(part), producer)] = int(_s(v))
        raw.stats = {_s(k): int(_s(v)) for k, v in stats.items()}
        raw.version = int(_s(version)) if version is not None else 0
        return raw
    raise SnapshotConflict(f"directory changed during {_MAX_ATTEMPTS} snapshot attempts")


async def read_snapshot(redis_client: aioredis.Redis) -> DirectorySnapshot:
    """The directory as the scheduler needs it: {hash: {worker: tier}}, parents, offsets, workers."""
    raw = await read_raw(redis_client)
    blocks = {h: {w: decode_holder(v)[0] for w, v in fields.items()} for h, fields in raw.blocks.items()}
    return DirectorySnapshot(blocks=blocks, parents=raw.parents, offsets=raw.offsets, workers=raw.workers)
