"""How much of a prompt's KV cache can be reused: the rule the engines, the scheduler, the simulator
and the TTFT bound all apply.

The last prompt token is always computed, because its logits give the first output token; so a prompt
of ``n`` tokens reuses at most ``(n - 1) // block_size`` whole blocks, even when every block is held.
"""

from __future__ import annotations


def reusable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Most whole blocks of a ``prompt_tokens``-token prompt that can come from a cache."""
    return (prompt_tokens - 1) // block_size if prompt_tokens > 0 else 0
