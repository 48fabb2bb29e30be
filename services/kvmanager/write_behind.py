"""The directory's write-behind to Redis: each batch's changes in one atomic Lua call.

::

    Directory (memory, authoritative) ──take_flush: changed keys, values read now──▶ PendingFlush
    PendingFlush ──send_flush: one Lua call (APPLY_LUA)──▶ Redis (holders / wrk / workers / offsets /
                                                                  seqs / stats / version INCR)

A failed send folds its keys back into the directory's change set; a version that did not advance by
exactly one (Redis restarted empty, or another writer) makes the next write a whole rewrite from
memory. ``load`` is the other direction: a manager's cold start from what Redis holds.

A writer owns one slice of the layout (``prefix``; see :mod:`services.fleet_directory.layout`). A
*fenced* writer (KV-manager replicas) sends the version it expects with each flush: a slice that
another replica wrote since is left untouched and :class:`SliceTaken` is raised, so a replica that
lost a shard to another can never overwrite the new owner's state; a slice whose version went *back*
(Redis restarted empty) is rewritten from memory as before.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import operator
from dataclasses import dataclass, field

import msgpack
import redis.asyncio as aioredis

from services.fleet_directory.layout import (
    APPLY_LUA,
    KEY_PREFIX,
    REDIS_DOWN_ERRORS,
    migrate_legacy_keys,
)
from services.kvmanager.directory import Directory, Holders
from services.kvmanager.dirty_keys import DirtyKeys

log = logging.getLogger(__name__)


def _encode_entries(entries: Holders) -> str:
    """The ``{kvm}:holders`` value of in-memory holders (already sorted by worker id)."""
    if len(entries) == 1:
        w, t, ms = entries[0]
        return f"{w}={t}:{ms}"
    return ",".join(f"{w}={t}:{ms}" for w, t, ms in entries)


def _encode_or_empty(entries: Holders | None) -> str:
    return _encode_entries(entries) if entries else ""


def _interleave(keys: list[str], values: list[str]) -> list[str]:
    """``[k0, v0, k1, v1, …]`` (HSET arguments) by slice assignment, without a per-item loop."""
    out = [""] * (2 * len(keys))
    out[::2] = keys
    out[1::2] = values
    return out


def _entries_of(holders: dict[str, tuple[str, int]]) -> Holders:
    return tuple(sorted((w, t, ms) for w, (t, ms) in holders.items()))


@dataclass(slots=True)
class PendingFlush:
    """One flush taken from the directory (:meth:`DirectoryWriter.take_flush`) and not yet confirmed.

    ``payload`` is the script argument, built from memory at take time, so the directory may go on
    changing while it is sent. ``event_ms`` is free for the caller (the service keeps there the event
    times of the KvEvents the flush makes durable).
    """

    payload: bytes
    dirty: DirtyKeys
    event_ms: list[int] = field(default_factory=list)


class SliceTaken(Exception):
    """A fenced flush found its slice written by another writer since this one's last write."""

    def __init__(self, prefix: str, expected: int, found: int) -> None:
        super().__init__(f"slice {prefix} is at version {found}, this writer expected {expected}")
        self.prefix = prefix
        self.expected = expected
        self.found = found


