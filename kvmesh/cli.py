"""``kvmesh <command>``: one console entry for every service and tool.

Each command lives in its own module and exposes ``main(argv: list[str] | None) -> int``; this file
only dispatches, importing the module lazily so that ``kvmesh intake`` does not import torch.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "dev": ("kvmesh.dev", "run broker + Redis + all services on loopback as one process tree"),
    "demo": ("kvmesh.demo", "send a scripted multi-turn workload to a running stack (or the embedded one)"),
    "intake": ("services.intake.__main__", "run the OpenAI-compatible HTTP intake"),
    "scheduler": ("services.scheduler.__main__", "run a scheduler replica"),
    "worker": ("services.worker.__main__", "run a worker (model + paged KV cache + block server)"),
    "kvmanager": ("services.kvmanager.__main__", "run the KV manager (directory, liveness, placement)"),
    "directory": ("services.kvmanager.directory_cli", "show who holds a prefix, cache usage, hit counters"),
    "simulate": ("kvmesh.sim.__main__", "discrete-event fleet simulator with the live scheduler code"),
    "replay": ("kvmesh.replay.__main__", "re-run scheduler decisions over a recorded window of topics"),
    "record": ("kvmesh.replay.record", "record a window of the topics to a file"),
    "bench": ("kvmesh.bench.__main__", "benchmarks: streams, worker, transfer, scheduler, fleet, serve, ..."),
    "model": ("kvmesh.modeldir", "model directories: `kvmesh model init DIR` writes a small seeded Llama"),
}


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: kvmesh <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"kvmesh: unknown command {name!r}\n\n{_usage()}")
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
