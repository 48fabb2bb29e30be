"""What a probe with bad inputs and a dead broker found in intake, each as a regression test.

Bad input is a 4xx with OpenAI's error shape before any expensive work (media type, body size,
nesting, out-of-range values, oversized session keys); a request no worker can finish before its
deadline is refused up front; a broker that dies answers JSON 503s within the publish timeout,
marks intake unready, and intake is ready again once the broker is back (its topics recreated).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
from conftest import ECHO_WORKER, EchoWorker, auth, chat_body, intake, make_settings

from schemas.messages import LoadReport, ServiceHeartbeat
from streams import topics
from streams.admin import ensure_topics
from streams.embedded import EmbeddedBroker
from streams.producer import TypedProducer
from streams.settings import KafkaSettings

pytestmark = pytest.mark.integration


def _report(worker: str, decode_ms: float, now_ms: int) -> LoadReport:
    return LoadReport(
        worker_id=worker,
        report_ms=now_ms,
        queue_depth=0,
        active_requests=0,
        active_tokens=0,
        queued_prefill_tokens=0,
        tiers=[],
        transfer_address="127.0.0.1:1",
        block_size=16,
        block_bytes=1024,
        prefill_ms_per_token=0.1,
        decode_ms_per_step=decode_ms,
    )


def _beat() -> ServiceHeartbeat:
    return ServiceHeartbeat("scheduler", "scheduler-0", int(time.time() * 1000))


async def test_bad_input_is_a_clear_4xx_before_any_work(
    kafka_settings: KafkaSettings, echo_worker: EchoWorker
) -> None:
    async with intake(make_settings(kafka_settings, max_body_bytes=64 * 1024)) as (_, http):

        async def post(content: bytes, content_type: str | None = "application/json") -> tuple[int, dict]:
            headers = auth()
            if content_type is not None:
                headers["Content-Type"] = content_type
            r = await http.post("/v1/chat/completions", content=content, headers=headers)
            return r.status_code, r.json()["error"]

        ok = json.dumps(chat_body("hi")).encode()
        # a form or text post, as a web page can send without a preflight
        assert (await post(ok, "text/plain"))[0] == 415
        assert (await post(ok, None))[0] == 415
        assert (await post(ok, "application/x-www-form-urlencoded"))[1]["code"] == "unsupported_media_type"
        # over the body limit: refused on the declared length, before parsing
        status, err = await post(json.dumps(chat_body("x" * 70_000)).encode())
        assert (status, err["code"]) == (413, "request_too_large")
        # nested deeper than the parser recurses
        status, err = await post(b'{"model": ' + b"[" * 20_000 + b"]" * 20_000 + b"}")
        assert (status, err["code"]) == (400, "invalid_json")
        # a seed msgpack cannot carry, a session key as long as a record
        for field, value in (("seed", 2**64), ("seed", -(2**63) - 1), ("user", "u" * 5000)):
            status, err = await post(json.dumps(chat_body("x", **{field: value})).encode())
            assert (status, err["param"]) == (400, field), (field, err)
        r = await http.post(
            "/v1/chat/completions", json=chat_body("x"), headers={**auth(), "X-Session-Id": "s" * 999}
        )
        assert (r.status_code, r.json()["error"]["param"]) == (400, "X-Session-Id")
        assert echo_worker.requests == []
        # the largest seed is fine, and n choices get seeds that wrap inside int64
        r = await http.post(
            "/v1/chat/completions", json=chat_body("hi", seed=2**63 - 1, n=2, max_tokens=4), headers=auth()
        )
        assert r.status_code == 200, r.text
        seeds = sorted(req.sampling.seed for req in echo_worker.requests if req.sampling.seed is not None)
        assert seeds == [-(2**63), 2**63 - 1]


async def test_a_large_prompt_is_prepared_off_the_event_loop(
    kafka_settings: KafkaSettings, echo_worker: EchoWorker
) -> None:
    async with intake(make_settings(kafka_settings)) as (app, http):
        service = app.state.service
        started, release = threading.Event(), threading.Event()
        prepare = service.prepare_chat

        def held(*args: Any, **kw: Any) -> Any:
            started.set()
            release.wait(10)  # on the event loop this would freeze /healthz for 10 s
            return prepare(*args, **kw)

        service.prepare_chat = held
        # ~1 MB of prompt: prepared (tokenized) in a worker thread, then refused for its length
        task = asyncio.create_task(
            http.post("/v1/chat/completions", json=chat_body("y" * 1_000_000), headers=auth())
        )
        assert await asyncio.to_thread(started.wait, 10)
        healthz = await http.get("/healthz")
        assert healthz.status_code == 200 and not task.done()
        release.set()
        r = await task
        assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded")


async def test_a_completion_that_cannot_finish_by_the_deadline_is_refused(
    kafka_settings: KafkaSettings, echo_worker: EchoWorker
) -> None:
    # 2 s deadline, the fastest worker decodes a token in 100 ms: at most 20 tokens fit
    settings = make_settings(kafka_settings, request_timeout_s=2.0, block_size=16)
    async with intake(settings) as (app, http):
        async with TypedProducer(kafka_settings, producer_id="probe") as producer:
            now = int(time.time() * 1000)
            await producer.send(topics.LOAD, _report(ECHO_WORKER, 100.0, now))
            await producer.send(topics.LOAD, _report("slow-worker", 400.0, now))
        service = app.state.service
        async with asyncio.timeout(10):
            while service.features.fastest_decode_ms("kvmesh-tiny", time.monotonic()) is None:
                await asyncio.sleep(0.05)
        r = await http.post("/v1/chat/completions", json=chat_body("hi", max_tokens=21), headers=auth())
        err = r.json()["error"]
        assert (r.status_code, err["param"]) == (400, "max_tokens") and "at most 20 tokens" in err["message"]
        r = await http.post("/v1/chat/completions", json=chat_body("hi", max_tokens=20), headers=auth())
        assert r.status_code == 200, r.text
        # without max_tokens the default (64) is lowered to what can finish
        r = await http.post("/v1/chat/completions", json=chat_body("hi"), headers=auth())
        assert r.status_code == 200 and echo_worker.requests[-1].max_tokens == 20


async def test_a_dead_broker_gives_fast_json_503s_and_intake_heals_when_it_returns() -> None:
    try:
        broker = EmbeddedBroker()
        url = broker.start()
    except Exception as exc:
        pytest.skip(f"no embedded broker: {exc}")
    kafka = KafkaSettings(bootstrap_servers=url)
    port = broker.port
    try:
        await ensure_topics(kafka)
        settings = make_settings(kafka, publish_timeout_s=1.0, request_timeout_s=3.0)
        async with intake(settings) as (app, http):
            # ready needs a live worker and a live scheduler: neither yet
            first = await http.get("/readyz")
            assert first.status_code == 503 and first.json()["live_schedulers"] == 0
            async with TypedProducer(kafka, producer_id="probe") as producer:
                await producer.send(topics.LOAD, _report("w0", 1.0, int(time.time() * 1000)))
                await asyncio.sleep(0.5)
                assert (await http.get("/readyz")).json()["live_workers"] == 1
                assert (await http.get("/readyz")).status_code == 503  # still no scheduler
                await producer.send(topics.HEARTBEATS, _beat())
            async with asyncio.timeout(10):
                while (await http.get("/readyz")).status_code != 200:
                    await asyncio.sleep(0.1)
            # a request in flight when the broker dies is answered at its deadline: its cancel goes
            # out in the background instead of blocking the answer on a dead broker
            pending = asyncio.create_task(
                http.post("/v1/chat/completions", json=chat_body("hang"), headers=auth())
            )
            await asyncio.sleep(0.5)
            broker.stop()
            t0 = time.monotonic()
            late = await pending
            assert late.status_code == 504 and late.json()["error"]["code"] == "timeout"
            assert time.monotonic() - t0 < settings.request_timeout_s, "the deadline was overrun"
            t0 = time.monotonic()
            r = await http.post("/v1/chat/completions", json=chat_body("hello"), headers=auth())
            took = time.monotonic() - t0
            assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", r.text
            assert r.headers["Retry-After"] and took < 5.0, took
            ready = await http.get("/readyz")
            assert ready.status_code == 503 and ready.json()["broker"] is False
            assert (await http.get("/healthz")).status_code == 200  # liveness: restarting would not help
            # the broker comes back on its port, empty (in-memory): readiness recreates the topics
            broker = EmbeddedBroker(port=port)
            broker.start()
            async with TypedProducer(kafka, producer_id="probe2") as producer:
                async with asyncio.timeout(30):
                    while True:
                        await ensure_topics(kafka, [topics.LOAD, topics.HEARTBEATS])
                        await producer.send(topics.LOAD, _report("w0", 1.0, int(time.time() * 1000)))
                        await producer.send(topics.HEARTBEATS, _beat())
                        if (await http.get("/readyz")).status_code == 200:
                            break
                        await asyncio.sleep(0.5)
            assert app.state.service.client.publish_failures == 0
    finally:
        broker.stop()
