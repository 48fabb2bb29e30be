"""Each policy's choice on small exact setups (cpu-tiny profile, block size 16)."""

from __future__ import annotations

import msgspec
import pytest

from schemas.messages import WorkerLost
from services.scheduler.errors import UnknownPolicy
from services.scheduler.router import POLICIES, Router, RouterSettings
from services.scheduler.view import FleetView

from .factories import load, prompt, request, stored


def fleet(n: int = 3, **loads: dict) -> FleetView:
    view = FleetView(block_size=16)
    for i in range(n):
        w = f"w-{i}"
        view.apply_load(load(w, **loads.get(w.replace("-", "_"), {})))
    return view


BUSY = {"queue_depth": 1, "queued_prefill_tokens": 2000}  # ~140 ms of queued prefill on cpu-tiny


def test_policies_tuple_is_the_contract() -> None:
    assert POLICIES == (
        "round_robin",
        "least_loaded",
        "session_affinity",
        "prefix_aware",
        "dynamo",
        "llm_d",
        "sglang",
        "kvmesh",
    )
    with pytest.raises(UnknownPolicy):
        Router(FleetView(), RouterSettings(policy="random"))


def test_prefix_aware_and_kvmesh_pick_the_holder_of_the_longest_prefix() -> None:
    view = fleet()
    req = request("r1", prompt(100))  # 6 full blocks + 4 tokens
    view.apply_kv_event(stored("w-1", req.block_hashes[:4]))
    view.apply_kv_event(stored("w-2", req.block_hashes[:2]))
    for policy in ("prefix_aware", "kvmesh"):
        v = fleet()
        v.apply_kv_event(stored("w-1", req.block_hashes[:4]))
        v.apply_kv_event(stored("w-2", req.block_hashes[:2]))
        a = Router(v, RouterSettings(policy=policy)).decide(req, 1000).assignment
        assert a is not None
        assert (a.worker_id, a.reuse_blocks, a.prefill_tokens, a.fetch) == ("w-1", 4, 36, [])
        assert a.estimate.policy == policy
        assert a.estimate.cached_blocks == 4


def test_prefix_aware_breaks_ties_by_load() -> None:
    view = fleet(w_0=BUSY)
    req = request("r1", prompt(64))
    view.apply_kv_event(stored("w-0", req.block_hashes[:3]))
    view.apply_kv_event(stored("w-2", req.block_hashes[:3]))
    a = Router(view, RouterSettings(policy="prefix_aware")).decide(req, 1000).assignment
    assert a is not None and a.worker_id == "w-2" and a.reuse_blocks == 3


def test_least_loaded_ignores_the_cache() -> None:
    view = fleet(w_0=BUSY, w_1={"queue_depth": 1, "queued_prefill_tokens": 100})
    req = request("r1", prompt(64))
    view.apply_kv_event(stored("w-0", req.block_hashes))
    a = Router(view, RouterSettings(policy="least_loaded")).decide(req, 1000).assignment
    assert a is not None and a.worker_id == "w-2" and a.reuse_blocks == 0 and a.prefill_tokens == 64


def test_round_robin_cycles_in_id_order() -> None:
    view = fleet()
    router = Router(view, RouterSettings(policy="round_robin"))
    got = [router.decide(request(f"r{i}", prompt(20, i)), 1000 + i).assignment for i in range(4)]
    assert [a.worker_id for a in got if a] == ["w-0", "w-1", "w-2", "w-0"]


def test_session_affinity_sticks_even_when_busy() -> None:
    view = fleet()
    router = Router(view, RouterSettings(policy="session_affinity"))
    first = router.decide(request("r1", prompt(32), session="s"), 1000).assignment
    assert first is not None and first.worker_id == "w-0"
    view.apply_load(load("w-0", 1001, **BUSY))
    second = router.decide(request("r2", prompt(48), session="s", arrival_ms=1002), 1002).assignment
    other = router.decide(request("r3", prompt(48, 5), session="t", arrival_ms=1003), 1003).assignment
    assert second is not None and second.worker_id == "w-0"
    assert other is not None and other.worker_id == "w-1"


