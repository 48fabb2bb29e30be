"""Fetch planning on the worker: chain rules and the worker's own cost check (no sockets: a fake client)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fleet_helpers import NS, assignment, block_tokens, chat_request

from schemas.messages import FetchPlan
from services.worker.fetch_planning import fetch_planned
from services.worker.reports import RunningRequest


@dataclass
class _Result:
    received: list[int]


@dataclass
class _Client:
    calls: list[tuple[str, list[int]]] = field(default_factory=list)
    give: int | None = None  # how many blocks to "receive" (None: all)

    async def fetch(
        self, address: str, hashes: list[int], parents: list[int], ns: bytes, sink: Any, **kw: Any
    ):  # type: ignore[no-untyped-def]
        assert ns == NS and len(parents) == len(hashes)
        self.calls.append((address, list(hashes)))
        n = len(hashes) if self.give is None else self.give
        sink.extend(hashes[:n])
        return _Result(list(hashes[:n]))


def _setup(held: int, plan_from: int, plan_to: int) -> tuple[Any, RunningRequest, list[int]]:
    req = chat_request("r", block_tokens("the fleet keeps its cache ", 8))
    hashes = list(req.block_hashes)
    a = assignment(req, "w-1", reuse=held)
    plan = FetchPlan(
        peer_worker="w-0",
        peer_address="127.0.0.1:1",
        first_block=plan_from,
        block_hashes=hashes[plan_from:plan_to],
    )
    a = msgspec.structs.replace(a, fetch=[plan])
    return a, RunningRequest(request=req, started=0.0, expected_blocks=held), hashes


def _lookup(sink: list[int]):  # type: ignore[no-untyped-def]
    return lambda hashes: next((i for i, h in enumerate(hashes) if h not in sink), len(hashes))


def test_fetches_only_what_extends_the_local_prefix() -> None:
    a, entry, hashes = _setup(held=2, plan_from=0, plan_to=6)
    sink = list(hashes[:2])
    client = _Client()
    out = asyncio.run(fetch_planned(a, entry, client, sink, _lookup(sink), "w-1"))  # type: ignore[arg-type]
    assert client.calls == [("127.0.0.1:1", hashes[2:6])]
    assert out.fetched_blocks == 4 and entry.fetched_blocks == 4 and entry.expected_blocks == 6
    assert entry.fallback is None


def test_a_gap_before_the_plan_fetches_nothing() -> None:
    a, entry, hashes = _setup(held=1, plan_from=3, plan_to=6)
    sink = list(hashes[:1])
    client = _Client()
    asyncio.run(fetch_planned(a, entry, client, sink, _lookup(sink), "w-1"))  # type: ignore[arg-type]
    assert client.calls == [] and "gap" in (entry.fallback or "")


def test_an_incomplete_fetch_is_a_recorded_fallback() -> None:
    a, entry, _hashes = _setup(held=0, plan_from=0, plan_to=6)
    sink: list[int] = []
    out = asyncio.run(fetch_planned(a, entry, _Client(give=2), sink, _lookup(sink), "w-1"))  # type: ignore[arg-type]
    assert out.fetched_blocks == 2 and out.failures == 1 and "incomplete (2/6)" in (entry.fallback or "")


def test_the_worker_declines_a_plan_its_own_cost_model_rejects() -> None:
    a, entry, _hashes = _setup(held=0, plan_from=0, plan_to=6)
    sink: list[int] = []
    client = _Client()
    seen: list[tuple[int, int]] = []

    def too_slow(n_blocks: int, cached_tokens: int) -> bool:
        seen.append((n_blocks, cached_tokens))
        return False

    out = asyncio.run(fetch_planned(a, entry, client, sink, _lookup(sink), "w-1", too_slow))  # type: ignore[arg-type]
    assert client.calls == [] and out.declined == 1 and seen == [(6, 0)]
    assert "costs more than recomputing" in (entry.fallback or "")
