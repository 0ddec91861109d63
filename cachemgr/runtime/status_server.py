"""``run --status-port``: the probes, the state and Prometheus metrics over HTTP.

* ``/startupz``, ``/livez``, ``/readyz``: 200 or 503, with the probe's one-line reason
  (the same verdicts as ``cachemgr probe``, from :mod:`cachemgr.runtime.probes`);
* ``/status``: the state record as JSON, with the heartbeat age, the three verdicts, the
  run's counters and the volume's figures (cachemgr.runtime.status_metrics measures them);
* ``/metrics``: the Prometheus text format (OpenMetrics when the scraper asks for it).

The server is a daemon thread in the ``run`` process, so a frozen ``run`` stops answering,
as a frozen process should. It listens on every address (the kubelet's HTTP probes come from
the node), so any pod in the cluster can reach it, and it holds up against clients that do
not behave:

* each request has :data:`REQUEST_SECONDS` from its first read to its last write, idle wait on
  a kept-alive connection included: a client that sends a byte a second, or sends nothing, or
  never reads the answer, has its connection closed at that deadline (every read and write is
  given only the time left, so trickling bytes do not extend it);
* at most :data:`MAX_CONNECTIONS` connections have a thread; a new one beyond that takes the
  place of the oldest that has not sent its request yet (closed at once), so idle connections
  cannot lock out the kubelet's probes; when every place is answering a request, the new one is
  closed at once;
* a failure while serving one connection is one JSON event at most, and at most one a minute
  (``status_port_errors``, with how many there were since), never a traceback in the log.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import socket
import socketserver
import sys
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

from prometheus_client.exposition import choose_encoder

from cachemgr import __version__
from cachemgr.core.errors import ConfigError
from cachemgr.core.log import get_logger
from cachemgr.runtime.metrics import Metrics
from cachemgr.runtime.probes import KINDS, ProbeKind, Verdict, check
from cachemgr.runtime.state import STATUS_PORT_FILE, heartbeat_age, read_state, write_status_port
from cachemgr.runtime.status_metrics import VolumeWatch, build_registry

log = get_logger("cachemgr.runtime.status_server")

READY_TIMEOUT = 0.8  # under the kubelet's default 1s timeoutSeconds, so /readyz says why itself
# A probe or a scrape is answered in well under a second; a request still unfinished after this
# (or a kept-alive connection idle that long) is a client holding a thread.
REQUEST_SECONDS = 5.0
# Connections with a thread at once: the kubelet's three probes, a scraper or two, someone's curl.
MAX_CONNECTIONS = 32
ERROR_EVENT_EVERY = 60.0  # seconds between two status_port_errors events
_PROBE_PATHS: dict[str, ProbeKind] = {"/startupz": "startup", "/livez": "live", "/readyz": "ready"}
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


# --- HTTP -----------------------------------------------------------------------------------


class _Connection:
    """One accepted connection: its socket, its request's deadline, and whether it is answering one."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.deadline = time.monotonic() + REQUEST_SECONDS
        self.answering = False

    def left(self) -> float:
        """Seconds left to the deadline; TimeoutError once it has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's deadline passed")
        return left


class _DeadlineReader(io.RawIOBase):
    """Reads the socket with only the time left to the request's deadline: a client trickling
    one byte a second does not get a fresh timeout with each byte."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._conn.sock.settimeout(self._conn.left())
        return self._conn.sock.recv_into(buffer)


