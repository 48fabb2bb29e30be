"""Strict conversion between plain MessagePack values and message dataclasses.

Each message type is a frozen dataclass. A converter is built once per class from its type hints and
checks every field on decode: required fields present, exact types (``bool`` is not an ``int``), and
nested messages converted recursively. Unknown fields are skipped so that an old reader can read a
newer writer's records (schema evolution: new fields are appended with defaults, never retyped).

A field typed :data:`~schemas.token_ids.PackedTokenIds` (or ``PackedBlockHashes``) travels as
``bin`` (packed uint32 / uint64) and decodes to a :class:`~schemas.token_ids.TokenIds` (or
``BlockHashes``); a plain int array (what a writer of an older version sent) is still accepted and
checked element by element.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from functools import cache
from typing import Annotated, Any, TypeVar, Union

from schemas.construct import constructor
from schemas.errors import InvalidPayload
from schemas.token_ids import PackedInts, packed_marker

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


def _packed(hint: Any) -> type[PackedInts] | None:
    """The packed class of ``hint`` if it is ``Annotated[..., PACKED_U32 or PACKED_U64]``."""
    if typing.get_origin(hint) is not Annotated:
        return None
    marker = packed_marker(hint)
    return marker.cls if marker is not None else None


@cache
def _int_list() -> Converter:
    return _converter(list[int])


@cache
def _packed_converter(cls: type[PackedInts]) -> Converter:
    def conv(value: Any, path: str) -> PackedInts:
        if type(value) is cls:
            return value
        if isinstance(value, bytes | bytearray):
            try:
                return cls.from_bytes(bytes(value))
            except ValueError as exc:
                raise InvalidPayload(f"{path}: {exc}") from exc
        ints = _int_list()(value, path)  # a record of an older version: every element checked
        try:
            return cls(ints)
        except ValueError as exc:
            raise InvalidPayload(f"{path}: {exc}") from exc

    return conv


def _converter(hint: Any) -> Converter:
    origin = typing.get_origin(hint)
    if hint is Any:
        return lambda v, p: v
    if origin is Annotated:
        packed = _packed(hint)
        return _packed_converter(packed) if packed else _converter(typing.get_args(hint)[0])
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
        return lambda v, p: _checked_from_plain(hint, v, p)
    if hint in (int, float, str, bool, bytes):
        return _scalar(hint)
    raise TypeError(f"unsupported field type {hint!r}")


@cache
def _fields(cls: type) -> tuple[tuple[str, Converter, bool], ...]:
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append((f.name, _converter(hints[f.name]), required))
    return tuple(out)


def _checked_from_plain(cls: type[T], value: Any, path: str) -> T:
    """The reference decoder: one converter call per field, a precise error path on failure."""
    if not isinstance(value, dict):
        _fail(path, f"map for {cls.__name__}", value)
    kwargs: dict[str, Any] = {}
    for name, conv, required in _fields(typing.cast(type, cls)):
        if name in value:
            kwargs[name] = conv(value[name], f"{path}.{name}")
        elif required:
            raise InvalidPayload(f"{path}.{name}: required field missing")
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as exc:  # __post_init__ bound checks raise ValueError
        raise InvalidPayload(f"{path}: {exc}") from exc
    return obj


def from_plain(cls: type[T], value: Any, path: str = "payload") -> T:
    """Build ``cls`` from a decoded MessagePack map, validating every field; raises InvalidPayload.

    Lists in the result are copies, so the caller's ``value`` can change afterwards.
    """
    return _from_plain(cls, value, path, True)


def from_owned_plain(cls: type[T], value: Any, path: str = "payload") -> T:
    """As :func:`from_plain`, for a ``value`` nobody else holds (fresh from ``msgpack.unpackb``).

    The message takes over its lists instead of copying them.
    """
    return _from_plain(cls, value, path, False)


def _from_plain(cls: type[T], value: Any, path: str, copy: bool) -> T:
    try:
        return typing.cast(T, _fast_decoder(typing.cast(type, cls), copy)(value))
    except (_Reject, KeyError, TypeError, ValueError):
        # Something is not exactly as the fast path wants it: the reference decoder either accepts
        # it (e.g. an int subclass) or raises InvalidPayload with the path of the bad field.
        return _checked_from_plain(cls, value, path)


def to_plain(obj: Any) -> Any:
    """A message dataclass as plain maps, arrays and scalars for MessagePack."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _fast_encoder(type(obj))(obj)
    return _generic_to_plain(obj)


