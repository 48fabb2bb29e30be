"""Every data-plane fault ends in a FetchResult (never an exception), commits only the verified leading
run, and is counted in metrics. Real sockets on 127.0.0.1; misbehaving peers are scripted servers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np
import pytest

from schemas.blocks import block_hashes, tenant_namespace
from services.worker.kv_layout import BlockLayout
from services.worker.transfer import BlockClient, BlockServer, FailReason, TransferMetrics
from services.worker.transfer.frames import REQUEST_PREFIX, BlockRequest, Status, checksum, pack_header
from services.worker.transfer.memory import MemoryBlockStore

SECRET = b"fleet-secret-for-tests"
LAYOUT = BlockLayout(layers=2, kv_heads=1, block_size=16, head_dim=8, dtype="float32")  # 2 KiB blocks
NS = tenant_namespace("acme")

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, BlockRequest], Awaitable[None]]


def chain(store: MemoryBlockStore, n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    hashes = block_hashes(rng.integers(0, 1000, size=n * LAYOUT.block_size), LAYOUT.block_size, NS)
    for h in hashes:
        store.put(h, rng.standard_normal(LAYOUT.nbytes // 4).astype(np.float32).tobytes(), NS)
    return hashes


def frame(store: MemoryBlockStore, h: int, *, corrupt: bool = False) -> bytes:
    data = bytearray(store.block_bytes(h))
    digest = checksum(data)
    if corrupt:
        data[100] ^= 0xFF
    return pack_header(Status.OK, h, len(data), digest, 1) + bytes(data)


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[[Script], Awaitable[str]]]:
    """Start a peer that reads one request and then runs ``script`` (send crafted frames, stall, close)."""
    servers: list[asyncio.Server] = []

    async def start(script: Script) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            (length,) = REQUEST_PREFIX.unpack(await reader.readexactly(4))
            req = BlockRequest.decode(await reader.readexactly(length))
            try:
                await script(reader, writer, req)
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        return f"127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for s in servers:
        s.close()
        await s.wait_closed()


def check_leading_run(result, hashes: list[int], n_ok: int, reason: FailReason) -> None:  # type: ignore[no-untyped-def]
    assert result.received == hashes[:n_ok]
    assert result.error is reason
    assert result.failed[0] == (hashes[n_ok], reason)
    assert all(r is FailReason.AFTER_GAP for _, r in result.failed[1:])
    assert [h for h, _ in result.failed] == hashes[n_ok:]


async def test_peer_closes_mid_stream_after_n_blocks(scripted) -> None:  # type: ignore[no-untyped-def]
    src, dst = MemoryBlockStore(LAYOUT), MemoryBlockStore(LAYOUT)
    hashes = chain(src, 10)

    async def die_after_3(_r: asyncio.StreamReader, w: asyncio.StreamWriter, req: BlockRequest) -> None:
        w.write(b"".join(frame(src, h) for h in req.block_hashes[:3]))
        await w.drain()

    addr = await scripted(die_after_3)
    metrics = TransferMetrics()
    result = await BlockClient(SECRET, metrics=metrics).fetch(addr, hashes, 0, NS, dst)
    check_leading_run(result, hashes, 3, FailReason.PEER_CLOSED)
    assert sorted(dst.blocks) == sorted(hashes[:3])
    assert all(dst.block_bytes(h) == src.block_bytes(h) for h in hashes[:3])
    assert metrics.fetch_failures["peer_closed"] == 1 and metrics.blocks_committed == 3


class CrashingSource(MemoryBlockStore):
    """A real server's block source that fails (as if the worker died) at its ``crash_at``-th read."""

    crash_at = 300

    def read_block(self, block_hash: int) -> tuple[str, memoryview] | None:
        if sum(self.pins.values()) + self.reads_released >= self.crash_at:
            raise RuntimeError("worker died")
        return super().read_block(block_hash)

    reads_released = 0

    def release_read(self, block_hash: int) -> None:
        self.reads_released += 1
        super().release_read(block_hash)


