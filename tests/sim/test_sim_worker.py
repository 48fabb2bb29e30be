"""The simulated worker serves what it really holds: fetch what the peer has, recompute the rest."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from kvmesh.sim.worker import ADMISSIONS, LOADS, Admission, Job, Load, SimWorker
from kvmesh_core.costmodel import PROFILES, recompute_ms
from schemas.messages import Assignment, ChatRequest, Completion, Estimate, FetchPlan, KvEvent, LoadReport

BS = 16
PROFILE = dataclasses.replace(PROFILES["h100-llama3-8b"], gpu_blocks=64, dram_blocks=0, disk_blocks=0)


class _Harness:
    def __init__(self, admission: Admission = "serial") -> None:
        self.sent: list[tuple[object, float]] = []
        self.calls: list[tuple[float, SimWorker, object]] = []
        self.peers: dict[str, SimWorker] = {}
        for i in range(2):
            w = SimWorker(i, f"w{i}", PROFILE, self._emit, self._schedule, self.peers, admission)
            self.peers[w.worker_id] = w

    def _emit(self, msg: object, t: float) -> None:
        self.sent.append((msg, t))

    def _schedule(self, t: float, w: SimWorker, job: object) -> None:
        self.calls.append((t, w, job))

    def run(self) -> None:
        while self.calls:
            self.calls.sort(key=lambda c: c[0])
            t, w, job = self.calls.pop(0)
            if job is not None:
                w.on_fetch_done(job, t)  # type: ignore[arg-type]
            elif w.busy_until == t:
                w.on_iteration_end(t)


def _request(n_blocks: int, rid: str) -> ChatRequest:
    from schemas.chat_requests import chat_request

    tokens = list(range(n_blocks * BS + 1))
    return chat_request(
        tokens, request_id=rid, session_id=rid, tenant="t", block_size=BS, max_tokens=2, arrival_ms=0
    )


def _assign(req: ChatRequest, worker: str, fetch: list[FetchPlan]) -> Assignment:
    return Assignment(req, worker, 0, len(req.token_ids), Estimate(0, 0, 0, 0, "kvmesh"), fetch)


@pytest.mark.parametrize("admission", ADMISSIONS)
def test_fetch_stops_at_first_block_the_peer_lacks(admission: Admission) -> None:
    h = _Harness(admission)
    w0, w1 = h.peers["w0"], h.peers["w1"]
    req = _request(8, "r1")
    # w1 holds only the first 5 blocks of the prompt
    w1.cache.access(req.block_hashes[:5], [0, *req.block_hashes[:4]])
    plan = FetchPlan("w1", w1.address, req.block_hashes, 0)
    w0.assign(_assign(req, "w0", [plan]), 0.0, 0.0)
    h.run()
    done = [m for m, _ in h.sent if isinstance(m, Completion)]
    assert len(done) == 1
    c = done[0]
    assert (c.fetched_tokens, c.reused_tokens, c.recomputed_tokens) == (5 * BS, 0, 3 * BS + 1)
    assert c.prefill_ms == recompute_ms(PROFILE, 3 * BS + 1, 5 * BS)
    stored = [m for m, _ in h.sent if isinstance(m, KvEvent) and m.kind == "stored"]
    assert [len(e.block_hashes) for e in stored] == [5, 3]  # fetched run, then the prefill's blocks


def test_second_turn_reuses_local_blocks() -> None:
    h = _Harness()
    w0 = h.peers["w0"]
    req = _request(4, "r1")
    w0.assign(_assign(req, "w0", []), 0.0, 0.0)
    h.run()
    again = msgspec.structs.replace(req, request_id="r2", arrival_ms=1000)
    w0.assign(_assign(again, "w0", []), 1000.0, 1000.0)
    h.run()
    c = [m for m, _ in h.sent if isinstance(m, Completion)][-1]
    assert (c.reused_tokens, c.fetched_tokens, c.recomputed_tokens) == (4 * BS, 0, 1)
    assert len(w0.finished) == 2
    assert w0.finished[1].first_token_ms > 1000.0


def test_fetch_reads_peer_lower_tiers_lands_in_dram_and_is_promoted_at_prefill() -> None:
    from kvmesh_core.costmodel import promote_ms, transfer_ms

    tiered = dataclasses.replace(PROFILE, dram_blocks=64)
    h = _Harness()
    for w in h.peers.values():
        w.profile = tiered
        w.cache = type(w.cache)(tiered.gpu_blocks, tiered.dram_blocks, 0)
    w0, w1 = h.peers["w0"], h.peers["w1"]
    req = _request(6, "r1")
    parents = [0, *req.block_hashes[:5]]
    w1.cache.insert(req.block_hashes, parents, 1)  # the peer holds all 6 blocks in DRAM
    w0.assign(_assign(req, "w0", [FetchPlan("w1", w1.address, req.block_hashes, 0)]), 0.0, 0.0)
    ((t_done, _, _),) = h.calls
    link = transfer_ms(tiered, 6, tiered.link_gbps, tiered.link_latency_ms)
    # the peer's DRAM reads, then the link
    assert t_done == pytest.approx(link + promote_ms(tiered, "dram", 6))
    h.run()
    landed = next(m for m, _ in h.sent if isinstance(m, KvEvent) and m.kind == "stored")
    assert (landed.tier, landed.block_hashes) == ("dram", req.block_hashes)
    c = next(m for m, _ in h.sent if isinstance(m, Completion))
    assert c.fetched_tokens == 6 * BS
    # the prefill iteration promoted the 6 landed blocks before computing the last token
    first_token = c.ttft_ms
    assert first_token == pytest.approx(
        t_done + promote_ms(tiered, "dram", 6) + recompute_ms(tiered, 1, 6 * BS)
    )


@pytest.mark.parametrize(
    ("admission", "first"), [("serial", "pulled"), ("pass", "local"), ("overlap", "local")]
)
def test_an_assignment_that_arrives_during_a_pull_waits_for_it_only_under_serial_admission(
    admission: Admission, first: str
) -> None:
    """Under "serial" a worker admits assignments one at a time and awaits each pull, so one that
    arrives while a pull is on the link starts after the pulled request; "pass" and "overlap" (the
    live worker's default) let it go first."""
    h = _Harness(admission)
    w0, w1 = h.peers["w0"], h.peers["w1"]
    pulled = _request(8, "pulled")
    w1.cache.access(pulled.block_hashes, [0, *pulled.block_hashes[:-1]])
    w0.assign(_assign(pulled, "w0", [FetchPlan("w1", w1.address, pulled.block_hashes, 0)]), 0.0, 0.0)
    ((landed_ms, _, _),) = h.calls
    local = msgspec.structs.replace(_request(2, "local"), block_hashes=[101, 102])
    w0.assign(_assign(local, "w0", []), 0.01, 0.01)
    assert landed_ms > 0.01
    h.run()
    by_id = {c.request_id: t for c, t in h.sent if isinstance(c, Completion)}
    assert set(by_id) == {"pulled", "local"}
    ttft = {r.arrival_ms: r.first_token_ms for r in w0.finished}
    order = sorted(ttft, key=lambda a: ttft[a])
    assert order[0] == (0.0 if first == "pulled" else 0.01)
    if first == "pulled":
        assert ttft[0.01] > landed_ms  # admitted only once the pull landed


def test_a_request_whose_next_blocks_are_on_the_link_waits_for_that_pull_and_reuses_them() -> None:
    """Overlap admission, as the live worker: "same" (the pulled prompt, assigned while the pull is on
    the link, with no pull of its own) waits for that pull and reuses its blocks; it does not start at
    once and compute them again."""
    h = _Harness("overlap")
    w0, w1 = h.peers["w0"], h.peers["w1"]
    pulled = _request(8, "pulled")
    w1.cache.access(pulled.block_hashes, [0, *pulled.block_hashes[:-1]])
    w0.assign(_assign(pulled, "w0", [FetchPlan("w1", w1.address, pulled.block_hashes, 0)]), 0.0, 0.0)
    ((landed_ms, _, _),) = h.calls
    same = msgspec.structs.replace(pulled, request_id="same", arrival_ms=0)
    w0.assign(_assign(same, "w0", []), 0.01, 0.01)
    assert landed_ms > 0.01 and w0.busy_until == 0.0  # nothing runs while the pull is on the link
    h.run()
    done = {c.request_id: c for c, _ in h.sent if isinstance(c, Completion)}
    assert (done["pulled"].fetched_tokens, done["same"].fetched_tokens) == (8 * BS, 0)
    assert (done["same"].reused_tokens, done["same"].recomputed_tokens) == (8 * BS, 1)
    assert 0.01 + done["same"].ttft_ms > landed_ms
    assert not w0._pulling


def _long_request(n_blocks: int, rid: str, max_tokens: int) -> ChatRequest:
    from schemas.chat_requests import chat_request

    tokens = [1000 * sum(map(ord, rid)) + i for i in range(n_blocks * BS + 1)]
    return chat_request(
        tokens, request_id=rid, session_id=rid, tenant="t", block_size=BS, max_tokens=max_tokens, arrival_ms=0
    )


@pytest.mark.parametrize("kv_capacity", [True, False])
def test_a_prefill_waits_for_room_in_the_gpu_tier_as_the_live_engine_admits(kv_capacity: bool) -> None:
    """A holds 41 of the 64 GPU blocks while it decodes; B needs 31. With KV capacity B starts when A
    ends and frees them, and the worker's own probe (the oracle's) predicts that; without it B starts
    at the next iteration, beside A's decode batch."""
    sent: list[tuple[object, float]] = []
    calls: list[tuple[float, SimWorker, object]] = []
    peers: dict[str, SimWorker] = {}
    w = SimWorker(
        0,
        "w0",
        PROFILE,
        lambda m, t: sent.append((m, t)),
        lambda t, s, j: calls.append((t, s, j)),
        peers,
        kv_capacity=kv_capacity,
    )
    peers["w0"] = w
    a, b = _long_request(40, "a", max_tokens=10), _long_request(30, "b", max_tokens=2)
    w.assign(_assign(a, "w0", []), 0.0, 0.0)
    predicted = w.probe(b, 0.5).ttft_ms
    w.assign(_assign(b, "w0", []), 0.5, 0.5)
    w.report(0.5)
    report = [m for m, _ in sent if isinstance(m, LoadReport)][-1]
    while calls:
        calls.sort(key=lambda c: c[0])
        t, s, _ = calls.pop(0)
        if s.busy_until == t:
            s.on_iteration_end(t)
    done = {m.request_id: (m, t) for m, t in sent if isinstance(m, Completion)}
    (ca, end_a), (cb, _) = done["a"], done["b"]
    first_b = 0.5 + cb.ttft_ms
    step = PROFILE.decode_ms_per_step
    if kv_capacity:
        assert first_b >= end_a  # B's prefill began only after A ended
        assert cb.ttft_ms == pytest.approx(predicted)
        assert first_b - end_a == pytest.approx(cb.prefill_ms)  # ... and carried no decode step
        # 64 blocks less A's 41 and B's 31; A frees its 41 after its 9 decode steps
        assert report.kv_free_blocks == 64 - 41 - 31 and report.kv_release == [(9, 41)]
    else:
        assert first_b < end_a
        assert cb.ttft_ms == pytest.approx(ca.ttft_ms - 0.5 + cb.prefill_ms + step)
        assert report.kv_free_blocks is None and report.kv_release == []


@pytest.mark.parametrize("load", LOADS)
def test_an_async_load_copies_a_dram_prefix_off_the_prefill_iteration(load: Load) -> None:
    """A's 30-block prefix is in DRAM; B, assigned just after, has nothing cached. "sync" (the live
    worker's default) promotes A's prefix inside A's prefill iteration and B waits behind it. "async"
    (vllm_async_load) copies it while B's prefill runs; A is prefilled next, without the copy in its
    iteration, once its blocks are in the GPU tier (a KvEvent says so when the copy ends)."""
    from kvmesh_core.costmodel import promote_ms

    tiered = dataclasses.replace(PROFILE, gpu_blocks=128, dram_blocks=64)
    sent: list[tuple[object, float]] = []
    calls: list[tuple[float, SimWorker, object]] = []
    w = SimWorker(
        0,
        "w0",
        tiered,
        lambda m, t: sent.append((m, t)),
        lambda t, s, j: calls.append((t, s, j)),
        {},
        load=load,
    )
    a, b = _long_request(30, "a", max_tokens=2), _long_request(40, "b", max_tokens=2)
    w.cache.insert(a.block_hashes, [0, *a.block_hashes[:-1]], 1)
    w.assign(_assign(a, "w0", []), 0.0, 0.0)
    w.assign(_assign(b, "w0", []), 0.01, 0.01)
    w.report(0.01)
    report = [m for m, _ in sent if isinstance(m, LoadReport)][-1]
    assert report.queue_depth == 2  # a copying request is still waiting, as vLLM counts it
    while calls:
        calls.sort(key=lambda c: c[0])
        t, s, j = calls.pop(0)
        if isinstance(j, Job):
            (s.on_load_done if j.loading else s.on_fetch_done)(j, t)
        elif s.busy_until == t:
            s.on_iteration_end(t)
    done = {m.request_id: m for m, _ in sent if isinstance(m, Completion)}
    ca, cb = done["a"], done["b"]
    first_a, first_b = ca.ttft_ms, 0.01 + cb.ttft_ms
    copy = promote_ms(tiered, "dram", 30)
    step = tiered.decode_ms_per_step
    for c, reused in ((ca, 30 * BS), (cb, 0)):
        assert (c.reused_tokens, c.fetched_tokens, c.recomputed_tokens) == (
            reused,
            0,
            c.prompt_tokens - reused,
        )
        assert c.prefill_ms == pytest.approx(recompute_ms(tiered, c.recomputed_tokens, reused))
    moved = [(m, t) for m, t in sent if isinstance(m, KvEvent) and m.kind == "moved"]
    assert [(m.from_tier, m.tier, m.block_hashes) for m, _ in moved] == [("dram", "gpu", a.block_hashes)]
    if load == "sync":
        assert first_a == pytest.approx(copy + ca.prefill_ms)
        assert first_b == pytest.approx(first_a + cb.prefill_ms + step)  # behind A's copy and prefill
        assert moved[0][1] == pytest.approx(first_a)
    else:
        assert first_b == pytest.approx(0.01 + cb.prefill_ms)  # ran while A's prefix was copied
        assert moved[0][1] == pytest.approx(copy) and copy < first_b
        assert first_a == pytest.approx(first_b + ca.prefill_ms + step)  # no copy in its iteration
