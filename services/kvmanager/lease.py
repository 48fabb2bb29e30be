"""The KV-manager replicas' leader lease in Redis: who runs liveness and placement.

Every replica applies its own shards; exactly one (the lease holder) also publishes WorkerLost,
plans hot-prefix replication and writes the fleet slice. The lease is one key set with ``NX PX``
and kept alive by its holder (a script renews it only if the value is still the holder's id)::

    replica ──every ttl/3: renew-or-acquire──▶ {kvm.lease}:kvmanager = manager_id (PX ttl)

A replica counts itself leader only until ``ttl`` after its last successful renewal *started*
(measured on its own clock), so when Redis is unreachable it steps down before another replica can
take the key over: two replicas never both act as leader for longer than clock drift allows. A
stopped replica releases the key at once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import redis.asyncio as aioredis

from services.fleet_directory.layout import LEASE_KEY, REDIS_DOWN_ERRORS

log = logging.getLogger(__name__)

#: 1: held by us and renewed; 2: taken now (the key was free); 0: held by another replica.
_RENEW_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if not cur then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 2 end
return 0
"""

_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaderLease:
    """One replica's view of the lease: whether it holds it, and until when it may act on it."""

    def __init__(self, holder: str, ttl_ms: int, clock: Callable[[], int], key: str = LEASE_KEY) -> None:
        if ttl_ms <= 0:
            raise ValueError("ttl_ms must be positive")
        self.holder = holder
        self.ttl_ms = ttl_ms
        self.clock = clock
        self.key = key
        self._valid_until = 0
        self._next_try = 0
        self.changes = 0  # times this replica became leader

    def held(self) -> bool:
        """Whether this replica may act as leader now."""
        return self.clock() < self._valid_until

    async def tick(self, client: aioredis.Redis) -> bool:
        """Renew (or try to take) the lease when due; returns True if this replica became leader now:
        also when it thought it held the lease but found the key gone (Redis restarted empty, so what
        the leader wrote is gone too and must be written again)."""
        now = self.clock()
        if now < self._next_try:
            return False
        self._next_try = now + max(1, self.ttl_ms // 3)
        was = self.held()
        try:
            got = int(await client.eval(_RENEW_LUA, 1, self.key, self.holder, str(self.ttl_ms)))
        except REDIS_DOWN_ERRORS as exc:
            log.debug("lease renewal failed: %s", exc)
            return False  # held() runs out on its own
        if got:
            self._valid_until = now + self.ttl_ms
        else:
            self._valid_until = 0
            if was:
                log.warning("%s lost the KV-manager leader lease", self.holder)
        became = got == 2 or (got == 1 and not was)
        if became:
            self.changes += 1
            log.info("%s is the KV-manager leader (liveness, placement, fleet slice)", self.holder)
        return became

    def step_down(self) -> None:
        """Stop acting as leader at once (the fleet slice was taken by another writer)."""
        self._valid_until = 0

    async def release(self, client: aioredis.Redis) -> None:
        self._valid_until = 0
        with contextlib.suppress(*REDIS_DOWN_ERRORS):  # else it expires by itself
            await client.eval(_RELEASE_LUA, 1, self.key, self.holder)
