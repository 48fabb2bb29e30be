"""Workload generators: timed :class:`~schemas.messages.ChatRequest` streams for the simulator and benches.

Every generator yields real ChatRequests in arrival order (``arrival_ms`` non-decreasing), with
``block_hashes`` computed by :func:`schemas.blocks.block_hashes` over the request's token ids, so the
scheduler sees exactly what intake would publish. ``max_tokens`` is the request's output length (the
simulator generates exactly that many tokens).

Shapes:

* :func:`multiturn` -- LMCache / vLLM multi-round QA: ``users`` conversations, each prompt is the shared
  system prompt, the user's own history, every earlier question and answer, then the new question::

      round r prompt:  SYS(s) | HIST_u(h) | q0 a0 | q1 a1 | ... | q_r        (answer a_r: max_tokens)

* :func:`shared_prefix` -- SGLang "generated shared prefix": ``groups`` long prefixes, each followed by
  ``per_group`` different questions, arrivals shuffled.
* :func:`mooncake_trace` -- Mooncake-format JSON lines (``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids`` of ``trace_block_size``-token blocks). The same hash id means the same
  block of tokens: block ``i``'s tokens are a fixed function of its id (:func:`tokens_for_id`), so equal
  ids give equal tokens, and because the trace's ids are prefix-chained, equal chained hashes follow.
  Pass ``block_size == trace_block_size`` (512, what the simulator does for traces) to get one request
  block per trace id; a smaller block size cuts each trace block into several.
* :func:`azure_trace` -- Azure LLM inference CSV (``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``):
  no prefix information, so every prompt is unique tokens.

Randomness is seeded (``numpy.random.default_rng(seed)``); the same arguments give the same requests.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh_core.errors import KvmeshError
from schemas.blocks import DEFAULT_BLOCK_SIZE
from schemas.chat_requests import chat_request
from schemas.messages import ChatRequest

#: Token ids synthesized by the generators stay below this (a Llama-sized vocabulary).
VOCAB_SIZE = 32000

#: Tokens per hash id in Mooncake traces.
MOONCAKE_BLOCK_SIZE = 512


class WorkloadError(KvmeshError):
    """A trace file cannot be read, or a workload's parameters are inconsistent."""


def make_request(
    request_id: str,
    session_id: str,
    tenant: str,
    tokens: np.ndarray,
    max_tokens: int,
    arrival_ms: int,
    block_size: int,
    public_prefix_tokens: int = 0,
) -> ChatRequest:
    """A ChatRequest with the block hashes intake would compute for ``tokens``."""
    return chat_request(
        tokens,
        request_id=request_id,
        session_id=session_id,
        tenant=tenant,
        block_size=block_size,
        max_tokens=max(1, int(max_tokens)),
        arrival_ms=int(arrival_ms),
        public_prefix_tokens=public_prefix_tokens,
    )


def _random_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB_SIZE, size=max(n, 0), dtype=np.int64)


# ---------------------------------------------------------------------------------------------- multi-turn


@dataclass(frozen=True, slots=True)
class MultiTurnSpec:
    """Shape of a multi-round QA workload; lengths in tokens, ``qps`` in requests per second.

    Requests cycle over users (user 0 round 0, user 1 round 0, ..., user 0 round 1, ...) at ``qps``,
    so a user's next round arrives ``users / qps`` seconds after the previous one, as in LMCache's
    multi-round QA benchmark.
    """

    users: int = 8
    rounds: int = 4
    system_prompt_tokens: int = 1024
    history_tokens: int = 512
    question_tokens: int = 64
    answer_tokens: int = 64
    qps: float = 4.0
    tenants: int = 1
    seed: int = 0


