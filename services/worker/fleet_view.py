"""What one worker knows of the rest of the fleet's KV cache: how many OTHER workers hold each block.

Fed from ``kvmesh.kv-events`` of the whole fleet and ``WorkerLost`` on ``kvmesh.control`` (the worker
reads both with no group, from their end at start); read by the eviction policy of
:class:`~services.worker.kv_cache_manager.KvCacheManager` through ``set_fleet_copies(view.copies)``::

    KvEvent(stored|moved, W, hashes) ──▶ W's set += hashes ──▶ copies[h] += 1 for each new member
    KvEvent(removed, W, hashes)      ──▶ W's set -= hashes ──▶ copies[h] -= 1
    KvEvent(cleared, W) / WorkerLost(W) ──▶ W's whole set dropped

kv-events and control are different topics, so a WorkerLost can be read *after* the re-announce it
triggered (the lost worker, alive after all, publishes its holdings again). A WorkerLost is therefore
ignored when an event of that worker stamped after ``declared_ms`` was already applied: the worker
was alive after the declaration and its events since are the truth. (Envelope times are the
producers' clocks; a worker whose clock runs ahead of the KV manager's by more than the time between
its last event and the declaration could keep its copies counted here until its next WorkerLost.)

Errors only ever go one way: the view may *under*-count copies (it starts empty, it misses what was
stored before the worker started, it refuses entries past its bound), never over-count them, because
a count only rises on a stored/moved event of a named worker and falls on that worker's removal. An
under-count makes the worker keep a block it could have dropped (demote to disk); an over-count
would drop a last copy. So a cold or full view is safe, merely less thrifty.

Memory bound: at most ``max_entries`` (worker, block) pairs are tracked. Each pair costs one set
member plus, for the first holder of a block, one dict entry: about 110 bytes with 64-bit hashes
(CPython 3.11), so the default 500 000 pairs stay under ~60 MB. Past the bound new pairs are refused
(and counted in ``refused``) until removals make room.

Thread safety: updates run on the event loop; :meth:`copies` is called from the engine thread under
the cache manager's lock. It only does one ``dict.get``, which the GIL makes atomic.
"""

from __future__ import annotations

import logging

from schemas.messages import KvEvent
from schemas.token_ids import int_list

log = logging.getLogger(__name__)

#: Default bound on tracked (worker, block) pairs; see the module docstring for the memory it means.
DEFAULT_MAX_ENTRIES = 500_000


class FleetCopies:
    """Owns, for every other worker, the set of block hashes its KvEvents say it holds, and per block
    the number of those workers. Invariant: ``_copies[h] == |{w : h in _held[w]}|`` and no zero
    counts are stored; ``_entries`` is the sum of the set sizes and never exceeds ``max_entries``."""

    def __init__(self, self_id: str, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.self_id = self_id
        self.max_entries = max(0, max_entries)
        self._held: dict[str, set[int]] = {}
        self._copies: dict[int, int] = {}
        self._entries = 0
        self._last_event_ms: dict[str, int] = {}  # per worker, the newest envelope time applied
        self.refused = 0
        self._warned = False

    def copies(self, block_hash: int) -> int:
        """How many other workers hold ``block_hash`` as far as this view knows (0 when unknown)."""
        return self._copies.get(block_hash, 0)

    def __len__(self) -> int:
        """Tracked (worker, block) pairs."""
        return self._entries

    def workers(self) -> list[str]:
        return sorted(self._held)

    def apply(self, ev: KvEvent, event_ms: int = 0) -> None:
        """Apply one KvEvent of any worker (``event_ms``: its envelope time); our own are ignored."""
        w = ev.worker_id
        if w == self.self_id:
            return
        if event_ms > self._last_event_ms.get(w, 0):
            self._last_event_ms[w] = event_ms
        if ev.kind == "cleared":
            self.drop_worker(w)
        elif ev.kind in ("stored", "moved"):
            # A move is still a copy on that worker; it also teaches us of blocks stored before we
            # started listening.
            self._add(w, int_list(ev.block_hashes))
        elif ev.kind == "removed":
            self._remove(w, int_list(ev.block_hashes))

    def worker_lost(self, worker_id: str, declared_ms: int) -> int:
        """A WorkerLost: drop the worker's copies unless it published after ``declared_ms``."""
        if self._last_event_ms.get(worker_id, 0) > declared_ms:
            return 0
        return self.drop_worker(worker_id)

    def drop_worker(self, worker_id: str) -> int:
        """Forget every copy of ``worker_id`` (cleared, or declared lost); returns how many."""
        held = self._held.pop(worker_id, None)
        if not held:
            return 0
        copies = self._copies
        for h in held:
            n = copies[h] - 1
            if n:
                copies[h] = n
            else:
                del copies[h]
        self._entries -= len(held)
        return len(held)

    def _add(self, worker: str, hashes: list[int]) -> None:
        held = self._held.get(worker)
        if held is None:
            held = self._held[worker] = set()
        copies = self._copies
        for h in hashes:
            if h in held:
                continue
            if self._entries >= self.max_entries:
                self.refused += 1
                if not self._warned:
                    log.warning(
                        "fleet view full (%d entries): further copies elsewhere are not tracked",
                        self.max_entries,
                    )
                    self._warned = True
                continue
            held.add(h)
            copies[h] = copies.get(h, 0) + 1
            self._entries += 1

    def _remove(self, worker: str, hashes: list[int]) -> None:
        held = self._held.get(worker)
        if not held:
            return
        copies = self._copies
        for h in hashes:
            if h not in held:
                continue  # stored before we listened (or refused): never counted
            held.discard(h)
            n = copies[h] - 1
            if n:
                copies[h] = n
            else:
                del copies[h]
            self._entries -= 1
        if not held:
            del self._held[worker]
        if self._warned and self._entries < self.max_entries:
            self._warned = False
