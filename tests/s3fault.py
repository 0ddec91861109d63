"""A proxy in front of a real S3 server: a full bucket, or a store that is slow and far away.

``--writes refuse`` (the default) makes it a full bucket: it refuses every write and passes
every read through. ``--writes pass`` forwards writes too; with ``--latency-ms`` (before each
request is answered: a store's first-byte time) and ``--bandwidth`` / ``--total-bandwidth``
(bytes per second per connection and for all of them: one stream of a real store gets a
fraction of what many get) it is the distant store of bench/bench_prefetch.py, in front of
which JuiceFS runs with its default caches.

A full bucket:

SeaweedFS 4.48 can be made to refuse writes for real (``s3.bucket.quota -op=set`` then
``s3.bucket.quota.enforce -apply`` makes an over-quota bucket read-only), but it answers
``500 InternalError`` then, which no client can tell from a crash (seen with ``weed mini`` on
127.0.0.1). Stores that refuse for space say so: AWS and MinIO ``507 InsufficientStorage`` /
``XMinioStorageFull``, Ceph RGW ``403 QuotaExceeded``. This proxy answers such a refusal to every
PUT and POST (objects, multipart parts, multipart create and complete) and forwards everything
else (GET, HEAD, DELETE, listings) unchanged to the real server; the client's signature covers
the Host header, which is forwarded as sent, so the real server still checks it.

    python tests/s3fault.py --upstream http://127.0.0.1:PORT --status 507 --code InsufficientStorage
    python tests/s3fault.py --upstream http://127.0.0.1:PORT --writes pass --latency-ms 20 \
        --bandwidth 16M --total-bandwidth 96M

Two misbehaviours no real server here can be made to show (issue 40), each with ``--writes pass``:

``--loop-listings PART``
    every ListObjectsV2 answer for a prefix holding ``PART`` says it is truncated, and its
    continuation token leads back to the first page (A, B, A, B...): a store whose pagination
    never ends (``""``: every listing).
``--refuse-deletes``
    a DeleteObjects request is answered, not forwarded: every key it names refused with
    ``AccessDenied`` in the result's per-key errors (HTTP 200, as S3 answers a partial refusal).

prints ``listening on PORT`` once it serves (on 127.0.0.1, a free port).
"""

from __future__ import annotations

import argparse
import html
import http.client
import re
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "expect"}
_SLICE = 64 << 10  # a response body goes out in slices this large, each paced


