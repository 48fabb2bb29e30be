"""One simulated worker: a FCFS prefill queue, a decode batch, a tiered block cache, and its messages.

Time model (ms), one engine *iteration* at a time, as in a continuous-batching engine with mixed
prefill + decode steps::

    assignment --[pull planned blocks from peers on the link: transfer_ms]--> FCFS queue
    iteration with a prefill:  promote(local lower-tier blocks) + recompute(rest of prompt)
                               [+ one decode step when the batch is not empty]
    decode-only run:           k decode steps of the whole batch (k = steps until the next request ends;
                               cut at the next step boundary when a new request is queued)

Like the live worker (services/worker/service.py), a fetch happens when the assignment arrives, before
the request joins the engine's queue, and only extends the prefix the worker already holds; pulls of one
worker share its link one at a time, while its GPU keeps computing. A pull costs what
``kvmesh_core.costmodel.fetch_ms`` says (its ``pull_ms`` on the link, the landing promotion at prefill):
the peer reads blocks held in its lower tiers, the link carries them, they land in the DRAM tier (GPU
without one) and the prefill promotes them. The worker serves what
it really holds, not what the scheduler believed: a planned block the peer no longer has ends the pull
there, and the prefill reuses the longest local prefix at the time it starts and recomputes the rest.
From the moment a request is queued, the prefix it finds here (extended by what its pull brings) is
pinned until its prefill has read it, as the live engine holds it (``KvCacheManager.hold``): pinned
blocks are evicted only when nothing else can go.
How an assignment meets a pull in flight is ``admission``:

- ``overlap`` (the default, what the live worker does, ``WorkerSettings.admission``; vLLM's
  WAITING_FOR_REMOTE_KVS): the request joins the queue at once and is skipped until its pull lands,
  keeping its place ahead of those queued after it;
- ``serial`` (the live worker's rule before, still a setting): assignments are admitted one at a time,
  each after its own pull, so one that arrives while a pull is on the link is admitted after it lands;
- ``pass`` (what-if): the pulling request joins the queue when its blocks land, and assignments that
  arrive meanwhile go ahead of it. After a prefill every full prompt block is
written to the GPU tier; cache changes go out as KvEvents, and a LoadReport after every iteration.

Loads (``load``): how a prefill's prefix held in DRAM or on disk here reaches the GPU tier.

- ``sync`` (the default, the live worker's ``vllm_async_load=False``): the
  prefill iteration promotes it, then recomputes the rest; the running batch's decode step waits for
  both.
- ``async`` (``vllm_async_load=True``, for GPU hosts where the copy is a DMA; vLLM's
  WAITING_FOR_REMOTE_KVS): when the request is next in line and its blocks fit, they are taken and
  its prefix is copied to the GPU tier, one copy at a time per worker, while the engine goes on with
  the requests behind it; once copied it is first in line again and its iteration only recomputes.

KV capacity (``kv_capacity``, the default), as the live engine admits (``Engine._admit``; vLLM's
scheduler the same): a running request holds its prompt's blocks in the GPU tier (blocks shared with
another running request count once) and one more per block of tokens it generates. The next prefill
in line starts only when its blocks fit in the tier beside the running requests'; until then it, and
those queued behind it, wait for the decode steps that end running requests. With a trace's long
prompts this decides a busy worker's wait: at 4x arrivals on the Mooncake trace, without the rule, a
worker's running batch and the next prompt, each request counted with its whole answer, peaked at
1.6x its GPU tier (the median worker's peak), and 11 % of iterations started past it. A running
request's growth is not capped (the live engine would preempt one); ``--no-kv-capacity`` is the what-if
without the rule, as the simulator ran before.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import msgspec

from kvmesh.sim.cache import FleetHolders, TieredCache
from kvmesh.sim.metrics import RequestRecord
from kvmesh.sim.truth import TruthScale
from kvmesh_core.costmodel import (
    PerfProfile,
    decode_ms,
    prefill_ctx,
    promote_ms,
    pull_ms,
    recompute_ms,
)
from kvmesh_core.event_runs import EventRun
from kvmesh_core.fetching import PullsInFlight, Step, chain_parents, plan_step
from kvmesh_core.kv_room import kv_release
from kvmesh_core.reuse import reusable_blocks
from schemas.messages import (
    TIERS,
    Assignment,
    ChatRequest,
    Completion,
    FetchPlan,
    KvEvent,
    LoadReport,
    TierUsage,
)
from schemas.token_ids import int_list
from services.worker.batch_slots import OutputLengths
from services.worker.engine_api import EngineLoad
from services.worker.reports import WorkerIdentity, build_load_report

#: Where a worker sends a message it publishes: (message, simulated time ms).
Emit = Callable[[object, float], None]
#: How a worker asks the engine to call it back at a time: (time ms, worker, job (fetch done) or None
#: (end of iteration; stale unless the worker's ``gen`` is unchanged)).
Schedule = Callable[[float, "SimWorker", "Job | None"], None]
# how an assignment meets a pull in flight (module docstring)
Admission = Literal["serial", "pass", "overlap"]
ADMISSIONS: tuple[str, ...] = get_args(Admission)
# how a prefill's lower-tier prefix reaches the GPU tier (module docstring, "Loads")
Load = Literal["sync", "async"]
LOADS: tuple[str, ...] = get_args(Load)


#: A LoadReport's defaults for what a simulated worker has no facts of (model, engine, context).
_REPORT_DEFAULTS: dict[str, Any] = {f.name: f.default for f in msgspec.structs.fields(LoadReport)}


@dataclass(frozen=True, slots=True)
class Probe:
    """What :meth:`SimWorker.probe` found: the true TTFT, its own prefill iteration's share (no decode
    step), the leading blocks reused in place and those pulled from the source first."""

    ttft_ms: float
    prefill_ms: float
    cached_blocks: int
    fetch_blocks: int = 0


@dataclass(slots=True)
class Job:
    """One assigned request on a worker, and how its prompt was served (filled in at prefill)."""

    request: ChatRequest
    fetch: list[FetchPlan]
    arrival_ms: float
    queued_tokens: int  # the scheduler's prefill estimate, published as queued work until prefill starts
    queued_ctx: float = 0.0  # prefill_ctx of that estimate (published with it)
    decided_ms: float = 0.0  # when the scheduler assigned it
    predicted_ms: float = 0.0  # the scheduler's TTFT estimate from ``decided_ms``
    prompt_tokens: int = 0
    remaining: int = 0
    first_token_ms: float = -1.0
    reused_tokens: int = 0
    fetched_tokens: int = 0
    recomputed_tokens: int = 0
    prefill_ms: float = 0.0
    fetch_range: tuple[int, int] = (0, 0)  # blocks [lo, hi) pulled from peers before queueing
    fetched_blocks: int = 0
    held: list[int] = field(default_factory=list)  # its prefix, pinned in the cache until its prefill
    ready: bool = True  # False while its pull, or the one it waits for, is in flight (overlap only)
    # requests queued here that wait for this one's pull: it carries the next blocks of their prompts
    waiters: list[Job] = field(default_factory=list)
    # async loads: its lower-tier prefix is being copied to the GPU tier (its GPU blocks taken), and
    # whether that copy ended (it is queued again, first in line, with its blocks still taken)
    loading: bool = False
    loaded: bool = False
    # KV capacity: the prompt's tokens, blocks and full blocks (set when queued), and of its full
    # blocks how many no other running request holds
    kv_tokens: int = 0
    kv_blocks: int = 0
    kv_full: int = 0
    kv_alone: int = 0


class SimWorker:
    """Owns one worker's queue, decode batch, cache and busy time.

    Invariants: at most one iteration is in flight (it ends at ``busy_until``); ``gen`` is bumped
    whenever the pending end-of-iteration event is superseded, so the engine ignores a stale one.
    Finished requests are kept only as small RequestRecords (a long prompt's token list is the bulk of
    a run's memory).
    """

    def __init__(
        self,
        index: int,
        worker_id: str,
        profile: PerfProfile,
        emit: Emit,
        schedule: Schedule,
        peers: dict[str, SimWorker],
        admission: Admission = "overlap",
        fleet: FleetHolders | None = None,
        truth: TruthScale | None = None,
        kv_capacity: bool = True,
        load: Load = "sync",
    ) -> None:
        self.index = index
        self.worker_id = worker_id
        self.address = f"sim://{worker_id}"
        # what the worker publishes (every policy sees only this) and what its engine really runs at
        self.profile = profile
        # What a LoadReport says of this worker beside its load: the live defaults of a worker that
        # publishes no model facts (the simulator's fleet serves one model).
        self._ident = WorkerIdentity(
            worker_id=worker_id,
            model=_REPORT_DEFAULTS["model"],
            engine=_REPORT_DEFAULTS["engine"],
            block_size=profile.block_size,
            block_bytes=profile.block_bytes,
            max_context=_REPORT_DEFAULTS["max_context"],
            transfer_address=self.address,
            peer_transfer=True,
            started_ms=0,
        )
        self.truth = truth or TruthScale()
        self.real = self.truth.apply(profile)
        self.peers = peers  # every worker of the fleet by id (a shared dict), for fetches
        # fleet: the holder counts shared by every worker's cache (fleet-aware eviction); None: LRU
        self.cache = TieredCache(profile.gpu_blocks, profile.dram_blocks, profile.disk_blocks, fleet)
        self.busy_ms = 0.0
        self.finished: list[RequestRecord] = []
        self.last_report_ms = -1.0
        self.gen = 0
        self.busy_until = 0.0
        self._emit = emit
        self._schedule = schedule
        self._link_free = 0.0
        if admission not in ADMISSIONS:
            raise ValueError(f"admission {admission!r}: one of {', '.join(ADMISSIONS)}")
        self._admission = admission  # see the module docstring
        if load not in LOADS:
            raise ValueError(f"load {load!r}: one of {', '.join(LOADS)}")
        self._load = load  # see "Loads" in the module docstring
        self._copy_free = 0.0  # async loads: when the copy in flight ends (one at a time)
        self._loading: list[Job] = []  # async loads: the jobs whose copy is queued or in flight
        # serial: assignments that came while a pull was on the link (pulls never overlap there, so
        # ``_link_free`` is when the one in flight lands)
        self._held: deque[Job] = deque()
        # the blocks on the link now, by the job whose pull carries them (overlap admission)
        self._pulling: PullsInFlight[Job] = PullsInFlight()
        self._queue: deque[Job] = deque()
        self._decoding: list[Job] = []
        self._prefilling: Job | None = None
        self._prefill_start = 0.0
        self._queued_tokens = 0
        self._queued_ctx = 0.0
        self._active_tokens = 0
        self._run_start = 0.0  # start of a decode-only run, and its planned steps (0: not in one)
        self._run_steps = 0
        # KV capacity (see "KV capacity" in the module doc): the GPU blocks the running requests hold,
        # their prompt blocks by hash (shared ones once, as the live engine's shared prefix), and
        # whether a prefill must wait for them to fit. False: the batch grows without bound (before).
        self._kv_capacity = kv_capacity
        self._kv_holders: dict[int, list[Job]] = {}  # prompt block hash -> running jobs holding it
        self._queued_blocks = 0  # the queued prompts' blocks, as the live engine reports its queue's
        # the typical output length, from the requests that ended here: what a live engine expects of
        # a running request's end (its LoadReport's kv_release) without knowing its real length
        self._outputs = OutputLengths()

    # ------------------------------------------------------------------------------------ messages

    def report(self, now_ms: float) -> None:
        """Publish a LoadReport of the current state."""
        p = self.profile
        cache = self.cache
        tiers = [
            TierUsage(TIERS[i], cache.capacity(i) - cache.used(i), cache.capacity(i))
            for i in range(3)
            if cache.capacity(i) > 0
        ]
        queued = self._queued_tokens
        queued_ctx = self._queued_ctx
        depth = len(self._queue) + len(self._loading)
        job = self._prefilling
        if job is not None and self.busy_until > now_ms:
            # The prefill in flight still owes its remaining share of the iteration.
            span = self.busy_until - self._prefill_start
            left = (self.busy_until - now_ms) / span if span > 0 else 0.0
            queued += int(job.recomputed_tokens * left)
            queued_ctx += prefill_ctx(job.recomputed_tokens, job.prompt_tokens - job.recomputed_tokens) * left
            depth += 1
        self.last_report_ms = now_ms
        free, release = self._kv_room() if self._kv_capacity else (None, [])
        load = EngineLoad(
            queue_depth=depth,
            active_requests=len(self._decoding) + depth,
            active_tokens=self._active_tokens,
            queued_prefill_tokens=queued,
            tiers=tiers,
            queued_prefill_ctx_tokens=queued_ctx,
            kv_free_blocks=free,
            kv_release=release,
        )
        # The live worker's builder: the simulated worker publishes what a real one would.
        lr = build_load_report(self._ident, load, p, int(now_ms), draining=False)
        self._emit(lr, now_ms)

    # ---------------------------------------------------------------------------------- the engine

    def assign(self, assignment: Assignment, arrival_ms: float, now_ms: float) -> None:
        """Take a request: pull its planned blocks from peers first (as the live worker does, on the
        link while the GPU keeps working), then queue it FCFS.

        No LoadReport here: the scheduler's view counts its own assignment as pending until a report
        newer than it arrives.
        """
        job = Job(
            assignment.request,
            assignment.fetch,
            arrival_ms,
            max(assignment.prefill_tokens, 0),
            decided_ms=now_ms,
            predicted_ms=assignment.estimate.ttft_ms if assignment.estimate is not None else 0.0,
        )
        job.queued_ctx = prefill_ctx(job.queued_tokens, len(job.request.token_ids) - job.queued_tokens)
        self._queued_tokens += job.queued_tokens
        self._queued_ctx += job.queued_ctx
        if self._admission == "serial" and (self._held or now_ms < self._link_free):
            self._held.append(job)
            return
        self._admit(job, now_ms)

    def _admit(self, job: Job, now_ms: float) -> None:
        self._hold_prefix(job)
        if job.fetch:
            done = self._plan_fetch(job, now_ms)
            if done is not None:
                self._schedule(done, self, job)
                if self._admission != "overlap":
                    return
                job.ready = False
        if job.ready and self._pulling:
            # The next blocks of its prompt are on the link for a request queued before it (the
            # scheduler counted them as here): it waits for them, as the live worker does, rather than
            # start at once and recompute them.
            hashes = int_list(job.request.block_hashes)
            puller = self._pulling.carrier(hashes, len(self.cache.prefix_tiers(hashes)))
            if puller is not None:
                job.ready = False
                puller.waiters.append(job)
        self._enqueue(job, now_ms)

    def _plan_fetch(self, job: Job, now_ms: float) -> float | None:
        """Decide which planned blocks the peers really hold now; return when the pull ends."""
        hashes = int_list(job.request.block_hashes)
        have = len(self.cache.prefix_tiers(hashes))
        cost = 0.0
        start = have
        for plan in sorted(job.fetch, key=lambda f: f.first_block):
            end = plan.first_block + len(plan.block_hashes)
            step, _ = plan_step(plan.first_block, len(plan.block_hashes), have)
            if step is Step.HELD:
                continue  # already here (an earlier turn, a replication)
            peer = self.peers.get(plan.peer_worker)
            if step is Step.GAP or peer is None:
                break  # a gap before the fetched blocks: a chained block is useless after it
            got = 0
            lower = [0, 0, 0]  # of the blocks pulled, how many the peer reads from each tier
            for pos in range(have, end):
                h = plan.block_hashes[pos - plan.first_block]
                t = peer.cache.tier_of(h) if pos < len(hashes) and hashes[pos] == h else None
                if t is None:
                    break
                lower[t] += 1
                got += 1
            if got:
                # the peer reads, the link carries; promotion of the landed blocks is paid at prefill
                cost += pull_ms(self.real, got, peer.real, lower[1], lower[2])
                have += got
            if have < end:
                break  # the peer lacked a block: the rest is recomputed
        job.fetch = []
        if have == start:
            return None
        job.fetch_range = (start, have)
        if self._admission == "overlap":
            self._pulling.add(hashes[start:have], job)
        begin = max(now_ms, self._link_free)
        self._link_free = begin + cost  # one pull at a time on this worker's link
        return self._link_free

    def on_fetch_done(self, job: Job, now_ms: float) -> None:
        """The pulled blocks enter the DRAM tier (the GPU tier without one), as the live worker commits
        them, and the view by KvEvent; the job joins the queue and its prefill promotes them."""
        lo, hi = job.fetch_range
        hashes = int_list(job.request.block_hashes)
        parents = chain_parents(hashes, lo, hi - lo)
        self._publish(self.cache.insert(hashes[lo:hi], parents, 1), job, now_ms)
        self._hold_prefix(job)  # what it pulled extends the prefix it holds
        job.fetched_blocks = hi - lo
        self._pulling.remove(hashes[lo:hi], job)
        for waiter in job.waiters:  # queued already (overlap admission), passed over until now
            self._hold_prefix(waiter)
            waiter.ready = True
        job.waiters = []
        if job.ready:
            self._enqueue(job, now_ms)
        else:
            job.ready = True
            self._wake(now_ms)
        while self._held and now_ms >= self._link_free:
            self._admit(self._held.popleft(), now_ms)

    def _hold_prefix(self, job: Job) -> None:
        """Pin the leading run of ``job``'s prompt held here, instead of what it held, until its
        prefill has read it: a queued request keeps its prefix, as the live engine holds it from the
        moment the request is queued until it is admitted (``KvCacheManager.hold``)."""
        hashes = int_list(job.request.block_hashes)
        self._hold(job, hashes[: len(self.cache.prefix_tiers(hashes))])

    def _hold(self, job: Job, hashes: list[int]) -> None:
        self.cache.unpin(job.held)
        job.held = hashes
        self.cache.pin(hashes)

    def _enqueue(self, job: Job, now_ms: float) -> None:
        job.kv_tokens = len(job.request.token_ids)
        job.kv_blocks = -(-job.kv_tokens // self.real.block_size)
        job.kv_full = len(job.request.block_hashes)
        self._queued_blocks += job.kv_blocks
        self._queue.append(job)
        self._wake(now_ms)

    def _wake(self, now_ms: float) -> None:
        """A job became ready: start it now if idle, or at the next decode step boundary."""
        if now_ms >= self.busy_until:
            self._start(now_ms)
            return
        if self._run_steps and (head := self._head()) is not None and self._fits(self._queue[head]):
            # Cut a decode-only run at the next step boundary so the new prefill starts there (not
            # for a prefill that would not fit: it waits for the run's end to free blocks).
            step = self.real.decode_ms_per_step
            done = int((now_ms - self._run_start) // step) + 1
            if done < self._run_steps:
                self.busy_ms -= (self._run_steps - done) * step
                self._run_steps = done
                self.busy_until = self._run_start + done * step
                self.gen += 1
                self._schedule(self.busy_until, self, None)

    def on_iteration_end(self, now_ms: float) -> None:
        """Finish the iteration in flight, start the next one, report."""
        if self._run_steps:
            steps, self._run_steps = self._run_steps, 0
            self._advance_decode(steps, now_ms)
        elif self._prefilling is not None:
            job, self._prefilling = self._prefilling, None
            if self._decoding:
                self._advance_decode(1, now_ms)
            self._finish_prefill(job, now_ms)
        self._start(now_ms)
        self.report(now_ms)

    def _head(self) -> int | None:
        """Where the next prefill in line is queued: FCFS among jobs whose pulled blocks arrived."""
        return next((i for i, j in enumerate(self._queue) if j.ready), None)

    def _start(self, now_ms: float) -> None:
        job = None
        # a head that does not fit waits for running requests to free blocks, and those behind it too
        while (head := self._head()) is not None and self._fits(self._queue[head]):
            job = self._queue[head]
            del self._queue[head]
            if not job.loaded:  # a loaded job took its blocks when its copy began
                self._queued_blocks -= job.kv_blocks
                self._kv_take(job)
            if self._load == "async" and not job.loaded and self._begin_load(job, now_ms):
                job = None  # copying off the iteration; the next in line may start now
                continue
            break
        if job is not None:
            self._queued_tokens -= job.queued_tokens
            self._queued_ctx = max(self._queued_ctx - job.queued_ctx, 0.0)
            duration = self._serve(job)
            if self._decoding:
                duration += self.real.decode_ms_per_step
            self._prefilling = job
            self._prefill_start = now_ms
        elif self._decoding:
            steps = min(j.remaining for j in self._decoding)
            duration = decode_ms(self.real, steps)
            self._run_start, self._run_steps = now_ms, steps
        else:
            return
        self.busy_ms += duration
        self.busy_until = now_ms + duration
        self.gen += 1
        self._schedule(self.busy_until, self, None)

    def _begin_load(self, job: Job, now_ms: float) -> bool:
        """Async loads: start copying ``job``'s lower-tier prefix to the GPU tier, after the copy in
        flight (one at a time, as one copy stream); False when all of it is in the GPU tier already."""
        promote, _ = self._prefill_plan(job.request)
        if promote <= 0.0:
            return False
        self._copy_free = max(now_ms, self._copy_free) + promote
        job.loading = True
        self._loading.append(job)
        self._schedule(self._copy_free, self, job)
        return True

    def on_load_done(self, job: Job, now_ms: float) -> None:
        """Async loads: ``job``'s prefix is in the GPU tier now (KvEvents say so); it is queued again
        after the loaded jobs before it and ahead of the rest, as vLLM keeps a request that waited for
        its KV at the front of its waiting queue, and its prefill recomputes only what is missing."""
        job.loading = False
        job.loaded = True
        self._loading.remove(job)
        hashes = int_list(job.request.block_hashes)
        k = self._prefill_plan(job.request)[1]  # the run its prefill reuses, all of it held here
        if k:
            # every block of the run is held, so access only promotes (it stores nothing)
            self._publish(self.cache.access(hashes[:k], [0, *hashes[: k - 1]]), job, now_ms)
        i = 0
        while i < len(self._queue) and self._queue[i].loaded:
            i += 1
        self._queue.insert(i, job)
        self._wake(now_ms)

    def _serve(self, job: Job) -> float:
        """Plan ``job``'s prompt against the real caches; return the prefill iteration's length."""
        bs = self.real.block_size
        n_tok = len(job.request.token_ids)
        plan = self._prefill_plan(job.request)
        n = plan[1]
        job.prompt_tokens = n_tok
        # As the live worker counts: fetched blocks are in the local prefix by now.
        job.fetched_tokens = min(n, job.fetched_blocks) * bs
        job.reused_tokens = n * bs - job.fetched_tokens
        job.recomputed_tokens = n_tok - n * bs
        total, job.prefill_ms = self._prefill_cost(job.request, plan)
        return total

    def _prefill_cost(
        self, request: ChatRequest, plan: tuple[float, int], fetched: int = 0
    ) -> tuple[float, float]:
        """The one price of a prefill iteration here, at the truth's speed and noise, given its
        ``_prefill_plan`` and ``fetched`` blocks pulled past the local prefix (not landed yet: each
        is promoted from DRAM at prefill): the iteration's length, and its recompute part alone."""
        p = self.real
        promote, n = plan
        if fetched and p.dram_blocks > 0:
            promote += promote_ms(p, "dram", fetched)
        reused = (n + fetched) * p.block_size
        rec = recompute_ms(p, len(request.token_ids) - reused, reused)
        rec *= self.truth.prefill_noise(request.request_id)
        return promote + rec, rec

    def _prefill_plan(self, request: ChatRequest) -> tuple[float, int]:
        """What a prefill of ``request`` would reuse from this worker's cache now: the time to promote
        its local lower-tier blocks to the GPU, and how many leading blocks it reuses."""
        p = self.real
        hashes = int_list(request.block_hashes)
        max_reuse = reusable_blocks(len(request.token_ids), p.block_size)
        local = self.cache.prefix_tiers(hashes)[:max_reuse]
        cost = 0.0
        for t in (1, 2):  # promote local lower-tier blocks to the GPU
            k = local.count(t)
            if k:
                cost += promote_ms(p, TIERS[t], k)
        return cost, len(local)

    def held_prefix(self, request: ChatRequest) -> int:
        """How many leading blocks of ``request`` this worker's cache holds now (any tier)."""
        return len(self.cache.prefix_tiers(int_list(request.block_hashes)))

    def probe(self, request: ChatRequest, now_ms: float, source: SimWorker | None = None) -> Probe:
        """The TTFT ``request`` would have if assigned here at ``now_ms``, from the worker's real state
        (the simulator's perfect-information reference, kvmesh.sim.oracle), reusing what this worker
        holds and, when it is faster, first pulling from ``source`` the blocks it holds past that.

        Exact when nothing changes before the request starts; it can be off when a queued prompt stores
        blocks a later one shares (the later one gets cheaper), when an eviction takes a block it
        counted, or when other requests join the queue while its pull is on the link.
        """
        p = self.real
        bs = p.block_size
        step = p.decode_ms_per_step
        t, batch = self._drain_ms(now_ms, self._kv_need(request))
        carried = step if batch else 0.0  # its own iteration carries a step of a running batch
        n_tok = len(request.token_ids)
        plan = self._prefill_plan(request)
        n = plan[1]
        own = self._prefill_cost(request, plan)[0]
        best = Probe(t + own + carried - now_ms, own, n)
        if source is None:
            return best
        hashes = int_list(request.block_hashes)
        lower = [0, 0, 0]
        k = 0
        for h in hashes[n : reusable_blocks(n_tok, bs)]:
            tier = source.cache.tier_of(h)
            if tier is None:
                break
            lower[tier] += 1
            k += 1
        if not k:
            return best
        ready = max(now_ms, self._link_free) + pull_ms(p, k, source.real, lower[1], lower[2])
        if ready <= t:
            begin = t  # queued behind what is queued now
        elif batch:  # a decode-only run from t: the next step boundary after the pull lands
            begin = t + math.ceil((ready - t) / step) * step
        else:
            begin = ready
        own_f = self._prefill_cost(request, plan, fetched=k)[0]
        ttft = begin + own_f + carried - now_ms
        return Probe(ttft, own_f, n, k) if ttft < best.ttft_ms else best

    def _drain_ms(self, now_ms: float, need: int = 0) -> tuple[float, bool]:
        """When a prefill assigned now could start (after the iteration in flight, or the decode step
        in flight, and every queued prefill, each carrying a step of the running batch), and whether a
        batch decodes by then. With KV capacity, a prefill whose blocks (``need`` for the one assigned
        now) do not fit waits for decode steps until enough running requests end; the blocks a running
        request frees are those it holds alone now, so shared prompt blocks make this an upper bound. With
        async loads a job still copying its prefix is counted first in line, as it is once its copy
        ends; a prefill that would run during the copy is estimated behind it (also an upper bound)."""
        step = self.real.decode_ms_per_step
        t = now_ms
        if now_ms < self.busy_until:
            if self._run_steps:  # a decode-only run is cut at the next step boundary (see _wake)
                t = self._run_start + (int((now_ms - self._run_start) // step) + 1) * step
            else:
                t = self.busy_until
        batch = bool(self._decoding) or (self._prefilling is not None and now_ms < self.busy_until)
        if not self._kv_capacity:
            for job in (*self._loading, *self._queue):
                t += self._queued_iteration_ms(job)
                t += step if batch else 0.0
                batch = True  # once a prompt is prefilled it decodes beside every later prefill
            return t, batch
        cap = self.real.gpu_blocks
        used = self.kv_used()
        running = [[j.remaining, self._kv_frees(j)] for j in self._decoding]  # steps left, frees
        if self._prefilling is not None:
            j = self._prefilling
            running.append([j.request.max_tokens - 1, self._kv_frees(j)])

        def steps(k: int) -> int:  # run every running request k steps; the blocks the ended free
            nonlocal running
            freed = sum(r[1] for r in running if r[0] <= k)
            running = [[r[0] - k, r[1]] for r in running if r[0] > k]
            return freed

        # None: the prefill assigned now; a loading job (copying, its blocks taken) comes back first
        queued: list[Job | None] = [*self._loading, *self._queue, None]
        for q in queued:
            taken = q is not None and (q.loading or q.loaded)  # its blocks are counted in used
            n = need if q is None else 0 if taken else self._kv_need(q.request)
            while running and used + n > cap:  # a decode-only run until the next request ends
                k = min(r[0] for r in running)
                t += k * step
                used -= steps(k)
            if q is None:
                break
            t += self._queued_iteration_ms(q)
            if running:
                t += step
                used -= steps(1)
            used += n
            if q.request.max_tokens > 1:
                running.append([q.request.max_tokens - 1, self._kv_frees(q) if taken else n])
        return t, bool(running)

    def _queued_iteration_ms(self, job: Job) -> float:
        """The prefill iteration a queued ``job`` will take here: with async loads its prefix is
        copied to the GPU tier off the iteration, so only the recompute is in it."""
        total, rec = self._prefill_cost(job.request, self._prefill_plan(job.request))
        return rec if self._load == "async" else total

    def _kv_frees(self, job: Job) -> int:
        """The GPU blocks ``job``'s end would free now: its own and the prompt blocks no other running
        request shares."""
        return job.kv_alone + self._kv_private(job)

    def _finish_prefill(self, job: Job, now_ms: float) -> None:
        req = job.request
        hashes = int_list(req.block_hashes)
        parents = [0, *hashes[:-1]] if hashes else []
        self._store(hashes, parents, job, now_ms)
        self._hold(job, [])  # read: its blocks are the most recent now
        job.first_token_ms = now_ms
        job.remaining = req.max_tokens - 1
        job.fetch = []
        if job.remaining <= 0:
            self._complete(job, now_ms)
        else:
            self._active_tokens += job.prompt_tokens + req.max_tokens
            self._decoding.append(job)

    def _store(self, hashes: list[int], parents: list[int], job: Job, now_ms: float) -> None:
        self._publish(self.cache.access(hashes, parents), job, now_ms)

    def _publish(self, runs: list[EventRun], job: Job, now_ms: float) -> None:
        t = int(now_ms)
        sid = job.request.session_id
        for r in runs:
            # as the live engine: the session is named on the blocks its prefill stored
            session = sid if r.kind == "stored" else None
            # r.kind is one of KvEvent's kinds (stored, moved, removed): the ignore below
            ev = KvEvent(self.worker_id, r.kind, r.tier, r.hashes, r.parents, r.from_tier, session, t)  # type: ignore[arg-type]
            self._emit(ev, now_ms)

    # -------------------------------------------------------------------------------- KV capacity

    def _kv_private(self, job: Job) -> int:
        """GPU blocks ``job`` holds beside its full prompt blocks: the prompt's partial last block
        and the tokens it has generated (a prefilling job: none yet)."""
        produced = job.request.max_tokens - job.remaining if job.first_token_ms >= 0 else 0
        return max(-(-(job.kv_tokens + produced) // self.real.block_size) - job.kv_full, 0)

    def kv_used(self) -> int:
        """GPU blocks the running requests hold now (the prefill in flight included)."""
        used = len(self._kv_holders) + sum(self._kv_private(j) for j in self._decoding)
        used += sum(self._kv_private(j) for j in self._loading)
        if self._prefilling is not None:
            used += self._kv_private(self._prefilling)
        return used

    def _kv_need(self, request: ChatRequest) -> int:
        """GPU blocks a prefill of ``request`` would add to what the running requests hold."""
        holders = self._kv_holders
        shared = sum(1 for h in int_list(request.block_hashes) if h in holders)
        return -(-len(request.token_ids) // self.real.block_size) - shared

    def _fits(self, job: Job) -> bool:
        """Whether ``job``'s prefill can start: its blocks fit beside the running requests', or
        nothing runs (the live engine then fails a prompt larger than the tier; no trace has one, and
        running it keeps a what-if profile with a small GPU tier from stalling)."""
        if job.loaded or not self._kv_capacity or (not self._decoding and self._prefilling is None):
            return True
        return self.kv_used() + self._kv_need(job.request) <= self.real.gpu_blocks

    def _kv_room(self) -> tuple[int, list[tuple[int, int]]]:
        """What a LoadReport says of the GPU tier's room (kvmesh_core/kv_room.py): the blocks free
        for the next prompt after the queued ones, and when the running requests are expected to end
        and free theirs. Expected as a live engine expects it, from the typical output length here
        (before any request ended, from its own ``max_tokens``, as the live engines); not from the
        simulated request's real length, which no scheduler could know."""
        # the queued prompts whole, as the live engine counts its queue (not what they share)
        free = self.real.gpu_blocks - self.kv_used() - self._queued_blocks
        typical = self._outputs.mean
        running = [*self._decoding] + ([self._prefilling] if self._prefilling is not None else [])
        ends = []
        for j in running:
            # a prefilling request's first token comes with its prefill, not a decode step
            produced = j.request.max_tokens - j.remaining if j.first_token_ms >= 0 else 1
            left = j.request.max_tokens - produced if typical is None else round(typical) - produced
            ends.append((max(left, 1), self._kv_frees(j)))
        return free, kv_release(ends)

    def _kv_take(self, job: Job) -> None:
        """``job`` starts: it holds its full prompt blocks, some perhaps with other running jobs."""
        holders = self._kv_holders
        for h in int_list(job.request.block_hashes):
            held = holders.get(h)
            if held is None:
                holders[h] = [job]
                job.kv_alone += 1
            else:
                if len(held) == 1:
                    held[0].kv_alone -= 1
                held.append(job)

    def _kv_drop(self, job: Job) -> None:
        """``job`` ended: its prompt blocks are free unless another running job holds them."""
        holders = self._kv_holders
        for h in int_list(job.request.block_hashes):
            held = holders[h]
            for i, other in enumerate(held):
                if other is job:
                    del held[i]
                    break
            if not held:
                del holders[h]
            elif len(held) == 1:
                held[0].kv_alone += 1
        job.kv_alone = 0

    def _advance_decode(self, steps: int, now_ms: float) -> None:
        still: list[Job] = []
        for job in self._decoding:
            job.remaining -= steps
            if job.remaining <= 0:
                self._active_tokens -= job.prompt_tokens + job.request.max_tokens
                self._complete(job, now_ms)
            else:
                still.append(job)
        self._decoding = still

    def _complete(self, job: Job, now_ms: float) -> None:
        self._kv_drop(job)
        self._outputs.add(job.request.max_tokens)
        req = job.request
        self.finished.append(
            RequestRecord(
                self.index,
                job.arrival_ms,
                job.first_token_ms,
                now_ms,
                job.prompt_tokens,
                job.reused_tokens,
                job.fetched_tokens,
                job.recomputed_tokens,
                req.max_tokens,
                job.decided_ms,
                job.predicted_ms,
                req.request_id,
            )
        )
        self._emit(
            Completion(
                request_id=req.request_id,
                session_id=req.session_id,
                worker_id=self.worker_id,
                finish_reason="length",
                prompt_tokens=job.prompt_tokens,
                completion_tokens=req.max_tokens,
                reused_tokens=job.reused_tokens,
                fetched_tokens=job.fetched_tokens,
                recomputed_tokens=job.recomputed_tokens,
                ttft_ms=job.first_token_ms - job.arrival_ms,
                prefill_ms=job.prefill_ms,
                e2e_ms=now_ms - job.arrival_ms,
            ),
            now_ms,
        )
