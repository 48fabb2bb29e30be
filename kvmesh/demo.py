"""``kvmesh demo``: a scripted multi-turn chat workload against intake, and a table of what happened.

Several users share one system prompt and hold multi-turn conversations. Each turn re-sends the whole
history (as OpenAI clients do), so after turn 1 most of every prompt is already cached somewhere in
the fleet; the table shows where each turn ran, its time to first token and how its prompt tokens
were served (reused on the worker, fetched from a peer, or recomputed).
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
) -> tuple[str, dict[str, Any], float]:
    body = {
        "model": "kvmesh-tiny",
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
) -> list[TurnResult]:
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
                answer, data, e2e = await _chat(client, url, f"demo-user-{u}", hist, max_tokens, headers)
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
    p.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = p.parse_args(argv)

    def go(url: str, before_turn: Callable[[int], None] | None = None) -> list[TurnResult]:
        return asyncio.run(run_demo(url, args.users, args.turns, args.max_tokens, args.api_key, before_turn))

    if args.embedded:
        from kvmesh.devstack import DevStack, DevStackSettings

        logs: list[str] = []
        sys.stderr.write(
            f"starting the embedded stack (broker, redis, kvmanager, scheduler, "
            f"{args.workers} workers, intake)...\n"
        )
        with DevStack(
            DevStackSettings(workers=args.workers, intake_port=0, log_level="WARNING"), sink=logs.append
        ) as stack:
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
        sys.stdout.write(json.dumps({"turns": [asdict(r) for r in results]}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
