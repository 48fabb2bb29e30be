"""Routing policies: pure functions of (view, request, now_ms) that rank candidate workers.

Every policy returns scored candidates, the chosen one first. Scores come from one estimator,
:func:`score_worker`, which prices a request on a worker with the shared cost model::

    ttft = queue wait          (report's queued prefill + own pending assignments, kvmesh_core.costmodel)
         + promotion           (cached blocks sitting in dram/disk brought back to the GPU)
         + peer fetch          (blocks a peer holds past the local prefix, only if fetch beats recompute:
                                the peer's lower-tier reads, the link, the promotion of the landed
                                blocks; kvmesh_core.costmodel.fetch_ms)
         + recompute           (every token after the reused/fetched blocks)

``kvmesh`` picks the least ttft plus the work it adds to the fleet (below), ties by the active tokens
of the worker's report, then by the oldest last assignment, then id. Baselines: ``round_robin``,
``least_loaded``, ``session_affinity`` (sticky per session) and ``prefix_aware`` (most cached blocks,
ties by load); they never plan peer fetches. The peers' routers are in
:mod:`services.scheduler.peer_policies`, every policy by name in :mod:`services.scheduler.registry`.

Because the queue estimate includes pending work, an overloaded fleet does not recompute a shared
prefix everywhere: moving a request off a busy holder only wins when the saved wait exceeds the
recompute (or fetch) it costs. Under load that greedy rule still undercounts: the extra prefill a
choice causes on its worker (recompute and promotions, beyond the cheapest candidate's; link time is not
the worker's compute) also delays every request that will queue behind it. So each candidate pays that
extra work once more per request queued on an average candidate (reports' queue depth plus the
router's own pending assignments, plus a live worker's share of the requests the scheduler holds: they
will all queue on some worker), the M/G/1 externality of a job's service time. Idle fleets have no
queue, and the rule is then pure TTFT.

A prompt whose prefix an active request (assigned, not completed) on a worker already covers counts
that prefix as on the worker's GPU: it queues behind that request, which computes it. SGLang's router
and Dynamo's credit what they routed the same way. Without it, a conversation's next turn that arrives
before the previous one ran found its history nowhere and went to any worker.

Candidates are the live workers holding a leading block of the prompt plus the ``k`` least loaded live
workers: any other worker holds nothing of the prompt, so it cannot beat the least loaded of those
(exact for a homogeneous fleet), and scoring 512 workers per request would cost milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh_core.costmodel import decode_ms, fetch_ms, promote_ms, recompute_ms
from kvmesh_core.reuse import reusable_blocks
from schemas.messages import ChatRequest
from services.scheduler.view import FleetView, WorkerState, carried_steps


@dataclass(slots=True)
class CandidateScore:
    """A policy's estimate for one worker (ms). ``transfer_ms`` includes promotion from lower tiers."""

    worker_id: str
    ttft_ms: float
    queue_ms: float
    recompute_ms: float
    transfer_ms: float
    cached_blocks: int
    fetch_blocks: int
    fetch_from: str | None
    work_ms: float = 0.0  # the worker's own compute for it: recompute + promotions (not the link)


@dataclass(frozen=True, slots=True)
class ScoringParams:
    """The knobs of RouterSettings the policies read."""

    fetch_min_blocks: int = 1
    least_loaded_k: int = 2


@dataclass(slots=True)
class Holder:
    ws: WorkerState
    counts: list[int]  # [leading blocks, in gpu, in dram, in disk]


def is_live(view: FleetView, ws: WorkerState, now_ms: int, model: str, as_source: bool = False) -> bool:
    """Fresh reports and the request's model; a draining worker takes no new requests but may still
    be a fetch source (``as_source``): its block server keeps serving while its sessions move away."""
    return (
        ws.report_ms >= now_ms - view.settings.worker_timeout_ms
        and (as_source or not ws.report.draining)
        and ws.report.model == model
    )


def holders(view: FleetView, req: ChatRequest, now_ms: int, as_source: bool = False) -> list[Holder]:
    """Live workers holding ≥ 1 leading block of the prompt, longest prefix first (ties by id).

    With ``as_source``, draining workers are included (as peers to fetch from, never as candidates).
    """
    if req.block_size != view.block_size or not req.block_hashes:
        return []
    index = view.index
    workers = view.workers
    out: list[Holder] = []
    for w, counts in index.match_codes(req.block_hashes).items():
        ws = workers.get(index.worker_name(w))
        if ws is not None and is_live(view, ws, now_ms, req.model, as_source):
            out.append(Holder(ws, counts))
    out.sort(key=lambda h: (-h.counts[0], h.ws.worker_id))
    return out


