"""Strict conversion between plain MessagePack values and message dataclasses.

Each message type is a frozen dataclass. A converter is built once per class from its type hints and
checks every field on decode: required fields present, exact types (``bool`` is not an ``int``), and
nested messages converted recursively. Unknown fields are skipped so that an old reader can read a
newer writer's records (schema evolution: new fields are appended with defaults, never retyped).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from functools import cache
from typing import Any, TypeVar, Union

from schemas.errors import InvalidPayload

T = TypeVar("T")

Converter = Callable[[Any, str], Any]


def _fail(path: str, want: str, got: Any) -> typing.NoReturn:
    raise InvalidPayload(f"{path}: expected {want}, got {type(got).__name__}")


def _scalar(kind: type) -> Converter:
    def conv(value: Any, path: str) -> Any:
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                _fail(path, "float", value)
            return float(value)
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                _fail(path, "int", value)
            return value
        if not isinstance(value, kind):
            _fail(path, kind.__name__, value)
        return value

    return conv


def _converter(hint: Any) -> Converter:
    origin = typing.get_origin(hint)
    if hint is Any:
        return lambda v, p: v
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        optional = type(None) in args
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported union {hint!r}")
        conv = _converter(inner[0])

        def opt(value: Any, path: str) -> Any:
            if value is None and optional:
                return None
            return conv(value, path)

        return opt
    if origin is list or origin is tuple:
        (item,) = typing.get_args(hint)[:1]
        conv = _converter(item)
        as_tuple = origin is tuple
        fast = item if item in (int, str) else None

        def seq(value: Any, path: str) -> Any:
            if not isinstance(value, list | tuple):
                _fail(path, "array", value)
            # Token id lists are long: one C-level pass instead of a call per element.
            if fast is not None and (not value or set(map(type, value)) == {fast}):
                return tuple(value) if as_tuple else list(value)
            out = [conv(v, f"{path}[{i}]") for i, v in enumerate(value)]
            return tuple(out) if as_tuple else out

        return seq
    if origin is dict:
        kconv, vconv = (_converter(a) for a in typing.get_args(hint))

        def mapping(value: Any, path: str) -> Any:
            if not isinstance(value, dict):
                _fail(path, "map", value)
            return {kconv(k, f"{path}.key"): vconv(v, f"{path}[{k!r}]") for k, v in value.items()}

        return mapping
    if typing.get_origin(hint) is typing.Literal:
        allowed = typing.get_args(hint)

        def literal(value: Any, path: str) -> Any:
            if value not in allowed or isinstance(value, bool) != any(isinstance(a, bool) for a in allowed):
                raise InvalidPayload(f"{path}: expected one of {allowed!r}, got {value!r}")
            return value

        return literal
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return lambda v, p: from_plain(hint, v, p)
    if hint in (int, float, str, bool, bytes):
        return _scalar(hint)
    raise TypeError(f"unsupported field type {hint!r}")


@cache
def _fields(cls: type) -> tuple[tuple[str, Converter, bool], ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append((f.name, _converter(hints[f.name]), required))
    return tuple(out)


def from_plain(cls: type[T], value: Any, path: str = "payload") -> T:
    """Build ``cls`` from a decoded MessagePack map, validating every field; raises InvalidPayload."""
    if not isinstance(value, dict):
        _fail(path, f"map for {cls.__name__}", value)
    kwargs: dict[str, Any] = {}
    for name, conv, required in _fields(cls):
        if name in value:
            kwargs[name] = conv(value[name], f"{path}.{name}")
        elif required:
            raise InvalidPayload(f"{path}.{name}: required field missing")
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as exc:  # __post_init__ bound checks raise ValueError
        raise InvalidPayload(f"{path}: {exc}") from exc
    return obj


def to_plain(obj: Any) -> Any:
    """A message dataclass as plain maps, arrays and scalars for MessagePack."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        if obj and type(obj[0]) in (int, float, str, bytes):
            return list(obj)  # long scalar arrays (token ids, hashes) need no per-item walk
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj
