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

prints ``listening on PORT`` once it serves (on 127.0.0.1, a free port).
"""

from __future__ import annotations

import argparse
import http.client
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

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

        def _forward(self) -> None:
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
    args = parser.parse_args()
    shape = Shape(
        refuse_writes=args.writes == "refuse",
        latency=args.latency_ms / 1000.0,
        bandwidth=args.bandwidth,
        total=Pacer(args.total_bandwidth) if args.total_bandwidth else None,
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(args.upstream, args.status, args.code, shape))
    server.daemon_threads = True
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
