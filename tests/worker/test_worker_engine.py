"""The engine: reuse of cached KV (also after demotion to DRAM and disk) gives the logits and tokens of
a full recompute; multi-turn reuse; continuous batching; rejection; events; abort; shutdown."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvmesh_core.costmodel import prefill_ctx
from kvmesh_core.tokenizer import ByteTokenizer, ChatMessage, render_chat
from schemas.blocks import block_hashes
from schemas.messages import SamplingParams
from services.worker import engine as engine_mod
from services.worker.engine import Engine, EngineConfig, EngineRequest, RequestRejected, StepOutput


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny matmuls on a shared 2-core box run far faster on one thread (no spinning workers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


NS = b"t:acme"
BS = 16


def _engine(tmp_path: Path | None = None, **kw: object) -> Engine:
    args: dict = {"gpu_blocks": 64, "dram_blocks": 64, "max_batch": 4, "prefill_chunk": 48}
    if tmp_path is not None:
        args.update(disk_blocks=64, disk_dir=str(tmp_path))
    args.update(kw)
    return Engine(EngineConfig(**args))


def _req(rid: str, tokens: list[int], max_tokens: int = 6, **kw: object) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        session_id=kw.pop("session_id", "s1"),  # type: ignore[arg-type]
        token_ids=tokens,
        block_hashes=block_hashes(tokens, BS, NS),
        namespace=NS,
        max_tokens=max_tokens,
        sampling=kw.pop("sampling", SamplingParams()),  # type: ignore[arg-type]
        stop_token_ids=kw.pop("stop", []),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def _run(eng: Engine, *reqs: EngineRequest) -> dict[str, list[StepOutput]]:
    for r in reqs:
        eng.add_request(r)
    outs: dict[str, list[StepOutput]] = {r.request_id: [] for r in reqs}
    for _ in range(1000):
        if not eng.has_work():
            break
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    assert not eng.has_work()
    return outs


def _tokens(outs: list[StepOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _stats(outs: list[StepOutput]):
    [s] = [o.stats for o in outs if o.stats is not None]
    return s


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every logits vector the engine samples from, in order."""
    seen: list[torch.Tensor] = []
    real = engine_mod.sample

    def spy(logits, params, gen, mask, *rest):  # type: ignore[no-untyped-def]
        seen.append(logits.detach().float().cpu().clone())
        return real(logits, params, gen, mask, *rest)

    monkeypatch.setattr(engine_mod, "sample", spy)
    return seen


def _demote_everything(eng: Engine) -> None:
    """Push every cached GPU block down a tier by taking the whole GPU pool for a moment."""
    ids = eng.kv.allocate(eng.kv.pool.num_blocks)
    assert ids is not None
    eng.kv.release(ids)


