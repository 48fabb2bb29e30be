"""Small Mooncake-format traces for the simulator's tests.

Imported as ``from sim_helpers import ...`` (tests/ is on sys.path through its conftest.py).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

#: The shared traces live beside the repository (../shared/traces); KVMESH_TRACES names another folder.
_BESIDE = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
TRACES = Path(os.environ.get("KVMESH_TRACES") or _BESIDE)
MOONCAKE = "mooncake_synthetic_trace.jsonl"
#: The same trace, vendored (tests/data/README.md)
VENDORED = Path(__file__).resolve().parent / "data" / f"{MOONCAKE}.gz"


def mooncake_trace_path(tmp_path: Path) -> Path:
    """The public Mooncake trace: from ``KVMESH_TRACES``, else the shared folder beside the repository,
    else the copy in ``tests/data`` unpacked into ``tmp_path`` (so a clean clone anywhere has it)."""
    shared = TRACES / MOONCAKE
    if shared.exists():
        return shared
    out = tmp_path / MOONCAKE
    with gzip.open(VENDORED, "rb") as src, out.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    return out


def tiny_trace(path: Path, n: int) -> Path:
    """``n`` requests 200 ms apart: two shared prefixes (alternating) plus two blocks of their own."""
    rows = []
    for i in range(n):
        shared = [0, 1, 2] if i % 2 else [10, 11]
        ids = [*shared, 100 + 3 * i, 101 + 3 * i]
        rows.append(
            {"timestamp": 200 * i, "input_length": 512 * len(ids) - 7, "output_length": 4, "hash_ids": ids}
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
