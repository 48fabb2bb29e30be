"""The message types that travel between services, one frozen msgspec Struct each.

A message type is tagged with its wire name (``SCHEMA``), so that a topic's decoder reads the union of
the types it carries in one pass (schemas.codec); the types nested inside messages are untagged.

Schema evolution rules (msgspec's): a new field is appended with a default; an existing field never
changes type or meaning; a breaking change bumps ``VERSION`` and readers list the versions they accept
in ``READS``. Every class carries ``SCHEMA`` (its wire name) and ``VERSION``.

Times on the wire are integer milliseconds since the Unix epoch (``*_ms``) taken by the producer of
the event; decisions never read the clock themselves, they read these fields.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import msgspec

from schemas.token_ids import BlockHashes, PackedBlockHashes, PackedTokenIds, TokenIds

# Tier names, fastest first. The order is the demotion order of a worker's KV cache.
Tier = Literal["gpu", "dram", "disk"]
TIERS: tuple[str, ...] = ("gpu", "dram", "disk")

FinishReason = Literal["stop", "length", "error", "rejected", "cancelled"]


#: Bounds of the sampling fields (OpenAI's, where it has one): what a worker will run.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20

#: What every kvmesh engine honours: the intake accepts these fields whatever engine serves a model.
BASE_FEATURES: tuple[str, ...] = ("stop", "logprobs", "penalties", "seed", "min_tokens", "ignore_eos")
#: What some engines add (vLLM's structured output decoding; tool calls forced by a JSON schema).
OPTIONAL_FEATURES: tuple[str, ...] = ("json_object", "json_schema", "tools")


class StructuredOutput(msgspec.Struct, frozen=True):
    """Constrain the output to a grammar: ``json_object`` (any JSON object) or ``json_schema``
    (``schema`` holds the JSON Schema as JSON text, so the wire type stays flat)."""

    kind: Literal["json_object", "json_schema"]
    schema: str = ""


class SamplingParams(msgspec.Struct, frozen=True):
    """How to pick each next token. ``temperature == 0`` is greedy; ``seed`` makes sampling repeatable.

    The penalties are OpenAI's (presence, frequency: over the generated tokens) and vLLM's
    (repetition: over prompt and output, logits above 0 divided by it, below 0 multiplied).
    ``min_tokens`` tokens come before any stop token or stop string may end the output; ``ignore_eos``
    keeps generating past the model's end tokens. ``logprobs`` asks for each chosen token's log
    probability and that many top alternatives (None: none), from the model's raw distribution.
    ``stop`` strings are matched on the detokenized output; the match and what follows are not output.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 10.0:
            raise ValueError("temperature must be in [0, 10]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError("repetition_penalty must be in (0, 10]")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must not be negative")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop strings must have 1 to {MAX_STOP_CHARS} characters")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def features(self) -> set[str]:
        """The engine features a request with these parameters needs (BASE_FEATURES + OPTIONAL_FEATURES)."""
        need: set[str] = set()
        if self.stop:
            need.add("stop")
        if self.logprobs is not None:
            need.add("logprobs")
        if self.penalized:
            need.add("penalties")
        if self.min_tokens:
            need.add("min_tokens")
        if self.ignore_eos:
            need.add("ignore_eos")
        if self.structured is not None:
            need.add(self.structured.kind)
        return need


