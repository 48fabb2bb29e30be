"""The KV-event subscriber against vLLM's own ZMQ publisher: order, duplicates, gaps, replay, loss.

vLLM's ``ZmqEventPublisher`` is the real thing (its publisher thread, PUB socket and replay ROUTER),
bound to ipc sockets in a temporary folder; no engine is started.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

kv_events = pytest.importorskip("vllm.distributed.kv_events")

from services.worker.vllm_engine.event_subscriber import Drained, EventSubscriber  # noqa: E402


def _batch(i: int) -> Any:
    ev = kv_events.BlockStored(
        block_hashes=[1000 + i],
        parent_block_hash=None,
        token_ids=list(range(32)),
        block_size=32,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[(f"kvmesh/0/{i:02x}",)],
    )
    return kv_events.KVEventBatch(ts=float(i), events=[ev])


class _Pair:
    def __init__(self, tmp: Path, buffer_steps: int) -> None:
        self.pub = kv_events.ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=f"ipc://{tmp}/ev",
            replay_endpoint=f"ipc://{tmp}/replay",
            buffer_steps=buffer_steps,
            topic="kv",
        )
        self.sub = EventSubscriber(f"ipc://{tmp}/ev", f"ipc://{tmp}/replay", topic="kv")
        time.sleep(0.3)  # ZMQ's slow joiner: let the SUB connect before the first publish

    def publish(self, *ids: int) -> None:
        for i in ids:
            self.pub.publish(_batch(i))
        time.sleep(0.2)

    def drain(self, expect: int, timeout: float = 5.0) -> Drained:
        """Drain until ``expect`` batches arrived (or the deadline)."""
        out = Drained()
        deadline = time.monotonic() + timeout
        while len(out.batches) < expect and time.monotonic() < deadline:
            d = self.sub.drain()
            out.batches += d.batches
            out.lost = out.lost or d.lost
            out.replayed += d.replayed
            time.sleep(0.02)
        return out

    def drop_one(self, timeout: float = 5.0) -> None:
        """Read one message off the SUB socket before the subscriber sees it: a dropped message."""
        sock = self.sub.socket
        assert sock.poll(int(timeout * 1000)), "nothing published"
        sock.recv_multipart()

    def close(self) -> None:
        self.sub.close()
        self.pub.shutdown()


def _ids(d: Drained) -> list[int]:
    return [b[1][0]["block_hashes"][0] - 1000 for b in d.batches]


@pytest.fixture
def pair(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[_Pair]:
    p = _Pair(tmp_path, getattr(request, "param", 100))
    yield p
    p.close()


def test_batches_in_order_with_their_events(pair: _Pair) -> None:
    pair.publish(0, 1, 2)
    d = pair.drain(3)
    assert _ids(d) == [0, 1, 2] and not d.lost and d.replayed == 0
    ev = d.batches[0][1][0]
    assert ev["type"] == "BlockStored" and ev["extra_keys"] == [["kvmesh/0/00"]]
    assert pair.sub.next_seq == 3 and pair.sub.gaps == 0


def test_a_dropped_batch_is_replayed(pair: _Pair) -> None:
    pair.publish(0)
    assert _ids(pair.drain(1)) == [0]
    pair.publish(1)
    pair.drop_one()  # batch 1 never reaches the subscriber
    pair.publish(2)
    d = pair.drain(2)
    assert _ids(d) == [1, 2] and d.replayed == 1 and not d.lost
    assert pair.sub.gaps == 1 and pair.sub.lost_gaps == 0


@pytest.mark.parametrize("pair", [2], indirect=True)
def test_a_gap_older_than_the_replay_buffer_is_reported_lost(pair: _Pair) -> None:
    pair.publish(0)
    assert _ids(pair.drain(1)) == [0]
    pair.publish(1, 2, 3)
    for _ in range(3):
        pair.drop_one()  # 1, 2, 3 dropped; the publisher keeps only 2 and 3
    pair.publish(4)
    d = pair.drain(1)
    assert d.lost and pair.sub.lost_gaps == 1
    assert _ids(d)[-1] == 4 and 1 not in _ids(d)
    # and reading goes on in order afterwards
    pair.publish(5)
    d = pair.drain(1)
    assert _ids(d) == [5] and not d.lost
