"""The byte layout of one KV block, and the two faces of a block store the data plane talks to.

One block holds the keys and values of ``block_size`` consecutive tokens for every layer::

    block = tensor[layers, 2, kv_heads, block_size, head_dim]     (2 = key, value)
            contiguous, so it is one byte range of ``nbytes`` in every tier and on the wire

Two workers can exchange blocks only if their layouts are equal (same model shape, block size and
dtype); the data plane checks this before any bytes move.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True, slots=True)
class BlockLayout:
    layers: int
    kv_heads: int
    block_size: int
    head_dim: int
    dtype: str  # "float32" | "float16" | "bfloat16"
    #: Which engine arranged the bytes ("" for kvmesh's own [layers, 2, kv_heads, block, head_dim]).
    #: Blocks of equal shape but another arrangement (vLLM's) must never be exchanged unnoticed.
    tag: str = ""

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, self.block_size, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.itemsize

    def describe(self) -> str:
        """A short string two peers compare to agree they hold the same kind of blocks."""
        base = f"L{self.layers}xH{self.kv_heads}xB{self.block_size}xD{self.head_dim}:{self.dtype}"
        return f"{base}:{self.tag}" if self.tag else base


class BlockSource(Protocol):
    """What a worker's block server reads from: any tier, without promoting anything."""

    layout: BlockLayout

    def read_block(self, block_hash: int) -> tuple[str, memoryview] | None:
        """(tier, bytes of the block) or None when the block is not held. The view stays valid until
        ``release_read`` is called for the same hash (the store pins the block meanwhile)."""
        ...

    def release_read(self, block_hash: int) -> None: ...

    def namespace_of(self, block_hash: int) -> bytes | None:
        """The namespace a held block was stored under (tenant isolation on the data plane)."""
        ...


class BlockSink(Protocol):
    """What a fetching worker writes into: verified blocks enter the pool only through ``commit``."""

    layout: BlockLayout

    def staging_buffer(self, n_blocks: int) -> memoryview:
        """A writable buffer of ``n_blocks * layout.nbytes`` bytes to receive frames into."""
        ...

    def commit_blocks(self, blocks: list[tuple[int, int, bytes | memoryview]], namespace: bytes) -> int:
        """Insert verified (hash, parent hash, bytes) blocks; returns how many were inserted."""
        ...
