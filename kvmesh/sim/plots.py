"""PNG figures of a simulator run (or a live one, as SimResults): TTFT CDF and busy fraction per worker;
and of a ``--time-scales`` sweep: TTFT p50 per policy against time scale."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a display

import matplotlib.pyplot as plt
import numpy as np

from kvmesh.sim.engine import SimResult
from kvmesh.sim.metrics import ttft_seconds
from kvmesh.sim.oracle import ORACLE


def plot_ttft_cdf(results: list[SimResult], path: Path) -> Path:
    """One CDF line of time to first token per policy (log x axis)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        t = ttft_seconds(r.records)
        if t.size:
            ax.plot(np.maximum(t, 1e-4), np.arange(1, t.size + 1) / t.size, label=r.policy)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


#: Up to this many workers the busy figure is grouped bars labelled by worker id; above, one line each.
BAR_WORKERS = 16


def plot_busy(results: list[SimResult], path: Path) -> Path:
    """Busy fraction of every worker per policy: grouped bars for a small fleet, lines for a big one."""
    ids = results[0].worker_ids
    n = len(ids)
    fig, ax = plt.subplots(figsize=(max(7, n * (0.25 if n > BAR_WORKERS else 0.9)), 4.5))
    width = 0.8 / len(results)
    for k, r in enumerate(results):
        busy = list(r.summary()["busy_fraction"].values())
        if n <= BAR_WORKERS:
            x = np.arange(len(busy)) - 0.4 + width * (k + 0.5)
            ax.bar(x, busy, width=width, label=r.policy)
        else:
            ax.plot(range(len(busy)), busy, marker="o", linestyle="-", label=r.policy, alpha=0.8)
    if n <= BAR_WORKERS:
        ax.set_xticks(range(n), ids)
    ax.set_xlabel("worker")
    ax.set_ylabel("busy fraction")
    ax.set_ylim(0, 1.05)
    ax.grid(True, axis="y", alpha=0.3)
    # Below the axes: above it would hide the tallest bars, which are the interesting ones.
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=min(len(results), 5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(results: list[SimResult], out_dir: str | Path) -> list[Path]:
    """Both figures into ``out_dir`` (created); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not results:
        return []
    return [plot_ttft_cdf(results, out / "ttft_cdf.png"), plot_busy(results, out / "busy_fraction.png")]


def _shade_spans(scales: list[float], met: list[float]) -> list[tuple[float, float]]:
    """An x interval per goal-met scale: halfway to each neighbouring scale (as far again at the ends)."""
    xs = sorted(set(scales))
    spans = []
    for i, x in enumerate(xs):
        if x not in met:
            continue
        if len(xs) == 1:
            spans.append((x * 0.95, x * 1.05))
            continue
        left = (xs[i - 1] + x) / 2 if i > 0 else x - (xs[1] - x) / 2
        right = (x + xs[i + 1]) / 2 if i + 1 < len(xs) else x + (x - xs[i - 1]) / 2
        spans.append((left, right))
    return spans


def plot_time_scale_sweep(sweep: list[dict[str, Any]], met: list[float], path: Path) -> Path:
    """TTFT p50 and p99 per policy against time scale (log y), the bound dashed, the scales where the
    goal holds shaded; with ``--seeds`` each point is the median and its bar spans the seeds.

    ``sweep`` rows are ``{"time_scale": x, "policies": {name: summary}, "bound": {...}}`` as
    ``--time-scales`` emits (rows without ``bound`` draw no bound line).
    """
    rows = sorted(sweep, key=lambda r: r["time_scale"])
    scales = [float(r["time_scale"]) for r in rows]
    policies = list(rows[0]["policies"]) if rows else []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharex=True)
    for ax, key, label in zip(
        axes, ("ttft_p50_s", "ttft_p99_s"), ("TTFT p50 (s)", "TTFT p99 (s)"), strict=True
    ):
        for k, (left, right) in enumerate(_shade_spans(scales, met)):
            ax.axvspan(left, right, color="tab:green", alpha=0.15, label="goal met" if k == 0 else None)
        for policy in policies:
            ys = [max(float(r["policies"][policy][key]), 1e-4) for r in rows]
            if policy == ORACLE:  # a reference, not a router one could run: drawn apart
                ax.plot(scales, ys, color="gray", linestyle=":", marker=".", label=f"{policy} (reference)")
                continue
            (line,) = ax.plot(
                scales, ys, marker="o", label=policy, linewidth=2.2 if policy == "kvmesh" else 1.2
            )
            spans = _seed_spans(rows, policy, key)
            if spans is not None:  # --seeds: the line is the median, the bar each scale's min to max
                lo, hi = spans
                ax.errorbar(
                    scales,
                    ys,
                    yerr=[
                        [y - a for y, a in zip(ys, lo, strict=True)],
                        [b - y for y, b in zip(ys, hi, strict=True)],
                    ],
                    fmt="none",
                    ecolor=line.get_color(),
                    capsize=3,
                    alpha=0.8,
                )
        if rows and all("bound" in r for r in rows):
            ys = [max(float(r["bound"][key]), 1e-4) for r in rows]
            ax.plot(scales, ys, color="black", linestyle="--", label="bound (no queue, every prefix cached)")
        ax.set_yscale("log")
        ax.set_xlabel("time scale (trace timestamps x scale; lower = more load)")
        ax.set_ylabel(label)
        ax.set_xticks(scales, [f"{x:g}" for x in scales])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _seed_spans(rows: list[dict[str, Any]], policy: str, key: str) -> tuple[list[float], list[float]] | None:
    """Per row, the least and the greatest ``key`` of ``policy`` over the row's seeds (``--seeds``);
    None when the rows have no seeds."""
    if not rows or not all(r.get("seeds") for r in rows):
        return None
    lo: list[float] = []
    hi: list[float] = []
    for r in rows:
        values = [max(float(d["policies"][policy][key]), 1e-4) for d in r["seeds"]]
        lo.append(min(values))
        hi.append(max(values))
    return lo, hi


def write_sweep_plot(sweep: list[dict[str, Any]], met: list[float], out_dir: str | Path) -> Path:
    """DIR/time_scale_sweep.png (DIR created); returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return plot_time_scale_sweep(sweep, met, out / "time_scale_sweep.png")
