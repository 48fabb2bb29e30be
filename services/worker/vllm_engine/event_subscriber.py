"""vLLM's KV-event stream, read in order: a ZMQ SUB socket, sequence checks, replay on a gap.

vLLM's ``ZmqEventPublisher`` sends each batch as three frames and keeps the last ``buffer_steps``
batches for replay on a ROUTER socket::

    PUB     [topic | seq: 8 bytes big-endian | msgpack [ts, [event, ...], dp_rank]]
    replay  request  [b"" | start seq: 8 bytes]            (from our DEALER)
            answers  [b"" | topic | seq | payload] ...      every buffered batch with seq >= start
                     [b"" | b"" | -1 (8 bytes, signed) | b""]   end of replay

Reading rules: sequence numbers start at 0 and grow by one. A batch older than the next expected one
is a duplicate and skipped. A newer one means batches were dropped (the PUB socket's high-water mark,
a slow joiner): the subscriber asks the replay endpoint for everything from the next expected seq. If
the replay answers from a later seq than asked, or not at all, the gap is lost for good and
``Drained.lost`` says so; the engine then re-announces what it holds instead of guessing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

log = logging.getLogger(__name__)

_END_SEQ = -1


@dataclass(slots=True)
class Drained:
    """What one ``drain`` read: decoded event batches in sequence order, and whether any were lost."""

    batches: list[list[Any]] = field(default_factory=list)
    lost: bool = False
    replayed: int = 0


class EventSubscriber:
    """Owns a SUB socket on vLLM's publisher and a DEALER on its replay endpoint (one thread uses both)."""

    def __init__(
        self, endpoint: str, replay_endpoint: str | None, topic: str = "", replay_timeout_ms: int = 2000
    ) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sub: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_ms = replay_timeout_ms
        self._decoder = msgspec.msgpack.Decoder()
        self.next_seq = 0
        self.gaps = 0
        self.lost_gaps = 0
        self.bad_batches = 0
        self._closed = False

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The SUB socket (tests drop a message by reading it here first)."""
        return self._sub

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sub.close(linger=0)

    def drain(self, max_batches: int = 10_000) -> Drained:
        """Every batch that arrived since the last call, gaps filled from the replay endpoint."""
        out = Drained()
        n = 0
        while n < max_batches and not self._closed and self._sub.poll(0):
            frames = self._sub.recv_multipart()
            n += 1
            if len(frames) != 3 or len(frames[1]) != 8:
                self.bad_batches += 1
                out.lost = True  # cannot tell which batch it was: treat like a lost one
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq < self.next_seq:
                continue  # duplicate of a replayed batch
            if seq > self.next_seq:
                self.gaps += 1
                self._fill_gap(seq, out)
            self._accept(seq, frames[2], out)
        return out

    def _accept(self, seq: int, payload: bytes, out: Drained) -> None:
        self.next_seq = seq + 1
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError:
            self.bad_batches += 1
            out.lost = True
            log.warning("undecodable vLLM KV event batch %d", seq)
            return
        if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
            self.bad_batches += 1
            out.lost = True
            log.warning("vLLM KV event batch %d is not [ts, [events], ...]", seq)
            return
        out.batches.append(batch)

    def _fill_gap(self, upto: int, out: Drained) -> None:
        """Replay batches [next_seq, upto); mark ``out.lost`` when the buffer no longer has them."""
        want = self.next_seq
        log.warning("vLLM KV events %d..%d missed; asking the replay endpoint", want, upto - 1)
        if self._replay_endpoint is None:
            self._lost(out, want, upto)
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self._replay_endpoint)
            dealer.send_multipart([b"", want.to_bytes(8, "big")])
            first = True
            while True:
                if not dealer.poll(self._replay_timeout_ms):
                    log.warning("replay endpoint did not answer within %d ms", self._replay_timeout_ms)
                    break
                frames = dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == _END_SEQ:
                    break
                if first and seq > want:
                    break  # the buffer starts after what we missed
                first = False
                if want <= seq < upto and seq == self.next_seq:
                    self._accept(seq, frames[3], out)
                    out.replayed += 1
        finally:
            dealer.close(linger=0)
        if self.next_seq < upto:
            self._lost(out, self.next_seq, upto)

    def _lost(self, out: Drained, start: int, upto: int) -> None:
        self.lost_gaps += 1
        out.lost = True
        log.warning("vLLM KV events %d..%d are lost for good (replay buffer passed them)", start, upto - 1)
        self.next_seq = upto
