"""Penalties, banned end tokens and logprobs of the built-in engine's sampler."""

from __future__ import annotations

import math

import pytest
import torch

from schemas.messages import SamplingParams
from services.worker.sampling import History, logprobs_of, penalize, sample

V = 8


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_greedy_logprobs_top_token_is_the_chosen_one_and_sum_to_one() -> None:
    logits = torch.tensor([0.1, 2.0, -1.0, 0.5, 1.9, 0.0, -3.0, 0.2])
    tok, lp = sample(logits, SamplingParams(logprobs=3), _gen(), None)
    assert tok == 1 and lp is not None
    assert lp.token_id == 1 and lp.top_ids == [1, 4, 3]
    assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
    assert math.isclose(lp.logprob, lp.top_logprobs[0])
    full = logprobs_of(logits, 1, V)
    assert math.isclose(sum(math.exp(v) for v in full.top_logprobs), 1.0, rel_tol=1e-5)
    # no logprobs unless asked
    assert sample(logits, SamplingParams(), _gen(), None)[1] is None


def test_masked_tokens_never_appear_in_logprobs() -> None:
    logits = torch.tensor([5.0, 2.0, -1.0, 0.5, 1.9, 0.0, -3.0, 0.2])
    mask = torch.ones(V, dtype=torch.bool)
    mask[0] = False
    tok, lp = sample(logits, SamplingParams(logprobs=2), _gen(), mask)
    assert tok == 1 and lp is not None and 0 not in lp.top_ids


def test_repetition_penalty_follows_vllm_sign_rule() -> None:
    hist = History([2, 3], V)
    x = torch.tensor([1.0, 1.0, 2.0, -2.0, 1.0, 1.0, 1.0, 1.0])
    y = penalize(x, SamplingParams(repetition_penalty=2.0), hist)
    assert y[2] == 1.0 and y[3] == -4.0  # positive divided, negative multiplied
    assert torch.equal(y[[0, 1, 4]], x[[0, 1, 4]])  # unseen tokens untouched
    assert torch.equal(x[2:4], torch.tensor([2.0, -2.0]))  # the input is not modified


def test_presence_and_frequency_penalties_count_generated_tokens_only() -> None:
    hist = History([5], V)
    for t in (1, 1, 2):
        hist.add(t)
    x = torch.zeros(V)
    y = penalize(x, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), hist)
    assert y[1] == pytest.approx(-(0.5 + 2 * 0.25))
    assert y[2] == pytest.approx(-(0.5 + 0.25))
    assert y[5] == 0.0  # a prompt token is not penalized by these two


def test_penalty_changes_the_greedy_choice_and_banned_tokens_are_never_chosen() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, 0.0, 0.0, 0.0, 0.0, 0.0])
    hist = History([], V)
    hist.add(1)
    assert sample(logits, SamplingParams(), _gen(), None, hist)[0] == 1
    assert sample(logits, SamplingParams(presence_penalty=1.0), _gen(), None, hist)[0] == 2
    assert sample(logits, SamplingParams(), _gen(), None, None, banned=[1])[0] == 2
    # logprobs stay those of the model: the penalty does not change them
    _, lp = sample(logits, SamplingParams(presence_penalty=1.0, logprobs=1), _gen(), None, hist)
    assert lp is not None and lp.top_ids == [1] and lp.token_id == 2
