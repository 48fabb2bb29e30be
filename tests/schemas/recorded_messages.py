"""One message of every wire type, with no field left at its default where that can be helped, and
how each older version of a type was written.

``tests/schemas/recorded/*.bin`` hold the bytes the codec of each version wrote for these messages
(frozen when the codec moved to msgspec, from the hand-written encoder of the time). The fixtures
never change; ``test_recorded_versions`` checks that today's decoder still reads them to these
messages.
"""

from __future__ import annotations

from typing import Any

from schemas.blocks import block_hashes
from schemas.messages import (
    Assignment,
    CancelRequest,
    ChatRequest,
    Completion,
    DecisionInputs,
    DrainCommand,
    Estimate,
    FetchPlan,
    KvEvent,
    LoadReport,
    ReplicateCommand,
    ResyncRequest,
    RetainHint,
    SamplingParams,
    ServiceHeartbeat,
    StructuredOutput,
    TierUsage,
    TokenChunk,
    TokenLogprob,
    WorkerLost,
)

_TOKENS = [(i * 7919) % 32000 for i in range(70)]
_NS = b"tenant-a"

REQUEST = ChatRequest(
    request_id="r-1",
    session_id="s-1",
    tenant="tenant-a",
    token_ids=_TOKENS,
    block_hashes=block_hashes(_TOKENS, 16, _NS),
    block_size=16,
    max_tokens=64,
    arrival_ms=1_700_000_000_123,
    sampling=SamplingParams(
        temperature=0.7,
        top_p=0.9,
        seed=42,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.1,
        min_tokens=2,
        ignore_eos=True,
        logprobs=3,
        stop=["\n\n", "END"],
        structured=StructuredOutput("json_schema", '{"type": "object"}'),
    ),
    deadline_ms=1_700_000_030_000,
    namespace=_NS,
    public_prefix_tokens=32,
    model="tiny-llama",
    reply_topic="kvmesh.replies.intake-2",
    stop_token_ids=[2, 7],
)

_HASHES = [2**64 - 1, 0, 12345678901234567890]

MESSAGES: dict[str, Any] = {
    "chat_request": REQUEST,
    "cancel_request": CancelRequest("r-1", "s-1", reason="deadline", worker_id="w-2"),
    "assignment": Assignment(
        request=REQUEST,
        worker_id="w-1",
        reuse_blocks=2,
        prefill_tokens=6,
        estimate=Estimate(12.5, 3.0, 7.25, 2.25, "ttft", cached_blocks=2, fetched_blocks=2),
        fetch=[FetchPlan("w-2", "127.0.0.1:7001", list(REQUEST.block_hashes[2:4]), 2, tier="dram")],
        scheduler_id="sched-a",
        decision_seq=17,
        inputs=DecisionInputs(
            now_ms=1_700_000_000_200,
            applied={"kvmesh.kv-events/0": 10, "kvmesh.load/1": 4},
            since={"kvmesh.kv-events/0": 0},
            full=True,
            batch=3,
        ),
        worker_epoch=1_699_999_000_000,
    ),
    "token_chunk": TokenChunk(
        "r-1",
        "w-1",
        4,
        [11, 12],
        text="hi",
        logprobs=[TokenLogprob(11, -0.5, [11, 3], [-0.5, -1.5]), TokenLogprob(12, -0.1, [], [])],
    ),
    "completion": Completion(
        request_id="r-1",
        session_id="s-1",
        worker_id="w-1",
        finish_reason="length",
        prompt_tokens=70,
        completion_tokens=5,
        output_token_ids=[1, 2, 3, 4, 5],
        reused_tokens=32,
        fetched_tokens=32,
        recomputed_tokens=6,
        ttft_ms=14.5,
        prefill_ms=3.25,
        e2e_ms=40.0,
        error=None,
        fallback="peer_unreachable",
        text="abcde",
    ),
    "kv_event": KvEvent(
        "w-1",
        "moved",
        "dram",
        _HASHES,
        [0, *_HASHES[:-1]],
        from_tier="gpu",
        session_id="s-1",
        event_ms=1_700_000_000_300,
        seq=9,
        epoch=1_699_999_000_000,
    ),
    "load_report": LoadReport(
        worker_id="w-1",
        report_ms=1_700_000_000_400,
        queue_depth=2,
        active_requests=3,
        active_tokens=900,
        queued_prefill_tokens=120,
        tiers=[TierUsage("gpu", 10, 64), TierUsage("dram", 100, 256), TierUsage("disk", 1000, 1024)],
        transfer_address="127.0.0.1:7001",
        block_size=16,
        block_bytes=65536,
        prefill_ms_per_token=0.25,
        prefill_ms_per_token_per_ctx=0.0001,
        decode_ms_per_step=8.0,
        link_gbps=10.0,
        link_latency_ms=0.5,
        model="tiny-llama",
        max_context=2048,
        started_ms=1_699_999_000_000,
        draining=True,
        dram_gbps=15.0,
        disk_gbps=1.5,
        engine="vllm",
        peer_transfer=False,
        queued_prefill_ctx_tokens=1234.5,
        features=["stop", "logprobs"],
        signature=b"0123456789abcdef",
    ),
    "worker_lost": WorkerLost("w-3", 1_700_000_000_000, 1_700_000_010_000, reason="operator"),
    "replicate_command": ReplicateCommand(
        "cmd-1", "w-2", "w-1", "127.0.0.1:7001", list(_HASHES), _NS, tier="gpu", reason="drain"
    ),
    "retain_hint": RetainHint("w-1", "s-1", list(_HASHES), 1_700_000_100_000),
    "drain_command": DrainCommand("w-1", drain=False, reason="maintenance"),
    "resync_request": ResyncRequest("w-1", "kvmanager-1", reason="restart"),
    "service_heartbeat": ServiceHeartbeat("scheduler", "sched-a", 1_700_000_000_500, started_ms=1),
}

#: The header of every fixture record: producer, sequence, event time.
HEADER = ("recorder", 7, 1_700_000_000_999)

#: (file stem, schema, version): every fixture; the current version of each type is ``<schema>-v<N>``.
OLDER = (
    ("chat_request-v1", "chat_request", 1),  # token ids and block hashes as int arrays
    ("chat_request-v2", "chat_request", 2),  # token ids packed, block hashes an int array
    ("kv_event-v1", "kv_event", 1),  # both hash lists int arrays
)
