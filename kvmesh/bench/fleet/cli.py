"""``kvmesh bench fleet`` arguments and entry point."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from tqdm import tqdm

from kvmesh.bench.fleet.errors import FleetBenchError
from kvmesh.bench.fleet.output import build_output, format_table
from kvmesh.bench.fleet.run import StackOptions, run_existing, run_fleet
from kvmesh.workloads import (
    MultiTurnSpec,
    SharedPrefixSpec,
    Workload,
    WorkloadError,
    mooncake_sessions,
    multiturn_sessions,
    shared_prefix_sessions,
)
from services.scheduler.router import POLICIES


def _parser() -> argparse.ArgumentParser:
    from kvmesh.bench import fleet  # the package's docstring is the command's description

    doc = fleet.__doc__ or ""
    p = argparse.ArgumentParser(prog="kvmesh bench fleet", description=doc.split("\n\n")[0])
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


def workload_from_args(args: argparse.Namespace) -> Workload:
    kind = "trace" if args.trace else (args.workload or "multiturn")
    if kind == "trace":
        if not args.trace:
            raise FleetBenchError("--workload trace needs --trace FILE")
        return mooncake_sessions(
            args.trace, args.time_scale, args.max_requests, args.token_scale, args.max_output_tokens
        )
    if kind == "shared-prefix":
        return shared_prefix_sessions(
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
    return multiturn_sessions(
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
