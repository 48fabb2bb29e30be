"""Next-token choice: greedy, or temperature + top-p with a per-request seeded generator.

Sampling runs on CPU in fp32 so a request's tokens depend only on its logits and seed, not on the
device or on which other requests share its batch. The order is vLLM's: vocabulary mask, repetition
penalty, frequency and presence penalties, temperature, top-p. Logprobs are read after the mask and
before the penalties (the model's own distribution over the tokens it may generate), so with greedy
decoding and no penalties the top logprob is the chosen token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from schemas.messages import SamplingParams, TokenLogprob


def allowed_mask(vocab: list[int] | None, vocab_size: int) -> Tensor | None:
    """A bool mask of the tokens the model may generate, or None for all of them."""
    if vocab is None:
        return None
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[torch.tensor([v for v in vocab if v < vocab_size], dtype=torch.long)] = True
    return mask


class History:
    """What the penalties look at: the prompt's distinct tokens and the output's token counts."""

    def __init__(self, prompt: Sequence[int], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.prompt = torch.unique(torch.as_tensor(list(prompt), dtype=torch.long))
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)

    def add(self, tok: int) -> None:
        if 0 <= tok < self.vocab_size:
            self.counts[tok] += 1


def penalize(x: Tensor, params: SamplingParams, hist: History) -> Tensor:
    """``x`` [V] fp32 with the request's penalties applied (a new tensor when any applies)."""
    if not params.penalized:
        return x
    x = x.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.unique(torch.cat([hist.prompt, torch.nonzero(hist.counts).flatten()]))
        seen = seen[seen < x.numel()]
        v = x[seen]
        x[seen] = torch.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
    if params.frequency_penalty or params.presence_penalty:
        c = hist.counts[: x.numel()]
        x -= params.frequency_penalty * c + params.presence_penalty * (c > 0).float()
    return x


def sample(
    logits: Tensor,
    params: SamplingParams,
    gen: torch.Generator,
    mask: Tensor | None,
    hist: History | None = None,
    banned: Sequence[int] = (),
) -> tuple[int, TokenLogprob | None]:
    """One token id from ``logits`` [V], and its logprobs when ``params.logprobs`` asks for them.

    ``banned`` tokens cannot be chosen (a request's end tokens before its ``min_tokens``).
    """
    x = logits.detach().to("cpu", torch.float32)
    if mask is not None:
        x = x.masked_fill(~mask, float("-inf"))
    raw = x
    if hist is not None:
        x = penalize(x, params, hist)
    if banned:
        x = x.clone() if x is raw else x
        x[torch.as_tensor([b for b in banned if 0 <= b < x.numel()], dtype=torch.long)] = float("-inf")
    if params.temperature == 0.0:
        tok = int(torch.argmax(x).item())
    else:
        probs = torch.softmax(x / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            # Keep the smallest head whose mass reaches top_p (always at least the top token).
            keep = (sorted_p.cumsum(0) - sorted_p) < params.top_p
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        tok = int(torch.multinomial(probs, 1, generator=gen).item())
    if params.logprobs is None:
        return tok, None
    return tok, logprobs_of(raw, tok, params.logprobs)


def logprobs_of(x: Tensor, tok: int, k: int) -> TokenLogprob:
    """The logprob of ``tok`` and the ``k`` most likely tokens under ``x`` [V] (fp32 logits)."""
    lp = torch.log_softmax(x, dim=-1)
    top_ids: list[int] = []
    top_lp: list[float] = []
    if k:
        vals, idx = torch.topk(lp, k)
        top_ids, top_lp = [int(i) for i in idx.tolist()], [float(v) for v in vals.tolist()]
    return TokenLogprob(token_id=tok, logprob=float(lp[tok].item()), top_ids=top_ids, top_logprobs=top_lp)
