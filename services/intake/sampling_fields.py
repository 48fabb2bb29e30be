"""From validated OpenAI fields to wire types: structured output, legacy prompts, the prepared job."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvmesh_core.tokenizer import Tokenizer
from schemas.messages import ChatRequest, StructuredOutput
from services.intake.errors import InvalidRequest
from services.intake.openai_models import ResponseFormat
from services.intake.tools import ToolPlan

#: OpenAI's default ``max_tokens`` of the legacy completions endpoint (chat has no small default).
LEGACY_DEFAULT_MAX_TOKENS = 16

#: The request field that needs each engine feature, for the 400 that names it.
FEATURE_PARAMS = {
    "stop": "stop",
    "logprobs": "logprobs",
    "penalties": "presence_penalty",
    "min_tokens": "min_tokens",
    "ignore_eos": "ignore_eos",
    "json_object": "response_format",
    "json_schema": "response_format",
    "tools": "tools",
}


@dataclass
class Prepared:
    """One HTTP request as the fleet runs it: ``requests[i]`` is choice ``i`` (prompt ``i // n``)."""

    id: str
    requests: list[ChatRequest]
    prompt_count: int
    n: int
    tools: ToolPlan | None = None
    #: Legacy ``echo``: each prompt's text, put before its choices' text.
    echo: list[str] = field(default_factory=list)


def structured_output(fmt: ResponseFormat | None) -> StructuredOutput | None:
    """The constraint ``response_format`` asks for (None for plain text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json_object")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise InvalidRequest(
            "'response_format.json_schema.schema' is required for type json_schema.",
            param="response_format.json_schema",
        )
    return StructuredOutput("json_schema", json.dumps(fmt.json_schema.schema_))


def completion_prompts(
    prompt: str | list[str] | list[int] | list[list[int]], tokenizer: Tokenizer
) -> list[list[int]]:
    """Token ids of each prompt of a legacy request. Text gets the model's BOS first, as engines'
    own completions endpoints add it; token ids are taken as they are."""
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]  # type: ignore[arg-type]  # all() above: a list of ints
    else:
        items = list(prompt)  # type: ignore[arg-type]  # strings or lists of ints
    if not items:
        raise InvalidRequest("'prompt' must not be empty.", param="prompt")
    out = []
    for i, p in enumerate(items):
        ids = [tokenizer.bos_id, *tokenizer.encode(p)] if isinstance(p, str) else list(p)
        if not ids or (isinstance(p, str) and not p):
            raise InvalidRequest(f"prompt[{i}] is empty.", param="prompt")
        if any(t < 0 or t >= tokenizer.vocab_size for t in ids):
            raise InvalidRequest(f"prompt[{i}] holds a token id outside the vocabulary.", param="prompt")
        out.append(ids)
    return out
