"""A small S3-compatible object store on a local directory: the durable storage of the dev broker.

tansu's object-store engine keeps every produced batch as one object and, on each fetch, lists the
partition's ``records/`` prefix and reads its ``watermark.json`` with ``If-None-Match``. It appends
to a partition with conditional writes (``If-None-Match: *`` to create, ``If-Match: ETAG`` to
update), so a store that ignores them loses acknowledged records under concurrent producers (s3rver:
70 of 200 came back). moto honours them but lists by scanning the whole bucket in Python on every
call, so the dev stack slowed down and stalled within a minute of traffic. This server keeps:

- a sorted in-memory index (key → size, ETag, mtime) so a listing costs O(log n + page), with each
  entry's XML rendered once at write time;
- the bytes on disk, one file per object, written to a temporary file and renamed into place, so a
  SIGKILL of the store (or of the broker) never leaves a torn object and a restart finds everything;
- one asyncio thread: a conditional write checks and renames with no await between, so two racing
  writers cannot both win.

What it is not: authenticated (it ignores the request signature; it binds to loopback only),
multipart-capable, or versioned. Production points the broker at real S3 or runs Apache Kafka.

Run: ``python -m streams.local_s3 --root DIR --port PORT [--bucket NAME]``.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote
from xml.etree import ElementTree
from xml.sax.saxutils import escape

from sortedcontainers import SortedDict

log = logging.getLogger(__name__)

_LOOPBACK = "127.0.0.1"
_MAX_KEYS = 1000
_XML = b"application/xml"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Response = tuple[int, list[tuple[bytes, bytes]], bytes]
Listing = tuple[list[str], list[str], str | None]


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    size: int
    etag: str  # quoted, as S3 sends it
    mtime: float
    xml: str  # this object's <Contents> element of a listing, rendered once


def _meta(key: str, size: int, etag: str, mtime: float) -> ObjectMeta:
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(mtime)) + f".{int(mtime % 1 * 1000):03d}Z"
    xml = (
        f"<Contents><Key>{escape(key)}</Key><LastModified>{iso}</LastModified>"
        f"<ETag>{escape(etag)}</ETag><Size>{size}</Size><StorageClass>STANDARD</StorageClass></Contents>"
    )
    return ObjectMeta(size, etag, mtime, xml)


def _etag(data: bytes) -> str:
    return f'"{hashlib.md5(data, usedforsecurity=False).hexdigest()}"'


class Bucket:
    """One bucket: the files under ``root`` and their sorted index. Keys are percent-encoded into flat
    file names, so no key can name a path outside the bucket's directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.index: SortedDict = SortedDict()
        for path in root.iterdir():
            if path.name.startswith(".tmp-"):
                path.unlink(missing_ok=True)  # a write torn by a crash; its object was never visible
                continue
            data = path.read_bytes()
            key = unquote(path.name)
            self.index[key] = _meta(key, len(data), _etag(data), path.stat().st_mtime)

    def _path(self, key: str) -> Path:
        return self.root / quote(key, safe="")

    def get(self, key: str) -> ObjectMeta | None:
        meta: ObjectMeta | None = self.index.get(key)
        return meta

    def read(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def put(self, key: str, data: bytes) -> ObjectMeta:
        final = self._path(key)
        tmp = self.root / f".tmp-{os.getpid()}-{final.name}"
        tmp.write_bytes(data)
        os.replace(tmp, final)  # atomic: readers see the old object or the new one, never half
        meta = _meta(key, len(data), _etag(data), time.time())
        self.index[key] = meta
        return meta

    def delete(self, key: str) -> None:
        if self.index.pop(key, None) is not None:
            self._path(key).unlink(missing_ok=True)

    def list(self, prefix: str, start_after: str, delimiter: str, max_keys: int) -> Listing:
        """Up to ``max_keys`` entries after ``start_after``: (content XML, common prefixes, next key)."""
        contents: list[str] = []
        prefixes: list[str] = []
        start = max(prefix, start_after)
        it = self.index.irange(minimum=start, inclusive=(start != start_after, True))
        last: str | None = None
        for key in it:
            if not key.startswith(prefix):
                break
            common = ""
            if delimiter:
                cut = key.find(delimiter, len(prefix))
                if cut >= 0:
                    common = key[: cut + len(delimiter)]
                    if prefixes and prefixes[-1] == common:
                        last = key  # one entry per common prefix, however many keys it holds
                        continue
            # A page ends only between entries, so a common prefix never spans two pages.
            if len(contents) + len(prefixes) >= max_keys:
                return contents, prefixes, last
            if common:
                prefixes.append(common)
            else:
                contents.append(self.index[key].xml)
            last = key
        return contents, prefixes, None


class LocalS3:
    """The ASGI application: path-style S3 requests on the buckets under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.buckets: dict[str, Bucket] = {p.name: Bucket(p) for p in root.iterdir() if p.is_dir()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        # From here on nothing awaits until the response is built: check-then-write is atomic.
        status, headers, payload = self.handle(scope, body)
        # Always a Content-Length: without one the server answers chunked, and object_store refuses
        # a response that lacks the header.
        if not any(name == b"content-length" for name, _ in headers):
            headers.append((b"content-length", str(len(payload)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else payload})

    def handle(self, scope: Scope, body: bytes) -> Response:
        method: str = scope["method"]
        # raw_path: ASGI's ``path`` is already percent-decoded, and a key may itself contain "%".
        raw = scope.get("raw_path") or scope["path"].encode()
        path = unquote(raw.decode().partition("?")[0]).lstrip("/")
        name, _, key = path.partition("/")
        query = {k: v[0] for k, v in parse_qs(scope["query_string"].decode(), keep_blank_values=True).items()}
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        if not name:
            return _error(400, "InvalidRequest", "a bucket is required (path-style requests only)")
        if not key:
            if method == "POST" and "delete" in query:
                return self._delete_many(name, body)
            return self._bucket_op(method, name, query)
        bucket = self.buckets.get(name)
        if bucket is None:
            return _error(404, "NoSuchBucket", name)
        if method == "PUT":
            return self._put(bucket, key, body, headers)
        if method in ("GET", "HEAD"):
            return self._get(bucket, key, headers)
        if method == "DELETE":
            bucket.delete(key)
            return 204, [], b""
        return _error(405, "MethodNotAllowed", method)

    def _bucket_op(self, method: str, name: str, query: dict[str, str]) -> Response:
        if method == "PUT":
            if name not in self.buckets:
                self.buckets[name] = Bucket(self.root / name)
            return 200, [(b"location", f"/{name}".encode())], b""
        if method == "HEAD":
            return (200, [], b"") if name in self.buckets else _error(404, "NoSuchBucket", name)
        bucket = self.buckets.get(name)
        if bucket is None:
            return _error(404, "NoSuchBucket", name)
        if method != "GET":
            return _error(405, "MethodNotAllowed", method)
        prefix = query.get("prefix", "")
        delimiter = query.get("delimiter", "")
        token = query.get("continuation-token") or ""
        start_after = unquote(token) if token else query.get("start-after", "")
        try:
            max_keys = min(max(int(query.get("max-keys", _MAX_KEYS)), 0), _MAX_KEYS)
        except ValueError:
            return _error(400, "InvalidArgument", "max-keys")
        contents, prefixes, next_key = bucket.list(prefix, start_after, delimiter, max_keys)
        parts = [
            '<?xml version="1.0" encoding="UTF-8"?>',
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">',
            f"<Name>{escape(name)}</Name><Prefix>{escape(prefix)}</Prefix>",
            f"<KeyCount>{len(contents) + len(prefixes)}</KeyCount><MaxKeys>{max_keys}</MaxKeys>",
        ]
        if delimiter:
            parts.append(f"<Delimiter>{escape(delimiter)}</Delimiter>")
        if token:
            parts.append(f"<ContinuationToken>{escape(token)}</ContinuationToken>")
        parts.append(f"<IsTruncated>{'true' if next_key is not None else 'false'}</IsTruncated>")
        if next_key is not None:
            parts.append(f"<NextContinuationToken>{escape(quote(next_key, safe=''))}</NextContinuationToken>")
        parts.extend(contents)
        parts.extend(f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>" for p in prefixes)
        parts.append("</ListBucketResult>")
        return 200, [(b"content-type", _XML)], "".join(parts).encode()

    def _delete_many(self, name: str, body: bytes) -> Response:
        """``POST /bucket?delete``: object_store deletes through it, never by single-object DELETE."""
        bucket = self.buckets.get(name)
        if bucket is None:
            return _error(404, "NoSuchBucket", name)
        try:
            root = ElementTree.fromstring(body)
        except ElementTree.ParseError:
            return _error(400, "MalformedXML", "the Delete body is not XML")
        keys = [el.text or "" for el in root.iter() if el.tag.rpartition("}")[2] == "Key"]
        if len(keys) > _MAX_KEYS:
            return _error(400, "MalformedXML", f"more than {_MAX_KEYS} keys")
        for key in keys:
            bucket.delete(key)
        deleted = "".join(f"<Deleted><Key>{escape(k)}</Key></Deleted>" for k in keys)
        xml = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            f'<DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">{deleted}</DeleteResult>'
        )
        return 200, [(b"content-type", _XML)], xml.encode()

    def _put(self, bucket: Bucket, key: str, body: bytes, headers: dict[str, str]) -> Response:
        if "x-amz-copy-source" in headers:
            return _error(501, "NotImplemented", "copy")
        current = bucket.get(key)
        if headers.get("if-none-match") == "*" and current is not None:
            return _error(412, "PreconditionFailed", f"{key} exists")
        if_match = headers.get("if-match")
        if if_match is not None:
            if current is None:
                return _error(404, "NoSuchKey", key)
            if if_match not in ("*", current.etag):
                return _error(412, "PreconditionFailed", f"{key} changed")
        meta = bucket.put(key, body)
        return 200, [(b"etag", meta.etag.encode())], b""

    def _get(self, bucket: Bucket, key: str, headers: dict[str, str]) -> Response:
        meta = bucket.get(key)
        if meta is None:
            return _error(404, "NoSuchKey", key)
        common = [
            (b"etag", meta.etag.encode()),
            (b"last-modified", formatdate(meta.mtime, usegmt=True).encode()),
            (b"accept-ranges", b"bytes"),
        ]
        if_match = headers.get("if-match")
        if if_match is not None and if_match not in ("*", meta.etag):
            return _error(412, "PreconditionFailed", key)
        if_none_match = headers.get("if-none-match")
        if if_none_match is not None and if_none_match in ("*", meta.etag):
            return 304, common, b""
        data = bucket.read(key)
        rng = headers.get("range")
        if rng is not None:
            span = _range(rng, len(data))
            if span is None:
                return _error(416, "InvalidRange", rng)
            lo, hi = span
            common.append((b"content-range", f"bytes {lo}-{hi - 1}/{len(data)}".encode()))
            return 206, [*common, (b"content-type", b"application/octet-stream")], data[lo:hi]
        return 200, [*common, (b"content-type", b"application/octet-stream")], data


def _range(header: str, size: int) -> tuple[int, int] | None:
    """``bytes=a-b``, ``bytes=a-`` or ``bytes=-n`` as a half-open span, or None when unsatisfiable."""
    unit, _, spec = header.partition("=")
    first, _, last = spec.partition("-")
    if unit.strip() != "bytes" or "," in spec:
        return None
    try:
        if first == "":
            lo, hi = max(size - int(last), 0), size
        else:
            lo = int(first)
            hi = size if last == "" else min(int(last) + 1, size)
    except ValueError:
        return None
    return (lo, hi) if 0 <= lo < hi else None


def _error(status: int, code: str, message: str) -> Response:
    xml = (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>{escape(message)}</Message></Error>"
    )
    return status, [(b"content-type", _XML)], xml.encode()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m streams.local_s3", description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="directory that holds the buckets")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default=_LOOPBACK)
    p.add_argument("--bucket", action="append", default=[], help="create this bucket at start")
    p.add_argument("--access-log", action="store_true", help="log every request")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    import uvicorn

    app = LocalS3(Path(args.root))
    for name in args.bucket:
        app.buckets.setdefault(name, Bucket(app.root / name))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.info("local S3 on %s:%d, %d bucket(s) under %s", args.host, args.port, len(app.buckets), args.root)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="info" if args.access_log else "warning",
        access_log=args.access_log,
        lifespan="off",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
