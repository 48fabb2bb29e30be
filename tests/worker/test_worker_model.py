"""The Llama-style decoder: incremental forward equals full forward, seeded weights, configs."""

from __future__ import annotations

import pytest
import torch

from services.worker.errors import ModelConfigError
from services.worker.model import build_model
from services.worker.model_configs import MODEL_CONFIGS, ModelConfig, get_config


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny matmuls on a shared 2-core box run far faster on one thread (no spinning workers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


CPU = torch.device("cpu")


def _model(seed: int = 0, **overrides: object):
    return build_model(get_config("tiny", **overrides), seed, CPU, torch.float32)


def test_tiny_config_fits_byte_tokenizer() -> None:
    cfg = MODEL_CONFIGS["tiny"]
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (4, 128, 4, 2, 32)
    assert cfg.vocab_size == 320 and cfg.max_context == 4096
    assert cfg.group_size == 2 and cfg.kv_dim == 64 and cfg.q_dim == 128
    assert get_config("kvmesh-tiny") == cfg


def test_bad_configs_raise() -> None:
    with pytest.raises(ModelConfigError):
        get_config("huge")
    with pytest.raises(ModelConfigError):
        ModelConfig("x", 1, 64, n_heads=3, n_kv_heads=2, head_dim=16, ffn_dim=64, vocab_size=10)


@torch.inference_mode()
def test_forward_with_past_equals_full_forward() -> None:
    m = _model()
    toks = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(50)[None]
    full, kv = m(toks, pos)
    assert kv.shape == (4, 2, 1, 2, 50, 32)
    part, kv2 = m(toks[:, 37:], pos[:, 37:], past=kv[:, :, :, :, :37])
    torch.testing.assert_close(part, full[:, 37:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv2, kv[:, :, :, :, 37:], atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_padded_batch_matches_single_sequences() -> None:
    m = _model()
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 256, (1, 20), generator=g), torch.randint(0, 256, (1, 12), generator=g)
    _, kva = m(a[:, :-1], torch.arange(19)[None])
    _, kvb = m(b[:, :-1], torch.arange(11)[None])
    la, _ = m(a[:, -1:], torch.tensor([[19]]), past=kva)
    lb, _ = m(b[:, -1:], torch.tensor([[11]]), past=kvb)
    past = torch.zeros(4, 2, 2, 2, 19, 32)
    past[:, :, 0:1] = kva
    past[:, :, 1:2, :, :11] = kvb
    mask = torch.zeros(2, 19, dtype=torch.bool)
    mask[0] = True
    mask[1, :11] = True
    lab, _ = m(torch.cat([a[:, -1:], b[:, -1:]]), torch.tensor([[19], [11]]), past=past, past_mask=mask)
    torch.testing.assert_close(lab[0], la[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lab[1], lb[0], atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_seeded_weights_are_deterministic_and_logits_spread() -> None:
    toks = torch.arange(32)[None]
    pos = torch.arange(32)[None]
    l0, _ = _model(0)(toks, pos)
    l0b, _ = _model(0)(toks, pos)
    l1, _ = _model(1)(toks, pos)
    assert torch.equal(l0, l0b)
    assert not torch.allclose(l0, l1)
    # Not degenerate: a clear spread, so greedy picks are stable under float noise.
    assert l0.std().item() > 1.0


@torch.inference_mode()
def test_tied_embeddings_and_bias_variants_run() -> None:
    m = _model(tie_embeddings=True, qkv_bias=True)
    assert m.lm_head is None
    logits, _ = m(torch.arange(8)[None], torch.arange(8)[None], last_only=True)
    assert logits.shape == (1, 1, 320)
    assert torch.isfinite(logits).all()
