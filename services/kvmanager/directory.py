"""The fleet's block directory in memory: which worker holds which block in which tier.

The manager is the only writer of its directory (with KV-manager replicas, each replica is the only
writer of the slices it owns: :mod:`services.kvmanager.replica`). It keeps the directory in memory
(authoritative while it runs) and
its write-behind (:mod:`services.kvmanager.write_behind`) writes the *changes* of each consumed batch
to Redis in one Lua call (atomic), together with the Kafka offsets the batch reached, so Redis always
holds a directory that is exactly "every record before these offsets, applied"::

    kafka batch ──apply──▶ Directory (+ DirtyKeys) ──DirectoryWriter: one Lua call──▶ Redis

Redis layout: see :mod:`services.fleet_directory.layout`.

Invariants: ``{kvm}:holders[h]`` exists iff some worker holds the block; ``h ∈ {kvm}:wrk:{w}`` iff ``w``
is one of its entries. The number of copies of a block is the number of its entries (one HMGET, see
``snapshot.fleet_copies``). One hash field per block (not one key per block, and parent and copy
count folded into it rather than kept in hashes of their own) is what lets a flush write tens of
thousands of blocks per Redis call: a hash field costs Redis ~0.6 µs to write, a set member half
that, and those writes are most of the directory's Redis time. Worker ids must not contain ``,``
``=`` ``:`` or ``|`` (events from such ids are refused).

Idempotence: a record is applied only if its envelope ``seq`` is greater than the last seq applied
from the same producer on the same partition (kept in ``{kvm}:seqs``), so replaying the topic from any
earlier offset leaves the directory unchanged. Every write is an absolute value (HSET/HDEL/SADD/SREM
of the current state), so re-sending a flush whose reply was lost is harmless too.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from schemas.messages import ChatRequest, KvEvent, LoadReport
from schemas.token_ids import int_list
from services.fleet_directory.layout import valid_worker_id
from services.kvmanager.dirty_keys import DirtyKeys

log = logging.getLogger(__name__)

#: The holders of one block in memory: ``((worker, tier, last_ms), ...)`` sorted by worker id.
#: A tuple of tuples of str/int, not a dict: CPython's collector stops tracking such tuples once they
#: survive a collection or two, so a directory of millions of blocks adds nothing to the full
#: collections of the manager process (with a dict per block, each full collection walked all of
#: them: pauses of 200-500 ms at 400 000 blocks, straight into the event → Redis lag).
Holders = tuple[tuple[str, str, int], ...]


def _with_holder(entries: Holders, worker: str, tier: str, when: int) -> Holders:
    """``entries`` with ``worker``'s entry set to (tier, when), kept sorted by worker id."""
    if not entries:
        return ((worker, tier, when),)
    out = [e for e in entries if e[0] != worker]
    out.append((worker, tier, when))
    if len(out) > 1:
        out.sort()
    return tuple(out)


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


class Directory:
    """The in-memory directory and the keys its changes touched.

    Owns: holders per block (tier, last use), parent links, each worker's block set, worker info,
    consumed offsets, per-(topic, partition, producer) applied seqs and hit/miss counters. Synchronous
    and pure: it never talks to Redis (its :class:`~services.kvmanager.write_behind.DirectoryWriter`
    does), so the same object is used live, in tests, in the benchmark and in the simulator's reading.
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
        self._dirty = DirtyKeys()
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

    # ---- the change set (read by the write-behind) ------------------------------------------------

    def take_changes(self) -> DirtyKeys | None:
        """The keys changed since the last call, and a fresh change set; None if nothing changed."""
        if self._dirty.empty():
            return None
        d, self._dirty = self._dirty, DirtyKeys()
        return d

    def reset(self) -> None:
        """Forget everything (before a load from Redis)."""
        self.__init__()  # type: ignore[misc]  # every field back to its initial value

    def restore_changes(self, old: DirtyKeys) -> None:
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
