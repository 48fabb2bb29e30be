"""The intake over HTTP against a real broker and an echo worker (stands in for scheduler + worker)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import MutableMapping
from typing import Any

import openai
import pytest
from conftest import ECHO_WORKER, KEY_A, KEY_B, EchoWorker, auth, chat_body, intake, make_settings
from pydantic import SecretStr

from schemas.blocks import tenant_namespace
from streams.settings import KafkaSettings

pytestmark = pytest.mark.integration


def _sse_events(text: str) -> list[Any]:
    """Parse an SSE body: every event must be ``data: ...\\n\\n``; ``[DONE]`` comes back as a string."""
    assert text.endswith("\n\n")
    out: list[Any] = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def test_non_stream_completion(kafka_settings: KafkaSettings, echo_worker: EchoWorker) -> None:
    async with intake(make_settings(kafka_settings)) as (_, http):
        r = await http.post(
            "/v1/chat/completions", json=chat_body("hello world, this is kvmesh"), headers=auth()
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {
            "role": "assistant",
            "content": "echo:hello world, this is kvmesh",
        }
        assert body["choices"][0]["finish_reason"] == "stop"
        req = echo_worker.requests[-1]
        prompt = len(req.token_ids)
        assert body["usage"] == {
            "prompt_tokens": prompt,
            "completion_tokens": len("echo:hello world, this is kvmesh"),
            "total_tokens": prompt + len("echo:hello world, this is kvmesh"),
            "prompt_tokens_details": {"cached_tokens": 16},
        }
        assert body["kvmesh"]["worker"] == ECHO_WORKER
        assert body["kvmesh"]["reused_tokens"] == 16
        assert body["kvmesh"]["recomputed_tokens"] == prompt - 16
        assert r.headers["X-Kvmesh-Worker"] == ECHO_WORKER
        assert r.headers["X-Kvmesh-Reused-Tokens"] == "16"
        assert r.headers["X-Kvmesh-Request-Id"] == req.request_id == body["kvmesh"]["request_id"]
        # The tenant comes from the key; the body's "user" only names the session.
        assert req.tenant == "tenantA"
        assert req.namespace == tenant_namespace("tenantA")
        assert req.max_tokens == 64  # default_max_tokens
        assert req.deadline_ms == req.arrival_ms + 20_000

        r = await http.post(
            "/v1/chat/completions", json=chat_body("hi", max_tokens=3, user="conv-7"), headers=auth()
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0] == {
            "index": 0,
            "message": {"role": "assistant", "content": "ech"},
            "finish_reason": "length",
            "logprobs": None,
        }
        assert echo_worker.requests[-1].session_id == "tenantA/conv-7"
        r = await http.post(
            "/v1/chat/completions", json=chat_body("hi"), headers={**auth(), "X-Session-Id": "conv-9"}
        )
        assert echo_worker.requests[-1].session_id == "tenantA/conv-9"

        models = await http.get("/v1/models", headers=auth())
        assert [m["id"] for m in models.json()["data"]] == ["kvmesh-tiny"]
        assert (await http.get("/healthz")).json()["status"] == "ok"
        metrics = (await http.get("/metrics")).text
        assert 'kvmesh_intake_requests_total{outcome="ok"} 3.0' in metrics
        assert 'kvmesh_intake_prompt_tokens_total{how="reused"}' in metrics


async def test_stream_completion_with_usage(kafka_settings: KafkaSettings, echo_worker: EchoWorker) -> None:
    async with intake(make_settings(kafka_settings)) as (_, http):
        body = chat_body(
            "stream me please, many tokens",
            stream=True,
            stream_options={"include_usage": True},
            max_completion_tokens=9,
        )
        r = await http.post("/v1/chat/completions", json=body, headers=auth())
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["X-Kvmesh-Worker"] == ECHO_WORKER
        events = _sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text == "echo:stre"  # 9 tokens, duplicates dropped
        finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert [c["choices"][0]["finish_reason"] for c in finish] == ["length"]
        usage_chunk = chunks[-1]
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] == 9
        assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
        assert usage_chunk["kvmesh"]["worker"] == ECHO_WORKER
        assert echo_worker.requests[-1].max_tokens == 9

        # Without include_usage there is no usage chunk, but the finish chunk still says how it was served.
        r = await http.post(
            "/v1/chat/completions",
            json=chat_body("again, and a bit more to stream", stream=True),
            headers=auth(),
        )
        events = _sse_events(r.text)
        assert events[-1] == "[DONE]"
        assert all("usage" not in e for e in events[:-1])
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        assert events[-2]["kvmesh"]["reused_tokens"] == 16


async def test_auth_and_tenants(kafka_settings: KafkaSettings, echo_worker: EchoWorker) -> None:
    async with intake(make_settings(kafka_settings)) as (_, http):
        for headers in ({}, auth("sk-wrong"), {"Authorization": KEY_A}, {"Authorization": "Basic abc"}):
            r = await http.post("/v1/chat/completions", json=chat_body("x"), headers=headers)
            assert r.status_code == 401, headers
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
            assert set(err) == {"message", "type", "param", "code"}
        assert (await http.get("/v1/models")).status_code == 401
        assert echo_worker.requests == []

        # The tenant comes from the key only: a body that names one is refused, not half obeyed.
        evil = await http.post(
            "/v1/chat/completions", json=chat_body("x", tenant="evil"), headers=auth(KEY_A)
        )
        assert evil.status_code == 400 and evil.json()["error"]["param"] == "tenant"
        same = chat_body("the same prompt for both tenants, long enough to fill two blocks")
        ra = await http.post("/v1/chat/completions", json=same, headers=auth(KEY_A))
        rb = await http.post("/v1/chat/completions", json=same, headers=auth(KEY_B))
        assert ra.status_code == rb.status_code == 200
        a, b = echo_worker.requests[-2:]
        assert (a.tenant, b.tenant) == ("tenantA", "tenantB")
        assert (a.namespace, b.namespace) == (tenant_namespace("tenantA"), tenant_namespace("tenantB"))
        assert a.token_ids == b.token_ids
        assert len(a.block_hashes) >= 2
        assert not set(a.block_hashes) & set(b.block_hashes)


async def test_dev_mode_without_keys(
    kafka_settings: KafkaSettings, echo_worker: EchoWorker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvmesh")
    async with intake(make_settings(kafka_settings, api_keys=None)) as (_, http):
        r = await http.post("/v1/chat/completions", json=chat_body("x"))
        assert r.status_code == 200
        assert echo_worker.requests[-1].tenant == "default"
    assert sum("dev mode" in rec.getMessage() for rec in caplog.records) == 1


async def test_validation_errors(kafka_settings: KafkaSettings, echo_worker: EchoWorker) -> None:
    settings = make_settings(kafka_settings, max_context=200, tenant_max_prompt_tokens={"tenantB": 20})
    async with intake(settings) as (_, http):

        async def post(body: Any, key: str = KEY_A, raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
            if raw is not None:
                headers = {**auth(key), "Content-Type": "application/json"}
                r = await http.post("/v1/chat/completions", content=raw, headers=headers)
            else:
                r = await http.post("/v1/chat/completions", json=body, headers=auth(key))
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            return r.status_code, err

        status, err = await post(None, raw=b"{not json")
        assert (status, err["code"]) == (400, "invalid_json")
        status, err = await post(None, raw=b"[1, 2]")
        assert (status, err["code"]) == (400, "invalid_json")
        status, err = await post({"model": "kvmesh-tiny"})
        assert (status, err["param"]) == (400, "messages")
        status, err = await post(chat_body("x", messages=[]))
        assert (status, err["param"], err["type"]) == (400, "messages", "invalid_request_error")
        status, err = await post(chat_body("x", messages=[{"role": "wizard", "content": "hi"}]))
        assert (status, err["param"]) == (400, "messages[0].role")
        image = {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}
        status, err = await post(chat_body("x", messages=[{"role": "user", "content": [image]}]))
        assert (status, err["param"]) == (400, "messages[0].content[0].image_url")
        assert "text only" in err["message"]
        status, err = await post(chat_body("x", messages=[{"role": "user", "content": [{"type": "image"}]}]))
        assert (status, err["param"]) == (400, "messages[0].content[0].type")
        status, err = await post(chat_body("x", model="gpt-9"))
        assert (status, err["code"], err["param"]) == (404, "model_not_found", "model")
        status, err = await post(chat_body("x", max_tokens=199))
        assert (status, err["code"], err["param"]) == (400, "context_length_exceeded", "max_tokens")
        status, err = await post(chat_body("y" * 300))
        assert (status, err["code"]) == (400, "context_length_exceeded")
        status, err = await post(chat_body("x", temperature=5))
        assert (status, err["param"]) == (400, "temperature")
        status, err = await post(chat_body("x", max_tokens=0))
        assert (status, err["param"]) == (400, "max_tokens")
        # tenantB's prompt limit is 20 tokens; tenantA has none.
        status, err = await post(chat_body("a prompt that is over twenty tokens"), key=KEY_B)
        assert (status, err["code"]) == (400, "context_length_exceeded")
        assert echo_worker.requests == []
        ok = await http.post(
            "/v1/chat/completions", json=chat_body("a prompt that is over twenty tokens"), headers=auth()
        )
        assert ok.status_code == 200


async def test_fleet_failures_map_to_errors(kafka_settings: KafkaSettings, echo_worker: EchoWorker) -> None:
    async with intake(make_settings(kafka_settings, request_timeout_s=1.0)) as (app, http):
        r = await http.post("/v1/chat/completions", json=chat_body("fail now"), headers=auth())
        assert (r.status_code, r.json()["error"]["code"]) == (502, "worker_error")
        r = await http.post("/v1/chat/completions", json=chat_body("reject now"), headers=auth())
        assert (r.status_code, r.json()["error"]["code"]) == (503, "rejected")
        r = await http.post("/v1/chat/completions", json=chat_body("fail", stream=True), headers=auth())
        assert r.status_code == 502  # failed before any token: still a proper status
        r = await http.post("/v1/chat/completions", json=chat_body("hang on"), headers=auth())
        assert (r.status_code, r.json()["error"]["type"]) == (504, "timeout_error")
        cancel = await echo_worker.wait_cancel(echo_worker.requests[-1].request_id)
        assert cancel.session_id == echo_worker.requests[-1].session_id
        # A stream that times out after its first token ends with an error event and [DONE].
        r = await http.post("/v1/chat/completions", json=chat_body("slow one", stream=True), headers=auth())
        assert r.status_code == 200
        events = _sse_events(r.text)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "timeout"
        await echo_worker.wait_cancel(echo_worker.requests[-1].request_id)
        assert app.state.service.in_flight == 0


async def test_backpressure_429(kafka_settings: KafkaSettings, echo_worker: EchoWorker) -> None:
    async with intake(make_settings(kafka_settings, max_inflight=1, retry_after_s=3)) as (app, http):
        service = app.state.service
        held = asyncio.create_task(http.post("/v1/chat/completions", json=chat_body("hang"), headers=auth()))
        async with asyncio.timeout(20):
            while not echo_worker.requests:
                await asyncio.sleep(0.02)
        assert service.in_flight == 1
        r = await http.post("/v1/chat/completions", json=chat_body("x"), headers=auth())
        assert r.status_code == 429
        assert r.headers["Retry-After"] == "3"
        assert r.json()["error"]["type"] == "rate_limit_error"
        # The official client sees it as what its retry logic keys on: RateLimitError + Retry-After.
        client = openai.AsyncOpenAI(
            base_url="http://intake.test/v1", api_key=KEY_A, http_client=http, max_retries=0
        )
        with pytest.raises(openai.RateLimitError) as info:
            await client.chat.completions.create(
                model="kvmesh-tiny", messages=[{"role": "user", "content": "x"}]
            )
        assert info.value.status_code == 429 and info.value.response.headers["retry-after"] == "3"
        assert info.value.code == "too_many_requests"
        metrics = (await http.get("/metrics")).text
        assert 'kvmesh_intake_requests_total{outcome="too_many_requests"} 2.0' in metrics
        assert "kvmesh_intake_in_flight 1.0" in metrics
        held.cancel()
        with pytest.raises(asyncio.CancelledError):
            await held
        # The abandoned request is cancelled in the fleet and its slot is free again.
        await echo_worker.wait_cancel(echo_worker.requests[0].request_id)
        assert service.in_flight == 0
        assert (
            await http.post("/v1/chat/completions", json=chat_body("x"), headers=auth())
        ).status_code == 200


async def test_stream_disconnect_cancels_in_fleet(
    kafka_settings: KafkaSettings, echo_worker: EchoWorker
) -> None:
    from services.intake.app import create_app

    app = create_app(make_settings(kafka_settings))
    body = json.dumps(chat_body("slow story", stream=True)).encode()
    first_body = asyncio.Event()
    sent: list[MutableMapping[str, Any]] = []
    received = [0]

    async def receive() -> dict[str, Any]:
        received[0] += 1
        if received[0] == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        await first_body.wait()  # the disconnect listener: the client leaves after the first chunk
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            first_body.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"authorization", f"Bearer {KEY_A}".encode()), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    async with app.router.lifespan_context(app):
        async with asyncio.timeout(20):
            await app(scope, receive, send)
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        req = echo_worker.requests[-1]
        cancel = await echo_worker.wait_cancel(req.request_id)
        assert (cancel.session_id, cancel.reason) == (req.session_id, "client_disconnected")
        assert app.state.service.in_flight == 0


async def test_secrets_never_logged(
    kafka_settings: KafkaSettings, echo_worker: EchoWorker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    kafka = kafka_settings.model_copy(update={"sasl_password": SecretStr("kafka-pass-s3cr3t")})
    settings = make_settings(kafka)
    async with intake(settings) as (app, http):
        await http.post("/v1/chat/completions", json=chat_body("x"), headers=auth(KEY_A))
        await http.post("/v1/chat/completions", json=chat_body("x"), headers=auth("sk-guess-xyz-4242"))
        await http.post("/v1/chat/completions", json=chat_body("x", stream=True), headers=auth(KEY_B))
        reprs = (
            repr(settings)
            + repr(app.state.service)
            + repr(app.state.service.keys)
            + repr(app.state.service.client)
        )
    text = caplog.text + reprs + "".join(repr(r.__dict__) for r in caplog.records)
    for secret in (KEY_A, KEY_B, "sk-guess-xyz-4242", "kafka-pass-s3cr3t", "tenantA,"):
        assert secret not in text
    assert "dev mode" not in caplog.text


async def test_several_intakes_side_by_side_each_get_their_own_replies(
    kafka_settings: KafkaSettings, echo_worker: EchoWorker
) -> None:
    """Intakes scale out side by side: on the shared reply topic each drops the others' replies; with
    a reply topic of its own (KVMESH_INTAKE_REPLY_TOPIC) it never reads them at all."""
    shared_a = make_settings(kafka_settings, intake_id="intake-a")
    shared_c = make_settings(kafka_settings, intake_id="intake-c")
    own_b = make_settings(kafka_settings, intake_id="intake-b", reply_topic="kvmesh.replies.intake-b")
    async with (
        intake(shared_a) as (app_a, http_a),
        intake(own_b) as (app_b, http_b),
        intake(shared_c) as (app_c, http_c),
    ):
        asks = [
            (http, f"from {name} {i}")
            for i in range(3)
            for name, http in (("a", http_a), ("b", http_b), ("c", http_c))
        ]
        replies = await asyncio.gather(
            *(http.post("/v1/chat/completions", json=chat_body(text), headers=auth()) for http, text in asks)
        )
        for (_, text), r in zip(asks, replies, strict=True):
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "echo:" + text
        clients = {name: app.state.service.client for name, app in (("a", app_a), ("b", app_b), ("c", app_c))}
        # a and c share the topic: each saw (and dropped) the other's replies; b saw none of theirs
        async with asyncio.timeout(10):
            while not (clients["a"].router.ignored and clients["c"].router.ignored):
                await asyncio.sleep(0.05)
        assert clients["b"].router.ignored == 0
        assert {r.reply_topic for r in echo_worker.requests} == {"kvmesh.replies", "kvmesh.replies.intake-b"}
