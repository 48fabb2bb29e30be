"""``kvmesh kvmanager``: run the KV manager (directory, liveness, placement) until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from kvmesh.runtime import tune_gc
from services.kvmanager.config import KvManagerSettings
from services.kvmanager.service import KvManagerService


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh kvmanager", description=__doc__)
    p.add_argument("--kafka", help="bootstrap servers (default: KVMESH_KVMANAGER_KAFKA__BOOTSTRAP_SERVERS)")
    p.add_argument("--redis", help="Redis URL (default: KVMESH_KVMANAGER_REDIS__URL)")
    p.add_argument("--manager-id", help="producer id of this manager")
    p.add_argument("--liveness-timeout-ms", type=int)
    p.add_argument("--log-level", default="INFO")
    return p


def settings_from_args(args: argparse.Namespace) -> KvManagerSettings:
    s = KvManagerSettings()
    if args.kafka:
        s.kafka = s.kafka.model_copy(update={"bootstrap_servers": args.kafka})
    if args.redis:
        s.redis = s.redis.model_copy(update={"url": args.redis})
    if args.manager_id:
        s.manager_id = args.manager_id
    if args.liveness_timeout_ms:
        s.liveness_timeout_ms = args.liveness_timeout_ms
    return s


async def serve(settings: KvManagerSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with KvManagerService(settings):
        # What is alive now (modules, settings, the directory loaded from Redis) lives as long as the
        # process: keep it out of every later full collection, whose pauses would add to the lag.
        tune_gc()
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(serve(settings_from_args(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
