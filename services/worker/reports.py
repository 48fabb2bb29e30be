"""What a worker tells the fleet about itself and about each request: LoadReports and Completions.

Pure builders: the service owns the state, these turn it into wire messages, the same way for every
engine (the engine's ``EngineLoad``, ``RequestStats`` and measured ``PerfProfile`` are all they read).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from schemas.messages import ChatRequest, Completion, LoadReport

if TYPE_CHECKING:
    from kvmesh_core.costmodel import PerfProfile
    from kvmesh_core.text_stream import TextStream
    from kvmesh_core.tokenizer import Tokenizer
    from services.worker.engine_api import EngineLoad, RequestStats


@dataclass
class RunningRequest:
    """What the service remembers of a request the engine is running."""

    request: ChatRequest
    started: float  # perf_counter at assignment receipt: TTFT is measured from here
    fetched_blocks: int = 0
    expected_blocks: int = 0  # blocks the assignment expects cached (local + fetched)
    fallback: str | None = None
    first_token_ms: float | None = None
    prefill_ms: float = 0.0
    stats: RequestStats | None = None
    output: list[int] = field(default_factory=list)
    #: The request's stop strings over its output (None: it has none).
    stops: TextStream | None = None
    #: Overlap admission: queued in the engine while its planned blocks are still being pulled (its own
    #: pull, or the one that carries the next blocks of its prompt for a request queued before it).
    kv_pending: bool = False
    #: Requests queued after this one that wait for its pull: it carries the next blocks of their prompts.
    waiters: list[RunningRequest] = field(default_factory=list)
    #: The assignment's estimate of the prompt tokens to compute here (Assignment.prefill_tokens).
    expected_prefill_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """The parts of a LoadReport that do not change between reports."""

    worker_id: str
    model: str
    engine: str
    block_size: int
    block_bytes: int
    max_context: int
    transfer_address: str
    peer_transfer: bool
    started_ms: int
    features: tuple[str, ...] = ()
    prefill_chunk_tokens: int = 0  # the engine's chunked-prefill budget (0: not reported)


def build_load_report(
    ident: WorkerIdentity,
    load: EngineLoad,
    profile: PerfProfile | None,
    report_ms: int,
    draining: bool,
) -> LoadReport:
    """A LoadReport from the engine's load and measured profile (defaults until calibrated)."""
    p = profile
    return LoadReport(
        worker_id=ident.worker_id,
        report_ms=report_ms,
        queue_depth=load.queue_depth,
        active_requests=load.active_requests,
        active_tokens=load.active_tokens,
        queued_prefill_tokens=load.queued_prefill_tokens,
        queued_prefill_ctx_tokens=load.queued_prefill_ctx_tokens,
        slot_wait_steps=load.slot_wait_steps,
        tiers=list(load.tiers),
        transfer_address=ident.transfer_address,
        block_size=ident.block_size,
        block_bytes=ident.block_bytes,
        prefill_ms_per_token=p.prefill_ms_per_token if p else 0.05,
        prefill_ms_per_token_per_ctx=p.prefill_ms_per_token_per_ctx if p else 0.0,
        decode_ms_per_step=p.decode_ms_per_step if p else 5.0,
        recent_decode_ms_per_step=load.recent_decode_ms_per_step,
        kv_free_blocks=load.kv_free_blocks,
        kv_release=list(load.kv_release),
        link_gbps=p.link_gbps if p else 1.0,
        link_latency_ms=p.link_latency_ms if p else 1.0,
        dram_gbps=p.dram_gbps if p else 20.0,
        disk_gbps=p.disk_gbps if p else 2.0,
        model=ident.model,
        max_context=ident.max_context,
        started_ms=ident.started_ms,
        draining=draining,
        engine=ident.engine,
        peer_transfer=ident.peer_transfer,
        features=list(ident.features),
        prefill_chunk_tokens=ident.prefill_chunk_tokens,
    )


def build_completion(
    req: ChatRequest,
    worker_id: str,
    finish_reason: str,
    entry: RunningRequest | None,
    error: str | None,
    tokenizer: Tokenizer | None,
) -> tuple[Completion, bool]:
    """The Completion of ``req``, and whether it records a fallback (for the worker's counters).

    Reused tokens are the engine's own count; of them, those that arrived from peers this request
    (``fetched_blocks``) are reported as fetched, the rest as reused in place.
    """
    stats = entry.stats if entry is not None else None
    bs = req.block_size
    reused = stats.reused_tokens if stats is not None else 0
    fetched = min(reused, entry.fetched_blocks * bs) if entry is not None else 0
    fallback = entry.fallback if entry is not None else None
    engine_fallback = stats.fallback if stats is not None else None
    if engine_fallback:
        fallback = f"{fallback}; {engine_fallback}" if fallback else engine_fallback
    output = entry.output if entry is not None else []
    c = Completion(
        request_id=req.request_id,
        session_id=req.session_id,
        worker_id=worker_id,
        finish_reason=finish_reason,  # type: ignore[arg-type]  # the engines' reasons are Completion's
        prompt_tokens=len(req.token_ids),
        completion_tokens=len(output),
        output_token_ids=list(output),
        reused_tokens=reused - fetched,
        fetched_tokens=fetched,
        recomputed_tokens=stats.recomputed_tokens if stats is not None else 0,
        ttft_ms=(entry.first_token_ms or 0.0) if entry is not None else 0.0,
        prefill_ms=stats.prefill_ms if stats is not None else 0.0,
        e2e_ms=(time.perf_counter() - entry.started) * 1e3 if entry is not None else 0.0,
        error=error,
        fallback=fallback,
        text=_output_text(entry, output, tokenizer),
    )
    return c, bool(engine_fallback)


def _output_text(entry: RunningRequest | None, output: list[int], tokenizer: Tokenizer | None) -> str:
    if entry is not None and entry.stops is not None:
        return entry.stops.text  # cut before the stop string, as the client sees it
    return tokenizer.decode(output) if tokenizer is not None else ""
