"""The scheduler service end to end on a real broker, with fake worker reports published to Kafka."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from schemas.messages import Assignment, CancelRequest, Completion, KvEvent
from services.fleet_directory.snapshot import DirectorySnapshot
from services.scheduler.config import SchedulerSettings
from services.scheduler.service import SchedulerService
from streams.clock import now_ms
from streams.consumer import TypedConsumer
from streams.producer import TypedProducer
from streams.settings import KafkaSettings
from streams.topics import ASSIGNMENTS, KV_EVENTS, LOAD, REPLIES, REQUESTS

from .factories import load, prompt, request, stored

pytestmark = pytest.mark.integration


async def wait_for(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def collect(
    consumer: TypedConsumer, want: Callable[[list[Any]], bool], timeout_s: float = 20.0
) -> list:
    got: list[Any] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not want(got):
        if loop.time() > deadline:
            raise AssertionError(f"got only {got!r}")
        got.extend(r.message for r in await consumer.getmany(timeout_ms=200))
    return got


def settings(kafka: KafkaSettings, **kw: Any) -> SchedulerSettings:
    base: dict[str, Any] = {"use_snapshot": False, "create_topics": False, "catch_up_timeout_s": 10}
    return SchedulerSettings(kafka=kafka, **{**base, **kw})


async def test_service_assigns_rejects_and_forwards_cancels(kafka_settings: KafkaSettings) -> None:
    t0 = now_ms()
    req = request("r1", prompt(100), arrival_ms=t0 + 10)
    async with TypedProducer(kafka_settings, "fake-workers") as prod:
        for w in ("w-0", "w-1"):
            await prod.send(LOAD, load(w, t0))
        await prod.send(KV_EVENTS, stored("w-1", req.block_hashes, event_ms=t0))
        service = SchedulerService(settings(kafka_settings))
        out = TypedConsumer(kafka_settings, [ASSIGNMENTS, REPLIES], None, from_beginning=True)
        await out.start()
        try:
            async with service:
                assert sorted(service.view.workers) == ["w-0", "w-1"]  # caught up before requests
                await prod.send(REQUESTS, req)
                late = request("r2", prompt(40, 3), arrival_ms=t0 + 20, deadline_ms=t0 - 1)
                await prod.send(REQUESTS, late)
                got = await collect(out, lambda g: len(g) >= 2)
                assigned = [m for m in got if isinstance(m, Assignment)]
                rejected = [m for m in got if isinstance(m, Completion)]
                assert [(a.request.request_id, a.worker_id, a.reuse_blocks) for a in assigned] == [
                    ("r1", "w-1", 6)
                ]
                # exact replay: the first decision after a start carries every position it had applied
                inputs = assigned[0].inputs
                assert inputs is not None and inputs.full and inputs.batch == 1
                assert req.arrival_ms <= inputs.now_ms <= t0 + 20  # the largest message time seen
                assert sum(v for k, v in inputs.applied.items() if k.startswith(LOAD.name)) == 2
                assert all(inputs.since[k] <= v for k, v in inputs.applied.items())
                assert [(c.request_id, c.finish_reason) for c in rejected] == [("r2", "rejected")]
                assert "deadline" in (rejected[0].error or "")
                await prod.send(REQUESTS, CancelRequest("r1", req.session_id))
                fwd = await collect(out, lambda g: any(isinstance(m, CancelRequest) for m in g))
                cancel = next(m for m in fwd if isinstance(m, CancelRequest))
                assert (cancel.request_id, cancel.worker_id) == ("r1", "w-1")
        finally:
            await out.stop()


async def test_restart_from_snapshot_reaches_same_view(
    kafka_settings: KafkaSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    t0 = now_ms()
    hashes = [request(f"p{i}", prompt(160, i)).block_hashes for i in range(4)]
    async with TypedProducer(kafka_settings, "fake-workers") as prod:
        for w in ("w-0", "w-1", "w-2"):
            await prod.send(LOAD, load(w, t0))
        for i, hs in enumerate(hashes[:2]):
            await prod.send(KV_EVENTS, stored(f"w-{i}", hs, event_ms=t0 + i))
        first = SchedulerService(settings(kafka_settings))
        async with first:
            await wait_for(lambda: len(first.view.index) == 20)
        # the KV manager's snapshot of the same records, with the offsets it reached
        probe = TypedConsumer(kafka_settings, [KV_EVENTS], None)
        await probe.start()
        ends = await probe.end_offsets()
        await probe.stop()
        snap = DirectorySnapshot(
            blocks={h: hs for h, _, hs in first.view.index.items()},
            parents={h: p for h, p, _ in first.view.index.items()},
            offsets={KV_EVENTS.name: {p: off for (_, p), off in ends.items()}},
            workers={},
        )
        # more events while the scheduler is down
        await prod.send(KV_EVENTS, stored("w-2", hashes[2], event_ms=t0 + 5))
        await prod.send(KV_EVENTS, stored("w-0", hashes[3][:4], tier="dram", event_ms=t0 + 6))

        async def fake_read_snapshot(_client: Any) -> DirectorySnapshot:
            return snap

        monkeypatch.setattr("services.fleet_directory.snapshot.read_snapshot", fake_read_snapshot)
        restarted = SchedulerService(settings(kafka_settings, use_snapshot=True), redis_client=object())
        never_stopped = SchedulerService(settings(kafka_settings, scheduler_id="scheduler-1"))
        async with restarted, never_stopped:
            assert restarted.snapshot_loaded
            # the restarted replica skipped the records the snapshot covers
            assert restarted.metrics.value("state_records_total") < never_stopped.metrics.value(
                "state_records_total"
            )
            assert len(restarted.view.index) == 34
            assert restarted.view.index.to_dict() == never_stopped.view.index.to_dict()


async def test_a_restarted_worker_gets_its_old_in_flight_requests_decided_again_once(
    kafka_settings: KafkaSettings,
) -> None:
    """A worker restarts (its LoadReport's started_ms moves on): the requests its old instance had
    in flight are decided again, each once, for the new instance."""

    t0 = now_ms()
    async with TypedProducer(kafka_settings, "fake-workers") as prod:
        await prod.send(LOAD, msgspec.structs.replace(load("w-0", t0), started_ms=t0 - 5000))
        service = SchedulerService(settings(kafka_settings))
        out = TypedConsumer(kafka_settings, [ASSIGNMENTS], None, from_beginning=True)
        await out.start()
        try:
            async with service:
                for i in range(3):
                    await prod.send(REQUESTS, request(f"old-{i}", prompt(40, i), arrival_ms=t0 + 1 + i))
                first = await collect(out, lambda g: len([m for m in g if isinstance(m, Assignment)]) >= 3)
                assert {m.worker_id for m in first if isinstance(m, Assignment)} == {"w-0"}
                # w-0 restarts at t0 + 100 and reports; old-0 had completed before it died
                await prod.send(REPLIES, Completion("old-0", "s-old-0", "w-0", "stop", 40, 1))
                await wait_for(lambda: "old-0" not in service._assigned)
                await prod.send(LOAD, msgspec.structs.replace(load("w-0", t0 + 200), started_ms=t0 + 100))
                again = await collect(out, lambda g: len([m for m in g if isinstance(m, Assignment)]) >= 2)
                ids = sorted(m.request.request_id for m in again if isinstance(m, Assignment))
                assert ids == ["old-1", "old-2"]
                assert all(m.worker_epoch == t0 + 100 for m in again)  # for the new instance
                # the same report again (a heartbeat) re-decides nothing
                await prod.send(LOAD, msgspec.structs.replace(load("w-0", t0 + 300), started_ms=t0 + 100))
                await asyncio.sleep(1.0)
                assert not [r for r in await out.getmany(timeout_ms=500) if isinstance(r.message, Assignment)]
                assert service.metrics.value("redispatches_total") == 2
                # a late WorkerLost for the old instance (declared before the new one reported) leaves
                # what was decided for the new instance where it is
                from schemas.messages import WorkerLost
                from streams.topics import CONTROL

                await prod.send(CONTROL, WorkerLost("w-0", t0 + 90, t0 + 150))
                await wait_for(lambda: service.view._lost.get("w-0") == t0 + 150)
                await asyncio.sleep(1.0)
                assert service.metrics.value("redispatches_total") == 2
                # a KV manager that lags (last saw w-0 before the scheduler did) declares it lost late:
                # the scheduler heard from that instance since, so it re-decides nothing
                await prod.send(CONTROL, WorkerLost("w-0", t0 + 250, t0 + 10_000))
                await wait_for(lambda: service.view._lost.get("w-0") == t0 + 10_000)
                await asyncio.sleep(0.5)
                assert service.metrics.value("redispatches_total") == 2
        finally:
            await out.stop()


async def test_a_running_scheduler_heartbeats(kafka_settings: KafkaSettings) -> None:
    from schemas.messages import ServiceHeartbeat
    from streams.topics import HEARTBEATS

    service = SchedulerService(settings(kafka_settings, scheduler_id="scheduler-7"))
    beats = TypedConsumer(kafka_settings, [HEARTBEATS], None, from_beginning=True)
    await beats.start()
    try:
        async with service:
            got = await collect(
                beats, lambda g: len([b for b in g if isinstance(b, ServiceHeartbeat)]) >= 2, 10
            )
        assert {(b.service, b.instance_id) for b in got} == {("scheduler", "scheduler-7")}
        assert got[1].report_ms > got[0].report_ms and got[0].started_ms <= got[0].report_ms
    finally:
        await beats.stop()


async def test_held_requests_survive_a_replica_and_decided_ones_are_not_decided_again(
    kafka_settings: KafkaSettings, redis_server: Any
) -> None:
    """A replica holds a request (no live worker for its model) while it decides two others, then
    dies. Its successor decides the held one when a worker comes, and skips the two it reads again."""

    from streams.settings import RedisSettings

    t0 = now_ms()
    far = t0 + 120_000
    redis = RedisSettings(url=redis_server.url)
    held = msgspec.structs.replace(
        request("held", prompt(40, 1), arrival_ms=t0 + 1, deadline_ms=far, tenant="globex", session="s"),
        model="m-b",
    )
    # one session: one partition, so the decided ones sit after the held one and are read again
    done = [
        request(f"done-{i}", prompt(40, 2 + i), arrival_ms=t0 + 2 + i, deadline_ms=far, session="s")
        for i in range(2)
    ]
    out = TypedConsumer(kafka_settings, [ASSIGNMENTS], None, from_beginning=True)
    await out.start()
    try:
        async with TypedProducer(kafka_settings, "fake-workers") as prod:
            await prod.send(LOAD, load("w-0", t0))  # serves kvmesh-tiny; nobody serves m-b
            first = SchedulerService(settings(kafka_settings, redis=redis))
            async with first:
                await prod.send(REQUESTS, held)
                await wait_for(lambda: len(first.dispatcher) == 1)
                for r in done:
                    await prod.send(REQUESTS, r)
                got = await collect(out, lambda g: len([m for m in g if isinstance(m, Assignment)]) >= 2)
                assert sorted(m.request.request_id for m in got) == ["done-0", "done-1"]
                await wait_for(lambda: first._marks.written == 2)  # marked once published
                assert len(first.dispatcher) == 1
            # the successor: same group, reads again from the held request on
            second = SchedulerService(settings(kafka_settings, redis=redis, scheduler_id="scheduler-1"))
            async with second:
                await wait_for(
                    lambda: second.metrics.value("skipped_decided_total") == 2 and len(second.dispatcher) == 1
                )
                await prod.send(LOAD, msgspec.structs.replace(load("w-1", now_ms()), model="m-b"))
                late = await collect(out, lambda g: len([m for m in g if isinstance(m, Assignment)]) >= 1)
                await asyncio.sleep(1.0)
                late += [r.message for r in await out.getmany(timeout_ms=500)]
        ids = [m.request.request_id for m in late if isinstance(m, Assignment)]
        assert ids == ["held"] and [m.worker_id for m in late if isinstance(m, Assignment)] == ["w-1"]
    finally:
        await out.stop()


async def test_with_a_fleet_secret_a_forged_load_report_invents_no_worker(
    kafka_settings: KafkaSettings,
) -> None:
    from pydantic import SecretStr

    from schemas.report_signing import sign

    t0 = now_ms()
    service = SchedulerService(settings(kafka_settings, fleet_secret=SecretStr("s3cret")))
    out = TypedConsumer(kafka_settings, [ASSIGNMENTS], None, from_beginning=True)
    await out.start()
    try:
        async with TypedProducer(kafka_settings, "anyone") as prod, service:
            await prod.send(LOAD, load("w-9", t0))  # unsigned: anyone can write to Kafka
            await prod.send(LOAD, sign(load("w-8", t0), b"a-guess"))  # signed with the wrong secret
            await prod.send(LOAD, sign(load("w-0", t0), b"s3cret"))
            await wait_for(lambda: "w-0" in service.view.workers and service._reports.refused >= 2)
            assert sorted(service.view.workers) == ["w-0"]
            await prod.send(REQUESTS, request("r1", prompt(40), arrival_ms=t0 + 5))
            got = await collect(out, lambda g: len([m for m in g if isinstance(m, Assignment)]) >= 1)
            assert [m.worker_id for m in got if isinstance(m, Assignment)] == ["w-0"]
    finally:
        await out.stop()


async def test_a_gap_in_a_workers_kv_events_asks_it_to_resync(kafka_settings: KafkaSettings) -> None:
    """KV event 3 of w-0 never arrives: the scheduler asks w-0 to resync, applies nothing more of it
    until the resync's ``cleared``, then follows the snapshot."""

    from schemas.messages import ResyncRequest
    from streams.topics import CONTROL

    t0 = now_ms()
    hs = request("x", prompt(80)).block_hashes
    service = SchedulerService(settings(kafka_settings))
    ctl = TypedConsumer(kafka_settings, [CONTROL], None, from_beginning=True)
    await ctl.start()

    def numbered(ev: KvEvent, seq: int) -> KvEvent:
        return msgspec.structs.replace(ev, seq=seq, epoch=t0)

    try:
        async with TypedProducer(kafka_settings, "w-0") as prod, service:
            await prod.send(LOAD, load("w-0", t0))
            await prod.send(KV_EVENTS, numbered(stored("w-0", hs[:1], event_ms=t0), 1))
            await prod.send(KV_EVENTS, numbered(stored("w-0", hs[1:2], event_ms=t0), 2))
            # 3 is lost; 4 shows the gap
            await prod.send(KV_EVENTS, numbered(stored("w-0", hs[3:4], event_ms=t0), 4))
            got = await collect(ctl, lambda g: any(isinstance(m, ResyncRequest) for m in g))
            [ask] = [m for m in got if isinstance(m, ResyncRequest)]
            assert ask.worker_id == "w-0" and ask.requested_by == service.settings.scheduler_id
            assert len(service.view.index) == 2  # 4 was not applied
            cleared = KvEvent("w-0", "cleared", "gpu", [], [], event_ms=t0 + 1)
            await prod.send(KV_EVENTS, numbered(cleared, 5))
            await prod.send(KV_EVENTS, numbered(stored("w-0", hs[:3], event_ms=t0 + 1), 6))
            await wait_for(lambda: len(service.view.index) == 3)
    finally:
        await ctl.stop()


async def test_a_silent_worker_s_requests_are_re_decided_without_a_worker_lost(
    kafka_settings: KafkaSettings,
) -> None:
    """The KV manager is down (no WorkerLost comes): the scheduler sees w-0 silent past its timeout in
    its own view and decides w-0's in-flight request again, on w-1."""
    t0 = now_ms()
    service = SchedulerService(settings(kafka_settings, worker_timeout_ms=1000))
    out = TypedConsumer(kafka_settings, [ASSIGNMENTS], None, from_beginning=True)
    await out.start()
    try:
        async with TypedProducer(kafka_settings, "fake-workers") as prod, service:
            await prod.send(LOAD, load("w-0", t0))
            await wait_for(lambda: "w-0" in service.view.workers)
            await prod.send(REQUESTS, request("r1", prompt(40), arrival_ms=t0 + 5, deadline_ms=t0 + 60_000))
            first = await collect(out, lambda g: any(isinstance(m, Assignment) for m in g))
            assert [m.worker_id for m in first if isinstance(m, Assignment)] == ["w-0"]
            for dt in (500, 1500, 2500):  # w-1 reports, w-0 stays silent
                await prod.send(LOAD, load("w-1", t0 + dt))
            again = await collect(out, lambda g: any(isinstance(m, Assignment) for m in g))
            assert [(m.request.request_id, m.worker_id) for m in again if isinstance(m, Assignment)] == [
                ("r1", "w-1")
            ]
            assert service.metrics.value("redispatches_total") == 1
    finally:
        await out.stop()


async def test_a_request_published_twice_is_decided_once(kafka_settings: KafkaSettings) -> None:
    """A producer's retried publish can land twice; the second copy is dropped, not run again."""
    t0 = now_ms()
    req = request("dup-1", prompt(64), arrival_ms=t0 + 10)
    async with TypedProducer(kafka_settings, "fake-workers") as prod:
        await prod.send(LOAD, load("w-0", t0))
        service = SchedulerService(settings(kafka_settings))
        out = TypedConsumer(kafka_settings, [ASSIGNMENTS], None, from_beginning=True)
        await out.start()
        try:
            async with service:
                await prod.send(REQUESTS, req)
                await collect(out, lambda g: len(g) >= 1)
                await prod.send(REQUESTS, req)  # the retry's copy, while the first still runs
                await prod.send(REQUESTS, request("other", prompt(64, 2), arrival_ms=t0 + 20))
                got = await collect(out, lambda g: any(a.request.request_id == "other" for a in g))
                assert [a.request.request_id for a in got] == ["other"]
                assert service.metrics.value("duplicate_requests_total") == 1
        finally:
            await out.stop()


async def test_a_killed_replica_s_sessions_move_to_the_other_and_no_request_is_lost_or_run_twice(
    kafka_settings: KafkaSettings, redis_server: Any
) -> None:
    """Two replicas in one group; one is SIGKILLed (a process, mid-stream). The survivor takes its
    partitions after the group's session timeout, and every request is assigned exactly once."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from streams.embedded import free_port
    from streams.producer import partition_for
    from streams.settings import RedisSettings

    session_timeout_ms = 3000
    kafka = kafka_settings.model_copy(update={"session_timeout_ms": session_timeout_ms})
    redis = RedisSettings(url=redis_server.url)
    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": str(repo),
        "KVMESH_KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "KVMESH_KAFKA_TOPIC_PREFIX": kafka.topic_prefix,
        "KVMESH_KAFKA_SESSION_TIMEOUT_MS": str(session_timeout_ms),
        "KVMESH_REDIS_URL": redis.url,
        "KVMESH_SCHEDULER_SCHEDULER_ID": "sched-a",
        "KVMESH_SCHEDULER_USE_SNAPSHOT": "false",
        "KVMESH_SCHEDULER_CREATE_TOPICS": "false",
        "KVMESH_SCHEDULER_METRICS_PORT": str(free_port()),
    }
    out = TypedConsumer(kafka, [ASSIGNMENTS], None, from_beginning=True)
    await out.start()
    got: list[Assignment] = []

    async def assigned(ids: set[str], timeout_s: float = 40.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not ids <= {a.request.request_id for a in got}:
            if loop.time() > deadline:
                raise AssertionError(f"never assigned: {sorted(ids - {a.request.request_id for a in got})}")
            got.extend(
                r.message for r in await out.getmany(timeout_ms=200) if isinstance(r.message, Assignment)
            )

    proc = subprocess.Popen([sys.executable, "-m", "services.scheduler"], cwd=repo, env=env)
    stop_beats = asyncio.Event()
    try:
        async with TypedProducer(kafka, "fake-workers") as prod:

            async def beat() -> None:  # live workers: nothing is re-decided for a silent one
                while not stop_beats.is_set():
                    for w in ("w-0", "w-1"):
                        await prod.send(LOAD, load(w, now_ms()))
                    await asyncio.sleep(0.5)

            beats = asyncio.create_task(beat())

            async def send(prefix: str, n: int) -> set[str]:
                ids = set()
                for i in range(n):
                    rid = f"{prefix}-{i}"
                    await prod.send(
                        REQUESTS, request(rid, prompt(40, i + 1), arrival_ms=now_ms(), session=rid)
                    )
                    ids.add(rid)
                return ids

            await assigned(await send("alone", 4))  # replica A is up and deciding
            second = SchedulerService(
                settings(kafka, redis=redis, scheduler_id="sched-b", catch_up_timeout_s=20)
            )
            async with second:
                both: set[str] = set()
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 40
                while {a.scheduler_id for a in got if a.request.request_id in both} != {"sched-a", "sched-b"}:
                    assert loop.time() < deadline, "the group never split the partitions between the two"
                    batch = await send(f"both{len(both)}", 8)
                    await assigned(batch)
                    both |= batch
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)
                after = await send("after", 12)  # sessions on the dead replica's partitions among them
                await assigned(after, timeout_s=session_timeout_ms / 1000 + 30)
                await asyncio.sleep(1.0)
                got.extend(
                    r.message for r in await out.getmany(timeout_ms=500) if isinstance(r.message, Assignment)
                )
            stop_beats.set()
            await beats
        ids = [a.request.request_id for a in got]
        assert len(ids) == len(set(ids))  # none decided twice
        assert {a.scheduler_id for a in got if a.request.request_id in after} == {"sched-b"}
        # and the survivor did take over the dead one's partitions: some later session hashes to one
        a_parts = {partition_for(REQUESTS, a.request.session_id) for a in got if a.scheduler_id == "sched-a"}
        assert a_parts & {partition_for(REQUESTS, rid) for rid in after}
    finally:
        stop_beats.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await out.stop()
