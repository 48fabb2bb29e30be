"""The block client: pulls a chained run of KV blocks from a peer's block server into a BlockSink.

Bytes land straight in the sink's staging buffer (``recv_into`` on a non-blocking socket, no per-frame
``bytes``); each block is checked against its xxh3 checksum; only the verified *leading run* is
committed, because a block after a missing one is useless to a chained prefix. Every fault ends in a
``FetchResult`` (never an exception): the caller recomputes whatever did not arrive whole.

    requested   h0  h1  h2  h3  h4  h5
    frames      ok  ok  ok  BAD .   .        -> commit h0..h2; failed: h3 (checksum), h4, h5 (after_gap)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import xxhash

from kvmesh_core.errors import KvmeshError
from services.worker.kv_layout import BlockSink
from services.worker.transfer import sockets
from services.worker.transfer.auth import new_nonce, resolve_secret, sign
from services.worker.transfer.errors import FrameError
from services.worker.transfer.frames import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    BlockRequest,
    FrameHeader,
    Status,
    unpack_header,
)
from services.worker.transfer.metrics import TransferMetrics
from streams.clock import now_ms

log = logging.getLogger(__name__)

#: Frames one scatter read may span (at 32 KiB blocks, about the kernel's socket buffer).
_WINDOW_FRAMES = 128


class FailReason(StrEnum):
    """Why a block did not arrive. The first failed block carries the cause; later ones ``after_gap``."""

    NOT_FOUND = "not_found"  # the peer does not hold it (or holds it for another tenant)
    REFUSED = "refused"  # fleet authentication failed (wrong secret, replay, clock skew)
    LAYOUT_MISMATCH = "layout_mismatch"  # peer's model/dtype/block layout differs from ours
    TOO_MANY_BLOCKS = "too_many_blocks"  # more blocks than the peer serves in one fetch
    BAD_REQUEST = "bad_request"
    CHECKSUM = "checksum"  # bytes arrived corrupt
    TRUNCATED = "truncated"  # the stream ended inside a frame
    PEER_CLOSED = "peer_closed"  # the stream ended between frames, before this block
    CONNECTION_REFUSED = "connection_refused"
    CONNECTION_ERROR = "connection_error"  # reset, unreachable, bad address
    TIMEOUT = "timeout"
    PROTOCOL = "protocol"  # a frame that is not what was asked (wrong hash, bad magic)
    COMMIT_FAILED = "commit_failed"  # the sink would not take verified blocks
    AFTER_GAP = "after_gap"  # follows a failed block, so useless even if it had arrived


_WHOLE_REQUEST = frozenset(
    {
        FailReason.REFUSED,
        FailReason.LAYOUT_MISMATCH,
        FailReason.TOO_MANY_BLOCKS,
        FailReason.BAD_REQUEST,
        FailReason.CONNECTION_REFUSED,
        FailReason.CONNECTION_ERROR,
        FailReason.COMMIT_FAILED,
    }
)


@dataclass
class FetchResult:
    """Outcome of one fetch. ``received`` is the committed leading run, in request order."""

    address: str
    received: list[int] = field(default_factory=list)
    failed: list[tuple[int, FailReason]] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    committed: int = 0  # what the sink reported as newly inserted (<= len(received))
    error: FailReason | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass(frozen=True, slots=True)
class LinkFigures:
    """What a worker publishes in LoadReport (link_gbps, link_latency_ms)."""

    link_gbps: float
    latency_ms: float


class _Fault(Exception):
    """Internal: ends the receive loop with a reason for block ``index`` (or the whole request)."""

    def __init__(self, reason: FailReason, index: int, detail: str = "") -> None:
        super().__init__(detail or reason.value)
        self.reason = reason
        self.index = index
        self.detail = detail


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


async def _connect(address: str) -> socket.socket:
    host, port = _split_address(address)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sockets.tune(sock)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return sock


class BlockClient:
    """Fetches blocks from peers. Stateless between fetches (one connection per fetch), so many fetches
    to different peers may run at once; owns only its secret and adds to ``metrics``."""

    def __init__(
        self,
        secret: bytes,
        *,
        timeout_s: float = 5.0,
        metrics: TransferMetrics | None = None,
        insecure_dev: bool = False,
    ) -> None:
        self._secret = resolve_secret(secret, insecure_dev)
        self.timeout_s = timeout_s
        self.metrics = metrics if metrics is not None else TransferMetrics()

    def _request(
        self, hashes: list[int], namespace: bytes, layout: str, peer_id: str, probe: int = 0
    ) -> bytes:
        req = BlockRequest(
            block_hashes=hashes,
            namespace=namespace,
            layout=layout,
            peer_id=peer_id,
            nonce=new_nonce(),
            ts_ms=now_ms(),
            probe_bytes=probe,
        )
        return dataclasses.replace(req, hmac=sign(self._secret, req)).encode()

    async def fetch(
        self,
        address: str,
        block_hashes: Sequence[int],
        parents: Sequence[int] | int,
        namespace: bytes,
        sink: BlockSink,
        *,
        peer_id: str = "",
    ) -> FetchResult:
        """Pull ``block_hashes`` (a chained run) from the server at ``address`` into ``sink``.

        ``parents`` is the parent hash of each block, or just the first block's parent (each later
        block's parent is then the block before it). Never raises for a transfer fault.
        """
        hashes = [int(h) for h in block_hashes]
        if isinstance(parents, int):
            parent_list = [parents, *hashes[:-1]]
        else:
            parent_list = [int(p) for p in parents]
            if len(parent_list) != len(hashes):
                raise ValueError("parents must have one entry per block hash")
        result = FetchResult(address=address)
        if not hashes:
            return result
        self.metrics.fetches += 1
        nb = sink.layout.nbytes
        staging = sockets.as_bytes_view(sink.staging_buffer(len(hashes)))
        if len(staging) < nb * len(hashes):
            raise ValueError("sink staging buffer is smaller than the blocks asked for")
        progress = [0]  # verified blocks so far; survives a timeout that cancels the receive loop
        t0 = time.perf_counter()
        fault: _Fault | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._transfer(address, hashes, namespace, sink, staging, progress, peer_id)
        except _Fault as f:
            fault = f
        except TimeoutError:
            fault = _Fault(FailReason.TIMEOUT, progress[0], f"no complete answer within {self.timeout_s}s")
        except ConnectionRefusedError as exc:
            fault = _Fault(FailReason.CONNECTION_REFUSED, 0, str(exc))
        except (ConnectionError, sockets.PeerClosed) as exc:
            fault = _Fault(FailReason.PEER_CLOSED, progress[0], str(exc))
        except (OSError, ValueError) as exc:  # unreachable host, bad address
            fault = _Fault(FailReason.CONNECTION_ERROR, progress[0], str(exc))
        result.seconds = time.perf_counter() - t0

        done = progress[0]
        result.bytes = done * nb
        self.metrics.blocks_received += done
        self.metrics.bytes_received += done * nb
        if done:
            blocks: list[tuple[int, int, bytes | memoryview]] = [
                (hashes[i], parent_list[i], staging[i * nb : (i + 1) * nb]) for i in range(done)
            ]
            try:
                result.committed = sink.commit_blocks(blocks, namespace)
            except KvmeshError as exc:
                log.warning("sink refused %d verified blocks from %s: %s", done, address, exc)
                fault = _Fault(FailReason.COMMIT_FAILED, 0, str(exc))
                done = 0
        result.received = hashes[:done]
        self.metrics.blocks_committed += result.committed
        if fault is not None:
            # The first block that did not arrive carries the cause, later ones are after_gap; a fault of
            # the whole request (refused, connection refused, ...) is the cause of every block.
            whole = fault.reason in _WHOLE_REQUEST
            result.failed = [
                (h, fault.reason if whole or k == 0 else FailReason.AFTER_GAP)
                for k, h in enumerate(hashes[done:])
            ]
            result.error = fault.reason
            result.detail = fault.detail
            self.metrics.fetch_failures[fault.reason.value] += 1
            log.info(
                "fetch from %s: %d/%d blocks, %s (%s)", address, done, len(hashes), fault.reason, fault.detail
            )
        else:
            self.metrics.fetches_complete += 1
        return result

    async def _transfer(
        self,
        address: str,
        hashes: list[int],
        namespace: bytes,
        sink: BlockSink,
        staging: memoryview,
        progress: list[int],
        peer_id: str,
    ) -> None:
        loop = asyncio.get_running_loop()
        nb = sink.layout.nbytes
        sock = await _connect(address)
        try:
            request = self._request(hashes, namespace, sink.layout.describe(), peer_id)
            await sockets.send_all(loop, sock, [memoryview(request)])
            await self._receive(loop, sock, hashes, nb, staging, progress)
        finally:
            sock.close()

    @staticmethod
    async def _receive(
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        hashes: list[int],
        nb: int,
        staging: memoryview,
        progress: list[int],
    ) -> None:
        """Receive the block frames, verifying each as soon as it is whole.

        The stream is read as if every frame were OK: frame i is a header (into ``headers[i]``) then
        ``nb`` bytes (into staging slot i), so one scatter read fills many headers and slots at once and
        payload bytes never pass through a Python object::

            stream   | hdr0 | block0 ........ | hdr1 | block1 ........ | hdr2 | ...
            lands in  headers[0] staging[0:nb]  headers[1] staging[nb:2nb] ...

        A header that is not OK ends the stream (NOT_FOUND, END, refusals), so whatever followed it and
        landed in a slot is garbage in a slot that is never committed.
        """
        n = len(hashes)
        hs = HEADER_SIZE
        seg = hs + nb
        hbuf = bytearray(hs * n)
        headers = memoryview(hbuf)
        unpack_from, xxh, ok = HEADER.unpack_from, xxhash.xxh3_64_intdigest, int(Status.OK)
        pos = 0  # stream bytes received
        j = 0  # next block to verify
        digest: int | None = None  # checksum from block j's header, once parsed
        while j < n:
            # iov: the rest of the frame at ``pos``, then whole frames, at most _WINDOW_FRAMES of them.
            f, w = divmod(pos, seg)
            if w < hs:
                iov = [headers[f * hs + w : (f + 1) * hs], staging[f * nb : (f + 1) * nb]]
            else:
                iov = [staging[f * nb + w - hs : (f + 1) * nb]]
            for g in range(f + 1, min(n, f + _WINDOW_FRAMES)):
                iov.append(headers[g * hs : (g + 1) * hs])
                iov.append(staging[g * nb : (g + 1) * nb])
            k = await sockets.recv_some(loop, sock, iov)
            pos += k
            while j < n:
                base = j * seg
                if digest is None:
                    if pos < base + hs:
                        break
                    magic, status, _tier, _rsvd, block_hash, size, digest = unpack_from(hbuf, j * hs)
                    if magic != MAGIC or status != ok:
                        h = _parse(headers[j * hs : (j + 1) * hs], j)  # raises FrameError for bad magic
                        raise _Fault(*_status_fault(h.status, j, h.block_hash))
                    if block_hash != hashes[j]:
                        raise _Fault(
                            FailReason.PROTOCOL, j, f"frame for {block_hash:#x}, asked {hashes[j]:#x}"
                        )
                    if size != nb:
                        raise _Fault(FailReason.LAYOUT_MISMATCH, j, f"block of {size} bytes, expected {nb}")
                if pos < base + seg:
                    break
                if xxh(staging[j * nb : (j + 1) * nb]) != digest:  # = frames.checksum
                    raise _Fault(FailReason.CHECKSUM, j, f"block {hashes[j]:#x} failed its checksum")
                digest = None
                j += 1
                progress[0] = j
            if k == 0 and j < n:
                got = pos - j * seg
                reason = FailReason.PEER_CLOSED if got == 0 else FailReason.TRUNCATED
                raise _Fault(reason, j, f"peer closed {got} bytes into frame {j}")
        # Every block arrived; the END frame is a courtesy we don't wait for.


def _parse(header: bytes | bytearray | memoryview, index: int) -> FrameHeader:
    try:
        return unpack_header(header)
    except FrameError as exc:
        raise _Fault(FailReason.PROTOCOL, index, str(exc)) from exc


def _status_fault(status: Status, index: int, value: int) -> tuple[FailReason, int, str]:
    if status is Status.NOT_FOUND:
        return FailReason.NOT_FOUND, index, f"peer does not hold block {value:#x}"
    if status is Status.END:
        return FailReason.NOT_FOUND, index, "peer ended the stream early"
    if status is Status.REFUSED:
        return FailReason.REFUSED, 0, "peer refused authentication"
    if status is Status.LAYOUT_MISMATCH:
        return FailReason.LAYOUT_MISMATCH, 0, "peer holds blocks of another layout"
    if status is Status.TOO_MANY_BLOCKS:
        return FailReason.TOO_MANY_BLOCKS, 0, f"peer serves at most {value} blocks per fetch"
    if status is Status.BAD_REQUEST:
        return FailReason.BAD_REQUEST, 0, "peer could not parse the request"
    return FailReason.PROTOCOL, index, f"unexpected frame status {status.name}"


async def measure_link(
    address: str, secret: bytes, *, probe_bytes: int = 16 << 20, rounds: int = 3, timeout_s: float = 10.0
) -> LinkFigures:
    """Latency (best round trip of an empty signed request, connect included) and throughput (best of
    ``rounds`` probes of ``probe_bytes`` filler) to the block server at ``address``."""
    client = BlockClient(secret, timeout_s=timeout_s)
    loop = asyncio.get_running_loop()
    scratch = memoryview(bytearray(probe_bytes))
    header = memoryview(bytearray(HEADER_SIZE))
    best_lat = float("inf")
    best_bw = 0.0
    async with asyncio.timeout(timeout_s * max(rounds, 1) * 2):
        for _ in range(max(rounds, 1)):
            t0 = time.perf_counter()
            sock = await _connect(address)
            try:
                await sockets.send_all(loop, sock, [memoryview(client._request([], b"", "", "link-probe"))])
                await sockets.recv_exact(loop, sock, header)
            finally:
                sock.close()
            best_lat = min(best_lat, time.perf_counter() - t0)

            sock = await _connect(address)
            try:
                await sockets.send_all(
                    loop, sock, [memoryview(client._request([], b"", "", "link-probe", probe=probe_bytes))]
                )
                t0 = time.perf_counter()
                await sockets.recv_exact(loop, sock, header)
                h = unpack_header(header)
                if h.status is not Status.PROBE:
                    raise FrameError(f"link probe answered {h.status.name}")
                await sockets.recv_exact(loop, sock, scratch[: h.nbytes])
                dt = time.perf_counter() - t0
            finally:
                sock.close()
            best_bw = max(best_bw, h.nbytes / dt / 1e9 if dt > 0 else 0.0)
    return LinkFigures(link_gbps=best_bw, latency_ms=best_lat * 1e3)
