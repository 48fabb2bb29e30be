"""``kvmesh bench fleet``: one workload against the live pipeline under every routing policy.

    kvmesh bench fleet [--workload multiturn|shared-prefix|trace] [--trace FILE --token-scale 1/32]
        [--policies round_robin,...,dynamo,llm_d,sglang,kvmesh (every policy)] [--workers 2]
        [--users 4 --rounds 3 ...] [--time-scale X] [--max-requests K] [--plot DIR] [--json]
    kvmesh bench fleet --bootstrap HOST:PORT | --url http://HOST:PORT   (an existing stack: one policy)

For each policy a fresh embedded stack (``DevStack``: broker, Redis, kvmanager, scheduler, N workers,
intake) is started, so no run inherits another's caches; the workload is driven through the producer
SDK (``kvmesh_client.KvmeshClient``, token ids straight in) or, with ``--url``, through intake's
streaming HTTP API. Users run concurrently, each user's turns strictly one after another, and every
next turn's prompt is the previous prompt + the real answer + the new question
(:mod:`kvmesh.bench.fleet_workloads`).

Per policy it reports the simulator's summary (:func:`kvmesh.sim.metrics.summarize`, same field
names, so ``kvmesh simulate`` and this bench can be set side by side):

* TTFT -- client side: submit -> first TokenChunk (HTTP: first SSE event, sent with the first token).
* end-to-end -- submit -> Completion; throughput over the run's makespan.
* reused / fetched / recomputed prompt tokens -- from the Completions.
* busy fraction per worker -- the union of the intervals during which the worker held a request
  (its own ``e2e_ms`` measured back from when the Completion arrived) over the makespan; spread =
  max - min in percentage points.

With ``--json`` the last stdout line is one JSON object ``{"policies": {name: summary}, ...}``; each
summary also holds ``errors``, ``worker_ids``, ``wall_s`` and the ``profile`` the workers calibrated
(a :class:`~kvmesh_core.costmodel.PerfProfile` as a dict: what to feed the simulator for the same fleet).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from tqdm import tqdm

from kvmesh.bench.fleet_workloads import (
    LiveSession,
    LiveWorkload,
    mooncake_live,
    multiturn_live,
    shared_prefix_live,
)
from kvmesh.sim.engine import SimResult
from kvmesh.sim.metrics import RequestRecord
from kvmesh.workloads import MultiTurnSpec, SharedPrefixSpec, WorkloadError
from kvmesh_core.costmodel import PerfProfile
from kvmesh_core.errors import KvmeshError
from services.scheduler.router import POLICIES
from streams.settings import KafkaSettings

log = logging.getLogger(__name__)


class FleetBenchError(KvmeshError):
    """The live benchmark cannot run as asked (bad arguments, a stack that never answers)."""


# ------------------------------------------------------------------------------------------------ records


@dataclass(slots=True)
class TurnRecord:
    """How one request of the live run went; times in seconds since the run started (client clock)."""

    session_id: str
    turn: int
    request_id: str
    worker_id: str
    submit_s: float
    first_token_s: float
    done_s: float
    prompt_tokens: int
    reused_tokens: int
    fetched_tokens: int
    recomputed_tokens: int
    output_tokens: int
    worker_ttft_ms: float  # assignment receipt -> first token, measured by the worker
    worker_e2e_ms: float  # assignment receipt -> Completion, measured by the worker (0: unknown)
    finish_reason: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("stop", "length")

    def busy_interval(self) -> tuple[float, float]:
        """When the worker held this request: its own duration, measured back from the Completion's
        arrival (the reply lag shifts both ends alike), never before the request was submitted."""
        if self.worker_e2e_ms > 0:
            start = self.done_s - self.worker_e2e_ms / 1000.0
        else:  # HTTP gives no worker e2e: the worker's TTFT back from the first token's arrival
            start = self.first_token_s - self.worker_ttft_ms / 1000.0
        return max(start, self.submit_s), self.done_s


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once; empty or reversed ones ignored)."""
    total = 0.0
    start: float | None = None
    end = 0.0
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if start is None or a > end:
            if start is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if start is not None:
        total += end - start
    return total