async def test_real_server_dying_mid_stream_leaves_a_verified_prefix() -> None:
    from services.worker.transfer import server as server_mod

    src, dst = CrashingSource(LAYOUT), MemoryBlockStore(LAYOUT)
    hashes = chain(src, 400)
    async with BlockServer(src, secret=SECRET) as server:
        result = await BlockClient(SECRET).fetch(server.address, hashes, 0, NS, dst)
    # the first batch went out before the source failed; the stream then ended between frames
    n_ok = server_mod._BATCH_BLOCKS
    check_leading_run(result, hashes, n_ok, FailReason.PEER_CLOSED)
    assert all(dst.block_bytes(h) == src.block_bytes(h) for h in hashes[:n_ok])
    assert not src.pins


async def test_truncated_frame(scripted) -> None:  # type: ignore[no-untyped-def]
    src, dst = MemoryBlockStore(LAYOUT), MemoryBlockStore(LAYOUT)
    hashes = chain(src, 5)

    async def truncate(_r: asyncio.StreamReader, w: asyncio.StreamWriter, req: BlockRequest) -> None:
        w.write(frame(src, hashes[0]) + frame(src, hashes[1]) + frame(src, hashes[2])[: 32 + 500])
        await w.drain()

    metrics = TransferMetrics()
    result = await BlockClient(SECRET, metrics=metrics).fetch(await scripted(truncate), hashes, 0, NS, dst)
    check_leading_run(result, hashes, 2, FailReason.TRUNCATED)
    assert metrics.fetch_failures["truncated"] == 1


async def test_truncated_header(scripted) -> None:  # type: ignore[no-untyped-def]
    src, dst = MemoryBlockStore(LAYOUT), MemoryBlockStore(LAYOUT)
    hashes = chain(src, 3)

    async def half_header(_r: asyncio.StreamReader, w: asyncio.StreamWriter, req: BlockRequest) -> None:
        w.write(frame(src, hashes[0]) + frame(src, hashes[1])[:10])
        await w.drain()

    result = await BlockClient(SECRET).fetch(await scripted(half_header), hashes, 0, NS, dst)
    check_leading_run(result, hashes, 1, FailReason.TRUNCATED)


async def test_wrong_checksum_stops_at_the_corrupt_block(scripted) -> None:  # type: ignore[no-untyped-def]
    src, dst = MemoryBlockStore(LAYOUT), MemoryBlockStore(LAYOUT)
    hashes = chain(src, 4)

    async def corrupt(_r: asyncio.StreamReader, w: asyncio.StreamWriter, req: BlockRequest) -> None:
        w.write(
            frame(src, hashes[0])
            + frame(src, hashes[1], corrupt=True)
            + b"".join(frame(src, h) for h in hashes[2:])
        )
        w.write(pack_header(Status.END, 4))
        await w.drain()

    metrics = TransferMetrics()
    result = await BlockClient(SECRET, metrics=metrics).fetch(await scripted(corrupt), hashes, 0, NS, dst)
    check_leading_run(result, hashes, 1, FailReason.CHECKSUM)
    assert set(dst.blocks) == {hashes[0]}  # neither the corrupt block nor the ones after it
    assert metrics.fetch_failures["checksum"] == 1


async def test_frame_for_another_block_is_a_protocol_fault(scripted) -> None:  # type: ignore[no-untyped-def]
    src, dst = MemoryBlockStore(LAYOUT), MemoryBlockStore(LAYOUT)
    hashes = chain(src, 3)

    async def swapped(_r: asyncio.StreamReader, w: asyncio.StreamWriter, req: BlockRequest) -> None:
        w.write(frame(src, hashes[0]) + frame(src, hashes[2]) + b"JUNK" * 8)
        await w.drain()

    result = await BlockClient(SECRET).fetch(await scripted(swapped), hashes, 0, NS, dst)
    check_leading_run(result, hashes, 1, FailReason.PROTOCOL)


