"""``kvmesh model init DIR``: a small Llama-architecture checkpoint that both engines load, no downloads.

The directory is laid out the way a Hugging Face checkpoint is, so vLLM, ``transformers`` and the
built-in engine read it alike, and so does intake (tokenizer and chat template)::

    DIR/config.json              LlamaForCausalLM config (model_type llama)
    DIR/model.safetensors        seeded random weights (services.worker.model.LlamaModel.init_random)
    DIR/generation_config.json   bos/eos ids
    DIR/tokenizer.json           byte-level BPE trained with the ``tokenizers`` library on a built-in text
    DIR/tokenizer_config.json    special tokens and the chat template

The weights come from the built-in engine's seeded init rather than ``transformers``' default
(std 0.02): that init keeps activations at unit scale, so greedy outputs vary from token to token and
depend on the whole prompt, which is what an equality test of two engines needs to catch wrong KV.

The chat template is prefix-stable (turn N+1's prompt starts with turn N's prompt and answer), the
property multi-turn KV reuse rests on; each role marker and the end marker are special tokens, so the
tokenizer never merges across a message boundary.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("kvmesh.model")

#: Special tokens, in id order after the learned vocabulary's first ids.
SPECIAL_TOKENS = (
    "<|bos|>",
    "<|end|>",
    "<|system|>",
    "<|developer|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
)

#: HF-style Jinja chat template (variables: messages, tools, add_generation_prompt, bos_token). Tools
#: render as a system turn that teaches the Hermes call format; without tools (and without tool calls
#: in the history) the output is the plain prefix-stable one.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ '<|system|>You may call these tools: ' }}{{ tools | tojson }}{{ "
    '\' To call one, answer <tool_call>{"name": NAME, "arguments": ARGUMENTS}</tool_call>.<|end|>\' }}'
    "{% endif %}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{ call['arguments'] + '}</tool_call>' }}"
    "{% endfor %}{{ '<|end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_WORD_TEXT = """
the a fleet worker cache block prefix token request answer question user system model engine
route load queue fetch recompute store evict tier memory disk network peer copy move hash chain
conversation turn history prompt reply time first latency throughput batch decode prefill
kernel python kafka redis vllm tensor layer head attention key value shape size number one two
three four five six seven eight nine ten hello thanks please explain why how what when where
which who code function class module test error retry timeout data plane control schedule
replica partition
"""
_WORDS = _WORD_TEXT.split()


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """Deterministic training text: sentences over a fixed word list plus digits and punctuation."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(lines):
        n = rng.randint(4, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if i % 7 == 0:
            words.append(str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        out.append(sentence.capitalize() + rng.choice([".", "?", "!", ",", ":"]))
    return out


def build_tokenizer(vocab_size: int, seed: int = 0) -> Any:  # a tokenizers.Tokenizer (untyped package)
    """A byte-level BPE tokenizer (every byte encodable) with the chat template's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    return tok


def init_model_dir(
    path: str | Path,
    *,
    seed: int = 0,
    layers: int = 4,
    d_model: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    ffn_dim: int = 512,
    vocab_size: int = 1024,
    max_context: int = 8192,
) -> Path:
    """Write a complete model directory at ``path`` (created; existing model files are replaced)."""
    import torch

    from services.worker.model import build_model
    from services.worker.model_configs import ModelConfig
    from services.worker.weights import save_checkpoint

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size, seed)
    # The embedding rows cover the whole vocabulary, rounded up to 64 for aligned matmuls.
    n_vocab = -(-tok.get_vocab_size() // 64) * 64
    cfg = ModelConfig(
        name=root.name,
        n_layers=layers,
        d_model=d_model,
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_dim=ffn_dim,
        vocab_size=n_vocab,
        max_context=max_context,
    )
    model = build_model(cfg, seed, torch.device("cpu"), torch.float32)
    save_checkpoint(model, root)
    bos, end = tok.token_to_id("<|bos|>"), tok.token_to_id("<|end|>")
    hf = json.loads((root / "config.json").read_text())
    hf.update(
        {
            "bos_token_id": bos,
            "eos_token_id": end,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "kvmesh_seed": seed,
        }
    )
    (root / "config.json").write_text(json.dumps(hf, indent=2))
    (root / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": end}, indent=2)
    )
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|end|>",
                "pad_token": "<|end|>",
                "add_bos_token": False,
                "model_max_length": max_context,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (root / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": "<|end|>", "pad_token": "<|end|>"}, indent=2)
    )
    return root


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh model", description="Model directories for tests and demos.")
    sub = p.add_subparsers(dest="cmd", required=True)
    init = sub.add_parser("init", help="write a small Llama checkpoint with seeded random weights")
    init.add_argument("dir")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--layers", type=int, default=4)
    init.add_argument("--d-model", type=int, default=256)
    init.add_argument("--heads", type=int, default=4)
    init.add_argument("--kv-heads", type=int, default=2)
    init.add_argument("--head-dim", type=int, default=64)
    init.add_argument("--ffn-dim", type=int, default=512)
    init.add_argument("--vocab-size", type=int, default=1024)
    init.add_argument("--max-context", type=int, default=8192)
    args = p.parse_args(argv)
    root = init_model_dir(
        args.dir,
        seed=args.seed,
        layers=args.layers,
        d_model=args.d_model,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        ffn_dim=args.ffn_dim,
        vocab_size=args.vocab_size,
        max_context=args.max_context,
    )
    sys.stdout.write(
        f"wrote {root} (config.json, model.safetensors, tokenizer.json, tokenizer_config.json)\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
