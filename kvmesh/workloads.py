"""Workload generators: timed :class:`~schemas.messages.ChatRequest` streams for the simulator and benches.

One generator per synthetic shape, for the simulator and the live bench alike: it builds a
:class:`Workload` of :class:`Session` s, each a list of :class:`Turn` s holding only the tokens the
turn *appends*. A live run (``kvmesh bench fleet``) builds each next prompt from the previous prompt
and the answer the model REALLY gave; :func:`open_loop` builds the simulator's requests of the same
shape, with seeded placeholder answers. So the same spec gives the same prompts to both, up to the
answers, which only the live fleet knows.

Every generator yields real ChatRequests in arrival order (``arrival_ms`` non-decreasing), with
``block_hashes`` computed by :func:`schemas.blocks.block_hashes` over the request's token ids, so the
scheduler sees exactly what intake would publish. ``max_tokens`` is the request's output length (the
simulator generates exactly that many tokens).

Shapes:

* :func:`multiturn` (:func:`multiturn_sessions`) -- LMCache / vLLM multi-round QA: ``users``
  conversations, each prompt is the shared (public) system prompt, the user's own history, every
  earlier question and answer, then the new question::

      round r prompt:  SYS(s) | HIST_u(h) | q0 a0 | q1 a1 | ... | q_r        (answer a_r: max_tokens)

* :func:`shared_prefix` (:func:`shared_prefix_sessions`) -- SGLang "generated shared prefix":
  ``groups`` long prefixes, each followed by ``per_group`` different questions, arrivals shuffled.
* :func:`mooncake_trace` -- Mooncake-format JSON lines (``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids`` of ``trace_block_size``-token blocks). The same hash id means the same
  block of tokens: block ``i``'s tokens are a fixed function of its id (:func:`tokens_for_id`), so equal
  ids give equal tokens, and because the trace's ids are prefix-chained, equal chained hashes follow.
  Pass ``block_size == trace_block_size`` (512, what the simulator does for traces) to get one request
  block per trace id; a smaller block size cuts each trace block into several.
* :func:`mooncake_sessions` -- a Mooncake trace for a live fleet: every length scaled by ``token_scale``,
  each trace block's tokens taken modulo the byte alphabet.
* :func:`azure_trace` -- Azure LLM inference CSV (``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``):
  no prefix information, so every prompt is unique tokens.

Randomness is seeded (``numpy.random.default_rng(seed)``); the same arguments give the same requests.
"""

from __future__ import annotations

import csv
import heapq
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvmesh_core.errors import KvmeshError
from schemas.blocks import DEFAULT_BLOCK_SIZE
from schemas.chat_requests import chat_request
from schemas.messages import ChatRequest

#: Token ids synthesized by the generators stay below this (a Llama-sized vocabulary).
VOCAB_SIZE = 32000

#: Token ids of the synthetic workloads are bytes: valid for any vocabulary, the tiny byte-level test
#: models' (320) included, so the same spec gives the same prompts to the simulator and a live fleet.
TOKEN_ALPHABET = 256

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


def _random_tokens(rng: np.random.Generator, n: int, alphabet: int = VOCAB_SIZE) -> np.ndarray:
    return rng.integers(0, alphabet, size=max(n, 0), dtype=np.int64)


# ------------------------------------------------------------------------------- sessions (the one generator)


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session: the tokens it appends to the session's context, and its answer length."""

    append_tokens: tuple[int, ...]
    max_tokens: int
    due_s: float  # earliest submit time, seconds after the run starts


@dataclass(frozen=True, slots=True)
class Session:
    """One user's turns, played strictly in order; ``carry_output`` puts each real answer in the context."""

    session_id: str
    turns: tuple[Turn, ...]
    tenant: str = "default"
    carry_output: bool = True
    #: Leading tokens of every prompt of the session that are a public prefix (shared across tenants).
    public_prefix_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Workload:
    """Sessions (played concurrently) plus the parameters that produced them (for the JSON output)."""

    name: str
    sessions: tuple[Session, ...]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def _tuple(a: np.ndarray) -> tuple[int, ...]:
    return tuple(int(x) for x in a)


