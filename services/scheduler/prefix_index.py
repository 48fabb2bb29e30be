"""Block hash → holders: which workers hold which KV blocks, in which tier, and each block's parent.

One dict entry per block, its value one Python int that packs the parent hash and every holder::

    value = parent | holders << 64
    holders = code_0 | code_1 << 16 | code_2 << 32 ...     code = worker_index << 2 | tier_code
              (codes sorted by worker index, ascending)      tier_code: 1 gpu, 2 dram, 3 disk

Worker ids are interned to small ints (at most 2**14 distinct ids). A block with one holder costs a
dict slot, its 64-bit key and one 3-digit int: about 110 bytes, against ~400 for a dict of dicts.

Because block hashes are chained (schemas.blocks), the longest cached prefix of a prompt on a worker
is the number of leading hashes it holds; :meth:`PrefixIndex.match` walks the hashes once, keeping the
set of workers that still hold every block so far. Consecutive blocks stored together have equal
holder fields, so a run of them costs one dict lookup and one int comparison each.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from schemas.messages import TIERS
from services.scheduler.errors import TooManyWorkers

_MASK64 = (1 << 64) - 1
_CODE_MASK = 0xFFFF
_MAX_WORKERS = 1 << 14
#: tier name → tier code (1-based so that a code is never 0 and a holders field of 0 means "none").
TIER_CODE: dict[str, int] = {name: i + 1 for i, name in enumerate(TIERS)}
TIER_NAME: tuple[str, ...] = ("", *TIERS)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a prompt's leading blocks one worker holds, and in which tiers."""

    blocks: int
    gpu: int = 0
    dram: int = 0
    disk: int = 0


def _decode(holders: int) -> dict[int, int]:
    out: dict[int, int] = {}
    while holders:
        code = holders & _CODE_MASK
        out[code >> 2] = code & 3
        holders >>= 16
    return out


def _encode(holders: dict[int, int]) -> int:
    packed = 0
    for w in sorted(holders, reverse=True):
        packed = (packed << 16) | (w << 2) | holders[w]
    return packed


