"""One view of a vLLM worker's blocks for the fleet: vLLM's GPU copies and the connector's lower tiers.

A vLLM worker with the kvmesh connector holds a block in up to two places at once: vLLM's own pool
(reported by vLLM's KV events, tier ``gpu``) and the connector's store (DRAM or disk, write-through:
every block vLLM computes is saved below it). The fleet's index keeps one tier per (block, worker), the
best one, so the two streams are merged::

    in vLLM  in store   the fleet sees      on a change the merger emits
    yes      any        gpu                 vLLM drops it, store has it → moved gpu→dram (or disk)
    no       dram/disk  dram/disk           vLLM drops it, store has not → removed
    no       no         (nothing)           store drops it while vLLM holds it → nothing

A block the fleet sees on this worker is therefore always somewhere this worker can read it: in vLLM's
pool for reuse in place, or in the store for the connector to load and for peers to fetch.
"""

from __future__ import annotations

from collections.abc import Iterable

from schemas.messages import KvEvent


class TierView:
    """Owns the per-block place (gpu flag, lower tier) and turns both sources' changes into KvEvents."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._gpu: dict[int, int] = {}  # hash → parent, blocks in vLLM's pool
        self._lower: dict[int, tuple[str, int]] = {}  # hash → (tier, parent), blocks in the store
        self._out: list[KvEvent] = []

    # ---- what the fleet sees ------------------------------------------------------------------
    def tier_of(self, h: int) -> str | None:
        if h in self._gpu:
            return "gpu"
        low = self._lower.get(h)
        return low[0] if low else None

    def holds(self, h: int) -> bool:
        return h in self._gpu or h in self._lower

    def prefix_length(self, hashes: Iterable[int]) -> int:
        n = 0
        for h in hashes:
            if not self.holds(h):
                break
            n += 1
        return n

    def held(self) -> list[tuple[int, int, str]]:
        """(hash, parent, best tier) of every held block."""
        out = [(h, p, "gpu") for h, p in self._gpu.items()]
        out += [(h, p, t) for h, (t, p) in self._lower.items() if h not in self._gpu]
        return out

    # ---- changes ------------------------------------------------------------------------------
    def gpu_stored(self, hashes: list[int], parents: list[int]) -> None:
        new = [(h, p) for h, p in zip(hashes, parents, strict=True) if h not in self._gpu]
        for h, p in new:
            self._gpu[h] = p
        fresh = [(h, p) for h, p in new if h not in self._lower]
        moved = [(h, p) for h, p in new if h in self._lower]
        if fresh:
            self._emit("stored", "gpu", fresh)
        for tier in ("dram", "disk"):
            up = [(h, p) for h, p in moved if self._lower[h][0] == tier]
            if up:
                self._emit("moved", "gpu", up, from_tier=tier)

    def gpu_removed(self, hashes: list[int]) -> None:
        gone: list[tuple[int, int]] = []
        down: dict[str, list[tuple[int, int]]] = {}
        for h in hashes:
            p = self._gpu.pop(h, None)
            if p is None:
                continue
            low = self._lower.get(h)
            if low is None:
                gone.append((h, p))
            else:
                down.setdefault(low[0], []).append((h, p))
        if gone:
            self._emit("removed", "gpu", gone)
        for tier, blocks in down.items():
            self._emit("moved", tier, blocks, from_tier="gpu")

    def gpu_cleared(self) -> None:
        """vLLM dropped its whole pool: blocks only there are gone, the store's stay."""
        self.gpu_removed(list(self._gpu))

    def lower_event(self, ev: KvEvent) -> None:
        """Apply one event of the connector's store (stored / moved / removed in dram or disk)."""
        parents = list(ev.parent_hashes) or [0] * len(ev.block_hashes)
        pairs = list(zip(ev.block_hashes, parents, strict=True))
        if ev.kind == "stored":
            for h, p in pairs:
                self._lower[h] = (ev.tier, p)
            visible = [(h, p) for h, p in pairs if h not in self._gpu]
            if visible:
                self._emit("stored", ev.tier, visible)
        elif ev.kind == "moved":
            for h, p in pairs:
                self._lower[h] = (ev.tier, p)
            visible = [(h, p) for h, p in pairs if h not in self._gpu]
            if visible:
                self._emit("moved", ev.tier, visible, from_tier=ev.from_tier)
        elif ev.kind == "removed":
            visible = []
            for h, p in pairs:
                if self._lower.pop(h, None) is not None and h not in self._gpu:
                    visible.append((h, p))
            if visible:
                self._emit("removed", ev.tier, visible)
        elif ev.kind == "cleared":
            self.lower_event(
                KvEvent(
                    worker_id=self.worker_id,
                    kind="removed",
                    tier="dram",
                    block_hashes=list(self._lower),
                    parent_hashes=[p for _, p in self._lower.values()],
                )
            )

    def reset(self) -> None:
        """Forget everything (the caller announces ``cleared``)."""
        self._gpu.clear()
        self._lower.clear()
        self._out.clear()

    def drain(self) -> list[KvEvent]:
        out, self._out = self._out, []
        return out

    def _emit(
        self, kind: str, tier: str, blocks: list[tuple[int, int]], from_tier: str | None = None
    ) -> None:
        self._out.append(
            KvEvent(
                worker_id=self.worker_id,
                kind=kind,  # type: ignore[arg-type]  # stored / moved / removed, KvEvent's kinds
                tier=tier,
                block_hashes=[h for h, _ in blocks],
                parent_hashes=[p for _, p in blocks],
                from_tier=from_tier,
            )
        )
