"""Drivers: how one turn reaches the fleet (the producer SDK over Kafka, or intake's HTTP API) and
what came back."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from kvmesh.workloads import Session
from streams.settings import KafkaSettings


@dataclass(slots=True)
class Served:
    """What a driver learned about one request (times from ``time.perf_counter``)."""

    first_token_t: float
    done_t: float
    worker_id: str
    prompt_tokens: int
    reused_tokens: int
    fetched_tokens: int
    recomputed_tokens: int
    output_token_ids: list[int]
    worker_ttft_ms: float
    worker_e2e_ms: float
    finish_reason: str
    error: str | None = None


class Driver(Protocol):
    """Submits one turn and follows it to its end; owns its connection to the fleet."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def serve(
        self,
        session: Session,
        prompt: list[int],
        appended: Sequence[int],
        max_tokens: int,
        request_id: str,
    ) -> Served: ...


class SdkDriver:
    """Token ids straight to ``kvmesh.requests`` through the producer SDK; replies from its reply topic."""

    def __init__(self, kafka: KafkaSettings, timeout_s: float = 120.0) -> None:
        from kvmesh_client import KvmeshClient

        self.client = KvmeshClient(kafka, client_id=f"bench-fleet-{uuid.uuid4().hex[:8]}")
        self.timeout_s = timeout_s

    async def start(self) -> None:
        await self.client.start()

    async def stop(self) -> None:
        await self.client.stop()

    async def serve(
        self,
        session: Session,
        prompt: list[int],
        appended: Sequence[int],
        max_tokens: int,
        request_id: str,
    ) -> Served:
        req = self.client.build_request(
            token_ids=prompt,
            session_id=session.session_id,
            tenant=session.tenant,
            max_tokens=max_tokens,
            request_id=request_id,
            public_prefix_tokens=session.public_prefix_tokens,
        )
        handle = await self.client.submit(req)
        first: float | None = None
        try:
            async for _chunk in handle.stream(timeout=self.timeout_s):
                if first is None:
                    first = time.perf_counter()
            c = await handle.result(timeout=self.timeout_s)
        finally:
            handle.close()
        done = time.perf_counter()
        return Served(
            first_token_t=first if first is not None else done,
            done_t=done,
            worker_id=c.worker_id,
            prompt_tokens=c.prompt_tokens,
            reused_tokens=c.reused_tokens,
            fetched_tokens=c.fetched_tokens,
            recomputed_tokens=c.recomputed_tokens,
            output_token_ids=list(c.output_token_ids),
            worker_ttft_ms=c.ttft_ms,
            worker_e2e_ms=c.e2e_ms,
            finish_reason=c.finish_reason,
            error=c.error,
        )


class HttpDriver:
    """Intake's streaming chat API. Token ids travel as text (one character per byte, latin-1), each
    session's messages grow turn by turn; intake's prefix-stable template keeps the reuse structure.

    Intake re-tokenizes as UTF-8, so bytes >= 128 count two prompt tokens and the chat template adds
    its own: prompts are longer than through the SDK. Only workers that served a request are known."""

    def __init__(self, url: str, timeout_s: float = 120.0, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._messages: dict[str, list[dict[str, str]]] = {}
        self._http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        self._http = httpx.AsyncClient(timeout=self.timeout_s)

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def serve(
        self,
        session: Session,
        prompt: list[int],
        appended: Sequence[int],
        max_tokens: int,
        request_id: str,
    ) -> Served:
        messages = self._messages.setdefault(session.session_id, [])
        messages.append({"role": "user", "content": bytes(appended).decode("latin-1")})
        body = {
            "model": "kvmesh-tiny",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "user": session.session_id,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        first: float | None = None
        text, error = "", None
        ext: dict[str, Any] = {}
        use: dict[str, Any] = {}
        assert self._http is not None, "driver not started"
        async with self._http.stream(
            "POST", f"{self.url}/v1/chat/completions", json=body, headers=self.headers
        ) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    first = first if first is not None else time.perf_counter()
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = str(event["error"])
                    for choice in event.get("choices", []):
                        text += choice.get("delta", {}).get("content") or ""
                    ext = event.get("kvmesh", ext)
                    use = event.get("usage", use)
        done = time.perf_counter()
        if session.carry_output:
            messages.append({"role": "assistant", "content": text})
        return Served(
            first_token_t=first if first is not None else done,
            done_t=done,
            worker_id=str(ext.get("worker", "?")),
            prompt_tokens=int(use.get("prompt_tokens", len(prompt))),
            reused_tokens=int(ext.get("reused_tokens", 0)),
            fetched_tokens=int(ext.get("fetched_tokens", 0)),
            recomputed_tokens=int(ext.get("recomputed_tokens", 0)),
            output_token_ids=list(text.encode()),
            worker_ttft_ms=float(ext.get("ttft_ms", 0.0)),
            worker_e2e_ms=0.0,
            finish_reason="stop" if error is None else "error",
            error=error,
        )
