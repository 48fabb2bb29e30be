"""Batches of KV blocks between the connector's store bytes and vLLM-shaped per-layer tensors.

The reference layout is the one the connector always used: a block is each layer's
``kv_cache[block_id]`` slab, concatenated over layers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.vllm_engine.block_copy import BlockCopier

SLAB = (2, 4, 2, 8)  # K/V, tokens, kv heads, head dim


def _layers(
    n_layers: int, blocks: int, dtype: torch.dtype, seed: int, contiguous: bool = True
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_layers):
        t = torch.randn(blocks, *SLAB, generator=g).to(dtype)
        if not contiguous:
            # the same values in a strided tensor: every other block of a buffer twice the size
            wide = torch.zeros(blocks * 2, *SLAB, dtype=dtype)
            wide[::2] = t
            t = wide[::2]
            assert not t.is_contiguous()
        out.append(t)
    return out


def _reference_bytes(layers: list[torch.Tensor], block_id: int) -> bytes:
    return b"".join(layer[block_id].contiguous().view(torch.uint8).numpy().tobytes() for layer in layers)


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blocks_go_out_in_the_store_layout_and_back_in_to_other_ids(
    dtype: torch.dtype, contiguous: bool
) -> None:
    src_layers = _layers(3, 10, dtype, seed=1, contiguous=contiguous)
    out = BlockCopier(src_layers).copy_out([7, 2, 5])
    assert out.dtype == np.uint8 and out.shape == (3, BlockCopier(src_layers).block_bytes)
    for row, block_id in zip(out, [7, 2, 5], strict=True):
        assert row.tobytes() == _reference_bytes(src_layers, block_id)
    dst_layers = _layers(3, 10, dtype, seed=2, contiguous=contiguous)
    before = [t.clone() for t in dst_layers]
    copier = BlockCopier(dst_layers)
    assert copier.copy_in([(0, memoryview(out[0])), (9, memoryview(out[1])), (4, memoryview(out[2]))]) == []
    for dst_id, src_id in ((0, 7), (9, 2), (4, 5)):
        for d, s in zip(dst_layers, src_layers, strict=True):
            assert torch.equal(d[dst_id], s[src_id])
    for untouched in (1, 2, 3, 5, 6, 7, 8):
        for d, b in zip(dst_layers, before, strict=True):
            assert torch.equal(d[untouched], b[untouched])


@pytest.mark.parametrize("contiguous", [True, False])
def test_bytes_that_are_not_one_block_and_ids_out_of_range_are_reported_and_the_rest_written(
    contiguous: bool,
) -> None:
    src_layers = _layers(2, 4, torch.float32, seed=3)
    good = BlockCopier(src_layers).copy_out([1, 2])
    dst_layers = _layers(2, 4, torch.float32, seed=4, contiguous=contiguous)
    before = [t.clone() for t in dst_layers]
    copier = BlockCopier(dst_layers)
    truncated = memoryview(good[0].tobytes()[:-8])
    items = [
        (0, truncated),  # a block cut short
        (1, memoryview(good[0])),
        (4, memoryview(good[1])),  # no vLLM block 4 in a pool of 4
        (-1, memoryview(good[1])),
        (3, memoryview(good[1])),
    ]
    assert copier.copy_in(items) == [0, 2, 3]
    for d, b, s in zip(dst_layers, before, src_layers, strict=True):
        assert torch.equal(d[0], b[0]) and torch.equal(d[2], b[2])  # never written
        assert torch.equal(d[1], s[1]) and torch.equal(d[3], s[2])


def test_store_bytes_of_any_buffer_format_are_read_as_bytes() -> None:
    src_layers = _layers(2, 3, torch.float32, seed=5)
    row = BlockCopier(src_layers).copy_out([2])[0]
    as_floats = memoryview(np.frombuffer(row.tobytes(), dtype=np.float32))  # format "f", not "B"
    dst_layers = _layers(2, 3, torch.float32, seed=6)
    assert BlockCopier(dst_layers).copy_in([(1, as_floats)]) == []
    assert all(torch.equal(d[1], s[2]) for d, s in zip(dst_layers, src_layers, strict=True))


def test_layers_of_different_shapes_are_refused_at_registration() -> None:
    a = torch.zeros(4, *SLAB)
    with pytest.raises(ValueError, match="one KV shape and dtype"):
        BlockCopier([a, torch.zeros(4, 2, 4, 2, 4)])
    with pytest.raises(ValueError, match="one KV shape and dtype"):
        BlockCopier([a, a.to(torch.bfloat16)])
    with pytest.raises(ValueError, match="no KV tensors"):
        BlockCopier([])
