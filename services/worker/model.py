"""A Llama-architecture decoder in torch, written as a pure function of tokens and past KV.

The model owns only weights. The KV cache lives outside it (the paged pool of the KV cache manager):
``forward`` takes the past keys/values of every layer gathered into one tensor and returns the keys
and values of the new tokens, which the caller writes back into its blocks. Shapes::

    tokens, positions   [B, T]                      T new tokens per sequence
    past                [L, 2, B, Hkv, P, D]        P past tokens (padded; past_mask marks real ones)
    past_mask           [B, P] bool
    new_kv              [L, 2, B, Hkv, T, D]        keys are stored after rotary positions are applied
    logits              [B, T, V]  (or [B, 1, V] with last_only)

Rotary positions follow the Hugging Face "rotate half" convention so HF checkpoints load unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.worker.model_configs import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32: bf16 sums of squares lose too much precision.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """cos/sin of rotary positions computed on the fly, so any context length works."""

    inv_freq: Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # positions [B, T] -> cos, sin [B, 1, T, D]
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.d_model, cfg.q_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_dim, cfg.d_model, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, past: Tensor | None, mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        # x [B, T, d]; past [2, B, Hkv, P, D] or None; mask [B, 1, T, P+T] bool or None (plain causal)
        c = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        new_kv = torch.stack((k, v))  # [2, B, Hkv, T, D]
        if past is not None:
            k = torch.cat((past[0], k), dim=2)
            v = torch.cat((past[1], v), dim=2)
        if c.group_size > 1:
            k = k.repeat_interleave(c.group_size, dim=1)
            v = v.repeat_interleave(c.group_size, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(b, t, c.q_dim)
        return self.o_proj(out), new_kv


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, past: Tensor | None, mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        h, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, past, mask)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), new_kv


def attention_mask(past_mask: Tensor | None, t: int, device: torch.device) -> Tensor | None:
    """Bool mask [B, 1, T, P+T]: every real past token, and causal among the T new ones.

    None when there is no past (plain causal attention, the fast path of SDPA).
    """
    if past_mask is None:
        return None
    b, p = past_mask.shape
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    left = past_mask[:, None, None, :].expand(b, 1, t, p)
    right = causal[None, None].expand(b, 1, t, t)
    return torch.cat((left, right), dim=-1)


class LlamaModel(nn.Module):
    """Token embedding, ``n_layers`` pre-norm blocks, final norm, LM head (tied or not)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head: nn.Linear | None = (
            None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        )
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """Deterministic weights from ``seed``, scaled so activations keep unit scale through the layers
        and logits spread by a few units (a near-uniform distribution would make greedy picks fragile)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            elif name == "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=gen) * (3.0 / math.sqrt(p.shape[1])))
            else:
                # Residual branches scaled down by depth so the residual stream does not blow up.
                gain = (
                    1.0 / math.sqrt(2 * self.cfg.n_layers)
                    if name.endswith(("o_proj.weight", "down_proj.weight"))
                    else 1.0
                )
                p.copy_(torch.randn(p.shape, generator=gen) * (gain / math.sqrt(p.shape[1])))

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        past: Tensor | None = None,
        past_mask: Tensor | None = None,
        last_only: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Logits and the new tokens' KV; see the module docstring for shapes."""
        x = self.embed_tokens(tokens)
        cos, sin = self.rotary(positions, x.dtype)
        if past is not None and past_mask is None:
            past_mask = torch.ones(past.shape[2], past.shape[4], dtype=torch.bool, device=tokens.device)
        mask = attention_mask(past_mask if past is not None else None, tokens.shape[1], tokens.device)
        new = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, cos, sin, None if past is None else past[i], mask)
            new.append(kv)
        if last_only:
            x = x[:, -1:]
        x = self.norm(x)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, weight)
        return logits, torch.stack(new)


def build_model(cfg: ModelConfig, seed: int, device: torch.device, dtype: torch.dtype) -> LlamaModel:
    """A model with seeded random weights (fp32 init on CPU, then cast, so weights match across devices)."""
    model = LlamaModel(cfg)
    model.init_random(seed)
    return model.to(device=device, dtype=dtype).eval()
