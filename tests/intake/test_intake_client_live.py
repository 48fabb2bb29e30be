"""The producer SDK against a real broker and the echo worker."""

from __future__ import annotations

import asyncio

import pytest
from conftest import ECHO_WORKER, EchoWorker

from kvmesh_core.tokenizer import ByteTokenizer, ChatMessage
from schemas.messages import TokenChunk
from streams.client import KvmeshClient
from streams.settings import KafkaSettings

pytestmark = pytest.mark.integration


async def test_two_clients_share_the_reply_topic(
    kafka_settings: KafkaSettings, echo_worker: EchoWorker
) -> None:
    tok = ByteTokenizer()
    async with (
        KvmeshClient(kafka_settings, client_id="sdk-a") as a,
        KvmeshClient(kafka_settings, client_id="sdk-b") as b,
    ):
        ha = await a.submit(a.build_request([ChatMessage("user", "from a, quite long")], tenant="tA"))
        hb = await b.submit(b.build_request([ChatMessage("user", "from b")], tenant="tB"))
        chunks: list[TokenChunk] = [c async for c in ha.stream(timeout=20)]
        assert [c.index for c in chunks] == [0, 4, 8, 12, 16, 20]  # each chunk once, in order
        assert tok.decode([t for c in chunks for t in c.token_ids]) == "echo:from a, quite long"
        ca, cb = await ha.result(20), await hb.result(20)
        assert (ca.worker_id, tok.decode(cb.output_token_ids)) == (ECHO_WORKER, "echo:from b")
        # Each client sees the other's replies and drops them (they arrive on its own reader's
        # schedule, which may trail our own result: wait for them, boundedly).
        async with asyncio.timeout(10):
            while not (a.router.ignored > 0 and b.router.ignored > 0):
                await asyncio.sleep(0.05)
        assert len(a.router) == len(b.router) == 0

        slow = await a.submit(a.build_request([ChatMessage("user", "slow please")], session_id="sess-1"))
        first = await anext(aiter(slow.stream(timeout=20)))
        assert first.token_ids == tok.encode("echo")
        await slow.cancel("user_stop")
        cancel = await echo_worker.wait_cancel(slow.request_id)
        assert (cancel.session_id, cancel.reason, cancel.worker_id) == ("sess-1", "user_stop", ECHO_WORKER)
        assert len(a.router) == 0
        await asyncio.sleep(0)
    await a.stop()  # safe twice