class _ErrorLog:
    """Failures while serving: counted, and one JSON event a minute at most."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._unsaid = 0
        self._said_at: float | None = None

    def note(self, error: BaseException | None) -> None:
        with self._lock:
            self._count += 1
            self._unsaid += 1
            now = time.monotonic()
            if self._said_at is not None and now - self._said_at < ERROR_EVENT_EVERY:
                return
            self._said_at, unsaid, self._unsaid = now, self._unsaid, 0
        log.warning(
            "status_port_errors",
            error=f"{type(error).__name__}: {error}"[:200] if error is not None else "unknown",
            errors=unsaid,
            total=self._count,
            note="a client of --status-port failed or misbehaved; the port serves on (one event a minute at most)",
        )


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client must not hold up run's exit
    # The listen backlog (socketserver's default is 5): during a burst of connections the kernel
    # queues them while this thread accepts, rather than dropping SYNs (a probe then waits 1 s+).
    request_queue_size = 128

    def __init__(
        self,
        port: int,
        *,
        family: socket.AddressFamily,
        state_dir: Path,
        metrics: Metrics,
        volume: VolumeWatch,
    ) -> None:
        self.address_family = family
        self.state_dir = state_dir
        self.metrics = metrics
        self.volume = volume
        self.registry = build_registry(metrics, state_dir, volume)
        self.errors = _ErrorLog()
        self._lock = threading.Lock()
        self._open: OrderedDict[int, _Connection] = OrderedDict()  # by id(socket), oldest first
        host = "::" if family == socket.AF_INET6 else "0.0.0.0"  # noqa: S104  # kubelet and Prometheus come from outside
        super().__init__((host, port), _Handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            # Dual stack: IPv4 clients (the kubelet on an IPv4 cluster) reach the same socket.
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        # HTTPServer.server_bind resolves our own name (getfqdn), which can hang on a pod's DNS.
        socketserver.TCPServer.server_bind(self)
        self.server_name = "cachemgr"
        self.server_port = int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread for the connection if it gets a place (MAX_CONNECTIONS), else closed at once."""
        sock = cast(socket.socket, request)
        if not self._admit(sock):
            with contextlib.suppress(OSError):
                sock.setblocking(False)
                sock.send(_BUSY)
            self.shutdown_request(sock)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)  # closes the socket at the end
        finally:
            with self._lock:
                self._open.pop(id(request), None)

    def _admit(self, sock: socket.socket) -> bool:
        with self._lock:
            if len(self._open) >= MAX_CONNECTIONS:
                waiting = next((c for c in self._open.values() if not c.answering), None)
                if waiting is None:
                    return False  # every place is answering a request: each ends by its deadline
                # The oldest connection that has not sent its request gives its place: idle
                # clients cannot keep the kubelet's probes out.
                del self._open[id(waiting.sock)]
                with contextlib.suppress(OSError):
                    waiting.sock.shutdown(socket.SHUT_RDWR)  # its thread's read returns at once
            self._open[id(sock)] = _Connection(sock)
            return True

    def connection(self, sock: socket.socket) -> _Connection:
        with self._lock:
            found = self._open.get(id(sock))
        return found if found is not None else _Connection(sock)

    def answering(self, conn: _Connection, *, now: bool) -> None:
        """``now``: its request has arrived (it keeps its place); else it waits for the next one."""
        with self._lock:
            conn.answering = now
            if not now:
                conn.deadline = time.monotonic() + REQUEST_SECONDS

    def handle_error(self, request: Any, client_address: Any) -> None:
        """socketserver prints a traceback to stderr here: one counted event instead."""
        self.errors.note(sys.exc_info()[1])


