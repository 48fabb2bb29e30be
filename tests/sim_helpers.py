"""Small Mooncake-format traces for the simulator's tests.

Imported as ``from sim_helpers import ...`` (tests/ is on sys.path through its conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path


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
