"""An in-memory block store that is both a BlockSource and a BlockSink (benches, tests, dev tools).

Blocks live in numpy arrays shaped like the layout, so the views it serves are typed and shaped the way
a tensor's are (the data plane must flatten them itself). It counts pins so callers can check that the
server released every block it read.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from services.worker.kv_layout import BlockLayout

_NP_DTYPES = {"float32": np.float32, "float16": np.float16}


@dataclass
class _Held:
    data: np.ndarray
    namespace: bytes
    parent: int
    tier: str


class MemoryBlockStore:
    """Owns a dict hash -> block; ``pins`` counts reads not yet released (0 for every hash when idle)."""

    def __init__(self, layout: BlockLayout) -> None:
        self.layout = layout
        self.blocks: dict[int, _Held] = {}
        self.pins: Counter[int] = Counter()
        self.commits = 0

    def _array(self, raw: bytes | bytearray | memoryview) -> np.ndarray:
        flat = np.frombuffer(bytes(raw), dtype=np.uint8).copy()
        if flat.size != self.layout.nbytes:
            raise ValueError(f"block of {flat.size} bytes, layout wants {self.layout.nbytes}")
        dt = _NP_DTYPES.get(self.layout.dtype)
        return flat.view(dt).reshape(self.layout.shape) if dt is not None else flat

    def put(
        self,
        block_hash: int,
        data: bytes | bytearray | memoryview,
        namespace: bytes,
        *,
        parent: int = 0,
        tier: str = "dram",
    ) -> None:
        self.blocks[block_hash] = _Held(self._array(data), namespace, parent, tier)

    def block_bytes(self, block_hash: int) -> bytes:
        return self.blocks[block_hash].data.tobytes()

    # BlockSource
    def read_block(self, block_hash: int) -> tuple[str, memoryview] | None:
        held = self.blocks.get(block_hash)
        if held is None:
            return None
        self.pins[block_hash] += 1
        return held.tier, memoryview(held.data)  # type: ignore[arg-type]  # ndarray is a buffer

    def release_read(self, block_hash: int) -> None:
        self.pins[block_hash] -= 1
        if self.pins[block_hash] <= 0:
            del self.pins[block_hash]

    def namespace_of(self, block_hash: int) -> bytes | None:
        held = self.blocks.get(block_hash)
        return held.namespace if held is not None else None

    # BlockSink
    def staging_buffer(self, n_blocks: int) -> memoryview:
        return memoryview(bytearray(n_blocks * self.layout.nbytes))

    def commit_blocks(self, blocks: list[tuple[int, int, bytes | memoryview]], namespace: bytes) -> int:
        self.commits += 1
        inserted = 0
        for block_hash, parent, data in blocks:
            if block_hash in self.blocks:
                continue
            self.put(block_hash, data, namespace, parent=parent)
            inserted += 1
        return inserted
