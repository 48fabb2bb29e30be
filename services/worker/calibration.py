"""Calibration arithmetic shared by every engine: which prompt lengths to time and the prefill fit.

Each engine times its own prefills and decode steps (through its real request path); this module turns
the samples into the ``PerfProfile`` figures the cost model prices with, so both engines publish
figures of the same meaning.
"""

from __future__ import annotations


def calibration_lengths(short: int, long: int) -> list[int]:
    """Prompt lengths to time: ``short``, ``long`` and points between (a fit, not a two-point guess)."""
    mids = [int(short + (long - short) * f) for f in (0.25, 0.5, 0.75)]
    return sorted({short, *mids, long})


def fit_prefill_cost(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares fit of ``t(n) = n * (a + b * n / 2)`` with ``a, b >= 0`` (ms per token, per ctx).

    Timings taken on a busy machine are noisy; a two-point difference can come out negative or give
    a near-zero linear term that prices long prompts absurdly. The fit uses every sample and, when
    the unconstrained solution leaves the feasible region, refits the single-term model instead.
    """
    ns = [float(n) for n, _ in samples]
    ys = [t / n for n, t in samples]  # per-token cost = a + b * n / 2
    xs = [n / 2.0 for n in ns]
    k = len(xs)
    mx, my = sum(xs) / k, sum(ys) / k
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    a = my - b * mx
    if b < 0 or a <= 0:
        # the per-token cost does not grow with length here (or grows through zero): one term only
        sx2 = sum(x * x for x in xs)
        b_only = sum(x * y for x, y in zip(xs, ys, strict=True)) / sx2 if sx2 > 0 else 0.0
        if b < 0:
            a, b = max(my, 1e-6), 0.0
        else:
            a, b = 1e-6, max(b_only, 0.0)
            # keep the linear term honest: at least half the shortest prompt's per-token cost
            a = max(a, 0.5 * min(ys))
            b = max((my - a) / mx, 0.0) if mx > 0 else 0.0
    return a, b
