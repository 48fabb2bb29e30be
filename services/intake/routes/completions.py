"""``POST /v1/completions``: OpenAI's legacy text completions, which many benchmark clients use.

Same routing, cache reporting (``usage``, ``kvmesh``) and errors as chat; a prompt is text (the
model's BOS is put first) or token ids, one or a batch; ``echo`` puts the prompt before the text.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from kvmesh_core.tokenizer import Tokenizer
from services.intake.generation import ChoiceResult, Delta
from services.intake.openai_format import (
    kvmesh_body,
    kvmesh_extension,
    legacy_chunk,
    legacy_logprobs,
    usage,
    usage_chunk,
)
from services.intake.openai_models import CompletionRequest
from services.intake.routes.deps import ServiceDep
from services.intake.routes.fleet_run import created_now, serve
from services.intake.sampling_fields import Prepared

router = APIRouter()


class LegacyRenderer:
    def __init__(self, body: CompletionRequest, prepared: Prepared, tokenizer: Tokenizer) -> None:
        self.model = body.model
        self.prepared = prepared
        self.tok = tokenizer
        self.id = f"cmpl-{prepared.id}"
        self.created = created_now()
        self.include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
        self._offsets = {i: len(self._echo(i)) for i in range(len(prepared.requests))}

    def _echo(self, index: int) -> str:
        return self.prepared.echo[index // self.prepared.n] if self.prepared.echo else ""

    def _chunk(self, index: int, text: str, **kw: Any) -> dict[str, Any]:
        return legacy_chunk(self.id, self.created, self.model, index, text, **kw)

    def _logprobs(self, index: int, d_logprobs: list[Any], text: str) -> dict[str, Any] | None:
        if not d_logprobs:
            return None
        lp = legacy_logprobs(self.tok, d_logprobs, self._offsets[index])
        self._offsets[index] += sum(len(t) for t in lp["tokens"])
        return lp

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk(i, self._echo(i)) for i in range(len(self.prepared.requests)) if self._echo(i)]

    def delta(self, d: Delta) -> list[dict[str, Any]]:
        if not (d.text or d.logprobs):
            return []
        return [self._chunk(d.index, d.text, logprobs=self._logprobs(d.index, d.logprobs, d.text))]

    def final(self, r: ChoiceResult) -> list[dict[str, Any]]:
        last = self._chunk(r.index, r.tail, finish_reason=r.finish_reason)
        last["kvmesh"] = kvmesh_extension(r.completion, self.prepared.requests[0].session_id)
        return [last]

    def usage_chunk(self, results: list[ChoiceResult]) -> dict[str, Any]:
        body = usage_chunk(
            self.id, self.created, self.model, "text_completion", usage(results, self.prepared.n)
        )
        body["kvmesh"] = kvmesh_body(results, self.prepared.requests[0].session_id)
        return body

    def body(self, results: list[ChoiceResult]) -> dict[str, Any]:
        wants = self.prepared.requests[0].sampling.logprobs is not None
        choices = [
            {
                "index": r.index,
                "text": self._echo(r.index) + r.text,
                "finish_reason": r.finish_reason,
                "logprobs": legacy_logprobs(self.tok, r.logprobs, len(self._echo(r.index)))
                if wants
                else None,
            }
            for r in results
        ]
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(results, self.prepared.n),
            "kvmesh": kvmesh_body(results, self.prepared.requests[0].session_id),
        }


@router.post("/v1/completions", response_model=None)
async def completions(request: Request, service: ServiceDep) -> Response:
    return await serve(
        request,
        service,
        CompletionRequest,
        lambda b, tenant, hint: service.prepare_completion(b, tenant=tenant, session_hint=hint),
        lambda b, prepared: LegacyRenderer(b, prepared, service.tokenizer),
    )