class PrefixIndex:
    """Owns the block → (parent, holders) map and the worker-id interning.

    Invariants: a block is in the map only while at least one worker holds it; each (block, worker)
    pair has exactly one tier (the fastest one reported); ``entries`` is the number of such pairs and
    ``worker_entries[i]`` the number held by worker ``i``.
    """

    __slots__ = ("_blocks", "_names", "_widx", "_worker_entries", "entries")

    def __init__(self) -> None:
        self._blocks: dict[int, int] = {}
        self._widx: dict[str, int] = {}
        self._names: list[str] = []
        self._worker_entries: list[int] = []
        self.entries = 0

    # -- worker ids ------------------------------------------------------------------------------
    def intern(self, worker_id: str) -> int:
        """The small int of ``worker_id`` (stable for the life of the index)."""
        idx = self._widx.get(worker_id)
        if idx is None:
            idx = len(self._names)
            if idx >= _MAX_WORKERS:
                raise TooManyWorkers(f"more than {_MAX_WORKERS} distinct worker ids")
            self._widx[worker_id] = idx
            self._names.append(worker_id)
            self._worker_entries.append(0)
        return idx

    def worker_name(self, idx: int) -> str:
        return self._names[idx]

    def worker_blocks(self, worker_id: str) -> int:
        """How many blocks ``worker_id`` holds."""
        idx = self._widx.get(worker_id)
        return 0 if idx is None else self._worker_entries[idx]

    # -- updates ---------------------------------------------------------------------------------
    def store(
        self, worker_id: str, tier: str, block_hashes: Sequence[int], parent_hashes: Sequence[int] = ()
    ) -> None:
        """``worker_id`` now holds ``block_hashes`` in ``tier`` (a faster tier it already has wins).

        Without ``parent_hashes`` each block's parent is the one before it in the list; the first keeps
        the parent already known, or 0.
        """
        w = self.intern(worker_id)
        code = TIER_CODE[tier]
        blocks = self._blocks
        prev: int | None = None
        for i, h in enumerate(block_hashes):
            if parent_hashes:
                parent: int | None = parent_hashes[i]
            else:
                parent = prev
            prev = h
            v = blocks.get(h)
            if v is None:
                blocks[h] = ((parent or 0) & _MASK64) | (((w << 2) | code) << 64)
                self.entries += 1
                self._worker_entries[w] += 1
                continue
            old_parent = v & _MASK64
            holders = _decode(v >> 64)
            old = holders.get(w)
            if old is None:
                holders[w] = code
                self.entries += 1
                self._worker_entries[w] += 1
            elif code < old:
                holders[w] = code
            new_parent = old_parent if parent is None else parent & _MASK64
            blocks[h] = new_parent | (_encode(holders) << 64)

    def move(self, worker_id: str, tier: str, block_hashes: Iterable[int]) -> None:
        """Blocks ``worker_id`` holds went to ``tier`` (demotion or promotion); unknown ones are skipped."""
        w = self._widx.get(worker_id)
        if w is None:
            return
        code = TIER_CODE[tier]
        blocks = self._blocks
        for h in block_hashes:
            v = blocks.get(h)
            if v is None:
                continue
            holders = _decode(v >> 64)
            if w in holders:
                holders[w] = code
                blocks[h] = (v & _MASK64) | (_encode(holders) << 64)

    def remove(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        """``worker_id`` no longer holds ``block_hashes``; blocks nobody holds leave the index."""
        w = self._widx.get(worker_id)
        if w is None:
            return
        blocks = self._blocks
        for h in block_hashes:
            v = blocks.get(h)
            if v is None:
                continue
            holders = _decode(v >> 64)
            if holders.pop(w, None) is None:
                continue
            self.entries -= 1
            self._worker_entries[w] -= 1
            if holders:
                blocks[h] = (v & _MASK64) | (_encode(holders) << 64)
            else:
                del blocks[h]

    def remove_worker(self, worker_id: str) -> int:
        """Drop every block of ``worker_id`` (WorkerLost, cleared cache). Returns how many it held.

        A scan of the whole map: rare events pay O(blocks) so that no per-worker block set doubles the
        memory of the common case. It stops as soon as the worker's count reaches zero.
        """
        w = self._widx.get(worker_id)
        if w is None or self._worker_entries[w] == 0:
            return 0
        todo = self._worker_entries[w]
        dropped = 0
        blocks = self._blocks
        changes: list[tuple[int, int | None]] = []
        for h, v in blocks.items():
            holders = _decode(v >> 64)
            if holders.pop(w, None) is None:
                continue
            changes.append((h, (v & _MASK64) | (_encode(holders) << 64) if holders else None))
            dropped += 1
            if dropped == todo:
                break
        for h, nv in changes:
            if nv is None:
                del blocks[h]
            else:
                blocks[h] = nv
        self.entries -= dropped
        self._worker_entries[w] -= dropped
        return dropped

    # -- lookups ---------------------------------------------------------------------------------
    def match_codes(self, block_hashes: Sequence[int]) -> dict[int, list[int]]:
        """Worker index → [leading blocks held, of them in gpu, in dram, in disk] (index = tier code).

        The hot path of every routing decision: one walk over the hashes, stopping when no worker
        still holds every block so far.
        """
        n = len(block_hashes)
        if n == 0:
            return {}
        get = self._blocks.get
        v = get(block_hashes[0])
        if v is None:
            return {}
        cur = v >> 64
        alive = _decode(cur)
        counts: dict[int, list[int]] = {w: [0, 0, 0, 0] for w in alive}
        run_start = 0
        i = 1
        while i < n:
            v = get(block_hashes[i])
            if v is None:
                break
            hv = v >> 64
            if hv != cur:
                run = i - run_start
                new = _decode(hv)
                nxt: dict[int, int] = {}
                for w, t in alive.items():
                    c = counts[w]
                    c[t] += run
                    t2 = new.get(w)
                    if t2 is None:
                        c[0] = i
                    else:
                        nxt[w] = t2
                alive = nxt
                cur = hv
                run_start = i
                if not alive:
                    break
            i += 1
        run = i - run_start
        for w, t in alive.items():
            c = counts[w]
            c[t] += run
            c[0] = i
        return counts

    def match(self, block_hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        """Worker id → how many leading blocks of ``block_hashes`` it holds, split by tier."""
        names = self._names
        return {
            names[w]: PrefixMatch(blocks=c[0], gpu=c[1], dram=c[2], disk=c[3])
            for w, c in self.match_codes(block_hashes).items()
        }

    def longest_prefix(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Worker id → number of leading blocks of ``block_hashes`` it holds (workers with ≥ 1 only)."""
        names = self._names
        return {names[w]: c[0] for w, c in self.match_codes(block_hashes).items()}

    def holders(self, block_hash: int) -> dict[str, str]:
        """Worker id → tier of one block (empty when nobody holds it)."""
        v = self._blocks.get(block_hash)
        if v is None:
            return {}
        return {self._names[w]: TIER_NAME[t] for w, t in _decode(v >> 64).items()}

    def parent(self, block_hash: int) -> int | None:
        """The parent hash of a block in the index (0 for a first block), None if it is not indexed."""
        v = self._blocks.get(block_hash)
        return None if v is None else v & _MASK64

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def items(self) -> Iterator[tuple[int, int, dict[str, str]]]:
        """Every block as (hash, parent, {worker: tier}), in insertion order."""
        names = self._names
        for h, v in self._blocks.items():
            yield h, v & _MASK64, {names[w]: TIER_NAME[t] for w, t in _decode(v >> 64).items()}

    def to_dict(self) -> dict[int, tuple[int, dict[str, str]]]:
        """hash → (parent, {worker: tier}): a plain copy for comparisons and snapshots."""
        return {h: (p, hs) for h, p, hs in self.items()}

    def load(self, blocks: dict[int, dict[str, str]], parents: dict[int, int] | None = None) -> None:
        """Add a directory snapshot's blocks (hash → {worker: tier}) and parent links."""
        parents = parents or {}
        for h, holders in blocks.items():
            parent = parents.get(h, 0)
            for worker_id, tier in sorted(holders.items()):
                self.store(worker_id, tier, [h], [parent])

    # -- memory ----------------------------------------------------------------------------------
    def memory_bytes(self, sample: int = 2000) -> int:
        """Estimated bytes held by the map: the dict itself plus its key and value ints (sampled)."""
        n = len(self._blocks)
        if n == 0:
            return sys.getsizeof(self._blocks)
        seen = 0
        obj_bytes = 0
        for h, v in itertools.islice(self._blocks.items(), sample):
            obj_bytes += sys.getsizeof(h) + sys.getsizeof(v)
            seen += 1
        return sys.getsizeof(self._blocks) + obj_bytes * n // seen

    def bytes_per_entry(self, sample: int = 2000) -> float:
        """Estimated bytes per (block, holder) pair."""
        return self.memory_bytes(sample) / max(self.entries, 1)
