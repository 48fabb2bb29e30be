"""Placement: hot prefixes get extra copies ahead of demand; multi-turn sessions get retain hints.

Demand is read from ChatRequests (``streams.topics.REQUESTS``) rather than from KvEvents or
Assignments: a ChatRequest carries the session id and every block hash of the prompt *before* any
worker acts, including the blocks that miss everywhere, so popularity is counted where it starts and
no worker's cache policy distorts it. (KvEvents only show what some worker already stored, and an
Assignment repeats the request once per decision.)

Hot prefix: because block hashes are chained, the hash of block ``k`` names the whole prefix
``0..k``. For every tracked leading block we count the distinct sessions that asked for it in the
sliding window (event time, ``arrival_ms``). Counts only shrink along a chain, so the hot blocks form
a tree of leading runs; its leaves are the hot prefixes::

    h0 ─ h1 ─ h2 ─ h3          sessions: h0=9 h1=9 h2=6 h3=2   (threshold 4)
               └── h3'                   h3'=4
    hot prefixes: (h0 h1 h2 h3')  and nothing deeper on the h3 branch: (h0 h1 h2) is not a leaf

Replication (:func:`plan_replication`, pure): for each hot prefix held in full by some worker, while
its copies (holders + pending commands) are below ``min(max_replicas, 1 + sessions // min_sessions)``,
the least loaded eligible worker is asked to pull the blocks it lacks from the least loaded holder,
as long as the byte budget (a token bucket on event time) lasts. Every block's copies stay at or
below ``max_replicas``. Ties break by worker id; the command id is derived from its inputs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from schemas.blocks import PUBLIC_NAMESPACE
from schemas.messages import ChatRequest, ReplicateCommand, RetainHint


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    window_ms: int = 10_000
    min_sessions: int = 4
    min_blocks: int = 1
    max_prefix_blocks: int = 64  # deeper blocks are never counted (bounds the work per request)
    max_replicas: int = 3
    bytes_per_s: float = 200e6
    burst_bytes: float = 64e6
    tier: str = "dram"
    pending_ms: int = 10_000
    min_free_blocks: int = 1
    retain_min_turns: int = 2
    retain_ms: int = 300_000
    session_ttl_ms: int = 600_000


@dataclass(frozen=True, slots=True)
class HotPrefix:
    """A leading run of blocks asked for by ``sessions`` distinct sessions in the window."""

    block_hashes: tuple[int, ...]
    sessions: int
    namespace: bytes


class BlockView(Protocol):
    """What placement reads of the directory (services.kvmanager.directory.Directory fits)."""

    def holders(self, block_hash: int) -> dict[str, str]: ...

    def copies(self, block_hash: int) -> int: ...

    def holders_of_run(self, block_hashes: Any) -> set[str]: ...


class HotPrefixTracker:
    """Sliding-window distinct-session counts per leading block.

    Owns: the window of (arrival_ms, session, leading hashes) entries, per block the count of window
    entries per session, each tracked block's parent and namespace. Invariant: ``_sessions[h]`` holds
    exactly the sessions with an entry in the window that contains ``h``.
    """

    def __init__(self, cfg: PlacementConfig) -> None:
        self.cfg = cfg
        self._window: deque[tuple[int, str, tuple[int, ...]]] = deque()
        self._sessions: dict[int, dict[str, int]] = {}
        self._parent: dict[int, int | None] = {}
        self._namespace: dict[int, bytes] = {}
        self.now_ms = 0

    def observe(self, req: ChatRequest) -> None:
        hashes = tuple(req.block_hashes[: self.cfg.max_prefix_blocks])
        self.now_ms = max(self.now_ms, req.arrival_ms)
        self._window.append((req.arrival_ms, req.session_id, hashes))
        parent: int | None = None
        for i, h in enumerate(hashes):
            per = self._sessions.get(h)
            if per is None:
                per = self._sessions[h] = {}
                self._parent[h] = parent
                end_token = (i + 1) * req.block_size
                public = end_token <= req.public_prefix_tokens
                self._namespace[h] = PUBLIC_NAMESPACE if public else req.namespace
            per[req.session_id] = per.get(req.session_id, 0) + 1
            parent = h
        self.expire(self.now_ms)

    def expire(self, now_ms: int) -> None:
        """Drop window entries older than ``window_ms`` before ``now_ms``."""
        horizon = now_ms - self.cfg.window_ms
        while self._window and self._window[0][0] <= horizon:
            _, session, hashes = self._window.popleft()
            for h in hashes:
                per = self._sessions[h]
                left = per[session] - 1
                if left:
                    per[session] = left
                else:
                    del per[session]
                    if not per:
                        del self._sessions[h]
                        del self._parent[h]
                        del self._namespace[h]

    def sessions(self, block_hash: int) -> int:
        return len(self._sessions.get(block_hash, ()))

    def hot(self) -> list[HotPrefix]:
        """Hot prefixes (leaves of the hot tree), most sessions first, then by leaf hash."""
        thr = self.cfg.min_sessions
        hot = {h for h, per in self._sessions.items() if len(per) >= thr}
        inner = {self._parent[h] for h in hot}
        out: list[HotPrefix] = []
        for leaf in hot - inner:
            chain: list[int] = []
            cur: int | None = leaf
            while cur is not None:
                chain.append(cur)
                cur = self._parent.get(cur)
            chain.reverse()
            if len(chain) >= self.cfg.min_blocks:
                out.append(HotPrefix(tuple(chain), len(self._sessions[leaf]), self._namespace[leaf]))
        out.sort(key=lambda p: (-p.sessions, -len(p.block_hashes), p.block_hashes[-1]))
        return out


@dataclass(slots=True)
class PendingReplication:
    target: str
    block_hashes: tuple[int, ...]
    issued_ms: int


@dataclass(slots=True)
class ByteBudget:
    """A token bucket on event time: ``rate`` bytes per second, at most ``burst`` saved up."""

    rate: float
    burst: float
    tokens: float = 0.0
    last_ms: int | None = None

    def refill(self, now_ms: int) -> float:
        if self.last_ms is None:
            self.tokens = self.burst
        elif now_ms > self.last_ms:
            self.tokens = min(self.burst, self.tokens + self.rate * (now_ms - self.last_ms) / 1000.0)
        self.last_ms = now_ms if self.last_ms is None else max(self.last_ms, now_ms)
        return self.tokens


def _load_key(worker: str, info: Mapping[str, Any]) -> tuple[int, int, int, str]:
    return (
        int(info.get("queued_prefill_tokens", 0)) + int(info.get("active_tokens", 0)),
        int(info.get("queue_depth", 0)),
        int(info.get("active_requests", 0)),
        worker,
    )


def _free_blocks(info: Mapping[str, Any], tier: str) -> int:
    free_total = info.get("tiers", {}).get(tier)
    return int(free_total[0]) if free_total else 0


@dataclass(slots=True)
class ReplicationPlan:
    commands: list[ReplicateCommand] = field(default_factory=list)
    bytes: int = 0


def plan_replication(
    hot: list[HotPrefix],
    view: BlockView,
    workers: Mapping[str, Mapping[str, Any]],
    pending: list[PendingReplication],
    budget_bytes: float,
    cfg: PlacementConfig,
    now_ms: int,
) -> ReplicationPlan:
    """Which worker pulls which hot blocks from whom, now. Pure: reads only its arguments.

    ``pending`` are commands issued earlier and not yet visible in the directory; they count as
    copies. Commands planned here count as pending for the rest of this plan too.
    """
    plan = ReplicationPlan()
    pending_per_block: dict[int, int] = {}
    pending_targets: dict[int, set[str]] = {}
    for p in pending:
        for h in p.block_hashes:
            pending_per_block[h] = pending_per_block.get(h, 0) + 1
        pending_targets.setdefault(p.block_hashes[-1], set()).add(p.target)
    left = budget_bytes
    for prefix in hot:
        chain = prefix.block_hashes
        leaf = chain[-1]
        holders = view.holders_of_run(chain)
        if not holders:
            continue  # nobody has the whole prefix yet: the scheduler will compute it somewhere
        live_holders = sorted((w for w in holders if w in workers), key=lambda w: _load_key(w, workers[w]))
        sources = [w for w in live_holders if workers[w].get("transfer_address")]
        if not sources:
            continue
        source = sources[0]
        block_bytes = int(workers[source].get("block_bytes", 0))
        targets_pending = pending_targets.setdefault(leaf, set())
        want = min(cfg.max_replicas, 1 + prefix.sessions // max(1, cfg.min_sessions))
        have = len(holders) + len(targets_pending - holders)
        candidates = sorted(
            (
                w
                for w, info in workers.items()
                if w not in holders
                and w not in targets_pending
                and not info.get("draining", False)
                and info.get("block_size") == workers[source].get("block_size")
            ),
            key=lambda w: _load_key(w, workers[w]),
        )
        for target in candidates:
            if have >= want:
                break
            missing = [h for h in chain if target not in view.holders(h)]
            if not missing:
                continue
            if any(view.copies(h) + pending_per_block.get(h, 0) >= cfg.max_replicas for h in missing):
                continue  # some block of the run already has all the copies it may have
            if _free_blocks(workers[target], cfg.tier) < len(missing) + cfg.min_free_blocks:
                continue
            cost = len(missing) * block_bytes
            if cost > left:
                return plan  # budget spent: stop here so the order of issue stays deterministic
            left -= cost
            plan.bytes += cost
            plan.commands.append(
                ReplicateCommand(
                    command_id=f"rep:{target}:{leaf:016x}:{now_ms}",
                    target_worker=target,
                    source_worker=source,
                    source_address=str(workers[source]["transfer_address"]),
                    block_hashes=missing,
                    namespace=prefix.namespace,
                    tier=cfg.tier,
                )
            )
            for h in missing:
                pending_per_block[h] = pending_per_block.get(h, 0) + 1
            targets_pending.add(target)
            have += 1
    return plan


class SessionTracker:
    """Turns per session (distinct request ids) with a TTL on event time.

    Owns: per session the request ids seen and the last arrival. Sessions idle for ``session_ttl_ms``
    are forgotten (insertion order of the dict is last-touch order, so expiry pops from the front).
    """

    def __init__(self, cfg: PlacementConfig) -> None:
        self.cfg = cfg
        self._turns: dict[str, tuple[set[str], int]] = {}

    def observe(self, req: ChatRequest) -> int:
        """Record a turn; returns how many distinct turns the session has had."""
        ids, _ = self._turns.pop(req.session_id, (set(), 0))
        ids.add(req.request_id)
        self._turns[req.session_id] = (ids, req.arrival_ms)
        horizon = req.arrival_ms - self.cfg.session_ttl_ms
        while self._turns:
            first = next(iter(self._turns))
            if self._turns[first][1] > horizon:
                break
            del self._turns[first]
        return len(ids)


def retain_hints(req: ChatRequest, turns: int, view: BlockView, cfg: PlacementConfig) -> list[RetainHint]:
    """Retain hints for a request of a returning session (pure).

    Each worker holding a leading run of the request's blocks is asked to keep that run (in a lower
    tier rather than dropping it) until ``arrival_ms + retain_ms``; by worker id.
    """
    if turns < cfg.retain_min_turns or not req.block_hashes:
        return []
    runs: dict[str, list[int]] = {}
    alive: set[str] | None = None
    for h in req.block_hashes:
        here = set(view.holders(h))
        alive = here if alive is None else alive & here
        if not alive:
            break
        for w in alive:
            runs.setdefault(w, []).append(h)
    return [
        RetainHint(
            worker_id=w,
            session_id=req.session_id,
            block_hashes=runs[w],
            until_ms=req.arrival_ms + cfg.retain_ms,
        )
        for w in sorted(runs)
    ]


class PlacementEngine:
    """The placement state of the manager: hot-prefix window, sessions, pending commands, byte budget.

    Driven only by message fields: :meth:`on_request` for each ChatRequest, :meth:`plan` with the
    latest event time. Same inputs in the same order give the same commands.
    """

    def __init__(self, cfg: PlacementConfig) -> None:
        self.cfg = cfg
        self.tracker = HotPrefixTracker(cfg)
        self.sessions = SessionTracker(cfg)
        self.pending: list[PendingReplication] = []
        self.budget = ByteBudget(cfg.bytes_per_s, cfg.burst_bytes)
        self.issued = 0

    def on_request(self, req: ChatRequest, view: BlockView) -> list[RetainHint]:
        self.tracker.observe(req)
        return retain_hints(req, self.sessions.observe(req), view, self.cfg)

    def wanted_hashes(self, now_ms: int) -> list[int]:
        """Every block :meth:`plan` may look up at ``now_ms``: the hot chains' and the pending
        commands' (a leader replica fetches the holders of these from the shards it does not own)."""
        self.tracker.expire(now_ms)
        out: dict[int, None] = {}
        for prefix in self.tracker.hot():
            out.update(dict.fromkeys(prefix.block_hashes))
        for p in self.pending:
            out.update(dict.fromkeys(p.block_hashes))
        return list(out)

    def plan(
        self, now_ms: int, view: BlockView, workers: Mapping[str, Mapping[str, Any]]
    ) -> list[ReplicateCommand]:
        self.tracker.expire(now_ms)
        self.pending = [
            p
            for p in self.pending
            if now_ms - p.issued_ms < self.cfg.pending_ms
            and p.target in workers
            and p.target not in view.holders_of_run(p.block_hashes)
        ]
        budget = self.budget.refill(now_ms)
        result = plan_replication(self.tracker.hot(), view, workers, self.pending, budget, self.cfg, now_ms)
        self.budget.tokens -= result.bytes
        for cmd in result.commands:
            self.pending.append(PendingReplication(cmd.target_worker, tuple(cmd.block_hashes), now_ms))
        self.issued += len(result.commands)
        return result.commands