class ChatRequest(msgspec.Struct, frozen=True, tag="chat_request"):
    """A tokenized chat turn, published by intake (or the producer SDK) keyed by ``session_id``.

    ``block_hashes`` are the chained hashes of the full blocks of ``token_ids`` (schemas.blocks), salted
    with ``namespace``; the first ``public_prefix_tokens`` tokens may be salted with the public namespace.
    ``reply_topic`` lets several intakes share the fleet: each reads the replies addressed to it.
    """

    SCHEMA: ClassVar[str] = "chat_request"
    #: 2: ``token_ids`` travel packed (schemas.token_ids); 3: ``block_hashes`` too (uint64). Records of
    #: versions 1 and 2 (int arrays) still decode.
    VERSION: ClassVar[int] = 3
    READS: ClassVar[tuple[int, ...]] = (1, 2, 3)

    request_id: str
    session_id: str
    tenant: str
    token_ids: PackedTokenIds
    block_hashes: PackedBlockHashes
    block_size: int
    max_tokens: int
    arrival_ms: int
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    deadline_ms: int | None = None
    namespace: bytes = b"public"
    public_prefix_tokens: int = 0
    model: str = "kvmesh-tiny"
    reply_topic: str = "kvmesh.replies"
    stop_token_ids: list[int] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if type(self.token_ids) is not TokenIds:
            # frozen: the one place the field is set after __init__; ValueError for ids outside uint32
            msgspec.structs.force_setattr(self, "token_ids", TokenIds(self.token_ids))
        if type(self.block_hashes) is not BlockHashes:
            msgspec.structs.force_setattr(self, "block_hashes", BlockHashes(self.block_hashes))
        if not self.request_id or not self.session_id:
            raise ValueError("request_id and session_id must be non-empty")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if len(self.block_hashes) != len(self.token_ids) // self.block_size:
            raise ValueError("block_hashes must hold one hash per full block of token_ids")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")


class CancelRequest(msgspec.Struct, frozen=True, tag="cancel_request"):
    """The client went away: stop work on ``request_id`` (intake → scheduler → worker)."""

    SCHEMA: ClassVar[str] = "cancel_request"
    VERSION: ClassVar[int] = 1

    request_id: str
    session_id: str
    reason: str = "client_disconnected"
    worker_id: str | None = None


class FetchPlan(msgspec.Struct, frozen=True):
    """Blocks to pull from one peer before prefill: ``block_hashes`` are consecutive prompt blocks."""

    peer_worker: str
    peer_address: str
    block_hashes: list[int]
    first_block: int
    tier: str = "gpu"


class Estimate(msgspec.Struct, frozen=True):
    """The scheduler's estimate of time to first token on the chosen worker, and its parts (ms)."""

    ttft_ms: float
    queue_ms: float
    recompute_ms: float
    transfer_ms: float
    policy: str
    cached_blocks: int = 0
    fetched_blocks: int = 0


class DecisionInputs(msgspec.Struct, frozen=True):
    """Where a scheduler stood in its input streams when it made a decision, for exact replay.

    ``applied`` maps ``"topic/partition"`` of every state partition (kv-events, load, control,
    replies) to the next offset the scheduler had not applied (everything below it was). To stay small
    it holds only the partitions that moved since this scheduler's previous decision, except in a
    ``full`` record (the first after a start, then every ``FULL_EVERY``-th), which holds them all plus
    ``since``: the offset each partition was first read from (replies start at their end; kv-events
    at the directory snapshot's offsets). ``batch`` numbers the dispatcher's drains: decisions of one
    batch saw the same inputs, in ``decision_seq`` order.

    Two inputs come from the scheduler's own queue, not from a stream: ``held``, how many requests it
    held besides this one (kvmesh charges extra work by them), and ``pulled``, whether a worker with
    room pulled this held request (it was placed there, not on the policy's choice). Both were added
    with defaults, so records written before them still decode (to 0 and False).
    """

    FULL_EVERY: ClassVar[int] = 64

    now_ms: int
    applied: dict[str, int] = msgspec.field(default_factory=dict)
    since: dict[str, int] = msgspec.field(default_factory=dict)
    full: bool = False
    batch: int = 0
    held: int = 0
    pulled: bool = False


