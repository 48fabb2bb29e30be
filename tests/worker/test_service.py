"""The worker service end to end on a real broker: assignments in, tokens and completions out, and
KV blocks fetched from a peer worker over the data plane (two workers in one test)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest

from kvmesh_core.tokenizer import ByteTokenizer, ChatMessage, render_chat
from schemas.blocks import block_hashes, tenant_namespace
from schemas.chat_requests import chat_request
from schemas.messages import (
    Assignment,
    CancelRequest,
    ChatRequest,
    Completion,
    Estimate,
    FetchPlan,
    KvEvent,
    LoadReport,
)
from services.worker.config import WorkerSettings
from services.worker.service import WorkerService
from streams import topics
from streams.clock import now_ms
from streams.consumer import TypedConsumer
from streams.producer import TypedProducer
from streams.settings import KafkaSettings
from streams.tasks import stop_task

pytestmark = pytest.mark.integration

TOK = ByteTokenizer()
NS = tenant_namespace("acme")


def _request(rid: str, tokens: list[int], max_tokens: int = 12, **kw: object) -> ChatRequest:
    return chat_request(
        tokens,
        request_id=rid,
        session_id="sess-1",
        tenant="acme",
        block_size=16,
        max_tokens=max_tokens,
        arrival_ms=now_ms(),
        **kw,
    )


def _assign(
    req: ChatRequest, worker: str, reuse: int = 0, fetch: list[FetchPlan] | None = None
) -> Assignment:
    return Assignment(
        request=req,
        worker_id=worker,
        reuse_blocks=reuse,
        prefill_tokens=len(req.token_ids) - reuse * 16,
        estimate=Estimate(ttft_ms=1.0, queue_ms=0.0, recompute_ms=1.0, transfer_ms=0.0, policy="test"),
        fetch=fetch or [],
    )


class Fleet:
    """Two workers, a producer standing in for the scheduler, and a reply reader."""

    def __init__(self, kafka: KafkaSettings) -> None:
        self.kafka = kafka
        self.workers: dict[str, WorkerService] = {}
        self.producer = TypedProducer(kafka, "test-scheduler")
        self.replies = TypedConsumer(kafka, [topics.REPLIES], group_id=None, from_beginning=True)
        self.completions: dict[str, Completion] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self, ids: list[str]) -> None:
        for wid in ids:
            await self.add_worker(wid)
        await self.producer.start()
        await self.replies.start()

        async def on_reply(rec: object) -> None:
            msg = rec.message  # type: ignore[attr-defined]
            if isinstance(msg, Completion):
                self.completions[msg.request_id] = msg

        self._task = asyncio.create_task(self.replies.run(on_reply))

    async def add_worker(self, wid: str, **overrides: object) -> WorkerService:
        s = WorkerSettings(
            worker_id=wid,
            insecure_dev_transfer=True,
            calibrate=False,
            gpu_blocks=256,
            dram_blocks=256,
            load_interval_ms=200,
            kafka=self.kafka,
            **overrides,  # type: ignore[arg-type]
        )
        w = WorkerService(s)
        await w.start()
        self.workers[wid] = w
        return w

    async def completion(self, rid: str, timeout: float = 60.0) -> Completion:
        async with asyncio.timeout(timeout):
            while rid not in self.completions:
                await asyncio.sleep(0.05)
        return self.completions[rid]

    async def run(self, a: Assignment, timeout: float = 60.0) -> Completion:
        await self.producer.send(topics.ASSIGNMENTS, a)
        return await self.completion(a.request.request_id, timeout)

    async def stop(self) -> None:
        await stop_task(self._task)
        await self.replies.stop()
        await self.producer.stop()
        for w in self.workers.values():
            await w.stop()


@pytest.fixture
async def fleet(kafka_settings: KafkaSettings) -> AsyncIterator[Fleet]:
    f = Fleet(kafka_settings)
    await f.start(["worker-a", "worker-b"])
    try:
        yield f
    finally:
        await f.stop()


class StalledPeer:
    """A data-plane peer that takes a pull request and sends nothing until ``release()``."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self._release = asyncio.Event()
        self._server: asyncio.Server | None = None
        self.address = ""

    async def __aenter__(self) -> StalledPeer:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1)
            self.asked.set()
            await self._release.wait()
            writer.close()

        self._server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def release(self) -> None:
        self._release.set()

    async def __aexit__(self, *exc: object) -> None:
        self.release()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


