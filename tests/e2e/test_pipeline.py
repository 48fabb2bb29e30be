"""The whole pipeline on the embedded default: real broker, real Redis, every service a separate process.

A three-turn conversation goes through HTTP. Turn 2 reuses turn 1's blocks on the same worker; then
that worker is drained (it takes no new requests but still serves its KV blocks), so turn 3 runs on
the other worker, which fetches the blocks over the data plane. Every answer equals what a single
engine computing from scratch produces. Finally a worker is killed outright and the fleet keeps
answering from the survivor.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kvmesh.devstack import DevStack, DevStackSettings
from kvmesh_core.tokenizer import ByteTokenizer, ChatMessage, render_chat
from schemas.blocks import block_hashes, tenant_namespace
from schemas.messages import SamplingParams
from services.worker.engine import Engine, EngineConfig, EngineRequest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SYSTEM = "You are the kvmesh test assistant. Keep answers short. " * 3
QUESTIONS = ["What is a KV cache?", "Why reuse it across turns?", "And across workers?"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    logs: list[str] = []
    settings = DevStackSettings(workers=2, intake_port=0, log_level="INFO", gpu_blocks=512, dram_blocks=512)
    with DevStack(settings, sink=logs.append) as s:
        s.logs = logs  # type: ignore[attr-defined]
        yield s


def _greedy_from_scratch(messages: list[ChatMessage], max_tokens: int) -> str:
    """The answer a single fresh engine gives with nothing cached (the reference for every turn)."""
    tok = ByteTokenizer()
    ids = render_chat(tok, messages)
    ns = tenant_namespace("default")
    engine = Engine(EngineConfig(gpu_blocks=256, dram_blocks=0))
    engine.add_request(
        EngineRequest(
            request_id="ref",
            session_id="ref",
            token_ids=ids,
            block_hashes=block_hashes(ids, 16, ns),
            namespace=ns,
            max_tokens=max_tokens,
            sampling=SamplingParams(),
            stop_token_ids=[],
        )
    )
    out: list[int] = []
    while engine.has_work():
        for o in engine.step():
            out.extend(o.new_token_ids)
    return tok.decode([t for t in out if t < 256])


def _reference_answers() -> list[str]:
    """Each turn of the conversation computed from scratch (no cache reuse across turns)."""
    answers: list[str] = []
    history = [ChatMessage("system", SYSTEM)]
    for q in QUESTIONS:
        history.append(ChatMessage("user", q))
        text = _greedy_from_scratch(history, MAX_TOKENS)
        answers.append(text)
        history.append(ChatMessage("assistant", text))
    return answers


def _chat(
    url: str, messages: list[dict[str, str]], stream: bool = False, user: str = "alice"
) -> tuple[str, dict, httpx.Headers]:
    body = {
        "model": "kvmesh-tiny",
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "user": user,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
        text, last = "", {}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for ch in chunk.get("choices", []):
                    text += ch.get("delta", {}).get("content") or ""
                if chunk.get("usage"):
                    last = chunk
            return text, last, r.headers
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["message"]["content"], data, r.headers


def test_three_turns_reuse_then_fetch_from_peer_then_survive_a_killed_worker(stack: DevStack) -> None:
    expected = _reference_answers()
    url = stack.intake_url
    history = [{"role": "system", "content": SYSTEM}]

    # turn 1: nothing cached anywhere
    history.append({"role": "user", "content": QUESTIONS[0]})
    a1, d1, h1 = _chat(url, history)
    first_worker = d1["kvmesh"]["worker"]
    assert a1 == expected[0]
    assert d1["kvmesh"]["reused_tokens"] == 0 and d1["kvmesh"]["fetched_tokens"] == 0
    assert h1["x-kvmesh-worker"] == first_worker
    history.append({"role": "assistant", "content": a1})
    p1 = d1["usage"]["prompt_tokens"]

    # turn 2: the cached prefix stays on the worker that has it
    history.append({"role": "user", "content": QUESTIONS[1]})
    a2, d2, _ = _chat(url, history)
    assert a2 == expected[1]
    assert d2["kvmesh"]["worker"] == first_worker
    assert d2["kvmesh"]["reused_tokens"] >= (p1 // 16 - 1) * 16
    assert d2["usage"]["prompt_tokens_details"]["cached_tokens"] >= d2["kvmesh"]["reused_tokens"]
    history.append({"role": "assistant", "content": a2})

    # turn 3 (streamed): the first worker drains, so the other one serves it by fetching the blocks
    stack.set_drain(first_worker, True, reason="e2e test")
    history.append({"role": "user", "content": QUESTIONS[2]})
    a3, d3, h3 = _chat(url, history, stream=True)
    assert a3 == expected[2]
    assert h3["x-kvmesh-worker"] != first_worker
    details = d3["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] > 0
    assert d3["kvmesh"]["worker"] == h3["x-kvmesh-worker"]
    assert d3["kvmesh"]["fetched_tokens"] > 0

    # a worker killed outright in the middle of a request: the fleet declares it lost, the
    # scheduler re-decides the orphaned request, and the client still gets the whole, correct answer
    stack.set_drain(first_worker, False, reason="e2e test")
    long_msgs = [{"role": "user", "content": "Tell a long story about caches."}]
    want = _greedy_from_scratch([ChatMessage("user", long_msgs[0]["content"])], LONG_TOKENS)
    body = {
        "model": "kvmesh-tiny",
        "messages": long_msgs,
        "max_tokens": LONG_TOKENS,
        "temperature": 0,
        "user": "bob",
        "stream": True,
    }
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        victim = r.headers["x-kvmesh-worker"]
        stack.kill(victim)
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:]).get("choices", []):
                    text += ch.get("delta", {}).get("content") or ""
    assert text == want
    # the answer really was cut off on the victim and finished elsewhere
    logs = stack.logs  # type: ignore[attr-defined]
    assert any(f"worker {victim} lost with 1 requests in flight" in line for line in logs), logs[-40:]
    # and no later request is assigned to the dead worker
    for i in range(3):
        _, d, _ = _chat(url, [{"role": "user", "content": f"after the crash {i}"}], user=f"late-{i}")
        assert d["kvmesh"]["worker"] != victim


LONG_TOKENS = 1200
