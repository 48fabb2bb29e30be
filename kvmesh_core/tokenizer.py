"""Tokenizers and the one chat template, shared by intake (to tokenize) and workers (to detokenize).

The chat template is prefix-stable: the prompt of turn N+1 begins with exactly the tokens of turn N's
prompt followed by turn N's answer, which is what lets a multi-turn conversation reuse its KV blocks::

    turn 1 prompt:  BOS SYS s.. END USER q1.. END ASSIST
    turn 1 answer:                                      a1..            (generated)
    turn 2 prompt:  BOS SYS s.. END USER q1.. END ASSIST a1.. END USER q2.. END ASSIST

For that to hold, detokenize → tokenize must give back the same tokens for everything a model can
generate. The byte tokenizer guarantees it by letting the model generate only printable ASCII, newline
and END (see :meth:`ByteTokenizer.generation_vocab`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from jinja2 import Template


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    #: An assistant turn's tool calls: (function name, arguments as JSON text).
    tool_calls: tuple[tuple[str, str], ...] = ()


class Tokenizer(Protocol):
    """What intake and workers need of a tokenizer."""

    vocab_size: int
    bos_id: int
    end_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def role_ids(self, role: str) -> list[int]: ...

    def generation_vocab(self) -> list[int] | None: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus special tokens for the chat template."""

    BOS, END, SYSTEM, USER, ASSISTANT, TOOL = 256, 257, 258, 259, 260, 261
    vocab_size = 320  # room for more specials; a multiple of 64 keeps embedding matmuls aligned
    bos_id = BOS
    end_id = END

    _ROLES: ClassVar[dict[str, int]] = {
        "system": SYSTEM,
        "user": USER,
        "assistant": ASSISTANT,
        "tool": TOOL,
        "developer": SYSTEM,
    }

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def role_ids(self, role: str) -> list[int]:
        try:
            return [self._ROLES[role]]
        except KeyError:
            raise ValueError(f"unknown chat role {role!r}") from None

    def generation_vocab(self) -> list[int] | None:
        # Printable ASCII, newline and END: every such sequence survives decode → encode unchanged.
        return [10, *range(32, 127), self.END]


class HFTokenizer:
    """A local ``tokenizer.json`` through the ``tokenizers`` package (never downloaded).

    When a ``tokenizer_config.json`` lies beside it (a model directory), its ``bos_token``,
    ``eos_token`` and ``chat_template`` are used: prompts are then rendered with the model's own
    template, exactly as the engine serving the model expects (see :func:`render_chat`).
    """

    def __init__(self, path: str | Path, bos: str | None = None, end: str | None = None) -> None:
        from tokenizers import Tokenizer as _HF

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self._tok = _HF.from_file(str(p))
        self.vocab_size = self._tok.get_vocab_size()
        vocab = self._tok.get_vocab()
        conf = _tokenizer_config(p.parent)
        template = conf.get("chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None
        bos = bos or _token_text(conf.get("bos_token"))
        end = end or _token_text(conf.get("eos_token"))
        self.bos_text = bos
        self.end_text = end

        def pick(*names: str) -> int:
            for n in names:
                if n in vocab:
                    return vocab[n]
            return 0

        self.bos_id = vocab[bos] if bos in vocab else pick("<|begin_of_text|>", "<s>", "<|endoftext|>")
        self.end_id = (
            vocab[end] if end in vocab else pick("<|eot_id|>", "<|im_end|>", "</s>", "<|endoftext|>")
        )
        self._vocab = vocab

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tool definitions (Hugging Face's ``tools`` variable)."""
        return bool(self.chat_template) and "tools" in (self.chat_template or "")

    def render_template(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of ``messages`` through the model's chat template (special tokens parsed)."""
        assert self.chat_template is not None
        text = _compiled_template(self.chat_template).render(
            messages=[
                {
                    "role": m.role,
                    "content": m.content,
                    "tool_calls": [{"name": n, "arguments": a} for n, a in m.tool_calls],
                }
                for m in messages
            ],
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_text or "",
            eos_token=self.end_text or "",
        )
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def role_ids(self, role: str) -> list[int]:
        for name in (f"<|start_header_id|>{role}<|end_header_id|>", f"<|im_start|>{role}"):
            if name in self._vocab:
                return [self._vocab[name]]
        return self.encode(f"<|{role}|>\n")

    def generation_vocab(self) -> list[int] | None:
        return None


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    f = folder / "tokenizer_config.json"
    if not f.is_file():
        return {}
    try:
        data = json.loads(f.read_text())
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(v: object) -> str | None:
    # tokenizer_config.json spells special tokens as a string or as {"content": "..."}.
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str) -> Template:
    # A sandbox, as Hugging Face renders templates: a model directory is data, not code to trust.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source)


def supports_tools(tok: Tokenizer) -> bool:
    return isinstance(tok, HFTokenizer) and tok.supports_tools


def render_chat(
    tok: Tokenizer,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool = True,
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[int]:
    """Render chat messages to prompt tokens: the model's own chat template when its tokenizer has
    one, else the prefix-stable template above. Tools, and tool calls in the history, need a template
    that renders them (ValueError otherwise: dropping them would silently change the prompt)."""
    if (tools or any(m.tool_calls for m in messages)) and not supports_tools(tok):
        raise ValueError("this model's chat template does not render tools")
    if isinstance(tok, HFTokenizer) and tok.chat_template:
        return tok.render_template(messages, add_generation_prompt, tools)
    ids = [tok.bos_id]
    for m in messages:
        ids += tok.role_ids(m.role)
        ids += tok.encode(m.content)
        ids.append(tok.end_id)
    if add_generation_prompt:
        ids += tok.role_ids("assistant")
    return ids


def render_history(tok: Tokenizer, messages: Sequence[ChatMessage]) -> list[int]:
    """Prompt tokens for ``messages`` where a trailing assistant message is still being generated.

    Used to check the prefix property: ``render_history(m + [answer])`` starts with ``render_chat(m)``.
    """
    if messages and messages[-1].role == "assistant":
        head = render_chat(tok, messages[:-1], add_generation_prompt=True)
        return head + tok.encode(messages[-1].content)
    return render_chat(tok, messages)


def load_tokenizer(path: str | None) -> Tokenizer:
    """The byte tokenizer, or a local Hugging Face tokenizer when ``path`` names one."""
    if path:
        return HFTokenizer(path)
    return ByteTokenizer()