def to_sim_result(policy: str, records: Sequence[TurnRecord], worker_ids: Sequence[str]) -> SimResult:
    """The live run as a :class:`SimResult` (ms), so the simulator's summary and plots apply unchanged.

    Failed requests are left out of the records and counted as ``rejected``.
    """
    ids = list(worker_ids)
    for r in records:
        if r.ok and r.worker_id not in ids:
            ids.append(r.worker_id)  # a worker the caller did not know of (an existing stack)
    index = {w: i for i, w in enumerate(ids)}
    ok = [r for r in records if r.ok]
    sim_records = [
        RequestRecord(
            worker=index[r.worker_id],
            arrival_ms=r.submit_s * 1000.0,
            first_token_ms=r.first_token_s * 1000.0,
            done_ms=r.done_s * 1000.0,
            prompt_tokens=r.prompt_tokens,
            reused_tokens=r.reused_tokens,
            fetched_tokens=r.fetched_tokens,
            recomputed_tokens=r.recomputed_tokens,
            output_tokens=r.output_tokens,
        )
        for r in ok
    ]
    sim_records.sort(key=lambda rec: (rec.arrival_ms, rec.worker))
    busy_ms = [1000.0 * union_length([r.busy_interval() for r in ok if r.worker_id == w]) for w in ids]
    return SimResult(
        policy=policy,
        records=sim_records,
        busy_ms=busy_ms,
        worker_ids=ids,
        rejected=len(records) - len(ok),
        deferrals=0,
        arrivals=len(records),
    )


def summarize_live(policy: str, records: Sequence[TurnRecord], worker_ids: Sequence[str]) -> dict[str, Any]:
    """The simulator's summary of a live run, plus ``errors`` and ``worker_ids``."""
    result = to_sim_result(policy, records, worker_ids)
    summary = result.summary()
    summary["errors"] = result.rejected
    summary["worker_ids"] = list(result.worker_ids)
    return summary


# ------------------------------------------------------------------------------------------------ drivers


@dataclass(slots=True)
class Served:
    """What a driver learned about one request (times from ``time.perf_counter``)."""

    first_token_t: float
    done_t: float
    worker_id: str
    prompt_tokens: int
    reused_tokens: int
    fetched_tokens: int
    recomputed_tokens: int
    output_token_ids: list[int]
    worker_ttft_ms: float
    worker_e2e_ms: float
    finish_reason: str
    error: str | None = None


