"""The fair dispatcher never loses, duplicates or strands a request, whatever the order of arrivals,
load reports, stored prefixes, cancels and drains: parked requests, pulls and moves included."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.messages import ChatRequest
from services.scheduler.fairness import FairDispatcher
from services.scheduler.router import Router, RouterSettings
from services.scheduler.view import FleetView

from .factories import load, prompt, request, stored

WORKERS = ("w-0", "w-1", "w-2")
# Three conversations whose turns extend one history, so turns share prefixes (what moves them).
HISTORIES = [prompt(2048, seed) for seed in (21, 22, 23)]

op = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 2), st.integers(1, 4), st.sampled_from(["acme", "beta"])),
    st.tuples(st.just("load"), st.sampled_from(WORKERS), st.sampled_from([0, 20_000, 20_000, 60_000])),
    st.tuples(st.just("store"), st.sampled_from(WORKERS), st.integers(0, 2), st.integers(1, 4)),
    st.tuples(st.just("cancel"), st.integers(0, 100)),
    st.tuples(st.just("drain"), st.integers(1, 400)),
)


def turn(conv: int, k: int) -> list[int]:
    """Turn ``k`` of conversation ``conv``: the first k quarters of its history and a question."""
    return [*HISTORIES[conv][: 512 * k], 900 + k]


def check_state(disp: FairDispatcher, queued: dict[str, ChatRequest]) -> None:
    """The queues hold exactly the requests not yet decided or cancelled, each once, and every parked
    one is where the dispatcher's record says it waits."""
    held: list[str] = []
    parked: dict[str, str] = {}
    for q in disp._queues.values():
        held.extend(e[2].request_id for e in q._heap)
        for worker, heap in q._parked.items():
            for e in heap:
                held.append(e[2].request_id)
                parked[e[2].request_id] = worker
    assert sorted(held) == sorted(queued)
    assert len(disp) == len(queued)
    assert {rid: w for rid, (_, w, _) in disp._parked_req.items()} == parked


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(op, min_size=10, max_size=60))
def test_every_request_is_decided_once_or_cancelled_and_none_is_stranded(ops: list[tuple]) -> None:
    view = FleetView()
    now = 1000
    for w in WORKERS:
        view.apply_load(load(w, now, queue_depth=1, queued_prefill_tokens=20_000, link_gbps=0.01))
    disp = FairDispatcher(Router(view, RouterSettings(max_queue_ms=100)))
    queued: dict[str, ChatRequest] = {}
    decided: set[str] = set()
    n = 0

    def drain(at: int) -> None:
        for d in disp.drain(at):
            req = d.assignment.request if d.assignment is not None else None
            rid = req.request_id if req is not None else d.rejection.request_id  # type: ignore[union-attr]
            assert rid in queued and rid not in decided, rid
            decided.add(rid)
            del queued[rid]
        check_state(disp, queued)

    for o in ops:
        if o[0] == "submit":
            _, conv, k, tenant = o
            n += 1
            req = request(f"r{n}", turn(conv, k), arrival_ms=now, session=f"c{conv}", tenant=tenant)
            disp.submit(req)
            queued[req.request_id] = req
        elif o[0] == "load":
            _, w, tokens = o
            view.apply_load(
                load(w, now, queue_depth=int(tokens > 0), queued_prefill_tokens=tokens, link_gbps=0.01)
            )
        elif o[0] == "store":
            _, w, conv, k = o
            view.apply_kv_event(stored(w, request("x", turn(conv, k)).block_hashes, event_ms=now))
        elif o[0] == "cancel":
            if queued:
                rid = sorted(queued)[o[1] % len(queued)]
                got = disp.cancel(rid)
                assert got is not None and got.request_id == rid
                del queued[rid]
                check_state(disp, queued)
        else:
            now += o[1]
            drain(now)
    # the fleet goes idle: every request still held is decided, none is left behind
    for _ in range(len(queued) + 1):
        if not queued:
            break
        now += 1000
        for w in WORKERS:
            view.apply_load(load(w, now, link_gbps=0.01))
        drain(now)
    assert not queued and len(disp) == 0
