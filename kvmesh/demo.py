"""``kvmesh demo``: a scripted multi-turn chat workload against intake, and a table of what happened.

Several users share one system prompt and hold multi-turn conversations. Each turn re-sends the whole
history (as OpenAI clients do), so after turn 1 most of every prompt is already cached somewhere in
the fleet; the table shows where each turn ran, its time to first token and how its prompt tokens
were served (reused on the worker, fetched from a peer, or recomputed).

``--embedded --engine vllm --model DIR`` runs it on vLLM workers (with the kvmesh KV connector). With
``--json`` the last line is one JSON object: the totals of reused, fetched and recomputed tokens and
``outputs_match_reference``, true when every greedy answer equals the answer of a recompute-only run of
the same conversation (a fresh engine of the same kind, each prompt in a namespace of its own).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

SYSTEM_PROMPT = (
    "You are kvmesh-tiny, a helpful assistant of the kvmesh demo fleet. Answer briefly and precisely. "
    "The fleet keeps the KV cache of every conversation so that follow-up turns start fast. " * 3
)
QUESTIONS = [
    "What is a KV cache and why does prefill cost so much?",
    "How does routing by estimated time to first token differ from sticky sessions?",
    "When is fetching blocks from a peer cheaper than recomputing them?",
]


@dataclass
class TurnResult:
    user: int
    turn: int
    worker: str
    ttft_ms: float
    e2e_ms: float
    prompt_tokens: int
    reused: int
    fetched: int
    recomputed: int
    completion_tokens: int


async def _chat(
    client: httpx.AsyncClient,
    url: str,
    session: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    headers: dict[str, str],
    model: str = "kvmesh-tiny",
) -> tuple[str, dict[str, Any], float]:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "user": session,
    }
    t0 = time.perf_counter()
    r = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
    e2e = (time.perf_counter() - t0) * 1e3
    if r.status_code != 200:
        raise RuntimeError(f"intake answered {r.status_code}: {r.text}")
    data = r.json()
    return data["choices"][0]["message"]["content"], data, e2e


async def run_demo(
    url: str,
    users: int,
    turns: int,
    max_tokens: int,
    api_key: str | None,
    before_turn: Callable[[int], None] | None = None,
    model: str = "kvmesh-tiny",
    transcripts: dict[tuple[int, int], tuple[list[dict[str, str]], str]] | None = None,
) -> list[TurnResult]:
    """Run the conversations; ``transcripts`` (if given) receives (user, turn) → (messages, answer)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results: list[TurnResult] = []
    histories = {u: [{"role": "system", "content": SYSTEM_PROMPT}] for u in range(users)}
    async with httpx.AsyncClient(timeout=120.0) as client:
        for turn in range(turns):
            if before_turn is not None:
                await asyncio.to_thread(before_turn, turn + 1)

            async def one(u: int, turn: int = turn) -> None:
                hist = histories[u]
                hist.append({"role": "user", "content": f"(user {u}) {QUESTIONS[turn % len(QUESTIONS)]}"})
                answer, data, e2e = await _chat(
                    client, url, f"demo-user-{u}", hist, max_tokens, headers, model
                )
                if transcripts is not None:
                    transcripts[(u, turn + 1)] = ([dict(m) for m in hist], answer)
                hist.append({"role": "assistant", "content": answer})
                ext = data.get("kvmesh", {})
                usage = data.get("usage", {})
                results.append(
                    TurnResult(
                        user=u,
                        turn=turn + 1,
                        worker=str(ext.get("worker", "?")),
                        ttft_ms=float(ext.get("ttft_ms", 0.0)),
                        e2e_ms=e2e,
                        prompt_tokens=int(usage.get("prompt_tokens", 0)),
                        reused=int(ext.get("reused_tokens", 0)),
                        fetched=int(ext.get("fetched_tokens", 0)),
                        recomputed=int(ext.get("recomputed_tokens", 0)),
                        completion_tokens=int(usage.get("completion_tokens", 0)),
                    )
                )

            await asyncio.gather(*(one(u) for u in range(users)))
    results.sort(key=lambda r: (r.turn, r.user))
    return results


def format_table(results: list[TurnResult]) -> str:
    head = (
        f"{'turn':>4} {'user':>4} {'worker':<9} {'ttft ms':>8} {'e2e ms':>8} {'prompt':>6} "
        f"{'reused':>6} {'fetched':>7} {'recomp':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.turn:>4} {r.user:>4} {r.worker:<9} {r.ttft_ms:>8.1f} {r.e2e_ms:>8.1f} "
            f"{r.prompt_tokens:>6} {r.reused:>6} {r.fetched:>7} {r.recomputed:>6}"
        )
    total = sum(r.prompt_tokens for r in results) or 1
    cached = sum(r.reused + r.fetched for r in results)
    first = [r.ttft_ms for r in results if r.turn == 1]
    later = [r.ttft_ms for r in results if r.turn > 1]
    lines.append("")
    lines.append(
        f"prompt tokens served from cache: {cached}/{total} ({100 * cached / total:.0f}%), "
        f"of which fetched from peers: {sum(r.fetched for r in results)}"
    )
    if first and later:
        lines.append(
            f"mean TTFT turn 1: {sum(first) / len(first):.1f} ms, "
            f"later turns: {sum(later) / len(later):.1f} ms"
        )
    return "\n".join(lines)


