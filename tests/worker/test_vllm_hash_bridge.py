"""The hash bridge names vLLM's blocks exactly as intake does, whatever vLLM calls them (no vLLM needed)."""

from __future__ import annotations

import random

import pytest

from schemas.blocks import PUBLIC_NAMESPACE, ROOT_HASH, block_hashes, tenant_namespace
from services.worker.vllm_engine.hash_bridge import HashBridge, kvmesh_salt, parse_salt

BS = 32
NS_A = tenant_namespace("A")
NS_B = tenant_namespace("B")


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 50_000) for _ in range(n)]


def test_salt_round_trip_and_foreign_salts() -> None:
    assert parse_salt(kvmesh_salt(NS_A, 64)) == (NS_A, 64)
    assert parse_salt(kvmesh_salt(b"\x00\xff weird", 0)) == (b"\x00\xff weird", 0)
    for foreign in (None, 7, "someone-else", "kvmesh/x/zz", "kvmesh/3/not-hex"):
        assert parse_salt(foreign) is None


def test_a_chain_in_two_events_gets_intake_hashes() -> None:
    toks = _tokens(5 * BS + 7)
    want = block_hashes(toks, BS, NS_A)
    bridge = HashBridge(BS)
    # vLLM's own names are arbitrary ints; the bridge must not care
    first = bridge.stored([901, 902, 903], None, toks[: 3 * BS], BS, [(kvmesh_salt(NS_A),), None, None])
    assert [b.block_hash for b in first] == want[:3]
    assert [b.parent for b in first] == [ROOT_HASH, want[0], want[1]]
    rest = bridge.stored([904, 905], 903, toks[3 * BS : 5 * BS], BS, [None, None])
    assert [b.block_hash for b in rest] == want[3:5] and rest[0].parent == want[2]
    assert bridge.prefix_length(want) == 5 and len(bridge) == 5
    # a re-emitted store of blocks already held (vLLM announces prefix-cache hits again) changes nothing
    assert bridge.stored([901, 902], None, toks[: 2 * BS], BS, [(kvmesh_salt(NS_A),), None]) == []
    assert len(bridge) == 5


def test_public_prefix_blocks_take_the_public_namespace() -> None:
    toks = _tokens(4 * BS, seed=1)
    ppt = 2 * BS + 5  # blocks 0 and 1 lie inside it, block 2 reaches past it
    want = block_hashes(toks, BS, NS_A, public_prefix_tokens=ppt)
    got = HashBridge(BS).stored([1, 2, 3, 4], None, toks, BS, [(kvmesh_salt(NS_A, ppt),), None, None, None])
    assert [b.block_hash for b in got] == want
    assert want[:2] == block_hashes(toks[: 2 * BS], BS, PUBLIC_NAMESPACE)


def test_tenants_get_different_blocks_and_shared_public_copies_are_counted() -> None:
    toks = _tokens(2 * BS, seed=2)
    bridge = HashBridge(BS)
    a = bridge.stored([1, 2], None, toks, BS, [(kvmesh_salt(NS_A),), None])
    b = bridge.stored([3, 4], None, toks, BS, [(kvmesh_salt(NS_B),), None])
    assert {x.block_hash for x in a}.isdisjoint(x.block_hash for x in b)
    # with a public prefix covering both blocks, vLLM still keeps one copy per salt (v 11/12 and 13/14):
    # one kvmesh block each, removed only when its last vLLM copy goes
    bridge = HashBridge(BS)
    pa = bridge.stored([11, 12], None, toks, BS, [(kvmesh_salt(NS_A, 2 * BS),), None])
    pb = bridge.stored([13, 14], None, toks, BS, [(kvmesh_salt(NS_B, 2 * BS),), None])
    assert len(pa) == 2 and pb == [] and len(bridge) == 2
    assert bridge.removed([11, 12]) == []
    assert bridge.removed([13, 14]) == [x.block_hash for x in pa]
    assert len(bridge) == 0


def test_skips_what_it_cannot_name_and_ignores_unknown_removals() -> None:
    toks = _tokens(2 * BS, seed=3)
    bridge = HashBridge(BS)
    # no kvmesh salt: a request that did not come through kvmesh
    assert bridge.stored([1, 2], None, toks, BS, [("lora-x",), None]) == []
    assert bridge.stored([1, 2], None, toks, BS, None) == []
    # a parent never seen (its event was lost)
    assert bridge.stored([5], 999, toks[:BS], BS, [None]) == []
    # cut at another block size: never indexed
    assert bridge.stored([7], None, toks[:16], 16, [(kvmesh_salt(NS_A),)]) == []
    assert bridge.size_mismatches == 1
    # fewer tokens than blocks
    assert bridge.stored([8, 9], None, toks[:BS], BS, [(kvmesh_salt(NS_A),), None]) == []
    assert len(bridge) == 0 and bridge.skipped_blocks == 8
    assert bridge.removed([123, 456]) == []


def test_retain_only_keeps_what_the_engine_holds() -> None:
    toks = _tokens(3 * BS, seed=4)
    want = block_hashes(toks, BS, NS_A)
    bridge = HashBridge(BS)
    bridge.stored([1, 2, 3], None, toks, BS, [(kvmesh_salt(NS_A),), None, None])
    gone = bridge.retain_only({1, 2})
    assert gone == [want[2]]
    assert [(b.block_hash, b.parent) for b in bridge.held()] == [(want[0], ROOT_HASH), (want[1], want[0])]
    bridge.cleared()
    assert bridge.held() == [] and bridge.prefix_length(want) == 0


@pytest.mark.parametrize("salt_keys", [("lora", kvmesh_salt(NS_A)), kvmesh_salt(NS_A)])
def test_salt_found_among_other_extra_keys(salt_keys: object) -> None:
    toks = _tokens(BS, seed=5)
    got = HashBridge(BS).stored([1], None, toks, BS, [salt_keys])
    assert [b.block_hash for b in got] == block_hashes(toks, BS, NS_A)
