"""Per-request records of a simulated run and the per-policy summary computed from them.

Definitions (every figure is computed over completed requests unless it says otherwise):

* ``ttft`` -- arrival to first token (queue wait + deferral + promotion + fetch + prefill), seconds.
* ``e2e`` -- arrival to last token, seconds.
* token fractions -- of all prompt tokens: ``reused`` (already on the chosen worker, any tier),
  ``fetched`` (pulled from a peer), ``recomputed`` (prefilled); they sum to 1. ``kv_hit_fraction`` =
  reused + fetched (comparable to a fetch-less router's "reused" figure).
* ``busy_fraction`` per worker -- time the worker spent in iterations / the run's makespan (first
  arrival to last completion). ``busy_fraction_spread`` = max - min over workers in percentage points;
  ``busy_fraction_spread_p90_p10`` = p90 - p10, also in points (less sensitive to one outlier).
* ``prediction_ratio_p10/p50/p90`` -- percentiles over requests of the policy's TTFT estimate at the
  decision over the TTFT the engine gave from that decision on (1 = exact; < 1 = optimistic).
* ``throughput_rps`` / ``output_tokens_per_s`` -- completed requests / output tokens per makespan second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvmesh.percentiles import percentile


@dataclass(slots=True)
class RequestRecord:
    """How one completed request went (times in simulated ms)."""

    worker: int
    arrival_ms: float
    first_token_ms: float
    done_ms: float
    prompt_tokens: int
    reused_tokens: int
    fetched_tokens: int
    recomputed_tokens: int
    output_tokens: int
    decided_ms: float = 0.0  # when the scheduler assigned it
    predicted_ms: float = 0.0  # the scheduler's TTFT estimate at that moment (0: none)
    request_id: str = ""


def summarize(
    policy: str,
    records: list[RequestRecord],
    busy_ms: list[float],
    worker_ids: list[str],
    rejected: int = 0,
    deferrals: int = 0,
) -> dict[str, Any]:
    """The summary of one policy's run as a JSON-ready dict (see the module docstring)."""
    n = len(records)
    arrival = np.fromiter((r.arrival_ms for r in records), float, n)
    first = np.fromiter((r.first_token_ms for r in records), float, n)
    done = np.fromiter((r.done_ms for r in records), float, n)
    ttft = (first - arrival) / 1000.0
    e2e = (done - arrival) / 1000.0
    prompt = sum(r.prompt_tokens for r in records) or 1
    reused = sum(r.reused_tokens for r in records)
    fetched = sum(r.fetched_tokens for r in records)
    recomputed = sum(r.recomputed_tokens for r in records)
    out_tokens = sum(r.output_tokens for r in records)
    pred = prediction_ratios(records)
    makespan_ms = float(done.max() - arrival.min()) if n else 0.0
    busy = np.asarray(busy_ms, dtype=float) / makespan_ms if makespan_ms > 0 else np.zeros(len(busy_ms))
    busy = np.minimum(busy, 1.0)
    span_s = makespan_ms / 1000.0 if makespan_ms > 0 else 1.0
    return {
        "policy": policy,
        "requests": n,
        "rejected": rejected,
        "deferrals": deferrals,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": float(ttft.mean()) if n else 0.0,
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p90_s": percentile(e2e, 90),
        "e2e_p99_s": percentile(e2e, 99),
        "throughput_rps": n / span_s,
        "output_tokens_per_s": out_tokens / span_s,
        "makespan_s": makespan_ms / 1000.0,
        "prompt_tokens": prompt if n else 0,
        "reused_tokens": reused,
        "fetched_tokens": fetched,
        "recomputed_tokens": recomputed,
        "reused_token_fraction": reused / prompt,
        "fetched_token_fraction": fetched / prompt,
        "recomputed_token_fraction": recomputed / prompt,
        "kv_hit_fraction": (reused + fetched) / prompt,
        "busy_fraction": {w: float(b) for w, b in zip(worker_ids, busy, strict=True)},
        "busy_fraction_mean": float(busy.mean()) if busy.size else 0.0,
        "busy_fraction_spread": float(100.0 * (busy.max() - busy.min())) if busy.size else 0.0,
        "busy_fraction_spread_p90_p10": float(100.0 * (percentile(busy, 90) - percentile(busy, 10))),
        "prediction_ratio_p10": percentile(pred, 10),
        "prediction_ratio_p50": percentile(pred, 50),
        "prediction_ratio_p90": percentile(pred, 90),
    }


