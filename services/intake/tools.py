"""Tool calling: what the request asks for, how the output is constrained, and how it is parsed.

The tools go into the prompt through the model's chat template (only a template that renders
``tools`` supports them). The model then answers in the Hermes convention that such templates teach,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. How each ``tool_choice`` is honoured:

  * ``auto`` (the default with tools): the output is parsed; calls become ``tool_calls``, the text
    outside them stays ``content``;
  * ``required``: the output is constrained (structured output decoding) to a JSON array of
    ``{"name", "arguments"}`` objects whose names and arguments match the tools' schemas (one item
    when ``parallel_tool_calls`` is false), as vLLM's server does;
  * a named function: the output is constrained to that function's parameter schema; it is the call;
  * ``none``: the tools are rendered, no call is parsed.

Constrained decoding needs an engine that has it, so tools need the ``tools`` engine feature.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from schemas.messages import StructuredOutput
from services.intake.errors import InvalidRequest
from services.intake.openai_models import ChatCompletionRequest, NamedToolChoice

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["auto", "required", "named", "none"]
    #: The tools as the chat template gets them (OpenAI's ``{"type": "function", "function": ...}``).
    tools: list[dict[str, Any]] = field(default_factory=list)
    name: str | None = None
    parallel: bool = True

    def structured(self) -> StructuredOutput | None:
        """The constraint that forces the call (``required`` and named), else None."""
        params = {t["function"]["name"]: t["function"].get("parameters") or _ANY_OBJECT for t in self.tools}
        if self.mode == "named":
            assert self.name is not None
            return StructuredOutput("json_schema", json.dumps(params[self.name]))
        if self.mode == "required":
            item = {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"type": "string", "enum": [name]}, "arguments": schema},
                        "required": ["name", "arguments"],
                        # a call is a name and its arguments, nothing else
                        "additionalProperties": False,
                    }
                    for name, schema in params.items()
                ]
            }
            array: dict[str, Any] = {"type": "array", "minItems": 1, "items": item}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutput("json_schema", json.dumps(array))
        return None

    def parse(self, text: str, call_id: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of the generated ``text``; a forced call that does not parse (cut by
        max_tokens) stays content, with no call."""
        calls: list[tuple[str, Any]] = []
        content: str | None = text
        if self.mode == "named":
            try:
                calls = [(self.name or "", json.loads(text))]
                content = None
            except ValueError:
                pass
        elif self.mode == "required":
            try:
                items = json.loads(text)
                calls = [(str(i["name"]), i.get("arguments", {})) for i in items]
                content = None
            except (ValueError, TypeError, KeyError):
                calls = []
        elif self.mode == "auto":
            known = {t["function"]["name"] for t in self.tools}
            for m in _CALL.finditer(text):
                try:
                    obj = json.loads(m.group(1))
                except ValueError:
                    continue
                if isinstance(obj, dict) and obj.get("name") in known:
                    calls.append((str(obj["name"]), obj.get("arguments", {})))
            if calls:
                rest = _CALL.sub("", text).strip()
                content = rest or None
        return content, [
            {
                "id": f"call_{call_id}_{i}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
            for i, (name, args) in enumerate(calls)
        ]


def plan_tools(body: ChatCompletionRequest) -> ToolPlan | None:
    """The tool plan of ``body`` (None without tools); a choice naming no given tool is a 400."""
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise InvalidRequest("'tool_choice' needs 'tools'.", param="tool_choice")
        return None
    tools = [t.model_dump(exclude_none=True, by_alias=True) for t in body.tools]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("Tool names must be unique.", param="tools")
    parallel = body.parallel_tool_calls is not False
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    if isinstance(choice, NamedToolChoice):
        name = choice.function.get("name")
        if name not in names:
            raise InvalidRequest(
                f"'tool_choice' names the function {name!r}, which is not in 'tools'.", param="tool_choice"
            )
        return ToolPlan("named", tools, name, parallel)
    return ToolPlan(choice, tools, None, parallel)


def template_messages(body: ChatCompletionRequest) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(role, content, [(tool name, arguments JSON)]) per message, for the chat template."""
    out = []
    for m in body.messages:
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        for name, args in calls:
            try:
                json.loads(args)
            except ValueError:
                raise InvalidRequest(
                    f"The arguments of tool call {name!r} are not JSON.", param="messages"
                ) from None
        out.append((m.role, m.text(), calls))
    return out
