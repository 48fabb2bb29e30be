"""The fleet's block directory: which worker holds which block in which tier, persisted in Redis.

The manager is the only writer. It keeps the directory in memory (authoritative while it runs) and
writes the *changes* of each consumed batch to Redis in one MULTI/EXEC, together with the Kafka
offsets the batch reached, so Redis always holds a directory that is exactly "every record before
these offsets, applied"::

    kafka batch ──apply──▶ memory (+ dirty marks) ──flush: MULTI … EXEC──▶ Redis
                                                     blk / wrk / copies / parents / workers /
                                                     offsets / seqs / stats / version (INCR)

Redis layout (block hashes and offsets as decimal strings):

=========================  ======  ==================================================================
key                        type    content
=========================  ======  ==================================================================
``kvm:holders``            hash    block hash → ``"{worker}={tier}:{last_ms},…"`` (by worker id)
``kvm:parents``            hash    block hash → parent hash (0 for a first block)
``kvm:copies``             hash    block hash → number of workers holding it (absent = 0)
``kvm:wrk:{worker}``       set     block hashes the worker holds
``kvm:workers``            hash    worker → JSON info (last_seen_ms, transfer_address, tiers, …)
``kvm:offsets``            hash    ``"{topic}:{partition}"`` → next offset to consume
``kvm:seqs``               hash    ``"{topic}:{partition}:{producer}"`` → last applied envelope seq
``kvm:stats``              hash    counters (lookups, hit_blocks, miss_blocks, events, blocks_applied)
``kvm:version``            string  incremented by every flush (readers WATCH it for a consistent read)
=========================  ======  ==================================================================

Invariants: ``kvm:holders[h]`` exists iff some worker holds the block; ``kvm:copies[h]`` equals the
number of its entries; ``h ∈ kvm:wrk:{w}`` iff ``w`` is one of them. One hash field per block (not one
key per block) lets a flush write thousands of blocks per Redis call. Worker ids must not contain
``,`` ``=`` or ``:`` (events from such ids are refused).

Idempotence: a record is applied only if its envelope ``seq`` is greater than the last seq applied
from the same producer on the same partition (kept in ``kvm:seqs``), so replaying the topic from any
earlier offset leaves the directory unchanged. Every write is an absolute value (HSET/HDEL/SADD/SREM
of the current state), so re-sending a flush whose reply was lost is harmless too.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from schemas.messages import ChatRequest, KvEvent, LoadReport

log = logging.getLogger(__name__)

HOLDERS_KEY = "kvm:holders"
WORKER_PREFIX = "kvm:wrk:"
PARENTS_KEY = "kvm:parents"
COPIES_KEY = "kvm:copies"
WORKERS_KEY = "kvm:workers"
OFFSETS_KEY = "kvm:offsets"
SEQS_KEY = "kvm:seqs"
STATS_KEY = "kvm:stats"
VERSION_KEY = "kvm:version"

#: Applies one flush atomically inside Redis. ARGV[1] is a MessagePack map of flat lists (see
#: ``Directory._payload``); one call replaces tens of thousands of pipelined commands, whose
#: client-side encoding and reply parsing would otherwise dominate the manager's time.
APPLY_LUA = """
local p = cmsgpack.unpack(ARGV[1])
local STEP = 1000
local function chunked(cmd, key, list, width)
  local n = #list
  local i = 1
  while i <= n do
    local j = math.min(i + STEP * width - 1, n)
    redis.call(cmd, key, unpack(list, i, j))
    i = j + 1
  end
