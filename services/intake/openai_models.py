"""HTTP models of the OpenAI chat and legacy completions APIs (what kvmesh honours of them).

Request bodies are validated here once; :mod:`services.intake.field_policy` refuses every field a
model here does not declare (a field accepted and then ignored would be silently wrong output), and
:mod:`services.intake.sampling_fields` turns what is declared into wire types.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.messages import MAX_TOP_LOGPROBS

#: Longest session hint (``user``, ``prompt_cache_key``, ``X-Session-Id``): it is the record key.
MAX_SESSION_HINT = 256

#: Roles the chat template renders ("developer" is the newer name of "system").
ROLES = ("system", "developer", "user", "assistant", "tool")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str = "{}"


class ToolCall(BaseModel):
    """An assistant message's earlier tool call, sent back in the history."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: dict[str, str]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(BaseModel):
    """The fields both endpoints share: sampling, limits, streaming, sessions."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # int64: what msgpack, torch's and vLLM's generators all take.
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_SESSION_HINT)
    n: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # vLLM's extensions, which benchmark clients send.
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    response_format: ResponseFormat | None = None
    # OpenAI's cache routing key: kvmesh's session hint when given.
    prompt_cache_key: str | None = Field(None, max_length=MAX_SESSION_HINT)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingFields):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    """The body of the legacy ``POST /v1/completions``: one prompt or a batch of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1)


FinishReason = Literal["stop", "length", "tool_calls"]
