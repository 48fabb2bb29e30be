"""The peers' routers (Dynamo, llm-d, SGLang) as baselines: their rules on hand-built fleets."""

from __future__ import annotations

import dataclasses

import pytest

from schemas.messages import Completion
from services.scheduler import peer_policies
from services.scheduler.router import Router, RouterSettings
from services.scheduler.router_state import ActiveBlocks, RoutedPrefixes
from services.scheduler.view import FleetView

from .factories import BS, load, prompt, request, stored

NOW = 1000


def _fleet(policy: str, n: int = 3, **loads: dict) -> Router:
    view = FleetView(BS)
    for i in range(n):
        view.apply_load(load(f"w-{i}", NOW, **loads.get(f"w-{i}", {})))
    return Router(view, RouterSettings(policy=policy))


def test_dynamo_trades_overlap_against_queued_prefill() -> None:
    toks = prompt(8 * BS + 1)
    req = request("r1", toks)
    # w-0 holds all 8 blocks but has 10 blocks' worth of prefill queued; w-1 is idle and holds nothing.
    r = _fleet("dynamo", **{"w-0": {"queued_prefill_tokens": 10 * BS, "queue_depth": 1}})
    r.view.apply_kv_event(stored("w-0", list(req.block_hashes)))
    # cost w-0 = (10*16 + 129)/16 - 8 = 10.06; w-1 = 129/16 = 8.06 (+ 8 new decode blocks each)
    assert r.decide(req, NOW).assignment.worker_id in {"w-1", "w-2"}
    # with less queued work the overlap credit wins
    r = _fleet("dynamo", **{"w-0": {"queued_prefill_tokens": 5 * BS, "queue_depth": 1}})
    r.view.apply_kv_event(stored("w-0", list(req.block_hashes)))
    d = r.decide(req, NOW)
    assert d.assignment.worker_id == "w-0"
    assert d.assignment.fetch == []  # peers never plan a fetch


def test_dynamo_host_tier_overlap_counts_three_quarters() -> None:
    toks = prompt(8 * BS + 1)
    req = request("r1", toks)
    r = _fleet("dynamo", n=2)
    # w-0 holds the prefix in DRAM (credit 8 * 0.75 = 6), w-1 in GPU for 7 blocks (credit 7)
    r.view.apply_kv_event(stored("w-0", list(req.block_hashes), tier="dram"))
    r.view.apply_kv_event(stored("w-1", list(req.block_hashes[:7])))
    assert r.decide(req, NOW).assignment.worker_id == "w-1"


def test_dynamo_counts_its_own_active_blocks_until_completion() -> None:
    r = _fleet("dynamo", n=2)
    first = r.decide(request("a", prompt(6 * BS, seed=1)), NOW).assignment
    assert first is not None
    busy = first.worker_id
    active = r.view.active_blocks
    assert isinstance(active, ActiveBlocks) and active.active(busy) == 6
    # a request with nothing cached goes to the other worker: it has no active decode blocks
    second = r.decide(request("b", prompt(6 * BS, seed=2)), NOW).assignment
    assert second is not None and second.worker_id != busy
    r.view.note_completion(Completion("a", "s-a", busy, "stop", 96, 8))
    assert active.active(busy) == 0


def test_llm_d_scores_prefix_kv_usage_and_queue() -> None:
    toks = prompt(8 * BS + 1)
    req = request("r1", toks)
    # w-0: the whole prefix (prefix score 1, x2) but the longest queue (queue score 0)
    r = _fleet("llm_d", **{"w-0": {"queue_depth": 4}, "w-1": {"queue_depth": 2}})
    r.view.apply_kv_event(stored("w-0", list(req.block_hashes)))
    assert r.decide(req, NOW).assignment.worker_id == "w-0"  # 2 + 1 + 0 beats 0 + 1 + 1
    # half the prefix (score 0.5 x 2 = 1) does not beat an empty queue (1) plus free KV (1)
    r = _fleet("llm_d", **{"w-0": {"queue_depth": 4}})
    r.view.apply_kv_event(stored("w-0", list(req.block_hashes[:4])))
    assert r.decide(req, NOW).assignment.worker_id != "w-0"


def test_llm_d_ties_break_the_same_way_every_time() -> None:
    picks = {
        _fleet("llm_d").decide(request(f"r{i}", prompt(40, seed=i)), NOW).assignment.worker_id
        for i in range(12)
    }
    again = {
        _fleet("llm_d").decide(request(f"r{i}", prompt(40, seed=i)), NOW).assignment.worker_id
        for i in range(12)
    }
    assert picks == again
    assert len(picks) > 1  # a pseudo-random tie break spreads equal workers, not always the first


