"""From a request's replies to what the HTTP client sees: text deltas and error mapping.

The reply routing itself (request id → handle, order, dedup) lives once, in the producer SDK
(:mod:`streams.client`); this module only turns its tokens into text and its Completion into errors.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.tokenizer import Tokenizer
from schemas.messages import Completion
from services.intake.errors import IntakeError, UpstreamFailed, UpstreamRejected

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character.

    Invariant: the concatenation of every delta returned (plus :meth:`flush`) equals
    ``tokenizer.decode(all ids)``. A trailing U+FFFD is held back because it may be the first bytes of
    a multi-byte character whose remaining tokens have not arrived yet.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already returned

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def push(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        # Decoding everything keeps tokenizers that merge across tokens right; outputs are short.
        text = self._tok.decode(self._ids)
        stable = len(text.rstrip(_REPLACEMENT))
        if stable <= self._emitted:
            return ""
        delta = text[self._emitted : stable]
        self._emitted = stable
        return delta

    def flush(self) -> str:
        text = self._tok.decode(self._ids)
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta

    def text(self) -> str:
        return self._tok.decode(self._ids)


def completion_error(c: Completion) -> IntakeError | None:
    """The HTTP error a failed Completion stands for, or None when it succeeded."""
    if c.finish_reason in ("stop", "length"):
        return None
    # Worker error strings may quote internals; the client gets the class of failure and the id.
    if c.finish_reason == "rejected":
        return UpstreamRejected(f"The fleet rejected request {c.request_id}: {c.error or 'no capacity'}.")
    if c.finish_reason == "cancelled":
        return UpstreamFailed(f"Request {c.request_id} was cancelled by the fleet.", code="cancelled")
    return UpstreamFailed(f"The worker failed while serving request {c.request_id}.")
