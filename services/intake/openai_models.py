"""HTTP models of the OpenAI chat completions API (the subset kvmesh serves) and response builders.

Request bodies are validated here once and converted to wire types (``ChatMessage``,
``SamplingParams``) at the boundary; responses are plain dicts in the OpenAI shape plus one extension
field, ``kvmesh``, that says how the prompt was served.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvmesh.tokenizer import ChatMessage
from schemas.messages import Completion

#: Roles the chat template renders ("developer" is the newer name of "system").
ROLES = ("system", "developer", "user", "assistant", "tool")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, … are accepted and not used

    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The body of ``POST /v1/chat/completions``; unknown fields are ignored, as OpenAI SDKs send many."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Message]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None

    def chat_messages(self) -> list[ChatMessage]:
        return [ChatMessage(m.role, m.text()) for m in self.messages]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


FinishReason = Literal["stop", "length"]


def kvmesh_extension(c: Completion, request_id: str, session_id: str) -> dict[str, Any]:
    """The ``kvmesh`` field: where and how the prompt was served."""
    return {
        "request_id": request_id,
        "session_id": session_id,
        "worker": c.worker_id,
        "reused_tokens": c.reused_tokens,
        "fetched_tokens": c.fetched_tokens,
        "recomputed_tokens": c.recomputed_tokens,
        "ttft_ms": c.ttft_ms,
        "fallback": c.fallback,
    }


def usage(c: Completion) -> dict[str, Any]:
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": c.reused_tokens + c.fetched_tokens},
    }


def openai_finish_reason(c: Completion) -> FinishReason:
    return "length" if c.finish_reason == "length" else "stop"


def completion_body(
    *, completion_id: str, created: int, model: str, text: str, c: Completion, session_id: str
) -> dict[str, Any]:
    """A full ``chat.completion`` object."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": openai_finish_reason(c),
                "logprobs": None,
            }
        ],
        "usage": usage(c),
        "kvmesh": kvmesh_extension(c, c.request_id, session_id),
    }


def chunk_body(
    *,
    completion_id: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    choices: bool = True,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``choices=False`` gives the usage-only final chunk."""
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
        if choices
        else [],
    }
    return body


def models_body(model: str, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "kvmesh"}],
    }
