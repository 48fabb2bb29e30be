"""The wire format of the data plane: one request frame in, a stream of block frames out.

Request (client -> server), once per connection::

    +----------------+--------------------------------------------------------------+
    | u32 length, BE | msgpack map of ``length`` bytes                              |
    +----------------+--------------------------------------------------------------+
    map: {"v": 1, "block_hashes": [u64, ...], "namespace": bytes, "layout": str,
          "peer_id": str, "nonce": bytes, "ts_ms": int, "probe_bytes": int, "hmac": bytes}

``hmac`` covers every other field (see ``auth.canonical_request``); ``layout`` is
``BlockLayout.describe()`` of the fetching worker; ``probe_bytes`` > 0 asks for filler bytes instead of
blocks (link measurement).

Response (server -> client): one frame per requested block, in request order, then an END frame. Each
frame is a fixed 32-byte little-endian header, followed by ``nbytes`` raw tensor bytes when the status is
OK (or PROBE) and by nothing otherwise::

     0      4      5      6      8             16            24            32
     +------+------+------+------+-------------+-------------+-------------+
     | KVB1 |status| tier | rsvd | block hash  |   nbytes    |  xxh3_64    |  + nbytes of block bytes
     |  4s  |  u8  |  u8  | u16  |    u64      |    u64      |    u64      |
     +------+------+------+------+-------------+-------------+-------------+

The server stops at the first block it cannot send (NOT_FOUND): blocks after a gap in a chained prefix
are useless to the fetcher. Whole-request answers (REFUSED, LAYOUT_MISMATCH, TOO_MANY_BLOCKS,
BAD_REQUEST) are a single header with no payload, after which the server closes. In the END frame
``block_hash`` holds the number of OK frames sent; in TOO_MANY_BLOCKS it holds the server's limit.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgpack
import xxhash

from services.worker.transfer.errors import FrameError

PROTOCOL_VERSION = 1
MAGIC = b"KVB1"

#: u32 big-endian length of the request map.
REQUEST_PREFIX = struct.Struct(">I")
#: The fixed response header (see the module sketch).
HEADER = struct.Struct("<4sBBHQQQ")
HEADER_SIZE = HEADER.size  # 32

#: Hard cap on a request's encoded size, whatever the block limit (an unauthenticated peer sends it).
MAX_REQUEST_BYTES = 1 << 20

_MASK64 = (1 << 64) - 1


class Status(IntEnum):
    OK = 0
    NOT_FOUND = 1
    REFUSED = 2
    LAYOUT_MISMATCH = 3
    TOO_MANY_BLOCKS = 4
    BAD_REQUEST = 5
    PROBE = 6
    END = 7


TIER_CODES: dict[str, int] = {"gpu": 0, "dram": 1, "disk": 2}
TIER_NAMES: dict[int, str] = {v: k for k, v in TIER_CODES.items()}
UNKNOWN_TIER = 255


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The per-block checksum carried in the header (xxh3_64: several GB/s per core)."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True, slots=True)
class FrameHeader:
    status: Status
    tier: int
    block_hash: int
    nbytes: int
    checksum: int

    @property
    def tier_name(self) -> str:
        return TIER_NAMES.get(self.tier, "unknown")


def pack_header(
    status: Status, block_hash: int = 0, nbytes: int = 0, digest: int = 0, tier: int = UNKNOWN_TIER
) -> bytes:
    return HEADER.pack(MAGIC, int(status), tier, 0, block_hash & _MASK64, nbytes, digest)


def unpack_header(buf: bytes | bytearray | memoryview) -> FrameHeader:
    """Parse a 32-byte header; a bad magic or unknown status is a FrameError (the stream is garbage)."""
    magic, status, tier, _rsvd, block_hash, nbytes, digest = HEADER.unpack(buf)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r}")
    try:
        st = Status(status)
    except ValueError as exc:
        raise FrameError(f"unknown frame status {status}") from exc
    return FrameHeader(st, tier, block_hash, nbytes, digest)


@dataclass(frozen=True, slots=True)
class BlockRequest:
    """One fetch: which blocks, for which tenant namespace, by whom, signed."""

    block_hashes: list[int]
    namespace: bytes
    layout: str
    peer_id: str
    nonce: bytes
    ts_ms: int
    hmac: bytes = b""
    probe_bytes: int = 0

    def encode(self) -> bytes:
        """Length prefix + msgpack map, ready to send."""
        body: bytes = msgpack.packb(
            {
                "v": PROTOCOL_VERSION,
                "block_hashes": self.block_hashes,
                "namespace": self.namespace,
                "layout": self.layout,
                "peer_id": self.peer_id,
                "nonce": self.nonce,
                "ts_ms": self.ts_ms,
                "probe_bytes": self.probe_bytes,
                "hmac": self.hmac,
            },
            use_bin_type=True,
        )
        return REQUEST_PREFIX.pack(len(body)) + body

    @classmethod
    def decode(cls, body: bytes) -> BlockRequest:
        """Parse the msgpack map (without its length prefix), checking every field's type."""
        try:
            m: Any = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types on garbage
            raise FrameError(f"request is not msgpack: {exc}") from exc
        if not isinstance(m, dict) or m.get("v") != PROTOCOL_VERSION:
            raise FrameError("request is not a version-1 map")
        hashes = m.get("block_hashes")
        if not isinstance(hashes, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= _MASK64 for h in hashes
        ):
            raise FrameError("block_hashes must be a list of u64")
        fields = {
            "namespace": bytes,
            "layout": str,
            "peer_id": str,
            "nonce": bytes,
            "ts_ms": int,
            "probe_bytes": int,
            "hmac": bytes,
        }
        for name, typ in fields.items():
            if not isinstance(m.get(name), typ) or isinstance(m.get(name), bool):
                raise FrameError(f"request field {name!r} must be {typ.__name__}")
        if m["probe_bytes"] < 0:
            raise FrameError("probe_bytes must be >= 0")
        return cls(
            block_hashes=hashes,
            namespace=m["namespace"],
            layout=m["layout"],
            peer_id=m["peer_id"],
            nonce=m["nonce"],
            ts_ms=m["ts_ms"],
            hmac=m["hmac"],
            probe_bytes=m["probe_bytes"],
        )