def multiturn(spec: MultiTurnSpec, block_size: int = DEFAULT_BLOCK_SIZE) -> Iterator[ChatRequest]:
    """Yield the rounds of ``spec.users`` conversations in arrival order.

    The system prompt is declared public (``public_prefix_tokens``) so tenants share its blocks.
    """
    if spec.users < 1 or spec.rounds < 1 or spec.qps <= 0:
        raise WorkloadError("multiturn needs users >= 1, rounds >= 1 and qps > 0")
    rng = np.random.default_rng(spec.seed)
    system = _random_tokens(rng, spec.system_prompt_tokens)
    # Each user's context so far (system prompt + history + earlier questions and answers).
    contexts = [np.concatenate([system, _random_tokens(rng, spec.history_tokens)]) for _ in range(spec.users)]
    gap_ms = 1000.0 / spec.qps
    k = 0
    for r in range(spec.rounds):
        for u in range(spec.users):
            question = _random_tokens(rng, spec.question_tokens)
            prompt = np.concatenate([contexts[u], question])
            tenant = f"tenant-{u % max(spec.tenants, 1)}"
            yield make_request(
                request_id=f"mt-u{u}-r{r}",
                session_id=f"mt-u{u}",
                tenant=tenant,
                tokens=prompt,
                max_tokens=spec.answer_tokens,
                arrival_ms=round(k * gap_ms),
                block_size=block_size,
                public_prefix_tokens=spec.system_prompt_tokens,
            )
            contexts[u] = np.concatenate([prompt, _random_tokens(rng, spec.answer_tokens)])
            k += 1


# ------------------------------------------------------------------------------------------- shared prefix


@dataclass(frozen=True, slots=True)
class SharedPrefixSpec:
    """Shape of SGLang's generated-shared-prefix workload; lengths in tokens."""

    groups: int = 8
    per_group: int = 16
    prefix_tokens: int = 2048
    question_tokens: int = 128
    output_tokens: int = 64
    qps: float = 8.0
    seed: int = 0


def shared_prefix(spec: SharedPrefixSpec, block_size: int = DEFAULT_BLOCK_SIZE) -> Iterator[ChatRequest]:
    """Yield ``groups * per_group`` requests, each a group prefix plus its own question, shuffled."""
    if spec.groups < 1 or spec.per_group < 1 or spec.qps <= 0:
        raise WorkloadError("shared_prefix needs groups >= 1, per_group >= 1 and qps > 0")
    rng = np.random.default_rng(spec.seed)
    prefixes = [_random_tokens(rng, spec.prefix_tokens) for _ in range(spec.groups)]
    order = [(g, i) for g in range(spec.groups) for i in range(spec.per_group)]
    rng.shuffle(order)
    gap_ms = 1000.0 / spec.qps
    for k, (g, i) in enumerate(order):
        prompt = np.concatenate([prefixes[g], _random_tokens(rng, spec.question_tokens)])
        yield make_request(
            request_id=f"sp-g{g}-{i}",
            session_id=f"sp-g{g}-{i}",
            tenant="tenant-0",
            tokens=prompt,
            max_tokens=spec.output_tokens,
            arrival_ms=round(k * gap_ms),
            block_size=block_size,
        )


# ------------------------------------------------------------------------------------------ Mooncake trace

# Odd 62-bit multipliers of a multiplicative hash; any fixed odd constants would do.
_ID_MUL = 0x9E3779B97F4A7C15 & ((1 << 62) - 1)
_POS_MUL = 0xC2B2AE3D27D4EB4F & ((1 << 62) - 1)


def tokens_for_id(hash_ids: np.ndarray, trace_block_size: int = MOONCAKE_BLOCK_SIZE) -> np.ndarray:
    """The tokens of trace blocks ``hash_ids``: shape ``(len(hash_ids) * trace_block_size,)``.

    A fixed function of (id, position in block), so equal ids give equal tokens and different ids give
    different blocks (with overwhelming probability); vectorized because traces hold ~10^5 blocks.
    """
    ids = np.asarray(hash_ids, dtype=np.uint64).reshape(-1, 1) + np.uint64(1)
    pos = np.arange(trace_block_size, dtype=np.uint64).reshape(1, -1) + np.uint64(1)
    with np.errstate(over="ignore"):
        mixed = ids * np.uint64(_ID_MUL) ^ pos * np.uint64(_POS_MUL)
        mixed ^= mixed >> np.uint64(29)
    return (mixed % np.uint64(VOCAB_SIZE)).astype(np.int64).reshape(-1)