def test_pending_load_spreads_requests_a_millisecond_apart() -> None:
    for policy in ("kvmesh", "least_loaded", "prefix_aware"):
        view = fleet(2)
        router = Router(view, RouterSettings(policy=policy))
        a = router.decide(request("a", prompt(200, 1), arrival_ms=1000), 1000).assignment
        b = router.decide(request("b", prompt(200, 2), arrival_ms=1001), 1001).assignment
        assert a is not None and b is not None
        assert (a.worker_id, b.worker_id) == ("w-0", "w-1"), policy


def test_pending_clears_when_report_catches_up_or_decays() -> None:
    view = fleet(2)
    router = Router(view, RouterSettings())
    a = router.decide(request("a", prompt(200, 1)), 1000).assignment
    assert a is not None and a.worker_id == "w-0"
    assert view.queue_ms(view.workers["w-0"], 1000) > 0
    view.apply_load(load("w-0", 1001))  # the worker's report now covers the assignment
    assert view.queue_ms(view.workers["w-0"], 1001) == 0
    # No report covers it: it counts until the worker could have done it, plus pending_decay_ms.
    view2 = fleet(2)
    a2 = Router(view2, RouterSettings()).decide(request("a", prompt(200, 1)), 1000).assignment
    assert a2 is not None
    cost = view2.queue_ms(view2.workers["w-0"], 1000)
    assert cost > 0
    assert view2.queue_ms(view2.workers["w-0"], 1000 + 1999 + int(cost)) > 0
    assert view2.queue_ms(view2.workers["w-0"], 1000 + 2001 + int(cost)) == 0


def test_a_long_prefill_stays_counted_while_it_can_still_be_running() -> None:
    # A prompt of many seconds of prefill, and no report after it (a lost report, or a worker that
    # reports between iterations): 2 s later the worker is still busy with it, so the next request
    # must not be priced as if the worker were idle.
    view = fleet(2)
    router = Router(view, RouterSettings())
    long = router.decide(request("long", prompt(20_000, 7)), 1000).assignment
    assert long is not None
    wait = view.queue_ms(view.workers[long.worker_id], 1000)
    assert wait > 2_500  # it costs more than the decay: the old fixed-age rule forgot it at 3,000
    assert view.queue_ms(view.workers[long.worker_id], 3_500) == wait
    nxt = router.decide(request("next", prompt(200, 8)), 3_500).assignment
    assert nxt is not None and nxt.worker_id != long.worker_id
    # entries behind it never expire before it: a worker's work runs in order
    pending = view.workers[long.worker_id].pending
    assert all(x.until_ms <= y.until_ms for x, y in zip(pending, list(pending)[1:], strict=False))


def test_equal_candidates_rotate_over_an_idle_fleet_instead_of_piling_on_the_lowest_id() -> None:
    view = fleet(4)
    router = Router(view, RouterSettings())
    picked = []
    for i in range(8):
        t = 1000 + 100 * i
        a = router.decide(request(f"r{i}", prompt(200, 100 + i)), t).assignment
        assert a is not None
        picked.append(a.worker_id)
        # every worker reports idle again before the next request: all four look the same
        for w in view.workers:
            view.apply_load(load(w, t + 50))
    assert picked == ["w-0", "w-1", "w-2", "w-3"] * 2


def test_kvmesh_plans_fetch_from_busy_holder_when_fetch_beats_recompute() -> None:
    view = fleet(2, w_0=BUSY)
    req = request("r1", prompt(100))
    view.apply_kv_event(stored("w-0", req.block_hashes))  # all 6 blocks
    d = Router(view, RouterSettings()).decide(req, 1000)
    a = d.assignment
    assert a is not None
    assert (a.worker_id, a.reuse_blocks, a.prefill_tokens) == ("w-1", 0, 4)
    assert len(a.fetch) == 1
    plan = a.fetch[0]
    assert (plan.peer_worker, plan.peer_address, plan.first_block) == ("w-0", "127.0.0.1:7000", 0)
    assert plan.block_hashes == req.block_hashes[:6]
    assert a.estimate.fetched_blocks == 6 and a.estimate.transfer_ms > 0
    assert [c.worker_id for c in d.candidates] == ["w-1", "w-0"]
    assert d.candidates[0].ttft_ms < d.candidates[1].ttft_ms


