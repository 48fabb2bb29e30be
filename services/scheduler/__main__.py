"""``kvmesh scheduler``: run one scheduler replica until SIGINT/SIGTERM (wiring only)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from typing import Any

from kvmesh.runtime import tune_gc
from services.scheduler.config import SchedulerSettings
from services.scheduler.registry import POLICIES
from services.scheduler.service import SchedulerService


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh scheduler", description="run a scheduler replica")
    p.add_argument("--policy", choices=POLICIES, help="routing policy (default: env or kvmesh)")
    p.add_argument("--scheduler-id", help="replica id stamped on assignments")
    p.add_argument("--bootstrap", help="Kafka bootstrap servers (overrides KVMESH_SCHEDULER_KAFKA__...)")
    p.add_argument("--redis-url", help="Redis URL of the KV manager's directory")
    p.add_argument(
        "--no-snapshot", action="store_true", help="replay kv-events instead of loading a snapshot"
    )
    p.add_argument("--log-level", default="INFO")
    return p


def build_settings(args: argparse.Namespace) -> SchedulerSettings:
    settings = SchedulerSettings()
    update: dict[str, Any] = {}
    if args.policy:
        update["policy"] = args.policy
    if args.scheduler_id:
        update["scheduler_id"] = args.scheduler_id
    if args.no_snapshot:
        update["use_snapshot"] = False
    if args.bootstrap:
        update["kafka"] = settings.kafka.model_copy(update={"bootstrap_servers": args.bootstrap})
    if args.redis_url:
        update["redis"] = settings.redis.model_copy(update={"url": args.redis_url})
    return SchedulerSettings.model_validate({**settings.model_dump(), **update}) if update else settings


async def _serve(settings: SchedulerSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with SchedulerService(settings):
        tune_gc()
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        settings = build_settings(args)
    except ValueError as exc:
        sys.stderr.write(f"kvmesh scheduler: bad settings: {exc}\n")
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
