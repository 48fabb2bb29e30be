"""``kvmesh simulate``: run the live scheduler policies over a trace or a synthetic workload.

    kvmesh simulate --trace FILE --workers 16 --policies round_robin,prefix_aware,kvmesh \\
        [--time-scale X] [--max-requests K] [--profile h100-llama3-8b|FILE.json] [--plot DIR] [--json]
    kvmesh simulate --workload multiturn|shared-prefix --workers 8 --json

``--time-scale`` multiplies trace timestamps (0.5 = twice the arrival rate). Traces use 512-token
blocks by default (one block per Mooncake hash id); synthetic workloads use 16. With ``--json`` the
last stdout line is one JSON object: ``{"policies": {name: summary}, ...}`` (see kvmesh.sim.metrics).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from tqdm import tqdm

from kvmesh.costmodel import load_profile
from kvmesh.sim.engine import SimConfig, SimResult, simulate
from kvmesh.sim.errors import SimError
from kvmesh.sim.recorder import SimRecorder
from kvmesh.workloads import (
    MultiTurnSpec,
    SharedPrefixSpec,
    WorkloadError,
    multiturn,
    shared_prefix,
    trace_requests,
)
from schemas.messages import ChatRequest
from services.scheduler.router import POLICIES

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh simulate", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", help="Mooncake JSON lines (.jsonl) or Azure CSV (.csv)")
    src.add_argument("--workload", choices=("multiturn", "shared-prefix"), help="synthetic workload")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma list of {', '.join(POLICIES)}")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (trace only)")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--profile", default="h100-llama3-8b", help="named profile or a benchmark's JSON")
    p.add_argument("--block-size", type=int, default=None, help="tokens per block (trace 512, else 16)")
    p.add_argument("--lag-ms", type=float, default=10.0, help="worker -> scheduler message lag")
    p.add_argument("--heartbeat-ms", type=float, default=2000.0)
    p.add_argument(
        "--overlap-fetch", action="store_true", help="what-if: workers queue requests while pulling"
    )
    p.add_argument(
        "--router", action="append", default=[], metavar="KEY=VALUE", help="RouterSettings override"
    )
    p.add_argument("--users", type=int, default=32, help="multiturn: conversations")
    p.add_argument("--rounds", type=int, default=6, help="multiturn: rounds per conversation")
    p.add_argument("--qps", type=float, default=8.0, help="synthetic workloads: requests per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="DIR", help="write ttft_cdf.png and busy_fraction.png here")
    p.add_argument("--json", action="store_true", help="last stdout line: the results as one JSON object")
    p.add_argument(
        "--record", metavar="FILE", help="one policy only: write the run as a replayable recording"
    )
    p.add_argument("--no-progress", action="store_true")
    return p


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
            return trace_requests(path, args.time_scale, args.max_requests, block_size)

        with open(path, "rb") as fh:
            lines = sum(1 for _ in fh) - (1 if path.endswith(".csv") else 0)
        n = lines if args.max_requests is None else min(lines, args.max_requests)
        return from_trace, n
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        unknown = [p for p in policies if p not in POLICIES]
        if unknown or not policies:
            raise SimError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
        block_size = args.block_size or (512 if args.trace else 16)
        profile = load_profile(args.profile)
        router = _overrides(args.router)
        if args.record and len(policies) != 1:
            raise SimError("--record needs exactly one policy")
        source, total = request_source(args, block_size)
        recorder = SimRecorder() if args.record else None
        results: list[SimResult] = []
        summaries: dict[str, dict[str, Any]] = {}
        for policy in policies:
            config = SimConfig(
                workers=args.workers,
                policy=policy,
                block_size=block_size,
                lag_ms=args.lag_ms,
                heartbeat_ms=args.heartbeat_ms,
                overlap_fetch=args.overlap_fetch,
                router=router,
            )
            started = time.perf_counter()
            bar = tqdm(
                total=total or None, desc=policy, unit="req", disable=args.no_progress, file=sys.stderr
            )
            with bar:
                tap = recorder.tap if recorder is not None else None
                result = simulate(source(), profile, config, progress=bar.update, tap=tap)
            summary = result.summary()
            summary["wall_s"] = time.perf_counter() - started
            results.append(result)
            summaries[policy] = summary
    except (SimError, WorkloadError, OSError, ValueError, TypeError) as exc:
        sys.stderr.write(f"kvmesh simulate: {exc}\n")
        return 2
    out: dict[str, Any] = {
        "trace": args.trace,
        "workload": None if args.trace else (args.workload or "multiturn"),
        "workers": args.workers,
        "time_scale": args.time_scale,
        "max_requests": args.max_requests,
        "profile": args.profile,
        "block_size": block_size,
        "lag_ms": args.lag_ms,
        "overlap_fetch": args.overlap_fetch,
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


def _write_plots(results: list[SimResult], out_dir: str) -> list[Any]:
    from kvmesh.sim.plots import write_plots  # matplotlib only when asked for

    return write_plots(results, out_dir)


if __name__ == "__main__":
    sys.exit(main())
