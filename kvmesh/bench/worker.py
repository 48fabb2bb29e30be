"""``kvmesh bench worker``: time to first token with 0/50/90/100% of the prompt cached, and decode speed.

For every prompt length and cached fraction, a fresh random prompt is used; its cached part is stored
first by a one-token request over that prefix, then the full prompt is timed from ``add_request`` to
its first token; the fastest of ``--repeats`` fresh prompts counts (a shared box is noisy).
All cases run in one engine, side by side. The 2-core CPU default stops at 4k tokens
(16k with the tiny model takes minutes there); pass ``--lengths 1024,4096,16384`` to go further.

``--engine vllm --model DIR`` runs the same measurement through vLLM (its CPU build here; block size 32)
on a local model directory (``kvmesh model init DIR`` writes a small one).

With ``--json`` the last stdout line is one JSON object: ``ttft_ms[length][cached_pct]``,
``ttft_ratio_90pct_cached_4k``, decode tokens/s and the measured ``profile`` (readable by
``kvmesh_core.costmodel.load_profile``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import sys
import time

import torch
from tqdm import tqdm

from schemas.blocks import block_hashes
from schemas.messages import SamplingParams
from services.worker.config import WorkerSettings
from services.worker.engine_api import EngineRequest, WorkerEngine
from services.worker.engines import build_engine

log = logging.getLogger(__name__)
NS = b"t:bench"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh bench worker", description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=["builtin", "vllm"], default="builtin")
    p.add_argument("--model", default="tiny", help="a built-in size or a local model directory")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lengths", default=None, help="prompt lengths, comma separated (default by machine)")
    p.add_argument("--cached", default="0,50,90,100", help="cached percents, comma separated")
    p.add_argument("--block-size", type=int, default=None, help="default 16 (builtin) or 32 (vllm)")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="fresh prompts per case; the fastest counts")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default 1 on CPU: on a shared 2-core box more threads spin and run slower)",
    )
    p.add_argument("--json", action="store_true", help="print the results as one JSON line last")
    p.add_argument("--plot", default=None, help="write a PNG plot of TTFT to this path")
    return p


def _sync(eng: WorkerEngine) -> None:
    sync = getattr(eng, "_sync", None)  # the built-in engine on a GPU: wait for its kernels
    if sync is not None:
        sync()


def _request(eng: WorkerEngine, rid: str, tokens: list[int], max_tokens: int) -> EngineRequest:
    bs = eng.block_size
    return EngineRequest(
        request_id=rid,
        session_id=rid,
        token_ids=tokens,
        block_hashes=block_hashes(tokens, bs, NS),
        namespace=NS,
        max_tokens=max_tokens,
        sampling=SamplingParams(),
        stop_token_ids=[],
    )


def _run_to_first_token(eng: WorkerEngine, req: EngineRequest) -> tuple[float, int]:
    """Time from add_request to the first token (ms), and the tokens reused."""
    _sync(eng)
    t0 = time.perf_counter()
    eng.add_request(req)
    reused = 0
    while True:
        outs = eng.step()
        done = [o for o in outs if o.request_id == req.request_id and o.first_token]
        if done:
            _sync(eng)
            ms = (time.perf_counter() - t0) * 1e3
            reused = done[0].stats.reused_tokens if done[0].stats else 0
            break
    while eng.has_work():
        eng.step()
    return ms, reused


def _prompt(rng: random.Random, vocab: list[int], n: int) -> list[int]:
    return [rng.choice(vocab) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cuda = torch.cuda.is_available() and args.device in ("auto", "cuda")
    if args.threads or not cuda:
        torch.set_num_threads(args.threads or 1)
    lengths = [int(x) for x in (args.lengths or ("1024,4096,16384" if cuda else "1024,4096")).split(",")]
    cached = [int(x) for x in args.cached.split(",")]
    bs = args.block_size or (32 if args.engine == "vllm" else 16)
    max_len = max(lengths)
    blocks = 2 * (max_len // bs) + args.decode_batch * (256 + args.decode_tokens) // bs + 64
    eng = build_engine(
        WorkerSettings(
            worker_id="bench",
            engine=args.engine,
            model=args.model,
            checkpoint=args.checkpoint,
            device=args.device,
            dtype=args.dtype,
            block_size=bs,
            gpu_blocks=blocks,
            dram_blocks=0,
            max_batch=max(args.decode_batch, 2),
            max_context=max(max_len, 256) + 64,
            prefill_chunk=args.prefill_chunk,
            seed=args.seed,
            insecure_dev_transfer=True,  # no data plane runs here
        )
    )
    vocab = eng.tokenizer.generation_vocab() or list(range(min(eng.vocab_size, 256)))
    rng = random.Random(args.seed)
    profile = eng.calibrate()
    _run_to_first_token(eng, _request(eng, "warmup", _prompt(rng, vocab, 256), 1))

    ttft: dict[str, dict[str, float]] = {}
    reused: dict[str, dict[str, int]] = {}
    cases = [(n, pct) for n in lengths for pct in cached]
    bar = tqdm(cases, desc="ttft", file=sys.stderr, disable=None)
    for n, pct in bar:
        bar.set_postfix_str(f"{n} tok, {pct}% cached")
        best = float("inf")
        for r in range(args.repeats):
            # A fresh prompt per repeat, so "0% cached" never hits blocks of an earlier run.
            prompt = _prompt(rng, vocab, n)
            k = n * pct // 100
            if k >= bs:
                _run_to_first_token(eng, _request(eng, f"warm-{n}-{pct}-{r}", prompt[:k], 1))
            ms, got = _run_to_first_token(eng, _request(eng, f"ttft-{n}-{pct}-{r}", prompt, 1))
            best = min(best, ms)
        ttft.setdefault(str(n), {})[str(pct)] = round(best, 3)
        reused.setdefault(str(n), {})[str(pct)] = got

    # Decode: a full batch of short prompts, timed over steps that only decode.
    for i in range(args.decode_batch):
        eng.add_request(_request(eng, f"dec-{i}", _prompt(rng, vocab, 256), args.decode_tokens))
    decode_s, decode_tokens = 0.0, 0
    for _ in tqdm(range(10_000), desc="decode", file=sys.stderr, disable=None):
        if not eng.has_work():
            break
        _sync(eng)
        t0 = time.perf_counter()
        outs = eng.step()
        _sync(eng)
        if outs and all(not o.first_token for o in outs):
            decode_s += time.perf_counter() - t0
            decode_tokens += sum(len(o.new_token_ids) for o in outs)
    tok_s = decode_tokens / decode_s if decode_s else 0.0

    ref = "4096" if "4096" in ttft else str(max(lengths))
    ratio = None
    if "90" in ttft[ref] and "0" in ttft[ref] and ttft[ref]["0"] > 0:
        ratio = round(ttft[ref]["90"] / ttft[ref]["0"], 4)
    result = {
        "bench": "worker",
        "engine": eng.kind,
        "model": eng.model_name,
        "device": str(getattr(eng, "device", "cpu")),
        "dtype": eng.dtype,
        "block_size": bs,
        "prefill_chunk": args.prefill_chunk,
        "repeats": args.repeats,
        "ttft_ms": ttft,
        "reused_tokens": reused,
        "ttft_ratio_90pct_cached_4k": ratio,
        "ratio_length": int(ref),
        "decode_batch": args.decode_batch,
        "decode_tokens_per_s": round(tok_s, 1),
        "threads": torch.get_num_threads(),
        "profile": dataclasses.asdict(profile),
    }
    lines = [f"worker bench: {eng.describe()} on {result['device']}"]
    lines.append("TTFT ms  " + "".join(f"{p:>10}%" for p in cached))
    for n in lengths:
        lines.append(f"{n:>7}  " + "".join(f"{ttft[str(n)][str(p)]:>11.1f}" for p in cached))
    lines.append(
        f"90%-cached / full at {ref}: {ratio}   decode: {tok_s:.0f} tok/s at batch {args.decode_batch}"
    )
    sys.stdout.write("\n".join(lines) + "\n")
    if args.plot:
        _plot(ttft, lengths, cached, args.plot)
    eng.release_all()
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    return 0


def _plot(ttft: dict[str, dict[str, float]], lengths: list[int], cached: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for p in cached:
        ax.plot(lengths, [ttft[str(n)][str(p)] for n in lengths], marker="o", label=f"{p}% cached")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("kvmesh worker: time to first token vs cached prefix")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
