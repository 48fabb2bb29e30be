"""The generated per-class decoders and encoders agree with the reference walk of schemas.validate.

The fast decoder may only accept what the reference decoder accepts, with an identical result (same
values *and* types: ``True == 1`` in Python, so plain equality is not enough); everything else it
must refuse so that the reference decoder decides.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import codec, validate
from schemas.blocks import block_hashes, tenant_namespace
from schemas.errors import InvalidPayload
from schemas.messages import (
    MESSAGE_TYPES,
    Assignment,
    ChatRequest,
    Completion,
    Estimate,
    FetchPlan,
    KvEvent,
    LoadReport,
    SamplingParams,
    TierUsage,
    WorkerLost,
)
from schemas.token_ids import TokenIds


def _request(**kw: Any) -> ChatRequest:
    toks = list(range(250, 300))
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
        **kw,
    )


SAMPLES = [
    _request(),
    _request(sampling=SamplingParams(temperature=0.7, top_p=0.9, seed=3), deadline_ms=5, stop_token_ids=[2]),
    Assignment(
        request=_request(),
        worker_id="w1",
        reuse_blocks=2,
        prefill_tokens=2,
        estimate=Estimate(ttft_ms=3.5, queue_ms=1, recompute_ms=2, transfer_ms=0.5, policy="kvmesh"),
        fetch=[FetchPlan(peer_worker="w2", peer_address="a:1", block_hashes=[5, 2**64 - 1], first_block=2)],
    ),
    Completion(
        request_id="r1",
        session_id="s1",
        worker_id="w1",
        finish_reason="length",
        prompt_tokens=50,
        completion_tokens=3,
        output_token_ids=[1, 2, 3],
        error="boom",
    ),
    KvEvent(
        worker_id="w1", kind="moved", tier="dram", block_hashes=[1, 2], parent_hashes=[0, 1], from_tier="gpu"
    ),
    LoadReport(
        worker_id="w1",
        report_ms=5,
        queue_depth=1,
        active_requests=2,
        active_tokens=300,
        queued_prefill_tokens=40,
        tiers=[TierUsage("gpu", 10, 100), TierUsage("dram", 0, 5)],
        transfer_address="127.0.0.1:1",
        block_size=16,
        block_bytes=32768,
        prefill_ms_per_token=0.05,
        draining=True,
    ),
]

# Any MessagePack value, to put where a field should be.
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


def _same(a: Any, b: Any) -> bool:
    """Equal values of identical types, recursively."""
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _payload(message: object) -> Any:
    """The payload map exactly as a reader gets it off the wire."""
    return msgpack.unpackb(codec.encode(message, "p", 1, 1), raw=False, strict_map_key=False)[6]


def _fast(cls: type, value: Any) -> Any:
    """The fast decoder's verdict: its result, or None if it refused."""
    try:
        return validate._fast_decoder(cls, True)(value)
    except (validate._Reject, KeyError, TypeError, ValueError):
        return None


def _reference(cls: type, value: Any) -> Any:
    try:
        return validate._checked_from_plain(cls, value, "payload")
    except InvalidPayload:
        return None


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_fast_paths_match_the_reference_on_samples(message: object) -> None:
    cls = type(message)
    assert _same(validate.to_plain(message), validate._generic_to_plain(message))
    value = _payload(message)
    fast = _fast(cls, value)
    assert fast is not None, "the fast decoder must accept well-formed records"
    assert _same(fast, _reference(cls, value))
    assert fast == message  # int given for a float field comes back a float: == not _same


def test_every_message_type_gets_fast_paths() -> None:
    for cls in MESSAGE_TYPES:
        assert callable(validate._fast_decoder(cls, False))
        assert callable(validate._fast_encoder(cls))


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("token_ids", [1, True, 3]),  # bool is not an int, even inside a long list
        ("token_ids", [1, 2.0, 3]),
        ("token_ids", [1, None]),
        ("token_ids", (1, 2)),
        ("block_size", True),
        ("block_size", 16.0),
        ("request_id", b"r1"),
        ("namespace", "acme"),
        ("sampling", {"temperature": "0.5"}),
        ("sampling", {"temperature": True}),
        ("deadline_ms", False),
        ("stop_token_ids", [False]),
    ],
)
def test_wrong_types_are_refused_on_both_paths(field: str, bad: object) -> None:
    value = _payload(_request())
    value[field] = bad
    assert _fast(ChatRequest, value) is None
    with pytest.raises(InvalidPayload, match=field):
        validate.from_owned_plain(ChatRequest, value, "chat_request")


