"""PNG figures of a simulator run (or a live one, as SimResults): TTFT CDF and busy fraction per worker."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a display

import matplotlib.pyplot as plt
import numpy as np

from kvmesh.sim.engine import SimResult
from kvmesh.sim.metrics import ttft_seconds


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
