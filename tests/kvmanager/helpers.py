"""Small builders shared by the KV manager tests."""

from __future__ import annotations

import weakref

from schemas.messages import ChatRequest, KvEvent, LoadReport, TierUsage
from services.kvmanager.directory import Directory
from services.kvmanager.write_behind import DirectoryWriter
from streams.topics import KV_EVENTS, LOAD


def stored(
    worker: str, hashes: list[int], tier: str = "gpu", ms: int = 1000, session: str | None = None
) -> KvEvent:
    parents = [0, *hashes[:-1]]
    return KvEvent(worker, "stored", tier, hashes, parents, session_id=session, event_ms=ms)


def removed(worker: str, hashes: list[int], ms: int = 1000) -> KvEvent:
    return KvEvent(worker, "removed", "gpu", hashes, event_ms=ms)


def moved(worker: str, hashes: list[int], to: str, frm: str, ms: int = 1000) -> KvEvent:
    return KvEvent(worker, "moved", to, hashes, from_tier=frm, event_ms=ms)


def cleared(worker: str, ms: int = 1000) -> KvEvent:
    return KvEvent(worker, "cleared", "gpu", [], event_ms=ms)


def load(
    worker: str,
    ms: int,
    *,
    queued: int = 0,
    dram_free: int = 100,
    draining: bool = False,
    block_bytes: int = 1000,
) -> LoadReport:
    return LoadReport(
        worker_id=worker,
        report_ms=ms,
        queue_depth=0,
        active_requests=0,
        active_tokens=0,
        queued_prefill_tokens=queued,
        tiers=[TierUsage("gpu", 10, 100), TierUsage("dram", dram_free, 1000)],
        transfer_address=f"127.0.0.1:{9000 + int(worker[1:]) if worker[1:].isdigit() else 9999}",
        block_size=16,
        block_bytes=block_bytes,
        prefill_ms_per_token=0.1,
        draining=draining,
    )


def request(session: str, rid: str, hashes: list[int], ms: int, public_tokens: int = 0) -> ChatRequest:
    return ChatRequest(
        request_id=rid,
        session_id=session,
        tenant="t",
        token_ids=[1] * (16 * len(hashes)),
        block_hashes=hashes,
        block_size=16,
        max_tokens=4,
        arrival_ms=ms,
        namespace=b"t:t",
        public_prefix_tokens=public_tokens,
    )


def feed(d: Directory, records: list[tuple[int, int, object]], producer: str = "p") -> None:
    """Apply (offset, seq, message) records as the service does: accept, then apply if new."""
    for offset, seq, msg in records:
        topic = LOAD.name if isinstance(msg, LoadReport) else KV_EVENTS.name
        if d.accept(topic, 0, offset, producer, seq):
            if isinstance(msg, KvEvent):
                d.apply_kv_event(msg)
            elif isinstance(msg, LoadReport):
                d.apply_load(msg)


_WRITERS: weakref.WeakKeyDictionary[Directory, DirectoryWriter] = weakref.WeakKeyDictionary()


def w(d: Directory) -> DirectoryWriter:
    """The one write-behind of ``d`` (the service keeps one per directory: it remembers the version
    it last wrote)."""
    writer = _WRITERS.get(d)
    if writer is None:
        writer = _WRITERS[d] = DirectoryWriter(d)
    return writer
