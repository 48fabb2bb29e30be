"""The one cost model that compares fetching KV blocks, recomputing them, and waiting.

Imported by the scheduler (to estimate time to first token per candidate worker), by the worker (to
decide whether a planned fetch is still worth it) and by the simulator (to advance simulated time).
Every figure comes from a :class:`PerfProfile`, which a worker measures on its own machine and
publishes in its LoadReport, or which the simulator reads from a named profile or a benchmark's JSON.

Units: milliseconds, bytes, and GB/s (10^9 bytes per second) for bandwidths.

    recompute(n new tokens after c cached) = n * (a + b * (c + n / 2))     a: per-token cost (MLPs)
                                                                           b: attention cost per token
                                                                              of context it attends to
    transfer(k blocks)                     = latency + k * block_bytes / link bandwidth
    promote(k blocks from a lower tier)    = k * block_bytes / tier bandwidth
    fetch(k blocks from a peer)            = peer's read of its dram/disk blocks + transfer(k)
                                             + promote(k from dram) when the puller has a DRAM tier
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class PerfProfile:
    """Measured speed of one worker (model + machine)."""

    prefill_ms_per_token: float
    prefill_ms_per_token_per_ctx: float
    decode_ms_per_step: float
    link_gbps: float
    link_latency_ms: float
    block_bytes: int
    block_size: int
    dram_gbps: float = 20.0
    disk_gbps: float = 2.0
    gpu_blocks: int = 4096
    dram_blocks: int = 16384
    disk_blocks: int = 65536
    # The engine's chunked-prefill budget in tokens per iteration (LoadReport.prefill_chunk_tokens);
    # 0: not known. Sets how many decode steps of a running batch a prefill carries (prefill_iterations).
    prefill_chunk_tokens: int = 0

    @classmethod
    def from_load_report(cls, report: Any) -> PerfProfile:
        """The profile a worker published in its LoadReport."""
        tiers = {t.tier: t.total_blocks for t in report.tiers}
        return cls(
            prefill_ms_per_token=report.prefill_ms_per_token,
            prefill_ms_per_token_per_ctx=report.prefill_ms_per_token_per_ctx,
            # the step as the worker runs it now, where it says (the waits are priced in steps)
            decode_ms_per_step=report.recent_decode_ms_per_step or report.decode_ms_per_step,
            link_gbps=report.link_gbps,
            link_latency_ms=report.link_latency_ms,
            block_bytes=report.block_bytes,
            block_size=report.block_size,
            dram_gbps=report.dram_gbps,
            disk_gbps=report.disk_gbps,
            gpu_blocks=tiers.get("gpu", 0),
            dram_blocks=tiers.get("dram", 0),
            disk_blocks=tiers.get("disk", 0),
            prefill_chunk_tokens=report.prefill_chunk_tokens,
        )

    def with_block_size(self, block_size: int) -> PerfProfile:
        """The same machine addressed with another block size: bytes per block scale with tokens and
        each tier keeps its capacity in tokens (its memory does not change), so block counts scale
        the other way. A tier that holds anything keeps at least one block."""
        if block_size == self.block_size:
            return self
        per_token = self.block_bytes / self.block_size

        def blocks(n: int) -> int:
            return max(n * self.block_size // block_size, 1 if n else 0)

        return dataclasses.replace(
            self,
            block_size=block_size,
            block_bytes=int(per_token * block_size),
            gpu_blocks=blocks(self.gpu_blocks),
            dram_blocks=blocks(self.dram_blocks),
            disk_blocks=blocks(self.disk_blocks),
        )


def recompute_ms(p: PerfProfile, new_tokens: int, cached_tokens: int = 0) -> float:
    """Prefill time of ``new_tokens`` that follow ``cached_tokens`` already in the KV cache."""
    if new_tokens <= 0:
        return 0.0
    mean_ctx = cached_tokens + new_tokens / 2.0
    return new_tokens * (p.prefill_ms_per_token + p.prefill_ms_per_token_per_ctx * mean_ctx)


def prefill_ctx(new_tokens: int, cached_tokens: int = 0) -> float:
    """The context term of one prefill: ``new_tokens`` times the mean context each attends to.

    Summed over a queue, it prices the queue exactly: ``queued_prefill_ms(p, sum(new), sum(ctx))``
    equals the sum of ``recompute_ms`` over the queued prompts.
    """
    if new_tokens <= 0:
        return 0.0
    return new_tokens * (cached_tokens + new_tokens / 2.0)


def queued_prefill_ms(p: PerfProfile, new_tokens: int, ctx_tokens: float) -> float:
    """Prefill time of a queue of prompts: ``new_tokens`` in all, ``ctx_tokens`` = their summed
    :func:`prefill_ctx`."""
    if new_tokens <= 0:
        return 0.0
    return new_tokens * p.prefill_ms_per_token + ctx_tokens * p.prefill_ms_per_token_per_ctx


def transfer_ms(
    p: PerfProfile, n_blocks: int, link_gbps: float | None = None, latency_ms: float | None = None
) -> float:
    """Time to pull ``n_blocks`` from a peer over the data plane.

    The slower of the two ends limits the link, so callers pass the peer's figures when they know them.
    """
    if n_blocks <= 0:
        return 0.0
    gbps = min(p.link_gbps, link_gbps) if link_gbps else p.link_gbps
    lat = max(p.link_latency_ms, latency_ms) if latency_ms is not None else p.link_latency_ms
    return lat + n_blocks * p.block_bytes / (gbps * 1e9) * 1e3


def promote_ms(p: PerfProfile, tier: str, n_blocks: int) -> float:
    """Time to bring ``n_blocks`` from ``tier`` back to the GPU tier on the same worker."""
    if n_blocks <= 0 or tier == "gpu":
        return 0.0
    gbps = p.dram_gbps if tier == "dram" else p.disk_gbps
    return n_blocks * p.block_bytes / (gbps * 1e9) * 1e3


def pull_ms(
    p: PerfProfile,
    n_blocks: int,
    peer: PerfProfile | None = None,
    peer_dram: int = 0,
    peer_disk: int = 0,
) -> float:
    """The first two steps of :func:`fetch_ms`: the peer reads ``n_blocks`` (``peer_dram`` /
    ``peer_disk`` of them from its lower tiers) and the link carries them. The simulator charges
    this on the puller's link and the landing promotion at its prefill, as the live worker spends it."""
    if n_blocks <= 0:
        return 0.0
    if peer is None:
        return transfer_ms(p, n_blocks)
    t = transfer_ms(p, n_blocks, peer.link_gbps, peer.link_latency_ms)
    return t + promote_ms(peer, "dram", peer_dram) + promote_ms(peer, "disk", peer_disk)


