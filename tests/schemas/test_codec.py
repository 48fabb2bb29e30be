"""Round trips, strict validation and fuzzing of the wire codec."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import codec
from schemas.blocks import block_hashes, tenant_namespace
from schemas.errors import (
    InvalidPayload,
    RecordTooLarge,
    SchemaError,
    UnknownSchema,
    UnknownVersion,
)
from schemas.messages import (
    Assignment,
    ChatRequest,
    Completion,
    Estimate,
    FetchPlan,
    KvEvent,
    LoadReport,
    ReplicateCommand,
    SamplingParams,
    TierUsage,
    WorkerLost,
)


def _request(tokens: list[int] | None = None, **kw: object) -> ChatRequest:
    toks = tokens if tokens is not None else list(range(50))
    ns = tenant_namespace("acme")
    return ChatRequest(
        request_id="r1",
        session_id="s1",
        tenant="acme",
        token_ids=toks,
        block_hashes=block_hashes(toks, 16, ns),
        block_size=16,
        max_tokens=8,
        arrival_ms=1000,
        namespace=ns,
        **kw,  # type: ignore[arg-type]
    )


SAMPLES = [
    _request(sampling=SamplingParams(temperature=0.7, top_p=0.9, seed=3), deadline_ms=5000),
    Assignment(
        request=_request(),
        worker_id="w1",
        reuse_blocks=2,
        prefill_tokens=2,
        estimate=Estimate(ttft_ms=3.5, queue_ms=1, recompute_ms=2, transfer_ms=0.5, policy="kvmesh"),
        fetch=[
            FetchPlan(peer_worker="w2", peer_address="127.0.0.1:7000", block_hashes=[5, 6], first_block=2)
        ],
    ),
    Completion(
        request_id="r1",
        session_id="s1",
        worker_id="w1",
        finish_reason="length",
        prompt_tokens=50,
        completion_tokens=8,
        output_token_ids=[1, 2, 3],
        reused_tokens=32,
        ttft_ms=4.2,
    ),
    KvEvent(worker_id="w1", kind="stored", tier="gpu", block_hashes=[1, 2], parent_hashes=[0, 1]),
    LoadReport(
        worker_id="w1",
        report_ms=5,
        queue_depth=1,
        active_requests=2,
        active_tokens=300,
        queued_prefill_tokens=40,
        tiers=[TierUsage("gpu", 10, 100)],
        transfer_address="127.0.0.1:1",
        block_size=16,
        block_bytes=32768,
        prefill_ms_per_token=0.05,
    ),
    WorkerLost(worker_id="w1", last_seen_ms=1, declared_ms=2),
    ReplicateCommand(
        command_id="c1",
        target_worker="w2",
        source_worker="w1",
        source_address="127.0.0.1:1",
        block_hashes=[1, 2],
        namespace=b"public",
    ),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message: object) -> None:
    data = codec.encode(message, "producer-a", 7, 1234)
    env = codec.decode(data)
    assert env.message == message
    assert (env.producer, env.seq, env.event_ms, env.schema) == ("producer-a", 7, 1234, type(message).SCHEMA)


def _raw(schema: str, version: int, payload: object) -> bytes:
    return msgpack.packb(["kvm1", schema, version, "p", 1, 2, payload], use_bin_type=True)


def test_unknown_schema_and_version_are_typed_errors() -> None:
    with pytest.raises(UnknownSchema):
        codec.decode(_raw("no_such_thing", 1, {}))
    with pytest.raises(UnknownVersion):
        codec.decode(_raw("worker_lost", 99, {"worker_id": "w", "last_seen_ms": 1, "declared_ms": 2}))


def test_wrong_types_and_missing_fields_are_rejected() -> None:
    ok = {"worker_id": "w", "last_seen_ms": 1, "declared_ms": 2}
    assert codec.decode(_raw("worker_lost", 1, ok)).message.worker_id == "w"
    with pytest.raises(InvalidPayload, match="last_seen_ms"):
        codec.decode(_raw("worker_lost", 1, {**ok, "last_seen_ms": "1"}))
    with pytest.raises(InvalidPayload, match="declared_ms"):
        codec.decode(_raw("worker_lost", 1, {"worker_id": "w", "last_seen_ms": 1}))
    # bool is not an int on the wire
    with pytest.raises(InvalidPayload):
        codec.decode(_raw("worker_lost", 1, {**ok, "declared_ms": True}))


def test_unknown_fields_are_skipped_for_schema_evolution() -> None:
    env = codec.decode(
        _raw(
            "worker_lost", 1, {"worker_id": "w", "last_seen_ms": 1, "declared_ms": 2, "added_in_v1_1": [1, 2]}
        )
    )
    assert env.message == WorkerLost(worker_id="w", last_seen_ms=1, declared_ms=2)


def test_bound_checks_in_post_init_become_invalid_payload() -> None:
    good = codec.encode(_request(), "p", 1, 1)
    raw = msgpack.unpackb(good, raw=False)
    raw[6]["block_hashes"] = raw[6]["block_hashes"][:-1]  # one hash short of the token count
    with pytest.raises(InvalidPayload, match="block_hashes"):
        codec.decode(msgpack.packb(raw, use_bin_type=True))
    raw[6]["sampling"] = {"temperature": -1.0}
    with pytest.raises(InvalidPayload):
        codec.decode(msgpack.packb(raw, use_bin_type=True))


def test_size_limits() -> None:
    big = _request(tokens=list(range(70_000, 470_000)))
    with pytest.raises(RecordTooLarge):
        codec.encode(big, "p", 1, 1)
    data = codec.encode(big, "p", 1, 1, max_bytes=8 << 20)
    with pytest.raises(RecordTooLarge):
        codec.decode(data)
    assert codec.decode(data, max_bytes=8 << 20).message == big


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"\x93\x01\x02",
        msgpack.packb({"a": 1}),
        msgpack.packb(["kvm1", 1, 1, "p", 1, 1, {}]),
        msgpack.packb(["kvm1", "worker_lost", "1", "p", 1, 1, {}]),
    ],
)
def test_malformed_records(data: bytes) -> None:
    with pytest.raises(SchemaError):
        codec.decode(data)


def test_encode_refuses_unregistered_types() -> None:
    with pytest.raises(UnknownSchema):
        codec.encode(object(), "p", 1, 1)


_plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_random_bytes_only_raise_schema_errors(data: bytes) -> None:
    with contextlib.suppress(SchemaError):
        codec.decode(data)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([type(m).SCHEMA for m in SAMPLES]), st.integers(0, 3), _plain)
def test_fuzz_structured_payloads_only_raise_schema_errors(
    schema: str, version: int, payload: object
) -> None:
    with contextlib.suppress(SchemaError):
        codec.decode(_raw(schema, version, payload))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=100), st.text(min_size=1, max_size=5))
def test_fuzz_chat_request_round_trip(tokens: list[int], tenant: str) -> None:
    ns = tenant_namespace(tenant)
    req = ChatRequest(
        request_id="r",
        session_id="s",
        tenant=tenant,
        token_ids=tokens,
        block_hashes=block_hashes(tokens, 16, ns),
        block_size=16,
        max_tokens=1,
        arrival_ms=0,
        namespace=ns,
    )
    assert codec.decode(codec.encode(req, "p", 0, 0)).message == req


def test_a_load_report_with_an_impossible_figure_is_malformed() -> None:
    """The figures the scheduler prices waits with cannot be negative or NaN (a broken worker): the
    report is refused as malformed, to the dead-letter topic, rather than poisoning every estimate."""
    import math

    import msgspec

    from schemas.messages import LoadReport, TierUsage

    base = LoadReport("w-0", 1, 0, 0, 0, 0, [TierUsage("gpu", 1, 1)], "127.0.0.1:1", 16, 4096, 0.1)
    fine = msgspec.structs.replace(base, recent_decode_ms_per_step=2.5, slot_wait_steps=40)
    assert codec.decode(codec.encode(fine, "w-0", 1, 1)).message == fine
    for bad in (
        {"recent_decode_ms_per_step": math.nan},
        {"recent_decode_ms_per_step": -1.0},
        {"recent_decode_ms_per_step": 1e7},
        {"slot_wait_steps": -3},
        {"prefill_chunk_tokens": -1},
    ):
        with pytest.raises(InvalidPayload, match=next(iter(bad))):
            codec.decode(codec.encode(msgspec.structs.replace(base, **bad), "w-0", 1, 1))  # type: ignore[arg-type]