class _Handler(BaseHTTPRequestHandler):
    server_version = f"cachemgr/{__version__}"
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self._conn = cast(_Server, self.server).connection(self.connection)
        self.rfile.close()  # makefile's reader holds the socket open until closed
        self.rfile = io.BufferedReader(_DeadlineReader(self._conn))

    def handle_one_request(self) -> None:
        server = cast(_Server, self.server)
        server.answering(self._conn, now=False)  # a fresh deadline for the next request
        try:
            super().handle_one_request()
        except OSError as error:
            # The client went away mid-request, or its place went to a newer connection, or the
            # deadline passed while writing: counted, never a traceback.
            server.errors.note(error)
            self.close_connection = True

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        if parsed:
            cast(_Server, self.server).answering(self._conn, now=True)
        return parsed

    def do_GET(self) -> None:
        server = cast(_Server, self.server)
        route = self.path.split("?", 1)[0]
        if route in _PROBE_PATHS:
            verdict = check(_PROBE_PATHS[route], server.state_dir, timeout=READY_TIMEOUT)
            self._send(200 if verdict.ok else 503, (verdict.line() + "\n").encode())
        elif route == "/status":
            code, body = _status(server)
            self._send(code, json.dumps(body, indent=2, sort_keys=True).encode() + b"\n", "application/json")
        elif route == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            self._send(200, encoder(server.registry), content_type)
        else:
            self._send(404, b"not found: try /startupz /livez /readyz /status /metrics\n")

    def do_HEAD(self) -> None:
        """As GET, without the body (HTTP probes and load balancers may ask so)."""
        self._head_only = True
        try:
            self.do_GET()
        finally:
            self._head_only = False  # one handler serves every request of a kept-alive connection

    def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if not getattr(self, "_head_only", False):
            # sendall's timeout bounds the whole write (Python 3.5+): a client that never reads
            # the answer is given only the time left.
            self.connection.settimeout(self._conn.left())
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a probe every few seconds would drown the compile log."""


def _status(server: _Server) -> tuple[int, dict[str, Any]]:
    """The state record, plus what the probes say, the counters and the volume."""
    verdicts: dict[str, Verdict] = {
        kind: check(kind, server.state_dir, timeout=READY_TIMEOUT) for kind in KINDS
    }
    extra = {
        "heartbeat_age_s": heartbeat_age(server.state_dir),
        "probes": {kind: verdict.to_json() for kind, verdict in verdicts.items()},
        "metrics": server.metrics.snapshot().to_json(),
        "volume": server.volume.figures.to_json(),
    }
    try:
        state = read_state(server.state_dir).to_json()
    except (OSError, ValueError, KeyError, TypeError) as error:
        return 503, {"error": f"no readable state record: {error}", **extra}
    return 200, {**state, **extra}


class StatusServer:
    """The running status server: ``port`` is the one bound; ``close()`` stops it."""

    def __init__(self, httpd: _Server, volume: VolumeWatch, state_dir: Path) -> None:
        self._httpd = httpd
        self._volume = volume
        self._state_dir = state_dir
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.5}, name="cachemgr-status", daemon=True
        )

    @property
    def port(self) -> int:
        return self._httpd.server_port

    def start(self) -> StatusServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._volume.stop()
        self._httpd.shutdown()
        self._httpd.server_close()
        with contextlib.suppress(OSError):
            (self._state_dir / STATUS_PORT_FILE).unlink(missing_ok=True)


def start_status_server(*, port: int, state_dir: Path, metrics: Metrics, cache_root: Path) -> StatusServer:
    """Serve the probes, /status and /metrics on ``port`` (0: any free one) from a daemon thread.

    The bound port is written to ``state_dir/status-port``.
    """
    metrics.keep_failures_in(state_dir)
    volume = VolumeWatch(cache_root, metrics)
    httpd = _bind(port, state_dir=state_dir, metrics=metrics, volume=volume)
    server = StatusServer(httpd, volume, state_dir)
    write_status_port(state_dir, server.port)
    volume.start()
    return server.start()


def _bind(port: int, *, state_dir: Path, metrics: Metrics, volume: VolumeWatch) -> _Server:
    families = [socket.AF_INET6, socket.AF_INET] if socket.has_dualstack_ipv6() else [socket.AF_INET]
    for family in families:
        try:
            return _Server(port, family=family, state_dir=state_dir, metrics=metrics, volume=volume)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"--status-port {port} is already in use in this pod",
                    remedy="give --status-port a free port (not the server's own)",
                ) from None
            if family == families[-1]:
                raise ConfigError(
                    f"cannot serve --status-port {port}: {error.strerror or error}",
                    remedy="give --status-port a free port above 1024, or drop it and use the exec probes",
                ) from None
    raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover
