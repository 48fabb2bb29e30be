"""``kvmesh bench chaos``: a multi-turn workload through the OpenAI SDK while a seeded schedule SIGKILLs
and restarts the fleet's parts, one at a time.

    kvmesh bench chaos [--durable] [--users 6 --turns 36 --think-s 1.0] [--seed 0]
        [--down-s 3 --every-s 6] [--plot FILE.png] [--json]

One embedded stack (``DevStack``: broker, Redis, KV manager, scheduler, 2 workers, intake). The same
conversations run twice, greedy, through ``openai.AsyncOpenAI`` (streaming, with the SDK's retries):

1. **reference**, no faults: the answer of every turn, and TTFT without faults;
2. **chaos**, with new session ids: while it runs, each component in a seeded order is SIGKILLed,
   left down for ``--down-s`` and started again: a worker, the scheduler, the KV manager, Redis, and
   with ``--durable`` the broker and, separately, its object store (whose files on disk outlive
   it). There is one intake, so intake is not killed.

Every chaos request is classified:

* ``completed``: streamed to its end (then ``wrong_output`` if its text differs from the reference
  answer of the same turn: the conversation's history is always the reference's, so each turn is
  comparable even after a failed one);
* ``failed_retriable``: the SDK gave up on a retriable status (429, 502, 503, 504) or the stream
  carried such an error: a clear answer the caller can retry;
* ``lost``: no answer within the request deadline (timeout, connection dropped, a 500);
* ``duplicated``: read back from the replies topic, a request id with more than one final
  Completion or served by more than one worker.

The last stdout line is one JSON object with those counts, ``faults`` (component, killed_s,
restarted_s), and TTFT p50/p99 of both phases. Goal: 0 lost, 0 duplicated, 0 wrong, >= 95 %
completed. ``--plot`` writes a timeline: every request at its start time against its TTFT, by
outcome, over the fault windows.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

from kvmesh.devstack import DevStack, DevStackSettings
from kvmesh.percentiles import percentile

log = logging.getLogger("kvmesh.bench.chaos")

MODEL = "kvmesh-tiny"
RETRIABLE = (429, 502, 503, 504)
#: The intake's request deadline in this bench (a lost request is one unanswered past it).
DEADLINE_S = 20.0


@dataclass
class Outcome:
    user: int
    turn: int
    start_s: float
    end_s: float
    ttft_s: float | None
    kind: str  # completed | failed_retriable | lost
    text: str = ""
    detail: str = ""
    wrong: bool = False


@dataclass
class Fault:
    component: str
    killed_s: float
    restarted_s: float = 0.0


@dataclass
class Phase:
    outcomes: list[Outcome] = field(default_factory=list)


def question(user: int, turn: int) -> str:
    topics_ = ("the cache", "a worker", "the scheduler", "the broker", "a block", "the fleet")
    return f"User {user}, turn {turn}: tell me about {topics_[(user + turn) % len(topics_)]}."


async def _one(
    client: Any, history: list[dict[str, str]], session: str, user: int, turn: int, t0: float
) -> Outcome:
    import openai

    start = time.monotonic()
    first: float | None = None
    parts: list[str] = []
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=history,
            max_tokens=8,
            temperature=0,
            stream=True,
            user=session,
        )
        finish = None
        async for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta.content
            if delta:
                if first is None:
                    first = time.monotonic()
                parts.append(delta)
            finish = chunk.choices[0].finish_reason or finish
        kind, detail = ("completed", "") if finish else ("failed_retriable", "stream ended without finish")
    except openai.APIStatusError as exc:
        retriable = exc.status_code in RETRIABLE
        kind, detail = ("failed_retriable" if retriable else "lost"), f"{exc.status_code} {exc.message}"
    except openai.APIError as exc:  # the error event of a stream, or a timeout / dropped connection
        body = getattr(exc, "body", None)
        code = body.get("code") if isinstance(body, dict) else None
        if code in ("timeout", "rejected", "unavailable", "worker_error"):
            kind, detail = "failed_retriable", f"stream error {code}"
        else:
            kind, detail = "lost", f"{type(exc).__name__}: {exc}"
    end = time.monotonic()
    return Outcome(
        user,
        turn,
        start - t0,
        end - t0,
        None if first is None else first - start,
        kind,
        "".join(parts),
        detail,
    )


async def run_phase(
    url: str,
    users: int,
    turns: int,
    think_s: float,
    tag: str,
    reference: dict[tuple[int, int], str] | None,
    bar: tqdm,
    t0: float,
) -> Phase:
    """Every user's conversation, users concurrently, turns one after another."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="chaos", max_retries=6, timeout=DEADLINE_S + 5)
    phase = Phase()

    async def converse(user: int) -> None:
        history: list[dict[str, str]] = [
            {"role": "system", "content": f"You are the fleet's assistant number {user}. " * 4}
        ]
        for turn in range(turns):
            history.append({"role": "user", "content": question(user, turn)})
            out = await _one(client, list(history), f"{tag}-user-{user}", user, turn, t0)
            want = reference.get((user, turn)) if reference is not None else None
            if out.kind == "completed" and want is not None and out.text != want:
                out.wrong = True
            phase.outcomes.append(out)
            bar.update(1)
            # the history stays the reference's, so every later turn is comparable
            history.append({"role": "assistant", "content": want if want is not None else out.text})
            await asyncio.sleep(think_s)

    try:
        await asyncio.gather(*(converse(u) for u in range(users)))
    finally:
        await client.close()
    return phase


