"""Small builders of requests, reports and events for the scheduler tests."""

from __future__ import annotations

from kvmesh_core.costmodel import PROFILES
from schemas.chat_requests import chat_request
from schemas.messages import ChatRequest, KvEvent, LoadReport, TierUsage

BS = 16
CPU = PROFILES["cpu-tiny"]


def request(
    rid: str,
    tokens: list[int],
    *,
    arrival_ms: int = 1000,
    session: str | None = None,
    tenant: str = "acme",
    deadline_ms: int | None = None,
    max_tokens: int = 8,
) -> ChatRequest:
    return chat_request(
        tokens,
        request_id=rid,
        session_id=session or f"s-{rid}",
        tenant=tenant,
        block_size=BS,
        max_tokens=max_tokens,
        arrival_ms=arrival_ms,
        deadline_ms=deadline_ms,
    )


def prompt(n_tokens: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(n_tokens)]


def load(
    worker: str,
    report_ms: int = 1000,
    *,
    queue_depth: int = 0,
    queued_prefill_tokens: int = 0,
    active_requests: int = 0,
    link_gbps: float | None = None,
    link_latency_ms: float | None = None,
    prefill_ms_per_token: float | None = None,
    draining: bool = False,
    active_tokens: int = 0,
) -> LoadReport:
    p = CPU
    return LoadReport(
        worker_id=worker,
        report_ms=report_ms,
        queue_depth=queue_depth,
        active_requests=active_requests,
        active_tokens=active_tokens,
        queued_prefill_tokens=queued_prefill_tokens,
        tiers=[
            TierUsage("gpu", p.gpu_blocks, p.gpu_blocks),
            TierUsage("dram", p.dram_blocks, p.dram_blocks),
            TierUsage("disk", p.disk_blocks, p.disk_blocks),
        ],
        transfer_address=f"127.0.0.1:{7000 + int(worker.rsplit('-', 1)[-1])}",
        block_size=BS,
        block_bytes=p.block_bytes,
        prefill_ms_per_token=p.prefill_ms_per_token if prefill_ms_per_token is None else prefill_ms_per_token,
        prefill_ms_per_token_per_ctx=p.prefill_ms_per_token_per_ctx,
        decode_ms_per_step=p.decode_ms_per_step,
        link_gbps=p.link_gbps if link_gbps is None else link_gbps,
        link_latency_ms=p.link_latency_ms if link_latency_ms is None else link_latency_ms,
        draining=draining,
    )


def stored(worker: str, hashes: list[int], tier: str = "gpu", event_ms: int = 0) -> KvEvent:
    parents = [0, *hashes[:-1]]
    return KvEvent(worker, "stored", tier, list(hashes), parents, event_ms=event_ms)