@pytest.mark.parametrize("tier", ["gpu", "dram", "disk"])
def test_reused_blocks_give_the_logits_and_tokens_of_a_full_recompute(
    tmp_path: Path, captured: list[torch.Tensor], tier: str
) -> None:
    prompt = _prompt(90, seed=1)
    ref_eng = _engine()
    ref = _run(ref_eng, _req("ref", prompt))["ref"]
    ref_logits = list(captured)
    captured.clear()

    eng = _engine(tmp_path, dram_blocks=0 if tier == "disk" else 64)
    _run(eng, _req("warm", prompt[:70], max_tokens=1))  # stores 4 full blocks of the prefix
    if tier != "gpu":
        _demote_everything(eng)
        assert {eng.kv.tier_of(h) for h in block_hashes(prompt, BS, NS)[:4]} == {tier}
    captured.clear()
    outs = _run(eng, _req("reuse", prompt))["reuse"]
    st = _stats(outs)
    assert st.reused_tokens == 64 and st.recomputed_tokens == 26
    assert st.promoted_blocks == (0 if tier == "gpu" else 4) and st.fallback is None
    assert _tokens(outs) == _tokens(ref)
    assert len(captured) == len(ref_logits)
    for got, want in zip(captured, ref_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    moved = [e for e in eng.drain_kv_events() if e.kind == "moved" and e.tier == "gpu"]
    assert (sum(len(e.block_hashes) for e in moved) == 4) == (tier != "gpu")


def test_generated_blocks_are_hashed_and_reused_by_the_next_turn() -> None:
    tok = ByteTokenizer()
    eng = _engine()
    msgs = [ChatMessage("system", "You are terse."), ChatMessage("user", "Name three colours, please.")]
    p1 = render_chat(tok, msgs)
    stop = [tok.end_id]
    out1 = _tokens(_run(eng, _req("t1", p1, max_tokens=40, stop=stop))["t1"])
    assert all(t in tok.generation_vocab() for t in out1)
    answer = tok.decode(out1[:-1] if out1[-1] == tok.end_id else out1)
    # Everything whose KV was computed (prompt + answer but its last token) is cached, generated
    # blocks included, under the continued hash chain.
    computed = len(p1) + len(out1) - 1
    chain = block_hashes(p1 + out1, BS, NS)
    assert eng.lookup_prefix(chain) == computed // BS
    assert computed // BS > len(p1) // BS  # the answer filled at least one block

    p2 = render_chat(tok, [*msgs, ChatMessage("assistant", answer), ChatMessage("user", "And two more?")])
    if out1[-1] == tok.end_id:
        assert p2[: len(p1) + len(out1)] == p1 + out1  # the template is prefix-stable
    st = _stats(_run(eng, _req("t2", p2, max_tokens=4))["t2"])
    assert st.reused_tokens == computed // BS * BS
    # Same tokens as a cold worker computing turn 2 from scratch.
    cold = _engine()
    assert _tokens(_run(cold, _req("c2", p2, max_tokens=4))["c2"]) == _tokens(
        _run(eng, _req("t2b", p2, max_tokens=4))["t2b"]
    )


def test_continuous_batching_gives_each_request_its_solo_tokens() -> None:
    prompts = [_prompt(n, seed=n) for n in (20, 45, 70)]
    solo = [_tokens(_run(_engine(), _req(f"r{i}", p, max_tokens=8))[f"r{i}"]) for i, p in enumerate(prompts)]
    eng = _engine()
    for i, p in enumerate(prompts):
        eng.add_request(_req(f"r{i}", p, max_tokens=8))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    widest = 0
    while eng.has_work():
        outs = eng.step()
        widest = max(widest, sum(1 for o in outs if not o.first_token and o.new_token_ids))
        for o in outs:
            got[o.request_id] += o.new_token_ids
    assert widest == 3  # all three decoded in one batched step at some point
    assert [got[f"r{i}"] for i in range(3)] == solo


def test_seeded_sampling_is_identical_with_and_without_reuse() -> None:
    prompt = _prompt(60, seed=5)
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=42)
    cold = _tokens(_run(_engine(), _req("a", prompt, max_tokens=10, sampling=sp))["a"])
    eng = _engine()
    _run(eng, _req("w", prompt, max_tokens=1))
    warm = _run(eng, _req("b", prompt, max_tokens=10, sampling=sp))["b"]
    assert _stats(warm).reused_tokens == 48
    assert _tokens(warm) == cold


def test_missing_expected_blocks_fall_back_to_recompute() -> None:
    prompt = _prompt(50, seed=9)
    eng = _engine()
    outs = _run(eng, _req("x", prompt, expected_reuse_blocks=3))["x"]
    st = _stats(outs)
    assert st.reused_tokens == 0 and st.recomputed_tokens == 50
    assert st.fallback is not None and "expected 3" in st.fallback
    assert _tokens(outs) == _tokens(_run(_engine(), _req("y", prompt))["y"])


def test_stop_and_length_finish_reasons() -> None:
    prompt = _prompt(30, seed=3)
    eng = _engine()
    outs = _run(eng, _req("a", prompt, max_tokens=5))["a"]
    assert outs[0].first_token and outs[-1].finished and outs[-1].finish_reason == "length"
    toks = _tokens(outs)
    assert len(toks) == 5
    outs = _run(eng, _req("b", prompt, max_tokens=5, stop=[toks[2]]))["b"]
    assert _tokens(outs) == toks[: toks.index(toks[2]) + 1] and outs[-1].finish_reason == "stop"
    short = _engine(max_context=33)
    outs = _run(short, _req("c", prompt, max_tokens=50))["c"]
    assert len(_tokens(outs)) == 3 and outs[-1].finish_reason == "length"


def test_bad_requests_are_rejected() -> None:
    eng = _engine(max_context=64)
    with pytest.raises(RequestRejected, match="does not fit the context"):
        eng.add_request(_req("long", _prompt(64, seed=1)))
    with pytest.raises(RequestRejected, match="empty"):
        eng.add_request(_req("empty", []))
    bad = _req("hash", _prompt(40, seed=1))
    bad.block_hashes = [1, 2]
    with pytest.raises(RequestRejected, match="block_hashes"):
        eng.add_request(bad)
    with pytest.raises(RequestRejected, match="vocabulary"):
        eng.add_request(_req("vocab", [5, 999]))
    eng.add_request(_req("dup", [1, 2, 3]))
    with pytest.raises(RequestRejected, match="already"):
        eng.add_request(_req("dup", [1, 2, 3]))
    assert issubclass(RequestRejected, engine_mod.RequestRejected)


def test_abort_releases_blocks_and_reports_cancelled() -> None:
    eng = _engine()
    eng.add_request(_req("a", _prompt(40, seed=2), max_tokens=50))
    eng.step()
    eng.step()
    assert eng.load().active_requests == 1
    assert eng.abort("a") and not eng.abort("a")
    outs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "cancelled")]
    assert not eng.has_work()
    gpu = eng.load().tiers[0]
    assert gpu.tier == "gpu" and gpu.free_blocks == gpu.total_blocks  # nothing referenced


def test_events_load_and_release_all() -> None:
    eng = _engine()
    prompt = _prompt(40, seed=4)
    eng.add_request(_req("a", prompt, max_tokens=3))
    eng.add_request(_req("b", _prompt(20, seed=6), max_tokens=3))
    load = eng.load()
    assert load.queue_depth == 2 and load.queued_prefill_tokens == 60
    _run(eng)
    stored = [h for e in eng.drain_kv_events() if e.kind == "stored" for h in e.block_hashes]
    assert set(block_hashes(prompt, BS, NS)) <= set(stored)
    events = eng.release_all()
    assert [e.kind for e in events] == ["cleared"]
    assert eng.lookup_prefix(block_hashes(prompt, BS, NS)) == 0


def test_calibrate_returns_a_usable_profile() -> None:
    p = _engine().calibrate()
    assert p.prefill_ms_per_token > 0 and p.decode_ms_per_step > 0
    assert p.prefill_ms_per_token_per_ctx >= 0
    assert p.block_size == BS and p.block_bytes == 4 * 2 * 2 * BS * 32 * 4


def test_end_tokens_min_tokens_ignore_eos_and_logprobs() -> None:
    eng = _engine()
    prompt = _prompt(40, seed=11)
    free = _tokens(_run(eng, _req("free", prompt, max_tokens=6))["free"])
    end = free[0]  # make the greedy first token the request's end token
    stopped = _run(eng, _req("end", prompt, max_tokens=6, stop=[end]))["end"]
    assert _tokens(stopped) == [end] and stopped[-1].finish_reason == "stop"
    kept = _run(eng, _req("ign", prompt, max_tokens=6, stop=[end], sampling=SamplingParams(ignore_eos=True)))
    assert _tokens(kept["ign"]) == free and kept["ign"][-1].finish_reason == "length"
    # min_tokens: the end token cannot be chosen before 3 tokens; logprobs still show the model's view
    sp = SamplingParams(min_tokens=3, logprobs=2)
    outs = _run(eng, _req("min", prompt, max_tokens=6, stop=[end], sampling=sp))["min"]
    toks = _tokens(outs)
    assert len(toks) >= 3 and end not in toks[:3]
    lps = [lp for o in outs for lp in o.logprobs or []]
    assert [lp.token_id for lp in lps] == toks
    assert lps[0].top_ids[0] == end and lps[0].token_id != end
    assert all(len(lp.top_ids) == 2 for lp in lps)


def test_a_feature_the_engine_lacks_is_refused_not_ignored() -> None:
    from schemas.messages import StructuredOutput

    eng = _engine()
    with pytest.raises(RequestRejected, match="json_object"):
        eng.add_request(
            _req("so", _prompt(20, 1), sampling=SamplingParams(structured=StructuredOutput("json_object")))
        )


def test_a_request_waiting_for_its_pull_keeps_its_place_and_the_others_run() -> None:
    """Overlap admission: a ``kv_pending`` request is passed over (and is no work on its own) until
    ``kv_arrived``; then it is admitted before requests queued after it, with its solo tokens."""
    pulled, later, other = _prompt(40, seed=1), _prompt(30, seed=2), _prompt(20, seed=3)
    solo = _tokens(_run(_engine(), _req("pulled", pulled))["pulled"])
    eng = _engine(max_batch=1)
    # the scheduler expected 32 of its 40 tokens from the pull: 8 are queued prefill, over 32 cached
    eng.add_request(_req("pulled", pulled, kv_pending=True, expected_prefill_tokens=8))
    eng.add_request(_req("other", other))
    done: list[str] = []
    got: list[int] = []
    while eng.has_work():
        done += [o.request_id for o in eng.step() if o.finished]
    assert done == ["other"]  # ran past the waiting one, which stays queued
    load = eng.load()
    assert load.queue_depth == 1 and load.queued_prefill_tokens == 8
    assert load.queued_prefill_ctx_tokens == prefill_ctx(8, 32)
    eng.add_request(_req("later", later))
    assert eng.load().queued_prefill_tokens == 8 + len(later)  # no estimate: the whole prompt
    eng.kv_arrived("pulled", 2)  # its pull brought nothing: it expected 2 blocks (32 tokens)
    eng.kv_arrived("unknown", 0)  # a request cancelled meanwhile: ignored
    outs: list[StepOutput] = []
    while eng.has_work():
        for o in eng.step():
            outs.append(o)
            if o.finished:
                done.append(o.request_id)
            if o.request_id == "pulled":
                got += o.new_token_ids
    assert done == ["other", "pulled", "later"]  # its place before the one queued after it is kept
    assert got == solo
    [first] = [o for o in outs if o.request_id == "pulled" and o.stats is not None]
    assert first.stats.fallback == "expected 2 cached blocks, found 0; recomputed"


def test_a_landed_pull_is_held_until_its_request_is_admitted_or_cancelled() -> None:
    """What a pull brought stays in the cache while its request waits (KvCacheManager.hold), and the
    hold ends when the engine admits the request (its blocks are referenced then) or drops it."""
    prompt = _prompt(40, seed=4)
    donor = _engine()
    _run(donor, _req("first", prompt))  # computes the blocks a peer would send
    eng = _engine(max_batch=1)
    src = donor.block_source()
    hashes = block_hashes(prompt, BS, NS)[:2]
    blocks = []
    for i, h in enumerate(hashes):
        got = src.read_block(h)
        assert got is not None
        blocks.append((h, hashes[i - 1] if i else 0, bytes(got[1])))
        src.release_read(h)
    eng.add_request(_req("pulled", prompt, kv_pending=True))
    eng.add_request(_req("cancelled", prompt, kv_pending=True))  # the same prompt, pulled once
    assert eng.block_sink().commit_blocks(blocks, NS) == 2
    eng.kv_arrived("pulled", 2)
    eng.kv_arrived("cancelled", 2)
    assert eng.kv._held == dict.fromkeys(hashes, 2)
    assert eng.abort("cancelled")
    assert eng.kv._held == dict.fromkeys(hashes, 1)
    outs = _run(eng)
    assert eng.kv._held == {} and eng.kv._holds == {}
    [first] = [o for o in outs["pulled"] if o.stats is not None]
    assert first.stats.reused_tokens == 2 * BS and first.stats.fallback is None


def test_a_queued_request_holds_the_prefix_it_found_until_it_is_admitted() -> None:
    """The prompts queued ahead of a request must not evict the prefix it will reuse: it holds the
    leading run it finds when it is queued (KvCacheManager.hold) until the engine admits it."""
    prompt = _prompt(40, seed=6)
    eng = _engine(max_batch=1)
    _run(eng, _req("first", prompt))
    eng.add_request(_req("ahead", _prompt(30, seed=7)))
    eng.add_request(_req("again", prompt, session_id="s2"))
    hashes = block_hashes(prompt, BS, NS)
    assert eng.kv._holds == {"again": hashes} and eng.kv._holds.keys() == {"again"}
    outs = _run(eng)
    assert eng.kv._holds == {} and eng.kv._held == {}
    [first] = [o for o in outs["again"] if o.stats is not None]
    assert first.stats.reused_tokens == len(hashes) * BS


def test_the_load_reports_room_for_the_next_prompt_and_when_running_requests_free_theirs() -> None:
    """The GPU tier's room (kvmesh_core/kv_room.py): free blocks less the queued prompts', and each
    running request's expected end with the blocks only it holds. A prompt that does not fit waits."""
    eng = _engine(gpu_blocks=16, dram_blocks=0, max_batch=8, prefill_chunk=512)
    a, b = _prompt(6 * BS, 1), _prompt(6 * BS, 2)
    eng.add_request(_req("a", a, max_tokens=20))
    eng.add_request(_req("b", b, max_tokens=40))
    eng.step()
    load = eng.load()
    assert load.active_requests == 2 and load.queue_depth == 0
    # each holds its 6 prompt blocks (a block for generated tokens comes when the first one fills)
    assert load.kv_free_blocks == load.tiers[0].free_blocks == 4
    steps = [s for s, _ in load.kv_release]
    assert steps == sorted(steps) and sum(n for _, n in load.kv_release) == 12
    assert load.kv_release[0][0] < load.kv_release[-1][0]  # a, with fewer tokens to go, ends first
    # a third prompt of 5 blocks does not fit: it waits, and the room counts it first
    eng.add_request(_req("c", _prompt(5 * BS, 3), max_tokens=4))
    eng.step()
    load = eng.load()
    assert load.queue_depth == 1 and load.kv_free_blocks == load.tiers[0].free_blocks - 5 < 0
    outs = _run(eng)
    assert {o.request_id for v in outs.values() for o in v if o.finished} >= {"c"}
    load = eng.load()
    assert load.kv_release == [] and load.kv_free_blocks == load.tiers[0].free_blocks == 16