class Assignment(msgspec.Struct, frozen=True, tag="assignment"):
    """The scheduler's decision for one request, keyed by ``worker_id``.

    Blocks [0, reuse_blocks) are expected on the worker; each FetchPlan covers a following run of
    blocks to pull from a peer; the rest of the prompt (``prefill_tokens``) is recomputed. The worker
    checks all of it and falls back to recompute for whatever is not really there.
    """

    SCHEMA: ClassVar[str] = "assignment"
    VERSION: ClassVar[int] = 1

    request: ChatRequest
    worker_id: str
    reuse_blocks: int
    prefill_tokens: int
    estimate: Estimate
    fetch: list[FetchPlan] = msgspec.field(default_factory=list)
    scheduler_id: str = ""
    decision_seq: int = 0
    inputs: DecisionInputs | None = None  # the scheduler's input positions (None: not recorded)
    #: The instance of the worker it was decided for (its LoadReport's started_ms; 0: unknown). A
    #: restarted worker skips what was decided for its previous instance; the scheduler decides those
    #: again, so each request runs once.
    worker_epoch: int = 0


class TokenLogprob(msgspec.Struct, frozen=True):
    """The log probability of one generated token and of the ``top_ids`` most likely alternatives
    (most likely first), from the model's distribution before temperature, penalties and masks."""

    token_id: int
    logprob: float
    top_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: list[float] = msgspec.field(default_factory=list)


class TokenChunk(msgspec.Struct, frozen=True, tag="token_chunk"):
    """Newly generated tokens of one request, in order (``index`` is the first token's position)."""

    SCHEMA: ClassVar[str] = "token_chunk"
    VERSION: ClassVar[int] = 1

    request_id: str
    worker_id: str
    index: int
    token_ids: list[int]
    text: str = ""
    #: One entry per token of ``token_ids`` when the request asked for logprobs, else empty.
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)


class Completion(msgspec.Struct, frozen=True, tag="completion"):
    """The end of a request, success or not; the only message that says how the prompt was served."""

    SCHEMA: ClassVar[str] = "completion"
    VERSION: ClassVar[int] = 1

    request_id: str
    session_id: str
    worker_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    output_token_ids: list[int] = msgspec.field(default_factory=list)
    reused_tokens: int = 0
    fetched_tokens: int = 0
    recomputed_tokens: int = 0
    ttft_ms: float = 0.0
    prefill_ms: float = 0.0
    e2e_ms: float = 0.0
    error: str | None = None
    fallback: str | None = None
    text: str = ""


class KvEvent(msgspec.Struct, frozen=True, tag="kv_event"):
    """A change of a worker's KV cache, keyed by ``worker_id``.

    kind: ``stored`` (blocks now in ``tier``), ``removed`` (blocks gone from the worker), ``moved``
    (blocks went from ``from_tier`` to ``tier``), ``cleared`` (every block of the worker is gone; the
    lists are empty). ``parent_hashes[i]`` is the parent of ``block_hashes[i]`` (0 for a first block).
    """

    SCHEMA: ClassVar[str] = "kv_event"
    #: 2: the hash lists travel packed (uint64, schemas.token_ids); version-1 records still decode.
    VERSION: ClassVar[int] = 2
    READS: ClassVar[tuple[int, ...]] = (1, 2)

    worker_id: str
    kind: Literal["stored", "removed", "moved", "cleared"]
    tier: str
    block_hashes: PackedBlockHashes
    parent_hashes: PackedBlockHashes = msgspec.field(default_factory=BlockHashes)
    from_tier: str | None = None
    session_id: str | None = None
    event_ms: int = 0
    #: This worker's count of KV events (1, 2, ...) within ``epoch`` (its start time, new on every
    #: restart). A consumer that sees a gap asks the worker to resync (ResyncRequest); 0: unnumbered.
    seq: int = 0
    epoch: int = 0

    def __post_init__(self) -> None:
        # frozen: the one place the fields are set after __init__; ValueError for negative hashes
        if type(self.block_hashes) is not BlockHashes:
            msgspec.structs.force_setattr(self, "block_hashes", BlockHashes(self.block_hashes))
        if type(self.parent_hashes) is not BlockHashes:
            msgspec.structs.force_setattr(self, "parent_hashes", BlockHashes(self.parent_hashes))
        if self.parent_hashes and len(self.parent_hashes) != len(self.block_hashes):
            raise ValueError("parent_hashes must be empty or as long as block_hashes")
        if self.tier not in TIERS:
            raise ValueError(f"unknown tier {self.tier!r}")


