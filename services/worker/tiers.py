"""Lower tiers of a worker's KV cache: DRAM and disk, each a fixed number of block slots.

    DRAM  tensor [capacity, *layout.shape] in CPU memory (pinned when CUDA exists, for fast copies)
    disk  the same shape over one memory-mapped file per worker: <disk_dir>/<worker_id>.kvblocks

A tier owns its slots, the hash → slot map and an LRU order of the hashes it holds. Slots pinned by
readers (the block server) are not reused until unpinned, even after their block left the tier.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from services.worker.kv_layout import BlockLayout


class HostTier:
    """A store of ``capacity`` block slots on the host (not thread-safe: the manager locks)."""

    def __init__(self, name: str, layout: BlockLayout, capacity: int, path: Path | None = None) -> None:
        self.name = name
        self.layout = layout
        self.capacity = max(capacity, 0)
        self.path = path
        self._mmap: np.memmap | None = None
        self.tensor = self._allocate()
        self._by_hash: dict[int, int] = {}
        self._free: deque[int] = deque(range(self.capacity))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._pins: dict[int, int] = {}
        self._deferred: set[int] = set()

    def _allocate(self) -> Tensor | None:
        if self.capacity == 0:
            return None
        shape = (self.capacity, *self.layout.shape)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # numpy holds the bytes (it has no bf16), torch reinterprets them as the layout's dtype.
            self._mmap = np.memmap(
                self.path, dtype=np.uint8, mode="w+", shape=(self.capacity, self.layout.nbytes)
            )
            return torch.from_numpy(self._mmap).view(self.layout.torch_dtype).view(shape)
        pin = torch.cuda.is_available()
        return torch.zeros(shape, dtype=self.layout.torch_dtype, pin_memory=pin)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def __len__(self) -> int:
        return len(self._by_hash)

    def slot_of(self, block_hash: int) -> int | None:
        return self._by_hash.get(block_hash)

    def hashes(self) -> list[int]:
        return list(self._by_hash)

    def lru(self) -> list[int]:
        """Held hashes, least recently used first."""
        return list(self._lru)

    def lru_unpinned(self, n: int, keep: int | None = None, held: Container[int] = ()) -> list[int]:
        """The ``n`` least recently used hashes that are neither pinned, ``keep`` nor ``held``, least
        recent first: the eviction window, read without copying the whole order."""
        return list(islice((h for h in self._lru if h != keep and h not in held and not self.pinned(h)), n))

    def get(self, block_hash: int) -> Tensor:
        assert self.tensor is not None
        return self.tensor[self._by_hash[block_hash]]

    def put(self, block_hash: int, data: Tensor) -> bool:
        """Copy a block in; False (nothing stored) when no slot is free."""
        if not self._free or block_hash in self._by_hash:
            return False
        assert self.tensor is not None
        slot = self._free.popleft()
        self.tensor[slot].copy_(data)
        self._by_hash[block_hash] = slot
        self._lru[block_hash] = None
        return True

    def touch(self, block_hash: int) -> None:
        self._lru.move_to_end(block_hash)

    def remove(self, block_hash: int) -> None:
        """Forget a block; its slot is reused at once unless a reader pinned it."""
        slot = self._by_hash.pop(block_hash)
        del self._lru[block_hash]
        if slot in self._pins:
            self._deferred.add(slot)
        else:
            self._free.append(slot)

    def pinned(self, block_hash: int) -> bool:
        slot = self._by_hash.get(block_hash)
        return slot is not None and slot in self._pins

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        n = self._pins.get(slot, 0) - 1
        if n > 0:
            self._pins[slot] = n
            return
        self._pins.pop(slot, None)
        if slot in self._deferred:
            self._deferred.discard(slot)
            self._free.append(slot)

    def reset(self) -> None:
        self._by_hash.clear()
        self._lru.clear()
        self._pins.clear()
        self._deferred.clear()
        self._free = deque(range(self.capacity))

    def close(self) -> None:
        """Release the file mapping (the file stays; it is rewritten at the next start)."""
        if self._mmap is not None:
            self._mmap.flush()
            self.tensor = None
            self._mmap = None