def test_kvmesh_fetch_continues_after_local_prefix() -> None:
    view = fleet(2, w_0=BUSY)
    req = request("r1", prompt(100))
    view.apply_kv_event(stored("w-0", req.block_hashes))
    view.apply_kv_event(stored("w-1", req.block_hashes[:2]))
    a = Router(view, RouterSettings()).decide(req, 1000).assignment
    assert a is not None and a.worker_id == "w-1" and a.reuse_blocks == 2
    assert a.fetch[0].first_block == 2 and a.fetch[0].block_hashes == req.block_hashes[2:6]


def test_no_fetch_plan_when_recompute_is_cheaper() -> None:
    view = FleetView()
    view.apply_load(load("w-0", **BUSY, link_latency_ms=50.0))
    view.apply_load(load("w-1"))
    req = request("r1", prompt(100))
    view.apply_kv_event(stored("w-0", req.block_hashes))
    a = Router(view, RouterSettings()).decide(req, 1000).assignment
    assert a is not None
    assert (a.worker_id, a.reuse_blocks, a.prefill_tokens, a.fetch) == ("w-1", 0, 100, [])


def test_fetch_min_blocks_suppresses_small_fetches() -> None:
    view = fleet(2, w_0=BUSY)
    req = request("r1", prompt(100))
    view.apply_kv_event(stored("w-0", req.block_hashes[:2]))
    a = Router(view, RouterSettings(fetch_min_blocks=3)).decide(req, 1000).assignment
    assert a is not None and a.worker_id == "w-1" and a.fetch == []


def test_full_prompt_cached_still_computes_last_token() -> None:
    view = fleet(1)
    req = request("r1", prompt(64))  # exactly 4 blocks
    view.apply_kv_event(stored("w-0", req.block_hashes))
    a = Router(view, RouterSettings()).decide(req, 1000).assignment
    assert a is not None and a.reuse_blocks == 3 and a.prefill_tokens == 16


def test_lower_tier_blocks_cost_promotion() -> None:
    view = fleet(2)
    req = request("r1", prompt(100))
    view.apply_kv_event(stored("w-0", req.block_hashes, tier="disk"))
    view.apply_kv_event(stored("w-1", req.block_hashes, tier="gpu"))
    d = Router(view, RouterSettings()).decide(req, 1000)
    assert d.assignment is not None and d.assignment.worker_id == "w-1"
    disk = next(c for c in d.candidates if c.worker_id == "w-0")
    assert disk.transfer_ms > 0 and disk.cached_blocks == 6


OVERLOAD = {"queue_depth": 20, "queued_prefill_tokens": 10000, "active_requests": 8}


def _shared_prefix_burst(policy: str, link_latency_ms: float | None = None) -> list:
    view = FleetView()
    for i in range(3):
        view.apply_load(load(f"w-{i}", **OVERLOAD, link_latency_ms=link_latency_ms))
    base = prompt(960, 42)  # 60 blocks, held by w-0
    view.apply_kv_event(stored("w-0", request("x", base).block_hashes))
    router = Router(view, RouterSettings(policy=policy))
    out = []
    for i in range(10):
        req = request(f"r{i}", base + prompt(10, 100 + i), arrival_ms=1000 + i)
        out.append(router.decide(req, 1000 + i).assignment)
    return out


def test_overload_waits_for_cached_blocks_instead_of_recomputing_elsewhere() -> None:
    # fetching is slow (50 ms latency): the only way to reuse the prefix is to queue on w-0
    got = _shared_prefix_burst("kvmesh", link_latency_ms=50.0)
    assert [a.worker_id for a in got] == ["w-0"] * 10
    assert all(a.reuse_blocks == 60 and a.prefill_tokens == 10 for a in got)
    # the cache-blind baseline recomputes the 960-token prefix on each of the other workers
    blind = _shared_prefix_burst("least_loaded", link_latency_ms=50.0)
    assert {a.worker_id for a in blind if a.prefill_tokens == 970} == {"w-1", "w-2"}


