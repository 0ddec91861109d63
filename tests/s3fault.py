"""A full bucket in front of a real S3 server: refuses every write, passes every read through.

SeaweedFS 4.48 can be made to refuse writes for real (``s3.bucket.quota -op=set`` then
``s3.bucket.quota.enforce -apply`` makes an over-quota bucket read-only), but it answers
``500 InternalError`` then, which no client can tell from a crash (seen with ``weed mini`` on
127.0.0.1). Stores that refuse for space say so: AWS and MinIO ``507 InsufficientStorage`` /
``XMinioStorageFull``, Ceph RGW ``403 QuotaExceeded``. This proxy answers such a refusal to every
PUT and POST (objects, multipart parts, multipart create and complete) and forwards everything
else (GET, HEAD, DELETE, listings) unchanged to the real server; the client's signature covers
the Host header, which is forwarded as sent, so the real server still checks it.

    python tests/s3fault.py --upstream http://127.0.0.1:PORT --status 507 --code InsufficientStorage

prints ``listening on PORT`` once it serves (on 127.0.0.1, a free port).
"""

from __future__ import annotations

import argparse
import http.client
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "expect"}


def handler(upstream: str, status: int, code: str) -> type[BaseHTTPRequestHandler]:
    target = urlsplit(upstream)

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
            self.send_response(answer.status)
            for key, value in answer.getheaders():
                if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                    self.send_header(key, value)
            length = answer.getheader("Content-Length") if self.command == "HEAD" else None
            self.send_header("Content-Length", length or str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_HEAD = do_DELETE = _forward  # noqa: N815  # http.server's names
        do_PUT = do_POST = _refuse  # noqa: N815

    return Handler


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--status", type=int, default=507)
    parser.add_argument("--code", default="InsufficientStorage")
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(args.upstream, args.status, args.code))
    server.daemon_threads = True
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
