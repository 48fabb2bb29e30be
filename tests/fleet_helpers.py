"""Builders shared by the tests that run real WorkerServices against the real broker (and Redis):
prompts of an exact number of blocks, ChatRequests and Assignments for them, and a bounded wait.

Imported as ``from fleet_helpers import ...`` (tests/ is on sys.path through its conftest.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from kvmesh_core.tokenizer import ByteTokenizer
from schemas import chat_requests
from schemas.blocks import tenant_namespace
from schemas.messages import Assignment, ChatRequest, Estimate
from streams.clock import now_ms
from streams.consumer import TypedConsumer
from streams.settings import KafkaSettings
from streams.topics import TopicSpec

TOK = ByteTokenizer()
NS = tenant_namespace("acme")
BS = 16


def block_tokens(text: str, blocks: int) -> list[int]:
    """Exactly ``blocks`` full blocks of tokens of ``text`` (repeated as needed)."""
    ids = TOK.encode(text)
    while len(ids) < blocks * BS:
        ids = ids + ids
    return ids[: blocks * BS]


def chat_request(
    rid: str, tokens: list[int], *, session: str | None = None, max_tokens: int = 4
) -> ChatRequest:
    """A tenant-``acme`` request for ``tokens`` with the block hashes intake would compute."""
    return chat_requests.chat_request(
        tokens,
        request_id=rid,
        session_id=session or f"s-{rid}",
        tenant="acme",
        block_size=BS,
        max_tokens=max_tokens,
        arrival_ms=now_ms(),
    )


def assignment(req: ChatRequest, worker: str, reuse: int = 0) -> Assignment:
    """What a scheduler would publish to run ``req`` on ``worker`` with ``reuse`` local blocks."""
    return Assignment(
        request=req,
        worker_id=worker,
        reuse_blocks=reuse,
        prefill_tokens=len(req.token_ids) - reuse * BS,
        estimate=Estimate(ttft_ms=1.0, queue_ms=0.0, recompute_ms=1.0, transfer_ms=0.0, policy="test"),
    )


async def wait_for(pred: Callable[[], Any], timeout: float = 30.0) -> None:
    """Poll ``pred`` until it holds; TimeoutError after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.05)


def read_topic(
    kafka: KafkaSettings, topic: TopicSpec, settle_s: float = 1.0, max_s: float = 15.0
) -> list[Any]:
    """Every message on ``topic`` so far: read from the beginning until it goes quiet for ``settle_s``
    (or ``max_s`` passed: the load topic never goes quiet)."""

    async def read() -> list[Any]:
        c = TypedConsumer(kafka, [topic], group_id=None, from_beginning=True, dedup=False)
        await c.start()
        out: list[Any] = []
        try:
            quiet_since = start = time.monotonic()
            while time.monotonic() - quiet_since < settle_s and time.monotonic() - start < max_s:
                recs = await c.getmany(timeout_ms=200)
                if recs:
                    quiet_since = time.monotonic()
                out += [r.message for r in recs]
        finally:
            await c.stop()
        return out

    return asyncio.run(read())
