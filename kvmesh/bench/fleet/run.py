"""Playing a workload: sessions concurrently, each one's turns in order, on a fresh embedded stack per
policy or on an existing one."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from kvmesh.bench.fleet.drivers import Driver, HttpDriver, SdkDriver, Served
from kvmesh.bench.fleet.errors import FleetBenchError
from kvmesh.bench.fleet.records import TurnRecord, summarize_live, to_sim_result
from kvmesh.sim.engine import SimResult
from kvmesh.workloads import Session, Workload
from kvmesh_core.costmodel import PerfProfile
from kvmesh_core.errors import KvmeshError
from services.scheduler.router import POLICIES
from streams.settings import KafkaSettings

log = logging.getLogger("kvmesh.bench.fleet")


async def drive(
    driver: Driver, workload: Workload, progress: Callable[[int], object] | None = None
) -> list[TurnRecord]:
    """Play ``workload`` through ``driver``: sessions concurrently, each one's turns in order, none
    before its due time. A turn that fails ends its session (its context would be wrong)."""
    t0 = time.perf_counter()
    records: list[TurnRecord] = []

    async def play(session: Session) -> None:
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
    driver: Driver, workload: Workload, progress: Callable[[int], object] | None
) -> list[TurnRecord]:
    await driver.start()
    try:
        return await drive(driver, workload, progress)
    finally:
        await driver.stop()


def run_policy(
    policy: str,
    workload: Workload,
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
    workload: Workload,
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
    workload: Workload,
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
