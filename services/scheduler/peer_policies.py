"""The routers users would run instead of kvmesh, rebuilt from their published cost functions and defaults.

Each peer ranks every live worker with its own rule and its own information; none plans a peer fetch
or reads a worker's speed profile. The assignment's estimate is still kvmesh's cost-model price of
the chosen worker, so ``kvmesh simulate`` can report how well each policy's choice was predicted.

Where a peer breaks exact ties at random, the tie goes to the worker with the smallest hash of
(request id, worker id): as unbiased as a random pick, and deterministic, so replays reproduce it.

* ``dynamo`` -- NVIDIA Dynamo's KV router (ai-dynamo/dynamo ``docs/components/router/router-concepts.md``,
  ``router-configuration.md``; ``lib/kv-router/src/scheduling/selector/default.rs``)::

      cost = prefill_load_scale * max((active prefill tokens + prompt tokens) / block_size
                                      - overlap credit, 0)
           + active decode blocks + the prompt's blocks not already among them
      overlap credit = device blocks * 1.0 + host blocks * 0.75 + disk blocks * 0.25

  with ``prefill_load_scale`` 1 and router temperature 0 (the least cost wins). Active decode blocks
  are the distinct prompt blocks of the requests Dynamo routed to the worker and that have not
  completed (its ``ActiveSequences``, :class:`~services.scheduler.router_state.ActiveBlocks`). Active
  prefill tokens are the worker's queued prefill: Dynamo adds each routed request's uncached tokens
  and removes them at its first token; kvmesh's scheduler sees no first token, so it reads the same
  quantity from the worker's LoadReport plus its own assignments not yet in a report. The overlap
  is the longest consecutive run of the prompt's blocks the worker holds, its tiers counted over
  the run (Dynamo counts host and disk blocks as extensions past the device prefix).

* ``llm_d`` -- llm-d's precise prefix-cache scheduling (llm-d ``deploy/config/epp-precise-prefix-cache-
  config.yaml``; llm-d-kv-cache ``pkg/kvcache/kvblock_scorer.go``; llm-d-inference-scheduler scorers)::

      score = 2 * prefix + 1 * kv utilization + 1 * queue        (max-score picker)
      prefix      = tier-weighted longest consecutive cached prefix / prompt blocks, capped at 1
                    (gpu 1.0, cpu 0.8; kvmesh's disk tier counts as cpu offload)
      kv util     = 1 - the worker's KV cache usage (blocks held by running requests / GPU blocks,
                    as vLLM's ``kv_cache_usage_perc`` counts them: cached free blocks are not used)
      queue       = (max - waiting) / (max - min) over the candidates, 1 when all are equal

  from the workers' own metrics (here their LoadReports): llm-d does not count its own assignments.

* ``sglang`` -- the SGLang router's ``cache_aware`` policy with its CLI defaults (sgl-project/sglang
  ``sgl-model-gateway/src/policies/cache_aware.rs``; ``cache_threshold`` 0.3,
  ``balance_abs_threshold`` 64, ``balance_rel_threshold`` 1.5, ``max_tree_size`` 2^26 characters)::

      load = requests the router sent to the worker and not yet completed (its own count)
      if max load - min load > 64 and max load > 1.5 * min load: the least loaded worker
      else: match = the longest prefix of the prompt in the router's tree of what it routed
            (never the engines' caches); match rate = matched tokens / prompt tokens
            rate > 0.3: the worker at the deepest match, else the least loaded worker

  Load ties go to the first worker in id order (its ``min_by_key``). The tree is
  :class:`~services.scheduler.router_state.RoutedPrefixes`, 2^26 characters taken as 2^24 tokens.
"""

from __future__ import annotations

import zlib

from schemas.messages import ChatRequest
from services.scheduler.policies import CandidateScore, Holder, ScoringParams, holders, score_set
from services.scheduler.view import FleetView

# Dynamo's defaults (KvRouterConfig)
DYNAMO_PREFILL_LOAD_SCALE = 1.0
DYNAMO_TIER_CREDIT = (1.0, 0.75, 0.25)  # device, host, disk

# llm-d's deployed weights and tier weights
LLM_D_WEIGHTS = (2.0, 1.0, 1.0)  # prefix, kv-cache utilization, queue
LLM_D_TIER_WEIGHT = (1.0, 0.8, 0.8)  # gpu, cpu (dram), disk taken as cpu offload

# SGLang router CLI defaults
SGLANG_CACHE_THRESHOLD = 0.3
SGLANG_BALANCE_ABS = 64
SGLANG_BALANCE_REL = 1.5
SGLANG_MAX_TREE_TOKENS = 2**26 // 4  # max_tree_size counts characters; ~4 per token

