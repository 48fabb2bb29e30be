"""A vLLM worker behind the whole pipeline: ``kvmesh dev --engine vllm --model DIR`` as a process tree.

Real broker, real Redis, KV manager, scheduler, intake, and one worker running vLLM's CPU build on a
model from ``kvmesh model init``. What the fleet sees of vLLM's cache must be exactly what intake
computed: the scheduler's index (the scheduler's own FleetView, fed the same kv-events topic) and the
Redis directory (``kvmesh directory``) hold the prompt's blocks under intake's hashes, turn 2 reports
vLLM's cached-token count, another tenant reuses nothing, and bad input gets clear errors while the
worker keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("vllm")

from fleet_helpers import read_topic

from kvmesh.devstack import DevStack, DevStackSettings
from kvmesh.modeldir import init_model_dir
from kvmesh_client import KvmeshClient
from kvmesh_core.tokenizer import ChatMessage, HFTokenizer, render_chat
from schemas.blocks import block_hashes, tenant_namespace
from schemas.messages import Completion, KvEvent, LoadReport
from services.scheduler.view import FleetView
from streams import topics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BS = 32
CTX = 1024
KEYS = "sk-tenant-a-000001:acme,sk-tenant-b-000002:globex"
KEY_A, KEY_B = "sk-tenant-a-000001", "sk-tenant-b-000002"
SYSTEM = "You are the assistant of the kvmesh fleet; answer in short sentences. " * 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model_dir(tmp_path_factory.mktemp("vllm-fleet") / "tiny-llama", seed=3)


@pytest.fixture(scope="module")
def stack(model_dir: Path) -> Iterator[DevStack]:
    logs: list[str] = []
    settings = DevStackSettings(
        workers=1,
        intake_port=0,
        engine="vllm",
        model=str(model_dir),
        max_context=CTX,
        gpu_blocks=256,
        api_keys=KEYS,
        ready_timeout_s=240,
    )
    with DevStack(settings, sink=logs.append) as s:
        s.logs = logs  # type: ignore[attr-defined]
        yield s


def _chat(stack: DevStack, key: str, messages: list[dict[str, str]], max_tokens: int = 10) -> dict:
    r = httpx.post(
        f"{stack.intake_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "kvmesh-tiny-llama", "messages": messages, "max_tokens": max_tokens, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _index(stack: DevStack) -> FleetView:
    """The scheduler's index as the scheduler builds it: its FleetView fed the kv-events and load topics."""
    view = FleetView(BS)
    for m in read_topic(stack.kafka, topics.LOAD, 0.5, max_s=3.0):
        if isinstance(m, LoadReport):
            view.apply_load(m)
    for m in read_topic(stack.kafka, topics.KV_EVENTS):
        if isinstance(m, KvEvent):
            view.apply_kv_event(m)
    return view


def _completion(stack: DevStack, request_id: str) -> Completion:
    for m in read_topic(stack.kafka, topics.REPLIES, 0.5):
        if isinstance(m, Completion) and m.request_id == request_id:
            return m
    raise AssertionError(f"no Completion for {request_id}")