class TierUsage(msgspec.Struct, frozen=True):
    """Capacity of one tier of a worker's KV cache, in blocks."""

    tier: str
    free_blocks: int
    total_blocks: int


#: What a LoadReport's newer figures may hold: a report outside these bounds (negative, NaN, or a step
#: of more than 1,000 s) is malformed and goes to the dead-letter topic instead of into estimates.
Count = Annotated[int, msgspec.Meta(ge=0)]
StepMs = Annotated[float, msgspec.Meta(ge=0, le=1e6)]


class LoadReport(msgspec.Struct, frozen=True, tag="load_report"):
    """A worker's load and measured speed, keyed by ``worker_id``; also its liveness heartbeat.

    The speed figures feed the shared cost model (kvmesh_core.costmodel) so the scheduler's estimates follow
    the machine: prefill cost per token, decode step time, link bandwidth and per-transfer latency.
    """

    SCHEMA: ClassVar[str] = "load_report"
    VERSION: ClassVar[int] = 1

    worker_id: str
    report_ms: int
    queue_depth: int
    active_requests: int
    active_tokens: int
    queued_prefill_tokens: int
    tiers: list[TierUsage]
    transfer_address: str
    block_size: int
    block_bytes: int
    prefill_ms_per_token: float
    prefill_ms_per_token_per_ctx: float = 0.0
    decode_ms_per_step: float = 0.0
    link_gbps: float = 1.0
    link_latency_ms: float = 1.0
    model: str = "kvmesh-tiny"
    max_context: int = 4096
    started_ms: int = 0
    draining: bool = False
    # Measured speed of moving blocks between this worker's tiers (GB/s), for promotion estimates.
    dram_gbps: float = 20.0
    disk_gbps: float = 2.0
    # The engine behind the worker ("builtin", "vllm") and whether it moves KV blocks with peers: a
    # worker that cannot is never planned as a fetch source or target (its blocks are still reused
    # in place).
    engine: str = "builtin"
    peer_transfer: bool = True
    # The attention part of the queued prefill: the sum over queued prompts of new tokens x (tokens
    # already before them + half the new ones), so the scheduler prices the queue as recompute_ms does
    # (kvmesh_core.costmodel.prefill_ctx). 0: not reported; the scheduler then assumes no cached context.
    queued_prefill_ctx_tokens: float = 0.0
    #: The most prompt tokens one engine iteration prefills (the chunked-prefill budget: vLLM's
    #: ``max_num_batched_tokens``, the built-in engine's ``prefill_chunk``). Every iteration of a
    #: prefill also runs one decode step of the running batch, so a long queued prompt carries as many
    #: steps as it takes iterations. 0: not reported (an older worker, or an engine that prefills one
    #: whole prompt per iteration); the scheduler then counts one step for the whole queue, as before.
    prefill_chunk_tokens: Count = 0
    #: Decode steps until a request queued now gets a place in the engine's running batch, which runs
    #: at most so many requests (built-in ``max_batch``, vLLM's ``max_num_seqs``): its running
    #: requests' expected steps left, the queued requests taking the places first
    #: (services/worker/batch_slots.py). 0: room now, or not reported.
    slot_wait_steps: Count = 0
    #: The recent mean time of the engine's decode-only steps (ms), as its batch and machine run now:
    #: ``decode_ms_per_step`` is calibrated on an idle engine with one request, and a full batch's step
    #: can take many times that (15x on the 2-core box). The scheduler prices every wait it counts in
    #: steps with it; the intake's check of what can finish keeps the calibrated figure. 0: not measured.
    recent_decode_ms_per_step: StepMs = 0.0
    #: Room in the GPU KV tier for the next prompt (kvmesh_core/kv_room.py): the blocks free now, less
    #: those the running requests hold and those the queued prompts will take first (negative when
    #: the queue already waits for room). None: not reported; no wait for room is priced.
    kv_free_blocks: int | None = None
    #: When the running requests are expected to end and the blocks each frees, as ``[decode steps
    #: from now, blocks]``, soonest first, at most ``kv_room.MAX_RELEASES`` entries.
    kv_release: list[tuple[Count, Count]] = msgspec.field(default_factory=list)
    #: What the engine honours of a request's sampling fields (BASE_FEATURES + OPTIONAL_FEATURES):
    #: the intake refuses a field no live worker of the model honours. Empty: an older worker, which
    #: honoured none of them.
    features: list[str] = msgspec.field(default_factory=list)
    #: HMAC of the report under the fleet secret (schemas.report_signing); empty when unsigned. A
    #: scheduler, KV manager or intake that knows the secret drops a report that does not verify.
    signature: bytes = b""


