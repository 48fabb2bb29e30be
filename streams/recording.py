"""Recordings: a window of topic records saved to a file, byte for byte, for replay and debugging.

File format: a sequence of frames, each a 4-byte big-endian length then a MessagePack array::

    [u32 len][msgpack [topic, partition, offset, timestamp_ms, key | nil, value]] [u32 len][...] ...

``topic`` is the catalog name (no ``topic_prefix``); ``value`` is the record value exactly as it was
on the broker, so a replay decodes it with the same strict codec as a live consumer. Records are in
the order they were read: per partition in offset order; across partitions in no set order (a
replay that needs a total order sorts by ``timestamp_ms``, then topic, partition, offset).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import msgpack
from aiokafka import AIOKafkaConsumer, TopicPartition

from streams.admin import topic_name
from streams.clock import now_ms as wall_ms
from streams.errors import StreamsError
from streams.settings import KafkaSettings
from streams.topics import TopicSpec

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
#: A frame larger than this is a corrupt length, not a record (records are at most a few MiB).
MAX_FRAME_BYTES = 64 << 20


class RecordingError(StreamsError):
    """A recording file is truncated or corrupt."""


@dataclass(frozen=True, slots=True)
class RawRecord:
    """One record as it was on the broker (value undecoded)."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes


def _frame(r: RawRecord) -> bytes:
    body: bytes = msgpack.packb(
        [r.topic, r.partition, r.offset, r.timestamp_ms, r.key, r.value], use_bin_type=True
    )
    return _LEN.pack(len(body)) + body


def write_recording(path: str | Path, records: Iterable[RawRecord]) -> int:
    """Write ``records`` to ``path`` (replacing it); returns how many were written."""
    n = 0
    with open(path, "wb") as f:
        for r in records:
            f.write(_frame(r))
            n += 1
    return n


def _read_exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise RecordingError(f"truncated recording: wanted {n} bytes, got {len(data)}")
    return data


def read_recording(path: str | Path) -> Iterator[RawRecord]:
    """Yield the records of a recording in file order. Raises RecordingError on a bad frame."""
    with open(path, "rb") as f:
        while True:
            head = f.read(_LEN.size)
            if not head:
                return
            if len(head) != _LEN.size:
                raise RecordingError("truncated frame header")
            (size,) = _LEN.unpack(head)
            if size > MAX_FRAME_BYTES:
                raise RecordingError(f"frame of {size} bytes: corrupt length")
            try:
                fields = msgpack.unpackb(_read_exact(f, size), raw=False, use_list=True)
                topic, partition, offset, ts, key, value = fields
            except RecordingError:
                raise
            except Exception as exc:  # msgpack and unpacking raise several types for bad bytes
                raise RecordingError(f"corrupt frame: {exc}") from exc
            if not isinstance(topic, str) or not isinstance(value, bytes):
                raise RecordingError("corrupt frame: bad field types")
            yield RawRecord(topic, int(partition), int(offset), int(ts), key, value)


