"""Every request field is honoured or refused: the rule that keeps output from being silently wrong.

A field kvmesh does not declare in :mod:`services.intake.openai_models` is refused with a 400 naming
it, unless its value is one that asks for nothing (``null``, OpenAI's own defaults such as
``store: false`` or an empty ``logit_bias``): SDKs and benchmark clients send those, and accepting them
changes no output. Declared fields whose value kvmesh cannot honour are refused where they are turned
into wire types (:mod:`services.intake.sampling_fields`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from services.intake.errors import InvalidRequest

#: Undeclared fields, and the values of them that ask for nothing.
NOOP_VALUES: dict[str, Callable[[Any], bool]] = {
    "logit_bias": lambda v: v == {},
    "store": lambda v: v is False,
    "service_tier": lambda v: v in ("auto", "default"),
    "modalities": lambda v: v == ["text"],
    "top_k": lambda v: v in (-1, 0),  # vLLM's "off"
    "include_obfuscation": lambda v: v is False,  # stream_options: padding only, no content
    "metadata": lambda v: v == {},
    "safety_identifier": lambda v: isinstance(v, str),  # an abuse-tracking id: no effect on output
    "suffix": lambda v: v == "",
    "refusal": lambda v: True,  # an assistant message sent back as the SDK returned it
    "annotations": lambda v: v == [],
}

#: Why a field is refused, where more can be said than "not supported".
WHY: dict[str, str] = {
    "functions": "use 'tools' instead",
    "function_call": "use 'tool_choice' instead",
    "name": "participant names are not rendered by the chat template",
    "suffix": "insertion (fill-in-the-middle) is not supported",
    "logit_bias": "logit bias is not supported",
    "top_k": "top-k sampling is not supported; use top_p",
    "image_url": "this model reads text only",
    "input_audio": "this model reads text only",
    "file": "this model reads text only",
}


def refuse_unknown(data: dict[str, Any], model: type[BaseModel], where: str = "") -> None:
    """Raise InvalidRequest (400, ``unsupported_parameter``) for the first field of ``data`` that
    ``model`` does not declare and whose value asks for something."""
    declared = set()
    for name, f in model.model_fields.items():
        declared.add(name)
        if f.alias:
            declared.add(f.alias)
    for key, value in data.items():
        if key in declared or value is None:
            continue
        noop = NOOP_VALUES.get(key)
        if noop is not None and noop(value):
            continue
        param = f"{where}{key}"
        why = WHY.get(key, "kvmesh does not support it")
        raise InvalidRequest(
            f"Unsupported parameter: '{param}': {why}.", param=param, code="unsupported_parameter"
        )


def refuse_unknown_nested(body: BaseModel, data: dict[str, Any]) -> None:
    """:func:`refuse_unknown` over ``data`` and every object inside it that a model declares."""
    _nested(body, data, "")


def _nested(value: BaseModel, raw: dict[str, Any], where: str) -> None:
    if type(value).__name__ in ("FunctionDef", "JsonSchemaFormat"):
        return  # tool and schema definitions are the user's data, passed on whole
    refuse_unknown(raw, type(value), where)
    for name in type(value).model_fields:
        v = getattr(value, name)
        r = raw.get(name)
        if isinstance(v, BaseModel) and isinstance(r, dict):
            _nested(v, r, f"{where}{name}.")
        elif isinstance(v, list) and isinstance(r, list):
            for i, (vi, ri) in enumerate(zip(v, r, strict=False)):
                if isinstance(vi, BaseModel) and isinstance(ri, dict):
                    _nested(vi, ri, f"{where}{name}[{i}].")
