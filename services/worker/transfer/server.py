"""The block server: a worker's data-plane endpoint that hands its KV blocks to authenticated peers.

One connection carries one request (see ``frames``). The server reads blocks from any tier through
``BlockSource.read_block`` (which pins without promoting), sends each block's memoryview as is (the
header and the view go out together with ``sendmsg``; nothing is joined or copied in Python) and
releases the pin once the kernel has taken the bytes. Many connections are served at once, one task
each; all run on the event loop thread, so the source is only ever touched from that thread.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import warnings
from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

import xxhash

from schemas.blocks import PUBLIC_NAMESPACE
from services.worker.kv_layout import BlockSource
from services.worker.transfer import sockets
from services.worker.transfer.auth import FleetAuth, resolve_secret
from services.worker.transfer.errors import AuthFailed, FrameError, ServerNotStarted
from services.worker.transfer.frames import (
    HEADER,
    MAGIC,
    MAX_REQUEST_BYTES,
    REQUEST_PREFIX,
    TIER_CODES,
    UNKNOWN_TIER,
    BlockRequest,
    Status,
    pack_header,
)
from services.worker.transfer.metrics import TransferMetrics

if TYPE_CHECKING:
    from services.worker.transfer.client import LinkFigures
from streams.clock import now_ms
from streams.tasks import stop_task, stop_tasks

log = logging.getLogger(__name__)

DEFAULT_MAX_BLOCKS = 4096
#: Blocks pinned and handed to one sendmsg call; bounded by bytes too so pins stay short-lived.
_BATCH_BLOCKS = 256
_BATCH_BYTES = 8 << 20
#: Largest filler a link probe may ask for.
MAX_PROBE_BYTES = 256 << 20
#: How long a connection may take to send its request (an idle peer must not hold a task forever).
REQUEST_TIMEOUT_S = 10.0
#: Connections served at once; more are closed on accept (peers retry or recompute).
DEFAULT_MAX_CONNECTIONS = 64
#: Bytes of not yet authenticated requests held at once, over all connections. A request is read in
#: pieces as its bytes arrive (never allocated at its declared length), so a peer that declares a
#: large request and sends nothing holds nothing; one that sends junk holds at most this in all.
DEFAULT_MAX_PENDING_BYTES = 8 << 20
_READ_PIECE = 64 << 10


class BlockServer:
    """Serves blocks of one ``BlockSource`` on a loopback/LAN TCP port.

    Owns the listening socket, one task per open connection and the replay cache of its ``FleetAuth``.
    Invariants: nothing but a single refusal header is written to a peer that fails authentication;
    a block is sent only if ``source.namespace_of(hash)`` is the request's namespace or the public one
    (otherwise it is answered NOT_FOUND, as if absent); every pin taken with ``read_block`` is released.
    """

    def __init__(
        self,
        source: BlockSource,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        metrics: TransferMetrics | None = None,
        insecure_dev: bool = False,
        replay_window_ms: int = 30_000,
        clock: Callable[[], int] = now_ms,
    ) -> None:
        self.source = source
        self.host = host
        self.port = port
        self.max_blocks = max_blocks
        self.max_connections = max_connections
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0  # bytes of requests read but not yet authenticated
        self.metrics = metrics if metrics is not None else TransferMetrics()
        self._secret = resolve_secret(secret, insecure_dev)
        self._auth = FleetAuth(self._secret, window_ms=replay_window_ms, clock=clock)
        self._sock: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._address: str | None = None
        self._zeros: memoryview | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> str:
        if self._address is None:
            raise ServerNotStarted("BlockServer.start() has not been called")
        return self._address

    async def start(self) -> str:
        """Bind and listen; returns ``host:port`` (what LoadReport.transfer_address announces)."""
        if self._address is not None:
            return self._address
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted sockets inherit the listener's buffer sizes; set them before listen() so the TCP
        # window scale is negotiated for the large buffer.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sockets.SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sockets.SOCKET_BUFFER_BYTES)
        sock.bind((self.host, self.port))
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._address = f"{self.host}:{self.port}"
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop(), name="block-server")
        log.info("block server listening on %s (layout %s)", self._address, self.source.layout.describe())
        return self._address

    async def stop(self) -> None:
        """Close the listener and every open connection. Safe to call twice."""
        task, self._accept_task = self._accept_task, None
        await stop_task(task)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        conns, self._conns = list(self._conns), set()
        await stop_tasks(conns, swallow_errors=True)
        self._address = None

    def __del__(self) -> None:
        sock = getattr(self, "_sock", None)  # absent when __init__ raised (e.g. an empty secret)
        if sock is not None:
            warnings.warn(f"unclosed BlockServer on {self._address}", ResourceWarning, stacklevel=1)
            sock.close()

    async def __aenter__(self) -> BlockServer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # ------------------------------------------------------------------ serving
    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, _addr = await loop.sock_accept(self._sock)
            self.metrics.connections += 1
            if len(self._conns) >= self.max_connections:
                self.metrics.connections_refused += 1
                conn.close()
                continue
            task = loop.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            sockets.tune(conn)
            await self._handle(loop, conn)
        except (OSError, sockets.PeerClosed) as exc:
            # The fetcher went away or timed out; its client records the fault, not us.
            log.debug("block server connection ended: %s", exc)
        except Exception:
            # A fault in the block source must not take the server down; the peer sees a closed stream.
            log.exception("block server connection failed")
        finally:
            conn.close()

    async def _handle(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                req = await self._read_request(loop, conn)
        except FrameError as exc:
            self.metrics.bad_frames += 1
            log.warning("bad data-plane request: %s", exc)
            await self._answer(loop, conn, Status.BAD_REQUEST)
            return
        except TimeoutError:
            self.metrics.bad_frames += 1
            return
        try:
            self._auth.verify(req)
        except AuthFailed as exc:
            self.metrics.auth_refused += 1
            log.warning("refused data-plane peer %r: %s", req.peer_id, exc)
            await self._answer(loop, conn, Status.REFUSED)
            return
        if req.probe_bytes:
            await self._send_probe(loop, conn, min(req.probe_bytes, MAX_PROBE_BYTES))
            return
        if len(req.block_hashes) > self.max_blocks:
            self.metrics.too_many_blocks += 1
            await self._answer(loop, conn, Status.TOO_MANY_BLOCKS, self.max_blocks)
            return
        if req.block_hashes and req.layout != self.source.layout.describe():
            self.metrics.layout_mismatch += 1
            await self._answer(loop, conn, Status.LAYOUT_MISMATCH)
            return
        self.metrics.requests_served += 1
        await self._stream_blocks(loop, conn, req)

    async def _read_request(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> BlockRequest:
        prefix = bytearray(REQUEST_PREFIX.size)
        await sockets.recv_exact(loop, conn, memoryview(prefix))
        (length,) = REQUEST_PREFIX.unpack(prefix)
        if length > MAX_REQUEST_BYTES:
            raise FrameError(f"request of {length} bytes exceeds {MAX_REQUEST_BYTES}")
        # Read in pieces as the bytes arrive, each counted against the server-wide budget of
        # unauthenticated bytes before it is allocated (see DEFAULT_MAX_PENDING_BYTES).
        body = bytearray()
        held = 0
        try:
            while len(body) < length:
                piece = min(_READ_PIECE, length - len(body))
                if self._pending_bytes + piece > self.max_pending_bytes:
                    self.metrics.pending_bytes_refused += 1
                    raise FrameError("too many unauthenticated request bytes held; try again")
                self._pending_bytes += piece
                held += piece
                buf = bytearray(piece)
                n = await sockets.recv_some(loop, conn, [memoryview(buf)])
                if n == 0:
                    raise sockets.PeerClosed(len(body), length)
                body += buf[:n]
                self._pending_bytes -= piece - n
                held -= piece - n
            return BlockRequest.decode(bytes(body))
        finally:
            self._pending_bytes -= held

    async def _answer(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, status: Status, value: int = 0
    ) -> None:
        await sockets.send_all(loop, conn, [memoryview(pack_header(status, value))])

    async def _stream_blocks(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, req: BlockRequest
    ) -> None:
        src = self.source
        allowed = (req.namespace, PUBLIC_NAMESPACE)
        sent = 0  # OK frames, for the END frame and the metrics
        hashes = req.block_hashes
        n = len(hashes)
        xxh = xxhash.xxh3_64_intdigest  # = frames.checksum, without the call in between
        i = 0
        stopped = False
        while not stopped:
            pinned: list[int] = []
            bufs: list[memoryview] = []
            batch_ok = 0
            batch_bytes = 0
            try:
                # Hot loop (once per block): locals only; tier counts are added per batch.
                read, ns_of, pack, ok = src.read_block, src.namespace_of, HEADER.pack, int(Status.OK)
                tiers: Counter[str] = Counter()
                while i < n and len(pinned) < _BATCH_BLOCKS and batch_bytes < _BATCH_BYTES:
                    h = hashes[i]
                    got = read(h)
                    if got is None:
                        bufs.append(memoryview(pack_header(Status.NOT_FOUND, h)))
                        stopped = True
                        break
                    pinned.append(h)
                    if ns_of(h) not in allowed:
                        # Another tenant's block: answer exactly as if it were absent.
                        self.metrics.tenant_refused += 1
                        bufs.append(memoryview(pack_header(Status.NOT_FOUND, h)))
                        stopped = True
                        break
                    tier, view = got
                    data = view if view.format == "B" and view.ndim == 1 else view.cast("B")
                    size = len(data)
                    bufs.append(
                        memoryview(pack(MAGIC, ok, TIER_CODES.get(tier, UNKNOWN_TIER), 0, h, size, xxh(data)))
                    )
                    bufs.append(data)
                    batch_ok += 1
                    batch_bytes += size
                    tiers[tier] += 1
                    i += 1
                self.metrics.sent_by_tier.update(tiers)
                if stopped:
                    self.metrics.not_found_sent += 1
                if i >= n:
                    stopped = True
                if stopped:
                    bufs.append(memoryview(pack_header(Status.END, sent + batch_ok)))
                await sockets.send_all(loop, conn, bufs)
            finally:
                for h in pinned:
                    src.release_read(h)
            sent += batch_ok
            self.metrics.blocks_sent += batch_ok
            self.metrics.bytes_sent += batch_bytes
        log.debug("served %d/%d blocks to %s", sent, len(hashes), req.peer_id)

    async def _send_probe(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, nbytes: int) -> None:
        # Filler from one shared zero buffer: the probe measures the link, not memory bandwidth.
        if self._zeros is None or len(self._zeros) < nbytes:
            self._zeros = memoryview(bytearray(nbytes))
        data = self._zeros[:nbytes]
        header = pack_header(Status.PROBE, 0, nbytes, 0)
        await sockets.send_all(loop, conn, [memoryview(header), data, memoryview(pack_header(Status.END))])

    async def measure_self(self, *, probe_bytes: int = 16 << 20, rounds: int = 3) -> LinkFigures:
        """Link figures of this host measured over loopback against this server (a LoadReport default)."""
        from services.worker.transfer.client import measure_link

        return await measure_link(self.address, self._secret, probe_bytes=probe_bytes, rounds=rounds)