end
local function each_key(cmd, list)
  local i = 1
  while i <= #list do
    local j = math.min(i + STEP - 1, #list)
    redis.call(cmd, unpack(list, i, j))
    i = j + 1
  end
end
each_key('UNLINK', p.unlink)
chunked('HSET', 'kvm:holders', p.hs, 2)
chunked('HDEL', 'kvm:holders', p.hd, 1)
chunked('HSET', 'kvm:copies', p.cs, 2)
chunked('HDEL', 'kvm:copies', p.hd, 1)
chunked('HSET', 'kvm:parents', p.ps, 2)
chunked('HDEL', 'kvm:parents', p.pd, 1)
for _, w in ipairs(p.wx) do redis.call('DEL', 'kvm:wrk:' .. w) end
for w, m in pairs(p.wa) do chunked('SADD', 'kvm:wrk:' .. w, m, 1) end
for w, m in pairs(p.wr) do chunked('SREM', 'kvm:wrk:' .. w, m, 1) end
chunked('HSET', 'kvm:workers', p['is'], 2)
chunked('HDEL', 'kvm:workers', p.id, 1)
chunked('HSET', 'kvm:offsets', p.os, 2)
chunked('HSET', 'kvm:seqs', p.ss, 2)
chunked('HSET', 'kvm:stats', p.st, 2)
return redis.call('INCR', 'kvm:version')
"""

#: Errors that mean "Redis is not reachable right now" (as opposed to a bug in a command).
REDIS_DOWN_ERRORS: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, OSError)


def worker_key(worker_id: str) -> str:
    return f"{WORKER_PREFIX}{worker_id}"


def encode_holders(holders: dict[str, tuple[str, int]]) -> str:
    """``{"w1": ("gpu", 5)}`` → ``"w1=gpu:5"`` (entries by worker id, joined by commas)."""
    if len(holders) == 1:  # the common case, without the sort
        for w, (t, ms) in holders.items():
            return f"{w}={t}:{ms}"
    return ",".join(f"{w}={t}:{ms}" for w, (t, ms) in sorted(holders.items()))


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


def decode_holders(value: str) -> dict[str, tuple[str, int]]:
    out: dict[str, tuple[str, int]] = {}
    for entry in value.split(","):
        if not entry:
            continue
        w, _, rest = entry.partition("=")
        tier, _, last = rest.partition(":")
        out[w] = (tier, int(last or 0))
    return out


def valid_worker_id(worker_id: str) -> bool:
    return bool(worker_id) and not any(c in worker_id for c in ",=:")


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
    """Changes since the last successful flush, coalesced to the latest value per key."""

    blocks: set[int] = field(default_factory=set)
    parents: dict[int, int | None] = field(default_factory=dict)
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
            + len(self.parents)
            + sum(len(s) for s in self.worker_add.values())
            + sum(len(s) for s in self.worker_rem.values())
            + len(self.workers)
            + len(self.seqs)
        )

    def empty(self) -> bool:
        return not (
            self.blocks
            or self.parents
            or self.worker_add
            or self.worker_rem
            or self.worker_reset
            or self.workers
            or self.offsets
            or self.seqs
            or self.stats
        )


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
        self.max_event_ms = max(self.max_event_ms, when)
        self.stats["events"] += 1
        self._dirty.stats = True
        if not valid_worker_id(ev.worker_id):
            log.error("KvEvent from worker id %r refused: ids may not contain , = or :", ev.worker_id)
            return 0
        if ev.kind == "cleared":
            return self.drop_worker_blocks(ev.worker_id)
        n = 0
        if ev.kind in ("stored", "moved"):
            parents = ev.parent_hashes
            for i, h in enumerate(ev.block_hashes):
                self._set_holder(h, ev.worker_id, ev.tier, when)
                if parents:
                    self._set_parent(h, parents[i])
                n += 1
        elif ev.kind == "removed":
            for h in ev.block_hashes:
                n += self._remove_holder(h, ev.worker_id)
        self.stats["blocks_applied"] += n
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

    def _set_holder(self, h: int, worker: str, tier: str, when: int) -> None:
        entries = self.blocks.get(h)
        if entries is None:
            self.blocks[h] = ((worker, tier, when),)  # the common case: a first holder
        else:
            self.blocks[h] = _with_holder(entries, worker, tier, when)
        self._dirty.blocks.add(h)
        wb = self.worker_blocks.get(worker)
        if wb is None:
            wb = self.worker_blocks[worker] = set()
        if h not in wb:
            wb.add(h)
            self._dirty.worker_add[worker].add(h)
            self._dirty.worker_rem[worker].discard(h)

    def _set_parent(self, h: int, parent: int) -> None:
        if self.parents.get(h) != parent:
            self.parents[h] = parent
            self._dirty.parents[h] = parent

    def _remove_holder(self, h: int, worker: str) -> int:
        wb = self.worker_blocks.get(worker)
        if wb is None or h not in wb:
            return 0
        wb.discard(h)
        if not wb:
            del self.worker_blocks[worker]
        self._dirty.worker_rem[worker].add(h)
        self._dirty.worker_add[worker].discard(h)
        self._unlink(h, worker)
        return 1

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
            if h in self.parents:
                del self.parents[h]
                self._dirty.parents[h] = None

    # ---- Redis ------------------------------------------------------------------------------------

    def _payload(self, d: _Dirty, unlink: list[str] | None = None) -> bytes:
        """The writes of ``d`` as one MessagePack map for :data:`APPLY_LUA` (hashes as decimal text:
        Lua numbers are doubles and would round 64-bit hashes)."""
        hs: list[str] = []
        hd: list[str] = []
        cs: list[str] = []
        for h in d.blocks:
            sh = str(h)
            entries = self.blocks.get(h)
            if entries:
                hs += (sh, _encode_entries(entries))
                cs += (sh, str(len(entries)))
            else:
                hd.append(sh)
        ps: list[str] = []
        pd: list[str] = []
        for h, par in d.parents.items():
            if par is None:
                pd.append(str(h))
            else:
                ps += (str(h), str(par))
        wa: dict[str, list[str]] = {}
        wr: dict[str, list[str]] = {}
        for w in d.worker_reset:
            members = self.worker_blocks.get(w)
            if members:
                wa[w] = [str(h) for h in members]
        for w, added in d.worker_add.items():
            if added and w not in d.worker_reset:
                wa[w] = [str(h) for h in added]
        for w, removed in d.worker_rem.items():
            if removed and w not in d.worker_reset:
                wr[w] = [str(h) for h in removed]
        info_set: list[str] = []
        for w in d.workers:
            if w in self.workers:
                info_set += (w, json.dumps(self.workers[w], sort_keys=True))
        payload = {
            "unlink": unlink or [],
            "hs": hs,
            "hd": hd,
            "cs": cs,
            "ps": ps,
            "pd": pd,
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
        return msgpack.packb(payload, use_bin_type=False)

    async def _apply(self, client: aioredis.Redis, payload: bytes) -> int:
        script = getattr(client, "_kvm_apply_script", None)
        if script is None:
            script = client.register_script(APPLY_LUA)
            client._kvm_apply_script = script  # type: ignore[attr-defined]  # one per client
        return int(await script(keys=[], args=[payload]))

    async def flush(self, client: aioredis.Redis) -> bool:
        """Write every change since the last flush atomically (one Lua call). False if Redis is down.

        On failure nothing is cleared: the changes stay coalesced in memory and the next flush sends
        them (with newer ones folded in). The caller must not apply records while a flush is awaited.

        If ``kvm:version`` did not advance by exactly one, Redis lost its data (a restart without
        persistence) or someone else wrote it: the whole directory is then rewritten from memory.
        """
        if self._dirty.empty():
            return True
        try:
            version = await self._apply(client, self._payload(self._dirty))
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
            return False
        self._version = version
        self._dirty = _Dirty()
        return True

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
        full.parents = dict(self.parents)
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
        from services.kvmanager.snapshot import read_raw

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
