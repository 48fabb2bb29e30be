"""Non-blocking socket I/O for the data plane, without per-frame copies.

asyncio's stream transports copy whatever the kernel does not take at once into their own buffer, and
``loop.sock_recv_into`` costs a coroutine and a future per call even when bytes are already waiting.
These helpers try the syscall first and touch the event loop only when the socket would block; sends
go out with ``sendmsg`` (a header and the block's own memoryview in one syscall, never joined).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence

from services.worker.transfer.errors import TransferError

#: Socket buffer sizes asked of the kernel (it may clamp them to net.core.[rw]mem_max).
SOCKET_BUFFER_BYTES = 8 << 20
_IOV_MAX = 1024


class PeerClosed(TransferError):
    """The peer closed the connection after ``got`` of the ``wanted`` bytes of a read."""

    def __init__(self, got: int, wanted: int) -> None:
        super().__init__(f"peer closed after {got} of {wanted} bytes")
        self.got = got
        self.wanted = wanted


def tune(sock: socket.socket, buffer_bytes: int = SOCKET_BUFFER_BYTES) -> None:
    """Large kernel buffers (fewer wake-ups per MiB), no Nagle delay on the small headers, non-blocking."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)


def as_bytes_view(buf: bytes | bytearray | memoryview) -> memoryview:
    """A flat unsigned-byte view of ``buf`` (tensor memoryviews come typed and shaped)."""
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


async def _wait(loop: asyncio.AbstractEventLoop, sock: socket.socket, writable: bool) -> None:
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    fd = sock.fileno()
    if writable:
        loop.add_writer(fd, ready)
    else:
        loop.add_reader(fd, ready)
    try:
        await fut
    finally:
        if writable:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


async def send_all(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, buffers: Sequence[memoryview]
) -> int:
    """Send every buffer in order (gathered with sendmsg); returns the bytes sent."""
    bufs = list(buffers)
    i = 0
    total = 0
    while i < len(bufs):
        try:
            n = sock.sendmsg(bufs[i : i + _IOV_MAX])
        except (BlockingIOError, InterruptedError):
            await _wait(loop, sock, writable=True)
            continue
        total += n
        # Advance past what the kernel took; a partly sent buffer is re-sliced (a view, not a copy).
        while n and i < len(bufs):
            size = len(bufs[i])
            if n >= size:
                n -= size
                i += 1
            else:
                bufs[i] = bufs[i][n:]
                n = 0
        while i < len(bufs) and len(bufs[i]) == 0:
            i += 1
    return total


async def recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely from the socket, straight into its memory; PeerClosed on early EOF."""
    got = 0
    wanted = len(view)
    while got < wanted:
        try:
            n = sock.recv_into(view[got:])
        except (BlockingIOError, InterruptedError):
            await _wait(loop, sock, writable=False)
            continue
        if n == 0:
            raise PeerClosed(got, wanted)
        got += n


async def recv_some(loop: asyncio.AbstractEventLoop, sock: socket.socket, views: list[memoryview]) -> int:
    """One scatter read into ``views`` (at least one byte, or 0 at EOF), waiting only if nothing is there."""
    while True:
        try:
            n, _anc, _flags, _addr = sock.recvmsg_into(views)
            return n
        except (BlockingIOError, InterruptedError):
            await _wait(loop, sock, writable=False)
