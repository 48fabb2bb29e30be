"""Reference counts kept in a plain dict (key → count, absent when 0): pins and holds on KV blocks,
the scheduler's per-worker prefix counts. A dict rather than a ``Counter`` because removing a few keys
must not rebuild the whole map (``Counter -=`` does), and the maps hold up to a tier's worth of blocks.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def add_counts(counts: dict[K, int], keys: Iterable[K]) -> None:
    """Count each of ``keys`` once more."""
    for k in keys:
        counts[k] = counts.get(k, 0) + 1


def remove_counts(counts: dict[K, int], keys: Iterable[K]) -> None:
    """Count each of ``keys`` once less; a key whose count reaches 0 (or was absent) is removed."""
    for k in keys:
        n = counts.get(k, 0) - 1
        if n > 0:
            counts[k] = n
        else:
            counts.pop(k, None)