def prediction_ratios(records: list[RequestRecord]) -> np.ndarray:
    """Per request: the TTFT the policy predicted when it decided, over the TTFT the engine then gave
    from that moment (1 = exact, < 1 = optimistic). Requests without an estimate are left out."""
    pairs = [
        (r.predicted_ms, r.first_token_ms - r.decided_ms)
        for r in records
        if r.predicted_ms > 0 and r.first_token_ms > r.decided_ms
    ]
    if not pairs:
        return np.zeros(0)
    a = np.asarray(pairs, dtype=float)
    ratios: np.ndarray = a[:, 0] / a[:, 1]
    return ratios


def ttft_seconds(records: list[RequestRecord]) -> np.ndarray:
    """TTFTs in seconds, sorted (for CDF plots)."""
    return np.sort(np.fromiter(((r.first_token_ms - r.arrival_ms) / 1000.0 for r in records), float))


#: Issue #8's claim, checked per load level by :func:`issue8_goal` (``kvmesh simulate --time-scales``).
GOAL_POLICIES = ("round_robin", "least_loaded", "prefix_aware", "kvmesh")
GOAL_RR_MIN_P50_S = 2.0  # the load must be high enough that round_robin's TTFT p50 is >= 2 s
GOAL_MAX_KV_OVER_RR = 0.40  # kvmesh TTFT p50 <= 40% of round_robin's
GOAL_MAX_KV_OVER_PA = 0.80  # ... and <= 80% of prefix_aware's
GOAL_MAX_SPREAD_EXCESS_PT = 10.0  # kvmesh busy_fraction_spread - least_loaded's <= 10 points


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def issue8_goal(
    summaries: dict[str, dict[str, Any]],
    *,
    rr_min_p50_s: float = GOAL_RR_MIN_P50_S,
    max_kv_over_rr: float = GOAL_MAX_KV_OVER_RR,
    max_kv_over_pa: float = GOAL_MAX_KV_OVER_PA,
    max_spread_excess_pt: float = GOAL_MAX_SPREAD_EXCESS_PT,
) -> dict[str, Any]:
    """Issue #8's goal on one run's per-policy summaries (``ttft_p50_s``, ``busy_fraction_spread``).

    Returns the figures -- ``rr_p50_s``, ``kv_over_rr_p50`` and ``kv_over_pa_p50`` (ratios of TTFT
    p50s; None when the denominator is 0), ``spread_kv_minus_ll_pt`` (percentage points) -- a boolean
    per condition (``rr_loaded``, ``kv_vs_rr_ok``, ``kv_vs_pa_ok``, ``spread_ok``) and ``met`` (all of
    them). Comparisons are on unrounded values. Raises KeyError if a policy in GOAL_POLICIES is missing.
    """
    missing = [p for p in GOAL_POLICIES if p not in summaries]
    if missing:
        raise KeyError(f"goal check needs policies {missing}")
    rr = float(summaries["round_robin"]["ttft_p50_s"])
    pa = float(summaries["prefix_aware"]["ttft_p50_s"])
    kv = float(summaries["kvmesh"]["ttft_p50_s"])
    spread = float(summaries["kvmesh"]["busy_fraction_spread"]) - float(
        summaries["least_loaded"]["busy_fraction_spread"]
    )
    kv_rr = _ratio(kv, rr)
    kv_pa = _ratio(kv, pa)
    checks = {
        "rr_loaded": rr >= rr_min_p50_s,
        "kv_vs_rr_ok": kv_rr is not None and kv_rr <= max_kv_over_rr,
        "kv_vs_pa_ok": kv_pa is not None and kv_pa <= max_kv_over_pa,
        "spread_ok": spread <= max_spread_excess_pt,
    }
    return {
        "rr_p50_s": rr,
        "kv_over_rr_p50": kv_rr,
        "kv_over_pa_p50": kv_pa,
        "spread_kv_minus_ll_pt": spread,
        **checks,
        "met": all(checks.values()),
    }