def least_prefill_ms(view: FleetView, req: ChatRequest, now_ms: int) -> float:
    """The least prefill the fleet could do for ``req`` now: the rest of the prompt after its longest
    prefix cached on a live worker, priced with that worker's profile (any live worker's when none
    holds any of it; 0 when no worker serves the model). Queues and links are not counted: this is the
    request's own work, which orders the requests the scheduler holds (fairness.FairDispatcher)."""
    found = holders(view, req, now_ms)
    n_tok = len(req.token_ids)
    if found:
        cached = min(found[0].counts[0], reusable_blocks(n_tok, req.block_size)) * req.block_size
        return recompute_ms(found[0].ws.profile, n_tok - cached, cached)
    live = view.live_workers(now_ms, req.model)
    return recompute_ms(view.workers[live[0]].profile, n_tok) if live else 0.0


def least_loaded_workers(view: FleetView, live: list[str], k: int, now_ms: int) -> list[str]:
    """The ``k`` live workers with the least estimated queue wait (ties by active tokens, then the
    oldest last assignment, then id)."""
    if len(live) <= k:
        workers = view.workers
        return sorted(
            live,
            key=lambda w: (view.queue_ms(workers[w], now_ms), *workers[w].tie_key),
        )
    # the view keeps workers ranked by a running load key (pending decay not applied): walking its
    # head costs O(k) instead of one Python call per worker. The picks are then scored exactly.
    return view.least_loaded(k, live)


