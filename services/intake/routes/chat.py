"""``POST /v1/chat/completions``: OpenAI's chat API, streaming (SSE) or not, n choices, tools."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from kvmesh_core.tokenizer import Tokenizer
from services.intake.generation import ChoiceResult, Delta
from services.intake.openai_format import (
    chat_chunk,
    chat_logprobs,
    kvmesh_body,
    kvmesh_extension,
    usage,
    usage_chunk,
)
from services.intake.openai_models import ChatCompletionRequest
from services.intake.routes.deps import ServiceDep
from services.intake.routes.fleet_run import created_now, serve
from services.intake.sampling_fields import Prepared

router = APIRouter()


class ChatRenderer:
    """Chat bodies. With tools (other than ``tool_choice: none``) a streamed choice's text is held
    until it ends, then sent as content and tool calls: a call is only known once its text parses."""

    def __init__(self, body: ChatCompletionRequest, prepared: Prepared, tokenizer: Tokenizer) -> None:
        self.model = body.model
        self.prepared = prepared
        self.tok = tokenizer
        self.id = f"chatcmpl-{prepared.id}"
        self.created = created_now()
        self.include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
        tools = prepared.tools
        self.tools = tools if tools is not None and tools.mode != "none" else None

    def _chunk(self, index: int, delta: dict[str, Any], **kw: Any) -> dict[str, Any]:
        return chat_chunk(self.id, self.created, self.model, index, delta, **kw)

    def _message(self, r: ChoiceResult) -> tuple[dict[str, Any], str]:
        """The choice's message and finish reason."""
        if self.tools is None:
            return {"role": "assistant", "content": r.text}, r.finish_reason
        content, calls = self.tools.parse(r.text, f"{self.prepared.id}_{r.index}")
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
            # OpenAI: a forced named call ends with "stop"; calls the model chose end with "tool_calls".
            return msg, ("stop" if self.tools.mode == "named" else "tool_calls")
        return msg, r.finish_reason

    def opening(self) -> list[dict[str, Any]]:
        return [
            self._chunk(i, {"role": "assistant", "content": ""}) for i in range(len(self.prepared.requests))
        ]

    def delta(self, d: Delta) -> list[dict[str, Any]]:
        if self.tools is not None or not (d.text or d.logprobs):
            return []
        lp = chat_logprobs(self.tok, d.logprobs) if d.logprobs else None
        return [self._chunk(d.index, {"content": d.text}, logprobs=lp)]

    def final(self, r: ChoiceResult) -> list[dict[str, Any]]:
        out = []
        if self.tools is not None:
            msg, reason = self._message(r)
            delta: dict[str, Any] = {}
            if msg["content"]:
                delta["content"] = msg["content"]
            if "tool_calls" in msg:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(msg["tool_calls"])]
            lp = chat_logprobs(self.tok, r.logprobs) if r.logprobs else None
            if delta or lp:
                out.append(self._chunk(r.index, delta, logprobs=lp))
        else:
            reason = r.finish_reason
            if r.tail:
                out.append(self._chunk(r.index, {"content": r.tail}))
        last = self._chunk(r.index, {}, finish_reason=reason)
        last["kvmesh"] = kvmesh_extension(r.completion, self.prepared.requests[0].session_id)
        out.append(last)
        return out

    def usage_chunk(self, results: list[ChoiceResult]) -> dict[str, Any]:
        body = usage_chunk(
            self.id, self.created, self.model, "chat.completion.chunk", usage(results, self.prepared.n)
        )
        body["kvmesh"] = kvmesh_body(results, self.prepared.requests[0].session_id)
        return body

    def body(self, results: list[ChoiceResult]) -> dict[str, Any]:
        choices = []
        for r in results:
            msg, reason = self._message(r)
            choices.append(
                {
                    "index": r.index,
                    "message": msg,
                    "finish_reason": reason,
                    "logprobs": chat_logprobs(self.tok, r.logprobs)
                    if r.logprobs or self._wants_logprobs()
                    else None,
                }
            )
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(results, self.prepared.n),
            "kvmesh": kvmesh_body(results, self.prepared.requests[0].session_id),
        }

    def _wants_logprobs(self) -> bool:
        return self.prepared.requests[0].sampling.logprobs is not None


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request, service: ServiceDep) -> Response:
    return await serve(
        request,
        service,
        ChatCompletionRequest,
        lambda b, tenant, hint: service.prepare_chat(b, tenant=tenant, session_hint=hint),
        lambda b, prepared: ChatRenderer(b, prepared, service.tokenizer),
    )
