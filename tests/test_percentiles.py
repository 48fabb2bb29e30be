"""The tools' one percentile: numpy's linear interpolation, and a chosen value for no samples."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.percentiles import percentile


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_matches_numpy_and_stays_within_the_samples(xs: list[float], q: float) -> None:
    got = percentile(xs, q)
    assert math.isclose(got, float(np.percentile(xs, q)), rel_tol=1e-12, abs_tol=1e-9)
    assert min(xs) - 1e-9 <= got <= max(xs) + 1e-9


def test_interpolates_between_ranks_and_reports_empty_as_asked() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([0.0, 10.0], 99) == 9.9
    assert percentile([], 50) == 0.0
    assert percentile([], 50, None) is None
    assert math.isnan(percentile([], 99, float("nan")))
