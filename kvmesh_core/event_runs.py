"""KV-cache changes merged into runs, the way a worker publishes them: consecutive changes of the same
kind, tier, source tier and session become one KvEvent. The live KvCacheManager and the simulator's
cache both record through it, so both publish the same events for the same changes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class EventRun:
    """One run: ``hashes[i]``'s parent is ``parents[i]`` (0 for a prompt's first block)."""

    kind: str  # stored | moved | removed
    tier: str
    from_tier: str | None = None
    session_id: str | None = None
    hashes: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)


class EventRuns:
    """Owns the runs recorded since the last :meth:`drain`."""

    __slots__ = ("runs",)

    def __init__(self) -> None:
        self.runs: list[EventRun] = []

    def add(
        self,
        kind: str,
        tier: str,
        h: int,
        parent: int,
        from_tier: str | None = None,
        session_id: str | None = None,
    ) -> None:
        last = self.runs[-1] if self.runs else None
        if (
            last is not None
            and last.kind == kind
            and last.tier == tier
            and last.from_tier == from_tier
            and last.session_id == session_id
        ):
            last.hashes.append(h)
            last.parents.append(parent)
        else:
            self.runs.append(EventRun(kind, tier, from_tier, session_id, [h], [parent]))

    def drain(self) -> list[EventRun]:
        out, self.runs = self.runs, []
        return out

    def __len__(self) -> int:
        return len(self.runs)
