"""Fixtures of the intake tests: a real broker (``kafka_settings``), an echo worker, an intake app.

The echo worker stands in for scheduler + worker at the Kafka boundary: it reads ``kvmesh.requests``
and answers on each request's reply topic. What it does is chosen by the last user message::

    "hang ..."    never answers (timeouts, backpressure)
    "slow ..."    one chunk, then nothing until the request is cancelled
    "fail ..."    Completion(finish_reason="error")
    "reject ..."  Completion(finish_reason="rejected")
    anything      answers "echo:" + the message, in 4-token chunks, each chunk sent twice (dedup)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvmesh_core.tokenizer import ByteTokenizer
from schemas.messages import CancelRequest, ChatRequest, Completion, TokenChunk
from services.intake.app import create_app
from services.intake.config import IntakeSettings
from streams import topics
from streams.consumer import Record, TypedConsumer
from streams.producer import TypedProducer
from streams.settings import KafkaSettings
from streams.tasks import stop_task

API_KEYS = "sk-alpha-0123456789:tenantA,sk-bravo-9876543210:tenantB"
KEY_A = "sk-alpha-0123456789"
KEY_B = "sk-bravo-9876543210"
ECHO_WORKER = "echo-worker-0"


class EchoWorker:
    """Consumes REQUESTS, records what it saw, answers per the module docstring."""

    def __init__(self, kafka: KafkaSettings) -> None:
        self.kafka = kafka
        self.requests: list[ChatRequest] = []
        self.cancels: list[CancelRequest] = []
        self.got_cancel = asyncio.Event()
        self._tok = ByteTokenizer()
        self._producer = TypedProducer(kafka, producer_id=ECHO_WORKER)
        self._consumer = TypedConsumer(kafka, topics=[topics.REQUESTS], group_id=None, from_beginning=False)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._producer.start()
        await self._consumer.start()
        await self._consumer.positions()  # positioned before any request is published
        self._task = asyncio.create_task(self._consumer.run(self._handle))

    async def stop(self) -> None:
        await stop_task(self._task, swallow_errors=True)
        await self._consumer.stop()
        await self._producer.stop()

    async def wait_cancel(self, request_id: str) -> CancelRequest:
        async with asyncio.timeout(20):
            while True:
                for c in self.cancels:
                    if c.request_id == request_id:
                        return c
                self.got_cancel.clear()
                await self.got_cancel.wait()

    async def _handle(self, record: Record) -> None:
        msg = record.message
        if isinstance(msg, CancelRequest):
            self.cancels.append(msg)
            self.got_cancel.set()
            return
        assert isinstance(msg, ChatRequest)
        self.requests.append(msg)
        text = self._last_user_text(msg.token_ids)
        reply = dataclasses.replace(topics.REPLIES, name=msg.reply_topic)
        if text.startswith("hang"):
            return
        prompt = len(msg.token_ids)
        if text.startswith(("fail", "reject")):
            reason = "error" if text.startswith("fail") else "rejected"
            await self._producer.send(
                reply,
                Completion(msg.request_id, msg.session_id, ECHO_WORKER, reason, prompt, 0, error="boom"),  # type: ignore[arg-type]
            )
            return
        answer = self._tok.encode("echo:" + text)[: msg.max_tokens]
        if text.startswith("slow"):
            await self._producer.send(reply, TokenChunk(msg.request_id, ECHO_WORKER, 0, answer[:4]))
            return
        for i in range(0, len(answer), 4):
            chunk = TokenChunk(msg.request_id, ECHO_WORKER, i, answer[i : i + 4])
            await self._producer.send(reply, chunk)
            await self._producer.send(reply, chunk)  # a redelivery: the client must drop it
        reused = min(16, prompt)
        await self._producer.send(
            reply,
            Completion(
                msg.request_id,
                msg.session_id,
                ECHO_WORKER,
                "length" if len(answer) == msg.max_tokens else "stop",
                prompt,
                len(answer),
                output_token_ids=answer,
                reused_tokens=reused,
                fetched_tokens=0,
                recomputed_tokens=prompt - reused,
                ttft_ms=3.0,
            ),
        )

    def _last_user_text(self, ids: list[int]) -> str:
        # The last USER ... END span of the rendered chat.
        start = len(ids) - 1 - ids[::-1].index(ByteTokenizer.USER)
        end = ids.index(ByteTokenizer.END, start)
        return self._tok.decode(ids[start + 1 : end])


@pytest.fixture
async def echo_worker(kafka_settings: KafkaSettings) -> AsyncIterator[EchoWorker]:
    worker = EchoWorker(kafka_settings)
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


def make_settings(kafka: KafkaSettings, **over: Any) -> IntakeSettings:
    base: dict[str, Any] = {
        "kafka": kafka,
        "api_keys": API_KEYS,
        "max_inflight": 4,
        "request_timeout_s": 20.0,
        "max_context": 512,
        "default_max_tokens": 64,
    }
    base.update(over)
    return IntakeSettings(**base)


@contextlib.asynccontextmanager
async def intake(settings: IntakeSettings) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """The app with its lifespan run (httpx's ASGI transport does not run it) and an HTTP client."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://intake.test", timeout=30) as http:
            yield app, http


def chat_body(text: str, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "kvmesh-tiny", "messages": [{"role": "user", "content": text}]}
    body.update(over)
    return body


def auth(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