#: How many of a peer's ranked workers get a full cost-model estimate (for the decision's candidates).
SCORED = 8


def tie_key(request_id: str, worker_id: str) -> int:
    """A deterministic stand-in for a random tie break."""
    return zlib.crc32(f"{request_id}/{worker_id}".encode())


def _ranked(
    view: FleetView,
    req: ChatRequest,
    now_ms: int,
    order: list[str],
    params: ScoringParams,
    found: list[Holder],
) -> list[CandidateScore]:
    """kvmesh's estimates of the peer's first choices, in the peer's order (fetch never planned)."""
    return score_set(view, req, now_ms, order[:SCORED], found, params, allow_fetch=False)


def dynamo(
    view: FleetView, req: ChatRequest, now_ms: int, live: list[str], params: ScoringParams
) -> list[CandidateScore]:
    """NVIDIA Dynamo's KV router: least prefill-plus-decode block cost (see the module docstring)."""
    bs = req.block_size
    isl = len(req.token_ids)
    found = holders(view, req, now_ms)
    overlaps = {h.ws.worker_id: h.counts for h in found}
    active = view.active_blocks
    hashes = req.block_hashes
    dev_w, host_w, disk_w = DYNAMO_TIER_CREDIT
    keyed: list[tuple[float, int, str]] = []
    for w in live:
        ws = view.workers[w]
        c = overlaps.get(w)
        credit = 0.0 if c is None else c[1] * dev_w + c[2] * host_w + c[3] * disk_w
        prefill_tokens = ws.report.queued_prefill_tokens + view.pending_prefill_tokens(ws, now_ms)
        prefill = DYNAMO_PREFILL_LOAD_SCALE * max((prefill_tokens + isl) / bs - credit, 0.0)
        decode = 0 if active is None else active.active(w) + active.new_blocks(w, hashes)
        keyed.append((prefill + decode, tie_key(req.request_id, w), w))
    keyed.sort()
    return _ranked(view, req, now_ms, [w for _, _, w in keyed], params, found)


def _kv_usage(view: FleetView, w: str) -> float:
    ws = view.workers[w]
    gpu = ws.profile.gpu_blocks
    if gpu <= 0:
        return 0.0
    return min(ws.report.active_tokens / ws.report.block_size / gpu, 1.0)


def llm_d(
    view: FleetView, req: ChatRequest, now_ms: int, live: list[str], params: ScoringParams
) -> list[CandidateScore]:
    """llm-d's precise prefix-cache scheduling: weighted prefix, KV usage and queue scores."""
    total = len(req.token_ids) // req.block_size
    found = holders(view, req, now_ms)
    overlaps = {h.ws.worker_id: h.counts for h in found}
    queues = {w: view.workers[w].report.queue_depth for w in live}
    q_min = min(queues.values())
    q_max = max(queues.values())
    wp, wk, wq = LLM_D_WEIGHTS
    gw, cw, dw = LLM_D_TIER_WEIGHT
    keyed: list[tuple[float, int, str]] = []
    for w in live:
        c = overlaps.get(w)
        prefix = 0.0
        if c is not None and total > 0:
            prefix = min((c[1] * gw + c[2] * cw + c[3] * dw) / total, 1.0)
        queue = 1.0 if q_max == q_min else (q_max - queues[w]) / (q_max - q_min)
        score = wp * prefix + wk * (1.0 - _kv_usage(view, w)) + wq * queue
        keyed.append((-score, tie_key(req.request_id, w), w))
    keyed.sort()
    return _ranked(view, req, now_ms, [w for _, _, w in keyed], params, found)


def sglang(
    view: FleetView, req: ChatRequest, now_ms: int, live: list[str], params: ScoringParams
) -> list[CandidateScore]:
    """SGLang router ``cache_aware``: balance by in-flight count, else the best routed-prefix match."""
    loads = {w: view.worker_inflight(w) for w in live}
    least = min(live, key=lambda w: loads[w])  # live is sorted: ties go to the first id
    lo = loads[least]
    hi = max(loads.values())
    choice = least
    if not (hi - lo > SGLANG_BALANCE_ABS and hi > SGLANG_BALANCE_REL * lo) and view.routed is not None:
        depth, tenant = view.routed.match(req.block_hashes, frozenset(live))
        n_tok = len(req.token_ids)
        if tenant is not None and n_tok and depth * req.block_size / n_tok > SGLANG_CACHE_THRESHOLD:
            choice = tenant
    order = [choice, *sorted((w for w in live if w != choice), key=lambda w: (loads[w], w))]
    return _ranked(view, req, now_ms, order, params, holders(view, req, now_ms))
