"""The fleet's block directory: which worker holds which block in which tier, persisted in Redis.

The manager is the only writer. It keeps the directory in memory (authoritative while it runs) and
writes the *changes* of each consumed batch to Redis in one Lua call (atomic), together with the Kafka
offsets the batch reached, so Redis always holds a directory that is exactly "every record before
these offsets, applied"::

    kafka batch ──apply──▶ memory (+ dirty keys) ──flush: one Lua call──▶ Redis
                                                     holders / wrk / workers / offsets /
                                                     seqs / stats / version (INCR)

Redis layout: see :mod:`services.fleet_directory.layout`.

Invariants: ``kvm:holders[h]`` exists iff some worker holds the block; ``h ∈ kvm:wrk:{w}`` iff ``w``
is one of its entries. The number of copies of a block is the number of its entries (one HMGET, see
``snapshot.fleet_copies``). One hash field per block (not one key per block, and parent and copy
count folded into it rather than kept in hashes of their own) is what lets a flush write tens of
thousands of blocks per Redis call: a hash field costs Redis ~0.6 µs to write, a set member half
that, and those writes are most of the directory's Redis time. Worker ids must not contain ``,``
``=`` ``:`` or ``|`` (events from such ids are refused).

Idempotence: a record is applied only if its envelope ``seq`` is greater than the last seq applied
from the same producer on the same partition (kept in ``kvm:seqs``), so replaying the topic from any
earlier offset leaves the directory unchanged. Every write is an absolute value (HSET/HDEL/SADD/SREM
of the current state), so re-sending a flush whose reply was lost is harmless too.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import operator
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis.asyncio as aioredis

from schemas.messages import ChatRequest, KvEvent, LoadReport
from schemas.token_ids import int_list
from services.fleet_directory.layout import (
    APPLY_LUA,
    REDIS_DOWN_ERRORS,
    VERSION_KEY,
    valid_worker_id,
)

log = logging.getLogger(__name__)


#: The holders of one block in memory: ``((worker, tier, last_ms), ...)`` sorted by worker id.
#: A tuple of tuples of str/int, not a dict: CPython's collector stops tracking such tuples once they
#: survive a collection or two, so a directory of millions of blocks adds nothing to the full
#: collections of the manager process (with a dict per block, each full collection walked all of
#: them: pauses of 200-500 ms at 400 000 blocks, straight into the event → Redis lag).
Holders = tuple[tuple[str, str, int], ...]


def _encode_entries(entries: Holders) -> str:
    """The ``kvm:holders`` value of in-memory holders (already sorted by worker id)."""
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


def _with_holder(entries: Holders, worker: str, tier: str, when: int) -> Holders:
    """``entries`` with ``worker``'s entry set to (tier, when), kept sorted by worker id."""
    if not entries:
        return ((worker, tier, when),)
    out = [e for e in entries if e[0] != worker]
    out.append((worker, tier, when))
    if len(out) > 1:
        out.sort()
    return tuple(out)


def _entries_of(holders: dict[str, tuple[str, int]]) -> Holders:
    return tuple(sorted((w, t, ms) for w, (t, ms) in holders.items()))


def worker_info(report: LoadReport) -> dict[str, Any]:
    """What the directory keeps about a worker: enough for placement and for a cold-starting scheduler."""
    return {
        "last_seen_ms": report.report_ms,
        "transfer_address": report.transfer_address,
        "block_size": report.block_size,
        "block_bytes": report.block_bytes,
        "queue_depth": report.queue_depth,
        "active_requests": report.active_requests,
        "active_tokens": report.active_tokens,
        "queued_prefill_tokens": report.queued_prefill_tokens,
        "tiers": {t.tier: [t.free_blocks, t.total_blocks] for t in report.tiers},
        "draining": report.draining,
        "model": report.model,
        "started_ms": report.started_ms,
    }


