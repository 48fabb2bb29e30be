"""Record a simulated run as a topic recording (streams.recording), replayable by ``kvmesh replay``.

Every message the scheduler saw (deliveries to the view, requests) and every Assignment it made is
written as the record a live broker would have held, encoded with the strict codec. Timestamps are
simulated milliseconds, nudged so that a replay's total order ``(timestamp, state < requests <
assignments, offset)`` is exactly the order the simulated scheduler saw; offsets count across topics.
"""

from __future__ import annotations

from pathlib import Path

from schemas.codec import encode
from streams.recording import RawRecord, write_recording
from streams.topics import ASSIGNMENTS, REQUESTS, TopicSpec

_RANK = {REQUESTS.name: 1, ASSIGNMENTS.name: 2}


class SimRecorder:
    """Owns the records of one run. Invariant: records are sorted by (timestamp_ms, rank, offset)."""

    def __init__(self, producer: str = "sim") -> None:
        self.records: list[RawRecord] = []
        self._producer = producer
        self._last = (-1, 0)

    def tap(self, topic: TopicSpec, message: object, now_ms: float) -> None:
        rank = _RANK.get(topic.name, 0)
        ts = int(now_ms)
        last_ts, last_rank = self._last
        if ts < last_ts or (ts == last_ts and rank < last_rank):
            ts = last_ts if rank >= last_rank else last_ts + 1
        self._last = (ts, rank)
        seq = len(self.records)
        key = getattr(message, topic.key, None)
        self.records.append(
            RawRecord(
                topic.name,
                0,
                seq,
                ts,
                key.encode() if isinstance(key, str) else None,
                encode(message, self._producer, seq, ts),
            )
        )

    def write(self, path: str | Path) -> int:
        return write_recording(path, self.records)
