"""Whole batches of KV blocks between the connector's store and vLLM's paged KV cache.

One kvmesh block is each attention layer's ``kv_cache[block_id]`` slab, concatenated over layers
(``BlockLayout``). Copied block by block and layer by layer, a batch costs ``blocks × layers`` torch
calls. In the forward that is about 21 µs a block on this CPU build (and a small copy each on a GPU).
In the background thread of an asynchronous load it is far worse: each torch call gives up the GIL,
and the thread then waits for vLLM's stepping thread to hand it back (13.7 ms a block, measured with
``kvmesh bench transfer --engine vllm --async-load``).

So no torch call is made per block. On the CPU build a load is a memoryview slice assignment per
block and layer, a memcpy that keeps the GIL, into flat views of the layers made once at
registration (a numpy gather was not enough: ``np.concatenate`` gives the GIL up once per array it
copies). Elsewhere the blocks are gathered into one buffer and each layer takes its slice with one
``index_copy_``. A save is a numpy row gather per layer on the CPU build, one ``index_select`` per
layer elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)


class BlockCopier:
    """Copies batches of blocks into and out of vLLM's per-layer KV tensors (``[blocks, *slab]`` each,
    one shape and dtype for all)."""

    def __init__(self, layers: Sequence[torch.Tensor]) -> None:
        self.layers = list(layers)
        if not self.layers:
            raise ValueError("vLLM registered no KV tensors")
        first = self.layers[0]
        for layer in self.layers:
            if layer.shape != first.shape or layer.dtype != first.dtype:
                raise ValueError(
                    f"kvmesh's connector needs one KV shape and dtype for every layer: {tuple(first.shape)} "
                    f"{first.dtype} and {tuple(layer.shape)} {layer.dtype}"
                )
        self._slab = tuple(first.shape[1:])
        self._slab_bytes = first[0].numel() * first.element_size()  # one layer's part of a block
        self.block_bytes = len(self.layers) * self._slab_bytes
        self.num_blocks = first.shape[0]
        # Each layer's memory as flat bytes when all are contiguous host tensors (the CPU build), else
        # None (the torch path). Made here, once, since each torch call would give up the GIL.
        self._hosts: list[np.ndarray] | None = []
        for layer in self.layers:
            if layer.device.type != "cpu" or not layer.is_contiguous():
                self._hosts = None
                break
            self._hosts.append(layer.view(layer.shape[0], -1).view(torch.uint8).numpy())
        self._flat = None if self._hosts is None else [memoryview(h.data).cast("B") for h in self._hosts]

    def copy_in(self, items: Sequence[tuple[int, memoryview]]) -> list[int]:
        """Write each ``(block_id, bytes)`` of ``items`` into the layers; return the positions in
        ``items`` of those not written (bytes that are not one block of this layout, or a block id
        out of range), for the caller to report as load errors so that vLLM recomputes them. Every
        other block is written."""
        bad: list[int] = []
        ids: list[int] = []
        views: list[memoryview] = []
        for i, (block_id, view) in enumerate(items):
            if view.nbytes != self.block_bytes or not 0 <= block_id < self.num_blocks:
                log.warning(
                    "%d bytes for vLLM block %d, not one block (%d bytes, ids below %d); recomputed",
                    view.nbytes,
                    block_id,
                    self.block_bytes,
                    self.num_blocks,
                )
                bad.append(i)
                continue
            ids.append(block_id)
            views.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
        if not ids:
            return bad
        slab = self._slab_bytes
        if self._flat is not None:
            # Slice assignment between memoryviews is a memcpy that keeps the GIL: no handoff per block.
            for block_id, src in zip(ids, views, strict=True):
                at = block_id * slab
                for n, dst in enumerate(self._flat):
                    dst[at : at + slab] = src[n * slab : (n + 1) * slab]
            return bad
        buf = bytearray(self.block_bytes * len(ids))
        out = memoryview(buf)
        for i, src in enumerate(views):
            out[i * self.block_bytes : (i + 1) * self.block_bytes] = src
        first = self.layers[0]
        data = torch.frombuffer(buf, dtype=torch.uint8).view(len(ids), len(self.layers), slab)
        index = torch.tensor(ids, dtype=torch.long, device=first.device)
        for layer, part in zip(self.layers, data.unbind(1), strict=True):
            block = part.view(first.dtype).view(len(ids), *self._slab)
            layer.index_copy_(0, index, block.to(layer.device))
        return bad

    def copy_out(self, block_ids: Sequence[int]) -> np.ndarray:
        """The blocks ``block_ids`` as host bytes, ``[blocks, block bytes]`` of uint8: row ``i`` is block
        ``block_ids[i]`` in the store's layout (each layer's slab in turn)."""
        if self._hosts is not None:
            rows = np.asarray(block_ids, dtype=np.intp)
            return np.stack([host[rows] for host in self._hosts], axis=1).reshape(len(rows), -1)
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.layers[0].device)
        data = torch.stack([layer.index_select(0, index) for layer in self.layers], dim=1)
        return data.cpu().contiguous().view(len(block_ids), -1).view(torch.uint8).numpy()
