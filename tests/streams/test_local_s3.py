"""The dev broker's object store (streams.local_s3): S3 semantics that tansu relies on, its data
surviving a restart, and a real tansu on it losing no acknowledged record when both are SIGKILLed."""

from __future__ import annotations

import asyncio
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from streams.embedded import EmbeddedBroker, EmbeddedObjectStore
from streams.local_s3 import Bucket, LocalS3

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


def _client(root: Path) -> httpx.AsyncClient:
    app = LocalS3(root)
    app.buckets.setdefault("b", Bucket(root / "b"))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s3")


def _keys(xml: bytes) -> tuple[list[str], list[str], str | None]:
    root = ET.fromstring(xml)
    keys = [e.findtext(f"{_NS}Key") or "" for e in root.iter(f"{_NS}Contents")]
    prefixes = [e.findtext(f"{_NS}Prefix") or "" for e in root.iter(f"{_NS}CommonPrefixes")]
    return keys, prefixes, root.findtext(f"{_NS}NextContinuationToken")


async def test_conditional_writes_let_exactly_one_writer_win(tmp_path: Path) -> None:
    async with _client(tmp_path) as c:
        first = await c.put("/b/wm.json", content=b"0", headers={"If-None-Match": "*"})
        assert first.status_code == 200
        etag = first.headers["etag"]
        again = await c.put("/b/wm.json", content=b"1", headers={"If-None-Match": "*"})
        assert again.status_code == 412
        # Two updates from the same read: the first wins, the second sees the new ETag and fails.
        a = await c.put("/b/wm.json", content=b"a", headers={"If-Match": etag})
        b = await c.put("/b/wm.json", content=b"b", headers={"If-Match": etag})
        assert (a.status_code, b.status_code) == (200, 412)
        got = await c.get("/b/wm.json")
        assert got.content == b"a" and got.headers["etag"] == a.headers["etag"]
        assert got.headers["content-length"] == "1"
        assert (await c.put("/b/missing", content=b"x", headers={"If-Match": etag})).status_code == 404
        # A reader holding the current ETag gets 304, a stale one the bytes.
        assert (await c.get("/b/wm.json", headers={"If-None-Match": a.headers["etag"]})).status_code == 304
        assert (await c.get("/b/wm.json", headers={"If-None-Match": etag})).content == b"a"
        assert (await c.get("/b/nope")).status_code == 404
        assert (await c.get("/nobucket/k")).status_code == 404


async def test_listing_pages_prefixes_and_deletes(tmp_path: Path) -> None:
    async with _client(tmp_path) as c:
        names = [f"t/p0/records/{i:020}.batch" for i in range(7)] + ["t/p0/watermark.json", "t/p1/x", "u"]
        for name in names:
            assert (await c.put(f"/b/{name}", content=name.encode())).status_code == 200
        seen: list[str] = []
        token: str | None = None
        pages = 0
        while True:
            params = {"list-type": "2", "prefix": "t/p0/records/", "max-keys": "3"}
            if token:
                params["continuation-token"] = token
            keys, _, token = _keys((await c.get("/b", params=params)).content)
            seen += keys
            pages += 1
            if not token:
                break
        assert seen == sorted(n for n in names if n.startswith("t/p0/records/")) and pages == 3
        # With a delimiter each common prefix is one entry, and a page never splits it.
        keys, prefixes, token = _keys(
            (await c.get("/b", params={"list-type": "2", "prefix": "t/", "delimiter": "/"})).content
        )
        assert (keys, prefixes, token) == ([], ["t/p0/", "t/p1/"], None)
        keys, prefixes, token = _keys(
            (await c.get("/b", params={"list-type": "2", "delimiter": "/", "max-keys": "1"})).content
        )
        assert (keys, prefixes) == ([], ["t/"]) and token is not None
        keys, prefixes, _ = _keys(
            (
                await c.get("/b", params={"list-type": "2", "delimiter": "/", "continuation-token": token})
            ).content
        )
        assert (keys, prefixes) == (["u"], [])
        body = "<Delete><Object><Key>u</Key></Object><Object><Key>t/p1/x</Key></Object></Delete>"
        deleted = await c.post("/b?delete", content=body.encode())
        assert deleted.status_code == 200 and deleted.content.count(b"<Deleted>") == 2
        assert (await c.get("/b/u")).status_code == 404
        assert (await c.post("/b?delete", content=b"<not xml")).status_code == 400


