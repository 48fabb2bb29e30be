"""The one engine interface of a worker: what the worker service, the data plane and the tests rely on.

Two engines implement it: the built-in torch engine (``services.worker.engine.Engine``, the embedded
default) and vLLM (``services.worker.vllm_engine.VllmEngine``). The service never reaches past it::

    WorkerService ──add_request / abort──▶ WorkerEngine ──step()──▶ [StepOutput]  (one thread steps)
         │   ▲                                │
         │   └── drain_kv_events() ◀── KvEvents under kvmesh block hashes (schemas.blocks)
         │   └── load() ◀── EngineLoad: queue, running, KV blocks per tier
         └─ data plane ── block_store (BlockSource + BlockSink) or None: no peer transfer

Threading contract: ``step()`` runs in one worker thread; ``add_request``/``abort``/``kv_arrived`` are
called between steps by the same task that awaits ``step``; ``load()``, ``lookup_prefix()`` and
``drain_kv_events()`` may be called from the event loop while a step runs, so engines answer them from
state that is safe to read then.

Invariants every engine keeps:
  * the KvEvents name blocks by the kvmesh chained hash of their tokens and the request's namespace, so
    the scheduler's index and the directory look the same whatever engine a worker runs;
  * ``RequestStats.reused_tokens`` is the engine's own count of prompt tokens it did not compute;
  * a request the engine cannot run raises :class:`RequestRejected` from ``add_request`` or ends with a
    ``StepOutput`` of reason ``"error"``; it never takes the engine down.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from schemas.messages import KvEvent, SamplingParams, TierUsage, TokenLogprob
from services.worker.errors import RequestRejected

if TYPE_CHECKING:
    from kvmesh_core.costmodel import PerfProfile
    from kvmesh_core.tokenizer import Tokenizer
    from services.worker.kv_layout import BlockSink, BlockSource

__all__ = [
    "EngineLoad",
    "EngineRequest",
    "RequestRejected",
    "RequestStats",
    "StepOutput",
    "WorkerEngine",
    "check_request",
    "waiting_prefill",
]


@dataclass
class EngineRequest:
    request_id: str
    session_id: str
    token_ids: Sequence[int]  # a ChatRequest's TokenIds, or a list
    block_hashes: list[int]
    namespace: bytes
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: list[int] = field(default_factory=list)
    public_prefix_tokens: int = 0
    #: Leading blocks the scheduler expected here (Assignment.reuse_blocks + fetched ones); fewer found
    #: means its view lagged, and the stats say so in ``fallback``.
    expected_reuse_blocks: int = 0
    #: Block size the request's hashes were cut with; an engine of another size refuses the request.
    block_size: int | None = None
    #: Its planned peer blocks are still on the link: the engine keeps its place in the queue but
    #: starts it only after ``kv_arrived`` (vLLM's WAITING_FOR_REMOTE_KVS), running the others meanwhile.
    kv_pending: bool = False
    #: The scheduler's estimate of the prompt tokens this worker computes (Assignment.prefill_tokens:
    #: the prompt past the blocks it expects held or pulled). While the request waits, the engine
    #: reports this much queued prefill, as the simulator's workers do; None: the whole prompt.
    expected_prefill_tokens: int | None = None


def waiting_prefill(req: EngineRequest, prompt_len: int) -> int:
    """Prompt tokens a waiting request is expected to compute: the scheduler's estimate when it sent
    one (at least the last token, which always runs; at most the prompt), else the whole prompt."""
    n = req.expected_prefill_tokens
    return prompt_len if n is None else min(max(n, 1), prompt_len)


def check_request(
    req: EngineRequest, block_size: int, max_context: int, vocab_size: int, features: Collection[str]
) -> np.ndarray:
    """The checks every engine makes before it queues ``req``: its token ids as int64 if it can run,
    else RequestRejected saying why (empty, other block size, too long, no room to generate, bad ids,
    a sampling feature the engine does not honour: never run it and silently ignore the field)."""
    rid = req.request_id
    missing = req.sampling.features() - set(features)
    if missing:
        raise RequestRejected(f"request {rid}: this engine does not support {', '.join(sorted(missing))}")
    n = len(req.token_ids)
    if n == 0:
        raise RequestRejected(f"request {rid}: empty prompt")
    if req.block_size is not None and req.block_size != block_size:
        raise RequestRejected(
            f"request {rid}: block size {req.block_size} differs from this worker's {block_size}"
        )
    if n >= max_context:
        raise RequestRejected(
            f"request {rid}: prompt of {n} tokens does not fit the context of {max_context} tokens "
            "(room for at least one generated token is needed)"
        )
    if req.max_tokens < 1:
        raise RequestRejected(f"request {rid}: max_tokens must be at least 1")
    ids = np.asarray(req.token_ids, dtype=np.int64)  # TokenIds: its packed buffer, no int walk
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise RequestRejected(f"request {rid}: token id outside the vocabulary")
    return ids


@dataclass
class RequestStats:
    prompt_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    prefill_ms: float
    promoted_blocks: int
    fallback: str | None


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "error" | "cancelled"
    first_token: bool = False
    stats: RequestStats | None = None
    error: str | None = None
    #: One entry per new token when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What a LoadReport says of the engine: its queue, its running batch and its KV blocks per tier."""

    queue_depth: int
    active_requests: int
    active_tokens: int
    queued_prefill_tokens: int
    tiers: list[TierUsage]
    # sum of kvmesh_core.costmodel.prefill_ctx over the queued prompts (0: unknown)
    queued_prefill_ctx_tokens: float = 0.0
    # decode steps until a request queued now gets a place in a full batch (services/worker/batch_slots)
    slot_wait_steps: int = 0
    # the recent mean of the engine's decode-only step times (batch_slots.DecodeStepMeter); 0: none
    # measured yet
    recent_decode_ms_per_step: float = 0.0
    # room in the GPU tier for the next prompt and when running requests free blocks
    # (kvmesh_core/kv_room.py); None: not reported
    kv_free_blocks: int | None = None
    kv_release: list[tuple[int, int]] = field(default_factory=list)


