"""``kvmesh dev``: broker + Redis + all four services on loopback until Ctrl-C."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading

from kvmesh.devstack import DevStack, DevStackSettings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh dev", description=__doc__)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--kvmanagers", type=int, default=1, help="KV managers; more than 1 run as sharded replicas"
    )
    p.add_argument("--host", default="127.0.0.1", help="intake bind address (loopback by default)")
    p.add_argument("--port", type=int, default=8000, help="intake port")
    p.add_argument("--policy", default="kvmesh")
    p.add_argument("--gpu-blocks", type=int, default=1024)
    p.add_argument("--dram-blocks", type=int, default=4096)
    p.add_argument(
        "--api-keys",
        default=None,
        help='"key1:tenantA,key2:tenantB": intake then requires Bearer keys (default: KVMESH_API_KEYS)',
    )
    p.add_argument("--engine", choices=["builtin", "vllm"], default="builtin", help="the workers' engine")
    p.add_argument(
        "--model",
        default="tiny",
        help="a built-in size (tiny, small) or a local model directory (`kvmesh model init DIR`)",
    )
    p.add_argument(
        "--block-size", type=int, default=None, help="the fleet's block size (default: 16, or 32 for vllm)"
    )
    p.add_argument("--max-context", type=int, default=None, help="context length (default: the model's)")
    p.add_argument(
        "--durable",
        action="store_true",
        help="keep the broker's topics in an object store (a local S3 server on disk) and Redis in "
        "an append-only file, so each survives a crash and restart",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="with --durable: where the object store and Redis keep their files (default: a temp dir)",
    )
    p.add_argument(
        "--status-file",
        default=None,
        help="once the stack is ready, write each process's metrics URL, pid and readiness here (JSON)",
    )
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    settings = DevStackSettings(
        workers=args.workers,
        kvmanagers=args.kvmanagers,
        intake_host=args.host,
        intake_port=args.port,
        policy=args.policy,
        gpu_blocks=args.gpu_blocks,
        dram_blocks=args.dram_blocks,
        log_level=args.log_level,
        api_keys=args.api_keys,
        engine=args.engine,
        model=args.model,
        block_size=args.block_size,
        max_context=args.max_context,
        durable=args.durable,
        data_dir=args.data_dir,
        supervise=True,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with DevStack(settings) as stack:
        if args.status_file:
            stack.write_status(args.status_file)
        sys.stderr.write(
            f"\nkvmesh dev is ready: intake {stack.intake_url}  broker {stack.kafka.bootstrap_servers}  "
            f"redis {stack.redis_settings.url}  workers {', '.join(stack.worker_ids)}"
            f"{'  (durable)' if args.durable else ''}\n"
            "a service that dies is restarted; GET /readyz says whether requests can be served\n"
            f"try: kvmesh demo --url {stack.intake_url}    (Ctrl-C stops everything)\n\n"
        )
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
        # One Ctrl-C is enough: a second one (or a SIGTERM) must not cut the orderly stop short and
        # leave services running.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.stderr.write("stopping kvmesh dev...\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
