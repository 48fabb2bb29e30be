"""Unit tests (no broker): dedup marks, the partitioner, seq numbering, recording files, key rules."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from aiokafka.partitioner import DefaultPartitioner
from hypothesis import given
from hypothesis import strategies as st

from schemas.messages import CancelRequest, DrainCommand, ReplicateCommand
from streams import topics
from streams.dedup import SeqDeduplicator
from streams.producer import TypedProducer, partition_for
from streams.recording import RawRecord, RecordingError, read_recording, write_recording
from streams.settings import KafkaSettings


def test_dedup_marks_are_per_partition() -> None:
    d = SeqDeduplicator()
    d.mark("t", 0, "p1", 10)
    assert d.is_duplicate("t", 0, "p1", 10)
    assert d.is_duplicate("t", 0, "p1", 3)
    assert not d.is_duplicate("t", 0, "p1", 11)
    # The same producer's lower seq on another partition is new: seq is monotonic per partition only.
    assert not d.is_duplicate("t", 1, "p1", 5)
    assert not d.is_duplicate("t", 0, "p2", 1)
    assert not d.is_duplicate("u", 0, "p1", 1)


def test_dedup_mark_only_moves_up_and_forget() -> None:
    d = SeqDeduplicator()
    d.mark("t", 0, "p", 7)
    d.mark("t", 0, "p", 4)
    assert d.high_water("t", 0, "p") == 7
    d.mark("t", 1, "p", 1)
    d.forget_partition("t", 0)
    assert d.high_water("t", 0, "p") is None
    assert d.high_water("t", 1, "p") == 1
    assert len(d) == 1


@given(st.text(min_size=1, max_size=40), st.sampled_from(topics.ALL_TOPICS))
def test_partition_for_matches_aiokafka_default_partitioner(key: str, spec: topics.TopicSpec) -> None:
    parts = list(range(spec.partitions))
    assert partition_for(spec, key) == DefaultPartitioner()(key.encode(), parts, parts)


def test_partition_for_known_values() -> None:
    # Fixed values of murmur2 (Java client compatible); a change here breaks worker partition reads.
    got = [partition_for(topics.ASSIGNMENTS, f"worker-{i}") for i in range(4)]
    parts = list(range(8))
    assert got == [DefaultPartitioner()(f"worker-{i}".encode(), parts, parts) for i in range(4)]
    assert all(0 <= p < 8 for p in got)


def test_seq_is_monotonic_and_starts_above_a_previous_incarnation() -> None:
    first = TypedProducer(KafkaSettings(), "w0", clock=lambda: 5_000)
    seqs = [first.next_seq() for _ in range(100)]
    assert seqs == sorted(seqs) and len(set(seqs)) == 100
    restarted = TypedProducer(KafkaSettings(), "w0", clock=lambda: 5_001)
    assert restarted.next_seq() > seqs[-1]


def test_producer_refuses_empty_id() -> None:
    with pytest.raises(ValueError):
        TypedProducer(KafkaSettings(), "")


def test_topic_keys_and_carried_types() -> None:
    cmd = ReplicateCommand("c1", "w7", "w1", "a:1", [1], b"ns")
    assert topics.CONTROL.key_of(cmd) == "w7"
    assert topics.CONTROL.key_of(DrainCommand("w3")) == "w3"
    assert topics.REQUESTS.key_of(CancelRequest("r", "s")) == "s"
    assert topics.ASSIGNMENTS.key_of(CancelRequest("r", "s")) is None  # worker_id unset
    assert topics.CONTROL.carries(cmd) and not topics.REQUESTS.carries(cmd)


def _records(n: int) -> list[RawRecord]:
    rng = random.Random(7)
    return [
        RawRecord(
            topic=rng.choice(["kvmesh.requests", "kvmesh.load"]),
            partition=rng.randrange(4),
            offset=i,
            timestamp_ms=1_700_000_000_000 + i,
            key=None if i % 5 == 0 else f"k{i}".encode(),
            value=rng.randbytes(rng.randrange(0, 300)),
        )
        for i in range(n)
    ]


def test_recording_round_trip(tmp_path: Path) -> None:
    recs = _records(50)
    path = tmp_path / "rec.kvr"
    assert write_recording(path, recs) == 50
    assert list(read_recording(path)) == recs
    empty = tmp_path / "empty.kvr"
    write_recording(empty, [])
    assert list(read_recording(empty)) == []


def test_recording_truncated_file_raises(tmp_path: Path) -> None:
    path = tmp_path / "rec.kvr"
    write_recording(path, _records(3))
    data = path.read_bytes()
    path.write_bytes(data[:-5])
    with pytest.raises(RecordingError):
        list(read_recording(path))
    path.write_bytes(b"\xff\xff\xff\xff" + data)
    with pytest.raises(RecordingError):
        list(read_recording(path))