def open_loop(workload: Workload, block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0) -> list[ChatRequest]:
    """The workload as open-loop requests (arrival = due time), in arrival order: what the simulator
    plays (a live run builds each next prompt from the real answer instead).

    A carried answer is ``max_tokens`` seeded placeholder tokens: the simulator generates exactly that
    many, and what matters for reuse is only that the next prompt starts with the same tokens.
    """
    rng = np.random.default_rng(seed)
    out: list[ChatRequest] = []
    for s in workload.sessions:
        context = np.zeros(0, dtype=np.int64)
        for r, turn in enumerate(s.turns):
            prompt = np.concatenate([context, np.asarray(turn.append_tokens, dtype=np.int64)])
            out.append(
                make_request(
                    request_id=f"{s.session_id}-r{r}",
                    session_id=s.session_id,
                    tenant=s.tenant,
                    tokens=prompt,
                    max_tokens=turn.max_tokens,
                    arrival_ms=round(turn.due_s * 1000.0),
                    block_size=block_size,
                    public_prefix_tokens=min(s.public_prefix_tokens, len(prompt)),
                )
            )
            answer = np.zeros(0, dtype=np.int64)
            if s.carry_output:
                answer = _random_tokens(rng, turn.max_tokens, TOKEN_ALPHABET)
            context = np.concatenate([prompt, answer])
    out.sort(key=lambda req: req.arrival_ms)  # stable: a session's turns keep their order
    return out


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


def multiturn_sessions(spec: MultiTurnSpec) -> Workload:
    """``spec.users`` conversations of ``spec.rounds`` turns: turn 0 appends SYS | HIST_u | q0, turn r
    appends q_r; user u's round r is due ``(r * users + u) / qps`` seconds into the run."""
    if spec.users < 1 or spec.rounds < 1 or spec.qps <= 0:
        raise WorkloadError("multiturn needs users >= 1, rounds >= 1 and qps > 0")
    rng = np.random.default_rng(spec.seed)
    system = _random_tokens(rng, spec.system_prompt_tokens, TOKEN_ALPHABET)
    history = [_random_tokens(rng, spec.history_tokens, TOKEN_ALPHABET) for _ in range(spec.users)]
    questions = [
        [_random_tokens(rng, spec.question_tokens, TOKEN_ALPHABET) for _ in range(spec.rounds)]
        for _ in range(spec.users)
    ]
    sessions = []
    for u in range(spec.users):
        turns = []
        for r in range(spec.rounds):
            appended = np.concatenate([system, history[u], questions[u][r]]) if r == 0 else questions[u][r]
            due = (r * spec.users + u) / spec.qps
            turns.append(Turn(_tuple(appended), spec.answer_tokens, due))
        tenant = f"tenant-{u % max(spec.tenants, 1)}"
        # the system prompt is public: every tenant's users share its blocks
        sessions.append(
            Session(f"mt-u{u}", tuple(turns), tenant, public_prefix_tokens=spec.system_prompt_tokens)
        )
    params = {
        "users": spec.users,
        "rounds": spec.rounds,
        "system_prompt_tokens": spec.system_prompt_tokens,
        "history_tokens": spec.history_tokens,
        "question_tokens": spec.question_tokens,
        "answer_tokens": spec.answer_tokens,
        "qps": spec.qps,
        "tenants": spec.tenants,
        "seed": spec.seed,
    }
    return Workload("multiturn", tuple(sessions), params)


def multiturn(spec: MultiTurnSpec, block_size: int = DEFAULT_BLOCK_SIZE) -> Iterator[ChatRequest]:
    """The rounds of ``spec.users`` conversations as open-loop requests, in arrival order (the
    simulator's view of :func:`multiturn_sessions`; the system prompt is declared public)."""
    return iter(open_loop(multiturn_sessions(spec), block_size, seed=spec.seed))


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


def shared_prefix_sessions(spec: SharedPrefixSpec) -> Workload:
    """``groups * per_group`` single-turn requests: a group prefix plus an own question, shuffled."""
    if spec.groups < 1 or spec.per_group < 1 or spec.qps <= 0:
        raise WorkloadError("shared_prefix needs groups >= 1, per_group >= 1 and qps > 0")
    rng = np.random.default_rng(spec.seed)
    prefixes = [_random_tokens(rng, spec.prefix_tokens, TOKEN_ALPHABET) for _ in range(spec.groups)]
    order = [(g, i) for g in range(spec.groups) for i in range(spec.per_group)]
    rng.shuffle(order)
    sessions = []
    for k, (g, i) in enumerate(order):
        prompt = np.concatenate([prefixes[g], _random_tokens(rng, spec.question_tokens, TOKEN_ALPHABET)])
        turn = Turn(_tuple(prompt), spec.output_tokens, k / spec.qps)
        sessions.append(Session(f"sp-g{g}-{i}", (turn,), tenant="tenant-0", carry_output=False))
    params = {
        "groups": spec.groups,
        "per_group": spec.per_group,
        "prefix_tokens": spec.prefix_tokens,
        "question_tokens": spec.question_tokens,
        "output_tokens": spec.output_tokens,
        "qps": spec.qps,
        "seed": spec.seed,
    }
    return Workload("shared-prefix", tuple(sessions), params)


