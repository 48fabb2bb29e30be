"""Same ordered events → same decisions; a scheduler restarted from a snapshot reaches the same view."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from schemas.messages import ChatRequest, Completion, KvEvent, LoadReport, WorkerLost
from services.scheduler.router import POLICIES, Decision, Router, RouterSettings
from services.scheduler.view import FleetView

from .factories import load, prompt, request, stored

Event = ChatRequest | KvEvent | LoadReport | WorkerLost | Completion


def scripted_events(seed: int = 7, n: int = 400) -> list[Event]:
    """A mixed, seeded event list: reports, stored/moved/removed blocks, a lost worker, requests."""
    rng = random.Random(seed)
    events: list[Event] = []
    t = 1000
    prefixes = [prompt(16 * rng.randint(2, 12), s) for s in range(6)]
    for w in range(6):
        events.append(load(f"w-{w}", t))
    for i in range(n):
        t += rng.randint(0, 3)
        r = rng.random()
        w = f"w-{rng.randrange(6)}"
        if r < 0.15:
            events.append(
                load(w, t, queue_depth=rng.randint(0, 4), queued_prefill_tokens=rng.randint(0, 3000))
            )
        elif r < 0.35:
            p = rng.choice(prefixes)
            hashes = request("x", p, tenant=rng.choice(["a", "b"])).block_hashes
            events.append(stored(w, hashes[: rng.randint(1, len(hashes))], rng.choice(["gpu", "dram"]), t))
        elif r < 0.40:
            p = rng.choice(prefixes)
            hashes = request("x", p, tenant="a").block_hashes
            kind = rng.choice(["removed", "moved"])
            events.append(KvEvent(w, kind, "disk", hashes[-2:], event_ms=t))
        elif i == 200:
            events.append(WorkerLost("w-5", last_seen_ms=t - 100, declared_ms=t))
        else:
            p = rng.choice(prefixes) + prompt(rng.randint(1, 40), i)
            events.append(request(f"r{i}", p, arrival_ms=t, tenant=rng.choice(["a", "b"])))
    return events


def drive(view: FleetView, router: Router, events: list[Event]) -> list[Decision]:
    out = []
    for ev in events:
        if isinstance(ev, ChatRequest):
            out.append(router.decide(ev, ev.arrival_ms))
        elif isinstance(ev, KvEvent):
            view.apply_kv_event(ev)
        elif isinstance(ev, LoadReport):
            view.apply_load(ev)
        elif isinstance(ev, WorkerLost):
            view.apply_worker_lost(ev)
        else:
            view.note_completion(ev)
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_same_events_same_assignments(policy: str) -> None:
    events = scripted_events()
    runs = []
    for _ in range(2):
        view = FleetView()
        runs.append(drive(view, Router(view, RouterSettings(policy=policy)), events))
    a, b = ([d.assignment for d in run] for run in runs)
    assert a == b
    assert sum(x is not None for x in a) > 200
    if policy == "kvmesh":
        assert any(x is not None and x.fetch for x in a)
        assert any(x is not None and x.reuse_blocks > 0 for x in a)
        assert all(x is None or x.worker_id != "w-5" for x in a[-100:])


@dataclass
class FakeSnapshot:
    blocks: dict[int, dict[str, str]]
    parents: dict[int, int]


def test_restart_from_snapshot_reaches_the_same_view() -> None:
    events = scripted_events(seed=11)
    kv_and_control = [e for e in events if isinstance(e, KvEvent | WorkerLost)]
    cut = len(kv_and_control) // 2
    # the never-stopped scheduler
    full = FleetView()
    decided = drive(full, Router(full, RouterSettings()), events)
    # the KV manager's snapshot after the first `cut` kv/control records
    snap_view = FleetView()
    for e in events:
        if isinstance(e, LoadReport):
            snap_view.apply_load(e)
    drive(snap_view, Router(snap_view, RouterSettings()), kv_and_control[:cut])
    snap = FakeSnapshot(
        blocks={h: hs for h, _, hs in snap_view.index.items()},
        parents={h: p for h, p, _ in snap_view.index.items()},
    )
    # the restarted one: load reports from the (compacted) beginning, snapshot, then the rest
    restarted = FleetView()
    for e in events:
        if isinstance(e, LoadReport):
            restarted.apply_load(e)
    restarted.load_snapshot(snap)
    drive(restarted, Router(restarted, RouterSettings()), kv_and_control[cut:])
    assert restarted.index.to_dict() == full.index.to_dict()
    now = max(e.arrival_ms for e in events if isinstance(e, ChatRequest)) + 1
    assert restarted.live_workers(now) == full.live_workers(now)
    # once every worker has reported again and the requests the first one placed have completed
    # (pending work caught up, no prompt still being computed anywhere), both decide alike
    done = [
        Completion(a.request.request_id, a.request.session_id, a.worker_id, "stop", 1, 1)
        for d in decided
        if (a := d.assignment) is not None
    ]
    catch_up = [*done, *(load(w, now + 1) for w in full.live_workers(now))]
    reqs = [e for e in events if isinstance(e, ChatRequest)][:30]
    later = [
        request(r.request_id + "-again", r.token_ids, arrival_ms=now + 2 + i, tenant=r.tenant)
        for i, r in enumerate(reqs)
    ]
    da = drive(full, Router(full, RouterSettings()), [*catch_up, *later])
    db = drive(restarted, Router(restarted, RouterSettings()), [*catch_up, *later])
    assert [d.assignment for d in da] == [d.assignment for d in db]