def test_overload_with_fast_links_fetches_rather_than_recomputes() -> None:
    got = _shared_prefix_burst("kvmesh")
    assert all(a.reuse_blocks + a.estimate.fetched_blocks == 60 for a in got)
    assert all(a.prefill_tokens == 10 for a in got)
    # spread, each reusing the prefix: fetched once per worker, which then computes behind that pull
    # (the next request there counts the prefix as on the worker, not fetched again)
    spread = {a.worker_id for a in got}
    assert len(spread) >= 2
    fetched = [a.worker_id for a in got if a.estimate.fetched_blocks == 60]
    assert len(fetched) == len(set(fetched)) == len(spread - {"w-0"})


def test_least_loaded_ranking_in_a_larger_fleet() -> None:
    # more workers than least_loaded_k: the view's maintained ranking picks the candidates
    view = FleetView()
    queued = [3000, 500, 2500, 800, 100, 4000, 900, 600]
    for i, q in enumerate(queued):
        view.apply_load(load(f"w-{i}", queue_depth=1, queued_prefill_tokens=q))
    router = Router(view, RouterSettings(policy="least_loaded"))
    a = router.decide(request("r1", prompt(500)), 1000).assignment
    assert a is not None and a.worker_id == "w-4"
    # w-4: 5.1 ms queued + 27.5 ms pending = 32.6 ms; now w-1 (500 queued, 27.5 ms) is the least loaded
    b = router.decide(request("r2", prompt(400, 1)), 1001).assignment
    assert b is not None and b.worker_id == "w-1"
    view.apply_worker_lost(WorkerLost("w-1", 1000, 1002))
    assert view.least_loaded(3, view.live_workers(1003)) == ["w-4", "w-7", "w-3"]
    kv = Router(view, RouterSettings()).decide(request("r3", prompt(64, 2)), 1003).assignment
    assert kv is not None and kv.worker_id == "w-4"


def test_draining_holder_is_a_fetch_source_but_never_a_candidate() -> None:
    view = fleet(2, w_0={"draining": True})
    req = request("r1", prompt(100))
    view.apply_kv_event(stored("w-0", req.block_hashes))
    for policy in ("kvmesh", "prefix_aware", "least_loaded", "round_robin"):
        d = Router(view, RouterSettings(policy=policy)).decide(req, 1000)
        assert d.assignment is not None and d.assignment.worker_id == "w-1", policy
        assert all(c.worker_id != "w-0" for c in d.candidates), policy
    # on a view where r1 is not on its way to w-1 (its prompt would count as computed there)
    view = fleet(2, w_0={"draining": True})
    view.apply_kv_event(stored("w-0", req.block_hashes))
    d = Router(view, RouterSettings(policy="kvmesh")).decide(request("r2", req.token_ids), 1000)
    assert d.assignment is not None
    assert [p.peer_worker for p in d.assignment.fetch] == ["w-0"]
    assert d.assignment.fetch[0].block_hashes == req.block_hashes[:6]


def test_equal_estimates_go_to_the_smaller_decode_batch() -> None:
    # w-0 and w-1 both decode (same one-step wait); w-0's batch holds more tokens
    def decoding_fleet() -> FleetView:
        view = FleetView()
        view.apply_load(load("w-0", active_requests=4, active_tokens=9000))
        view.apply_load(load("w-1", active_requests=1, active_tokens=300))
        view.apply_load(load("w-2", active_requests=6, active_tokens=20000))
        return view

    assert decoding_fleet().least_loaded(2, ["w-0", "w-1", "w-2"]) == ["w-1", "w-0"]
    view = decoding_fleet()
    a = Router(view, RouterSettings()).decide(request("r1", prompt(40)), 1000)
    assert a.assignment is not None and a.assignment.worker_id == "w-1"


def test_fetch_from_a_peer_disk_costs_its_read() -> None:
    view = fleet(2, w_0=BUSY)
    req = request("r1", prompt(100))
    view.apply_kv_event(stored("w-0", req.block_hashes, tier="gpu"))
    gpu_src = Router(view, RouterSettings()).decide(req, 1000).candidates
    view2 = fleet(2, w_0=BUSY)
    view2.apply_kv_event(stored("w-0", req.block_hashes, tier="disk"))
    disk_src = Router(view2, RouterSettings()).decide(req, 1000).candidates
    fetch_gpu = next(c for c in gpu_src if c.worker_id == "w-1")
    fetch_disk = next(c for c in disk_src if c.worker_id == "w-1")
    assert fetch_gpu.fetch_blocks == 6
    # reading 6 blocks from the peer's disk tier comes on top of the link, or recompute wins
    assert fetch_disk.fetch_blocks == 0 or fetch_disk.transfer_ms > fetch_gpu.transfer_ms
    assert fetch_disk.ttft_ms > fetch_gpu.ttft_ms


