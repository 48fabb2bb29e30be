"""One view of a vLLM worker's blocks: vLLM's GPU copies and the connector's store, as the fleet sees them."""

from __future__ import annotations

from schemas.messages import KvEvent
from services.worker.vllm_engine.tier_view import TierView


def _ev(kind: str, tier: str, hashes: list[int], from_tier: str | None = None) -> KvEvent:
    return KvEvent(
        worker_id="w",
        kind=kind,  # type: ignore[arg-type]
        tier=tier,
        block_hashes=hashes,
        parent_hashes=[h - 1 for h in hashes],
        from_tier=from_tier,
    )


def _seen(view: TierView) -> list[tuple[str, str, str | None, list[int]]]:
    return [(e.kind, e.tier, e.from_tier, list(e.block_hashes)) for e in view.drain()]


def test_saved_then_stored_in_gpu_is_one_block_in_its_best_tier() -> None:
    v = TierView("w")
    v.lower_event(_ev("stored", "dram", [1, 2]))
    v.gpu_stored([1, 2], [0, 1])
    assert _seen(v) == [("stored", "dram", None, [1, 2]), ("moved", "gpu", "dram", [1, 2])]
    assert v.tier_of(1) == "gpu" and v.prefix_length([1, 2, 3]) == 2


def test_vllm_evicting_a_saved_block_moves_it_down_not_away() -> None:
    v = TierView("w")
    v.gpu_stored([1, 2, 3], [0, 1, 2])
    v.lower_event(_ev("stored", "dram", [1, 2]))  # invisible: vLLM's copy is the better one
    assert _seen(v) == [("stored", "gpu", None, [1, 2, 3])]
    v.gpu_removed([1, 2, 3])
    assert _seen(v) == [("removed", "gpu", None, [3]), ("moved", "dram", "gpu", [1, 2])]
    assert v.tier_of(1) == "dram" and v.tier_of(3) is None


def test_store_changes_under_a_gpu_copy_stay_invisible_until_vllm_lets_go() -> None:
    v = TierView("w")
    v.gpu_stored([5], [4])
    v.lower_event(_ev("stored", "dram", [5]))
    v.lower_event(_ev("moved", "disk", [5], from_tier="dram"))
    v.lower_event(_ev("removed", "disk", [5]))
    assert _seen(v) == [("stored", "gpu", None, [5])]
    v.gpu_removed([5])
    assert _seen(v) == [("removed", "gpu", None, [5])]
    assert not v.holds(5)


def test_store_only_blocks_follow_the_store() -> None:
    v = TierView("w")
    v.lower_event(_ev("stored", "dram", [7, 8]))
    v.lower_event(_ev("moved", "disk", [7], from_tier="dram"))
    v.lower_event(_ev("removed", "dram", [8]))
    assert _seen(v) == [
        ("stored", "dram", None, [7, 8]),
        ("moved", "disk", "dram", [7]),
        ("removed", "dram", None, [8]),
    ]
    assert [(h, t) for h, _p, t in v.held()] == [(7, "disk")]


def test_vllm_clearing_its_pool_keeps_what_the_store_has() -> None:
    v = TierView("w")
    v.gpu_stored([1, 2], [0, 1])
    v.lower_event(_ev("stored", "dram", [2]))
    v.drain()
    v.gpu_cleared()
    assert _seen(v) == [("removed", "gpu", None, [1]), ("moved", "dram", "gpu", [2])]
    v.gpu_removed([99])  # unknown: nothing
    assert _seen(v) == []


def test_raw_vllm_events_in_both_encodings_and_merged_records() -> None:
    from services.worker.vllm_engine.engine import _event_fields, _merge

    as_map = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [5],
        "block_size": 32,
    }
    assert _event_fields(as_map) == ("BlockStored", as_map)
    # vLLM before 0.10 sent events as tagged arrays
    kind, fields = _event_fields(["BlockRemoved", [7, 8], "GPU"])
    assert kind == "BlockRemoved" and fields == {"block_hashes": [7, 8], "medium": "GPU"}
    assert _event_fields(42) == ("", {})
    merged = _merge(
        [
            _ev("moved", "dram", [1], from_tier="gpu"),
            _ev("moved", "dram", [2], from_tier="gpu"),
            _ev("moved", "disk", [3], from_tier="dram"),
            _ev("removed", "gpu", [4]),
            _ev("removed", "gpu", [5]),
        ]
    )
    assert [(e.kind, e.tier, e.from_tier, list(e.block_hashes), list(e.parent_hashes)) for e in merged] == [
        ("moved", "dram", "gpu", [1, 2], [0, 1]),
        ("moved", "disk", "dram", [3], [2]),
        ("removed", "gpu", None, [4, 5], [3, 4]),
    ]