async def test_block_the_peer_no_longer_has() -> None:
    src, dst = MemoryBlockStore(LAYOUT), MemoryBlockStore(LAYOUT)
    hashes = chain(src, 8)
    del src.blocks[hashes[5]]  # evicted since the peer announced it
    metrics = TransferMetrics()
    async with BlockServer(src, secret=SECRET) as server:
        result = await BlockClient(SECRET, metrics=metrics).fetch(server.address, hashes, 0, NS, dst)
    check_leading_run(result, hashes, 5, FailReason.NOT_FOUND)
    assert hashes[6] not in dst.blocks  # held by the peer, but useless after the gap
    assert metrics.fetch_failures["not_found"] == 1


async def test_layout_mismatch() -> None:
    src = MemoryBlockStore(LAYOUT)
    hashes = chain(src, 3)
    other = BlockLayout(layers=2, kv_heads=1, block_size=16, head_dim=8, dtype="float16")
    dst = MemoryBlockStore(other)
    sm, cm = TransferMetrics(), TransferMetrics()
    async with BlockServer(src, secret=SECRET, metrics=sm) as server:
        result = await BlockClient(SECRET, metrics=cm).fetch(server.address, hashes, 0, NS, dst)
    assert result.received == [] and result.error is FailReason.LAYOUT_MISMATCH
    assert result.failed == [(h, FailReason.LAYOUT_MISMATCH) for h in hashes]
    assert sm.layout_mismatch == 1 and sm.blocks_sent == 0 and cm.fetch_failures["layout_mismatch"] == 1


async def test_block_of_the_wrong_size_is_a_layout_mismatch(scripted) -> None:  # type: ignore[no-untyped-def]
    src, dst = MemoryBlockStore(LAYOUT), MemoryBlockStore(LAYOUT)
    hashes = chain(src, 2)

    async def short_block(_r: asyncio.StreamReader, w: asyncio.StreamWriter, req: BlockRequest) -> None:
        data = src.block_bytes(hashes[0])[:1024]
        w.write(pack_header(Status.OK, hashes[0], len(data), checksum(data)) + data)
        await w.drain()

    result = await BlockClient(SECRET).fetch(await scripted(short_block), hashes, 0, NS, dst)
    assert result.error is FailReason.LAYOUT_MISMATCH and result.received == []


async def test_connection_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    metrics = TransferMetrics()
    result = await BlockClient(SECRET, metrics=metrics).fetch(
        f"127.0.0.1:{port}", [1, 2], 0, NS, MemoryBlockStore(LAYOUT)
    )
    assert result.error is FailReason.CONNECTION_REFUSED
    assert result.failed == [(1, FailReason.CONNECTION_REFUSED), (2, FailReason.CONNECTION_REFUSED)]
    assert metrics.fetch_failures["connection_refused"] == 1


async def test_bad_address_is_a_connection_error() -> None:
    result = await BlockClient(SECRET).fetch("not-an-address", [1], 0, NS, MemoryBlockStore(LAYOUT))
    assert result.error is FailReason.CONNECTION_ERROR


async def test_peer_that_stalls_times_out(scripted) -> None:  # type: ignore[no-untyped-def]
    async def stall(_r: asyncio.StreamReader, w: asyncio.StreamWriter, req: BlockRequest) -> None:
        await asyncio.sleep(30)

    metrics = TransferMetrics()
    client = BlockClient(SECRET, timeout_s=0.3, metrics=metrics)
    result = await client.fetch(await scripted(stall), [1, 2, 3], 0, NS, MemoryBlockStore(LAYOUT))
    assert result.error is FailReason.TIMEOUT and result.received == []
    assert result.failed[0] == (1, FailReason.TIMEOUT)
    assert metrics.fetch_failures["timeout"] == 1