def fetch_ms(
    p: PerfProfile,
    n_blocks: int,
    peer: PerfProfile | None = None,
    peer_dram: int = 0,
    peer_disk: int = 0,
) -> float:
    """Time until ``n_blocks`` pulled from ``peer`` can be used by a prefill on ``p``'s worker.

    Three steps, one after the other as the live data plane runs them: the peer's block server reads
    a batch of blocks (``peer_dram`` / ``peer_disk`` of them sit in its lower tiers) and then sends
    it; the link carries the bytes; the puller commits them to its DRAM tier when it has one
    (``KvCacheManager.commit_blocks``' default), so its prefill promotes them to the GPU.
    """
    if n_blocks <= 0:
        return 0.0
    t = pull_ms(p, n_blocks, peer, peer_dram, peer_disk)
    if p.dram_blocks > 0:
        t += promote_ms(p, "dram", n_blocks)
    return t


def prefill_iterations(p: PerfProfile, new_tokens: int) -> int:
    """Engine iterations that a prefill of ``new_tokens`` spans under the chunked-prefill budget, each
    with one decode step of the running batch: ``ceil(new_tokens / budget)``, at least 1 (a prompt
    always computes its last token). Prefills queued together share iterations, so a queue's count is
    that of its summed tokens. 1 when the budget is not known (0)."""
    chunk = p.prefill_chunk_tokens
    if chunk <= 0 or new_tokens <= chunk:
        return 1
    return -(-new_tokens // chunk)


def decode_ms(p: PerfProfile, steps: int) -> float:
    """Time of ``steps`` decode steps (one token each) of a batch."""
    return max(steps, 0) * p.decode_ms_per_step


def fetch_beats_recompute(
    p: PerfProfile,
    n_blocks: int,
    cached_tokens: int,
    link_gbps: float | None = None,
    latency_ms: float | None = None,
) -> bool:
    """Whether pulling ``n_blocks`` that follow ``cached_tokens`` from a peer's GPU tier (and
    promoting them, see :func:`fetch_ms`) is faster than recomputing them."""
    t = transfer_ms(p, n_blocks, link_gbps, latency_ms)
    if p.dram_blocks > 0:
        t += promote_ms(p, "dram", n_blocks)
    return t < recompute_ms(p, n_blocks * p.block_size, cached_tokens)


def _kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * layers * kv_heads * head_dim * dtype_bytes


#: Named profiles for the simulator. Figures are public ballparks, not measurements of this machine.
PROFILES: dict[str, PerfProfile] = {
    # Llama-3-8B in bf16 on one H100: ~10k prefill tokens/s, ~25 ms decode step at batch 32, 128 KiB of
    # KV per token, a 25 GB/s RDMA-class link between hosts.
    "h100-llama3-8b": PerfProfile(
        prefill_ms_per_token=0.08,
        prefill_ms_per_token_per_ctx=2.0e-6,
        decode_ms_per_step=25.0,
        link_gbps=25.0,
        link_latency_ms=0.5,
        block_bytes=16 * _kv_bytes_per_token(32, 8, 128, 2),
        block_size=16,
        dram_gbps=25.0,
        disk_gbps=5.0,
        gpu_blocks=20000,
        dram_blocks=100000,
        disk_blocks=400000,
    ),
    # Llama-3-70B with tensor parallelism over 8 H100s, seen as one worker.
    "h100x8-llama3-70b": PerfProfile(
        prefill_ms_per_token=0.12,
        prefill_ms_per_token_per_ctx=3.0e-6,
        decode_ms_per_step=35.0,
        link_gbps=50.0,
        link_latency_ms=0.5,
        block_bytes=16 * _kv_bytes_per_token(80, 8, 128, 2),
        block_size=16,
        dram_gbps=50.0,
        disk_gbps=10.0,
        gpu_blocks=60000,
        dram_blocks=300000,
        disk_blocks=1000000,
    ),
    # NVIDIA Dynamo's mocker engine with its defaults (ai-dynamo/dynamo lib/mocker/src/common/perf_model.rs
    # and protocols.rs), so `kvmesh simulate` can be set beside `python -m dynamo.replay` on the same
    # trace. The mocker prices a prefill pass at 16.5 ms + 0.0152 ms per new token + 4.2e-7 ms per new
    # token squared, in chunks of at most 8,192 tokens (max_num_batched_tokens): about 0.0206 ms per
    # token, with no charge for the cached context. Its decode step, -25.74 u^2 + 54.01 u + 5.74 ms at
    # KV utilization u, is about 12 ms at the u of a Mooncake fleet. 16,384 GPU blocks of 64 tokens,
    # no lower tiers; the link is the H100 profile's (the mocker's aggregated workers move no KV).
    "dynamo-mocker": PerfProfile(
        prefill_ms_per_token=0.0206,
        prefill_ms_per_token_per_ctx=0.0,
        decode_ms_per_step=12.0,
        link_gbps=25.0,
        link_latency_ms=0.5,
        block_bytes=64 * _kv_bytes_per_token(32, 8, 128, 2),
        block_size=64,
        dram_gbps=25.0,
        disk_gbps=5.0,
        gpu_blocks=16384,
        dram_blocks=0,
        disk_blocks=0,
    ),
    # The tiny seeded model of the test suite on a 2-core CPU; `kvmesh bench worker` measures the real one.
    "cpu-tiny": PerfProfile(
        prefill_ms_per_token=0.05,
        prefill_ms_per_token_per_ctx=2.0e-5,
        decode_ms_per_step=4.0,
        link_gbps=2.0,
        link_latency_ms=0.3,
        block_bytes=16 * _kv_bytes_per_token(4, 2, 32, 4),
        block_size=16,
        dram_gbps=5.0,
        disk_gbps=1.0,
        gpu_blocks=2048,
        dram_blocks=8192,
        disk_blocks=32768,
    ),
}


def load_profile(name_or_path: str) -> PerfProfile:
    """A named profile, or one read from a JSON file (a benchmark's output or a PerfProfile's fields)."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    data = json.loads(Path(name_or_path).read_text())
    if "profile" in data:
        data = data["profile"]
    fields = {f.name for f in dataclasses.fields(PerfProfile)}
    return PerfProfile(**{k: v for k, v in data.items() if k in fields})
