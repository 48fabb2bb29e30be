"""Held requests survive a replica's crash: commit only what was decided, and mark what was.

A replica commits its position in the requests topic after every batch. Requests it holds (deferred:
the fleet overloaded, no live worker) are not decided yet, so committing past them would lose them if
the replica died. So, per partition, the commit stops at the oldest request still held
(:meth:`HeldPositions.commit_limits`); a replica that takes the partition over reads again from there.

What it reads again includes requests decided after the held one. While anything is held, every
decision is therefore also marked in Redis (``kvmesh:sched:decided:<request id>``, expiring with the
request's deadline), and a replica skips a request read again whose mark exists
(:class:`DecidedMarks`). While nothing is held the commit covers every decision and no mark is
written: the common path costs nothing. A mark that could not be written (Redis away) costs at most a
request decided twice, which the worker's idempotence absorbs when the same worker is chosen.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

MARK_PREFIX = "kvmesh:sched:decided:"
#: A mark without a deadline to expire with lives this long.
DEFAULT_MARK_TTL_MS = 3600 * 1000


class HeldPositions:
    """request id -> (partition, offset) of every request read from the requests topic and not yet
    decided. Pure; the service feeds it."""

    def __init__(self) -> None:
        self._pos: dict[str, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._pos)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._pos

    def read(self, request_id: str, partition: int, offset: int) -> None:
        self._pos[request_id] = (partition, offset)

    def done(self, request_id: str) -> None:
        self._pos.pop(request_id, None)

    def commit_limits(self) -> dict[int, int]:
        """Per partition, the offset a commit must not pass: the oldest request still held."""
        out: dict[int, int] = {}
        for part, off in self._pos.values():
            if off < out.get(part, off + 1):
                out[part] = off
        return out


class DecidedMarks:
    """The Redis marks of decided requests (see the module doc). Every call is bounded by the client's
    timeouts and never raises: without Redis, marks are simply absent."""

    def __init__(self, redis: Any | None) -> None:
        self.redis = redis
        self.written = 0
        self.skipped = 0
        self._warned = False

    async def mark(self, decided: list[tuple[str, int | None]], now_ms: int) -> None:
        """Mark ``(request id, deadline ms)`` pairs as decided."""
        if self.redis is None or not decided:
            return
        try:
            pipe = self.redis.pipeline(transaction=False)
            for rid, deadline in decided:
                ttl = DEFAULT_MARK_TTL_MS if deadline is None else max(deadline - now_ms, 1000)
                pipe.set(MARK_PREFIX + rid, b"1", px=ttl)
            await pipe.execute()
            self.written += len(decided)
        except Exception as exc:
            self._warn(exc)

    async def already_decided(self, request_ids: list[str]) -> set[str]:
        """Which of ``request_ids`` a replica decided before (read again after a crash)."""
        if self.redis is None or not request_ids:
            return set()
        try:
            keys = [MARK_PREFIX + rid for rid in request_ids]
            # marks spread over a cluster's slots (no hash tag: they are many and short-lived); a
            # cluster client reads them per slot, a plain one in one MGET
            nonatomic = getattr(self.redis, "mget_nonatomic", None)
            values = await (nonatomic(keys) if nonatomic is not None else self.redis.mget(keys))
        except Exception as exc:
            self._warn(exc)
            return set()
        found = {rid for rid, v in zip(request_ids, values, strict=True) if v is not None}
        self.skipped += len(found)
        return found

    def _warn(self, exc: BaseException) -> None:
        if not self._warned:
            log.warning("decided-request marks unavailable (%s): a crash may decide a request twice", exc)
            self._warned = True
