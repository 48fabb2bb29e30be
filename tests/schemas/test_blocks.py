"""Block identity: chaining, tenant salting, public prefixes, incremental extension."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.blocks import PUBLIC_NAMESPACE, block_hashes, tenant_namespace


def test_only_full_blocks_have_hashes() -> None:
    assert len(block_hashes(list(range(47)), 16)) == 2
    assert len(block_hashes(list(range(48)), 16)) == 3
    assert block_hashes([], 16) == []


def test_equal_hash_means_equal_prefix() -> None:
    a = list(range(64))
    b = list(range(64))
    b[3] = 999  # differs in the first block only
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert ha[0] != hb[0]
    # later blocks hold the same tokens but a different prefix, so they differ too
    assert all(x != y for x, y in zip(ha, hb, strict=True))


def test_tenants_are_isolated_unless_prefix_is_public() -> None:
    toks = list(range(64))
    a = block_hashes(toks, 16, tenant_namespace("a"))
    b = block_hashes(toks, 16, tenant_namespace("b"))
    assert not set(a) & set(b)
    pa = block_hashes(toks, 16, tenant_namespace("a"), public_prefix_tokens=40)
    pb = block_hashes(toks, 16, tenant_namespace("b"), public_prefix_tokens=40)
    # blocks 0 and 1 lie inside the 40-token public prefix; block 2 reaches past it
    assert pa[:2] == pb[:2] == block_hashes(toks[:32], 16, PUBLIC_NAMESPACE)
    assert pa[2] != pb[2] and pa[3] != pb[3]


@given(st.lists(st.integers(0, 2**32 - 1), max_size=80), st.integers(0, 5))
def test_extension_equals_hashing_the_whole(tokens: list[int], split_blocks: int) -> None:
    ns = tenant_namespace("t")
    whole = block_hashes(tokens, 8, ns)
    cut = min(split_blocks, len(tokens) // 8) * 8
    head = block_hashes(tokens[:cut], 8, ns)
    parent = head[-1] if head else 0
    tail = block_hashes(tokens[cut:], 8, ns, parent=parent, start_token=cut)
    assert head + tail == whole


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        block_hashes([1], 0)
    with pytest.raises(ValueError):
        block_hashes([-1] * 16, 16)
    with pytest.raises(ValueError):
        block_hashes([1] * 16, 16, start_token=3)
