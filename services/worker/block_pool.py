"""The GPU-tier block pool: one tensor of blocks, the free queue, ref counts and the hash → block map.

    tensor [num_blocks, layers, 2, kv_heads, block_size, head_dim]      (one BlockLayout block per row)

Every block id is in exactly one of three states:

    free      ref 0, no hash        in ``_free`` (FIFO)                    holds nothing
    cached    ref 0, hash           in ``_cached`` (LRU order, oldest first) evictable
    in use    ref > 0               in neither                              never evicted

A hashed block is immutable: it is only ever written while it is an unhashed block owned by one
request. "Out of blocks" is a ``None`` return value; misuse (double free, unknown id) raises.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container
from itertools import filterfalse, islice

import torch
from torch import Tensor

from services.worker.kv_layout import BlockLayout


class BlockPool:
    """Owns the pool tensor and the bookkeeping of its blocks (not thread-safe: the manager locks)."""

    def __init__(self, layout: BlockLayout, num_blocks: int, device: torch.device) -> None:
        # 0 blocks: a store of lower tiers only (the vLLM connector's, whose GPU tier is vLLM's own).
        if num_blocks < 0:
            raise ValueError("the GPU tier cannot have a negative number of blocks")
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        self.tensor = torch.zeros((num_blocks, *layout.shape), dtype=layout.torch_dtype, device=device)
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()

    # ---- state -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that hold nothing."""
        return len(self._free)

    @property
    def num_unreferenced(self) -> int:
        """Blocks a new request could get (free, or cached and evictable)."""
        return len(self._free) + len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def hash_of(self, block_id: int) -> int | None:
        return self._hash[block_id]

    def lookup(self, block_hash: int) -> int | None:
        return self._by_hash.get(block_hash)

    def hashes(self) -> list[int]:
        return list(self._by_hash)

    def lru_cached(self, n: int, skip: Container[int] = ()) -> list[int]:
        """The ``n`` least recently used cached (evictable) block ids not in ``skip``, least recent
        first. Only the head is read: eviction looks at a window of the LRU order, and copying the
        whole order per eviction was O(pool)."""
        return list(islice(filterfalse(skip.__contains__, self._cached), n))

    # ---- transitions -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """``n`` free blocks with ref 1, or None (nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        return out

    def incref(self, block_id: int) -> None:
        if self._ref[block_id] == 0:
            if self._hash[block_id] is None:
                raise ValueError(f"block {block_id} is free")
            del self._cached[block_id]
        self._ref[block_id] += 1

    def decref(self, block_id: int) -> None:
        if self._ref[block_id] <= 0:
            raise ValueError(f"block {block_id} released more often than acquired")
        self._ref[block_id] -= 1
        if self._ref[block_id] == 0:
            if self._hash[block_id] is None:
                self._free.append(block_id)
            else:
                self._cached[block_id] = None  # most recently used end

    def set_hash(self, block_id: int, block_hash: int) -> None:
        """Name an owned block by its content hash; from now on it is immutable and shareable."""
        if self._hash[block_id] is not None or block_hash in self._by_hash:
            raise ValueError(f"block {block_id} or hash {block_hash:#x} already named")
        if self._ref[block_id] == 0:
            raise ValueError(f"block {block_id} is not owned")
        self._hash[block_id] = block_hash
        self._by_hash[block_hash] = block_id

    def insert_cached(self, block_hash: int, data: Tensor) -> int | None:
        """Put a block (from a lower tier or a peer) into a free block as cached; None if none free."""
        ids = self.allocate(1)
        if ids is None:
            return None
        b = ids[0]
        self.tensor[b].copy_(data)
        self.set_hash(b, block_hash)
        self.decref(b)
        return b

    def evict(self, block_id: int) -> int:
        """Forget a cached block's content; returns its hash. The block becomes free."""
        h = self._hash[block_id]
        if self._ref[block_id] != 0 or h is None:
            raise ValueError(f"block {block_id} is not evictable")
        del self._cached[block_id]
        del self._by_hash[h]
        self._hash[block_id] = None
        self._free.append(block_id)
        return h

    def reset(self) -> None:
        """Forget everything (shutdown); ref counts of running requests are dropped too."""
        self._ref = [0] * self.num_blocks
        self._hash = [None] * self.num_blocks
        self._by_hash.clear()
        self._cached.clear()
        self._free = deque(range(self.num_blocks))

    # ---- data --------------------------------------------------------------------------------
    def gather(self, block_ids: list[int], n_tokens: int) -> Tensor:
        """KV of the first ``n_tokens`` tokens held in ``block_ids``, contiguous: [L, 2, Hkv, n, D]."""
        bs = self.layout.block_size
        n_blocks = -(-n_tokens // bs)
        idx = torch.tensor(block_ids[:n_blocks], dtype=torch.long, device=self.device)
        x = self.tensor.index_select(0, idx)  # [n_blocks, L, 2, Hkv, bs, D]
        x = x.permute(1, 2, 3, 0, 4, 5).reshape(*x.shape[1:4], n_blocks * bs, x.shape[-1])
        return x[:, :, :, :n_tokens]

    def write(self, block_ids: list[int], start: int, kv: Tensor) -> None:
        """Write ``kv`` [L, 2, Hkv, T, D] for token positions start .. start+T-1 of ``block_ids``."""
        bs = self.layout.block_size
        t = kv.shape[3]
        pos = torch.arange(start, start + t)
        blocks = torch.tensor(block_ids, dtype=torch.long)[pos // bs].to(self.device)
        offs = (pos % bs).to(self.device)
        # Advanced indices on dims 0 and 4 put the token dim first: target [T, L, 2, Hkv, D].
        self.tensor[blocks, :, :, :, offs, :] = kv.permute(3, 0, 1, 2, 4).to(self.tensor.dtype)
