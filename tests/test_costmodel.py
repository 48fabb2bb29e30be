"""The shared cost model: block-size changes keep memory, a peer fetch costs every step it takes."""

from __future__ import annotations

import dataclasses

from kvmesh_core.costmodel import (
    PROFILES,
    fetch_beats_recompute,
    fetch_ms,
    prefill_iterations,
    promote_ms,
    recompute_ms,
    transfer_ms,
)

H100 = PROFILES["h100-llama3-8b"]


def test_with_block_size_keeps_each_tier_in_tokens() -> None:
    p = H100.with_block_size(512)
    assert (p.block_size, p.block_bytes) == (512, H100.block_bytes * 32)
    for tier in ("gpu_blocks", "dram_blocks", "disk_blocks"):
        assert getattr(p, tier) * 512 == getattr(H100, tier) * 16
    assert H100.with_block_size(16) is H100
    tiny = dataclasses.replace(H100, gpu_blocks=3, disk_blocks=0).with_block_size(512)
    assert (tiny.gpu_blocks, tiny.disk_blocks) == (1, 0)  # a tier that holds anything keeps a block


def test_fetch_counts_peer_reads_link_and_landing_promotion() -> None:
    peer = dataclasses.replace(H100, link_gbps=10.0)
    link = transfer_ms(H100, 8, 10.0, peer.link_latency_ms)
    landing = promote_ms(H100, "dram", 8)
    assert fetch_ms(H100, 8, peer) == link + landing
    reads = promote_ms(peer, "dram", 3) + promote_ms(peer, "disk", 2)
    assert fetch_ms(H100, 8, peer, peer_dram=3, peer_disk=2) == link + landing + reads
    no_dram = dataclasses.replace(H100, dram_blocks=0)  # blocks land straight in the GPU tier
    assert fetch_ms(no_dram, 8, peer) == link
    assert fetch_ms(H100, 0, peer) == 0.0


def test_fetch_beats_recompute_includes_the_landing_promotion() -> None:
    # one 16-token block: recompute ~1.3 ms; link ~0.6 ms; link + landing promotion ~0.7 ms
    slow_landing = dataclasses.replace(H100, dram_gbps=1.0)
    assert fetch_beats_recompute(dataclasses.replace(slow_landing, dram_blocks=0), 1, 0)
    assert not fetch_beats_recompute(slow_landing, 1, 0)


def _dynamo_mocker_prefill_ms(new_tokens: int, chunk: int = 8192) -> float:
    """Dynamo's mocker (lib/mocker/src/common/perf_model.rs, defaults): one pass per chunk of at most
    max_num_batched_tokens new tokens, each 16.5 ms + 0.0152 ms per token + 4.2e-7 ms per token^2."""
    total = 0.0
    left = new_tokens
    while left > 0:
        t = min(left, chunk)
        total += 4.209989e-07 * t * t + 1.518344e-02 * t + 1.650142e01
        left -= t
    return total


def test_the_dynamo_mocker_profile_prices_long_prompts_as_the_mocker_does() -> None:
    p = PROFILES["dynamo-mocker"]
    assert (p.block_size, p.gpu_blocks, p.dram_blocks, p.disk_blocks) == (64, 16384, 0, 0)
    for n in (8192, 16384, 50_000, 128_000):
        ours = recompute_ms(p, n)
        theirs = _dynamo_mocker_prefill_ms(n)
        assert abs(ours - theirs) / theirs < 0.05, (n, ours, theirs)
    # the mocker charges nothing for the cached context: neither does the profile
    assert recompute_ms(p, 1000, 50_000) == recompute_ms(p, 1000)


def test_a_prefill_spans_one_iteration_per_budget_of_tokens() -> None:
    p = dataclasses.replace(PROFILES["h100-llama3-8b"], prefill_chunk_tokens=2048)
    assert [prefill_iterations(p, n) for n in (0, 1, 2048, 2049, 16384, 16385)] == [1, 1, 1, 2, 8, 9]
    # a worker that reports no budget: one iteration, whatever the length (as before the field)
    assert prefill_iterations(PROFILES["h100-llama3-8b"], 100_000) == 1
