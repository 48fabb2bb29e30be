"""Model shapes: one config dataclass with derived fields, and a registry of named sizes.

``tiny`` is the default of development and CI (fast on 2 CPU cores, vocabulary sized for
:class:`kvmesh_core.tokenizer.ByteTokenizer`); ``small`` is bigger, for benchmarks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.worker.errors import ModelConfigError


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a Llama-architecture decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU)."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    max_context: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2-style checkpoints carry biases on q/k/v projections

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError("n_heads must be a multiple of n_kv_heads")
        if self.head_dim % 2:
            raise ModelConfigError("head_dim must be even for rotary positions")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.n_layers * self.kv_dim * itemsize


MODEL_CONFIGS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny",
        n_layers=4,
        d_model=128,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        ffn_dim=384,
        vocab_size=320,
    ),
    "small": ModelConfig(
        name="small",
        n_layers=8,
        d_model=512,
        n_heads=8,
        n_kv_heads=4,
        head_dim=64,
        ffn_dim=1536,
        vocab_size=320,
        max_context=16384,
    ),
}


def get_config(name: str, **overrides: object) -> ModelConfig:
    """The named config, with optional field overrides (``max_context=16384``)."""
    try:
        cfg = MODEL_CONFIGS[name.removeprefix("kvmesh-")]
    except KeyError:
        raise ModelConfigError(f"unknown model {name!r}; known: {', '.join(MODEL_CONFIGS)}") from None
    return dataclasses.replace(cfg, **overrides) if overrides else cfg  # type: ignore[arg-type]  # replace() checks the names