def _stalled_plan(peer: StalledPeer, tokens: list[int]) -> FetchPlan:
    return FetchPlan(
        peer_worker="worker-stalled",
        peer_address=peer.address,
        block_hashes=block_hashes(tokens, 16, NS),
        first_block=0,
    )


def _turn1() -> list[int]:
    msgs = [
        ChatMessage("system", "You are a terse assistant. " * 4),
        ChatMessage("user", "Name three colours."),
    ]
    return render_chat(TOK, msgs)


async def test_turn_two_on_another_worker_fetches_blocks_and_matches(fleet: Fleet) -> None:
    p1 = _turn1()
    c1 = await fleet.run(_assign(_request("t1", p1), "worker-a"))
    assert c1.finish_reason in ("stop", "length") and c1.worker_id == "worker-a"
    assert c1.reused_tokens == 0 and c1.recomputed_tokens == len(p1)
    answer = c1.output_token_ids
    p2 = (
        p1
        + answer
        + [TOK.END]
        + TOK.role_ids("user")
        + TOK.encode("And three more?")
        + [TOK.END]
        + TOK.role_ids("assistant")
    )
    h2 = block_hashes(p2, 16, NS)
    held = fleet.workers["worker-a"].engine.lookup_prefix(h2)
    assert held >= len(p1) // 16  # turn 1's prompt blocks (and some answer blocks) stayed cached on A

    # B gets turn 2 with a plan to fetch A's blocks over the data plane.
    plan = FetchPlan(
        peer_worker="worker-a",
        peer_address=fleet.workers["worker-a"].transfer_address,
        block_hashes=h2[:held],
        first_block=0,
    )
    c2b = await fleet.run(_assign(_request("t2-b", p2), "worker-b", fetch=[plan]))
    # The same turn on A (all local) is the reference: B must produce exactly its tokens.
    c2a = await fleet.run(_assign(_request("t2-a", p2), "worker-a", reuse=held))
    assert c2b.worker_id == "worker-b" and c2a.worker_id == "worker-a"
    assert c2b.output_token_ids == c2a.output_token_ids
    assert c2b.fetched_tokens > 0 and c2b.fetched_tokens + c2b.reused_tokens >= (held - 1) * 16
    assert c2a.reused_tokens >= (held - 1) * 16 and c2a.fetched_tokens == 0
    assert c2b.fallback is None


async def test_failed_fetch_falls_back_to_recompute_with_identical_output(fleet: Fleet) -> None:
    p1 = _turn1()
    ref = await fleet.run(_assign(_request("ref", p1), "worker-a"))
    h = block_hashes(p1, 16, NS)
    dead = FetchPlan(peer_worker="worker-gone", peer_address="127.0.0.1:1", block_hashes=h, first_block=0)
    c = await fleet.run(_assign(_request("fb", p1), "worker-b", fetch=[dead]))
    assert c.finish_reason in ("stop", "length")
    assert c.output_token_ids == ref.output_token_ids
    assert c.fetched_tokens == 0 and c.recomputed_tokens == len(p1)
    assert c.fallback and "incomplete" in c.fallback
    assert fleet.workers["worker-b"].transfer_metrics.fetch_failures.total() == 1


async def test_bad_requests_get_error_completions_and_the_worker_goes_on(fleet: Fleet) -> None:
    late = _request("late", _turn1(), deadline_ms=now_ms() - 1000)
    c = await fleet.run(_assign(late, "worker-a"))
    assert c.finish_reason == "rejected" and "deadline" in (c.error or "")
    too_long = _request("long", [65] * 10_000)
    c = await fleet.run(_assign(too_long, "worker-a"))
    assert c.finish_reason == "error" and c.error
    # garbage on the assignments topic goes to the dead-letter topic; the next assignment still runs
    await fleet.producer.send_raw(topics.ASSIGNMENTS.name, b"\x00garbage", key="worker-a")
    ok = await fleet.run(_assign(_request("ok", _turn1()), "worker-a"))
    assert ok.finish_reason in ("stop", "length") and ok.completion_tokens > 0


