"""Workloads of known shape for ``kvmesh bench fleet``: sessions of turns, played against a live fleet.

A live multi-turn conversation cannot be generated ahead of time: turn r+1's prompt is turn r's prompt,
the tokens the model REALLY answered (``Completion.output_token_ids``), then the next question -- any
other answer would make nothing after turn 1 reusable. So a workload here is a list of
:class:`LiveSession` (one user, or one single-shot request), each a list of :class:`LiveTurn` holding
only the tokens the turn *appends*; the driver builds each prompt from the previous prompt and answer.

Shapes (lengths in tokens; every synthesized token id is a byte, 0..255, so it is valid for the tiny
byte-level model whose vocabulary is 320):

* :func:`multiturn_live` -- the LMCache / vLLM multi-round QA shape of :func:`kvmesh.workloads.multiturn`:
  turn 0 appends SYS | HIST_u | q0, turn r appends q_r; user u's round r is due ``(r * users + u) / qps``
  seconds into the run (and never before the user's previous round finished).
* :func:`shared_prefix_live` -- SGLang's generated shared prefix: single-turn sessions, group prefix +
  own question, arrivals shuffled.
* :func:`mooncake_live` -- a Mooncake trace (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids`` of 512-token blocks). Each trace block becomes ``round(512 * token_scale)`` tokens that are
  a fixed function of its id (equal ids, equal tokens), lengths are scaled the same way, timestamps by
  ``time_scale``.

:func:`sim_requests` turns a workload into the simulator's open-loop ChatRequests of the same shape
(answers are seeded placeholder tokens of ``max_tokens`` length: inside the simulator they play the
role the real answers play live).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.workloads import (
    MOONCAKE_BLOCK_SIZE,
    MultiTurnSpec,
    SharedPrefixSpec,
    WorkloadError,
    make_request,
    read_mooncake,
    tokens_for_id,
)
from schemas.blocks import DEFAULT_BLOCK_SIZE
from schemas.messages import ChatRequest

#: Synthesized token ids are bytes: below the tiny model's vocabulary (320) and below its specials.
TOKEN_ALPHABET = 256


@dataclass(frozen=True, slots=True)
class LiveTurn:
    """One request of a session: the tokens it appends to the session's context, and its answer length."""

    append_tokens: tuple[int, ...]
    max_tokens: int
    due_s: float  # earliest submit time, seconds after the run starts


@dataclass(frozen=True, slots=True)
class LiveSession:
    """One user's turns, played strictly in order; ``carry_output`` puts each real answer in the context."""

    session_id: str
    turns: tuple[LiveTurn, ...]
    tenant: str = "default"
    carry_output: bool = True


@dataclass(frozen=True, slots=True)
class LiveWorkload:
    """Sessions (played concurrently) plus the parameters that produced them (for the JSON output)."""

    name: str
    sessions: tuple[LiveSession, ...]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def _bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, TOKEN_ALPHABET, size=max(n, 0), dtype=np.int64)


def _tuple(a: np.ndarray) -> tuple[int, ...]:
    return tuple(int(x) for x in a)


def multiturn_live(spec: MultiTurnSpec) -> LiveWorkload:
    """``spec.users`` conversations of ``spec.rounds`` turns (see the module docstring)."""
    if spec.users < 1 or spec.rounds < 1 or spec.qps <= 0:
        raise WorkloadError("multiturn needs users >= 1, rounds >= 1 and qps > 0")
    rng = np.random.default_rng(spec.seed)
    system = _bytes(rng, spec.system_prompt_tokens)
    history = [_bytes(rng, spec.history_tokens) for _ in range(spec.users)]
    questions = [[_bytes(rng, spec.question_tokens) for _ in range(spec.rounds)] for _ in range(spec.users)]
    sessions = []
    for u in range(spec.users):
        turns = []
        for r in range(spec.rounds):
            appended = np.concatenate([system, history[u], questions[u][r]]) if r == 0 else questions[u][r]
            due = (r * spec.users + u) / spec.qps
            turns.append(LiveTurn(_tuple(appended), spec.answer_tokens, due))
        sessions.append(LiveSession(f"mt-u{u}", tuple(turns), tenant=f"tenant-{u % max(spec.tenants, 1)}"))
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
    return LiveWorkload("multiturn", tuple(sessions), params)


def shared_prefix_live(spec: SharedPrefixSpec) -> LiveWorkload:
    """``groups * per_group`` single-turn requests: a group prefix plus an own question, shuffled."""
    if spec.groups < 1 or spec.per_group < 1 or spec.qps <= 0:
        raise WorkloadError("shared_prefix needs groups >= 1, per_group >= 1 and qps > 0")
    rng = np.random.default_rng(spec.seed)
    prefixes = [_bytes(rng, spec.prefix_tokens) for _ in range(spec.groups)]
    order = [(g, i) for g in range(spec.groups) for i in range(spec.per_group)]
    rng.shuffle(order)
    sessions = []
    for k, (g, i) in enumerate(order):
        prompt = np.concatenate([prefixes[g], _bytes(rng, spec.question_tokens)])
        turn = LiveTurn(_tuple(prompt), spec.output_tokens, k / spec.qps)
        sessions.append(LiveSession(f"sp-g{g}-{i}", (turn,), carry_output=False))
    params = {
        "groups": spec.groups,
        "per_group": spec.per_group,
        "prefix_tokens": spec.prefix_tokens,
        "question_tokens": spec.question_tokens,
        "output_tokens": spec.output_tokens,
        "qps": spec.qps,
        "seed": spec.seed,
    }
    return LiveWorkload("shared-prefix", tuple(sessions), params)


def mooncake_live(
    path: str | Path,
    time_scale: float = 1.0,
    max_requests: int | None = 64,
    token_scale: float = 1 / 32,
    max_output_tokens: int | None = 64,
) -> LiveWorkload:
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
        turn = LiveTurn(_tuple(tokens), n_out, due)
        sessions.append(LiveSession(f"trace-{i}", (turn,), tenant="trace", carry_output=False))
    if not sessions:
        raise WorkloadError(f"trace {path} holds no request")
    t0 = min(s.turns[0].due_s for s in sessions)
    rebased = tuple(
        LiveSession(s.session_id, (LiveTurn(t.append_tokens, t.max_tokens, t.due_s - t0),), s.tenant, False)
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
    return LiveWorkload("mooncake", rebased, params)


def sim_requests(
    workload: LiveWorkload, block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0
) -> list[ChatRequest]:
    """The workload as the simulator's requests (arrival = due time), in arrival order.

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
                )
            )
            answer = _bytes(rng, turn.max_tokens) if s.carry_output else np.zeros(0, dtype=np.int64)
            context = np.concatenate([prompt, answer])
    out.sort(key=lambda req: req.arrival_ms)  # stable: a session's turns keep their order
    return out
