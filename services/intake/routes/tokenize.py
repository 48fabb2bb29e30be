"""``POST /tokenize`` and ``POST /detokenize``: vLLM's server endpoints, over the served model's tokenizer.

Benchmark clients (``vllm bench serve``) use them to check that the prompts they built locally have
the length the server sees; a client can also count a prompt's tokens before it sends it. As on
vLLM's server, only ``/v1`` paths need an API key: these read the served model's tokenizer, which is
no tenant's data, and run nothing in the fleet (``vllm bench serve`` calls them without a key).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from kvmesh_core.tokenizer import ChatMessage, render_chat
from services.intake.errors import InvalidRequest, ModelNotFound
from services.intake.openai_models import Message
from services.intake.request_body import parse_body
from services.intake.routes.deps import ServiceDep

router = APIRouter()


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)


@router.post("/tokenize", response_model=None)
async def tokenize(request: Request, service: ServiceDep) -> Response:
    body = await parse_body(request, TokenizeRequest, service.settings.max_body_bytes)
    _check_model(service.settings.model_name, body.model)
    tok = service.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("Give exactly one of 'prompt' and 'messages'.", param="prompt")
    if body.messages is not None:
        try:
            msgs = [ChatMessage(m.role, m.text()) for m in body.messages]
            ids = render_chat(tok, msgs, add_generation_prompt=body.add_generation_prompt)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="messages") from None
    else:
        assert body.prompt is not None
        ids = tok.encode(body.prompt)
        if body.add_special_tokens:
            ids = [tok.bos_id, *ids]  # as /v1/completions renders a text prompt
    out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": service.settings.max_context}
    return JSONResponse(out)


@router.post("/detokenize", response_model=None)
async def detokenize(request: Request, service: ServiceDep) -> Response:
    body = await parse_body(request, DetokenizeRequest, service.settings.max_body_bytes)
    _check_model(service.settings.model_name, body.model)
    if any(t < 0 or t >= service.tokenizer.vocab_size for t in body.tokens):
        raise InvalidRequest("A token id is outside the vocabulary.", param="tokens")
    return JSONResponse({"prompt": service.tokenizer.decode(body.tokens)})


def _check_model(served: str, model: str | None) -> None:
    if model is not None and model != served:
        raise ModelNotFound(f"The model '{model}' does not exist.", param="model")