def test_sglang_follows_its_routed_tree_not_the_engines_caches() -> None:
    r = _fleet("sglang")
    shared = prompt(8 * BS + 1, seed=3)
    a = r.decide(request("a", shared), NOW).assignment
    assert a is not None
    # the engines report the prefix on another worker: SGLang does not read it
    other = "w-2" if a.worker_id != "w-2" else "w-1"
    r.view.apply_kv_event(stored(other, list(request("x", shared).block_hashes)))
    b = r.decide(request("b", shared), NOW).assignment
    assert b is not None and b.worker_id == a.worker_id
    assert isinstance(r.view.routed, RoutedPrefixes) and r.view.routed.size(a.worker_id) == 8


def test_sglang_below_the_match_threshold_goes_to_the_least_loaded() -> None:
    r = _fleet("sglang", n=2)
    base = prompt(2 * BS, seed=4)
    a = r.decide(request("a", base + prompt(BS, seed=5)), NOW).assignment
    assert a is not None
    # 2 of 9 blocks matched (22% < 30%): the worker without in-flight requests wins
    b = r.decide(request("b", base + prompt(7 * BS, seed=6)), NOW).assignment
    assert b is not None and b.worker_id != a.worker_id


def test_sglang_imbalance_overrides_the_cache_match(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peer_policies, "SGLANG_BALANCE_ABS", 2)
    r = _fleet("sglang", n=2)
    shared = prompt(8 * BS + 1, seed=7)
    first = r.decide(request("a0", shared), NOW).assignment
    assert first is not None
    hot = first.worker_id
    # same prompt: cache match keeps them on the hot worker until it has 3 more in flight than the other
    picks = [r.decide(request(f"a{i}", shared), NOW).assignment.worker_id for i in range(1, 5)]
    assert picks[:2] == [hot, hot]
    assert picks[2] != hot  # loads 3 vs 0: 3 > 2 and 3 > 1.5 * 0


def test_routed_prefixes_evict_leaves_first() -> None:
    t = RoutedPrefixes(max_blocks=4)
    t.insert("w", [1, 2, 3])
    t.insert("w", [1, 2, 4])  # 4 distinct blocks: full
    t.insert("w", [7])  # evicts the least recent leaf (3), never the shared root
    assert t.match([1, 2, 3], frozenset({"w"})) == (2, "w")
    assert t.match([1, 2, 4], frozenset({"w"})) == (3, "w")
    assert t.match([1], frozenset()) == (0, None)


def test_peer_estimates_are_the_cost_model_price_of_their_choice() -> None:
    r = _fleet("dynamo")
    d = r.decide(request("a", prompt(3 * BS)), NOW)
    assert d.assignment is not None
    est = d.assignment.estimate
    assert (
        est.policy == "dynamo" and est.ttft_ms == pytest.approx(d.candidates[0].ttft_ms) and est.ttft_ms > 0
    )
    assert dataclasses.asdict(d.candidates[0])["worker_id"] == d.assignment.worker_id


@pytest.mark.parametrize("policy", ["dynamo", "llm_d", "sglang"])
def test_peers_route_at_once_where_kvmesh_holds(policy: str) -> None:
    heavy = {"queue_depth": 4, "queued_prefill_tokens": 60_000}  # seconds of queued prefill on every worker
    loads = {f"w-{i}": heavy for i in range(3)}
    req = request("r", prompt(64))
    held = _fleet("kvmesh", **loads).decide(req, NOW)
    assert held.deferred and held.reason == "overloaded"  # late binding: wait in the scheduler
    d = _fleet(policy, **loads).decide(req, NOW)
    assert d.assignment is not None and not d.deferred  # the peers' defaults have no router queue


def test_leading_blocks_of_active_requests_follow_adds_removes_and_lost_workers() -> None:
    """kvmesh's in-flight prefixes (ActiveBlocks.leading): per worker, the leading blocks of a prompt
    that its active requests hold, found through the prompts' first blocks, not a scan of the fleet."""
    active = ActiveBlocks()
    active.add("a", "w-0", [1, 2, 3, 4])
    active.add("b", "w-1", [1, 2, 9])
    active.add("c", "w-1", [7, 8])
    active.add("a", "w-2", [1, 2, 3, 4])  # the same request again: counted once, where it went first
    assert active.leading([1, 2, 3, 5]) == {"w-0": 3, "w-1": 2}
    assert active.leading([7, 8, 10]) == {"w-1": 2}
    assert active.leading([2, 3]) == {} and active.leading([]) == {}
    active.add("d", "w-0", [1, 2])
    active.remove("a")  # "d" still starts with block 1 on w-0
    assert active.leading([1, 2, 3]) == {"w-0": 2, "w-1": 2}
    active.remove("d")
    active.remove("d")  # twice: no effect
    assert active.leading([1, 2, 3]) == {"w-1": 2}
    active.drop_worker("w-1")
    assert active.leading([1, 2, 3]) == {} and active.leading([7]) == {}
    active.add("e", "w-1", [7])
    assert active.leading([7, 8]) == {"w-1": 1}