@pytest.mark.parametrize("no_transfer", ["w-0", "w-1"])
def test_no_fetch_to_or_from_a_worker_that_moves_no_kv_bytes(no_transfer: str) -> None:
    """A vLLM worker without the KV connector announces peer_transfer=false: its blocks are reused in
    place only, and it is never handed a fetch plan."""

    view = FleetView(block_size=16)
    for w in ("w-0", "w-1"):
        lr = load(w, **(BUSY if w == "w-0" else {}))
        view.apply_load(msgspec.structs.replace(lr, peer_transfer=w != no_transfer, engine="vllm"))
    req = request("r1", prompt(100))
    view.apply_kv_event(stored("w-0", req.block_hashes))
    d = Router(view, RouterSettings()).decide(req, 1000)
    a = d.assignment
    assert a is not None and a.fetch == []
    # without a fetch, the busy holder still wins on reuse or the idle one recomputes; never both
    assert a.estimate.fetched_blocks == 0
    assert (a.worker_id == "w-0") == (a.reuse_blocks > 0)


def test_pulls_planned_onto_one_worker_wait_for_its_link() -> None:
    """A worker pulls one request's blocks at a time: a second pull planned onto w-1 in the same
    millisecond as the first is priced behind it, and once the link is free again it is not."""
    view = fleet(2, w_0=BUSY)
    # three prompts of 6 blocks held by the busy w-0: one each, so that no request's prefix is one an
    # earlier request is already bringing to w-1
    bases = [prompt(96, 7 + i) for i in range(3)]
    for base in bases:
        view.apply_kv_event(stored("w-0", request("x", base).block_hashes))
    router = Router(view, RouterSettings())
    first = router.decide(request("r1", bases[0] + prompt(4, 1), arrival_ms=1000), 1000).assignment
    assert first is not None and first.worker_id == "w-1" and first.fetch
    ws = view.workers["w-1"]
    pull = ws.link_free_ms - 1000
    assert pull > 0
    assert view.link_wait_ms(ws, 1000) == pytest.approx(pull)
    second = router.decide(request("r2", bases[1] + prompt(4, 2), arrival_ms=1000), 1000)
    on_w1 = next(c for c in second.candidates if c.worker_id == "w-1")
    # the same pull, behind the first one's
    assert on_w1.fetch_blocks == 6
    assert on_w1.transfer_ms == pytest.approx(first.estimate.transfer_ms + pull)
    assert view.link_wait_ms(ws, int(ws.link_free_ms) + 1) == 0.0
    third = router.decide(request("r3", bases[2] + prompt(4, 3), arrival_ms=5000), 5000)
    on_w1 = next(c for c in third.candidates if c.worker_id == "w-1")
    assert on_w1.transfer_ms == pytest.approx(first.estimate.transfer_ms)


def test_a_worker_without_room_for_the_prompt_is_priced_with_the_wait_for_its_running_requests() -> None:
    """w-0 and w-1 look alike, but w-0's GPU tier is full of running requests that end in 300 decode
    steps (1.2 s on cpu-tiny) and w-1 has room: kvmesh prices w-0 with that wait and goes to w-1.
    Without the report's room figures (an older worker) the two cost the same."""
    req = request("r1", prompt(640))  # 40 blocks
    for room in (True, False):
        view = FleetView(block_size=16)
        full = load("w-0", active_requests=4)
        if room:
            full = msgspec.structs.replace(full, kv_free_blocks=2, kv_release=[(300, 100)])
        view.apply_load(full)
        view.apply_load(msgspec.structs.replace(load("w-1", active_requests=4), kv_free_blocks=60))
        w0 = view.workers["w-0"]
        wait = 300 * w0.profile.decode_ms_per_step
        assert view.kv_wait_ms(w0, 640, 1000) == (wait if room else 0.0)
        queue = view.queue_ms(w0, 1000)  # the step in flight and the one the prefill carries
        assert queue == view.queue_ms(view.workers["w-1"], 1000)
        d = Router(view, RouterSettings(policy="kvmesh")).decide(req, 1000)
        by = {c.worker_id: c for c in d.candidates}
        assert by["w-0"].queue_ms == pytest.approx(queue + (wait if room else 0.0))
        assert by["w-1"].queue_ms == pytest.approx(queue)
        assert by["w-0"].ttft_ms - by["w-1"].ttft_ms == pytest.approx(wait if room else 0.0)
        if room:
            assert d.assignment is not None and d.assignment.worker_id == "w-1"