def read_mooncake(path: str | Path) -> Iterator[dict[str, Any]]:
    """The rows of a Mooncake-format JSON-lines file, checked for the fields the generator needs."""
    try:
        fh = open(path, encoding="utf-8")  # noqa: SIM115 -- closed by the with below, generator-friendly
    except OSError as exc:
        raise WorkloadError(f"cannot open trace {path}: {exc}") from exc
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                _ = int(row["timestamp"]), int(row["input_length"]), int(row["output_length"])
                if not isinstance(row["hash_ids"], list):
                    raise TypeError("hash_ids must be a list")
            except (ValueError, KeyError, TypeError) as exc:
                raise WorkloadError(f"{path}:{lineno}: not a Mooncake trace row: {exc}") from exc
            yield row


def mooncake_trace(
    path: str | Path,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    trace_block_size: int = MOONCAKE_BLOCK_SIZE,
    tenant: str = "trace",
) -> Iterator[ChatRequest]:
    """Replay a Mooncake trace as ChatRequests.

    ``time_scale`` multiplies every timestamp (0.5 = arrivals twice as fast, a heavier load). The prompt
    is the tokens of its hash ids cut to ``input_length`` (the last trace block is usually partial, and
    a partial block has no hash, as in the live system). One tenant for the whole trace, because the
    trace's ids are shared across its requests.
    """
    if time_scale <= 0:
        raise WorkloadError("time_scale must be positive")
    if trace_block_size % block_size and block_size % trace_block_size:
        raise WorkloadError("block_size and trace_block_size must divide one another")
    for i, row in enumerate(read_mooncake(path)):
        if max_requests is not None and i >= max_requests:
            return
        n_in = int(row["input_length"])
        ids = np.asarray(row["hash_ids"], dtype=np.int64)
        tokens = tokens_for_id(ids, trace_block_size)[:n_in]
        if tokens.size < n_in:  # ids cover less than input_length: pad with tokens unique to this row
            pad = tokens_for_id(np.asarray([-(i + 1)], dtype=np.int64), n_in - tokens.size)
            tokens = np.concatenate([tokens, pad])
        yield make_request(
            request_id=f"trace-{i}",
            session_id=f"trace-{i}",
            tenant=tenant,
            tokens=tokens,
            max_tokens=int(row["output_length"]),
            arrival_ms=round(int(row["timestamp"]) * time_scale),
            block_size=block_size,
        )


# --------------------------------------------------------------------------------------------- Azure trace


def _parse_azure_time(text: str) -> float:
    """Seconds since the epoch of '2023-11-16 18:17:03.9799600' (7 fraction digits: strptime refuses)."""
    whole, _, frac = text.strip().partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    return base.timestamp() + (float("0." + frac) if frac else 0.0)


def azure_trace(
    path: str | Path,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    seed: int = 0,
) -> Iterator[ChatRequest]:
    """Replay an Azure LLM inference CSV; arrivals relative to the first row, scaled by ``time_scale``."""
    if time_scale <= 0:
        raise WorkloadError("time_scale must be positive")
    rng = np.random.default_rng(seed)
    t0: float | None = None
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            for i, row in enumerate(csv.DictReader(fh)):
                if max_requests is not None and i >= max_requests:
                    return
                try:
                    t = _parse_azure_time(row["TIMESTAMP"])
                    n_in, n_out = int(row["ContextTokens"]), int(row["GeneratedTokens"])
                except (KeyError, ValueError, TypeError) as exc:
                    raise WorkloadError(f"{path}: row {i + 1}: not an Azure trace row: {exc}") from exc
                t0 = t if t0 is None else t0
                yield make_request(
                    request_id=f"azure-{i}",
                    session_id=f"azure-{i}",
                    tenant="trace",
                    tokens=_random_tokens(rng, n_in),
                    max_tokens=n_out,
                    arrival_ms=round((t - t0) * 1000.0 * time_scale),
                    block_size=block_size,
                )
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {path}: {exc}") from exc


def trace_requests(
    path: str | Path, time_scale: float = 1.0, max_requests: int | None = None, block_size: int = 512
) -> Iterator[ChatRequest]:
    """Mooncake JSON lines or Azure CSV, chosen by the file's suffix (``.csv`` = Azure)."""
    if str(path).endswith(".csv"):
        return azure_trace(path, time_scale, max_requests, block_size)
    return mooncake_trace(path, time_scale, max_requests, block_size)
