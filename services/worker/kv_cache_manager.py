"""The worker's KV cache across tiers: the only API the engine calls, and the block store of the data plane.

    GPU pool (BlockPool)  --evict LRU-->  DRAM (HostTier)  --evict LRU-->  disk (HostTier)  --> dropped
          ^                                  |                                |
          +------------ promote on use (acquire_prefix) ----------------------+

Invariants:
  * a block hash lives in at most one tier of this worker (moves are moves, not copies);
  * a block referenced by a running request (ref > 0) or pinned by a reader is never evicted; one
    held for a waiting request (``hold``) only when nothing else can go;
  * every store / move / drop is recorded as a :class:`KvEvent` (``drain_kv_events``), with parent
    hashes, so the fleet's prefix index can follow this worker exactly;
  * the namespace each block was stored under is kept (``namespace_of``) for tenant checks.

Eviction takes the least recently used unreferenced block, except that blocks the fleet holds
elsewhere (``set_fleet_copies``) go first and retained blocks (``retain``) last; from DRAM, blocks
with copies elsewhere are dropped while last copies and retained blocks are demoted to disk. Blocks
held for waiting requests (``hold``) are passed over while any other block can go.

One ``threading.RLock`` guards everything: the block server reads from the event-loop thread while
the engine steps in another.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Container
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kvmesh_core.counts import add_counts, remove_counts
from kvmesh_core.event_runs import EventRuns
from kvmesh_core.eviction import VICTIM_WINDOW, HeldElsewhere, dram_victim_to_disk, pick_victim
from schemas.blocks import ROOT_HASH
from schemas.messages import KvEvent, TierUsage
from services.worker.block_pool import BlockPool
from services.worker.errors import BlockSizeMismatch
from services.worker.kv_layout import BlockLayout
from services.worker.tiers import HostTier

log = logging.getLogger(__name__)


#: Blocks per re-announce KvEvent: a hash and a parent are at most 9 bytes each in MessagePack, so
#: 4096 blocks make a ~75 KB record, far below the default 1 MiB record limit.
HOLDINGS_CHUNK = 4096


@dataclass(slots=True)
class BlockMeta:
    """What the manager knows of one held block besides its bytes."""

    parent: int
    namespace: bytes
    tier: str
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The result of :meth:`KvCacheManager.acquire_prefix`: GPU block ids now referenced by the caller."""

    block_ids: list[int]
    promoted: int  # how many of them came up from DRAM or disk