def _directory(stack: DevStack, hashes: list[int]) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "directory",
            "--redis",
            stack.redis_settings.url,
            "--json",
            "--hashes",
            ",".join(str(h) for h in hashes),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_two_turns_on_vllm_with_the_fleet_indexing_exactly_intakes_blocks(
    stack: DevStack, model_dir: Path
) -> None:
    tok = HFTokenizer(model_dir)
    ns = tenant_namespace("acme")
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a KV cache?"}]
    d1 = _chat(stack, KEY_A, turn1)
    assert d1["kvmesh"]["worker"] == "worker-0"
    assert d1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    p1 = render_chat(tok, [ChatMessage(**m) for m in turn1])
    assert d1["usage"]["prompt_tokens"] == len(p1)  # intake rendered the model's own chat template
    out1 = list(_completion(stack, d1["kvmesh"]["request_id"]).output_token_ids)
    computed = block_hashes(p1 + out1, BS, ns)[: (len(p1) + len(out1) - 1) // BS]

    # the scheduler's index and the directory hold exactly the blocks intake computed, on worker-0
    time.sleep(1.0)
    view = _index(stack)
    held = {h for h, _parent, holders in view.index.items() if "worker-0" in holders}
    assert held == set(computed)
    assert [view.index.parent(h) for h in computed] == [0, *computed[:-1]]
    assert all(view.index.holders(h) == {"worker-0": "gpu"} for h in computed)
    rep = _directory(stack, computed)
    assert rep["leading_blocks_held"] == {"worker-0": len(computed)}
    assert rep["workers"]["worker-0"]["blocks_by_tier"] == {"gpu": len(computed)}
    assert rep["total_blocks"] == len(computed)

    # turn 2 reuses what vLLM says it reused: the leading blocks of its prompt that turn 1 computed
    turn2 = [
        *turn1,
        {"role": "assistant", "content": d1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Why keep it between turns?"},
    ]
    d2 = _chat(stack, KEY_A, turn2)
    p2 = render_chat(tok, [ChatMessage(**m) for m in turn2])
    h2 = block_hashes(p2, BS, ns)
    shared = 0
    while shared < min(len(h2), (len(p2) - 1) // BS) and h2[shared] in set(computed):
        shared += 1
    assert shared >= len(p1) // BS > 0
    cached = d2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == d2["kvmesh"]["reused_tokens"] == shared * BS
    assert d2["kvmesh"]["worker"] == "worker-0" and d2["kvmesh"]["fetched_tokens"] == 0

    # tenant B sends tenant A's first prompt word for word: vLLM reuses nothing across the salt
    d3 = _chat(stack, KEY_B, turn1)
    assert d3["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert d3["choices"][0]["message"]["content"] == d1["choices"][0]["message"]["content"]


def test_streaming_sampling_and_a_client_disconnect_that_aborts_in_vllm(stack: DevStack) -> None:
    url = f"{stack.intake_url}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {KEY_A}"}
    msgs = [{"role": "user", "content": "Stream me a story."}]
    base = {"model": "kvmesh-tiny-llama", "messages": msgs, "max_tokens": 12}
    # streamed greedy text equals the non-streamed answer
    plain = httpx.post(url, headers=auth, json={**base, "temperature": 0}, timeout=60).json()
    text = ""
    with httpx.stream(
        "POST", url, headers=auth, json={**base, "temperature": 0, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:]).get("choices", []):
                    text += ch.get("delta", {}).get("content") or ""
    assert text == plain["choices"][0]["message"]["content"]
    # sampled decoding: the same seed samples the same tokens
    hot = {**base, "temperature": 1.0, "top_p": 0.9, "seed": 1234}
    s1 = httpx.post(url, headers=auth, json=hot, timeout=60).json()["choices"][0]["message"]["content"]
    s2 = httpx.post(url, headers=auth, json=hot, timeout=60).json()["choices"][0]["message"]["content"]
    assert s1 == s2
    # a client that goes away after the first chunk: the request is aborted in vLLM, not decoded on
    long = {**base, "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.stream("POST", url, headers=auth, json=long, timeout=60) as r:
        rid = r.headers["x-kvmesh-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 30
    while True:
        done = [
            m
            for m in read_topic(stack.kafka, topics.REPLIES, 0.5)
            if isinstance(m, Completion) and m.request_id == rid
        ]
        if done or time.monotonic() > deadline:
            break
    assert done and done[0].finish_reason == "cancelled" and done[0].completion_tokens < 900


def _openai(stack: DevStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.intake_url}/v1", api_key=KEY_A, max_retries=0, timeout=120)


def test_structured_output_passes_through_to_vllm(stack: DevStack) -> None:
    client = _openai(stack)
    msgs = [{"role": "user", "content": "Describe the cache as JSON."}]
    base = {"model": "kvmesh-tiny-llama", "messages": msgs, "temperature": 0, "max_tokens": 200}
    # json_object: any object. A model of random weights rarely closes one (its keys are free text),
    # so eight sampled choices: every one that ends on its own is a JSON object, the rest are cut
    # objects (finish "length").
    r = client.chat.completions.create(  # type: ignore[call-overload]
        response_format={"type": "json_object"},
        **{**base, "temperature": 1.0, "seed": 0, "max_tokens": 48, "n": 8},
    )
    done = [c for c in r.choices if c.finish_reason == "stop"]
    assert done, [c.message.content for c in r.choices]
    assert all(isinstance(json.loads(c.message.content or ""), dict) for c in done)
    assert all((c.message.content or "").startswith("{") for c in r.choices)
    schema = {
        "type": "object",
        "properties": {"blocks": {"type": "integer"}, "tier": {"enum": ["gpu", "dram", "disk"]}},
        "required": ["blocks", "tier"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "cache", "schema": schema}}
    r = client.chat.completions.create(response_format=fmt, **base)  # type: ignore[call-overload]
    obj = json.loads(r.choices[0].message.content or "")
    assert (
        set(obj) == {"blocks", "tier"}
        and isinstance(obj["blocks"], int)
        and obj["tier"] in schema["properties"]["tier"]["enum"]
    )  # type: ignore[index]
    # streamed, the same constrained text arrives in pieces
    stream = client.chat.completions.create(response_format=fmt, stream=True, **base)  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert json.loads(text) == obj


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_block",
            "description": "Look up a KV block.",
            "parameters": {
                "type": "object",
                "properties": {"hash": {"type": "integer", "minimum": 0, "maximum": 4095}},
                "required": ["hash"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "drain",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]


def test_tool_calls_are_honoured_on_vllm(stack: DevStack) -> None:
    client = _openai(stack)
    msgs = [{"role": "user", "content": "Which block holds my prompt?"}]
    base = {
        "model": "kvmesh-tiny-llama",
        "messages": msgs,
        "temperature": 0,
        "max_tokens": 120,
        "tools": TOOLS,
    }
    # A random-weight model may emit calls until max_tokens; one call (parallel_tool_calls false) and
    # closed schemas bound what it can write.
    r = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **base)  # type: ignore[call-overload]
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls, r.choices[0]
    for call in calls:
        assert call.function.name in ("get_block", "drain") and call.id and call.type == "function"
        args = json.loads(call.function.arguments)
        if call.function.name == "get_block":
            assert set(args) == {"hash"} and isinstance(args["hash"], int)
    named = {"type": "function", "function": {"name": "get_block"}}
    r = client.chat.completions.create(tool_choice=named, **base)  # type: ignore[call-overload]
    [call] = r.choices[0].message.tool_calls or [None]  # type: ignore[list-item]
    assert call is not None, r.choices[0]
    assert call.function.name == "get_block" and isinstance(json.loads(call.function.arguments)["hash"], int)
    assert r.choices[0].message.content is None
    # the call goes back into the history with its result, and the template renders both
    history = [
        *msgs,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "block 7 on worker-0"},
    ]
    r = client.chat.completions.create(**{**base, "messages": history, "tool_choice": "none"})  # type: ignore[call-overload]
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    # streamed: the call arrives as tool_calls deltas
    stream = client.chat.completions.create(tool_choice=named, stream=True, **base)  # type: ignore[call-overload]
    deltas = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function is not None and deltas[0].function.name == "get_block"


def test_logprobs_stop_and_the_openai_client_on_vllm(stack: DevStack) -> None:
    client = _openai(stack)
    msgs = [{"role": "user", "content": "Say something about tokens."}]
    base = {"model": "kvmesh-tiny-llama", "messages": msgs, "temperature": 0, "max_tokens": 16}
    r = client.chat.completions.create(logprobs=True, top_logprobs=2, **base)  # type: ignore[call-overload]
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    for t in content:
        # greedy: the chosen token is the most likely (a tie may list another first)
        assert len(t.top_logprobs) == 2 and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4
        assert t.token in {x.token for x in t.top_logprobs if abs(x.logprob - t.logprob) < 1e-4}
    text = r.choices[0].message.content or ""
    stop = text[6:8]
    cut = client.chat.completions.create(stop=[stop], **base)  # type: ignore[call-overload]
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_vllm_bench_serve_runs_against_kvmesh_with_no_failures(stack: DevStack, model_dir: Path) -> None:
    from kvmesh.bench.serve import vllm_bench_serve

    for backend in ("openai-chat", "openai"):
        result = vllm_bench_serve(
            stack.intake_url,
            "kvmesh-tiny-llama",
            str(model_dir),
            backend=backend,
            num_prompts=12,
            input_len=96,
            output_len=8,
            max_concurrency=4,
            api_key=KEY_A,
        )
        assert result["completed"] == 12 and result["failed"] == 0, result.get("errors")
        assert result["median_ttft_ms"] > 0
        assert "/tokenize unavailable" not in result["stdout"]


def test_over_long_prompt_gets_a_clear_error_and_the_worker_serves_on(
    stack: DevStack, model_dir: Path
) -> None:
    async def run() -> tuple[Completion, Completion]:
        client = KvmeshClient(
            stack.kafka,
            client_id="test-long",
            block_size=BS,
            tokenizer=HFTokenizer(model_dir),
            model="kvmesh-tiny-llama",
        )
        async with client:
            # past the worker's context (intake would refuse it; a producer may not)
            long = client.build_request(token_ids=[5] * (CTX + 40), tenant="acme", max_tokens=4)
            bad = await (await client.submit(long)).result(timeout=60)
            ok_req = client.build_request(
                [ChatMessage("user", "still serving?")], tenant="acme", max_tokens=4
            )
            ok = await (await client.submit(ok_req)).result(timeout=60)
            return bad, ok

    bad, ok = asyncio.run(run())
    assert bad.finish_reason == "error" and "does not fit the context" in (bad.error or "")
    assert ok.finish_reason == "length" and ok.completion_tokens == 4


def test_a_worker_with_another_block_size_is_refused_at_announce(stack: DevStack) -> None:
    env = dict(stack._env)
    env.update(
        {
            "KVMESH_WORKER_ENGINE": "builtin",
            "KVMESH_WORKER_MODEL": "tiny",
            "KVMESH_WORKER_BLOCK_SIZE": "16",
            "KVMESH_WORKER_SERVED_MODEL_NAME": "kvmesh-tiny-llama",  # same model name: only the size differs
            "KVMESH_WORKER_CALIBRATE": "0",
        }
    )
    stack._spawn("worker-bs16", ["-m", "services.worker", "--worker-id", "worker-bs16"], env)
    logs = stack.logs  # type: ignore[attr-defined]
    deadline = time.monotonic() + 90
    want = "worker worker-bs16 announces block size 16, the fleet's is 32"
    while not any(want in line and line.startswith("[scheduler]") for line in logs):
        assert time.monotonic() < deadline, logs[-30:]
        time.sleep(0.5)
    assert any(want in line and line.startswith("[kvmanager]") for line in logs)
    # requests keep going to the worker of the right size
    for i in range(3):
        d = _chat(stack, KEY_A, [{"role": "user", "content": f"who serves {i}?"}], max_tokens=2)
        assert d["kvmesh"]["worker"] == "worker-0"
    stack.children["worker-bs16"].terminate()


def test_a_missing_model_directory_stops_the_worker_with_a_clear_error(tmp_path: Path) -> None:
    env = dict(
        os.environ, KVMESH_WORKER_INSECURE_DEV_TRANSFER="1", KVMESH_KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:9"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.worker",
            "--engine",
            "vllm",
            "--model",
            str(tmp_path / "no-such-model"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 2
    assert "neither a built-in size" in out.stderr and "no-such-model" in out.stderr
    assert "Traceback" not in out.stderr
