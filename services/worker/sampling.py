"""Next-token choice: greedy, or temperature + top-p with a per-request seeded generator.

Sampling runs on CPU in fp32 so a request's tokens depend only on its logits and seed, not on the
device or on which other requests share its batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from schemas.messages import SamplingParams


def allowed_mask(vocab: list[int] | None, vocab_size: int) -> Tensor | None:
    """A bool mask of the tokens the model may generate, or None for all of them."""
    if vocab is None:
        return None
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[torch.tensor([v for v in vocab if v < vocab_size], dtype=torch.long)] = True
    return mask


def sample(logits: Tensor, params: SamplingParams, gen: torch.Generator, mask: Tensor | None) -> int:
    """One token id from ``logits`` [V]."""
    x = logits.detach().to("cpu", torch.float32)
    if mask is not None:
        x = x.masked_fill(~mask, float("-inf"))
    if params.temperature == 0.0:
        return int(torch.argmax(x).item())
    probs = torch.softmax(x / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        # Keep the smallest head whose mass reaches top_p (always at least the top token).
        keep = (sorted_p.cumsum(0) - sorted_p) < params.top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen).item())
