"""``kvmesh simulate``: run the live scheduler policies over a trace or a synthetic workload.

    kvmesh simulate --trace FILE --workers 16 --policies round_robin,prefix_aware,kvmesh \\
        [--time-scale X] [--max-requests K] [--profile h100-llama3-8b|FILE.json] [--plot DIR] [--json]
    kvmesh simulate --workload multiturn|shared-prefix --workers 8 --json

``--time-scale`` multiplies trace timestamps (0.5 = twice the arrival rate). Traces use 512-token
blocks by default (one block per Mooncake hash id); synthetic workloads use 16. With ``--json`` the
last stdout line is one JSON object: ``{"policies": {name: summary}, ...}`` (see kvmesh.sim.metrics).

``--time-scales 0.25,0.28,0.3,0.5`` (trace only) runs that simulation once per scale and checks
issue #8's goal at each (kvmesh.sim.metrics.issue8_goal); with ``--json`` the last line is then
``{"sweep": [{"time_scale": x, "policies": {...}, "goal": {...}}, ...], "goal_met_at": [x, ...], ...}``
and ``--plot DIR`` writes DIR/time_scale_sweep.png (TTFT p50 per policy against scale).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from tqdm import tqdm

from kvmesh.sim.bound import bound_by_request, bound_summary, per_request_excess
from kvmesh.sim.engine import SIM_POLICIES, SimConfig, SimResult, simulate
from kvmesh.sim.errors import SimError
from kvmesh.sim.metrics import GOAL_POLICIES, issue8_goal
from kvmesh.sim.oracle import ORACLE
from kvmesh.sim.peer_goal import MAX_RATIO, MAX_RATIO_TRUTH_DRIFT, add_excess, peer_goal
from kvmesh.sim.recorder import SimRecorder
from kvmesh.sim.seeds import goal_tally, median_figures, median_policies, seed_digest, seeded_truths
from kvmesh.sim.truth import TruthScale
from kvmesh.sim.worker import ADMISSIONS, LOADS
from kvmesh.workloads import (
    MultiTurnSpec,
    SharedPrefixSpec,
    WorkloadError,
    multiturn,
    shared_prefix,
    trace_requests,
)
from kvmesh_core.costmodel import load_profile
from kvmesh_core.load_reports import LOAD_INTERVAL_MS
from schemas.messages import ChatRequest
from services.scheduler.router import POLICIES
from services.scheduler.virtual_clock import AHEAD

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh simulate", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", help="Mooncake JSON lines (.jsonl) or Azure CSV (.csv)")
    src.add_argument("--workload", choices=("multiturn", "shared-prefix"), help="synthetic workload")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma list of {', '.join(SIM_POLICIES)} ({ORACLE}: the perfect-information reference, "
        "kvmesh.sim.oracle; not in the default list)",
    )
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (trace only)")
    p.add_argument(
        "--time-scales",
        type=_scales,
        default=None,
        metavar="X,Y,...",
        help="sweep: a --time-scale run per value with issue #8's goal check (trace only; overrides it)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=0,
        metavar="N",
        help="sweep: run each row once per seed 1..N of the truth's per-request prefill noise (2 %% "
        "when --truth-scale sets none) and report the medians, each seed's figures and in how many "
        "seeds issue #22's goal held (kvmesh.sim.seeds)",
    )
    p.add_argument(
        "--jobs", type=int, default=1, metavar="J", help="sweep: run J simulations at once (processes)"
    )
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument(
        "--tile",
        type=int,
        default=1,
        help="trace: play K copies at once, each its own tenant (K times the load, for K times the workers)",
    )
    p.add_argument("--profile", default="h100-llama3-8b", help="named profile or a benchmark's JSON")
    p.add_argument("--block-size", type=int, default=None, help="tokens per block (trace 512, else 16)")
    p.add_argument(
        "--truth-scale",
        type=_truth,
        default=TruthScale(),
        metavar="prefill=X,decode=Y,link=Z[,tier=T,noise=S,seed=N]",
        help="the simulated engine runs at the published profile's times times these factors "
        "(policies see only the published profile); noise: per-request log-normal prefill sigma",
    )
    p.add_argument("--lag-ms", type=float, default=10.0, help="worker -> scheduler message lag")
    p.add_argument(
        "--heartbeat-ms",
        type=float,
        default=float(LOAD_INTERVAL_MS),
        help="a quiet worker reports this often (default: the live worker's load interval)",
    )
    p.add_argument(
        "--admission",
        choices=ADMISSIONS,
        default="overlap",
        help="how a worker admits assignments while a pull is on its link: overlap (as the live worker: "
        "the pulling request is queued at once and skipped until its blocks land), serial (the live "
        "worker's setting admission=serial: after it lands), pass (what-if: later ones go ahead of it)",
    )
    p.add_argument(
        "--load",
        choices=LOADS,
        default="sync",
        help="how a prefill's DRAM/disk prefix reaches the GPU: sync (in the prefill iteration, the "
        "live worker's default) or async (copied off the iteration while the batch runs, as the "
        "worker's vllm_async_load on a GPU host)",
    )
    p.add_argument(
        "--lru-eviction",
        action="store_true",
        help="what-if: plain LRU caches (default: fleet-aware eviction, as live workers)",
    )
    p.add_argument(
        "--no-kv-capacity",
        action="store_true",
        help="what-if: running batches grow past the GPU tier (default: a prefill waits until its "
        "blocks fit beside the running requests', as the live engine admits)",
    )
    p.add_argument(
        "--router", action="append", default=[], metavar="KEY=VALUE", help="RouterSettings override"
    )
    p.add_argument(
        "--held-ahead",
        type=float,
        default=AHEAD,
        metavar="X",
        help="the share of the held backlog a held request waits behind, which sets how far short "
        "prompts pass long ones (0: arrival plus work, 1: processor sharing; "
        "services/scheduler/virtual_clock.py)",
    )
    p.add_argument("--users", type=int, default=32, help="multiturn: conversations")
    p.add_argument("--rounds", type=int, default=6, help="multiturn: rounds per conversation")
    p.add_argument("--qps", type=float, default=8.0, help="synthetic workloads: requests per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--plot",
        metavar="DIR",
        help="write ttft_cdf.png and busy_fraction.png here (a sweep: time_scale_sweep.png)",
    )
    p.add_argument("--json", action="store_true", help="last stdout line: the results as one JSON object")
    p.add_argument(
        "--record", metavar="FILE", help="one policy only: write the run as a replayable recording"
    )
    p.add_argument("--no-progress", action="store_true")
    return p


def _truth(raw: str) -> TruthScale:
    try:
        return TruthScale.parse(raw)
    except SimError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _scales(raw: str) -> list[float]:
    try:
        scales = [float(x) for x in raw.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {raw!r}") from exc
    if not scales or any(not x > 0 for x in scales):
        raise argparse.ArgumentTypeError(f"expected positive time scales, got {raw!r}")
    return scales


def _overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SimError(f"--router expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def request_source(
    args: argparse.Namespace, block_size: int
) -> tuple[Callable[[], Iterator[ChatRequest]], int]:
    """A factory of the run's requests (called once per policy, so no run holds every prompt) and
    how many there are (for the progress bar; 0 when unknown)."""
    if args.trace:
        path = args.trace

        def from_trace() -> Iterator[ChatRequest]:
            return trace_requests(path, args.time_scale, args.max_requests, block_size, tile=args.tile)

        with open(path, "rb") as fh:
            lines = sum(1 for _ in fh) - (1 if path.endswith(".csv") else 0)
        n = lines if args.max_requests is None else min(lines, args.max_requests)
        return from_trace, n * args.tile
    if args.workload == "shared-prefix":
        sp = SharedPrefixSpec(
            groups=max(args.users // 4, 1), per_group=args.rounds * 4, qps=args.qps, seed=args.seed
        )

        def from_sp() -> Iterator[ChatRequest]:
            return _cap(shared_prefix(sp, block_size), args.max_requests)

        return from_sp, min(sp.groups * sp.per_group, args.max_requests or 1 << 62)
    mt = MultiTurnSpec(users=args.users, rounds=args.rounds, qps=args.qps, seed=args.seed)

    def from_mt() -> Iterator[ChatRequest]:
        return _cap(multiturn(mt, block_size), args.max_requests)

    return from_mt, min(mt.users * mt.rounds, args.max_requests or 1 << 62)


def _cap(it: Iterator[ChatRequest], k: int | None) -> Iterator[ChatRequest]:
    for i, r in enumerate(it):
        if k is not None and i >= k:
            return
        yield r


def _table(results: dict[str, dict[str, Any]]) -> str:
    cols = (
        ("ttft_p50_s", "p50 s"),
        ("ttft_p90_s", "p90 s"),
        ("ttft_p99_s", "p99 s"),
        ("e2e_p50_s", "e2e p50"),
        ("reused_token_fraction", "reused"),
        ("fetched_token_fraction", "fetched"),
        ("busy_fraction_mean", "busy"),
        ("busy_fraction_spread", "spread pt"),
        ("throughput_rps", "req/s"),
    )
    lines = [f"{'policy':<17}" + "".join(f"{h:>10}" for _, h in cols)]
    for name, s in results.items():
        lines.append(f"{name:<17}" + "".join(f"{s[k]:>10.3f}" for k, _ in cols))
    return "\n".join(lines)


def _run_policies(
    args: argparse.Namespace,
    policies: list[str],
    profile: Any,
    router: dict[str, Any],
    block_size: int,
    source: Callable[[], Iterator[ChatRequest]],
    total: int,
    recorder: SimRecorder | None,
    no_progress: bool,
    leave: bool = True,
) -> tuple[list[SimResult], dict[str, dict[str, Any]]]:
    """One simulation per policy over the same requests: the results and their summaries."""
    results: list[SimResult] = []
    summaries: dict[str, dict[str, Any]] = {}
    for policy in policies:
        config = SimConfig(
            workers=args.workers,
            policy=policy,
            block_size=block_size,
            lag_ms=args.lag_ms,
            heartbeat_ms=args.heartbeat_ms,
            admission=args.admission,
            fleet_aware_eviction=not args.lru_eviction,
            kv_capacity=not args.no_kv_capacity,
            load=args.load,
            router=router,
            truth=args.truth_scale,
            held_ahead=args.held_ahead,
        )
        started = time.perf_counter()
        bar = tqdm(
            total=total or None,
            desc=policy,
            unit="req",
            disable=no_progress,
            file=sys.stderr,
            leave=leave,
        )
        with bar:
            tap = recorder.tap if recorder is not None else None
            result = simulate(source(), profile, config, progress=bar.update, tap=tap)
        summary = result.summary()
        summary["wall_s"] = time.perf_counter() - started
        results.append(result)
        summaries[policy] = summary
    return results, summaries


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        unknown = [p for p in policies if p not in SIM_POLICIES]
        if unknown or not policies:
            raise SimError(f"unknown policies {unknown}; choose from {', '.join(SIM_POLICIES)}")
        block_size = args.block_size or (512 if args.trace else 16)
        profile = load_profile(args.profile)
        router = _overrides(args.router)
        if args.record and len(policies) != 1:
            raise SimError("--record needs exactly one policy")
        if args.time_scales is not None:
            return _sweep(args, policies, profile, router, block_size)
        if args.seeds or args.jobs != 1:
            raise SimError("--seeds and --jobs need --time-scales (a sweep)")
        source, total = request_source(args, block_size)
        recorder = SimRecorder() if args.record else None
        results, summaries = _run_policies(
            args, policies, profile, router, block_size, source, total, recorder, args.no_progress
        )
    except (SimError, WorkloadError, OSError, ValueError, TypeError) as exc:
        sys.stderr.write(f"kvmesh simulate: {exc}\n")
        return 2
    out: dict[str, Any] = {
        **_run_settings(args, block_size),
        "workload": None if args.trace else (args.workload or "multiturn"),
        "time_scale": args.time_scale,
        "policies": summaries,
    }
    if recorder is not None:
        out["recording"] = {"path": args.record, "records": recorder.write(args.record)}
    if args.plot:
        out["plots"] = [str(p) for p in _write_plots(results, args.plot)]
    sys.stdout.write(_table(summaries) + "\n")
    if args.json:
        sys.stdout.write(json.dumps(out, sort_keys=True) + "\n")
    return 0


def _run_settings(args: argparse.Namespace, block_size: int) -> dict[str, Any]:
    """What a run's JSON repeats of its settings (single scale and sweep alike)."""
    return {
        "trace": args.trace,
        "workers": args.workers,
        "max_requests": args.max_requests,
        "tile": args.tile,
        "profile": args.profile,
        "block_size": block_size,
        "lag_ms": args.lag_ms,
        "admission": args.admission,
        "held_ahead": args.held_ahead,
        "fleet_aware_eviction": not args.lru_eviction,
        "kv_capacity": not args.no_kv_capacity,
        "load": args.load,
        "truth_scale": args.truth_scale.describe(),
    }