class DirectoryWriter:
    """Owns the Redis side of one :class:`Directory`: the slice it writes (``prefix``), the version
    this manager last wrote and the flushes. At most one flush is in flight; the directory may change
    while it is sent."""

    def __init__(self, directory: Directory, prefix: str = KEY_PREFIX, *, fenced: bool = False) -> None:
        self.directory = directory
        self.prefix = prefix
        self.version_key = prefix + "version"
        self.fenced = fenced
        # The slice's version after our last flush; None until the first flush or load.
        self._version: int | None = None
        self.full_rewrites = 0

    def _payload(self, d: DirtyKeys, unlink: list[str] | None = None) -> bytes:
        """The writes of ``d`` as one MessagePack map for :data:`APPLY_LUA` (hashes as decimal text:
        Lua numbers are doubles and would round 64-bit hashes)."""
        # Per key only C-level map/compress/slice work and one f-string: a flush carries a few
        # keys per block update.
        get = self.directory.blocks.get
        changed = list(d.blocks)
        # Holders tuples are shared by the blocks of one event: each distinct tuple is encoded once.
        encode = functools.lru_cache(maxsize=None)(_encode_or_empty)
        values = list(map(encode, map(get, changed)))
        hd: list[str] = []
        if "" in values:  # blocks nobody holds any more
            held = list(map(bool, values))
            hd = list(map(str, itertools.compress(changed, map(operator.not_, held))))
            changed = list(itertools.compress(changed, held))
            values = list(filter(None, values))
        parents = list(map(self.directory.parents.get, changed))
        values = [e if p is None else f"{p}|{e}" for p, e in zip(parents, values, strict=True)]
        hs = _interleave(list(map(str, changed)), values)
        wa: dict[str, list[str]] = {}
        wr: dict[str, list[str]] = {}
        for w in d.worker_reset:
            members = self.directory.worker_blocks.get(w)
            if members:
                wa[w] = list(map(str, members))
        for w, added in d.worker_add.items():
            if added and w not in d.worker_reset:
                wa[w] = list(map(str, added))
        for w, removed in d.worker_rem.items():
            if removed and w not in d.worker_reset:
                wr[w] = list(map(str, removed))
        info_set: list[str] = []
        for w in d.workers:
            if w in self.directory.workers:
                info_set += (w, json.dumps(self.directory.workers[w], sort_keys=True))
        payload = {
            "unlink": unlink or [],
            "hs": hs,
            "hd": hd,
            "wx": sorted(d.worker_reset),
            "wa": wa,
            "wr": wr,
            "is": info_set,
            "id": [w for w in d.workers if w not in self.directory.workers],
            "os": [x for (t, p), o in self.directory.offsets.items() for x in (f"{t}:{p}", str(o))]
            if d.offsets
            else [],
            "ss": [x for t, p, pr in d.seqs for x in (f"{t}:{p}:{pr}", str(self.directory.seqs[(t, p, pr)]))],
            "st": [x for k, v in self.directory.stats.items() for x in (k, str(v))] if d.stats else [],
        }
        packed: bytes = msgpack.packb(payload, use_bin_type=False)
        return packed

    async def _apply(self, client: aioredis.Redis, payload: bytes, expect: int | None = None) -> int:
        """Run the flush script; with ``expect``, the slice's current version (negative: ``-1 -
        current``) when it differs, and nothing is written."""
        script = getattr(client, "_kvm_apply_script", None)
        if script is None:
            script = client.register_script(APPLY_LUA)
            client._kvm_apply_script = script  # type: ignore[attr-defined]  # one per client
        fence = "" if expect is None else str(expect)
        return int(await script(keys=[self.version_key], args=[payload, self.prefix, fence]))

    async def flush(self, client: aioredis.Redis) -> bool:
        """Write every change since the last flush atomically (one Lua call). False if Redis is down.

        The same as :meth:`take_flush` then :meth:`send_flush`; on failure nothing is lost: the
        changes stay coalesced in memory and the next flush sends them (with newer ones folded in).
        """
        pending = self.take_flush()
        return pending is None or await self.send_flush(client, pending)

    def take_flush(self) -> PendingFlush | None:
        """Build the next flush from memory and start a new change set; None if nothing changed.

        The directory may be changed while the flush is sent (the payload is already built); at most
        one flush may be in flight, and every taken flush must be handed to :meth:`send_flush`, which
        puts its changes back if it fails.
        """
        d = self.directory.take_changes()
        if d is None:
            return None
        return PendingFlush(self._payload(d), d)

    async def send_flush(self, client: aioredis.Redis, pending: PendingFlush) -> bool:
        """Write a taken flush. False if Redis is down (its changes are then folded back into the
        current ones, to be sent again with the next flush).

        If ``{kvm}:version`` did not advance by exactly one, Redis lost its data (a restart without
        persistence) or someone else wrote it: the whole directory is then rewritten from memory.
        """
        try:
            expect = self._version if self.fenced else None
            version = await self._apply(client, pending.payload, expect)
            if version < 0:
                found = -1 - version
                assert expect is not None
                if found > expect:
                    raise SliceTaken(self.prefix, expect, found)
                # Lower: Redis lost the slice (restarted empty); memory is authoritative.
                log.warning("slice %s went back to version %d: rewriting it from memory", self.prefix, found)
                version = await self._rewrite_all(client)
            elif self._version is not None and version != self._version + 1:
                log.warning(
                    "directory in Redis is not the one this manager wrote (version %d, expected %d): "
                    "rewriting it whole from memory",
                    version,
                    self._version + 1,
                )
                version = await self._rewrite_all(client)
        except REDIS_DOWN_ERRORS as exc:
            log.debug("directory flush failed: %s", exc)
            self.directory.restore_changes(pending.dirty)
            return False
        except BaseException:
            self.directory.restore_changes(pending.dirty)
            raise
        self._version = version
        return True

    async def verify(self, client: aioredis.Redis) -> bool:
        """Rewrite Redis from memory if it no longer holds the directory this manager last wrote.

        Returns True if a rewrite was needed. Raises a REDIS_DOWN_ERRORS error if Redis is down.
        """
        if self._version is None:
            return False
        raw = await client.get(self.version_key)
        if int(raw or 0) == self._version:
            return False
        if self.fenced and int(raw or 0) > self._version:
            raise SliceTaken(self.prefix, self._version, int(raw or 0))
        log.warning("directory in Redis is gone or foreign (version %s): rewriting it from memory", raw)
        await self.take_over(client)
        return True

    async def _rewrite_all(self, client: aioredis.Redis) -> int:
        """Replace every ``{kvm}:*`` key with the in-memory directory in one script call; returns version."""
        stale = [
            k.decode() if isinstance(k, bytes) else k
            async for k in client.scan_iter(match=self.prefix + "*", count=1000)
        ]
        full = DirtyKeys()
        full.blocks = set(self.directory.blocks)
        full.worker_reset = set(self.directory.worker_blocks)
        full.workers = set(self.directory.workers)
        full.offsets = True
        full.seqs = set(self.directory.seqs)
        full.stats = True
        version = await self._apply(client, self._payload(full, unlink=stale))
        self.full_rewrites += 1
        return version

    async def take_over(self, client: aioredis.Redis) -> None:
        """Make this writer the slice's writer now: rewrite it whole from memory (a replica that just
        became the leader; its memory is current, what Redis holds may be another replica's)."""
        self._version = await self._rewrite_all(client)
        self.directory.take_changes()  # all written by the rewrite

    async def load(self, client: aioredis.Redis) -> None:
        """Rebuild the in-memory directory from Redis (cold start after a restart of the manager)."""
        from services.fleet_directory.snapshot import read_raw

        if self.prefix == KEY_PREFIX:
            renamed = await migrate_legacy_keys(client)
            if renamed:
                log.warning("directory keys renamed to the hash-tagged layout ({kvm}:*): %d keys", renamed)
        raw = await read_raw(client, self.prefix)
        self.directory.reset()
        for h, holders in raw.blocks.items():
            self.directory.blocks[h] = _entries_of(holders)
            for w in holders:
                self.directory.worker_blocks.setdefault(w, set()).add(h)
        self.directory.parents = dict(raw.parents)
        self.directory.workers = dict(raw.workers)
        for topic, parts in raw.offsets.items():
            for p, o in parts.items():
                self.directory.offsets[(topic, p)] = o
        self.directory.seqs = dict(raw.seqs)
        self.directory.stats.update(raw.stats)
        self.directory.max_event_ms = max(
            [0, *(int(i.get("last_seen_ms", 0)) for i in self.directory.workers.values())]
        )
        self._version = raw.version
