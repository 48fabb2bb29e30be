"""Unit tests of the producer SDK without a broker: reply routing, ordering, dedup, request building."""

from __future__ import annotations

import pytest

from kvmesh_client import ClientError, KvmeshClient, ReplyRouter, RequestClosed, RequestHandle
from kvmesh_core.tokenizer import ByteTokenizer, ChatMessage, render_chat
from schemas.blocks import PUBLIC_NAMESPACE, block_hashes, tenant_namespace
from schemas.messages import Completion, KvEvent, TokenChunk
from streams.settings import KafkaSettings

SYSTEM = "You are a helpful assistant for the kvmesh test suite, answering briefly."


def _client(**kw: object) -> KvmeshClient:
    return KvmeshClient(KafkaSettings(), client_id="test-client", **kw)  # type: ignore[arg-type]


def _handle(client: KvmeshClient | None = None, request_id: str = "r1") -> RequestHandle:
    c = client or _client()
    req = c.build_request(token_ids=list(range(40)), session_id="s1", request_id=request_id)
    return RequestHandle(req)


def _chunk(index: int, ids: list[int], rid: str = "r1") -> TokenChunk:
    return TokenChunk(rid, "w0", index, ids)


def _done(ids: list[int], rid: str = "r1") -> Completion:
    return Completion(rid, "s1", "w0", "stop", 40, len(ids), output_token_ids=ids)


async def _collect(h: RequestHandle) -> list[tuple[int, list[int]]]:
    return [(c.index, c.token_ids) async for c in h.stream(timeout=5)]


async def test_router_delivers_in_order_and_drops_duplicates() -> None:
    router = ReplyRouter()
    h = _handle()
    router.register(h)
    for msg in [_chunk(0, [1, 2]), _chunk(0, [1, 2]), _chunk(2, [3]), _chunk(1, [2, 3]), _done([1, 2, 3])]:
        assert router.dispatch(msg)
    assert await _collect(h) == [(0, [1, 2]), (2, [3])]
    assert (await h.result(1)).output_token_ids == [1, 2, 3]
    assert len(router) == 0  # unregistered once the Completion went through


async def test_router_buffers_a_gap_until_it_is_filled() -> None:
    router = ReplyRouter()
    h = _handle()
    router.register(h)
    router.dispatch(_chunk(3, [40, 50]))
    router.dispatch(_chunk(0, [10, 20, 30]))
    router.dispatch(_done([10, 20, 30, 40, 50]))
    assert await _collect(h) == [(0, [10, 20, 30]), (3, [40, 50])]


async def test_overlapping_chunk_is_trimmed_to_the_new_tokens() -> None:
    router = ReplyRouter()
    h = _handle()
    router.register(h)
    router.dispatch(_chunk(0, [1, 2, 3]))
    router.dispatch(_chunk(1, [2, 3, 4, 5]))
    router.dispatch(_done([1, 2, 3, 4, 5]))
    assert await _collect(h) == [(0, [1, 2, 3]), (3, [4, 5])]


async def test_completion_fills_the_tail_that_no_chunk_carried() -> None:
    router = ReplyRouter()
    h = _handle()
    router.register(h)
    router.dispatch(_chunk(0, [7]))
    router.dispatch(_chunk(5, [99]))  # lost chunks 1..4: the Completion is authoritative
    router.dispatch(_done([7, 8, 9]))
    assert await _collect(h) == [(0, [7]), (1, [8, 9])]


async def test_unknown_and_foreign_replies_are_ignored() -> None:
    router = ReplyRouter()
    h = _handle()
    router.register(h)
    assert not router.dispatch(_chunk(0, [1], rid="someone-else"))
    assert not router.dispatch(_done([1], rid="someone-else"))
    assert not router.dispatch(KvEvent("w0", "cleared", "gpu", []))
    assert router.ignored == 3
    router.dispatch(_done([5]))
    assert await _collect(h) == [(0, [5])]
    # After the end, late duplicates are dropped without error.
    assert not router.dispatch(_chunk(0, [5]))


async def test_register_twice_is_refused_and_close_wakes_readers() -> None:
    router = ReplyRouter()
    h = _handle()
    router.register(h)
    with pytest.raises(ClientError):
        router.register(h)
    router.close_all()
    with pytest.raises(RequestClosed):
        await _collect(h)
    with pytest.raises(RequestClosed):
        await h.result(1)


def test_build_request_hashes_with_the_tenant_namespace() -> None:
    c = _client()
    msgs = [ChatMessage("user", "x" * 40)]
    a = c.build_request(msgs, tenant="tenantA", session_id="s")
    b = c.build_request(msgs, tenant="tenantB", session_id="s")
    ids = render_chat(ByteTokenizer(), msgs)
    assert a.token_ids == b.token_ids == ids
    assert a.namespace == tenant_namespace("tenantA")
    assert a.block_hashes == block_hashes(ids, 16, tenant_namespace("tenantA"))
    assert len(a.block_hashes) == len(ids) // 16 >= 2
    assert not set(a.block_hashes) & set(b.block_hashes)
    assert a.public_prefix_tokens == 0
    assert a.reply_topic == "kvmesh.replies"


def test_public_prefix_blocks_are_shared_only_when_configured() -> None:
    msgs = [ChatMessage("system", SYSTEM), ChatMessage("user", "hello there")]
    shared = _client(public_prefixes={"assistant-v1": SYSTEM})
    a = shared.build_request(msgs, tenant="tenantA")
    b = shared.build_request(msgs, tenant="tenantB")
    prefix_len = len(render_chat(ByteTokenizer(), msgs[:1], add_generation_prompt=False))
    assert a.public_prefix_tokens == prefix_len == b.public_prefix_tokens
    n_public = prefix_len // 16
    assert n_public >= 2
    assert a.block_hashes[:n_public] == b.block_hashes[:n_public]
    assert a.block_hashes[:n_public] == block_hashes(a.token_ids[: n_public * 16], 16, PUBLIC_NAMESPACE)
    assert a.block_hashes[n_public:] != b.block_hashes[n_public:]
    # Without the setting nothing is shared; a different system prompt never matches.
    private = _client()
    assert not set(private.build_request(msgs, tenant="tenantA").block_hashes) & set(
        private.build_request(msgs, tenant="tenantB").block_hashes
    )
    other = [ChatMessage("system", SYSTEM + "!"), ChatMessage("user", "hello there")]
    assert shared.build_request(other, tenant="tenantA").public_prefix_tokens == 0


def test_build_request_needs_exactly_one_prompt_form() -> None:
    c = _client()
    with pytest.raises(ValueError):
        c.build_request()
    with pytest.raises(ValueError):
        c.build_request([ChatMessage("user", "a")], token_ids=[1])


async def test_submit_before_start_is_an_error() -> None:
    c = _client()
    with pytest.raises(ClientError):
        await c.submit(c.build_request(token_ids=[1, 2, 3]))
    await c.stop()  # safe without start
    assert "password" not in repr(c)
