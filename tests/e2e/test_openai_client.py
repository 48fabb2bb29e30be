"""The official ``openai`` client (sync, async, streaming) against a real stack of the built-in engine.

Every field the OpenAI API defines is either honoured (checked here by what it does to the output) or
refused with a 400 that names it; nothing is accepted and ignored. Broker, Redis, KV manager,
scheduler, intake and two workers run as processes (``kvmesh dev``).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvmesh.devstack import DevStack, DevStackSettings

pytestmark = [pytest.mark.integration]

MODEL = "kvmesh-tiny"
KEY = "sk-openai-test-0001"
MSG = [{"role": "user", "content": "Tell me about the fleet and its cache, in a few words."}]


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    logs: list[str] = []
    settings = DevStackSettings(
        workers=2, intake_port=0, gpu_blocks=512, dram_blocks=512, api_keys=f"{KEY}:acme"
    )
    with DevStack(settings, sink=logs.append) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: DevStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.intake_url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _greedy(client: openai.OpenAI, tokens: int = 24, **kw: object) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=tokens, temperature=0, **kw)  # type: ignore[call-overload, no-any-return]


def test_logprobs_have_openai_shape_and_their_top_token_is_the_greedy_token(client: openai.OpenAI) -> None:
    plain = _greedy(client)
    r = _greedy(client, logprobs=True, top_logprobs=3)
    choice = r.choices[0]
    assert choice.message.content == plain.choices[0].message.content  # logprobs change no output
    assert choice.logprobs is not None and choice.logprobs.content
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy: the most likely token is the one chosen
        assert math.isclose(t.top_logprobs[0].logprob, t.logprob, abs_tol=1e-5)
        assert [x.logprob for x in t.top_logprobs] == sorted(
            (x.logprob for x in t.top_logprobs), reverse=True
        )
        assert t.logprob <= 0 and bytes(t.bytes or []).decode() == t.token
    # logprobs without top_logprobs: the chosen token only
    r0 = _greedy(client, tokens=6, logprobs=True)
    assert r0.choices[0].logprobs is not None
    assert all(t.top_logprobs == [] for t in r0.choices[0].logprobs.content or [])


def test_stop_cuts_at_the_first_match_streamed_and_not(client: openai.OpenAI) -> None:
    full = _greedy(client, tokens=40).choices[0].message.content or ""
    # a stop string taken from the middle of the greedy output (2 chars, first occurrence)
    stop = full[10:12]
    cut = full[: full.index(stop)]
    r = _greedy(client, tokens=40, stop=[stop, "never-occurs"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens < 40  # the worker stopped decoding
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MSG,
        max_tokens=40,
        temperature=0,
        stop=stop,
        stream=True,  # type: ignore[arg-type]
    )
    parts, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(parts) == cut and reasons[-1] == "stop"
    assert all(stop not in p for p in parts)


def test_n_choices_seed_and_penalties(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "messages": MSG, "max_tokens": 16, "temperature": 1.0, "seed": 7}
    a = client.chat.completions.create(n=3, **kw)  # type: ignore[call-overload]
    b = client.chat.completions.create(n=3, **kw)  # type: ignore[call-overload]
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]  # seeded: repeatable
    assert len(set(texts)) > 1  # n samples, not n copies
    assert a.usage is not None and a.usage.completion_tokens == 3 * 16
    # a strong presence penalty changes the greedy output (tokens already used get less likely)
    plain = _greedy(client, tokens=32).choices[0].message.content or ""
    pen = (
        _greedy(client, tokens=32, presence_penalty=2.0, frequency_penalty=2.0).choices[0].message.content
        or ""
    )
    assert pen != plain
    assert len(set(pen)) >= len(set(plain))
    rep = _greedy(client, tokens=32, extra_body={"repetition_penalty": 1.8}).choices[0].message.content
    assert rep != plain


def test_min_tokens_ignore_eos_and_max_completion_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSG,
        max_completion_tokens=9,
        temperature=0,
        extra_body={"min_tokens": 9, "ignore_eos": True},
    )
    assert r.usage is not None and r.usage.completion_tokens == 9 and r.choices[0].finish_reason == "length"


def test_fields_not_honoured_are_refused_with_a_400_that_names_them(client: openai.OpenAI) -> None:
    cases = [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
            "tools",
        ),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"extra_body": {"best_of_all": 2}}, "best_of_all"),
        ({"extra_body": {"top_k": 5}}, "top_k"),
        ({"n": 99}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            _greedy(client, tokens=4, **kw)
        err = info.value.body
        assert isinstance(err, dict) and err.get("param") == param, (kw, err)
        assert info.value.status_code == 400 and err.get("type") == "invalid_request_error"
    # a value that asks for nothing is accepted
    assert _greedy(client, tokens=4, store=False, logit_bias={}).choices[0].message.content is not None


def test_errors_keep_openai_shape(client: openai.OpenAI, stack: DevStack) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=MSG)
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.intake_url}/v1", api_key="sk-bad", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as long:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=10**6)
    assert long.value.code == "context_length_exceeded"
    r = httpx.post(f"{stack.intake_url}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"}, json={})
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_legacy_completions_streamed_and_not(client: openai.OpenAI) -> None:
    prompt = "The fleet cache"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    text = r.choices[0].text
    assert r.object == "text_completion" and r.usage is not None and r.usage.completion_tokens == 12
    lp = r.choices[0].logprobs
    assert lp is not None and "".join(lp.tokens or []) == text
    assert all(len(t) == 2 for t in lp.top_logprobs or [])
    assert lp.text_offset == [sum(len(t) for t in (lp.tokens or [])[:i]) for i in range(len(lp.tokens or []))]
    s = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in s:
        parts += [c.text for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(parts) == text and usage is not None and usage.prompt_tokens == r.usage.prompt_tokens
    # a batch of prompts x n, echo, and token-id prompts
    b = client.completions.create(
        model=MODEL, prompt=[prompt, "Other"], n=2, max_tokens=4, temperature=0, echo=True
    )
    assert [c.index for c in b.choices] == [0, 1, 2, 3]
    assert b.choices[0].text == prompt + text[: len(b.choices[0].text) - len(prompt)]
    assert b.choices[2].text.startswith("Other")
    ids = client.completions.create(model=MODEL, prompt=[[256, 72, 105]], max_tokens=3, temperature=0)
    assert ids.usage is not None and ids.usage.prompt_tokens == 3


def test_async_client_concurrent_streams_with_usage(stack: DevStack) -> None:
    async def main() -> list[tuple[str, int]]:
        client = openai.AsyncOpenAI(base_url=f"{stack.intake_url}/v1", api_key=KEY, max_retries=0)

        async def one(i: int) -> tuple[str, int]:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Question {i % 3} about blocks."}],
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                logprobs=True,
            )
            text, tokens = "", 0
            async for chunk in stream:
                for c in chunk.choices:
                    text += c.delta.content or ""
                    tokens += len(c.logprobs.content or []) if c.logprobs else 0
                if chunk.usage is not None:
                    assert chunk.usage.completion_tokens == tokens
            return text, tokens

        try:
            return await asyncio.gather(*(one(i) for i in range(9)))
        finally:
            await client.close()

    out = asyncio.run(main())
    assert all(n == 8 for _, n in out)
    for i in range(3):  # the same prompt, greedy: the same text wherever it ran
        assert len({out[j][0] for j in range(i, 9, 3)}) == 1


def test_usage_reports_cached_tokens_on_a_repeat(client: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": "Shared instructions for the cache test. " * 6}, *MSG]
    client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0, user="u-cache")  # type: ignore[arg-type]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=2, temperature=0, user="u-cache"
    )  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens and r.usage.prompt_tokens_details.cached_tokens > 0
    assert json.loads(r.model_dump_json())["kvmesh"]["worker"].startswith("worker-")