class WorkerLost(msgspec.Struct, frozen=True, tag="worker_lost"):
    """The KV manager declares a worker gone; its blocks are no longer anywhere in the fleet view."""

    SCHEMA: ClassVar[str] = "worker_lost"
    VERSION: ClassVar[int] = 1

    worker_id: str
    last_seen_ms: int
    declared_ms: int
    reason: str = "heartbeat_timeout"


class ReplicateCommand(msgspec.Struct, frozen=True, tag="replicate_command"):
    """Ask ``target_worker`` to pull ``block_hashes`` (a chained run) from ``source_worker``."""

    SCHEMA: ClassVar[str] = "replicate_command"
    VERSION: ClassVar[int] = 1

    command_id: str
    target_worker: str
    source_worker: str
    source_address: str
    block_hashes: list[int]
    namespace: bytes
    tier: str = "dram"
    reason: str = "hot_prefix"


class RetainHint(msgspec.Struct, frozen=True, tag="retain_hint"):
    """Ask ``worker_id`` to keep a session's blocks in a lower tier rather than drop them (multi-turn)."""

    SCHEMA: ClassVar[str] = "retain_hint"
    VERSION: ClassVar[int] = 1

    worker_id: str
    session_id: str
    block_hashes: list[int]
    until_ms: int


class DrainCommand(msgspec.Struct, frozen=True, tag="drain_command"):
    """Operator command: ``worker_id`` takes no new requests (``drain``) but keeps serving its KV blocks
    to peers, so its sessions move to other workers without recomputing; ``drain=False`` undoes it."""

    SCHEMA: ClassVar[str] = "drain_command"
    VERSION: ClassVar[int] = 1

    worker_id: str
    drain: bool = True
    reason: str = "operator"


class ResyncRequest(msgspec.Struct, frozen=True, tag="resync_request"):
    """Asks ``worker_id`` to replace what the fleet knows of its KV cache: it publishes ``cleared``
    and then every block it holds. Sent by a KV manager or scheduler that saw a gap in its KV events."""

    SCHEMA: ClassVar[str] = "resync_request"
    VERSION: ClassVar[int] = 1

    worker_id: str
    requested_by: str
    reason: str = "gap"


class ServiceHeartbeat(msgspec.Struct, frozen=True, tag="service_heartbeat"):
    """A scheduler or KV manager replica is alive, keyed by ``instance_id`` (workers' heartbeat is
    their LoadReport). Intake is ready only while a scheduler's heartbeats arrive."""

    SCHEMA: ClassVar[str] = "service_heartbeat"
    VERSION: ClassVar[int] = 1

    service: Literal["scheduler", "kvmanager"]
    instance_id: str
    report_ms: int
    started_ms: int = 0


MESSAGE_TYPES: tuple[type, ...] = (
    ChatRequest,
    CancelRequest,
    Assignment,
    TokenChunk,
    Completion,
    KvEvent,
    LoadReport,
    WorkerLost,
    ReplicateCommand,
    RetainHint,
    DrainCommand,
    ServiceHeartbeat,
    ResyncRequest,
)
