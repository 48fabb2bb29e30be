"""The stop-string rule the worker and the intake share (kvmesh_core.text_stream)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh_core.text_stream import TextStream, find_stop, partial_stop
from kvmesh_core.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _feed(text: str, stops: list[str], min_tokens: int = 0, step: int = 1) -> tuple[TextStream, list[str]]:
    ts = TextStream(TOK, stops, min_tokens)
    ids = TOK.encode(text)
    deltas = [ts.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(ts.flush())
    return ts, deltas


def test_cuts_before_the_first_match_of_any_stop_string() -> None:
    ts, deltas = _feed("hello world. next line\nmore", ["\n", "world"])
    assert ts.text == "hello " and "".join(deltas) == "hello "
    assert ts.matched == "world"
    assert ts.stopped_at == len("hello world")  # the token that completed the match
    # tokens after the stop are ignored
    assert ts.push(TOK.encode("zzz")) == "" and ts.text == "hello "


def test_text_that_may_start_a_stop_string_is_held_back() -> None:
    ts = TextStream(TOK, ["STOP"])
    assert ts.push(TOK.encode("abc ST")) == "abc "  # "ST" might become STOP
    assert ts.push(TOK.encode("A")) == "STA"  # it did not
    assert ts.push(TOK.encode("ST")) == ""
    assert ts.push(TOK.encode("OP tail")) == ""
    assert ts.text == "abc STA" and ts.stopped


def test_flush_releases_held_text_when_generation_ends_otherwise() -> None:
    ts, deltas = _feed("ends with ST", ["STOP"])
    assert not ts.stopped and deltas[-1] == "ST" and "".join(deltas) == "ends with ST"


def test_min_tokens_floor_ignores_matches_inside_the_first_tokens() -> None:
    # "\n" at token 2 is inside the first 5 tokens: not a stop; the next one is.
    ts, _ = _feed("a\nbcdef\ngh", ["\n"], min_tokens=5)
    assert ts.text == "a\nbcdef" and ts.stopped_at == 8
    ts, _ = _feed("a\nbcdef", ["\n"], min_tokens=5)
    assert not ts.stopped


def test_helpers() -> None:
    assert find_stop("xxabyyab", ["ab"]) == 2
    assert find_stop("xxabyyab", ["ab"], floor=4) == 6  # must end after the floor
    assert find_stop("abc", ["zz"]) is None
    assert partial_stop("hello wo", ["world", "xyz"]) == 2
    assert partial_stop("hello", ["world"]) == 0


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab\n c€", max_size=40),
    stops=st.lists(st.text(alphabet="ab\n c€", min_size=1, max_size=3), max_size=3),
    step=st.integers(1, 5),
    min_tokens=st.integers(0, 6),
)
def test_deltas_concatenate_to_the_cut_text(text: str, stops: list[str], step: int, min_tokens: int) -> None:
    ts, deltas = _feed(text, stops, min_tokens, step)
    assert "".join(deltas) == ts.text
    assert text.startswith(ts.text)
    if ts.stopped:
        assert any(text[len(ts.text) :].startswith(s) for s in stops)
    else:
        assert ts.text == text
        # no stop string ends after the min_tokens floor
        floor = len(TOK.decode(TOK.encode(text)[:min_tokens]).rstrip("\ufffd"))
        assert find_stop(text, stops, floor) is None