def fault_plan(durable: bool, seed: int) -> list[str]:
    """The components to kill, in a seeded order (one worker, chosen by the seed)."""
    rng = random.Random(seed)
    parts = [f"worker-{rng.randrange(2)}", "scheduler", "kvmanager", "redis"]
    if durable:
        parts += ["broker", "object_store"]
    rng.shuffle(parts)
    return parts


async def run_faults(
    stack: DevStack, plan: list[str], down_s: float, every_s: float, t0: float, stop: asyncio.Event
) -> list[Fault]:
    faults: list[Fault] = []
    kill: dict[str, Callable[[], None]] = {
        "broker": stack.kill_broker,
        "object_store": stack.kill_object_store,
        "redis": stack.kill_redis,
    }
    start: dict[str, Callable[[], None]] = {
        "broker": stack.restart_broker,
        "object_store": stack.restart_object_store,
        "redis": stack.restart_redis,
    }
    await asyncio.sleep(every_s / 2)
    for part in plan:
        if stop.is_set():
            break
        f = Fault(part, time.monotonic() - t0)
        await asyncio.to_thread(kill.get(part) or functools.partial(stack.kill, part))
        log.info("chaos: killed %s", part)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(start.get(part) or functools.partial(stack.restart, part))
        f.restarted_s = time.monotonic() - t0
        log.info("chaos: restarted %s", part)
        faults.append(f)
        await asyncio.sleep(max(every_s - down_s, 0.0))
    return faults


def duplicates(stack: DevStack) -> tuple[list[tuple[str, list[str]]], int]:
    """(request ids with more than one final Completion or more than one serving worker, final
    Completions read), from the replies topic."""
    from schemas.messages import Completion
    from streams import topics
    from streams.consumer import TypedConsumer

    async def read() -> tuple[list[tuple[str, list[str]]], int]:
        c = TypedConsumer(stack.kafka, [topics.REPLIES], group_id=None, from_beginning=True, dedup=False)
        await c.start()
        finals: dict[str, list[str]] = {}
        try:
            quiet = time.monotonic()
            while time.monotonic() - quiet < 2.0:
                recs = await c.getmany(timeout_ms=300)
                if recs:
                    quiet = time.monotonic()
                for r in recs:
                    m = r.message
                    if isinstance(m, Completion) and m.finish_reason in ("stop", "length"):
                        finals.setdefault(m.request_id, []).append(f"{m.worker_id}@{r.envelope.event_ms}")
        finally:
            await c.stop()
        dup = [(rid, ws) for rid, ws in finals.items() if len(ws) > 1]
        return dup, sum(len(ws) for ws in finals.values())

    return asyncio.run(read())


def summarize(phase: Phase) -> dict[str, Any]:
    ttft = [o.ttft_s * 1000 for o in phase.outcomes if o.ttft_s is not None and o.kind == "completed"]
    p50, p99 = percentile(ttft, 50, None), percentile(ttft, 99, None)
    return {
        "ttft_p50_ms": None if p50 is None else round(p50, 1),
        "ttft_p99_ms": None if p99 is None else round(p99, 1),
    }