class KvCacheManager:
    """Owns the GPU pool, the DRAM and disk tiers, block metadata and the KV event log of one worker."""

    def __init__(
        self,
        layout: BlockLayout,
        gpu_blocks: int,
        dram_blocks: int = 0,
        disk_blocks: int = 0,
        disk_dir: str | Path | None = None,
        device: torch.device | str = "cpu",
        worker_id: str = "worker-0",
    ) -> None:
        self.layout = layout
        self.worker_id = worker_id
        self.device = torch.device(device)
        self.pool = BlockPool(layout, gpu_blocks, self.device)
        self.dram = HostTier("dram", layout, dram_blocks)
        disk_path = None
        if disk_blocks > 0:
            if disk_dir is None:
                raise ValueError("disk_blocks > 0 needs a disk_dir")
            disk_path = Path(disk_dir) / f"{worker_id}.kvblocks"
        self.disk = HostTier("disk", layout, disk_blocks, disk_path)
        self._tiers = {"dram": self.dram, "disk": self.disk}
        self._meta: dict[int, BlockMeta] = {}
        self._events = EventRuns()
        self._lock = threading.RLock()
        self._gpu_pins: dict[int, int] = {}
        self._reads: dict[int, list[tuple[str, int]]] = {}
        self._fleet_copies: Callable[[int], int] | None = None
        self._retained: dict[int, int] = {}
        # hash → how many waiting requests hold it (``hold``), and each request's held hashes
        self._held: dict[int, int] = {}
        self._holds: dict[str, list[int]] = {}

    # ---- queries -----------------------------------------------------------------------------
    def tier_of(self, block_hash: int) -> str | None:
        with self._lock:
            m = self._meta.get(block_hash)
            return m.tier if m else None

    def lookup_prefix(self, block_hashes: list[int]) -> int:
        """How many leading blocks of ``block_hashes`` this worker holds, in any tier."""
        with self._lock:
            n = 0
            for h in block_hashes:
                if h not in self._meta:
                    break
                n += 1
            return n

    def namespace_of(self, block_hash: int) -> bytes | None:
        with self._lock:
            m = self._meta.get(block_hash)
            return m.namespace if m else None

    def tier_usage(self) -> list[TierUsage]:
        """Capacity per tier; for the GPU tier "free" counts blocks no running request references."""
        with self._lock:
            return [
                TierUsage("gpu", self.pool.num_unreferenced, self.pool.num_blocks),
                TierUsage("dram", self.dram.num_free, self.dram.capacity),
                TierUsage("disk", self.disk.num_free, self.disk.capacity),
            ]

    def held_hashes(self) -> dict[str, list[int]]:
        with self._lock:
            return {"gpu": self.pool.hashes(), "dram": self.dram.hashes(), "disk": self.disk.hashes()}

    # ---- fleet hints -------------------------------------------------------------------------
    def set_fleet_copies(self, fn: Callable[[int], int] | None) -> None:
        """``fn(hash)`` = how many OTHER workers hold the block; None turns the preference off."""
        with self._lock:
            self._fleet_copies = fn

    def retain(self, block_hashes: list[int], until_ms: int) -> None:
        """Keep these blocks (a live session) in a lower tier rather than drop them, until ``until_ms``."""
        with self._lock:
            for h in block_hashes:
                self._retained[h] = max(until_ms, self._retained.get(h, 0))

    def hold(self, key: str, block_hashes: list[int]) -> int:
        """Keep the leading run of ``block_hashes`` held here from eviction until ``unhold(key)``,
        unless nothing else is left to evict: a waiting request's prefix, from the moment it is queued
        (the prompts queued ahead of it would evict it) and again when its pull has landed (the fleet
        rule evicts first a block another worker also holds, and a pulled block is one by definition:
        a busy worker evicted what it had just pulled before the request that pulled it ran). Holding
        again under ``key`` replaces the hold. Returns how many blocks are held."""
        with self._lock:
            self._unhold(key)
            run = block_hashes[: self.lookup_prefix(block_hashes)]
            if run:
                self._holds[key] = run
                add_counts(self._held, run)
            return len(run)

    def unhold(self, key: str) -> None:
        """End ``hold(key)``'s hold (the request was admitted, or ended); nothing when none."""
        with self._lock:
            self._unhold(key)

    def _unhold(self, key: str) -> None:
        remove_counts(self._held, self._holds.pop(key, ()))

    def is_retained(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._retained

    def expire_retains(self, now_ms: int) -> None:
        """Forget retain hints that ran out (``now_ms`` comes from a message field, not the clock)."""
        with self._lock:
            self._retained = {h: t for h, t in self._retained.items() if t > now_ms}

    # ---- engine API --------------------------------------------------------------------------
    def acquire_prefix(self, block_hashes: list[int], max_blocks: int | None = None) -> PrefixHit:
        """Reference the longest held leading run of ``block_hashes`` in the GPU tier, promoting blocks
        from DRAM/disk as needed. Stops early where the GPU tier has no room left."""
        with self._lock:
            limit = len(block_hashes) if max_blocks is None else min(max_blocks, len(block_hashes))
            run = block_hashes[: self.lookup_prefix(block_hashes[:limit])]
            # Pin the lower-tier copies of the whole run so that making room for one promotion
            # cannot demote or drop a later block of the same run.
            slots: dict[int, tuple[HostTier, int]] = {}
            for h in run:
                m = self._meta[h]
                if m.tier != "gpu":
                    tier = self._tiers[m.tier]
                    slot = tier.slot_of(h)
                    assert slot is not None
                    tier.pin(slot)
                    slots[h] = (tier, slot)
            # Reference the GPU-resident blocks of the run first, so that promoting an earlier block
            # never evicts a later one.
            ids: list[int | None] = [
                self.pool.lookup(h) if self._meta[h].tier == "gpu" else None for h in run
            ]
            for b in ids:
                if b is not None:
                    self.pool.incref(b)
            promoted = 0
            try:
                for i, h in enumerate(run):
                    if ids[i] is not None:
                        continue
                    b2 = self._promote(h)
                    if b2 is None:
                        # No room: the hit ends here; drop the references taken beyond it.
                        self.release([b for b in ids[i:] if b is not None])
                        ids = ids[:i]
                        break
                    self.pool.incref(b2)
                    ids[i] = b2
                    promoted += 1
                    # Its copy is in the GPU now: its old slot is free for the next demotion at once
                    # (held until the end, a vacated slot forced a needless drop).
                    tier, slot = slots.pop(h)
                    tier.unpin(slot)
            finally:
                for tier, slot in slots.values():
                    tier.unpin(slot)
            got = [b for b in ids if b is not None]
            return PrefixHit(got, promoted)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh GPU blocks owned by the caller (ref 1), evicting unreferenced blocks as needed;
        None when even eviction cannot free enough (every block is referenced or pinned)."""
        with self._lock:
            if not self._make_gpu_room(n):
                return None
            return self.pool.allocate(n)

    def commit_computed(
        self, block_id: int, block_hash: int, parent: int, namespace: bytes, session_id: str | None = None
    ) -> bool:
        """Name a full block the caller computed into ``block_id``. False (the block stays private and is
        freed on release) when the hash is already held, e.g. computed concurrently by another request."""
        with self._lock:
            if block_hash in self._meta:
                return False
            self.pool.set_hash(block_id, block_hash)
            self._meta[block_hash] = BlockMeta(parent, namespace, "gpu", session_id)
            self._events.add("stored", "gpu", block_hash, parent, session_id=session_id)
            return True

    def release(self, block_ids: list[int]) -> None:
        """Drop the caller's references; named blocks stay cached (most recently used), others are freed.

        Released in reverse so that a request's later blocks are older in LRU order than its first
        ones: eviction then trims prefixes from the tail, keeping the shared head longest."""
        with self._lock:
            for b in reversed(block_ids):
                self.pool.decref(b)

    def sole_blocks(self, block_ids: list[int]) -> int:
        """How many of ``block_ids`` (one request's GPU blocks) no other request references: the
        blocks its end frees for others (kvmesh_core/kv_room.py)."""
        with self._lock:
            return sum(1 for b in block_ids if self.pool.ref_count(b) == 1)

    def gpu_ref_count(self, block_hash: int) -> int:
        with self._lock:
            b = self.pool.lookup(block_hash)
            return 0 if b is None else self.pool.ref_count(b)

    def clear(self) -> list[KvEvent]:
        """Drop every block of every tier (shutdown); returns the one ``cleared`` event to publish."""
        with self._lock:
            self.pool.reset()
            self.dram.reset()
            self.disk.reset()
            self._meta.clear()
            self._events.drain()
            self._gpu_pins.clear()
            self._reads.clear()
            return [KvEvent(worker_id=self.worker_id, kind="cleared", tier="gpu", block_hashes=[])]

    def close(self) -> None:
        self.disk.close()

    def drain_kv_events(self) -> list[KvEvent]:
        """The events recorded since the last drain, consecutive ones of the same kind merged."""
        with self._lock:
            return [
                KvEvent(
                    worker_id=self.worker_id,
                    kind=e.kind,  # type: ignore[arg-type]  # EventRun.kind is one of KvEvent's kinds
                    tier=e.tier,
                    block_hashes=e.hashes,
                    parent_hashes=e.parents,
                    from_tier=e.from_tier,
                    session_id=e.session_id,
                )
                for e in self._events.drain()
            ]

    def holdings_events(self, max_blocks_per_event: int = HOLDINGS_CHUNK) -> list[KvEvent]:
        """Everything this worker holds as ``stored`` events, per tier (GPU, DRAM, disk) with parent
        hashes, at most ``max_blocks_per_event`` blocks each (records stay under the size limit).

        For re-announcing after the fleet forgot us (a WorkerLost about ourselves). The pending event
        log is left alone: publish :meth:`drain_kv_events` first, then these, then later drains, and
        the fleet ends with exactly what is held (a stored repeated or a removal of something not
        re-announced is harmless)."""
        step = max(1, max_blocks_per_event)
        with self._lock:
            out: list[KvEvent] = []
            for tier, hashes in (
                ("gpu", self.pool.hashes()),
                ("dram", self.dram.lru()),
                ("disk", self.disk.lru()),
            ):
                for i in range(0, len(hashes), step):
                    chunk = hashes[i : i + step]
                    out.append(
                        KvEvent(
                            worker_id=self.worker_id,
                            kind="stored",
                            tier=tier,
                            block_hashes=chunk,
                            parent_hashes=[self._meta[h].parent for h in chunk],
                        )
                    )
            return out

    # ---- BlockSource -------------------------------------------------------------------------
    def read_block(self, block_hash: int) -> tuple[str, memoryview] | None:
        """The bytes of a held block from whichever tier holds it, without promoting; pinned until
        ``release_read``. GPU blocks on a CUDA device are copied to host memory first."""
        with self._lock:
            m = self._meta.get(block_hash)
            if m is None:
                return None
            if m.tier == "gpu":
                b = self.pool.lookup(block_hash)
                assert b is not None
                t = self.pool.tensor[b]
                self._gpu_pins[b] = self._gpu_pins.get(b, 0) + 1
                pin = ("gpu", b)
            else:
                tier = self._tiers[m.tier]
                slot = tier.slot_of(block_hash)
                assert slot is not None
                t = tier.get(block_hash)
                tier.pin(slot)
                pin = (m.tier, slot)
            self._reads.setdefault(block_hash, []).append(pin)
            if t.device.type != "cpu":
                t = t.cpu()
            return m.tier, t.reshape(-1).view(torch.uint8).numpy().data

    def release_read(self, block_hash: int) -> None:
        with self._lock:
            pins = self._reads.get(block_hash)
            if not pins:
                return
            tier_name, slot = pins.pop()
            if not pins:
                del self._reads[block_hash]
            if tier_name == "gpu":
                n = self._gpu_pins.get(slot, 0) - 1
                if n > 0:
                    self._gpu_pins[slot] = n
                else:
                    self._gpu_pins.pop(slot, None)
            else:
                self._tiers[tier_name].unpin(slot)

    # ---- BlockSink ---------------------------------------------------------------------------
    def staging_buffer(self, n_blocks: int) -> memoryview:
        return memoryview(bytearray(n_blocks * self.layout.nbytes))

    def commit_blocks(
        self, blocks: list[tuple[int, int, bytes | memoryview]], namespace: bytes, tier: str | None = None
    ) -> int:
        """Insert verified blocks (hash, parent, bytes) into ``tier`` (default DRAM, or GPU when there is
        no DRAM tier); blocks already held are skipped. Returns how many were inserted."""
        nbytes = self.layout.nbytes
        with self._lock:
            target = tier or ("dram" if self.dram.capacity else "gpu")
            inserted = 0
            for h, parent, data in blocks:
                if h in self._meta:
                    continue
                mv = memoryview(data).cast("B")
                if mv.nbytes != nbytes:
                    raise BlockSizeMismatch(f"block {h:#x}: {mv.nbytes} bytes, layout needs {nbytes}")
                buf = bytearray(mv) if mv.readonly else mv
                t = (
                    torch.frombuffer(buf, dtype=torch.uint8)
                    .view(self.layout.torch_dtype)
                    .view(self.layout.shape)
                )
                placed = self._insert(h, t, target)
                if placed is None:
                    break
                self._meta[h] = BlockMeta(parent, namespace, placed, None)
                self._events.add("stored", placed, h, parent)
                inserted += 1
            return inserted

    # ---- internals ---------------------------------------------------------------------------
    def _insert(self, h: int, data: Tensor, target: str) -> str | None:
        """Store a new block in ``target``, falling back to lower tiers when it is full of referenced
        blocks; the tier used, or None when no tier had room."""
        order = ["gpu", "dram", "disk"]
        for name in order[order.index(target) :]:
            if name == "gpu":
                if self._make_gpu_room(1) and self.pool.insert_cached(h, data) is not None:
                    return "gpu"
            else:
                tier = self._tiers[name]
                if tier.capacity and self._make_host_room(tier) and tier.put(h, data):
                    return name
        return None

    def _promote(self, h: int) -> int | None:
        """Move a lower-tier block into the GPU pool (unreferenced); its block id or None if no room."""
        m = self._meta[h]
        tier = self._tiers[m.tier]
        if not self._make_gpu_room(1):
            return None
        b = self.pool.insert_cached(h, tier.get(h))
        assert b is not None
        tier.remove(h)
        self._events.add("moved", "gpu", h, m.parent, from_tier=m.tier)
        m.tier = "gpu"
        return b

    def _has_copies(self, h: int) -> bool:
        return self._fleet_copies is not None and self._fleet_copies(h) > 0

    def _held_elsewhere(self) -> HeldElsewhere | None:
        return self._has_copies if self._fleet_copies is not None else None

    def _pick(self, candidates: list[int]) -> int | None:
        """The victim's index among ``candidates`` (evictable, least recent first, at most
        VICTIM_WINDOW: the rule looks no further): the fleet rule."""
        return pick_victim(candidates, self._held_elsewhere(), self._retained)

    def _gpu_skip(self) -> Container[int]:
        """The GPU block ids eviction passes over: pinned by a reader, or held for a waiting request."""
        if not self._held:
            return self._gpu_pins
        held, pins, hash_of = self._held, self._gpu_pins, self.pool.hash_of
        return _Skip(lambda b: b in pins or hash_of(b) in held)

    def _make_gpu_room(self, n: int) -> bool:
        """Evict cached GPU blocks until ``n`` are free; False if unreferenced blocks run out."""
        skip = self._gpu_skip()  # holds and pins do not change while room is made
        while self.pool.num_free < n:
            # only the rule's window: hashing every cached block per eviction was O(pool) Python work
            cands = self.pool.lru_cached(VICTIM_WINDOW, skip=skip)
            if not cands and self._held:  # held blocks go last, but they never block a request
                cands = self.pool.lru_cached(VICTIM_WINDOW, skip=self._gpu_pins)
            hashes = [self.pool.hash_of(b) for b in cands]
            i = self._pick(hashes)  # type: ignore[arg-type]  # a cached block always has its hash
            if i is None:
                return False
            b = cands[i]
            h = self.pool.hash_of(b)
            assert h is not None
            self._demote_from_gpu(b, h)
        return True

    def _demote_from_gpu(self, b: int, h: int) -> None:
        m = self._meta[h]
        data = self.pool.tensor[b]
        for name in ("dram", "disk"):
            tier = self._tiers[name]
            if tier.capacity and self._make_host_room(tier, keep=h) and tier.put(h, data):
                self.pool.evict(b)
                m.tier = name
                self._events.add("moved", name, h, m.parent, from_tier="gpu")
                return
        self.pool.evict(b)
        self._drop(h, "gpu")

    def _make_host_room(self, tier: HostTier, keep: int | None = None) -> bool:
        """Free one slot of ``tier`` by demoting (DRAM → disk) or dropping its LRU victim."""
        if tier.num_free:
            return True
        cands = tier.lru_unpinned(VICTIM_WINDOW, keep, self._held)
        if not cands and self._held:  # held blocks go last, but they never block a store
            cands = tier.lru_unpinned(VICTIM_WINDOW, keep)
        i = self._pick(cands)
        if i is None:
            return False
        h = cands[i]
        m = self._meta[h]
        data = tier.get(h)
        to_disk = (
            tier is self.dram
            and self.disk.capacity > 0
            and dram_victim_to_disk(h, self._held_elsewhere(), self._retained)
            and self._make_host_room(self.disk)
            and self.disk.put(h, data)
        )
        tier.remove(h)
        if to_disk:
            m.tier = "disk"
            self._events.add("moved", "disk", h, m.parent, from_tier=tier.name)
        else:
            self._drop(h, tier.name)
        return True

    def _drop(self, h: int, tier: str) -> None:
        m = self._meta.pop(h)
        self._retained.pop(h, None)
        self._events.add("removed", tier, h, m.parent)


__all__ = ["ROOT_HASH", "BlockMeta", "KvCacheManager", "PrefixHit"]


class _Skip:
    """A container defined by a predicate (``lru_cached``'s ``skip``)."""

    __slots__ = ("_test",)

    def __init__(self, test: Callable[[int], bool]) -> None:
        self._test = test

    def __contains__(self, item: object) -> bool:
        return isinstance(item, int) and self._test(item)
