"""Issue #22's goal: kvmesh's routing excess over the bound, against the peers' routers.

A policy's *excess* at a percentile is its TTFT percentile minus the bound's (kvmesh.sim.bound): the
part routing could still win. At each checked percentile (p50, p99) kvmesh's excess must be at most
``max_ratio`` times the smallest excess among the peers (0.35 when the engine runs at its published
speed, 0.5 when its prefill is slower than published). An excess below a millisecond counts as zero
excess: ratios of noise would decide nothing.
"""

from __future__ import annotations

from typing import Any

PEERS = ("dynamo", "llm_d", "sglang")
PERCENTILES = ("ttft_p50_s", "ttft_p99_s")
MAX_RATIO = 0.35
MAX_RATIO_TRUTH_DRIFT = 0.5
NOISE_FLOOR_S = 0.001


def excess(summary: dict[str, Any], bound: dict[str, Any], key: str) -> float:
    """``summary``'s percentile ``key`` minus the bound's, in seconds (clamped at 0)."""
    return max(float(summary[key]) - float(bound[key]), 0.0)


def add_excess(policies: dict[str, dict[str, Any]], bound: dict[str, Any]) -> None:
    """Write ``ttft_p50_excess_s`` / ``ttft_p99_excess_s`` into every policy's summary."""
    for s in policies.values():
        for key in PERCENTILES:
            s[key.replace("_s", "_excess_s")] = excess(s, bound, key)


def peer_goal(
    policies: dict[str, dict[str, Any]], bound: dict[str, Any], max_ratio: float = MAX_RATIO
) -> dict[str, Any] | None:
    """The goal at one load, or None unless kvmesh and every peer ran.

    Per percentile: kvmesh's excess, the best peer and its excess, their ratio (None when the best
    peer's excess is under the noise floor), and whether it holds; ``met`` when all hold.
    """
    if "kvmesh" not in policies or any(p not in policies for p in PEERS):
        return None
    out: dict[str, Any] = {"max_ratio": max_ratio}
    met = True
    for key in PERCENTILES:
        kv = excess(policies["kvmesh"], bound, key)
        best = min(PEERS, key=lambda p: excess(policies[p], bound, key))
        peer = excess(policies[best], bound, key)
        if peer < NOISE_FLOOR_S:
            ratio = None
            ok = kv < NOISE_FLOOR_S
        else:
            ratio = kv / peer
            ok = kv <= max_ratio * peer or kv < NOISE_FLOOR_S
        name = key.removeprefix("ttft_").removesuffix("_s")
        out[name] = {
            "kvmesh_excess_s": kv,
            "best_peer": best,
            "peer_excess_s": peer,
            "ratio": ratio,
            "met": ok,
        }
        met = met and ok
    out["met"] = met
    return out
