"""Two vLLM workers with the kvmesh KV connector behind the whole pipeline (real broker and Redis).

Worker A is drained after turn 1 of several conversations: their turn 2 runs on B, which fetches the
history's blocks from A's connector tiers over the data plane and loads them into vLLM. Then a peer
dies before B can fetch from it: B recomputes and nothing is lost. Every greedy answer equals vLLM's
own ``LLM.generate`` on the same token ids with nothing cached.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm")

from fleet_helpers import read_topic
from vllm_helpers import llm_generate

from kvmesh.devstack import DevStack, DevStackSettings
from kvmesh.modeldir import init_model_dir
from kvmesh_core.tokenizer import ChatMessage, HFTokenizer, render_chat
from schemas.messages import Completion
from streams import topics
from streams.consumer import TypedConsumer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BS = 32
CTX = 1024
MAX_TOKENS = 10
MODEL = "kvmesh-tiny-llama"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model_dir(tmp_path_factory.mktemp("vllm-conn") / "tiny-llama", seed=11)


@pytest.fixture(scope="module")
def stack(model_dir: Path) -> Iterator[DevStack]:
    logs: list[str] = []
    settings = DevStackSettings(
        workers=2,
        intake_port=0,
        engine="vllm",
        model=str(model_dir),
        max_context=CTX,
        gpu_blocks=256,
        dram_blocks=1024,
        ready_timeout_s=300,
        extra_env={"KVMESH_WORKER_DTYPE": "float32"},
    )
    with DevStack(settings, sink=logs.append) as s:
        s.logs = logs  # type: ignore[attr-defined]
        yield s


def _chat(stack: DevStack, user: str, messages: list[dict[str, str]]) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "user": user}
    r = httpx.post(f"{stack.intake_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _completions(stack: DevStack) -> dict[str, Completion]:
    return {m.request_id: m for m in read_topic(stack.kafka, topics.REPLIES) if isinstance(m, Completion)}


def _conversation(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"You are assistant number {i} of the kvmesh fleet. " * 4},
        {"role": "user", "content": f"Tell me about cache number {i}."},
    ]


def test_drained_workers_sessions_fetch_their_history_and_answer_the_same(
    stack: DevStack, model_dir: Path
) -> None:
    tok = HFTokenizer(model_dir)
    users = [f"user-{i}" for i in range(4)]
    turn1 = {u: _chat(stack, u, _conversation(i)) for i, u in enumerate(users)}
    placed: dict[str, list[str]] = {}
    for u, d in turn1.items():
        placed.setdefault(d["kvmesh"]["worker"], []).append(u)
    drained = max(placed, key=lambda w: (len(placed[w]), w))
    moved = placed[drained]
    time.sleep(1.5)  # kv-events of turn 1 reach the scheduler and the other worker
    stack.set_drain(drained, True, reason="connector test")

    prompts, results = [], []
    for u in moved:
        i = users.index(u)
        msgs = [
            *_conversation(i),
            {"role": "assistant", "content": turn1[u]["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Why fetch it?"},
        ]
        d = _chat(stack, u, msgs)
        p1 = render_chat(tok, [ChatMessage(**m) for m in _conversation(i)])
        p2 = render_chat(tok, [ChatMessage(**m) for m in msgs])
        assert d["usage"]["prompt_tokens"] == len(p2)
        k = d["kvmesh"]
        assert k["worker"] != drained
        assert k["fetched_tokens"] > 0, k
        # the history's blocks came from the peer: at most one block of it, the answer and the new turn
        # are computed (the answer is text again, re-tokenized by intake, so it may cut other blocks)
        assert k["recomputed_tokens"] <= BS + len(p2) - len(p1), k
        assert k["fetched_tokens"] + k["reused_tokens"] >= (len(p1) // BS) * BS
        prompts.append(p2)
        results.append(d["kvmesh"]["request_id"])
    stack.set_drain(drained, False, reason="connector test")

    done = _completions(stack)
    want = llm_generate(model_dir, prompts, MAX_TOKENS, block_size=BS, max_model_len=CTX)
    assert [list(done[rid].output_token_ids) for rid in results] == want


def test_a_hot_prefix_is_replicated_between_vllm_workers(stack: DevStack, model_dir: Path) -> None:
    """A ReplicateCommand makes one vLLM worker pull a run of another's blocks into its DRAM tier."""
    from schemas.blocks import block_hashes, tenant_namespace
    from schemas.messages import KvEvent, LoadReport, ReplicateCommand
    from streams.producer import TypedProducer

    tok = HFTokenizer(model_dir)
    convo = _conversation(7)
    d = _chat(stack, "hot", convo)
    source = d["kvmesh"]["worker"]
    target = next(w for w in stack.worker_ids if w != source)
    hashes = block_hashes(
        render_chat(tok, [ChatMessage(**m) for m in convo]), BS, tenant_namespace("default")
    )
    hashes = hashes[: len(hashes) - 1]

    async def run() -> set[int]:
        loads = TypedConsumer(stack.kafka, [topics.LOAD], group_id=None, from_beginning=True, dedup=False)
        await loads.start()
        address = ""
        try:
            while not address:
                for r in await loads.getmany(timeout_ms=300):
                    if isinstance(r.message, LoadReport) and r.message.worker_id == source:
                        address = r.message.transfer_address
        finally:
            await loads.stop()
        events = TypedConsumer(
            stack.kafka, [topics.KV_EVENTS], group_id=None, from_beginning=False, dedup=False
        )
        await events.start()
        got: set[int] = set()
        try:
            await events.positions()
            async with TypedProducer(stack.kafka, "test-replicate") as p:
                cmd = ReplicateCommand(
                    command_id="rep-1",
                    target_worker=target,
                    source_worker=source,
                    source_address=address,
                    block_hashes=hashes,
                    namespace=tenant_namespace("default"),
                )
                await p.send(topics.CONTROL, cmd)
            deadline = time.monotonic() + 30
            while not set(hashes) <= got and time.monotonic() < deadline:
                for r in await events.getmany(timeout_ms=300):
                    m = r.message
                    if (
                        isinstance(m, KvEvent)
                        and m.worker_id == target
                        and m.kind == "stored"
                        and m.tier == "dram"
                    ):
                        got |= set(m.block_hashes)
        finally:
            await events.stop()
        return got

    assert set(hashes) <= asyncio.run(run())


def test_a_peer_that_dies_before_the_fetch_means_recompute_and_the_same_answer(
    stack: DevStack, model_dir: Path
) -> None:
    tok = HFTokenizer(model_dir)
    convo = _conversation(99)
    d1 = _chat(stack, "doomed", convo)
    victim = d1["kvmesh"]["worker"]
    time.sleep(1.5)
    # drained first, so the scheduler plans a fetch from it rather than sending the turn there
    stack.set_drain(victim, True, reason="about to die")
    stack.kill(victim)
    msgs = [*convo, {"role": "assistant", "content": d1["choices"][0]["message"]["content"]}]
    msgs.append({"role": "user", "content": "Still there?"})
    d2 = _chat(stack, "doomed", msgs)
    k = d2["kvmesh"]
    assert k["worker"] != victim and k["fetched_tokens"] == 0
    assert k["fallback"] and victim in k["fallback"], k  # the fetch was planned and failed
    p2 = render_chat(tok, [ChatMessage(**m) for m in msgs])
    got = _completions(stack)[k["request_id"]]
    assert [list(got.output_token_ids)] == llm_generate(
        model_dir, [p2], MAX_TOKENS, block_size=BS, max_model_len=CTX
    )