async def test_worker_publishes_load_and_kv_events(fleet: Fleet) -> None:
    p1 = _turn1()
    await fleet.run(_assign(_request("ev", p1), "worker-a"))
    seen_load: set[str] = set()
    stored: set[int] = set()
    timed: set[str] = set()  # workers whose reports carry a measured decode step
    consumer = TypedConsumer(fleet.kafka, [topics.LOAD, topics.KV_EVENTS], group_id=None, from_beginning=True)
    await consumer.start()
    try:
        async with asyncio.timeout(20):
            while not (
                {"worker-a", "worker-b"} <= seen_load
                and set(block_hashes(p1, 16, NS)) <= stored
                and "worker-a" in timed
            ):
                for rec in await consumer.getmany(timeout_ms=200):
                    if isinstance(rec.message, LoadReport):
                        seen_load.add(rec.message.worker_id)
                        assert rec.message.transfer_address.startswith("127.0.0.1:")
                        # its chunked-prefill budget, for the decode steps a long prefill carries
                        engine = fleet.workers[rec.message.worker_id].engine
                        assert rec.message.prefill_chunk_tokens == engine.cfg.prefill_chunk > 0  # type: ignore[attr-defined]
                        # the request it ran decoded: its steps as they ran, for the scheduler's waits
                        if rec.message.recent_decode_ms_per_step > 0:
                            timed.add(rec.message.worker_id)
                    elif isinstance(rec.message, KvEvent) and rec.message.worker_id == "worker-a":
                        stored.update(rec.message.block_hashes if rec.message.kind == "stored" else [])
    finally:
        await consumer.stop()
    # and its metrics say what its latest report said
    assert fleet.workers["worker-a"].metrics.value("decode_step_seconds") > 0


async def test_an_assignment_decided_twice_runs_once(fleet: Fleet) -> None:
    """A request decided again (a rebalance, a second replica) reaches the worker twice: it is
    decoded once, and one Completion answers it."""
    req = _request("twice", _turn1())
    first = await fleet.run(_assign(req, "worker-a"))
    worker = fleet.workers["worker-a"]
    before = worker.metrics.value("requests_total", outcome="completed")
    again = _assign(req, "worker-a")  # a new record, not a redelivery of the old one
    await fleet.producer.send(topics.ASSIGNMENTS, again)
    async with asyncio.timeout(20):
        while worker.metrics.value("assignments_total", kind="duplicate") < 1:
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    assert (
        worker.metrics.value("requests_total", outcome="completed") == before
        and worker.metrics.value("assignments_total", kind="accepted") == 1
    )
    assert fleet.completions["twice"] == first


async def test_an_assignment_decided_for_a_previous_instance_is_skipped(fleet: Fleet) -> None:
    """After a restart the scheduler decides the old instance's requests again; the new instance
    must not also run what was decided for the old one (Assignment.worker_epoch)."""

    worker = fleet.workers["worker-a"]
    old = msgspec.structs.replace(
        _assign(_request("stale", _turn1()), "worker-a"), worker_epoch=worker._started_ms - 1
    )
    await fleet.producer.send(topics.ASSIGNMENTS, old)
    async with asyncio.timeout(20):
        while worker.metrics.value("assignments_total", kind="stale") < 1:
            await asyncio.sleep(0.05)
    fresh = msgspec.structs.replace(
        _assign(_request("fresh", _turn1()), "worker-a"), worker_epoch=worker._started_ms
    )
    c = await fleet.run(fresh)
    assert c.finish_reason in ("stop", "length") and "stale" not in fleet.completions


async def _until_resynced(consumer: TypedConsumer, worker: str, held: set[int]) -> list[KvEvent]:
    """The worker's KV events until a ``cleared`` followed by every block of ``held``."""
    seen: list[KvEvent] = []
    async with asyncio.timeout(20):
        while True:
            recs = await consumer.getmany(timeout_ms=200)
            seen += [r.message for r in recs if r.message.worker_id == worker]
            kinds = [e.kind for e in seen]
            if "cleared" in kinds and held <= {
                h for e in seen[kinds.index("cleared") :] for h in e.block_hashes
            }:
                return seen