def test_the_routers_own_assignments_take_room_before_the_workers_report_counts_them() -> None:
    """Until a report counts it, an assignment the router made takes its blocks off the free ones; the
    steps its prefill iteration runs are already in the queue estimate, the rest are added."""
    view = FleetView(block_size=16)
    view.apply_load(msgspec.structs.replace(load("w-0"), kv_free_blocks=60, kv_release=[(50, 100)]))
    w0 = view.workers["w-0"]
    assert view.kv_wait_ms(w0, 640, 1000) == 0.0
    a = Router(view, RouterSettings(policy="kvmesh")).decide(request("r2", prompt(650, 2)), 1000)
    assert a.assignment is not None and a.assignment.worker_id == "w-0"
    # 41 of the 60 blocks go to r2: a 40-block prompt now waits for the running requests' 50 steps,
    # one of which r2's prefill carries (it is in the queue's price already)
    assert view.kv_wait_ms(w0, 640, 1000) == 49 * w0.profile.decode_ms_per_step
    # ... until a report that counts r2 comes
    view.apply_load(msgspec.structs.replace(load("w-0", 1100), kv_free_blocks=60, kv_release=[(50, 100)]))
    assert view.kv_wait_ms(view.workers["w-0"], 640, 1100) == 0.0


def test_the_steps_the_queued_prefills_carry_are_not_counted_twice() -> None:
    """Three prompts are queued and the new one fits after the running requests' next 10 steps: the
    three prefill iterations run three of them (the queue's price), seven are decode-only."""
    view = FleetView(block_size=16)
    report = load("w-0", queue_depth=3, queued_prefill_tokens=300, active_requests=2)
    view.apply_load(msgspec.structs.replace(report, kv_free_blocks=-5, kv_release=[(10, 50), (40, 50)]))
    w0 = view.workers["w-0"]
    step = w0.profile.decode_ms_per_step
    assert view.kv_wait_ms(w0, 640, 1000) == 7 * step  # 40 blocks: after the first release
    assert view.kv_wait_ms(w0, 1500, 1000) == 37 * step  # 94 blocks: after both
    assert view.kv_wait_ms(w0, 16 * 2, 1000) == 7 * step  # even 2 blocks: the queue itself waits


def test_price_beside_holders_scores_the_workers_storing_or_computing_the_prefix() -> None:
    """A parked request's alternatives (FairDispatcher._pull_target): w-1 stores part of the prompt,
    w-2 is computing all of it for a request assigned before, w-0 (draining) stores it but takes no
    work, and w-3 holds none of it. The worker priced first is not among the others."""
    view = fleet(4, w_0={"draining": True}, w_1=BUSY, w_3=BUSY)
    req = request("r1", prompt(100))  # 6 full blocks
    view.apply_kv_event(stored("w-0", req.block_hashes))
    router = Router(view, RouterSettings())
    first = router.decide(request("r0", [*req.token_ids, 7, 8]), 1000).assignment
    assert first is not None and first.worker_id == "w-2"  # the idle one: it is computing the prefix now
    view.apply_kv_event(stored("w-1", req.block_hashes[:2]))
    there, others = router.price_beside_holders(req, 1001, "w-3")
    assert there.worker_id == "w-3" and there.cached_blocks == 0
    scored = {c.worker_id: c for c in others}
    assert sorted(scored) == ["w-1", "w-2"]
    assert scored["w-2"].cached_blocks == 6 and scored["w-1"].cached_blocks == 2
    assert scored["w-2"].work_ms < scored["w-1"].work_ms < there.work_ms
    there, others = router.price_beside_holders(req, 1001, "w-1")
    assert there.worker_id == "w-1" and [c.worker_id for c in others] == ["w-2"]