@dataclass(slots=True)
class _Dirty:
    """Keys changed since the last successful flush. Values are read from memory when the flush is
    built, so each key is written once with its latest value however often it changed."""

    blocks: set[int] = field(default_factory=set)  # kvm:holders fields (holders or parent changed)
    worker_add: defaultdict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    worker_rem: defaultdict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    worker_reset: set[str] = field(default_factory=set)  # rewrite the whole set (after a clear)
    workers: set[str] = field(default_factory=set)
    offsets: bool = False
    seqs: set[tuple[str, int, str]] = field(default_factory=set)
    stats: bool = False

    def size(self) -> int:
        return (
            len(self.blocks)
            + sum(len(s) for s in self.worker_add.values())
            + sum(len(s) for s in self.worker_rem.values())
            + len(self.workers)
            + len(self.seqs)
        )

    def empty(self) -> bool:
        return not (
            self.blocks
            or self.worker_add
            or self.worker_rem
            or self.worker_reset
            or self.workers
            or self.offsets
            or self.seqs
            or self.stats
        )


@dataclass(slots=True)
class PendingFlush:
    """One flush taken from the directory (:meth:`Directory.take_flush`) and not yet confirmed.

    ``payload`` is the script argument, built from memory at take time, so the directory may go on
    changing while it is sent. ``event_ms`` is free for the caller (the service keeps there the event
    times of the KvEvents the flush makes durable).
    """

    payload: bytes
    dirty: _Dirty
    event_ms: list[int] = field(default_factory=list)


