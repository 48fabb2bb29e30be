"""``kvmesh bench <name>``: dispatch to kvmesh.bench.<name>.main."""

from __future__ import annotations

import importlib
import sys

BENCHES = ("streams", "worker", "transfer", "scheduler", "kvmanager", "fleet", "serve", "chaos")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in BENCHES:
        sys.stderr.write(f"usage: kvmesh bench {{{','.join(BENCHES)}}} [--json] [options]\n")
        return 2
    module = importlib.import_module(f"kvmesh.bench.{args[0]}")
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
