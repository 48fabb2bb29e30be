"""The one percentile of every report the tools print (simulator, benchmarks, replay).

Linear interpolation between the closest ranks (numpy's default), so a p99 of few samples does not
jump from one sample to the next; ``empty`` is what a report shows for no samples at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, overload

import numpy as np

E = TypeVar("E", float, None)


@overload
def percentile(values: Sequence[float] | np.ndarray, q: float) -> float: ...


@overload
def percentile(values: Sequence[float] | np.ndarray, q: float, empty: E) -> float | E: ...


def percentile(values: Sequence[float] | np.ndarray, q: float, empty: float | None = 0.0) -> float | None:
    """The ``q``-th percentile (0..100) of ``values``; ``empty`` when there are none."""
    if len(values) == 0:
        return empty
    return float(np.percentile(np.asarray(values, dtype=float), q))