class Directory:
    """The in-memory directory and its write-behind to Redis.

    Owns: holders per block (tier, last use), parent links, each worker's block set, worker info,
    consumed offsets, per-(topic, partition, producer) applied seqs and hit/miss counters. Only
    :meth:`flush` talks to Redis; everything else is synchronous and pure in-memory, so the same
    object is used live, in tests and in the benchmark.
    """

    def __init__(self) -> None:
        self.blocks: dict[int, Holders] = {}
        self.parents: dict[int, int] = {}
        self.worker_blocks: dict[str, set[int]] = {}
        self.workers: dict[str, dict[str, Any]] = {}
        self.offsets: dict[tuple[str, int], int] = {}
        self.seqs: dict[tuple[str, int, str], int] = {}
        self.stats: dict[str, int] = defaultdict(int)
        self.max_event_ms = 0
        self._dirty = _Dirty()
        # kvm:version after our last flush; None until the first flush or load.
        self._version: int | None = None
        self.full_rewrites = 0
        self._valid_ids: set[str] = set()

    def _check_id(self, worker_id: str) -> bool:
        if valid_worker_id(worker_id):
            self._valid_ids.add(worker_id)
            return True
        return False

    # ---- record bookkeeping -------------------------------------------------------------------

    def accept(self, topic: str, partition: int, offset: int, producer: str, seq: int) -> bool:
        """Advance the offset of (topic, partition) past ``offset``; True if the record is new.

        A record whose seq is not above the last one applied from its producer on that partition is
        a redelivery (or a replay) and must not be applied again.
        """
        tp = (topic, partition)
        if offset + 1 > self.offsets.get(tp, 0):
            self.offsets[tp] = offset + 1
            self._dirty.offsets = True
        key = (topic, partition, producer)
        if seq <= self.seqs.get(key, -1):
            return False
        self.seqs[key] = seq
        self._dirty.seqs.add(key)
        return True

    # ---- applying messages ----------------------------------------------------------------------

    def apply_kv_event(self, ev: KvEvent, event_ms: int | None = None) -> int:
        """Apply one KvEvent; returns the number of block-level updates it made."""
        when = ev.event_ms or (event_ms or 0)
        if when > self.max_event_ms:
            self.max_event_ms = when
        stats = self.stats
        stats["events"] += 1
        self._dirty.stats = True
        worker = ev.worker_id
        if worker not in self._valid_ids and not self._check_id(worker):
            log.error("KvEvent from worker id %r refused: ids may not contain , = : or |", worker)
            return 0
        kind = ev.kind
        if kind == "cleared":
            return self.drop_worker_blocks(worker)
        hashes = int_list(ev.block_hashes)
        if kind in ("stored", "moved"):
            n = self._set_holders(hashes, worker, ev.tier, when)
            if ev.parent_hashes:
                # The blocks are dirty already (their holders were just set): the parents travel
                # with them, so an unchanged parent costs nothing to set again.
                self.parents.update(zip(hashes, int_list(ev.parent_hashes), strict=False))
        elif kind == "removed":
            n = self._remove_holders(hashes, worker)
        else:
            n = 0
        stats["blocks_applied"] += n
        return n

    def apply_load(self, report: LoadReport) -> None:
        """Record a worker's LoadReport (its info and liveness heartbeat)."""
        self.max_event_ms = max(self.max_event_ms, report.report_ms)
        prev = self.workers.get(report.worker_id)
        if prev is not None and prev.get("last_seen_ms", 0) > report.report_ms:
            return  # an older report arriving late never moves last_seen back
        self.workers[report.worker_id] = worker_info(report)
        self._dirty.workers.add(report.worker_id)

    def observe_lookup(self, request: ChatRequest) -> int:
        """Count a request's blocks as fleet hits (leading run held somewhere) or misses; returns hits."""
        self.max_event_ms = max(self.max_event_ms, request.arrival_ms)
        hits = 0
        for h in request.block_hashes:
            if h not in self.blocks:
                break
            hits += 1
        self.stats["lookups"] += 1
        self.stats["hit_blocks"] += hits
        self.stats["miss_blocks"] += len(request.block_hashes) - hits
        self._dirty.stats = True
        return hits

    def drop_worker_blocks(self, worker_id: str) -> int:
        """Forget every block of ``worker_id`` (a ``cleared`` event or a lost worker)."""
        held = self.worker_blocks.pop(worker_id, set())
        for h in held:
            self._unlink(h, worker_id)
        self._dirty.worker_add.pop(worker_id, None)
        self._dirty.worker_rem.pop(worker_id, None)
        self._dirty.worker_reset.add(worker_id)
        return len(held)

    def drop_worker(self, worker_id: str) -> int:
        """Remove a lost worker entirely: its blocks and its info."""
        n = self.drop_worker_blocks(worker_id)
        if self.workers.pop(worker_id, None) is not None:
            self._dirty.workers.add(worker_id)
        return n

    # ---- queries ---------------------------------------------------------------------------------

    def holders(self, block_hash: int) -> dict[str, str]:
        return {w: tier for w, tier, _ in self.blocks.get(block_hash, ())}

    def copies(self, block_hash: int) -> int:
        return len(self.blocks.get(block_hash, ()))

    def holders_of_run(self, block_hashes: Iterable[int]) -> set[str]:
        """Workers that hold every block of ``block_hashes``."""
        common: set[str] | None = None
        for h in block_hashes:
            here = {e[0] for e in self.blocks.get(h, ())}
            common = here if common is None else common & here
            if not common:
                return set()
        return common or set()

    def dirty_size(self) -> int:
        return self._dirty.size()

    def has_dirty(self) -> bool:
        return not self._dirty.empty()

    # ---- internals -------------------------------------------------------------------------------

    def _set_holders(self, hashes: list[int], worker: str, tier: str, when: int) -> int:
        """``worker`` holds every block of ``hashes`` in ``tier`` since ``when``; returns len(hashes).

        The per-block work is one dict lookup and store: the holders tuple of a block that only this
        worker holds is one tuple shared by every block of the event (also one encoding per event in
        the flush); sets are updated with C-level set operations, not per block in Python.
        """
        blocks = self.blocks
        get = blocks.get
        one: Holders = ((worker, tier, when),)
        known = list(map(get, hashes))
        # The blocks of one run usually share one holders tuple (they were stored together), so a
        # set of them is tiny: all new blocks (most stored events) or blocks only this worker holds
        # (most moves) take one C-level update, no Python loop per block.
        distinct = set(known)
        only = next(iter(distinct)) if len(distinct) == 1 else ()
        if only is None or (only and len(only) == 1 and only[0][0] == worker):
            blocks.update(dict.fromkeys(hashes, one))
        else:
            for h, entries in zip(hashes, known, strict=True):
                if entries is None or (len(entries) == 1 and entries[0][0] == worker):
                    blocks[h] = one
                else:
                    blocks[h] = _with_holder(entries, worker, tier, when)
        d = self._dirty
        d.blocks.update(hashes)
        wb = self.worker_blocks.get(worker)
        if wb is None:
            wb = self.worker_blocks[worker] = set()
        if not wb.issuperset(hashes):
            added = set(hashes).difference(wb)
            wb |= added
            d.worker_add[worker] |= added
            rem = d.worker_rem.get(worker)
            if rem:
                rem -= added
        return len(hashes)

    def _remove_holders(self, hashes: list[int], worker: str) -> int:
        """``worker`` no longer holds ``hashes``; returns how many it did hold."""
        wb = self.worker_blocks.get(worker)
        if wb is None:
            return 0
        gone = wb.intersection(hashes)
        if not gone:
            return 0
        wb -= gone
        if not wb:
            del self.worker_blocks[worker]
        d = self._dirty
        d.worker_rem[worker] |= gone
        add = d.worker_add.get(worker)
        if add:
            add -= gone
        for h in gone:
            self._unlink(h, worker)
        return len(gone)

    def _unlink(self, h: int, worker: str) -> None:
        entries = self.blocks.get(h)
        if entries is None:
            return
        rest = tuple(e for e in entries if e[0] != worker)
        if len(rest) == len(entries):
            return
        self._dirty.blocks.add(h)
        if rest:
            self.blocks[h] = rest
        else:
            del self.blocks[h]
            self.parents.pop(h, None)

    # ---- Redis ------------------------------------------------------------------------------------

    def _payload(self, d: _Dirty, unlink: list[str] | None = None) -> bytes:
        """The writes of ``d`` as one MessagePack map for :data:`APPLY_LUA` (hashes as decimal text:
        Lua numbers are doubles and would round 64-bit hashes)."""
        # Per key only C-level map/compress/slice work and one f-string: a flush carries a few
        # keys per block update.
        get = self.blocks.get
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
        parents = list(map(self.parents.get, changed))
        values = [e if p is None else f"{p}|{e}" for p, e in zip(parents, values, strict=True)]
        hs = _interleave(list(map(str, changed)), values)
        wa: dict[str, list[str]] = {}
        wr: dict[str, list[str]] = {}
        for w in d.worker_reset:
            members = self.worker_blocks.get(w)
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
            if w in self.workers:
                info_set += (w, json.dumps(self.workers[w], sort_keys=True))
        payload = {
            "unlink": unlink or [],
            "hs": hs,
            "hd": hd,
            "wx": sorted(d.worker_reset),
            "wa": wa,
            "wr": wr,
            "is": info_set,
            "id": [w for w in d.workers if w not in self.workers],
            "os": [x for (t, p), o in self.offsets.items() for x in (f"{t}:{p}", str(o))]
            if d.offsets
            else [],
            "ss": [x for t, p, pr in d.seqs for x in (f"{t}:{p}:{pr}", str(self.seqs[(t, p, pr)]))],
            "st": [x for k, v in self.stats.items() for x in (k, str(v))] if d.stats else [],
        }
        packed: bytes = msgpack.packb(payload, use_bin_type=False)
        return packed

    async def _apply(self, client: aioredis.Redis, payload: bytes) -> int:
        script = getattr(client, "_kvm_apply_script", None)
        if script is None:
            script = client.register_script(APPLY_LUA)
            client._kvm_apply_script = script  # type: ignore[attr-defined]  # one per client
        return int(await script(keys=[], args=[payload]))

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
        if self._dirty.empty():
            return None
        d = self._dirty
        self._dirty = _Dirty()
        return PendingFlush(self._payload(d), d)

    async def send_flush(self, client: aioredis.Redis, pending: PendingFlush) -> bool:
        """Write a taken flush. False if Redis is down (its changes are then folded back into the
        current ones, to be sent again with the next flush).

        If ``kvm:version`` did not advance by exactly one, Redis lost its data (a restart without
        persistence) or someone else wrote it: the whole directory is then rewritten from memory.
        """
        try:
            version = await self._apply(client, pending.payload)
            if self._version is not None and version != self._version + 1:
                log.warning(
                    "directory in Redis is not the one this manager wrote (version %d, expected %d): "
                    "rewriting it whole from memory",
                    version,
                    self._version + 1,
                )
                version = await self._rewrite_all(client)
        except REDIS_DOWN_ERRORS as exc:
            log.debug("directory flush failed: %s", exc)
            self._restore(pending.dirty)
            return False
        except BaseException:
            self._restore(pending.dirty)
            raise
        self._version = version
        return True

    def _restore(self, old: _Dirty) -> None:
        """Fold the changes of a failed flush back into the current ones (memory is authoritative:
        only the keys matter, except for worker set members, which are re-derived from memory)."""
        d = self._dirty
        d.blocks |= old.blocks
        d.workers |= old.workers
        d.seqs |= old.seqs
        d.offsets = d.offsets or old.offsets
        d.stats = d.stats or old.stats
        for w in old.worker_reset:
            d.worker_reset.add(w)
            d.worker_add.pop(w, None)
            d.worker_rem.pop(w, None)
        for w in {*old.worker_add, *old.worker_rem}:
            if w in d.worker_reset:
                continue
            held = self.worker_blocks.get(w, set())
            for h in old.worker_add.get(w, set()) | old.worker_rem.get(w, set()):
                if h in held:
                    d.worker_add[w].add(h)
                    d.worker_rem[w].discard(h)
                else:
                    d.worker_rem[w].add(h)
                    d.worker_add[w].discard(h)

    async def verify(self, client: aioredis.Redis) -> bool:
        """Rewrite Redis from memory if it no longer holds the directory this manager last wrote.

        Returns True if a rewrite was needed. Raises a REDIS_DOWN_ERRORS error if Redis is down.
        """
        if self._version is None:
            return False
        raw = await client.get(VERSION_KEY)
        if int(raw or 0) == self._version:
            return False
        log.warning("directory in Redis is gone or foreign (version %s): rewriting it from memory", raw)
        self._version = await self._rewrite_all(client)
        self._dirty = _Dirty()
        return True

    async def _rewrite_all(self, client: aioredis.Redis) -> int:
        """Replace every ``kvm:*`` key with the in-memory directory in one script call; returns version."""
        stale = [
            k.decode() if isinstance(k, bytes) else k
            async for k in client.scan_iter(match="kvm:*", count=1000)
        ]
        full = _Dirty()
        full.blocks = set(self.blocks)
        full.worker_reset = set(self.worker_blocks)
        full.workers = set(self.workers)
        full.offsets = True
        full.seqs = set(self.seqs)
        full.stats = True
        version = await self._apply(client, self._payload(full, unlink=stale))
        self.full_rewrites += 1
        return version

    async def load(self, client: aioredis.Redis) -> None:
        """Rebuild the in-memory directory from Redis (cold start after a restart of the manager)."""
        from services.fleet_directory.snapshot import read_raw

        raw = await read_raw(client)
        self.__init__()  # type: ignore[misc]  # reset every field before filling it
        for h, holders in raw.blocks.items():
            self.blocks[h] = _entries_of(holders)
            for w in holders:
                self.worker_blocks.setdefault(w, set()).add(h)
        self.parents = dict(raw.parents)
        self.workers = dict(raw.workers)
        for topic, parts in raw.offsets.items():
            for p, o in parts.items():
                self.offsets[(topic, p)] = o
        self.seqs = dict(raw.seqs)
        self.stats.update(raw.stats)
        self.max_event_ms = max([0, *(int(i.get("last_seen_ms", 0)) for i in self.workers.values())])
        self._version = raw.version