class WorkerEngine(Protocol):
    """An inference engine behind one worker (see the module docstring for the threading contract)."""

    # Read-only facts of the engine (attributes or properties in an implementation).
    @property
    def kind(self) -> str:
        """The engine's name, builtin or vllm: what LoadReports and logs say."""
        ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_context(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block on this engine (the cost model prices moves with it)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def features(self) -> Collection[str]:
        """What the engine honours of a request's sampling fields (schemas.messages BASE_FEATURES and
        OPTIONAL_FEATURES); announced in LoadReports so the intake refuses the rest."""
        ...

    @property
    def model_name(self) -> str: ...

    @property
    def prefill_chunk_tokens(self) -> int:
        """The most prompt tokens one iteration prefills (its chunked-prefill budget); announced in
        LoadReports so the scheduler counts the decode steps a long prefill carries."""
        ...

    @property
    def dtype(self) -> str:
        """Element type of the KV cache ("float32", "bfloat16", ...)."""
        ...

    def describe(self) -> str:
        """One line for logs: engine, model, block size, KV shape."""
        ...

    def block_source(self) -> BlockSource | None:
        """What the block server serves, or None when this engine cannot hand out KV bytes."""
        ...

    def block_sink(self) -> BlockSink | None:
        """Where fetched blocks go, or None when this engine cannot take KV bytes from peers."""
        ...

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request; raises RequestRejected when it can never run here."""
        ...

    def abort(self, request_id: str) -> bool:
        """Stop a request; the next ``step()`` reports it finished with reason "cancelled"."""
        ...

    def kv_arrived(self, request_id: str, expected_reuse_blocks: int) -> None:
        """The pull for a ``kv_pending`` request has ended (landed, partly or not at all): it may start,
        reusing whatever of its prefix is held by then; ``expected_reuse_blocks`` now counts the blocks
        that landed. Unknown ids are ignored (cancelled meanwhile)."""
        ...

    def has_work(self) -> bool:
        """Whether ``step()`` has something to do; a request waiting for its pull is not work (the
        service wakes the loop with ``kv_arrived``), so a lone pull does not spin the engine thread."""
        ...

    def step(self) -> list[StepOutput]:
        """One iteration of the batch: new tokens, finished requests, first-token stats."""
        ...

    def lookup_prefix(self, block_hashes: list[int]) -> int:
        """How many leading blocks of ``block_hashes`` this engine holds (any tier)."""
        ...

    def drain_kv_events(self) -> list[KvEvent]:
        """Block stores, moves and removals since the last call, under kvmesh hashes, in order."""
        ...

    def holdings_events(self, max_blocks_per_event: int) -> list[KvEvent]:
        """Everything held now, as ``stored`` events (a re-announce after the fleet forgot us)."""
        ...

    def load(self) -> EngineLoad: ...

    def calibrate(self) -> PerfProfile:
        """Measure prefill per token and per context token, and the decode step, through the engine."""
        ...

    def set_fleet_copies(self, fn: Callable[[int], int] | None) -> None:
        """How many other workers hold a block: eviction drops those first (fleet-aware)."""
        ...

    def retain(self, block_hashes: list[int], until_ms: int) -> None: ...

    def expire_retains(self, now_ms: int) -> None: ...

    def release_all(self) -> list[KvEvent]:
        """Graceful shutdown: forget every request and block; the events that tell the fleet."""
        ...
