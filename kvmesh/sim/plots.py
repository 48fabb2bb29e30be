"""PNG figures of a simulator run: TTFT CDF per policy, busy fraction per worker per policy."""

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


def plot_busy(results: list[SimResult], path: Path) -> Path:
    """Busy fraction of every worker, one marker series per policy."""
    fig, ax = plt.subplots(figsize=(max(7, len(results[0].worker_ids) * 0.25), 4.5))
    for r in results:
        busy = r.summary()["busy_fraction"]
        ax.plot(range(len(busy)), list(busy.values()), marker="o", linestyle="-", label=r.policy, alpha=0.8)
    ax.set_xlabel("worker")
    ax.set_ylabel("busy fraction")
    ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    ax.legend()
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
