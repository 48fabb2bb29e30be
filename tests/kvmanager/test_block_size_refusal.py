"""The KV manager refuses a worker announcing another block size than the fleet's (no broker needed)."""

from __future__ import annotations

import msgspec

from schemas.envelope import Envelope
from services.kvmanager.config import KvManagerSettings
from services.kvmanager.service import KvManagerService
from streams.consumer import Record

from .helpers import load, stored

_offset = iter(range(1, 10_000))


def _record(message: object, topic: str = "kvmesh.kv-events") -> Record:
    n = next(_offset)
    env = Envelope(schema="x", version=1, producer="p", seq=n, event_ms=1000 + n, message=message)
    return Record(topic=topic, partition=0, offset=n, key=None, envelope=env, timestamp_ms=0)


def test_reports_and_events_of_another_block_size_stay_out_of_the_directory() -> None:
    svc = KvManagerService(KvManagerSettings(block_size=32))
    good = msgspec.structs.replace(load("w-0", 1000), block_size=32)
    odd = msgspec.structs.replace(load("w-1", 1000), block_size=16)
    svc._apply(_record(good, "kvmesh.load"))
    svc._apply(_record(odd, "kvmesh.load"))
    svc._apply(_record(stored("w-0", [11, 12])))
    svc._apply(_record(stored("w-1", [21, 22])))
    assert set(svc.directory.workers) == {"w-0"} and svc.refused_workers == {"w-1"}
    assert 11 in svc.directory.blocks and 21 not in svc.directory.blocks
    # once it announces the fleet's size it is indexed like any worker
    svc._apply(_record(msgspec.structs.replace(load("w-1", 1000), block_size=32), "kvmesh.load"))
    svc._apply(_record(stored("w-1", [21])))
    assert svc.refused_workers == set() and 21 in svc.directory.blocks


def test_no_fleet_block_size_accepts_every_worker() -> None:
    svc = KvManagerService(KvManagerSettings())
    svc._apply(_record(msgspec.structs.replace(load("w-1", 1000), block_size=16), "kvmesh.load"))
    svc._apply(_record(stored("w-1", [21])))
    assert 21 in svc.directory.blocks and not svc.refused_workers