async def test_peer_that_stalls_mid_stream_keeps_the_verified_prefix(scripted) -> None:  # type: ignore[no-untyped-def]
    src, dst = MemoryBlockStore(LAYOUT), MemoryBlockStore(LAYOUT)
    hashes = chain(src, 6)

    async def slow(_r: asyncio.StreamReader, w: asyncio.StreamWriter, req: BlockRequest) -> None:
        w.write(b"".join(frame(src, h) for h in hashes[:2]))
        await w.drain()
        await asyncio.sleep(30)

    result = await BlockClient(SECRET, timeout_s=0.3).fetch(await scripted(slow), hashes, 0, NS, dst)
    check_leading_run(result, hashes, 2, FailReason.TIMEOUT)
    assert set(dst.blocks) == set(hashes[:2])


async def test_wrong_tenant_namespace_gets_nothing() -> None:
    src, dst = MemoryBlockStore(LAYOUT), MemoryBlockStore(LAYOUT)
    hashes = chain(src, 4)
    async with BlockServer(src, secret=SECRET) as server:
        result = await BlockClient(SECRET).fetch(server.address, hashes, 0, tenant_namespace("evil"), dst)
    check_leading_run(result, hashes, 0, FailReason.NOT_FOUND)
    assert not dst.blocks


async def test_bad_hmac_refused_then_right_secret_served() -> None:
    src = MemoryBlockStore(LAYOUT)
    hashes = chain(src, 2)
    sm = TransferMetrics()
    async with BlockServer(src, secret=SECRET, metrics=sm) as server:
        bad = await BlockClient(b"wrong").fetch(server.address, hashes, 0, NS, MemoryBlockStore(LAYOUT))
        good = await BlockClient(SECRET).fetch(server.address, hashes, 0, NS, MemoryBlockStore(LAYOUT))
    assert bad.error is FailReason.REFUSED and good.ok
    assert sm.auth_refused == 1


async def test_a_sink_that_refuses_blocks_is_a_commit_failure() -> None:
    from services.worker.transfer.errors import TransferError

    class Refusing(MemoryBlockStore):
        def commit_blocks(self, blocks, namespace):  # type: ignore[no-untyped-def]
            raise TransferError("pool full")

    src = MemoryBlockStore(LAYOUT)
    hashes = chain(src, 2)
    async with BlockServer(src, secret=SECRET) as server:
        result = await BlockClient(SECRET).fetch(server.address, hashes, 0, NS, Refusing(LAYOUT))
    assert result.received == [] and result.error is FailReason.COMMIT_FAILED


async def test_unauthenticated_connections_cannot_take_the_servers_memory_or_slots() -> None:
    """A flood of half-open connections, each declaring a 1 MiB request and sending part of it, holds
    at most the pending-bytes budget and the connection cap; an honest fetch still works after."""
    src = MemoryBlockStore(LAYOUT)
    hashes = chain(src, 3)
    sm = TransferMetrics()
    server = BlockServer(src, secret=SECRET, metrics=sm, max_connections=16, max_pending_bytes=256 << 10)
    async with server:
        host, port = server.address.split(":")
        socks: list[socket.socket] = []
        try:
            for i in range(40):
                s = socket.create_connection((host, int(port)))
                # declared 1 MiB; the first 20 send 100 KiB of junk, the rest nothing
                s.sendall(REQUEST_PREFIX.pack(1 << 20) + (b"\0" * (100 << 10) if i < 20 else b""))
                socks.append(s)
            await asyncio.sleep(0.5)
            assert len(server._conns) <= 16 and sm.connections_refused >= 40 - 16
            assert server._pending_bytes <= 256 << 10
            assert sm.pending_bytes_refused >= 1  # 16 x 100 KiB would be over the budget
        finally:
            for s in socks:
                s.close()
        await asyncio.sleep(0.2)
        assert server._pending_bytes == 0
        good = await BlockClient(SECRET).fetch(server.address, hashes, 0, NS, MemoryBlockStore(LAYOUT))
        assert good.ok