def _generic_to_plain(obj: Any) -> Any:
    if isinstance(obj, PackedInts):
        return obj.to_bytes()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _generic_to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        if obj and type(obj[0]) in (int, float, str, bytes):
            return list(obj)  # long scalar arrays (token ids, hashes) need no per-item walk
        return [_generic_to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _generic_to_plain(v) for k, v in obj.items()}
    return obj


# ---------------------------------------------------------------------------------------- fast paths
#
# Per message class, a decoder and an encoder are generated once as Python source with the field loop
# unrolled: one dict lookup and one exact ``type(x) is T`` test per field, no path strings, no per-field
# calls. The fast decoder only *accepts*: anything it does not recognise as exactly right (a missing
# field, a wrong or unusual type, a failing ``__post_init__``) raises, and ``_from_plain`` hands the
# value to the reference decoder above, which is the single definition of what is valid and produces
# the error message. So the fast path can be wrong only by being too strict, never too lenient.


class _Reject(Exception):
    """Raised by a generated decoder for a value it does not accept as is."""


_MISSING = object()


class _Gen:
    """Source lines and the names they refer to, for one generated function."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.env: dict[str, Any] = {"_Reject": _Reject, "_MISSING": _MISSING, "_set": set, "_map": map}
        self._n = 0

    def bind(self, value: Any, stem: str = "c") -> str:
        self._n += 1
        name = f"_{stem}{self._n}"
        self.env[name] = value
        return name

    def emit(self, indent: int, line: str) -> None:
        self.lines.append("    " * indent + line)

    def compile(self, name: str, arg: str) -> Callable[[Any], Any]:
        src = f"def {name}({arg}):\n" + "\n".join(self.lines) + "\n"
        exec(
            compile(src, f"<schemas.validate {name}>", "exec"), self.env
        )  # source built above from type hints only
        fn: Callable[[Any], Any] = self.env[name]
        return fn


_SCALARS = (int, str, bytes, bool)


def _emit_check(g: _Gen, hint: Any, var: str, indent: int, copy: bool) -> None:
    """Emit lines that leave an accepted value in ``var`` or raise."""
    origin = typing.get_origin(hint)
    if hint in _SCALARS:
        g.emit(indent, f"if type({var}) is not {g.bind(hint, 't')}: raise _Reject")
        return
    if origin is Annotated:
        packed = _packed(hint)
        if not packed:
            _emit_check(g, typing.get_args(hint)[0], var, indent, copy)
            return
        # Only the packed form is taken here; a bad length raises ValueError, and an int array (a
        # record of an older version) goes to the reference decoder.
        g.emit(indent, f"if type({var}) is not bytes: raise _Reject")
        g.emit(indent, f"{var} = {g.bind(packed.from_bytes, 'packed')}({var})")
        return
    if hint is float:
        # Like the reference decoder: an int is accepted for a float field (bool is not: type is bool).
        g.emit(indent, f"if type({var}) is not float:")
        g.emit(indent + 1, f"if type({var}) is not int: raise _Reject")
        g.emit(indent + 1, f"{var} = float({var})")
        return
    if hint is Any:
        return
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1 and type(None) in typing.get_args(hint):
            g.emit(indent, f"if {var} is not None:")
            _emit_check(g, inner[0], var, indent + 1, copy)
            return
    if origin is typing.Literal:
        allowed = typing.get_args(hint)
        if allowed and all(type(a) is str for a in allowed):
            g.emit(indent, f"if type({var}) is not str or {var} not in {g.bind(frozenset(allowed), 'lit')}:")
            g.emit(indent + 1, "raise _Reject")
            return
    if origin is list:
        (item,) = typing.get_args(hint)
        g.emit(indent, f"if type({var}) is not list: raise _Reject")
        if item in (int, str, float, bytes):
            # One C-level pass over the element types; bool is its own type, so a bool is rejected.
            only = g.bind(frozenset({item}), "only")
            g.emit(indent, f"if {var} and _set(_map(type, {var})) != {only}: raise _Reject")
            if copy:
                g.emit(indent, f"{var} = {var}.copy()")
            return
        if dataclasses.is_dataclass(item) and isinstance(item, type):
            sub = g.bind(_fast_decoder(item, copy), "dec")
            g.emit(indent, f"{var} = [{sub}(e) for e in {var}]")
            return
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        g.emit(indent, f"{var} = {g.bind(_fast_decoder(hint, copy), 'dec')}({var})")
        return
    # Anything else (maps, tuples, other unions and literals): the reference converter, whose error
    # sends the whole value to the reference decoder for its message.
    conv = g.bind(_converter(hint), "conv")
    g.emit(indent, "try:")
    g.emit(indent + 1, f"{var} = {conv}({var}, '')")
    g.emit(indent, f"except {g.bind(InvalidPayload, 'exc')}: raise _Reject")


@cache
def _fast_decoder(cls: type, copy: bool) -> Callable[[Any], Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = dataclasses.fields(cls)
    g = _Gen()
    g.emit(1, "if type(value) is not dict: raise _Reject")
    g.emit(1, "get = value.get")
    args: list[str] = []
    kwargs: list[str] = []
    for i, f in enumerate(fields):
        var = f"x{i}"
        if f.kw_only:
            kwargs.append(f"{f.name}={var}")
        else:
            args.append(var)
        name = repr(f.name)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            g.emit(1, f"{var} = value[{name}]")
            _emit_check(g, hints[f.name], var, 1, copy)
            continue
        g.emit(1, f"{var} = get({name}, _MISSING)")
        g.emit(1, f"if {var} is _MISSING:")
        if f.default is not dataclasses.MISSING:
            g.emit(2, f"{var} = {g.bind(f.default, 'default')}")
        else:
            g.emit(2, f"{var} = {g.bind(f.default_factory, 'factory')}()")
        g.emit(1, "else:")
        _emit_check(g, hints[f.name], var, 2, copy)
    if not all(f.init for f in fields):
        raise TypeError(f"{cls.__name__}: fields with init=False are not supported")
    make = constructor(cls)
    if make is cls:
        g.emit(1, f"return {g.bind(cls, 'cls')}({', '.join(args + kwargs)})")
    else:
        # every field in field order (keyword-only ones too): see schemas.construct
        g.emit(1, f"return {g.bind(make, 'make')}({', '.join(f'x{i}' for i in range(len(fields)))})")
    return g.compile(f"decode_{cls.__name__}", "value")


def _emit_plain(g: _Gen, hint: Any, expr: str) -> str:
    """An expression for the plain form of ``expr`` (a field of declared type ``hint``)."""
    origin = typing.get_origin(hint)
    if hint in (int, float, str, bytes, bool) or origin is typing.Literal:
        return expr
    if origin is Annotated:
        packed = _packed(hint)
        if packed:
            # the field holds a TokenIds / BlockHashes (the message's __post_init__ made sure)
            return f"{g.bind(packed.to_bytes, 'packed')}({expr})"
        return _emit_plain(g, typing.get_args(hint)[0], expr)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1 and inner[0] in (int, float, str, bytes, bool):
            return expr
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]) and isinstance(inner[0], type):
            # an optional nested message: its own fast encoder, None as is
            return f"(None if {expr} is None else {g.bind(_fast_encoder(inner[0]), 'enc')}({expr}))"
    if origin is dict and all(a in (int, float, str, bytes, bool) for a in typing.get_args(hint)):
        # MessagePack writes a dict of scalars as a map: no copy needed.
        return expr
    if origin is list and typing.get_args(hint)[0] in (int, float, str, bytes):
        # MessagePack writes a list or a tuple as the same array: no copy needed.
        return expr
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return f"{g.bind(_fast_encoder(hint), 'enc')}({expr})"
    if origin is list:
        (item,) = typing.get_args(hint)
        if dataclasses.is_dataclass(item) and isinstance(item, type):
            return f"[{g.bind(_fast_encoder(item), 'enc')}(e) for e in {expr}]"
    return f"{g.bind(_generic_to_plain, 'plain')}({expr})"


@cache
def _fast_encoder(cls: type) -> Callable[[Any], dict[str, Any]]:
    hints = typing.get_type_hints(cls, include_extras=True)
    g = _Gen()
    items = [f"{f.name!r}: {_emit_plain(g, hints[f.name], f'obj.{f.name}')}" for f in dataclasses.fields(cls)]
    g.emit(1, "if type(obj) is not " + g.bind(cls, "cls") + ":")
    # A subclass may add fields: the generic walk sees them.
    g.emit(2, f"return {g.bind(_generic_to_plain, 'plain')}(obj)")
    g.emit(1, "return {" + ", ".join(items) + "}")
    return g.compile(f"encode_{cls.__name__}", "obj")