def test_unusual_but_valid_values_fall_back_to_the_reference() -> None:
    class Tok(enum.IntEnum):
        A = 5

    value = _payload(_request())
    # an int array is what a version-1 writer sent: the reference decoder checks it element-wise
    value["token_ids"] = [Tok.A, *TokenIds.from_bytes(value["token_ids"])[1:]]
    assert _fast(ChatRequest, value) is None
    got = validate.from_plain(ChatRequest, value)
    assert got.token_ids[0] == 5


def test_required_missing_and_unknown_fields() -> None:
    ok = {"worker_id": "w", "last_seen_ms": 1, "declared_ms": 2}
    assert _same(_fast(WorkerLost, {**ok, "future_field": [1]}), WorkerLost("w", 1, 2))
    assert _fast(WorkerLost, {"worker_id": "w", "last_seen_ms": 1}) is None
    assert _fast(WorkerLost, [ok]) is None


def test_from_plain_copies_lists_and_decode_keeps_its_own() -> None:
    value = _payload(_request())
    stops = value["stop_token_ids"] = [7, 8]
    copied = validate.from_plain(ChatRequest, value)
    assert copied.stop_token_ids == stops and copied.stop_token_ids is not stops
    owned = validate.from_owned_plain(ChatRequest, value)
    assert owned.stop_token_ids is stops


def test_packed_token_ids_travel_as_bytes_and_wrap_without_unpacking() -> None:
    message = _request()
    value = _payload(message)
    assert type(value["token_ids"]) is bytes and len(value["token_ids"]) == 4 * len(message.token_ids)
    fast = _fast(ChatRequest, value)
    assert fast is not None and type(fast.token_ids) is TokenIds
    assert fast.token_ids._arr is None  # nothing unpacked until someone reads an element
    assert fast.token_ids == message.token_ids == list(message.token_ids)


@pytest.mark.parametrize("bad", [b"\x01\x02\x03", b"\x00" * 4 * 7 + b"\x00", bytearray(3)])
def test_packed_token_ids_of_a_wrong_length_are_refused_on_both_paths(bad: bytes) -> None:
    value = _payload(_request())
    value["token_ids"] = bad
    assert _fast(ChatRequest, value) is None
    with pytest.raises(InvalidPayload, match="token_ids"):
        validate.from_owned_plain(ChatRequest, value, "chat_request")


@pytest.mark.parametrize("bad", [[-1], [1 << 32], [0, 2**40]])
def test_version_1_int_arrays_outside_uint32_are_refused(bad: list[int]) -> None:
    value = _payload(_request())
    value["token_ids"] = bad + [0] * (len(TokenIds.from_bytes(value["token_ids"])) - len(bad))
    with pytest.raises(InvalidPayload, match="token_ids"):
        validate.from_owned_plain(ChatRequest, value, "chat_request")


def test_bound_checks_still_apply_on_the_fast_path() -> None:
    value = _payload(_request())
    value["block_hashes"] = value["block_hashes"][:-1]
    assert _fast(ChatRequest, value) is None
    with pytest.raises(InvalidPayload, match="block_hashes"):
        validate.from_plain(ChatRequest, value, "chat_request")


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_fuzz_fast_decoder_never_accepts_more_than_the_reference(
    message: object, data: st.DataObject
) -> None:
    cls = type(message)
    value = _payload(message)
    names = sorted(value)
    for name in data.draw(st.lists(st.sampled_from(names), max_size=3, unique=True)):
        if data.draw(st.booleans()):
            value[name] = data.draw(_plain)
        else:
            del value[name]
    fast = _fast(cls, value)
    if fast is not None:
        assert _same(fast, _reference(cls, value))