class Driver(Protocol):
    """Submits one turn and follows it to its end; owns its connection to the fleet."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def serve(
        self,
        session: LiveSession,
        prompt: list[int],
        appended: Sequence[int],
        max_tokens: int,
        request_id: str,
    ) -> Served: ...


class SdkDriver:
    """Token ids straight to ``kvmesh.requests`` through the producer SDK; replies from its reply topic."""

    def __init__(self, kafka: KafkaSettings, timeout_s: float = 120.0) -> None:
        from kvmesh_client import KvmeshClient

        self.client = KvmeshClient(kafka, client_id=f"bench-fleet-{uuid.uuid4().hex[:8]}")
        self.timeout_s = timeout_s

    async def start(self) -> None:
        await self.client.start()

    async def stop(self) -> None:
        await self.client.stop()

    async def serve(
        self,
        session: LiveSession,
        prompt: list[int],
        appended: Sequence[int],
        max_tokens: int,
        request_id: str,
    ) -> Served:
        req = self.client.build_request(
            token_ids=prompt,
            session_id=session.session_id,
            tenant=session.tenant,
            max_tokens=max_tokens,
            request_id=request_id,
        )
        handle = await self.client.submit(req)
        first: float | None = None
        try:
            async for _chunk in handle.stream(timeout=self.timeout_s):
                if first is None:
                    first = time.perf_counter()
            c = await handle.result(timeout=self.timeout_s)
        finally:
            handle.close()
        done = time.perf_counter()
        return Served(
            first_token_t=first if first is not None else done,
            done_t=done,
            worker_id=c.worker_id,
            prompt_tokens=c.prompt_tokens,
            reused_tokens=c.reused_tokens,
            fetched_tokens=c.fetched_tokens,
            recomputed_tokens=c.recomputed_tokens,
            output_token_ids=list(c.output_token_ids),
            worker_ttft_ms=c.ttft_ms,
            worker_e2e_ms=c.e2e_ms,
            finish_reason=c.finish_reason,
            error=c.error,
        )


class HttpDriver:
    """Intake's streaming chat API. Token ids travel as text (one character per byte, latin-1), each
    session's messages grow turn by turn; intake's prefix-stable template keeps the reuse structure.

    Intake re-tokenizes as UTF-8, so bytes >= 128 count two prompt tokens and the chat template adds
    its own: prompts are longer than through the SDK. Only workers that served a request are known."""

    def __init__(self, url: str, timeout_s: float = 120.0, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._messages: dict[str, list[dict[str, str]]] = {}
        self._http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        self._http = httpx.AsyncClient(timeout=self.timeout_s)

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def serve(
        self,
        session: LiveSession,
        prompt: list[int],
        appended: Sequence[int],
        max_tokens: int,
        request_id: str,
    ) -> Served:
        messages = self._messages.setdefault(session.session_id, [])
        messages.append({"role": "user", "content": bytes(appended).decode("latin-1")})
        body = {
            "model": "kvmesh-tiny",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "user": session.session_id,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        first: float | None = None
        text, error = "", None
        ext: dict[str, Any] = {}
        use: dict[str, Any] = {}
        assert self._http is not None, "driver not started"
        async with self._http.stream(
            "POST", f"{self.url}/v1/chat/completions", json=body, headers=self.headers
        ) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    first = first if first is not None else time.perf_counter()
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = str(event["error"])
                    for choice in event.get("choices", []):
                        text += choice.get("delta", {}).get("content") or ""
                    ext = event.get("kvmesh", ext)
                    use = event.get("usage", use)
        done = time.perf_counter()
        if session.carry_output:
            messages.append({"role": "assistant", "content": text})
        return Served(
            first_token_t=first if first is not None else done,
            done_t=done,
            worker_id=str(ext.get("worker", "?")),
            prompt_tokens=int(use.get("prompt_tokens", len(prompt))),
            reused_tokens=int(ext.get("reused_tokens", 0)),
            fetched_tokens=int(ext.get("fetched_tokens", 0)),
            recomputed_tokens=int(ext.get("recomputed_tokens", 0)),
            output_token_ids=list(text.encode()),
            worker_ttft_ms=float(ext.get("ttft_ms", 0.0)),
            worker_e2e_ms=0.0,
            finish_reason="stop" if error is None else "error",
            error=error,
        )


# ------------------------------------------------------------------------------------------------ the run


async def drive(
    driver: Driver, workload: LiveWorkload, progress: Callable[[int], object] | None = None
) -> list[TurnRecord]:
    """Play ``workload`` through ``driver``: sessions concurrently, each one's turns in order, none
    before its due time. A turn that fails ends its session (its context would be wrong)."""
    t0 = time.perf_counter()
    records: list[TurnRecord] = []

    async def play(session: LiveSession) -> None:
        context: list[int] = []
        for r, turn in enumerate(session.turns):
            delay = t0 + turn.due_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = [*context, *turn.append_tokens]
            request_id = f"{session.session_id}-r{r}-{uuid.uuid4().hex[:8]}"
            submit = time.perf_counter()
            try:
                s = await driver.serve(session, prompt, turn.append_tokens, turn.max_tokens, request_id)
            except (KvmeshError, OSError, TimeoutError, httpx.HTTPError) as exc:  # timeout, lost link
                now = time.perf_counter()
                s = Served(now, now, "?", len(prompt), 0, 0, 0, [], 0.0, 0.0, "error", str(exc) or repr(exc))
            records.append(
                TurnRecord(
                    session_id=session.session_id,
                    turn=r,
                    request_id=request_id,
                    worker_id=s.worker_id,
                    submit_s=submit - t0,
                    first_token_s=s.first_token_t - t0,
                    done_s=s.done_t - t0,
                    prompt_tokens=s.prompt_tokens,
                    reused_tokens=s.reused_tokens,
                    fetched_tokens=s.fetched_tokens,
                    recomputed_tokens=s.recomputed_tokens,
                    output_tokens=len(s.output_token_ids),
                    worker_ttft_ms=s.worker_ttft_ms,
                    worker_e2e_ms=s.worker_e2e_ms,
                    finish_reason=s.finish_reason,
                    error=s.error,
                )
            )
            if progress is not None:
                progress(1)
            if not records[-1].ok:
                log.warning(
                    "request %s failed (%s); session %s stops", request_id, s.error, session.session_id
                )
                if progress is not None:
                    progress(len(session.turns) - r - 1)
                return
            context = [*prompt, *s.output_token_ids] if session.carry_output else []

    await asyncio.gather(*(play(s) for s in workload.sessions))
    records.sort(key=lambda rec: (rec.submit_s, rec.session_id))
    return records


async def read_profiles(
    kafka: KafkaSettings, expect: Sequence[str] | None = None, timeout_s: float = 10.0
) -> dict[str, PerfProfile]:
    """Each worker's calibrated profile from its latest LoadReport on ``kvmesh.load``.

    Reads from the beginning until every worker of ``expect`` has reported (or, without ``expect``,
    until a poll brings nothing new), at most ``timeout_s``.
    """
    from schemas.messages import LoadReport
    from streams import topics
    from streams.consumer import TypedConsumer

    profiles: dict[str, PerfProfile] = {}
    consumer = TypedConsumer(kafka, [topics.LOAD], group_id=None, from_beginning=True, dedup=False)
    await consumer.start()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for rec in batch:
                if isinstance(rec.message, LoadReport):
                    profiles[rec.message.worker_id] = PerfProfile.from_load_report(rec.message)
            if expect is not None and set(expect) <= set(profiles):
                break
            if expect is None and profiles and not batch:
                break
    finally:
        await consumer.stop()
    return profiles


@dataclass(slots=True)
class PolicyRun:
    """One policy's live run: its records, the fleet's workers and what they calibrated."""

    policy: str
    records: list[TurnRecord]
    worker_ids: list[str]
    profiles: dict[str, PerfProfile]
    wall_s: float

    def result(self) -> SimResult:
        return to_sim_result(self.policy, self.records, self.worker_ids)

    def summary(self) -> dict[str, Any]:
        out = summarize_live(self.policy, self.records, self.worker_ids)
        out["wall_s"] = self.wall_s
        first = sorted(self.profiles)[:1]
        out["profile"] = dataclasses.asdict(self.profiles[first[0]]) if first else None
        return out


@dataclass(slots=True)
class StackOptions:
    """The embedded fleet each policy gets (DevStackSettings' knobs the bench exposes)."""

    workers: int = 2
    gpu_blocks: int = 1024
    dram_blocks: int = 4096
    timeout_s: float = 120.0


async def _run_with(
    driver: Driver, workload: LiveWorkload, progress: Callable[[int], object] | None
) -> list[TurnRecord]:
    await driver.start()
    try:
        return await drive(driver, workload, progress)
    finally:
        await driver.stop()


def run_policy(
    policy: str,
    workload: LiveWorkload,
    options: StackOptions | None = None,
    progress: Callable[[int], object] | None = None,
    sink: Callable[[str], None] | None = None,
    on_ready: Callable[[], object] | None = None,
) -> PolicyRun:
    """``workload`` on a fresh embedded stack running ``policy``; the stack is stopped afterwards.

    ``on_ready`` is called once the stack is up (the progress bar restarts its clock there)."""
    from kvmesh.devstack import DevStack, DevStackSettings

    opts = options or StackOptions()
    settings = DevStackSettings(
        workers=opts.workers,
        policy=policy,
        intake_port=0,
        log_level="WARNING",
        gpu_blocks=opts.gpu_blocks,
        dram_blocks=opts.dram_blocks,
    )
    logs: list[str] = []
    with DevStack(settings, sink=sink or logs.append) as stack:
        if on_ready is not None:
            on_ready()
        started = time.perf_counter()
        records = asyncio.run(_run_with(SdkDriver(stack.kafka, opts.timeout_s), workload, progress))
        wall = time.perf_counter() - started
        profiles = asyncio.run(read_profiles(stack.kafka, stack.worker_ids))
        return PolicyRun(policy, records, stack.worker_ids, profiles, wall)


def run_existing(
    workload: LiveWorkload,
    *,
    bootstrap: str | None = None,
    url: str | None = None,
    api_key: str | None = None,
    policy: str = "existing",
    timeout_s: float = 120.0,
    progress: Callable[[int], object] | None = None,
) -> PolicyRun:
    """``workload`` against a running stack, through its broker (SDK) or its intake URL (HTTP)."""
    started = time.perf_counter()
    if bootstrap:
        kafka = KafkaSettings(bootstrap_servers=bootstrap)
        records = asyncio.run(_run_with(SdkDriver(kafka, timeout_s), workload, progress))
        profiles = asyncio.run(read_profiles(kafka))
    elif url:
        records = asyncio.run(_run_with(HttpDriver(url, timeout_s, api_key), workload, progress))
        profiles = {}
    else:
        raise FleetBenchError("an existing stack needs --bootstrap or --url")
    wall = time.perf_counter() - started
    workers = sorted(profiles) or sorted({r.worker_id for r in records if r.ok})
    return PolicyRun(policy, records, workers, profiles, wall)


def run_fleet(
    workload: LiveWorkload,
    policies: Sequence[str],
    options: StackOptions | None = None,
    show_progress: bool = True,
) -> list[PolicyRun]:
    """The live benchmark's core: ``workload`` under each policy, each on its own fresh stack."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise FleetBenchError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    runs = []
    for policy in policies:
        bar = tqdm(
            total=workload.requests, desc=policy, unit="req", disable=not show_progress, file=sys.stderr
        )
        with bar:
            runs.append(run_policy(policy, workload, options, progress=bar.update, on_ready=bar.reset))
    return runs


# ------------------------------------------------------------------------------------------------ output

_COLUMNS = (
    ("ttft_p50_s", "p50 s"),
    ("ttft_p90_s", "p90 s"),
    ("ttft_p99_s", "p99 s"),
    ("e2e_p50_s", "e2e p50"),
    ("throughput_rps", "req/s"),
    ("reused_token_fraction", "reused"),
    ("fetched_token_fraction", "fetched"),
    ("recomputed_token_fraction", "recomp"),
    ("busy_fraction_mean", "busy"),
    ("busy_fraction_spread", "spread pt"),
)


def format_table(summaries: dict[str, dict[str, Any]]) -> str:
    """One row per policy of the headline figures."""
    lines = [f"{'policy':<17}" + "".join(f"{h:>10}" for _, h in _COLUMNS) + f"{'errors':>8}"]
    for name, s in summaries.items():
        row = "".join(f"{float(s[k]):>10.3f}" for k, _ in _COLUMNS)
        lines.append(f"{name:<17}{row}{int(s.get('errors', 0)):>8}")
    return "\n".join(lines)


def build_output(workload: LiveWorkload, runs: Sequence[PolicyRun], workers: int | None) -> dict[str, Any]:
    """The JSON object of a benchmark run."""
    return {
        "bench": "fleet",
        "workload": workload.name,
        "workload_params": workload.params,
        "requests": workload.requests,
        "workers": workers,
        "policies": {run.policy: run.summary() for run in runs},
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh bench fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=("multiturn", "shared-prefix", "trace"), default=None)
    p.add_argument("--trace", help="Mooncake JSON lines (implies --workload trace)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma list of {', '.join(POLICIES)}")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--users",
        type=int,
        default=5,
        # Odd by default: with an even count on 2 workers, round robin pins every user by accident.
        help="multiturn: conversations (shared-prefix: groups)",
    )
    p.add_argument("--rounds", type=int, default=3, help="multiturn: rounds (shared-prefix: per group)")
    p.add_argument("--system-tokens", type=int, default=256, help="multiturn: shared system prompt")
    p.add_argument("--history-tokens", type=int, default=1024, help="multiturn: per-user history")
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--prefix-tokens", type=int, default=512, help="shared-prefix: group prefix")
    p.add_argument("--qps", type=float, default=4.0, help="synthetic workloads: request rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply timestamps")
    p.add_argument("--token-scale", type=float, default=1 / 32, help="trace: multiply every length")
    p.add_argument("--max-requests", type=int, default=64, help="trace: first K rows")
    p.add_argument("--max-output-tokens", type=int, default=64, help="trace: cap on answers")
    p.add_argument("--gpu-blocks", type=int, default=1024)
    p.add_argument("--dram-blocks", type=int, default=4096)
    p.add_argument("--timeout-s", type=float, default=120.0, help="per reply")
    p.add_argument("--bootstrap", help="an existing stack's broker (SDK); runs its one policy")
    p.add_argument("--url", help="an existing stack's intake (HTTP); runs its one policy")
    p.add_argument("--api-key", default=None, help="--url: Bearer key")
    p.add_argument("--plot", metavar="DIR", help="write ttft_cdf.png and busy_fraction.png here")
    p.add_argument("--json", action="store_true", help="last stdout line: the results as one JSON object")
    p.add_argument("--no-progress", action="store_true")
    return p


def workload_from_args(args: argparse.Namespace) -> LiveWorkload:
    kind = "trace" if args.trace else (args.workload or "multiturn")
    if kind == "trace":
        if not args.trace:
            raise FleetBenchError("--workload trace needs --trace FILE")
        return mooncake_live(
            args.trace, args.time_scale, args.max_requests, args.token_scale, args.max_output_tokens
        )
    if kind == "shared-prefix":
        return shared_prefix_live(
            SharedPrefixSpec(
                groups=args.users,
                per_group=args.rounds,
                prefix_tokens=args.prefix_tokens,
                question_tokens=args.question_tokens,
                output_tokens=args.answer_tokens,
                qps=args.qps,
                seed=args.seed,
            )
        )
    return multiturn_live(
        MultiTurnSpec(
            users=args.users,
            rounds=args.rounds,
            system_prompt_tokens=args.system_tokens,
            history_tokens=args.history_tokens,
            question_tokens=args.question_tokens,
            answer_tokens=args.answer_tokens,
            qps=args.qps,
            seed=args.seed,
        )
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        workload = workload_from_args(args)
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        if args.bootstrap or args.url:
            # The stack runs whatever policy it was started with; one name in --policies labels it.
            label = policies[0] if len(policies) == 1 else "existing"
            bar = tqdm(
                total=workload.requests,
                desc="existing",
                unit="req",
                disable=args.no_progress,
                file=sys.stderr,
            )
            with bar:
                run = run_existing(
                    workload,
                    bootstrap=args.bootstrap,
                    url=args.url,
                    api_key=args.api_key,
                    policy=label,
                    timeout_s=args.timeout_s,
                    progress=bar.update,
                )
            runs = [run]
            workers = len(run.worker_ids)
        else:
            options = StackOptions(args.workers, args.gpu_blocks, args.dram_blocks, args.timeout_s)
            runs = run_fleet(workload, policies, options, show_progress=not args.no_progress)
            workers = args.workers
    except (FleetBenchError, WorkloadError, OSError, ValueError, RuntimeError, TimeoutError) as exc:
        sys.stderr.write(f"kvmesh bench fleet: {exc}\n")
        return 2
    out = build_output(workload, runs, workers)
    if args.plot:
        from kvmesh.sim.plots import write_plots  # matplotlib only when asked for

        out["plots"] = [str(p) for p in write_plots([r.result() for r in runs], args.plot)]
    sys.stdout.write(format_table(out["policies"]) + "\n")
    if args.json:
        sys.stdout.write(json.dumps(out, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