def reference_answers(
    engine: str,
    model: str,
    dtype: str,
    block_size: int,
    conversations: list[list[dict[str, str]]],
    max_tokens: int,
    max_context: int | None = None,
) -> list[str]:
    """Each conversation's next greedy answer from a fresh engine that reuses nothing: every prompt gets
    a namespace of its own (a cache salt of its own in vLLM), so every token is recomputed."""
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep vLLM's start-up chatter off stdout
    from kvmesh_core.tokenizer import ChatMessage, render_chat
    from schemas.blocks import block_hashes
    from services.worker.config import WorkerSettings
    from services.worker.engine_api import EngineRequest
    from services.worker.engines import build_engine

    eng = build_engine(
        WorkerSettings(
            worker_id="demo-reference",
            engine=engine,  # type: ignore[arg-type]  # the settings validate the name
            model=model,
            dtype=dtype,
            block_size=block_size,
            gpu_blocks=512,
            dram_blocks=0,
            disk_blocks=0,
            vllm_connector=False,
            max_context=max_context,
            calibrate=False,
            insecure_dev_transfer=True,
        )
    )
    answers = []
    try:
        for i, msgs in enumerate(conversations):
            ids = render_chat(eng.tokenizer, [ChatMessage(m["role"], m["content"]) for m in msgs])
            ns = b"demo-reference:%d" % i
            eng.add_request(
                EngineRequest(f"ref-{i}", "ref", ids, block_hashes(ids, eng.block_size, ns), ns, max_tokens)
            )
            out: list[int] = []
            while eng.has_work():
                for o in eng.step():
                    out += o.new_token_ids
            answers.append(eng.tokenizer.decode(out))
    finally:
        eng.release_all()
    return answers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvmesh demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="intake base URL of a running stack")
    p.add_argument("--embedded", action="store_true", help="start the embedded default stack first")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--no-drain", action="store_true", help="with --embedded: do not drain worker-0 before the last turn"
    )
    p.add_argument("--engine", choices=["builtin", "vllm"], default="builtin", help="with --embedded")
    p.add_argument("--model", default="tiny", help="with --embedded: a built-in size or a model directory")
    p.add_argument(
        "--dtype",
        default=None,
        help="with --embedded: the workers' dtype (default float32 for vllm, so the reference is exact)",
    )
    p.add_argument(
        "--model-name", default=None, help="the OpenAI model name to ask for (default: the served one)"
    )
    p.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = p.parse_args(argv)
    from services.worker.config import served_model_for

    model_name = args.model_name or served_model_for(args.model)
    dtype = args.dtype or ("float32" if args.engine == "vllm" else "auto")
    transcripts: dict[tuple[int, int], tuple[list[dict[str, str]], str]] = {}

    def go(url: str, before_turn: Callable[[int], None] | None = None) -> list[TurnResult]:
        return asyncio.run(
            run_demo(
                url,
                args.users,
                args.turns,
                args.max_tokens,
                args.api_key,
                before_turn,
                model=model_name,
                transcripts=transcripts,
            )
        )

    if args.embedded:
        from kvmesh.devstack import DevStack, DevStackSettings

        logs: list[str] = []
        sys.stderr.write(
            f"starting the embedded stack (broker, redis, kvmanager, scheduler, "
            f"{args.workers} workers, intake)...\n"
        )
        settings = DevStackSettings(
            workers=args.workers,
            intake_port=0,
            log_level="WARNING",
            engine=args.engine,
            model=args.model,
            extra_env={"KVMESH_WORKER_DTYPE": dtype},
        )
        with DevStack(settings, sink=logs.append) as stack:
            sys.stderr.write(
                f"stack up at {stack.intake_url}; running {args.users} users x {args.turns} turns\n"
            )

            def drain_before_last(turn: int) -> None:
                # Maintenance on worker-0: it takes no new work but still serves its KV blocks, so
                # its users' last turn runs elsewhere by fetching their history, not recomputing it.
                if turn == args.turns and turn > 1 and args.workers > 1 and not args.no_drain:
                    sys.stderr.write(
                        f"turn {turn}: draining worker-0 (its sessions move, fetching their KV)\n"
                    )
                    stack.set_drain("worker-0", True, reason="demo")

            results = go(stack.intake_url, drain_before_last)
    else:
        results = go(args.url)
    sys.stdout.write(format_table(results) + "\n")
    if args.json:
        summary: dict[str, Any] = {
            "engine": args.engine if args.embedded else None,
            "model": model_name,
            "reused_tokens": sum(r.reused for r in results),
            "fetched_tokens": sum(r.fetched for r in results),
            "recomputed_tokens": sum(r.recomputed for r in results),
            "outputs_match_reference": None,
            "turns": [asdict(r) for r in results],
        }
        if args.embedded:
            sys.stderr.write("recomputing every answer on a fresh engine for the reference...\n")
            keys = sorted(transcripts)
            bs = 32 if args.engine == "vllm" else 16
            want = reference_answers(
                args.engine, args.model, dtype, bs, [transcripts[k][0] for k in keys], args.max_tokens
            )
            mismatches = [k for k, w in zip(keys, want, strict=True) if transcripts[k][1] != w]
            summary["outputs_match_reference"] = not mismatches
            summary["mismatches"] = [{"user": u, "turn": t} for u, t in mismatches]
        sys.stdout.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
