"""Local Hugging Face checkpoints: write one from a seeded model, load it back, same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.engine import Engine, EngineConfig
from services.worker.errors import CheckpointError
from services.worker.model import build_model
from services.worker.model_configs import get_config
from services.worker.weights import config_from_hf, load_checkpoint, save_checkpoint

CPU = torch.device("cpu")


@pytest.mark.parametrize("variant", [{}, {"qkv_bias": True, "tie_embeddings": True}])
def test_roundtrip_gives_identical_logits(tmp_path: Path, variant: dict) -> None:
    cfg = get_config("tiny", n_layers=2, **variant)
    model = build_model(cfg, 7, CPU, torch.float32)
    save_checkpoint(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == ("qwen2" if variant else "llama")
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert ("lm_head.weight" in names) != bool(variant.get("tie_embeddings"))

    loaded = load_checkpoint(tmp_path, CPU, torch.float32)
    assert loaded.cfg.qkv_bias == cfg.qkv_bias and loaded.cfg.tie_embeddings == cfg.tie_embeddings
    toks = torch.arange(24)[None]
    with torch.inference_mode():
        a, _ = model(toks, torch.arange(24)[None])
        b, _ = loaded(toks, torch.arange(24)[None])
    assert torch.equal(a, b)


def test_missing_and_misshapen_checkpoints_raise(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "nowhere", CPU, torch.float32)
    with pytest.raises(CheckpointError):
        config_from_hf(tmp_path)
    model = build_model(get_config("tiny", n_layers=1), 0, CPU, torch.float32)
    save_checkpoint(model, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["model.norm.weight"] = torch.ones(7)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"norm\.weight"):
        load_checkpoint(tmp_path, CPU, torch.float32)
    del state["model.norm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lacks"):
        load_checkpoint(tmp_path, CPU, torch.float32)


def test_engine_runs_from_checkpoint(tmp_path: Path) -> None:
    save_checkpoint(build_model(get_config("tiny", n_layers=2), 3, CPU, torch.float32), tmp_path)
    eng = Engine(EngineConfig(checkpoint=str(tmp_path), gpu_blocks=16, dram_blocks=0))
    assert eng.layout.layers == 2
    assert eng.max_context == 4096