def _sweep(
    args: argparse.Namespace,
    policies: list[str],
    profile: Any,
    router: dict[str, Any],
    block_size: int,
) -> int:
    """``--time-scales``: the single-scale run once per scale (and per seed with ``--seeds``), each
    with issue #8's and issue #22's goal checks."""
    if not args.trace:
        raise SimError("--time-scales needs --trace")
    if args.record:
        raise SimError("--record needs a single --time-scale")
    if args.seeds < 0 or args.jobs < 1:
        raise SimError("--seeds must be >= 0 and --jobs >= 1")
    scales: list[float] = args.time_scales
    quiet = args.json or args.no_progress
    max_ratio = MAX_RATIO if args.truth_scale.prefill <= 1.0 else MAX_RATIO_TRUTH_DRIFT
    truths = seeded_truths(args.truth_scale, args.seeds)
    # each request's bound, once per scale and truth: the rows' bound and every run's per-request excess
    bounds: dict[tuple[float, TruthScale], dict[str, float]] = {}
    for scale in scales:
        for truth in truths:
            run_args = argparse.Namespace(**{**vars(args), "time_scale": scale, "truth_scale": truth})
            source, _ = request_source(run_args, block_size)
            real = truth.apply(profile.with_block_size(block_size))
            bounds[(scale, truth)] = bound_by_request(source(), real, truth)
    runs = [(scale, truth, policy) for scale in scales for truth in truths for policy in policies]
    summaries = _sweep_runs(args, runs, bounds, profile, router, block_size, quiet)
    sweep: list[dict[str, Any]] = []
    for scale in scales:
        digests: list[dict[str, Any]] = []
        per_seed: list[dict[str, dict[str, Any]]] = []
        seed_bounds: list[dict[str, Any]] = []
        for truth in truths:
            bound = bound_summary(np.fromiter(bounds[(scale, truth)].values(), float))
            runs_here = {p: summaries[(scale, truth, p)] for p in policies}
            add_excess(runs_here, bound)
            per_seed.append(runs_here)
            seed_bounds.append(bound)
            digests.append(seed_digest(truth.seed, bound, runs_here, peer_goal(runs_here, bound, max_ratio)))
        if len(truths) == 1:
            row_policies, row_bound = per_seed[0], seed_bounds[0]
        else:
            row_policies, row_bound = median_policies(per_seed), median_figures(seed_bounds)
            add_excess(row_policies, row_bound)
        goal = issue8_goal(row_policies) if all(p in row_policies for p in GOAL_POLICIES) else None
        row: dict[str, Any] = {
            "time_scale": scale,
            "policies": row_policies,
            "bound": row_bound,
            "goal": goal,
            "peer_goal": peer_goal(row_policies, row_bound, max_ratio),
        }
        if args.seeds:
            row["seeds"] = digests
            row["peer_goal_seeds"] = goal_tally(digests)
        sweep.append(row)
    met = [row["time_scale"] for row in sweep if row["goal"] is not None and row["goal"]["met"]]
    peer_met = [
        row["time_scale"] for row in sweep if row["peer_goal"] is not None and row["peer_goal"]["met"]
    ]
    out: dict[str, Any] = {
        **_run_settings(args, block_size),
        "sweep": sweep,
        "goal_met_at": met,
        "peer_goal_met_at": peer_met,
        "time_scales": scales,
        "seeds": args.seeds,
    }
    if args.plot:
        from kvmesh.sim.plots import write_sweep_plot  # matplotlib only when asked for

        out["plots"] = [str(write_sweep_plot(sweep, peer_met or met, args.plot))]
    sys.stdout.write(_sweep_table(sweep, policies) + "\n")
    if args.json:
        sys.stdout.write(json.dumps(out, sort_keys=True) + "\n")
    return 0


