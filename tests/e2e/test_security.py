"""Tenant isolation and secret hygiene across the whole stack: real broker, Redis, every service a process.

Two tenants with their own API keys share one fleet. The same messages sent by both are different
blocks (no reuse, no fetch of the other tenant's blocks, as the assignments topic shows); only a
declared public system prompt is shared, and only its leading blocks. The block server of a real
worker refuses a wrong fleet secret, answers another tenant's blocks as absent and refuses a fetch over
its block limit; a tenant's prompt limit is a 400. No log line of any service and no record on any
topic carries the fleet secret or an API key.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvmesh.devstack import DevStack, DevStackSettings
from schemas.blocks import tenant_namespace
from schemas.codec import decode
from schemas.messages import Assignment, ChatRequest, LoadReport
from services.worker.kv_layout import BlockLayout
from services.worker.transfer import BlockClient, FailReason
from services.worker.transfer.memory import MemoryBlockStore
from streams import topics
from streams.consumer import TypedConsumer
from streams.recording import RawRecord, read_recording, record_topics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEY_A = "sk-tenant-a-4f1e9b27c3"
KEY_B = "sk-tenant-b-8d02a6e51f"
GUESSED_KEY = "sk-guessed-77aa31c0de"
PUBLIC_SYSTEM = "You are the Example Corp support assistant. Be brief, be kind, cite the manual. " * 2
PRIVATE_SYSTEM = "You are tenant A's private assistant for the quarterly numbers. " * 2
MAX_PROMPT_B = 400  # tenantB's prompt limit (tokens); tenantA has none
MAX_BLOCKS_PER_FETCH = 64
BLOCK = 16


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    logs: list[str] = []
    settings = DevStackSettings(
        workers=2,
        intake_port=0,
        api_keys=f"{KEY_A}:tenantA,{KEY_B}:tenantB",
        log_level="INFO",
        gpu_blocks=512,
        dram_blocks=512,
        extra_env={
            "KVMESH_INTAKE_PUBLIC_PREFIXES": json.dumps({"support": PUBLIC_SYSTEM}),
            "KVMESH_INTAKE_TENANT_MAX_PROMPT_TOKENS": json.dumps({"tenantB": MAX_PROMPT_B}),
            "KVMESH_MAX_BLOCKS_PER_FETCH": str(MAX_BLOCKS_PER_FETCH),
        },
    )
    with DevStack(settings, sink=logs.append) as s:
        s.logs = logs  # type: ignore[attr-defined]
        yield s


def _post(stack: DevStack, body: dict[str, Any], key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(f"{stack.intake_url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def _chat(
    stack: DevStack,
    key: str,
    messages: list[dict[str, str]],
    *,
    user: str | None = None,
    stream: bool = False,
) -> dict[str, Any]:
    """One completion; returns the final body (for a stream: the usage chunk) with its text as ``text``."""
    body: dict[str, Any] = {"model": "kvmesh-tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
    if user is not None:
        body["user"] = user
    if not stream:
        r = _post(stack, body, key)
        assert r.status_code == 200, r.text
        data = r.json()
        data["text"] = data["choices"][0]["message"]["content"]
        return data
    body.update(stream=True, stream_options={"include_usage": True})
    text, last = "", {}
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST", f"{stack.intake_url}/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text += "".join(c.get("delta", {}).get("content") or "" for c in chunk.get("choices", []))
                if chunk.get("usage"):
                    last = chunk
    last["text"] = text
    return last


def _record(stack: DevStack, specs: tuple[topics.TopicSpec, ...], path: Path) -> list[RawRecord]:
    """Every record of ``specs`` written so far, from the beginning, byte for byte."""
    asyncio.run(record_topics(stack.kafka, specs, path, idle_timeout_s=1.0))
    return list(read_recording(path))


def _messages(records: list[RawRecord], cls: type) -> list[Any]:
    out = []
    for rec in records:
        message = decode(rec.value).message
        if isinstance(message, cls):
            out.append(message)
    return out


def _requests_by_id(stack: DevStack, tmp_path: Path) -> dict[str, ChatRequest]:
    recs = _record(stack, (topics.REQUESTS,), tmp_path / "requests.rec")
    return {r.request_id: r for r in _messages(recs, ChatRequest)}


def _private_hashes(req: ChatRequest) -> list[int]:
    """The request's blocks that carry its tenant's salt (every block past the public prefix)."""
    return req.block_hashes[req.public_prefix_tokens // req.block_size :]


def test_same_messages_from_two_tenants_share_no_blocks(stack: DevStack, tmp_path: Path) -> None:
    history = [{"role": "system", "content": PRIVATE_SYSTEM}, {"role": "user", "content": "Q3 revenue?"}]
    a1 = _chat(stack, KEY_A, history, user="conv-1")
    assert a1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    b1 = _chat(stack, KEY_B, history, user="conv-1")  # the very same messages and session name
    assert b1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert b1["kvmesh"]["fetched_tokens"] == 0 and b1["kvmesh"]["reused_tokens"] == 0
    # A's own next turn still reuses A's blocks.
    history += [{"role": "assistant", "content": a1["text"]}, {"role": "user", "content": "And Q4?"}]
    a2 = _chat(stack, KEY_A, history, user="conv-1")
    assert (
        a2["usage"]["prompt_tokens_details"]["cached_tokens"]
        >= (a1["usage"]["prompt_tokens"] // BLOCK - 1) * BLOCK
    )
    assert a2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    requests = _requests_by_id(stack, tmp_path)
    ra, rb = requests[a1["kvmesh"]["request_id"]], requests[b1["kvmesh"]["request_id"]]
    assert (ra.tenant, rb.tenant) == ("tenantA", "tenantB")
    assert ra.token_ids == rb.token_ids and len(ra.block_hashes) >= 4
    assert ra.public_prefix_tokens == rb.public_prefix_tokens == 0
    assert not set(ra.block_hashes) & set(rb.block_hashes)
    assert ra.session_id != rb.session_id  # same "user" field, different tenants: different sessions

    # No assignment ever told a worker to fetch one of tenant A's blocks for a tenant B request.
    a_private = {h for r in requests.values() if r.tenant == "tenantA" for h in _private_hashes(r)}
    assignments = _messages(_record(stack, (topics.ASSIGNMENTS,), tmp_path / "asg.rec"), Assignment)
    b_assignments = [x for x in assignments if x.request.tenant == "tenantB"]
    assert rb.request_id in {x.request.request_id for x in b_assignments}
    for x in b_assignments:
        fetched = {h for plan in x.fetch for h in plan.block_hashes}
        assert not fetched & a_private, x.request.request_id
        assert not set(x.request.block_hashes) & a_private
        assert x.request.namespace == tenant_namespace("tenantB")
    assert a1["kvmesh"]["request_id"] in {x.request.request_id for x in assignments}


def test_declared_public_prefix_is_shared_only_for_its_leading_blocks(
    stack: DevStack, tmp_path: Path
) -> None:
    messages = [
        {"role": "system", "content": PUBLIC_SYSTEM},
        {"role": "user", "content": "Reset my password."},
    ]
    a = _chat(stack, KEY_A, messages)
    b = _chat(stack, KEY_B, messages)
    requests = _requests_by_id(stack, tmp_path)
    ra, rb = requests[a["kvmesh"]["request_id"]], requests[b["kvmesh"]["request_id"]]
    assert ra.token_ids == rb.token_ids
    assert ra.public_prefix_tokens == rb.public_prefix_tokens > 2 * BLOCK
    n_public = ra.public_prefix_tokens // BLOCK
    assert len(ra.block_hashes) > n_public  # there are private blocks after the shared ones
    assert ra.block_hashes[:n_public] == rb.block_hashes[:n_public]
    assert not set(ra.block_hashes[n_public:]) & set(rb.block_hashes)
    # B reuses (or fetches) exactly the public blocks A computed, nothing of A's own.
    cached_b = b["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached_b == n_public * BLOCK, b["kvmesh"]


def test_tenant_comes_from_the_key_and_bad_keys_get_401(stack: DevStack, tmp_path: Path) -> None:
    body = {"model": "kvmesh-tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    for key, headers in (
        (None, {}),
        (GUESSED_KEY, None),
        (None, {"Authorization": "Bearer"}),
        (None, {"Authorization": f"Basic {KEY_A}"}),
        (None, {"Authorization": KEY_A}),
    ):
        if headers is None:
            r = _post(stack, body, key)
        else:
            r = httpx.post(f"{stack.intake_url}/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (key, headers)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
        assert KEY_A not in r.text and GUESSED_KEY not in r.text
    assert httpx.get(f"{stack.intake_url}/v1/models", timeout=30).status_code == 401

    # B names tenant A everywhere it can in the body: still B's request, B's namespace, B's session.
    spoof = _chat(stack, KEY_B, [{"role": "user", "content": "I am tenantA, honest"}], user="tenantA")
    req = _requests_by_id(stack, tmp_path)[spoof["kvmesh"]["request_id"]]
    assert req.tenant == "tenantB" and req.namespace == tenant_namespace("tenantB")
    assert req.session_id.startswith("tenantB/")


def test_per_tenant_prompt_limit_is_a_clear_400(stack: DevStack) -> None:
    long = [{"role": "user", "content": "x" * (MAX_PROMPT_B + 50)}]
    body = {"model": "kvmesh-tiny", "messages": long, "max_tokens": 2}
    r = _post(stack, body, KEY_B)
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "messages")
    assert str(MAX_PROMPT_B) in err["message"]
    assert _post(stack, body, KEY_A).status_code == 200  # tenant A has no such limit


async def _load_reports(stack: DevStack) -> dict[str, LoadReport]:
    consumer = TypedConsumer(stack.kafka, [topics.LOAD], group_id=None, from_beginning=True, dedup=False)
    await consumer.start()
    reports: dict[str, LoadReport] = {}
    try:
        async with asyncio.timeout(30):
            while set(reports) < set(stack.worker_ids):
                for rec in await consumer.getmany(timeout_ms=500):
                    if isinstance(rec.message, LoadReport):
                        reports[rec.message.worker_id] = rec.message
    finally:
        await consumer.stop()
    return reports


def _worker_layout(stack: DevStack, worker_id: str) -> BlockLayout:
    """The KV layout a worker logged at start (``worker X up: ..., layout L4xH2xB16xD32:float32``)."""
    pattern = re.compile(rf"worker {worker_id} up: .*layout L(\d+)xH(\d+)xB(\d+)xD(\d+):(\w+)")
    for line in stack.logs:  # type: ignore[attr-defined]
        m = pattern.search(line)
        if m:
            layers, heads, bs, dim = (int(g) for g in m.groups()[:4])
            return BlockLayout(layers, heads, bs, dim, m.group(5))
    raise AssertionError(f"no layout line for {worker_id}")


async def _fetch(
    address: str, secret: bytes, hashes: list[int], namespace: bytes, layout: BlockLayout
) -> tuple[Any, MemoryBlockStore]:
    sink = MemoryBlockStore(layout)
    result = await BlockClient(secret, timeout_s=10).fetch(
        address, hashes, 0, namespace, sink, peer_id="test"
    )
    return result, sink


def test_real_block_server_checks_fleet_secret_namespace_and_fetch_size(
    stack: DevStack, tmp_path: Path
) -> None:
    messages = [{"role": "user", "content": "Tenant A's contract terms, clause by clause, please. " * 3}]
    a = _chat(stack, KEY_A, messages)
    req = _requests_by_id(stack, tmp_path)[a["kvmesh"]["request_id"]]
    worker = a["kvmesh"]["worker"]
    address = asyncio.run(_load_reports(stack))[worker].transfer_address
    layout = _worker_layout(stack, worker)
    hashes = req.block_hashes
    assert len(hashes) >= 4
    secret = stack.fleet_secret.encode()
    ns_a, ns_b = tenant_namespace("tenantA"), tenant_namespace("tenantB")

    async def scenario() -> None:
        # Control: with the fleet secret and A's namespace the blocks are there and arrive.
        ok, sink = await _fetch(address, secret, hashes, ns_a, layout)
        assert ok.received == hashes and len(sink.blocks) == len(hashes)
        wrong, sink = await _fetch(address, b"not-the-fleet-secret", hashes, ns_a, layout)
        assert wrong.error is FailReason.REFUSED and wrong.received == [] and wrong.bytes == 0
        assert not sink.blocks
        other, sink = await _fetch(address, secret, hashes, ns_b, layout)
        assert other.received == [] and other.failed[0] == (hashes[0], FailReason.NOT_FOUND)
        assert not sink.blocks and other.bytes == 0
        many = [*hashes, *range(1, MAX_BLOCKS_PER_FETCH + 2 - len(hashes))]
        too_many, sink = await _fetch(address, secret, many, ns_a, layout)
        assert (
            too_many.error is FailReason.TOO_MANY_BLOCKS
            and f"at most {MAX_BLOCKS_PER_FETCH}" in too_many.detail
        )
        assert not sink.blocks

    asyncio.run(scenario())


def test_no_secret_in_any_log_line_or_record(stack: DevStack, tmp_path: Path) -> None:
    # Every key in use, plus a guessed one, in plain and streamed requests.
    _chat(stack, KEY_A, [{"role": "user", "content": "secret hygiene, plain"}])
    _chat(stack, KEY_B, [{"role": "user", "content": "secret hygiene, streamed"}], stream=True)
    assert _post(stack, {"model": "kvmesh-tiny", "messages": []}, GUESSED_KEY).status_code == 401
    secrets = [stack.fleet_secret, KEY_A, KEY_B, GUESSED_KEY]
    records = _record(stack, topics.ALL_TOPICS, tmp_path / "all.rec")
    schemas = {decode(r.value).message.SCHEMA for r in records if r.topic != topics.DEAD_LETTER.name}
    # The recording holds the whole conversation flow, so the check below looks at real traffic.
    assert {"chat_request", "assignment", "token_chunk", "completion", "kv_event", "load_report"} <= schemas
    for secret in secrets:
        raw = secret.encode()
        for r in records:
            assert raw not in r.value and raw not in (r.key or b""), (r.topic, r.offset)
    logs = "\n".join(stack.logs)  # type: ignore[attr-defined]
    assert "[intake]" in logs and "[worker-0]" in logs and "[scheduler]" in logs and "[kvmanager]" in logs
    for secret in secrets:
        assert secret not in logs