def plot(path: str, chaos: Phase, faults: list[Fault]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, f in enumerate(faults):
        ax.axvspan(f.killed_s, f.restarted_s, color=f"C{i % 10}", alpha=0.15)
        ax.text(f.killed_s, 1.0, f.component, transform=ax.get_xaxis_transform(), fontsize=8, va="top")
    styles = {"completed": ("o", "tab:green"), "failed_retriable": ("s", "tab:orange"), "lost": ("x", "red")}
    for kind, (marker, color) in styles.items():
        pts = [o for o in chaos.outcomes if o.kind == kind]
        if pts:
            ax.scatter(
                [o.start_s for o in pts],
                [(o.ttft_s if o.ttft_s is not None else o.end_s - o.start_s) * 1000 for o in pts],
                marker=marker,
                color=color,
                s=14,
                label=f"{kind} ({len(pts)})",
            )
    wrong = [o for o in chaos.outcomes if o.wrong]
    if wrong:
        ax.scatter([o.start_s for o in wrong], [1] * len(wrong), marker="*", color="black", label="wrong")
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the chaos phase began (shaded: component down)")
    ax.set_ylabel("TTFT (failed: time to the error), ms")
    ax.set_title("kvmesh bench chaos: requests and faults")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvmesh bench chaos", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--durable", action="store_true", help="durable broker and Redis; the broker is killed too"
    )
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--turns", type=int, default=36)
    ap.add_argument("--think-s", type=float, default=1.0, help="pause between a user's turns")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--down-s", type=float, default=3.0, help="how long a killed component stays down")
    ap.add_argument("--every-s", type=float, default=6.0, help="time between two kills")
    ap.add_argument("--plot", default=None, help="write the timeline PNG here")
    ap.add_argument("--log", default=None, help="write every service's log lines here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    # A SIGTERM ends the run like Ctrl-C: the stack's processes are stopped, not orphaned.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:

    settings = DevStackSettings(
        workers=2,
        intake_port=0,
        gpu_blocks=512,
        dram_blocks=1024,
        durable=args.durable,
        log_level="WARNING",
        extra_env={"KVMESH_INTAKE_REQUEST_TIMEOUT_S": str(DEADLINE_S)},
    )
    plan = fault_plan(args.durable, args.seed)
    log_file = open(args.log, "w") if args.log else None  # noqa: SIM115 - closed below

    def sink(line: str) -> None:
        if log_file is not None:
            log_file.write(f"{time.time() * 1000:.0f} {line}\n")

    try:
        return _run_stack(args, settings, plan, sink)
    finally:
        if log_file is not None:
            log_file.close()


def _run_stack(
    args: argparse.Namespace, settings: DevStackSettings, plan: list[str], sink: Callable[[str], None]
) -> int:
    total = args.users * args.turns
    with DevStack(settings, sink=sink) as stack:
        t0 = time.monotonic()
        with tqdm(total=total, desc="reference", unit="req", file=sys.stderr) as bar:
            ref = asyncio.run(
                run_phase(stack.intake_url, args.users, args.turns, args.think_s, "ref", None, bar, t0)
            )
        answers = {(o.user, o.turn): o.text for o in ref.outcomes if o.kind == "completed"}

        async def chaos_phase() -> tuple[Phase, list[Fault]]:
            t1 = time.monotonic()
            sink(f"[bench] chaos phase starts at wall {time.time() * 1000:.0f}")
            stop = asyncio.Event()
            faults = asyncio.create_task(run_faults(stack, plan, args.down_s, args.every_s, t1, stop))
            with tqdm(total=total, desc="chaos", unit="req", file=sys.stderr) as bar:
                phase = await run_phase(
                    stack.intake_url, args.users, args.turns, args.think_s, "chaos", answers, bar, t1
                )
            stop.set()
            return phase, await faults

        chaos, faults = asyncio.run(chaos_phase())
        dup, finals = duplicates(stack)

    outs = chaos.outcomes
    count = {k: sum(1 for o in outs if o.kind == k) for k in ("completed", "failed_retriable", "lost")}
    report: dict[str, Any] = {
        "durable": args.durable,
        "seed": args.seed,
        "sent": len(outs),
        **count,
        "completed_ratio": round(count["completed"] / max(len(outs), 1), 4),
        "duplicated": len(dup),
        "duplicated_ids": [{"request_id": rid, "workers": ws} for rid, ws in dup][:20],
        "wrong_output": sum(1 for o in outs if o.wrong),
        "reference_completed": len(answers),
        "final_completions_read": finals,
        "faults": [asdict(f) for f in faults],
        "ttft_without_faults": summarize(ref),
        "ttft_with_faults": summarize(chaos),
        "reference_not_completed": [
            {"user": o.user, "turn": o.turn, "kind": o.kind, "detail": o.detail[:200]}
            for o in ref.outcomes
            if o.kind != "completed"
        ][:20],
        "not_completed": [
            {"user": o.user, "turn": o.turn, "kind": o.kind, "detail": o.detail[:200]}
            for o in outs
            if o.kind != "completed"
        ][:20],
    }
    if args.plot:
        plot(args.plot, chaos, faults)
        report["plot"] = args.plot
    if not args.json:
        for k in ("sent", "completed", "failed_retriable", "lost", "duplicated", "wrong_output"):
            sys.stdout.write(f"{k:>18}: {report[k]}\n")
        for f in faults:
            sys.stdout.write(f"{'fault':>18}: {f.component} down {f.killed_s:.1f}s -> {f.restarted_s:.1f}s\n")
    sys.stdout.write(json.dumps(report) + "\n")
    ok = report["lost"] == 0 and not dup and report["wrong_output"] == 0
    return 0 if ok and report["completed_ratio"] >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