class Pacer:
    """Bytes per second through one pipe: each send waits its turn (0: unlimited)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._next = 0.0
        self._lock = threading.Lock()

    def wait(self, nbytes: int) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + nbytes / self.rate
        if start > now:
            time.sleep(start - now)


@dataclass(frozen=True)
class Shape:
    """What the proxy does: refuse writes (a full bucket), or pass them; latency and bandwidth."""

    refuse_writes: bool = True
    latency: float = 0.0  # seconds before each answer
    bandwidth: float = 0.0  # bytes/s per connection
    total: Pacer | None = None  # bytes/s for all connections together
    loop_listings: str | None = None  # listings of prefixes holding this: truncated, leading back to page one
    refuse_deletes: bool = False  # DeleteObjects: every key refused in the per-key errors


def handler(
    upstream: str, status: int, code: str, shape: Shape | None = None
) -> type[BaseHTTPRequestHandler]:
    target = urlsplit(upstream)
    shape = shape or Shape()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, and "Expect: 100-continue" answered

        def log_message(self, format: str, *args: object) -> None:  # the base's signature
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                data = b""
                while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                    data += self.rfile.read(size)
                    self.rfile.readline()
                while self.rfile.readline() not in {b"\r\n", b"\n", b""}:  # trailers
                    pass
                return data
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _refuse(self) -> None:
            self._body()  # read it all: the connection stays usable
            xml = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f"<Message>the bucket is over its quota (s3fault)</Message></Error>"
            ).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(xml)))
            self.end_headers()
            self.wfile.write(xml)

        def _answer(self, status: int, xml: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(xml)))
            self.end_headers()
            self.wfile.write(xml)

        def _refuse_deletes(self) -> None:
            keys = re.findall(rb"<Key>(.*?)</Key>", self._body())
            errors = b"".join(
                b"<Error><Key>" + key + b"</Key><Code>AccessDenied</Code>"
                b"<Message>Access Denied (s3fault)</Message></Error>"
                for key in keys
            )
            self._answer(
                200, b'<?xml version="1.0" encoding="UTF-8"?><DeleteResult>' + errors + b"</DeleteResult>"
            )

        def _looping_listing(self) -> bool:
            """A listing's page: the first forwarded, every page after it that same page again."""
            query = parse_qs(urlsplit(self.path).query, keep_blank_values=True)
            if not _loops(query, shape.loop_listings):
                return False
            token = (query.get("continuation-token") or [""])[0]
            if not token:
                return False  # forwarded, then rewritten (_rewrite_listing)
            page = getattr(self.server, "first_page", b"")
            self._answer(200, _truncated(page, "B" if token == "A" else "A"))
            return True

        def _forward(self) -> None:
            query = parse_qs(urlsplit(self.path).query, keep_blank_values=True)
            if shape.refuse_deletes and self.command == "POST" and "delete" in query:
                self._refuse_deletes()
                return
            if self.command == "GET" and self._looping_listing():
                return
            body = self._body()
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            headers["Content-Length"] = str(len(body))
            conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=60)
            try:
                conn.request(self.command, self.path, body=body or None, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
            finally:
                conn.close()
            if answer.status == 200 and _loops(query, shape.loop_listings):
                self.server.first_page = data  # type: ignore[attr-defined]  # the pages to come
                data = _truncated(data, "A")
            if shape.latency > 0:
                time.sleep(shape.latency)  # the store's first-byte time: not a wait for a condition
            self.send_response(answer.status)
            for key, value in answer.getheaders():
                if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                    self.send_header(key, value)
            length = answer.getheader("Content-Length") if self.command == "HEAD" else None
            self.send_header("Content-Length", length or str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self._send_paced(data)

        def _send_paced(self, data: bytes) -> None:
            if not shape.bandwidth and shape.total is None:
                self.wfile.write(data)
                return
            mine = self.server_pacer()
            for start in range(0, len(data), _SLICE):
                piece = data[start : start + _SLICE]
                mine.wait(len(piece))
                if shape.total is not None:
                    shape.total.wait(len(piece))
                try:
                    self.wfile.write(piece)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client gave up on it (a cancelled read-ahead)
                    return

        def server_pacer(self) -> Pacer:
            """This connection's pacer (one handler instance serves one connection)."""
            pacer: Pacer | None = getattr(self, "_pacer", None)
            if pacer is None:
                pacer = Pacer(shape.bandwidth)
                self._pacer = pacer
            return pacer

        do_GET = do_HEAD = do_DELETE = _forward  # noqa: N815  # http.server's names
        do_PUT = do_POST = _refuse if shape.refuse_writes else _forward  # noqa: N815

    return Handler


def _loops(query: dict[str, list[str]], part: str | None) -> bool:
    """Whether this request is a listing the proxy makes loop."""
    prefix = (query.get("prefix") or [""])[0]
    return part is not None and query.get("list-type") == ["2"] and part in prefix


def _truncated(page: bytes, token: str) -> bytes:
    """A ListObjectsV2 page that says more follows, at ``token``."""
    page = re.sub(rb"<IsTruncated>\w+</IsTruncated>", b"<IsTruncated>true</IsTruncated>", page)
    page = re.sub(rb"<NextContinuationToken>.*?</NextContinuationToken>", b"", page)
    tail = f"<NextContinuationToken>{html.escape(token)}</NextContinuationToken>".encode()
    return page.replace(b"</ListBucketResult>", tail + b"</ListBucketResult>")


def _rate(text: str) -> float:
    """Bytes per second: 16M, 1.5G, 800k, or a plain number (0: unlimited)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower()
    if text and text[-1] in units:
        return float(text[:-1]) * units[text[-1]]
    return float(text)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--status", type=int, default=507)
    parser.add_argument("--code", default="InsufficientStorage")
    parser.add_argument("--writes", choices=("refuse", "pass"), default="refuse")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--bandwidth", type=_rate, default=0.0, help="bytes/s per connection (16M)")
    parser.add_argument("--total-bandwidth", type=_rate, default=0.0, help="bytes/s for all connections")
    parser.add_argument(
        "--loop-listings", metavar="PART", help="pagination that never ends, for prefixes holding PART"
    )
    parser.add_argument("--refuse-deletes", action="store_true", help="DeleteObjects refuses every key")
    args = parser.parse_args()
    shape = Shape(
        refuse_writes=args.writes == "refuse",
        latency=args.latency_ms / 1000.0,
        bandwidth=args.bandwidth,
        total=Pacer(args.total_bandwidth) if args.total_bandwidth else None,
        loop_listings=args.loop_listings,
        refuse_deletes=args.refuse_deletes,
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(args.upstream, args.status, args.code, shape))
    server.daemon_threads = True
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
