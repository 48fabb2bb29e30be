"""TokenIds (packed uint32 token ids) and ChatRequest v2 beside the version-1 records it replaces."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.blocks import block_hashes
from schemas.codec import decode, encode
from schemas.envelope import MAGIC
from schemas.errors import InvalidPayload
from schemas.messages import ChatRequest, KvEvent
from schemas.token_ids import BlockHashes, TokenIds, int_list, wire_value

ids32 = st.lists(st.integers(min_value=0, max_value=0xFFFFFFFF), max_size=300)


@given(ids32)
def test_behaves_as_the_list_it_replaces(ids: list[int]) -> None:
    t = TokenIds(ids)
    assert len(t) == len(ids)
    assert t == ids and ids == t and t == tuple(ids)
    assert list(t) == ids and t.tolist() == ids
    assert t[1:5] == ids[1:5] and t[::-1] == ids[::-1]
    if ids:
        assert t[0] == ids[0] and t[-1] == ids[-1]
    assert t + [7] == [*ids, 7] and [7] + t == [7, *ids]  # noqa: RUF005 (the operators under test)
    assert t.numpy().tolist() == ids
    assert TokenIds.from_bytes(t.to_bytes()) == t
    assert t.to_bytes() == np.asarray(ids, dtype="<u4").tobytes()  # little-endian on the wire


def test_inequality_and_errors() -> None:
    t = TokenIds([1, 2, 3])
    assert t != [1, 2] and t != [1, 2, 4] and t != TokenIds([1, 2]) and t != "abc"
    with pytest.raises(IndexError):
        t[3]
    for bad in ([-1], [1 << 32], [1.5], ["a"]):
        with pytest.raises(ValueError):
            TokenIds(bad)
    with pytest.raises(ValueError, match="multiple of 4"):
        TokenIds.from_bytes(b"\x00" * 5)


@given(ids32)
def test_an_array_packs_to_the_same_bytes_as_its_list(ids: list[int]) -> None:
    for dtype in ("<u4", "<i8", "<u8"):
        assert TokenIds(np.asarray(ids, dtype=dtype)).to_bytes() == TokenIds(ids).to_bytes()
    assert BlockHashes(np.asarray(ids, dtype="<u8")) == BlockHashes(ids)


def test_an_array_out_of_range_or_not_ints_is_refused() -> None:
    for bad in (np.array([-1]), np.array([1 << 32]), np.array([1.5]), np.array([[1, 2]])):
        with pytest.raises(ValueError, match="token ids"):
            TokenIds(bad)
    assert TokenIds(np.array([], dtype=np.int64)) == []


def test_a_request_built_from_an_array_matches_one_built_from_its_list() -> None:
    from schemas.chat_requests import chat_request

    arr = np.random.default_rng(3).integers(0, 32_000, size=1000)
    made = [
        chat_request(
            t,
            request_id="r",
            session_id="s",
            tenant="a",
            block_size=16,
            max_tokens=1,
            arrival_ms=0,
            public_prefix_tokens=100,
        )
        for t in (arr, arr.tolist())
    ]
    assert made[0] == made[1]
    assert made[0].block_hashes == block_hashes(arr.tolist(), 16, b"t:a", 100)


def test_copies_and_pickles_as_itself() -> None:
    t = TokenIds(range(40))
    for other in (copy.copy(t), copy.deepcopy(t), pickle.loads(pickle.dumps(t))):
        assert type(other) is TokenIds and other == t
    assert hash(t) == hash(TokenIds(list(range(40))))


def _request(tokens: list[int]) -> ChatRequest:
    return ChatRequest(
        request_id="r1",
        session_id="s1",
        tenant="t",
        token_ids=tokens,
        block_hashes=block_hashes(tokens, 16),
        block_size=16,
        max_tokens=4,
        arrival_ms=1,
    )


def test_a_request_always_holds_token_ids_whatever_it_was_built_from() -> None:
    tokens = list(range(50))
    for given_ids in (tokens, tuple(tokens), TokenIds(tokens)):
        r = _request(given_ids)  # type: ignore[arg-type]
        assert type(r.token_ids) is TokenIds and r.token_ids == tokens
    r = _request(tokens)
    shorter = msgspec.structs.replace(r, token_ids=tokens[:20], block_hashes=r.block_hashes[:1])
    assert type(shorter.token_ids) is TokenIds
    with pytest.raises(ValueError, match="token ids"):
        _request([-1] * 16)


def test_version_1_records_with_int_arrays_still_decode_to_the_same_request() -> None:
    tokens = [(i * 7919) % 32000 for i in range(100)]
    message = _request(tokens)
    payload = _plain(message)
    payload["token_ids"] = tokens  # how a version-1 writer sent them
    payload["block_hashes"] = list(message.block_hashes)  # and versions 1 and 2 sent these
    v1 = msgpack.packb([MAGIC, "chat_request", 1, "old-intake", 5, 9, payload], use_bin_type=True)
    got = decode(v1)
    assert got.version == 1 and got.message == message
    assert type(got.message.block_hashes) is BlockHashes
    payload["token_ids"] = message.token_ids.to_bytes()
    v2 = decode(msgpack.packb([MAGIC, "chat_request", 2, "intake", 6, 9, payload], use_bin_type=True))
    assert v2.version == 2 and v2.message == message
    v3 = decode(encode(message, "intake", 7, 9))
    assert v3.version == ChatRequest.VERSION == 3 and v3.message == message
    assert len(encode(message, "intake", 6, 9)) < len(v1) + 2 * len(tokens)


def test_a_version_1_array_with_a_bool_is_refused() -> None:
    message = _request(list(range(32)))
    payload = _plain(message)
    payload["token_ids"] = [True, *range(1, 32)]
    v1 = msgpack.packb([MAGIC, "chat_request", 1, "old", 5, 9, payload], use_bin_type=True)
    with pytest.raises(InvalidPayload, match="token_ids"):
        decode(v1)


def test_kv_event_hashes_travel_packed_and_version_1_int_arrays_still_decode() -> None:
    hashes = [2**64 - 1, 0, 12345678901234567890]
    ev = KvEvent("w1", "stored", "gpu", hashes, [0, *hashes[:-1]], event_ms=3)
    assert type(ev.block_hashes) is BlockHashes and ev.block_hashes == hashes
    wire = encode(ev, "w1", 1, 3)
    # packed uint64s (in both lists), not MessagePack uint64 ints (0xcf + 8 bytes)
    assert wire.count(b"\xff" * 8) == 2 and b"\xcf" + b"\xff" * 8 not in wire
    assert decode(wire).message == ev
    payload = _plain(ev)
    payload["block_hashes"], payload["parent_hashes"] = hashes, [0, *hashes[:-1]]
    v1 = decode(msgpack.packb([MAGIC, "kv_event", 1, "old-worker", 2, 3, payload], use_bin_type=True))
    assert v1.version == 1 and v1.message == ev
    assert KvEvent("w1", "cleared", "gpu", []).parent_hashes == []
    with pytest.raises(ValueError, match="block hashes"):
        KvEvent("w1", "stored", "gpu", [-1])
    payload["block_hashes"] = b"\x00" * 7  # not a whole number of uint64s
    with pytest.raises(InvalidPayload, match="multiple of 8"):
        decode(msgpack.packb([MAGIC, "kv_event", 2, "w1", 3, 3, payload], use_bin_type=True))


def test_int_list_unpacks_packed_runs_once_and_copies_lists() -> None:
    packed = BlockHashes([5, 6, 7])
    assert int_list(packed) == [5, 6, 7] and type(int_list(packed)) is list
    plain = [1, 2]
    assert int_list(plain) == plain and int_list(plain) is not plain
    assert BlockHashes([1, 2]) == TokenIds([1, 2])  # same ints, different widths


def _plain(message: object) -> dict[str, Any]:
    """The payload map of ``message`` as a writer from before the tag wrote it (bytes kept as bin)."""
    plain: dict[str, Any] = msgspec.to_builtins(message, builtin_types=(bytes,), enc_hook=wire_value)
    plain.pop("type", None)
    return plain