async def test_kv_events_lost_to_a_broker_outage_are_repaired_by_a_resync(fleet: Fleet) -> None:
    """A KV event the broker never took leaves a gap in the fleet's view of the worker; the worker
    then publishes ``cleared`` and a snapshot of everything it holds, replacing that view whole."""
    from streams.producer import PublishError

    worker = fleet.workers["worker-a"]
    assert worker._producer is not None
    real_send = worker._producer.send
    failed: list[object] = []

    async def flaky(topic, message, *a, **kw):  # type: ignore[no-untyped-def]
        if topic is topics.KV_EVENTS and not failed:
            failed.append(message)
            raise PublishError("broker away")
        return await real_send(topic, message, *a, **kw)

    worker._producer.send = flaky  # type: ignore[method-assign]
    c = await fleet.run(_assign(_request("gap", _turn1()), "worker-a"))
    held = set(block_hashes(_turn1(), 16, NS)[: len(_turn1()) // 16])
    consumer = TypedConsumer(fleet.kafka, [topics.KV_EVENTS], group_id=None, from_beginning=True)
    await consumer.start()
    try:
        await _until_resynced(consumer, "worker-a", held)
    finally:
        await consumer.stop()
    assert failed and c.finish_reason in ("stop", "length")
    assert worker.metrics.value("kv_event_gaps_total") == 1 and not worker._kv_resync


async def test_a_resync_request_replaces_the_fleets_view_with_numbered_events(fleet: Fleet) -> None:
    """Asked to resync, the worker publishes ``cleared`` then every block it holds, all numbered in
    one sequence of its epoch (what consumers check for gaps)."""
    from schemas.messages import ResyncRequest

    worker = fleet.workers["worker-a"]
    await fleet.run(_assign(_request("rs", _turn1()), "worker-a"))
    held = set(block_hashes(_turn1(), 16, NS)[: len(_turn1()) // 16])
    consumer = TypedConsumer(fleet.kafka, [topics.KV_EVENTS], group_id=None, from_beginning=True)
    await consumer.start()
    try:
        await fleet.producer.send(topics.CONTROL, ResyncRequest("worker-a", "test"))
        seen = await _until_resynced(consumer, "worker-a", held)
    finally:
        await consumer.stop()
    seqs = [e.seq for e in seen]
    assert seqs == list(range(1, len(seqs) + 1)) and {e.epoch for e in seen} == {worker._started_ms}


def _other() -> list[int]:
    """A prompt that shares no block with :func:`_turn1`'s."""
    return render_chat(TOK, [ChatMessage("user", "Count from one to nine, slowly, in words please.")])


async def _pull_then_queue_behind(fleet: Fleet, peer: StalledPeer, tokens: list[int]) -> None:
    """On worker-c: "pulling" starts a pull the peer holds open, then "behind", another prompt, is
    assigned after it."""
    await fleet.producer.send(
        topics.ASSIGNMENTS,
        _assign(_request("pulling", tokens), "worker-c", fetch=[_stalled_plan(peer, tokens)]),
    )
    async with asyncio.timeout(30):
        await peer.asked.wait()
    await fleet.producer.send(topics.ASSIGNMENTS, _assign(_request("behind", _other()), "worker-c"))


@pytest.mark.parametrize("admission", ["serial", "overlap"])
async def test_a_cancel_is_answered_during_a_stalled_pull_and_the_queue_behind_it_still_runs(
    fleet: Fleet, admission: str
) -> None:
    # A long fetch timeout: the peer is released by the test, never by the client giving up, so the
    # cancel is known to have been answered while the pull was still in flight.
    await fleet.add_worker("worker-c", fetch_timeout_s=120.0, admission=admission)
    p1 = _turn1()
    async with StalledPeer() as peer:
        await _pull_then_queue_behind(fleet, peer, p1)
        if admission == "overlap":
            # the request behind the pull runs while the pull is still on the link
            behind = await fleet.completion("behind")
            assert not peer._release.is_set()
        # Under serial a request queued behind the pull waits with it, and a cancel answers it too.
        # (Under overlap it would start at once, so it may have tokens before its cancel arrives.)
        cancels = ("pulling", "dropped") if admission == "serial" else ("pulling",)
        if admission == "serial":
            await fleet.producer.send(topics.ASSIGNMENTS, _assign(_request("dropped", p1), "worker-c"))
        for rid in cancels:
            await fleet.producer.send(
                topics.ASSIGNMENTS, CancelRequest(request_id=rid, session_id="sess-1"), key="worker-c"
            )
        # Answered while the peer still holds the pull open, with no token.
        for rid in cancels:
            c = await fleet.completion(rid)
            assert c.finish_reason == "cancelled" and c.output_token_ids == []
        assert not peer._release.is_set()
        if admission == "serial":
            assert "behind" not in fleet.completions  # it waits for the pull
        peer.release()
        behind = await fleet.completion("behind")
    assert behind.finish_reason in ("stop", "length") and behind.output_token_ids
    await asyncio.sleep(0.5)  # the cancelled pull's request must not be run after its pull ends
    worker = fleet.workers["worker-c"]
    assert not worker._running and not worker._pending
    assert fleet.completions["pulling"].finish_reason == "cancelled"


async def test_a_request_keeps_its_place_while_its_pull_runs_and_recomputes_what_did_not_land(
    fleet: Fleet,
) -> None:
    """Overlap admission: the pulling request waits in the engine's queue (counted as queued work),
    the one behind it runs meanwhile, and a pull that brings nothing still lets it run, recomputed,
    with the same tokens as on a worker that never pulled."""
    worker = await fleet.add_worker("worker-c", fetch_timeout_s=120.0)
    assert worker.settings.admission == "overlap"  # the default
    p1 = _turn1()
    async with StalledPeer() as peer:
        await _pull_then_queue_behind(fleet, peer, p1)
        await fleet.completion("behind")
        assert "pulling" not in fleet.completions
        load = worker.engine.load()
        assert load.queue_depth == 1 and load.queued_prefill_tokens == len(p1)
        assert not worker.engine.has_work()  # a lone pull does not spin the engine thread
        assert worker.metrics.value("pulls") == 1
        peer.release()  # the peer closes without a block: the pull lands nothing
        pulled = await fleet.completion("pulling")
    assert worker.metrics.value("pulls") == 0
    alone = await fleet.run(_assign(_request("alone", p1), "worker-a"))
    assert pulled.finish_reason == alone.finish_reason
    assert pulled.output_token_ids == alone.output_token_ids
    assert pulled.fetched_tokens == 0
    # idle again: the room for the next prompt is the whole unreferenced GPU tier, and the gauge says so
    await worker._publish_load(force=True)
    idle = worker.engine.load()
    assert idle.kv_release == [] and idle.kv_free_blocks == idle.tiers[0].free_blocks > 0
    assert worker.metrics.value("kv_free_blocks") == idle.kv_free_blocks
    assert worker.engine.load().queue_depth == 0


async def test_a_request_whose_next_blocks_are_on_the_link_waits_for_that_pull_and_reuses_them(
    fleet: Fleet,
) -> None:
    """Overlap admission: turn 1 ran on worker-a; worker-c pulls its blocks for "pulling", and "same",
    the same prompt assigned while that pull is on the link (the scheduler counted the blocks as
    coming), waits for it and reuses them instead of computing them again beside it; "other", which
    shares nothing with it, runs meanwhile. Both answers match a worker that computed everything."""
    p1 = _turn1()
    await fleet.run(_assign(_request("t1", p1), "worker-a"))
    worker = await fleet.add_worker("worker-c")
    hashes = block_hashes(p1, 16, NS)
    held = fleet.workers["worker-a"].engine.lookup_prefix(hashes)
    assert held == len(p1) // 16
    plan = FetchPlan("worker-a", fleet.workers["worker-a"].transfer_address, hashes[:held], 0)
    gate = asyncio.Event()
    real_pull = worker._pull

    async def gated_pull(a, entry, sink):  # type: ignore[no-untyped-def]
        await gate.wait()
        await real_pull(a, entry, sink)

    worker._pull = gated_pull  # type: ignore[method-assign]
    await fleet.producer.send(topics.ASSIGNMENTS, _assign(_request("pulling", p1), "worker-c", fetch=[plan]))
    async with asyncio.timeout(30):
        while not worker._pulling:
            await asyncio.sleep(0.02)
    await fleet.producer.send(topics.ASSIGNMENTS, _assign(_request("same", p1), "worker-c"))
    await fleet.producer.send(topics.ASSIGNMENTS, _assign(_request("other", _other()), "worker-c"))
    await fleet.completion("other")  # the engine ran past both while the pull was held
    assert "same" not in fleet.completions and "pulling" not in fleet.completions
    gate.set()
    pulled, same = await fleet.completion("pulling"), await fleet.completion("same")
    assert pulled.fetched_tokens == held * 16
    assert same.fetched_tokens == 0 and same.reused_tokens >= (held - 1) * 16  # what the pull brought
    assert same.recomputed_tokens < 32
    alone = await fleet.run(_assign(_request("alone", p1), "worker-b"))
    assert pulled.output_token_ids == same.output_token_ids == alone.output_token_ids
    assert not worker._pulling


async def test_a_request_waiting_for_another_ones_pull_runs_when_that_pull_brings_nothing(
    fleet: Fleet,
) -> None:
    """The pull it waits for stalls and then lands nothing: it runs, recomputed, as the puller does."""
    worker = await fleet.add_worker("worker-c", fetch_timeout_s=120.0)
    p1 = _turn1()
    async with StalledPeer() as peer:
        await _pull_then_queue_behind(fleet, peer, p1)
        await fleet.producer.send(topics.ASSIGNMENTS, _assign(_request("same", p1), "worker-c"))
        await fleet.completion("behind")
        hashes = block_hashes(p1, 16, NS)
        async with asyncio.timeout(30):  # "same" waits for the pull that carries its first block
            while (carrier := worker._pulling.carrier(hashes, 0)) is None or not carrier.waiters:
                await asyncio.sleep(0.02)
        assert "same" not in fleet.completions
        peer.release()
        same = await fleet.completion("same")
        pulled = await fleet.completion("pulling")
    assert same.finish_reason in ("stop", "length") and same.recomputed_tokens == len(p1)
    assert same.output_token_ids == pulled.output_token_ids
    assert not worker._pulling


@pytest.mark.parametrize("admission", ["serial", "overlap"])
async def test_stopping_during_a_stalled_pull_answers_every_request_not_yet_started(
    fleet: Fleet, admission: str
) -> None:
    worker = await fleet.add_worker("worker-c", fetch_timeout_s=120.0, admission=admission)
    async with StalledPeer() as peer:
        await _pull_then_queue_behind(fleet, peer, _turn1())
        if admission == "serial":
            async with asyncio.timeout(30):
                while "behind" not in worker._pending:
                    await asyncio.sleep(0.05)
        async with asyncio.timeout(30):
            while "pulling" not in worker._running and "pulling" not in worker._pending:
                await asyncio.sleep(0.05)
        await worker.stop()
        c = await fleet.completion("pulling")
        assert c.finish_reason == "error" and c.error == "worker shutting down"
        if admission == "serial":
            c = await fleet.completion("behind")
            assert c.finish_reason == "error" and c.error == "worker shutting down"


async def test_an_admission_that_fails_is_answered_and_the_queue_behind_it_still_runs(fleet: Fleet) -> None:
    worker = fleet.workers["worker-a"]
    real_sink = worker.engine.block_sink
    calls = 0

    def failing_once():  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("sink unavailable")
        return real_sink()

    worker.engine.block_sink = failing_once  # type: ignore[method-assign]
    p1 = _turn1()
    await fleet.producer.send(topics.ASSIGNMENTS, _assign(_request("broken", p1), "worker-a"))
    await fleet.producer.send(topics.ASSIGNMENTS, _assign(_request("after", p1), "worker-a"))
    broken = await fleet.completion("broken")
    after = await fleet.completion("after")
    assert broken.finish_reason == "error" and "sink unavailable" in (broken.error or "")
    assert after.finish_reason in ("stop", "length") and after.output_token_ids
    assert not worker._pending
