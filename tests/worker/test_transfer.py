"""Data plane happy paths, wire format, fleet auth, tenant isolation and limits, on real loopback sockets."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from schemas.blocks import PUBLIC_NAMESPACE, block_hashes, tenant_namespace
from services.worker.kv_layout import BlockLayout
from services.worker.transfer import (
    AuthFailed,
    BlockClient,
    BlockServer,
    FailReason,
    FleetAuth,
    InsecureSecret,
    TransferMetrics,
    TransferSettings,
    measure_link,
    resolve_secret,
)
from services.worker.transfer.errors import FrameError
from services.worker.transfer.frames import BlockRequest, Status, checksum, pack_header, unpack_header
from services.worker.transfer.memory import MemoryBlockStore

SECRET = b"fleet-secret-for-tests"
LAYOUT = BlockLayout(layers=2, kv_heads=2, block_size=16, head_dim=8, dtype="float32")  # 4 KiB blocks
NS = tenant_namespace("acme")


def make_chain(store: MemoryBlockStore, n: int, *, namespace: bytes = NS, seed: int = 0) -> list[int]:
    """n chained blocks of random float32 KV in ``store``; returns their hashes."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, size=n * LAYOUT.block_size)
    hashes = block_hashes(tokens, LAYOUT.block_size, namespace)
    tiers = ("gpu", "dram", "disk")
    parent = 0
    for i, h in enumerate(hashes):
        data = rng.standard_normal(LAYOUT.nbytes // 4).astype(np.float32).tobytes()
        store.put(h, data, namespace, parent=parent, tier=tiers[i % 3])
        parent = h
    return hashes


def parents_of(hashes: list[int]) -> list[int]:
    return [0, *hashes[:-1]]


@pytest.mark.parametrize("n", [1, 300])
async def test_fetch_is_byte_exact_and_releases_pins(n: int) -> None:
    src, dst = MemoryBlockStore(LAYOUT), MemoryBlockStore(LAYOUT)
    hashes = make_chain(src, n)
    server_metrics, client_metrics = TransferMetrics(), TransferMetrics()
    async with BlockServer(src, secret=SECRET, metrics=server_metrics) as server:
        assert server.address.startswith("127.0.0.1:")
        client = BlockClient(SECRET, timeout_s=10, metrics=client_metrics)
        result = await client.fetch(server.address, hashes, parents_of(hashes), NS, dst, peer_id="B")
    assert result.ok and result.error is None
    assert result.received == hashes
    assert result.committed == n
    assert result.bytes == n * LAYOUT.nbytes
    for i, h in enumerate(hashes):
        assert dst.block_bytes(h) == src.block_bytes(h)
        assert dst.blocks[h].parent == (hashes[i - 1] if i else 0)
        assert dst.blocks[h].namespace == NS
    assert dst.commits == 1  # one commit (one KvEvent batch) per fetch
    assert not src.pins  # every pinned read was released
    assert server_metrics.blocks_sent == n
    assert sum(server_metrics.sent_by_tier.values()) == n
    assert client_metrics.blocks_committed == n and client_metrics.fetches_complete == 1


async def test_parents_may_be_given_as_first_parent_only() -> None:
    src, dst = MemoryBlockStore(LAYOUT), MemoryBlockStore(LAYOUT)
    hashes = make_chain(src, 4)
    async with BlockServer(src, secret=SECRET) as server:
        result = await BlockClient(SECRET).fetch(server.address, hashes[1:], hashes[0], NS, dst)
    assert result.received == hashes[1:]
    assert [dst.blocks[h].parent for h in hashes[1:]] == hashes[:3]


async def test_already_held_blocks_are_received_but_not_reinserted() -> None:
    src, dst = MemoryBlockStore(LAYOUT), MemoryBlockStore(LAYOUT)
    hashes = make_chain(src, 3)
    dst.put(hashes[0], src.block_bytes(hashes[0]), NS)
    async with BlockServer(src, secret=SECRET) as server:
        result = await BlockClient(SECRET).fetch(server.address, hashes, 0, NS, dst)
    assert result.received == hashes and result.committed == 2


async def test_empty_fetch_does_not_connect() -> None:
    result = await BlockClient(SECRET).fetch("127.0.0.1:1", [], [], NS, MemoryBlockStore(LAYOUT))
    assert result.ok and result.received == [] and result.bytes == 0


async def test_two_fetches_at_once_from_one_and_from_two_servers() -> None:
    a, b, dst1, dst2 = (MemoryBlockStore(LAYOUT) for _ in range(4))
    ha = make_chain(a, 120, seed=1)
    hb = make_chain(b, 80, seed=2)
    async with BlockServer(a, secret=SECRET) as sa, BlockServer(b, secret=SECRET) as sb:
        client = BlockClient(SECRET, timeout_s=10)
        r1, r2, r3 = await asyncio.gather(
            client.fetch(sa.address, ha, 0, NS, dst1),
            client.fetch(sb.address, hb, 0, NS, dst2),
            client.fetch(sa.address, ha[:50], 0, NS, MemoryBlockStore(LAYOUT)),
        )
    assert r1.received == ha and r2.received == hb and r3.received == ha[:50]
    assert all(dst1.block_bytes(h) == a.block_bytes(h) for h in ha)
    assert all(dst2.block_bytes(h) == b.block_bytes(h) for h in hb)
    assert not a.pins and not b.pins


async def test_wrong_secret_is_refused_and_nothing_is_sent() -> None:
    src, dst = MemoryBlockStore(LAYOUT), MemoryBlockStore(LAYOUT)
    hashes = make_chain(src, 5)
    sm, cm = TransferMetrics(), TransferMetrics()
    async with BlockServer(src, secret=SECRET, metrics=sm) as server:
        result = await BlockClient(b"another-fleet", metrics=cm).fetch(server.address, hashes, 0, NS, dst)
    assert result.received == [] and not dst.blocks
    assert result.error is FailReason.REFUSED
    assert result.failed == [(h, FailReason.REFUSED) for h in hashes]
    assert sm.auth_refused == 1 and sm.blocks_sent == 0 and sm.bytes_sent == 0
    assert not src.pins and not sm.sent_by_tier  # the source was never read
    assert cm.fetch_failures["refused"] == 1


async def test_replayed_request_is_refused() -> None:
    src = MemoryBlockStore(LAYOUT)
    hashes = make_chain(src, 2)
    client = BlockClient(SECRET)
    request = client._request(hashes, NS, LAYOUT.describe(), "B")
    sm = TransferMetrics()
    async with BlockServer(src, secret=SECRET, metrics=sm) as server:
        statuses = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(request)
            await writer.drain()
            statuses.append(unpack_header(await reader.readexactly(32)).status)
            writer.close()
            await writer.wait_closed()
    assert statuses == [Status.OK, Status.REFUSED]
    assert sm.auth_refused == 1


async def test_other_tenants_blocks_are_answered_not_found_public_ones_served() -> None:
    src, dst = MemoryBlockStore(LAYOUT), MemoryBlockStore(LAYOUT)
    public = make_chain(src, 2, namespace=PUBLIC_NAMESPACE, seed=3)
    private = make_chain(src, 3, namespace=tenant_namespace("other"), seed=4)
    sm = TransferMetrics()
    async with BlockServer(src, secret=SECRET, metrics=sm) as server:
        client = BlockClient(SECRET)
        r_pub = await client.fetch(server.address, public, 0, NS, dst)
        r_priv = await client.fetch(server.address, private, 0, NS, dst)
        r_absent = await client.fetch(server.address, [12345], 0, NS, dst)
    assert r_pub.received == public  # public-namespace blocks are shared across tenants
    assert r_priv.received == [] and r_priv.failed[0] == (private[0], FailReason.NOT_FOUND)
    # indistinguishable from a block that does not exist
    assert r_absent.failed == [(12345, FailReason.NOT_FOUND)] and r_priv.detail.startswith("peer does not")
    assert all(h not in dst.blocks for h in private)
    assert sm.tenant_refused == 1
    assert not src.pins


async def test_more_blocks_than_the_limit_is_a_clear_failure() -> None:
    src, dst = MemoryBlockStore(LAYOUT), MemoryBlockStore(LAYOUT)
    hashes = make_chain(src, 5)
    sm = TransferMetrics()
    async with BlockServer(src, secret=SECRET, max_blocks=4, metrics=sm) as server:
        client = BlockClient(SECRET)
        over = await client.fetch(server.address, hashes, 0, NS, dst)
        at = await client.fetch(server.address, hashes[:4], 0, NS, dst)
    assert over.error is FailReason.TOO_MANY_BLOCKS and "at most 4" in over.detail
    assert over.failed == [(h, FailReason.TOO_MANY_BLOCKS) for h in hashes]
    assert at.received == hashes[:4]
    assert sm.too_many_blocks == 1


async def test_server_stop_is_safe_twice_and_address_needs_start() -> None:
    server = BlockServer(MemoryBlockStore(LAYOUT), secret=SECRET)
    with pytest.raises(Exception, match="start"):
        _ = server.address
    addr = await server.start()
    assert await server.start() == addr
    await server.stop()
    await server.stop()


async def test_measure_link_reports_positive_figures() -> None:
    async with BlockServer(MemoryBlockStore(LAYOUT), secret=SECRET) as server:
        figs = await measure_link(server.address, SECRET, probe_bytes=1 << 20, rounds=2)
        own = await server.measure_self(probe_bytes=1 << 20, rounds=1)
    assert figs.link_gbps > 0 and figs.latency_ms > 0
    assert own.link_gbps > 0


def test_empty_secret_is_refused_unless_insecure_dev(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InsecureSecret):
        resolve_secret(b"")
    with pytest.raises(InsecureSecret):
        BlockServer(MemoryBlockStore(LAYOUT), secret=b"")
    with pytest.raises(InsecureSecret):
        BlockClient(b"")
    assert resolve_secret(b"", insecure_dev=True)
    monkeypatch.setenv("KVMESH_FLEET_SECRET", "s3cret")
    monkeypatch.setenv("KVMESH_MAX_BLOCKS_PER_FETCH", "64")
    settings = TransferSettings()
    assert settings.secret_bytes() == b"s3cret" and settings.max_blocks_per_fetch == 64
    assert "s3cret" not in repr(settings)


def _signed(auth: FleetAuth, *, ts_ms: int, nonce: bytes = b"n" * 16) -> BlockRequest:
    req = BlockRequest([1, 2], NS, LAYOUT.describe(), "B", nonce, ts_ms)
    return BlockRequest(
        req.block_hashes, req.namespace, req.layout, req.peer_id, nonce, ts_ms, auth.sign(req)
    )


def test_fleet_auth_checks_mac_window_and_nonce() -> None:
    now = [1_000_000]
    auth = FleetAuth(SECRET, window_ms=1000, clock=lambda: now[0])
    ok = _signed(auth, ts_ms=now[0])
    auth.verify(ok)
    with pytest.raises(AuthFailed, match="replayed"):
        auth.verify(ok)
    with pytest.raises(AuthFailed, match="window"):
        auth.verify(_signed(auth, ts_ms=now[0] - 5000, nonce=b"m" * 16))
    tampered = BlockRequest([1, 3], ok.namespace, ok.layout, ok.peer_id, b"k" * 16, ok.ts_ms, ok.hmac)
    with pytest.raises(AuthFailed, match="MAC"):
        auth.verify(tampered)
    other = FleetAuth(b"other", clock=lambda: now[0])
    with pytest.raises(AuthFailed, match="MAC"):
        auth.verify(_signed(other, ts_ms=now[0], nonce=b"o" * 16))
    # After the window the nonce is forgotten, but the old timestamp is then refused anyway.
    now[0] += 5000
    with pytest.raises(AuthFailed, match="window"):
        auth.verify(ok)


def test_frames_round_trip_and_reject_garbage() -> None:
    data = np.arange(LAYOUT.nbytes // 4, dtype=np.float32).tobytes()
    hdr = pack_header(Status.OK, 2**64 - 1, len(data), checksum(data), 1)
    assert len(hdr) == 32
    h = unpack_header(hdr)
    assert (h.status, h.block_hash, h.nbytes, h.checksum, h.tier_name) == (
        Status.OK,
        2**64 - 1,
        len(data),
        checksum(data),
        "dram",
    )
    with pytest.raises(FrameError):
        unpack_header(b"XXXX" + hdr[4:])
    req = BlockRequest([0, 2**64 - 1], NS, "L1", "B", b"x" * 16, 5, b"m" * 32, probe_bytes=0)
    wire = req.encode()
    assert int.from_bytes(wire[:4], "big") == len(wire) - 4
    assert BlockRequest.decode(wire[4:]) == req
    with pytest.raises(FrameError):
        BlockRequest.decode(b"\xc1garbage")
    with pytest.raises(FrameError):
        BlockRequest.decode(BlockRequest([-1], NS, "L", "B", b"x", 1).encode()[4:])


async def test_garbage_request_gets_bad_request_and_server_survives() -> None:
    src, dst = MemoryBlockStore(LAYOUT), MemoryBlockStore(LAYOUT)
    hashes = make_chain(src, 2)
    sm = TransferMetrics()
    async with BlockServer(src, secret=SECRET, metrics=sm) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"\x00\x00\x00\x05hello")
            reply = await asyncio.get_running_loop().run_in_executor(None, s.recv, 32)
        assert unpack_header(reply).status is Status.BAD_REQUEST
        result = await BlockClient(SECRET).fetch(server.address, hashes, 0, NS, dst)
    assert result.received == hashes and sm.bad_frames == 1
