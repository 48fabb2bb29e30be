"""The reference answers of the vLLM tests: ``vllm.LLM.generate`` in a fresh process, prefix caching off.

Imported as ``from vllm_helpers import llm_generate`` (tests/ is on sys.path through its conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path


def llm_generate(
    model_dir: Path | str,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    block_size: int = 32,
    max_model_len: int = 1024,
    dtype: str = "float32",
) -> list[list[int]]:
    """Greedy token ids of each prompt, computed from scratch by vLLM's own offline API."""
    code = textwrap.dedent(
        f"""
        import json, sys
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        if __name__ == "__main__":
            prompts = json.loads(sys.stdin.read())
            llm = LLM(model={str(model_dir)!r}, dtype={dtype!r}, block_size={block_size},
                      max_model_len={max_model_len}, enforce_eager=True, enable_prefix_caching=False, seed=0)
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                SamplingParams(temperature=0.0, max_tokens={max_tokens}, detokenize=False),
                                use_tqdm=False)
            print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
        """
    )
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(prompts),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result: list[list[int]] = json.loads(lines[-1][len("RESULT ") :])
    return result
