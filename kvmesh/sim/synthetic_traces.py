"""Mooncake-format traces of shapes the shared trace lacks, to check routing on work it was not tuned on.

``python -m kvmesh.sim.synthetic_traces DIR`` writes two seeded files (one JSON object a line:
``timestamp`` ms, ``input_length``, ``output_length`` and ``hash_ids``, one id per 512-token block):

* ``toolagent.jsonl``: 4,000 single-turn requests at 16 a second (Poisson). Each starts with one of
  30 shared tool prompts of 4-40 blocks, drawn with Zipf popularity (s = 1.1, so the first prompt
  takes about a quarter of the requests and one worker cannot serve it alone at 4x), then 1-6 blocks
  of its own; answers of 20-399 tokens.
* ``convo.jsonl``: 600 conversations that all begin within 75 s, a burst, then thin out. Each opens
  with one of 5 system prompts (8 blocks), takes 1-11 turns about 20 s apart (exponential), each turn
  re-sending the history plus 1-4 new blocks; answers of 20-499 tokens, long enough that at 4x the
  running answers fill every GPU tier during the burst.

Nothing here is read by the product; `kvmesh simulate --trace FILE` replays either (README,
"Traces it was not tuned on").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 512  # the Mooncake traces' block


def _line(ts: float, ids: list[int], tail: int, out_len: int) -> str:
    return json.dumps(
        {
            "timestamp": int(ts),
            "input_length": (len(ids) - 1) * BLOCK_TOKENS + tail,
            "output_length": out_len,
            "hash_ids": ids,
        }
    )


def toolagent(path: Path, n: int = 4000, rate: float = 16.0, prompts: int = 30, seed: int = 7) -> None:
    """Shared tool prompts with skewed popularity, one turn each (module docstring)."""
    rng = np.random.default_rng(seed)
    base: list[list[int]] = []
    nxt = 0
    for length in rng.integers(4, 41, size=prompts):
        base.append(list(range(nxt, nxt + int(length))))
        nxt += int(length)
    weights = 1.0 / np.arange(1, prompts + 1) ** 1.1
    weights /= weights.sum()
    t = 0.0
    lines = []
    for _ in range(n):
        t += rng.exponential(1000.0 / rate)
        prompt = base[int(rng.choice(prompts, p=weights))]
        own = int(rng.integers(1, 7))
        ids = prompt + list(range(nxt, nxt + own))
        nxt += own
        lines.append(_line(t, ids, int(rng.integers(1, BLOCK_TOKENS)), int(rng.integers(20, 400))))
    path.write_text("\n".join(lines) + "\n")


def convo(path: Path, users: int = 600, rate: float = 8.0, seed: int = 11) -> None:
    """A burst of multi-turn conversations on a few system prompts (module docstring)."""
    rng = np.random.default_rng(seed)
    system = [list(range(i * 8, i * 8 + 8)) for i in range(5)]
    nxt = 40
    turns: list[tuple[float, list[int], int, int]] = []
    for _ in range(users):
        t = rng.uniform(0, users / rate * 1000.0)
        history = list(system[int(rng.integers(0, 5))])
        for _ in range(int(rng.integers(1, 12))):
            new = int(rng.integers(1, 5))
            history = history + list(range(nxt, nxt + new))
            nxt += new
            turns.append((t, history, int(rng.integers(1, BLOCK_TOKENS)), int(rng.integers(20, 500))))
            t += rng.exponential(20_000.0)
    turns.sort(key=lambda e: int(e[0]))
    path.write_text("\n".join(_line(*turn) for turn in turns) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m kvmesh.sim.synthetic_traces", description=__doc__.split("\n")[0]
    )
    ap.add_argument("out", type=Path, help="directory to write toolagent.jsonl and convo.jsonl into")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    toolagent(args.out / "toolagent.jsonl")
    convo(args.out / "convo.jsonl")


if __name__ == "__main__":
    main()
