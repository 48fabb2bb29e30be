"""A sweep row over several seeds of engine noise: one deterministic run is one sample of a chaotic
system.

An overloaded fleet amplifies tiny differences: on the Mooncake trace at 4x, kvmesh's TTFT p99 was
10.6, 9.27, 9.38, 9.32 and 10.8 s with its late-binding threshold at 980, 990, 1,000, 1,010 and
1,020 ms, and 9.3-11.1 s over six seeds of a 2 % per-request prefill noise (dynamo's 17.1-20.3 s). A goal read
off one run can hold or fail by luck. ``kvmesh simulate --time-scales ... --seeds N`` runs every policy
once per seed of the truth's per-request noise (``TruthScale.noise``, :data:`SEED_NOISE` when the
truth has none) and reports, per row:

* ``policies`` and ``bound``: the median over seeds of every figure (so the output contract holds);
  each policy's excess is its median percentile minus the median bound;
* ``peer_goal``: issue #22's goal on those medians;
* ``seeds``: per seed, the bound's and every policy's p50 / p99 and that seed's goal ratios, so the
  spread is in the output, and ``peer_goal_seeds``: in how many seeds the goal held.

Each seed's run is as deterministic as a single run: the noise is keyed by seed and request id
(kvmesh.sim.truth), so the same command gives the same figures.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from kvmesh.sim.truth import TruthScale

#: The per-request prefill noise (log-normal sigma) of a seeded sweep whose truth sets none: small
#: beside the load's own variation, enough to move the order of near-simultaneous events.
SEED_NOISE = 0.02


def seeded_truths(truth: TruthScale, seeds: int) -> list[TruthScale]:
    """``truth`` once per seed 1..``seeds`` (noise :data:`SEED_NOISE` where it has none); ``truth``
    itself when ``seeds`` is 0."""
    if seeds <= 0:
        return [truth]
    noise = truth.noise or SEED_NOISE
    return [dataclasses.replace(truth, noise=noise, seed=s) for s in range(1, seeds + 1)]


def median_figures(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median of the numeric values over ``samples`` (the first sample's value for
    anything else, such as a policy's name)."""
    out: dict[str, Any] = {}
    for key, first in samples[0].items():
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            values = [s[key] for s in samples if isinstance(s.get(key), (int, float))]
            out[key] = statistics.median(values)
        else:
            out[key] = first
    return out


def median_policies(runs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per policy, :func:`median_figures` over the seeds' summaries."""
    return {name: median_figures([run[name] for run in runs]) for name in runs[0]}


def seed_digest(
    seed: int, bound: dict[str, Any], policies: dict[str, dict[str, Any]], goal: dict[str, Any] | None
) -> dict[str, Any]:
    """What a seeded row keeps of one seed: percentiles and the goal's ratios, not whole summaries."""

    def pcts(s: dict[str, Any]) -> dict[str, float]:
        return {"ttft_p50_s": s["ttft_p50_s"], "ttft_p99_s": s["ttft_p99_s"]}

    out: dict[str, Any] = {
        "seed": seed,
        "bound": pcts(bound),
        "policies": {name: pcts(s) for name, s in policies.items()},
    }
    if goal is not None:
        out["peer_goal"] = {
            "met": goal["met"],
            "p50_ratio": goal["p50"]["ratio"],
            "p99_ratio": goal["p99"]["ratio"],
        }
    return out


def goal_tally(digests: list[dict[str, Any]]) -> dict[str, Any] | None:
    """In how many seeds issue #22's goal held, and each seed's ratios (None: the goal was not run)."""
    goals = [d["peer_goal"] for d in digests if "peer_goal" in d]
    if not goals:
        return None
    return {
        "met": sum(1 for g in goals if g["met"]),
        "of": len(goals),
        "p50_ratios": [g["p50_ratio"] for g in goals],
        "p99_ratios": [g["p99_ratio"] for g in goals],
    }
