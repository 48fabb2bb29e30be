"""The simulator's cache keeps what the live worker's KvCacheManager keeps.

The same access sequences (prompts that share prefixes, as conversations do) go to the live cache, as
the built-in engine drives it (reuse the leading held run, allocate and commit the rest, release), and
to the simulator's TieredCache. After every access both hold the same blocks in the same tiers: the
same victims were chosen, the same demotions and drops made, and both announce them with the same
KvEvents. With a fleet (blocks other workers hold are evicted first, and dropped from DRAM rather than
kept on disk) too, and with a pulled prompt's blocks held until that prompt is next accessed
(``KvCacheManager.hold`` live, ``TieredCache.pin`` simulated: evicted only when nothing else can go).
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.sim.cache import FleetHolders, TieredCache
from services.worker.kv_cache_manager import KvCacheManager
from services.worker.kv_layout import BlockLayout

LAYOUT = BlockLayout(layers=1, kv_heads=1, block_size=4, head_dim=2, dtype="float32")
NS = b"t"

#: A prompt (document, length in blocks, pulled from a peer?); block i of document d is hash
#: d*100 + i + 1, chained. A pulled prompt's blocks are inserted into DRAM, as a fetch commits them.
prompts = st.lists(
    st.tuples(st.integers(0, 5), st.integers(1, 5), st.sampled_from([False, False, False, True])),
    min_size=1,
    max_size=40,
)


def _chain(doc: int, n: int) -> tuple[list[int], list[int]]:
    hashes = [doc * 100 + i + 1 for i in range(n)]
    return hashes, [0, *hashes[:-1]]


def _live_access(kv: KvCacheManager, hashes: list[int], parents: list[int]) -> None:
    """What the built-in engine does for one prompt whose every block ends up computed or reused."""
    hit = kv.acquire_prefix(hashes)
    got = len(hit.block_ids)
    own = kv.allocate(len(hashes) - got)
    assert own is not None
    for b, h, p in zip(own, hashes[got:], parents[got:], strict=True):
        kv.commit_computed(b, h, p, NS)
    kv.release(hit.block_ids + own)


def _live_fetch(kv: KvCacheManager, hashes: list[int], parents: list[int]) -> None:
    data = bytes(LAYOUT.nbytes)
    kv.commit_blocks([(h, p, data) for h, p in zip(hashes, parents, strict=True)], NS, tier="dram")


def _tiers_live(kv: KvCacheManager) -> dict[str, set[int]]:
    return {t: set(hs) for t, hs in kv.held_hashes().items()}


def _tiers_sim(c: TieredCache, held: list[int]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {"gpu": set(), "dram": set(), "disk": set()}
    names = ("gpu", "dram", "disk")
    for h in held:
        t = c.tier_of(h)
        if t is not None:
            out[names[t]].add(h)
    return out


def _run(
    tmp: Path,
    seq: list[tuple[int, int, bool]],
    caps: tuple[int, int, int],
    elsewhere: set[int] | None,
    holds: bool = False,
) -> None:
    kv = KvCacheManager(LAYOUT, *caps, disk_dir=tmp, worker_id="w-live")
    fleet = None
    if elsewhere is not None:
        kv.set_fleet_copies(lambda h: 1 if h in elsewhere else 0)
        fleet = FleetHolders()
        for h in elsewhere:
            fleet.add(h)  # another worker's copy
    sim = TieredCache(*caps, fleet=fleet)
    universe = [d * 100 + i + 1 for d in range(6) for i in range(5)]
    pins: dict[int, list[int]] = {}  # the simulated hold of each document's pulled prompt
    try:
        for step, (doc, n, pulled) in enumerate(seq):
            hashes, parents = _chain(doc, n)
            if pulled:
                _live_fetch(kv, hashes, parents)
                sim_runs = sim.insert(hashes, parents, 1)
                if holds:  # held for the prompt that pulled it, until that prompt runs
                    kv.hold(f"d{doc}", hashes)
                    sim.unpin(pins.pop(doc, []))
                    pins[doc] = hashes[: len(sim.prefix_tiers(hashes))]
                    sim.pin(pins[doc])
            else:
                _live_access(kv, hashes, parents)
                sim_runs = sim.access(hashes, parents)
                if holds:
                    kv.unhold(f"d{doc}")
                    sim.unpin(pins.pop(doc, []))
            where = f"after step {step}: {(doc, n, pulled)}"
            assert _tiers_live(kv) == _tiers_sim(sim, universe), where
            # and they announce it with the same KvEvents, run by run
            live_events = [
                (e.kind, e.tier, e.from_tier, list(e.block_hashes), list(e.parent_hashes))
                for e in kv.drain_kv_events()
            ]
            assert live_events == [(r.kind, r.tier, r.from_tier, r.hashes, r.parents) for r in sim_runs], (
                where
            )
    finally:
        kv.close()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq=prompts, disk=st.sampled_from([0, 3]))
def test_same_blocks_in_the_same_tiers(tmp_path: Path, seq: list[tuple[int, int, bool]], disk: int) -> None:
    _run(tmp_path, seq, (6, 4, disk), None)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq=prompts, elsewhere=st.sets(st.sampled_from([d * 100 + i + 1 for d in range(6) for i in range(5)])))
def test_same_victims_with_a_fleet(
    tmp_path: Path, seq: list[tuple[int, int, bool]], elsewhere: set[int]
) -> None:
    _run(tmp_path, seq, (6, 4, 3), elsewhere)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq=prompts, elsewhere=st.sets(st.sampled_from([d * 100 + i + 1 for d in range(6) for i in range(5)])))
def test_same_victims_with_pulled_prompts_held(
    tmp_path: Path, seq: list[tuple[int, int, bool]], elsewhere: set[int]
) -> None:
    _run(tmp_path, seq, (6, 4, 3), elsewhere, holds=True)
