"""schemas.construct: the decode path's constructor must build exactly what ``cls(...)`` builds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from schemas.construct import constructor
from schemas.envelope import Envelope
from schemas.messages import ChatRequest
from schemas.token_ids import TokenIds


@dataclass(frozen=True, slots=True)
class _Checked:
    a: int
    b: list[int] = field(default_factory=list)
    c: str = dataclasses.field(default="x", kw_only=True)

    def __post_init__(self) -> None:
        if self.a < 0:
            raise ValueError("a must be >= 0")


@dataclass
class _Plain:
    a: int


def test_same_object_as_init_and_still_frozen() -> None:
    make = constructor(_Checked)
    assert make is not _Checked
    got = make(1, [2], "y")
    assert got == _Checked(1, [2], c="y")
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.a = 2  # type: ignore[misc]


def test_runs_post_init() -> None:
    with pytest.raises(ValueError, match="a must be"):
        constructor(_Checked)(-1, [], "x")
    # ChatRequest's __post_init__ coerces a list of token ids and checks the block count
    req = constructor(ChatRequest)
    fields = [f.name for f in dataclasses.fields(ChatRequest)]
    ref = ChatRequest("r", "s", "t", list(range(32)), [1, 2], 16, 4, 1000)
    values = [getattr(ref, f) for f in fields]
    values[fields.index("token_ids")] = list(range(32))
    built = req(*values)
    assert built == ref and type(built.token_ids) is TokenIds
    values[fields.index("block_hashes")] = [1]
    with pytest.raises(ValueError, match="one hash per full block"):
        req(*values)


def test_wrong_arity_and_unslotted_classes() -> None:
    with pytest.raises(TypeError):
        constructor(Envelope)("s", 1, "p", 2, 3)  # type: ignore[call-arg]
    assert constructor(_Plain) is _Plain
    assert constructor(int) is int