async def record_topics(
    kafka: KafkaSettings,
    topics: Sequence[TopicSpec],
    path: str | Path,
    *,
    from_offsets: dict[tuple[str, int], int] | None = None,
    since_ms: int | None = None,
    until_ms: int | None = None,
    max_records: int | None = None,
    idle_timeout_s: float = 2.0,
) -> int:
    """Copy records of ``topics`` from Kafka to a recording file; returns the number written.

    Start per partition at ``from_offsets[(catalog topic, partition)]``, else at the first record with
    timestamp >= ``since_ms``, else at the beginning. Stop at the end offsets seen when recording
    started, at ``max_records``, at a record newer than ``until_ms`` (per partition), or after
    ``idle_timeout_s`` without new records, whichever comes first. No consumer group is used.
    """
    consumer = AIOKafkaConsumer(
        **kafka.client_kwargs(),
        group_id=None,
        enable_auto_commit=False,
        fetch_max_wait_ms=kafka.fetch_max_wait_ms,
    )
    await consumer.start()
    written = 0
    try:
        catalog: dict[str, str] = {}
        tps: list[TopicPartition] = []
        for spec in topics:
            name = topic_name(spec, kafka)
            catalog[name] = spec.name
            parts = consumer.partitions_for_topic(name) or set(range(kafka.partitions_of(spec)))
            tps.extend(TopicPartition(name, p) for p in sorted(parts))
        consumer.assign(tps)
        started_ms = wall_ms()
        ends = await consumer.end_offsets(tps)
        starts = await _start_offsets(consumer, tps, catalog, from_offsets, since_ms)
        with open(path, "wb") as f:
            window = _Window(consumer, f, catalog, max_records, until_ms, idle_timeout_s)
            await window.copy(starts, ends)
            # A broker may answer ListOffsets with an end short of what its fetches serve (tansu does
            # after a multi-record produce batch): records produced before the recording began would be
            # lost. A second look reads on from where each partition stopped, and keeps only records
            # from before the start (a later one ends that partition; a quiet one ends on idle).
            if window.room():
                window.until_ms = started_ms if until_ms is None else min(until_ms, started_ms)
                beyond = {tp: window.next_offset.get(tp, max(starts[tp], ends[tp])) for tp in tps}
                await window.copy(beyond, {tp: 1 << 62 for tp in tps})
            written = window.written
    finally:
        await consumer.stop()
    log.info("recorded %d records of %s to %s", written, [t.name for t in topics], path)
    return written


class _Window:
    """Copies records of assigned partitions from ``starts`` up to ``ends`` into a recording file."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        f: BinaryIO,
        catalog: dict[str, str],
        max_records: int | None,
        until_ms: int | None,
        idle_timeout_s: float,
    ) -> None:
        self.consumer = consumer
        self.f = f
        self.catalog = catalog
        self.max_records = max_records
        self.until_ms = until_ms
        self.idle_timeout_s = idle_timeout_s
        self.written = 0
        self.next_offset: dict[TopicPartition, int] = {}

    def room(self) -> bool:
        return self.max_records is None or self.written < self.max_records

    async def copy(self, starts: dict[TopicPartition, int], ends: dict[TopicPartition, int]) -> None:
        consumer = self.consumer
        active = set()
        for tp, start in starts.items():
            consumer.seek(tp, start)
            if start < ends[tp]:
                active.add(tp)
        loop = asyncio.get_running_loop()
        last_progress = loop.time()
        while active and self.room():
            batches = await consumer.getmany(*active, timeout_ms=200)
            if not any(batches.values()):
                if loop.time() - last_progress > self.idle_timeout_s:
                    break
                continue
            last_progress = loop.time()
            for tp, recs in batches.items():
                for rec in recs:
                    if tp not in active:
                        break
                    late = self.until_ms is not None and rec.timestamp > self.until_ms
                    if rec.offset >= ends[tp] or late:
                        active.discard(tp)
                        break
                    self.f.write(
                        _frame(
                            RawRecord(
                                self.catalog[tp.topic],
                                tp.partition,
                                rec.offset,
                                rec.timestamp,
                                rec.key,
                                bytes(rec.value or b""),
                            )
                        )
                    )
                    self.written += 1
                    self.next_offset[tp] = rec.offset + 1
                    if rec.offset + 1 >= ends[tp]:
                        active.discard(tp)
                    if not self.room():
                        return


async def _start_offsets(
    consumer: AIOKafkaConsumer,
    tps: list[TopicPartition],
    catalog: dict[str, str],
    from_offsets: dict[tuple[str, int], int] | None,
    since_ms: int | None,
) -> dict[TopicPartition, int]:
    starts = dict(await consumer.beginning_offsets(tps))
    if since_ms is not None:
        by_time = await consumer.offsets_for_times({tp: since_ms for tp in tps})
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            found = by_time.get(tp)
            # No record at or after since_ms: start at the end (nothing to record there).
            starts[tp] = found.offset if found is not None else ends[tp]
    for tp in tps:
        key = (catalog[tp.topic], tp.partition)
        if from_offsets and key in from_offsets:
            starts[tp] = from_offsets[key]
    return starts