async def test_objects_survive_a_restart_and_keys_stay_inside_the_bucket(tmp_path: Path) -> None:
    async with _client(tmp_path) as c:
        await c.put("/b/a/b/c", content=b"abc")
        await c.put("/b/..%2F..%2Fescape", content=b"no")
        etag = (await c.get("/b/a/b/c")).headers["etag"]
    (tmp_path / "b" / ".tmp-1-torn").write_bytes(b"half")  # a write a crash cut short
    assert not (tmp_path.parent / "escape").exists()
    async with _client(tmp_path) as c:
        got = await c.get("/b/a/b/c")
        assert got.content == b"abc" and got.headers["etag"] == etag
        assert (await c.get("/b/..%2F..%2Fescape")).content == b"no"
        keys, _, _ = _keys((await c.get("/b", params={"list-type": "2"})).content)
        assert keys == ["../../escape", "a/b/c"]  # the torn temporary file is gone, not listed
    assert not (tmp_path / "b" / ".tmp-1-torn").exists()


async def test_ranges(tmp_path: Path) -> None:
    async with _client(tmp_path) as c:
        await c.put("/b/k", content=b"0123456789")
        assert (await c.get("/b/k", headers={"Range": "bytes=2-4"})).content == b"234"
        assert (await c.get("/b/k", headers={"Range": "bytes=-3"})).content == b"789"
        assert (await c.get("/b/k", headers={"Range": "bytes=8-"})).content == b"89"
        assert (await c.get("/b/k", headers={"Range": "bytes=20-"})).status_code == 416


async def _produce(bootstrap: str, producers: int, each: int) -> set[bytes]:
    first = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await first.start()
    await first.send_and_wait("t", b"first", partition=0)  # creates the topic before the race
    await first.stop()
    clients = [AIOKafkaProducer(bootstrap_servers=bootstrap) for _ in range(producers)]
    sent = {b"first"}

    async def run(k: int, p: AIOKafkaProducer) -> None:
        await p.start()
        try:
            for i in range(each):
                value = f"{k}-{i}".encode()
                await p.send_and_wait("t", value, partition=0)
                sent.add(value)
        finally:
            await p.stop()

    await asyncio.gather(*(run(k, p) for k, p in enumerate(clients)))
    return sent


async def _consume(bootstrap: str, want: int) -> set[bytes]:
    c = AIOKafkaConsumer("t", bootstrap_servers=bootstrap, group_id="g", auto_offset_reset="earliest")
    await c.start()
    got: set[bytes] = set()
    try:
        for _ in range(60):
            for records in (await c.getmany(timeout_ms=500)).values():
                got.update(r.value for r in records if r.value is not None)
            if len(got) >= want:
                break
    finally:
        await c.stop()
    return got


@pytest.mark.integration
def test_tansu_on_the_store_keeps_every_acked_record_across_sigkills(tmp_path: Path) -> None:
    """4 producers race on one partition (tansu's conditional watermark writes), then the broker and
    the object store are both SIGKILLed and restarted: every acknowledged record comes back."""
    store = EmbeddedObjectStore(root=tmp_path / "s3")
    store.start()
    broker = EmbeddedBroker(storage=store.storage, env=store.broker_env())
    try:
        bootstrap = broker.start()
        sent = asyncio.run(_produce(bootstrap, producers=4, each=50))
        assert len(sent) == 201
        broker.kill()
        store.kill()
        store.start()
        broker.start()
        assert asyncio.run(_consume(bootstrap, len(sent))) == sent
    finally:
        broker.stop()
        store.stop()
