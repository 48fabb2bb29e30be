"""The producer SDK against a real broker and the echo worker."""

from __future__ import annotations

import asyncio

import pytest
from conftest import ECHO_WORKER, EchoWorker

from kvmesh_client import KvmeshClient
from kvmesh_core.tokenizer import ByteTokenizer, ChatMessage
from schemas.messages import TokenChunk
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


async def test_max_in_flight_holds_a_submit_until_a_slot_frees(
    kafka_settings: KafkaSettings, echo_worker: EchoWorker
) -> None:
    async with KvmeshClient(kafka_settings, client_id="sdk-bp", max_in_flight=1) as client:
        first = await client.chat([ChatMessage("user", "slow one")])  # never completes by itself
        assert client.in_flight == 1
        second = asyncio.create_task(client.chat([ChatMessage("user", "two")]))
        await asyncio.sleep(0.3)
        assert not second.done()  # waiting for the slot, nothing published
        assert [r.request_id for r in echo_worker.requests] == [first.request_id]

        # a caller that gives up while waiting publishes nothing and leaks no slot
        third = asyncio.create_task(client.chat([ChatMessage("user", "three")]))
        await asyncio.sleep(0.05)
        third.cancel()
        with pytest.raises(asyncio.CancelledError):
            await third

        async with first:  # leaving the block before the Completion cancels the request
            pass
        assert (await echo_worker.wait_cancel(first.request_id)).reason == "client_disconnected"
        async with asyncio.timeout(10):
            handle = await second
        done = await handle.result(20)
        assert ByteTokenizer().decode(done.output_token_ids) == "echo:two"
        assert client.in_flight == 0
        # the cancelled third never went out
        assert [r.request_id for r in echo_worker.requests] == [first.request_id, handle.request_id]


async def test_a_publish_that_fails_on_a_retriable_error_is_tried_again(
    kafka_settings: KafkaSettings, echo_worker: EchoWorker
) -> None:
    from streams.producer import PublishError

    async with KvmeshClient(kafka_settings, client_id="sdk-retry", retry_backoff_s=0.01) as client:
        real_send = client._producer.send
        failures = iter([PublishError("leader moved"), OSError("connection reset")])

        async def flaky_send(*args: object, **kw: object) -> object:
            # a fault injected in front of the real producer: two failures, then the broker takes it
            err = next(failures, None)
            if err is not None:
                raise err
            return await real_send(*args, **kw)

        client._producer.send = flaky_send
        handle = await client.chat([ChatMessage("user", "again")])
        done = await handle.result(20)
        assert ByteTokenizer().decode(done.output_token_ids) == "echo:again"
        assert (client.publish_retried, client.publish_failures) == (2, 0)

        client.publish_retries = 0
        failures = iter([PublishError("leader moved")])
        with pytest.raises(PublishError):
            await client.chat([ChatMessage("user", "no retry")])
        assert client.in_flight == 0  # the failed request's slot and handle are gone
