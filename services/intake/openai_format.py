"""Response bodies in OpenAI's shapes: chat and legacy completions, whole or as stream chunks.

Each body also carries one extension field, ``kvmesh``, that says how the prompt was served.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh_core.tokenizer import Tokenizer
from schemas.messages import Completion, TokenLogprob
from services.intake.generation import ChoiceResult

#: What a log probability of minus infinity (a token the model may not generate) is written as: JSON
#: has no infinity, and OpenAI clients expect a number.
MIN_LOGPROB = -9999.0


def kvmesh_extension(c: Completion, session_id: str) -> dict[str, Any]:
    """The ``kvmesh`` field of one choice: where and how its prompt was served."""
    return {
        "request_id": c.request_id,
        "session_id": session_id,
        "worker": c.worker_id,
        "reused_tokens": c.reused_tokens,
        "fetched_tokens": c.fetched_tokens,
        "recomputed_tokens": c.recomputed_tokens,
        "ttft_ms": c.ttft_ms,
        "fallback": c.fallback,
    }


def kvmesh_body(results: Sequence[ChoiceResult], session_id: str) -> dict[str, Any]:
    """The first choice's extension; with several choices, each one's under ``choices``."""
    ext = kvmesh_extension(results[0].completion, session_id)
    if len(results) > 1:
        ext["choices"] = [kvmesh_extension(r.completion, session_id) for r in results]
    return ext


def usage(results: Sequence[ChoiceResult], n: int) -> dict[str, Any]:
    """Prompt tokens once per prompt (its n choices share it), completion tokens of every choice."""
    firsts = [r.completion for r in results if r.index % n == 0]
    completion = sum(r.completion_tokens for r in results)
    prompt = sum(c.prompt_tokens for c in firsts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.reused_tokens + c.fetched_tokens for c in firsts)},
    }


def _lp(v: float) -> float:
    return v if v > MIN_LOGPROB else MIN_LOGPROB


def _token(tok: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    text = tok.decode([token_id])
    return text, list(text.encode("utf-8"))


def chat_logprobs(tok: Tokenizer, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat completion: one entry per generated token."""
    content = []
    for lp in lps:
        text, raw = _token(tok, lp.token_id)
        top = []
        for tid, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
            t, b = _token(tok, tid)
            top.append({"token": t, "logprob": _lp(v), "bytes": b})
        content.append({"token": text, "logprob": _lp(lp.logprob), "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def legacy_logprobs(tok: Tokenizer, lps: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """``choices[].logprobs`` of a legacy completion (``text_offset`` counts from ``offset``)."""
    tokens, values, tops, offsets = [], [], [], []
    pos = offset
    for lp in lps:
        text, _ = _token(tok, lp.token_id)
        tokens.append(text)
        values.append(_lp(lp.logprob))
        tops.append({_token(tok, t)[0]: _lp(v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)})
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_chunk(
    completion_id: str,
    created: int,
    model: str,
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}],
    }


def legacy_chunk(
    completion_id: str,
    created: int,
    model: str,
    index: int,
    text: str,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}],
    }


def usage_chunk(
    completion_id: str, created: int, model: str, obj: str, body: dict[str, Any]
) -> dict[str, Any]:
    """The last chunk of a stream with ``include_usage``: no choices, the usage."""
    return {
        "id": completion_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": body,
    }


def models_body(model: str, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "kvmesh"}],
    }