Run = tuple[float, TruthScale, str]  # (time scale, truth, policy)


def _sweep_runs(
    args: argparse.Namespace,
    runs: list[Run],
    bounds: dict[tuple[float, TruthScale], dict[str, float]],
    profile: Any,
    router: dict[str, Any],
    block_size: int,
    quiet: bool,
) -> dict[Run, dict[str, Any]]:
    """Every run's summary; with ``--jobs`` > 1 in that many processes (each run is deterministic on
    its own, so the figures do not depend on how many ran at once)."""
    bar = tqdm(total=len(runs), desc="sweep", unit="run", disable=quiet, file=sys.stderr)
    out: dict[Run, dict[str, Any]] = {}
    with bar:
        if args.jobs == 1:
            for run in runs:
                out[run] = _one_run(args, run, bounds[run[:2]], profile, router, block_size, quiet)
                bar.update(1)
            return out
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = {
                pool.submit(_one_run, args, run, bounds[run[:2]], profile, router, block_size, True): run
                for run in runs
            }
            for f in as_completed(futures):
                out[futures[f]] = f.result()
                bar.update(1)
    return out


def _one_run(
    args: argparse.Namespace,
    run: Run,
    bound_s: dict[str, float],
    profile: Any,
    router: dict[str, Any],
    block_size: int,
    quiet: bool,
) -> dict[str, Any]:
    """One policy at one time scale under one truth: its summary, with each request's excess over
    its bound (``bound_s``, by request id)."""
    scale, truth, policy = run
    run_args = argparse.Namespace(**{**vars(args), "time_scale": scale, "truth_scale": truth})
    source, total = request_source(run_args, block_size)
    results, summaries = _run_policies(
        run_args, [policy], profile, router, block_size, source, total, None, quiet, leave=False
    )
    summaries[policy].update(per_request_excess(results[0].records, bound_s))
    return summaries[policy]


