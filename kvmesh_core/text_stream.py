"""Generated token ids → text, with OpenAI's stop strings: one rule for the worker and the intake.

The worker ends a request when a stop string appears in its decoded output; the intake cuts the text
it returns at the same place. Both run :class:`TextStream` over the same tokens with the same
tokenizer, so they agree on where the output ends whatever engine generated it.

Rules (vLLM's and OpenAI's):
  * the output ends before the first occurrence of any stop string; the match and anything after it
    are not output;
  * a stop string only counts when it ends in the text of a token after the first ``min_tokens``;
  * text that might be the start of a stop string (or of a multi-byte character, a trailing U+FFFD)
    is held back until the next tokens decide it, so a streamed client never sees text that a later
    match would remove. :meth:`TextStream.flush` releases it when generation ends for another reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh_core.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


def find_stop(text: str, stops: Sequence[str], floor: int = 0) -> int | None:
    """Where the first stop string in ``text`` that ends after ``floor`` starts, or None."""
    best: int | None = None
    for s in stops:
        i = text.find(s, max(0, floor - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def partial_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


class TextStream:
    """Token ids in, text deltas out, stopping at the first stop string.

    Invariant: the concatenation of every delta returned by :meth:`push` and :meth:`flush` equals
    :attr:`text`, which is ``tokenizer.decode(ids)`` cut before the stop match (when one matched).
    ``stopped_at`` is the number of tokens consumed when a stop string matched (the output's length).
    """

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = (), min_tokens: int = 0) -> None:
        self._tok = tokenizer
        self.stops = [s for s in stops if s]
        self.min_tokens = min_tokens
        self._ids: list[int] = []
        self._emitted = 0  # characters of the text already returned
        self._floor = 0  # characters of the text of the first min_tokens tokens
        self._text = ""
        self.stopped_at: int | None = None
        self.matched: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    @property
    def text(self) -> str:
        return self._text

    def push(self, ids: Sequence[int]) -> str:
        """Take the next generated ids; the text that may be shown now. Ids after a stop are ignored."""
        if self.stopped or not ids:
            return ""
        if not self.stops:
            self._ids.extend(ids)
            # Decoding everything keeps tokenizers that merge across tokens right; outputs are short.
            self._text = self._tok.decode(self._ids)
            return self._release(len(self._text.rstrip(_REPLACEMENT)))
        for tok in ids:
            # One token at a time: a match must be found at the token that completes it, so that
            # ``stopped_at`` and the min_tokens floor are exact.
            self._ids.append(tok)
            self._text = self._tok.decode(self._ids)
            stable = self._text.rstrip(_REPLACEMENT)
            n = len(self._ids)
            if n <= self.min_tokens:
                self._floor = len(stable)
                continue
            cut = find_stop(stable, self.stops, self._floor)
            if cut is not None:
                self.stopped_at = n
                self.matched = next(s for s in self.stops if stable.startswith(s, cut))
                self._text = stable[:cut]
                return self._release(cut)
        stable = self._text.rstrip(_REPLACEMENT)
        return self._release(len(stable) - partial_stop(stable, self.stops))

    def flush(self) -> str:
        """Generation ended: everything not yet returned."""
        return self._release(len(self._text))

    def _release(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta
