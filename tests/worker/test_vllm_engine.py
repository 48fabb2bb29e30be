"""The vLLM engine behind the worker interface: one real vLLM (CPU build) for the whole module.

Checks what the fleet relies on: greedy output equal to ``vllm.LLM.generate`` on the same token ids,
vLLM's own cached-token count as the reused count, KV events under exactly the hashes intake computes,
tenant isolation through the cache salt, recovery from a dropped ZMQ message, and clear errors for bad
input with the engine serving on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_helpers import llm_generate

from kvmesh.modeldir import init_model_dir
from kvmesh_core.tokenizer import ChatMessage, render_chat, render_history
from schemas.blocks import block_hashes, tenant_namespace
from schemas.messages import SamplingParams
from services.worker.engine_api import EngineRequest, StepOutput
from services.worker.errors import ModelConfigError, RequestRejected
from services.worker.vllm_engine import VllmEngine, VllmEngineConfig, check_block_size

pytestmark = [pytest.mark.slow]  # a real vLLM, no broker or Redis

BS = 32
CTX = 1024
NS_A = tenant_namespace("A")
NS_B = tenant_namespace("B")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model_dir(tmp_path_factory.mktemp("model") / "tiny-llama", seed=7)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[VllmEngine]:
    eng = VllmEngine(
        VllmEngineConfig(
            model_dir=str(model_dir), block_size=BS, gpu_blocks=256, max_context=CTX, dtype="float32", seed=0
        )
    )
    yield eng
    eng.release_all()


def _req(rid: str, ids: list[int], ns: bytes = NS_A, max_tokens: int = 8, **kw: object) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        session_id=f"s-{rid}",
        token_ids=ids,
        block_hashes=block_hashes(ids, BS, ns),
        namespace=ns,
        max_tokens=max_tokens,
        block_size=BS,
        **kw,  # type: ignore[arg-type]
    )


def _run(eng: VllmEngine, req: EngineRequest) -> tuple[list[int], list[StepOutput]]:
    eng.add_request(req)
    tokens: list[int] = []
    outs: list[StepOutput] = []
    for _ in range(10_000):
        if not eng.has_work():
            break
        for o in eng.step():
            if o.request_id == req.request_id:
                outs.append(o)
                tokens += o.new_token_ids
    return tokens, outs


def _stored_hashes(eng: VllmEngine) -> list[int]:
    import time

    out: list[int] = []
    for _ in range(20):  # vLLM's publisher thread sends shortly after the step
        out += [h for ev in eng.drain_kv_events() if ev.kind == "stored" for h in ev.block_hashes]
        if out:
            time.sleep(0.1)
            out += [h for ev in eng.drain_kv_events() if ev.kind == "stored" for h in ev.block_hashes]
            return out
        time.sleep(0.05)
    return out


def _reference(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return llm_generate(model_dir, prompts, max_tokens, block_size=BS, max_model_len=CTX)


def test_greedy_output_equals_llm_generate_and_turn_two_reuses_vllm_counted_blocks(
    engine: VllmEngine, model_dir: Path
) -> None:
    tok = engine.tokenizer
    # the budget its LoadReports announce is vLLM's own per-step token budget
    assert engine.prefill_chunk_tokens == engine._sched.scheduler_config.max_num_batched_tokens == 2048
    turn1 = [ChatMessage("system", "You serve the kvmesh fleet. " * 8), ChatMessage("user", "Why cache?")]
    p1 = render_chat(tok, turn1)
    out1, o1 = _run(engine, _req("t1", p1, max_tokens=12))
    first = [o for o in o1 if o.first_token]
    assert len(first) == 1 and first[0].stats is not None
    assert first[0].stats.reused_tokens == 0 and first[0].stats.recomputed_tokens == len(p1)
    assert o1[-1].finished and o1[-1].finish_reason in ("length", "stop")
    # the KV events name the prompt's blocks by the hashes intake computes for it, nothing else
    stored = _stored_hashes(engine)
    full = (len(p1) + len(out1) - 1) // BS  # blocks whose KV vLLM computed (the last token's is not)
    assert stored == block_hashes(p1 + out1, BS, NS_A)[:full]
    assert engine.lookup_prefix(block_hashes(p1, BS, NS_A)) == len(p1) // BS

    # turn 2: the prompt is turn 1's prompt and answer and a new question (prefix-stable template)
    answer = tok.decode(out1)
    p2 = render_chat(tok, [*turn1, ChatMessage("assistant", answer), ChatMessage("user", "And then?")])
    assert (
        p2[: len(p1)] == p1
        and render_history(tok, [*turn1, ChatMessage("assistant", answer)])[: len(p1)] == p1
    )
    out2, o2 = _run(engine, _req("t2", p2, max_tokens=12))
    stats2 = next(o.stats for o in o2 if o.stats is not None)
    # what vLLM reused is every full block of turn 2's prompt that turn 1 computed
    h1 = block_hashes(p1 + out1, BS, NS_A)[:full]
    h2 = block_hashes(p2, BS, NS_A)
    shared = 0
    while shared < min(len(h1), len(h2), (len(p2) - 1) // BS) and h1[shared] == h2[shared]:
        shared += 1
    assert shared >= len(p1) // BS > 0
    assert stats2.reused_tokens == shared * BS
    assert stats2.recomputed_tokens == len(p2) - shared * BS

    # the answers equal vLLM's own LLM.generate on the same token ids, nothing cached there
    assert _reference(model_dir, [p1, p2], 12) == [out1, out2]
    # a random model that repeats one token could not tell wrong KV from right: this one does not
    assert len(set(out1)) > 3 and out1 != out2


def test_another_tenant_repeating_the_prompt_reuses_nothing(engine: VllmEngine) -> None:
    ids = render_chat(engine.tokenizer, [ChatMessage("user", "Tenant isolation matters a lot. " * 6)])
    _, oa = _run(engine, _req("iso-a", ids, NS_A, max_tokens=2))
    _, oa2 = _run(engine, _req("iso-a2", ids, NS_A, max_tokens=2))
    _, ob = _run(engine, _req("iso-b", ids, NS_B, max_tokens=2))
    reused = [next(o.stats.reused_tokens for o in outs if o.stats) for outs in (oa, oa2, ob)]
    assert reused[0] == 0 and reused[1] == (len(ids) - 1) // BS * BS and reused[2] == 0
    stored = _stored_hashes(engine)
    assert set(block_hashes(ids, BS, NS_B)) <= set(stored)  # B's copy is indexed under B's hashes


def test_sampled_decoding_is_repeatable_per_seed(engine: VllmEngine) -> None:
    ids = render_chat(engine.tokenizer, [ChatMessage("user", "Sample something.")])
    hot = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    a, _ = _run(engine, _req("samp-1", ids, max_tokens=16, sampling=hot))
    b, _ = _run(engine, _req("samp-2", ids, max_tokens=16, sampling=hot))
    c, _ = _run(engine, _req("samp-3", ids, max_tokens=16, sampling=SamplingParams(temperature=1.0, seed=12)))
    greedy, _ = _run(engine, _req("samp-4", ids, max_tokens=16))
    assert a == b and len(a) == 16
    assert a != c or a != greedy  # another seed, or greedy, picks other tokens


def test_a_dropped_zmq_message_is_recovered_without_restart(engine: VllmEngine) -> None:
    engine.drain_kv_events()
    ids = render_chat(engine.tokenizer, [ChatMessage("user", "A message lost on the way. " * 5)])
    sock = engine._events.socket  # read the next batch before the subscriber can: a dropped message
    engine.add_request(_req("gap-1", ids, max_tokens=1))
    while engine.has_work():
        engine.step()
    assert sock.poll(5000)
    sock.recv_multipart()
    gaps = engine._events.gaps
    ids2 = render_chat(engine.tokenizer, [ChatMessage("user", "The next one arrives. " * 5)])
    _run(engine, _req("gap-2", ids2, max_tokens=1))
    stored = _stored_hashes(engine)
    want = block_hashes(ids, BS, NS_A)[: len(ids) // BS]
    assert set(want) <= set(stored), "the dropped batch was not replayed"
    assert set(block_hashes(ids2, BS, NS_A)[: len(ids2) // BS]) <= set(stored)
    assert engine._events.gaps == gaps + 1 and engine._events.lost_gaps == 0


def test_lost_events_lead_to_a_reannounce_of_what_vllm_really_holds(engine: VllmEngine) -> None:
    ids = render_chat(engine.tokenizer, [ChatMessage("user", "Resync me. " * 12)])
    _run(engine, _req("resync", ids, max_tokens=1))
    _stored_hashes(engine)
    held = {b.block_hash for b in engine.bridge.held()}
    assert set(block_hashes(ids, BS, NS_A)[: len(ids) // BS]) <= held
    # a block the bridge believes in but vLLM does not hold (its removal was in the lost gap)
    ghost = engine.bridge.stored([424242], None, list(range(BS)), BS, [("kvmesh/0/" + NS_A.hex(),)])
    assert ghost
    engine._reannounce = True  # what a gap beyond the replay buffer sets
    events = engine.drain_kv_events()
    assert events[0].kind == "cleared"
    announced = {h for ev in events[1:] for h in ev.block_hashes}
    assert all(ev.kind == "stored" for ev in events[1:])
    assert announced == held and ghost[0].block_hash not in announced


def test_bad_input_gets_clear_errors_and_the_engine_serves_on(engine: VllmEngine) -> None:
    with pytest.raises(RequestRejected, match="does not fit the context"):
        engine.add_request(_req("long", list(range(10, 10 + CTX + 5))))
    with pytest.raises(RequestRejected, match="block size 16"):
        engine.add_request(EngineRequest("bs", "s", [1, 2, 3], [], NS_A, 4, block_size=16))
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        engine.add_request(_req("vocab", [1, 2, 10**7]))
    with pytest.raises(RequestRejected, match="empty prompt"):
        engine.add_request(_req("empty", []))
    ids = render_chat(engine.tokenizer, [ChatMessage("user", "Still there?")])
    out, outs = _run(engine, _req("after", ids, max_tokens=4))
    assert len(out) == 4 and outs[-1].finish_reason == "length"


def test_abort_ends_the_request_as_cancelled(engine: VllmEngine) -> None:
    ids = render_chat(engine.tokenizer, [ChatMessage("user", "Talk for a long time.")])
    engine.add_request(_req("abort-me", ids, max_tokens=500))
    engine.step()
    engine.step()
    assert engine.load().active_requests == 1
    assert engine.abort("abort-me") and not engine.abort("abort-me")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [("abort-me", "cancelled")]
    while engine.has_work():
        engine.step()
    load = engine.load()
    assert load.active_requests == 0 and load.queue_depth == 0
    assert load.tiers[0].tier == "gpu" and load.tiers[0].total_blocks == 256


def test_a_full_batch_reports_the_wait_for_a_place(engine: VllmEngine) -> None:
    """vLLM runs at most ``max_num_seqs`` requests (8 here): the ninth and tenth wait, and the load
    says for how many decode steps a request queued now would (the running ones' steps left)."""
    reqs = [_req(f"slot-{i}", [40 + i] * 40, max_tokens=6 + i) for i in range(10)]
    for r in reqs:
        engine.add_request(r)
    engine.step()
    load = engine.load()
    assert load.active_requests == 8 and load.queue_depth == 2
    running = sorted(r.max_tokens - r.num_output_tokens for r in engine._sched.running)
    # before this batch, answers here ran to their limits (the earlier tests'), never past a limit
    assert 1 <= load.slot_wait_steps <= running[2]
    # room in the GPU tier (kvmesh_core/kv_room.py): the two queued prompts' blocks come off the free
    # ones; each running request (none shares a block) frees its own blocks, the soonest first
    assert load.kv_free_blocks == load.tiers[0].free_blocks - 2 * 2
    steps = [s for s, _ in load.kv_release]
    assert steps == sorted(steps) and len(set(steps)) == len(steps) and steps[0] >= 1
    assert sum(n for _, n in load.kv_release) == sum(
        len(engine._sched.kv_cache_manager.get_block_ids(r.request_id)[0]) for r in engine._sched.running
    )
    # the batch is full and two wait: its steps only decode, and they are timed
    before = engine._step_meter.ms
    engine.step()
    assert engine.load().queue_depth == 2 and engine._step_meter.ms not in (None, before)
    while engine.has_work():
        engine.step()
    assert engine.load().slot_wait_steps == 0
    load = engine.load()
    assert load.kv_release == [] and load.kv_free_blocks == load.tiers[0].free_blocks


def test_calibration_measures_through_vllm(engine: VllmEngine) -> None:
    p = engine.calibrate(short=64, long=512, decode_ctx=64)
    assert p.prefill_ms_per_token > 0 and p.decode_ms_per_step > 0
    assert p.block_size == BS and p.block_bytes == engine.block_bytes > 0
    assert engine.load().active_requests == 0


def test_model_directory_and_block_size_are_checked_before_vllm_starts(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="does not exist"):
        VllmEngine(VllmEngineConfig(model_dir=str(tmp_path / "nope")))
    with pytest.raises(ModelConfigError, match=r"no config\.json"):
        VllmEngine(VllmEngineConfig(model_dir=str(tmp_path)))
    with pytest.raises(ModelConfigError, match="multiple of 32"):
        check_block_size(16, on_cpu=True)
    check_block_size(16, on_cpu=False)
    check_block_size(64, on_cpu=True)
