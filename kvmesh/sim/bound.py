"""The TTFT no router can beat, to measure routing by its excess over it.

Each request's bound is its prefill alone on an idle worker (no queue, no decode step beside it) that
already holds, in its GPU tier, every leading block that any earlier request (by arrival) computed
anywhere in the fleet. It is priced with the simulated engine's own timing (the truth profile and the
request's own noise), so with ``--truth-scale`` it is the truth's bound.

At light load a TTFT percentile is mostly prefill that no router avoids, so a ratio of raw TTFTs says
little; the *excess* of a policy's percentile over the bound's is what routing can still win.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from kvmesh.percentiles import percentile
from kvmesh.sim.metrics import RequestRecord
from kvmesh.sim.truth import TruthScale
from kvmesh_core.costmodel import PerfProfile, recompute_ms
from kvmesh_core.reuse import reusable_blocks
from schemas.messages import ChatRequest
from schemas.token_ids import int_list


def _bounds(
    requests: Iterable[ChatRequest], real: PerfProfile, truth: TruthScale
) -> Iterator[tuple[str, float]]:
    """Every request's id and bound TTFT in seconds, in arrival order, streamed (a trace's requests
    are not all held at once)."""
    seen: set[int] = set()
    for req in requests:
        bs = req.block_size
        n_tok = len(req.token_ids)
        hashes = int_list(req.block_hashes)
        max_reuse = reusable_blocks(n_tok, bs)
        cached = 0
        # block hashes chain their prefix, so a block seen anywhere means its whole prefix was computed
        for h in hashes[:max_reuse]:
            if h not in seen:
                break
            cached += 1
        seen.update(hashes)
        ms = recompute_ms(real, n_tok - cached * bs, cached * bs) * truth.prefill_noise(req.request_id)
        yield req.request_id, ms / 1000.0


def bound_ttfts_s(requests: Iterable[ChatRequest], real: PerfProfile, truth: TruthScale) -> np.ndarray:
    """Every request's bound TTFT in seconds, in arrival order. ``real``: the truth's profile."""
    return np.fromiter((b for _, b in _bounds(requests, real, truth)), float)


def bound_by_request(
    requests: Iterable[ChatRequest], real: PerfProfile, truth: TruthScale
) -> dict[str, float]:
    """Every request's bound TTFT in seconds, by request id (in arrival order)."""
    return dict(_bounds(requests, real, truth))


def bound_summary(ttfts_s: np.ndarray) -> dict[str, Any]:
    """The bound's percentiles, with the same names as a policy's summary."""
    if not ttfts_s.size:
        return {"ttft_p50_s": 0.0, "ttft_p90_s": 0.0, "ttft_p99_s": 0.0, "ttft_mean_s": 0.0, "requests": 0}
    return {
        "ttft_p50_s": percentile(ttfts_s, 50),
        "ttft_p90_s": percentile(ttfts_s, 90),
        "ttft_p99_s": percentile(ttfts_s, 99),
        "ttft_mean_s": float(ttfts_s.mean()),
        "requests": int(ttfts_s.size),
    }


def per_request_excess(records: list[RequestRecord], bound_s: dict[str, float]) -> dict[str, float]:
    """Percentiles of each request's own excess over its own bound, in seconds.

    The goal's excess is a difference of percentiles: at light load the requests at the TTFT p99 are
    the longest prompts, which every router starts at once, so it measures a few ms of their luck.
    This one measures what routing cost each request. Requests without a bound are left out."""
    ex = np.fromiter(
        (
            (r.first_token_ms - r.arrival_ms) / 1000.0 - bound_s[r.request_id]
            for r in records
            if r.request_id in bound_s
        ),
        float,
    )
    if not ex.size:
        return {}
    return {
        "ttft_request_excess_p50_s": percentile(ex, 50),
        "ttft_request_excess_p99_s": percentile(ex, 99),
        "ttft_request_excess_mean_s": float(ex.mean()),
    }