def _sweep_table(sweep: list[dict[str, Any]], policies: list[str]) -> str:
    """TTFT p50 and p99 per policy and the bound's per scale, then each goal's verdict."""
    short = {
        "round_robin": "RR",
        "least_loaded": "LL",
        "prefix_aware": "PA",
        "kvmesh": "KV",
        ORACLE: "oracle",
    }
    names = ["bound", *(short.get(p, p[:8]) for p in policies)]
    head = f"{'scale':>7}" + "".join(f"{n + ' p50/p99':>20}" for n in names) + f"{'#8':>5}{'#22':>5}"
    lines = [head]
    for row in sweep:
        cells = [row["bound"], *(row["policies"][p] for p in policies)]
        line = f"{row['time_scale']:>7.3g}" + "".join(
            f"{c['ttft_p50_s']:>10.3f}{c['ttft_p99_s']:>10.3f}" for c in cells
        )
        for g in (row["goal"], row["peer_goal"]):
            line += f"{'-' if g is None else ('YES' if g['met'] else 'no'):>5}"
        lines.append(line)
    return "\n".join(lines)


def _write_plots(results: list[SimResult], out_dir: str) -> list[Any]:
    from kvmesh.sim.plots import write_plots  # matplotlib only when asked for

    return write_plots(results, out_dir)


if __name__ == "__main__":
    sys.exit(main())