def shared_prefix(spec: SharedPrefixSpec, block_size: int = DEFAULT_BLOCK_SIZE) -> Iterator[ChatRequest]:
    """``groups * per_group`` requests, each a group prefix plus its own question, shuffled (the
    simulator's view of :func:`shared_prefix_sessions`)."""
    return iter(open_loop(shared_prefix_sessions(spec), block_size, seed=spec.seed))


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


def mooncake_sessions(
    path: str | Path,
    time_scale: float = 1.0,
    max_requests: int | None = 64,
    token_scale: float = 1 / 32,
    max_output_tokens: int | None = 64,
) -> Workload:
    """A Mooncake trace replayed at ``time_scale`` with every length multiplied by ``token_scale``.

    Trace block ``id`` becomes ``round(512 * token_scale)`` byte tokens fixed by ``id`` alone, so requests
    that share hash ids share those tokens (and so, chained, their KV blocks). Output lengths are capped
    at ``max_output_tokens`` because on a CPU decode dominates everything else.
    """
    if time_scale <= 0 or not 0 < token_scale <= 1:
        raise WorkloadError("time_scale must be positive and token_scale in (0, 1]")
    per_block = max(1, round(MOONCAKE_BLOCK_SIZE * token_scale))
    sessions = []
    for i, row in enumerate(read_mooncake(path)):
        if max_requests is not None and i >= max_requests:
            break
        n_in = max(1, round(int(row["input_length"]) * token_scale))
        ids = np.asarray(row["hash_ids"], dtype=np.int64)
        # tokens_for_id mixes (id, position) into a large range; modulo the byte alphabet keeps it fixed.
        tokens = tokens_for_id(ids, per_block)[:n_in] % TOKEN_ALPHABET
        if tokens.size < n_in:  # ids cover less than input_length: pad with tokens unique to this row
            pad = tokens_for_id(np.asarray([-(i + 1)], dtype=np.int64), n_in - tokens.size) % TOKEN_ALPHABET
            tokens = np.concatenate([tokens, pad])
        n_out = max(1, round(int(row["output_length"]) * token_scale))
        if max_output_tokens is not None:
            n_out = min(n_out, max_output_tokens)
        due = int(row["timestamp"]) * time_scale / 1000.0
        turn = Turn(_tuple(tokens), n_out, due)
        sessions.append(Session(f"trace-{i}", (turn,), tenant="trace", carry_output=False))
    if not sessions:
        raise WorkloadError(f"trace {path} holds no request")
    t0 = min(s.turns[0].due_s for s in sessions)
    rebased = tuple(
        Session(s.session_id, (Turn(t.append_tokens, t.max_tokens, t.due_s - t0),), s.tenant, False)
        for s in sessions
        for t in s.turns
    )
    params = {
        "trace": str(path),
        "time_scale": time_scale,
        "max_requests": max_requests,
        "token_scale": token_scale,
        "max_output_tokens": max_output_tokens,
    }
    return Workload("mooncake", rebased, params)


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
    path: str | Path,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    block_size: int = 512,
    tile: int = 1,
) -> Iterator[ChatRequest]:
    """Mooncake JSON lines or Azure CSV, chosen by the file's suffix (``.csv`` = Azure).

    ``tile`` > 1 plays ``tile`` copies of the trace at once, each as its own tenant (so no copy
    shares a block with another: tenants' blocks hash apart): ``tile`` times the load and the
    distinct prefixes of one trace, for a fleet ``tile`` times the size it was recorded on.
    ``max_requests`` counts trace rows, before tiling."""
    if tile < 1:
        raise WorkloadError("tile must be at least 1")
    if str(path).endswith(".csv"):
        copies = [azure_trace(path, time_scale, max_requests, block_size, seed=j) for j in range(tile)]
    else:
        copies = [
            mooncake_trace(path, time_scale, max_requests, block_size, tenant=f"trace-{j}")
            for j in range(tile)
        ]
    return copies[0] if tile == 1 else _interleave_copies(copies)


def _interleave_copies(copies: list[Iterator[ChatRequest]]) -> Iterator[ChatRequest]:
    """The copies merged in arrival order, copy ``j`` shifted by ``j / len(copies)`` of a second:
    enough to break the lockstep of identical copies (each would otherwise meet a fleet in the very
    state the others meet, and the run would only repeat the untiled one), too little to change the
    load. Each copy's ids get its number (the blocks already differ: by tenant, or by the seed of an
    Azure copy)."""
    k = len(copies)

    def shifted(j: int, it: Iterator[ChatRequest]) -> Iterator[ChatRequest]:
        offset = j * 1000 // k
        for req in it:
            yield msgspec.structs.replace(
                req,
                request_id=f"{req.request_id}-c{j}",
                session_id=f"{req.session_id}-c{j}",
                arrival_ms=req.arrival_ms + offset,
            )

    return heapq.merge(*(shifted(j, it) for j, it in enumerate(copies)), key=lambda r: r.arrival_ms)
