"""Load (and write) local Hugging Face Llama/Qwen2-style checkpoints: ``config.json`` + ``*.safetensors``.

Nothing is ever downloaded: the path must be a local directory. HF parameter names map to ours by
dropping the leading ``model.`` (``model.layers.0.self_attn.q_proj.weight`` → ``layers.0.self_attn...``);
``lm_head.weight`` is absent from checkpoints with tied embeddings.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from services.worker.errors import CheckpointError
from services.worker.model import LlamaModel
from services.worker.model_configs import ModelConfig

log = logging.getLogger(__name__)

_SUPPORTED = ("llama", "qwen2", "mistral")


def config_from_hf(path: str | Path) -> ModelConfig:
    """Our ModelConfig from a checkpoint's ``config.json``."""
    p = Path(path) / "config.json"
    if not p.is_file():
        raise CheckpointError(f"no config.json in {path}")
    hf = json.loads(p.read_text())
    model_type = hf.get("model_type", "llama")
    if model_type not in _SUPPORTED:
        raise CheckpointError(f"unsupported model_type {model_type!r}; supported: {_SUPPORTED}")
    if hf.get("rope_scaling"):
        # Long-context rope scaling (llama3/yarn) is not implemented; positions past the trained
        # context will be off, shorter ones are exact.
        log.warning("checkpoint rope_scaling %s ignored", hf["rope_scaling"].get("rope_type", "?"))
    n_heads = int(hf["num_attention_heads"])
    d_model = int(hf["hidden_size"])
    return ModelConfig(
        name=Path(path).name,
        n_layers=int(hf["num_hidden_layers"]),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads", n_heads)),
        head_dim=int(hf.get("head_dim") or d_model // n_heads),
        ffn_dim=int(hf["intermediate_size"]),
        vocab_size=int(hf["vocab_size"]),
        max_context=int(hf.get("max_position_embeddings", 4096)),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
    )


def load_checkpoint(path: str | Path, device: torch.device, dtype: torch.dtype) -> LlamaModel:
    """A model built from a local checkpoint directory, every parameter checked for name and shape."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a local directory")
    cfg = config_from_hf(root)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            state[name.removeprefix("model.")] = t
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    model = LlamaModel(cfg)
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    unused = sorted(k for k in set(state) - set(expected) if "rotary_emb" not in k)
    if unused:
        log.warning("checkpoint %s: %d tensors unused, e.g. %s", path, len(unused), unused[:3])
    with torch.no_grad():
        for name, param in expected.items():
            t = state[name]
            if tuple(t.shape) != tuple(param.shape):
                raise CheckpointError(f"{name}: shape {tuple(t.shape)} != expected {tuple(param.shape)}")
            param.copy_(t.to(torch.float32))
    return model.to(device=device, dtype=dtype).eval()


def save_checkpoint(model: LlamaModel, path: str | Path) -> None:
    """Write ``model`` as an HF Llama (or Qwen2 when it has q/k/v biases) checkpoint directory."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    c = model.cfg
    hf = {
        "model_type": "qwen2" if c.qkv_bias else "llama",
        "architectures": ["Qwen2ForCausalLM" if c.qkv_bias else "LlamaForCausalLM"],
        "hidden_size": c.d_model,
        "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_context,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": c.tie_embeddings,
        "torch_dtype": "float32",
    }
    (root / "config.json").write_text(json.dumps(hf, indent=2))
    tensors = {}
    for name, p in model.named_parameters():
        hf_name = name if name == "lm_head.weight" else f"model.{name}"
        tensors[hf_name] = p.detach().to("cpu", torch.float32).contiguous()
    save_file(tensors, str(root / "model.safetensors"))