def score_worker(
    view: FleetView,
    ws: WorkerState,
    req: ChatRequest,
    now_ms: int,
    local: list[int] | None,
    peer: Holder | None,
    fetch_min_blocks: int,
) -> CandidateScore:
    """Price ``req`` on ``ws``: reuse ``local`` blocks, maybe fetch the rest of ``peer``'s prefix."""
    p = ws.profile
    bs = req.block_size
    n_tok = len(req.token_ids)
    # at least one token is always computed: its logits start decoding
    max_reuse = reusable_blocks(n_tok, bs)
    cached = 0
    move = 0.0
    if local is not None:
        cached = min(local[0], max_reuse)
        dram, disk = local[2], local[3]
        excess = local[0] - cached
        cut = min(excess, disk)
        disk -= cut
        dram -= min(excess - cut, dram)
        move = promote_ms(p, "dram", dram) + promote_ms(p, "disk", disk)
    fetch = 0
    fetch_from = None
    local_move = move
    landed = 0.0
    # Only engines that move KV blocks with peers (both ends) can fetch; others reuse in place.
    if peer is not None and ws.report.peer_transfer and peer.ws.report.peer_transfer:
        k = min(peer.counts[0], max_reuse) - cached
        if k >= max(fetch_min_blocks, 1):
            # the index counts the peer's tiers over its whole run, not per position: share them out
            run = max(peer.counts[0], 1)
            peer_dram = -(-peer.counts[2] * k // run)
            peer_disk = -(-peer.counts[3] * k // run)
            # behind the pulls already planned onto this worker's link
            t = fetch_ms(p, k, peer.ws.profile, peer_dram, peer_disk) + view.link_wait_ms(ws, now_ms)
            if t < recompute_ms(p, k * bs, cached * bs):
                fetch = k
                fetch_from = peer.ws.worker_id
                move += t
                landed = promote_ms(p, "dram", k) if p.dram_blocks > 0 else 0.0
    reused_tokens = (cached + fetch) * bs
    rec = recompute_ms(p, n_tok - reused_tokens, reused_tokens)
    # a prefill longer than the worker's chunked-prefill budget carries a decode step per iteration
    # (the queue estimate counts its first)
    rec += decode_ms(p, max(carried_steps(ws, n_tok - reused_tokens) - 1, 0))
    # the queue, and for a prompt that does not fit beside the running requests' KV the decode-only
    # steps until enough of them end (those the queue's iterations carry are in the queue already)
    queue = view.queue_ms(ws, now_ms) + view.kv_wait_ms(ws, n_tok, now_ms)
    return CandidateScore(
        worker_id=ws.worker_id,
        ttft_ms=queue + move + rec,
        queue_ms=queue,
        recompute_ms=rec,
        transfer_ms=move,
        cached_blocks=cached,
        fetch_blocks=fetch,
        fetch_from=fetch_from,
        work_ms=rec + local_move + landed,
    )


def score_set(
    view: FleetView,
    req: ChatRequest,
    now_ms: int,
    ids: list[str],
    found: list[Holder],
    params: ScoringParams,
    allow_fetch: bool,
    ahead: dict[str, int] | None = None,
) -> list[CandidateScore]:
    """Score each of ``ids``. ``ahead``: per worker, the leading blocks its active requests' prompts
    hold (:func:`ahead_of`); past what the worker has stored, they count as computed there, on the
    GPU, by the time ``req`` runs behind them. Peers fetch only what they have stored."""
    by_id = {h.ws.worker_id: h for h in found}
    best = found[0] if found else None
    second = found[1] if len(found) > 1 else None
    out = []
    for w in ids:
        h = by_id.get(w)
        local = None if h is None else h.counts
        if ahead:
            n = ahead.get(w, 0)
            if n > (0 if local is None else local[0]):
                local = [n, n, 0, 0] if local is None else [n, local[1] + n - local[0], local[2], local[3]]
        peer = None
        if allow_fetch and best is not None:
            peer = second if best.ws.worker_id == w else best
        out.append(score_worker(view, view.workers[w], req, now_ms, local, peer, params.fetch_min_blocks))
    return out


def ahead_of(view: FleetView, req: ChatRequest, now_ms: int) -> dict[str, int]:
    """Per live worker (not draining), the leading blocks of ``req`` that the prompts of its active
    requests hold: a prefix another request is computing there (or has, before its KV events came)."""
    active = view.active_blocks
    if active is None or req.block_size != view.block_size or not req.block_hashes:
        return {}
    workers = view.workers
    return {
        w: n
        for w, n in active.leading(req.block_hashes).items()
        if (ws := workers.get(w)) is not None and is_live(view, ws, now_ms, req.model)
    }


def prefix_workers(found: list[Holder], ahead: dict[str, int]) -> set[str]:
    """The candidates a prefix gives: the workers storing a leading run of the prompt (``found``;
    draining ones are fetch sources only) or computing one for a request assigned before (``ahead``)."""
    ids = {h.ws.worker_id for h in found if not h.ws.report.draining}
    ids.update(ahead)
    return ids


def kvmesh(
    view: FleetView, req: ChatRequest, now_ms: int, live: list[str], params: ScoringParams
) -> list[CandidateScore]:
    """Least estimated time to first token, counting queue, promotion, peer fetch and recompute."""
    found = holders(view, req, now_ms, as_source=True)
    ahead = ahead_of(view, req, now_ms)
    ids = prefix_workers(found, ahead)
    ids.update(least_loaded_workers(view, live, params.least_loaded_k, now_ms))
    out = score_set(view, req, now_ms, sorted(ids), found, params, allow_fetch=True, ahead=ahead)
    workers = view.workers
    # the work a choice adds beyond the cheapest candidate delays the requests that will queue behind
    # it; as many will as now wait on an average candidate (see the module docstring)
    depth = sum(workers[c.worker_id].report.queue_depth + len(workers[c.worker_id].pending) for c in out)
    # ... and the requests the scheduler holds will queue on the live workers too, a share on each
    behind = depth / len(out) + view.held / len(live)
    least_work = min(c.work_ms for c in out)

    def cost(c: CandidateScore) -> float:
        return c.ttft_ms + behind * (c.work_ms - least_work)

    # equal estimates (common: idle or one decode step, nothing cached) go to the smaller decode
    # batch, which frees up sooner, then to the worker assigned to longest ago (view.WorkerState)
    out.sort(key=lambda c: (cost(c), *workers[c.worker_id].tie_key))
    return out


def prefix_aware(
    view: FleetView, req: ChatRequest, now_ms: int, live: list[str], params: ScoringParams
) -> list[CandidateScore]:
    """Most cached leading blocks; ties (including none cached) by queue wait, then worker id."""
    found = holders(view, req, now_ms)
    ids = {h.ws.worker_id for h in found}
    ids.update(least_loaded_workers(view, live, params.least_loaded_k, now_ms))
    out = score_set(view, req, now_ms, sorted(ids), found, params, allow_fetch=False)
    out.sort(key=lambda c: (-c.cached_blocks, c.queue_ms, c.worker_id))
    return out


def least_loaded(
    view: FleetView, req: ChatRequest, now_ms: int, live: list[str], params: ScoringParams
) -> list[CandidateScore]:
    """Least queue wait, blind to the cache (ties by worker id)."""
    ids = least_loaded_workers(view, live, params.least_loaded_k, now_ms)
    out = score_set(view, req, now_ms, ids, holders(view, req, now_ms), params, allow_fetch=False)
    out.sort(key=lambda c: (c.queue_ms, c.worker_id))
    return out


def round_robin(
    view: FleetView, req: ChatRequest, now_ms: int, live: list[str], params: ScoringParams
) -> list[CandidateScore]:
    """The next live worker in id order after the previous assignment (counted by the view)."""
    w = live[view.assignments_noted % len(live)]
    return score_set(view, req, now_ms, [w], holders(view, req, now_ms), params, allow_fetch=False)


def session_affinity(
    view: FleetView, req: ChatRequest, now_ms: int, live: list[str], params: ScoringParams
) -> list[CandidateScore]:
    """The worker of the session's previous turn while it is live; a new session goes to the least loaded."""
    w = view.session_worker(req.session_id)
    if w is None or w not in view.workers or not is_live(view, view.workers[w], now_ms, req.model):
        w = least_loaded_workers(view, live, 1, now_ms)[0]
    return score_set(view, req, now_ms, [w], holders(view, req, now_ms), params, allow_fetch=False)
