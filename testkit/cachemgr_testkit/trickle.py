"""A TCP proxy that passes, trickles or stalls what a store sends: a slow remote store, for real.

A real S3 server (``s3server``) behind a real proxy, so a pod's transfers meet what a degraded
gateway does: bytes that keep coming, one every half second, so no read timeout ever fires
(``Trickle``), or a connection that goes quiet after some bytes and never closes (``Stall``).
It works on TCP, below HTTP: the client's signatures and the server's answers pass unchanged.

::

    with trickle_proxy(s3.endpoint) as proxy:        # listens on 127.0.0.1, a free port
        env = {**s3.env(), "CACHEMGR_REMOTE_ENDPOINT": proxy.endpoint}
        proxy.set_mode(Trickle(nbytes=1, interval=0.5))  # every connection, from its next byte
        proxy.set_mode(Trickle(nbytes=1, interval=0.5, after=65536))  # 64 KiB each, then a trickle
        proxy.set_mode(Stall(after=65536))              # 64 KiB each, then nothing, never closed
        proxy.set_mode(PASS)                            # full speed again, live connections too
        proxy.stats()                                   # connections open and accepted, bytes moved

A mode shapes what the store sends (``direction="down"``, the default), what the client sends
(``"up"``: an upload), or both; ``after`` counts the bytes of each connection in that direction.
A mode change reaches live connections at once. ``stop()`` (or leaving the ``with``) closes every
connection. ``stats().open`` drops when a client closes its connections: how a test sees that a
transfer was abandoned rather than left hanging.

From a shell (the fault campaign), each line on stdin switches the mode::

    python -m cachemgr_testkit.trickle --upstream http://127.0.0.1:PORT [--mode trickle:1/0.5@65536]

prints ``listening on PORT``; modes as :func:`parse_mode` reads them: ``pass``,
``trickle:N/SECONDS[@AFTER][,up|,both]``, ``stall@AFTER[,up|,both]``.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

Direction = Literal["down", "up", "both"]
_RECV = 64 << 10


@dataclass(frozen=True)
class Pass:
    """Everything at full speed."""

    direction: Direction = "both"


@dataclass(frozen=True)
class Trickle:
    """``after`` bytes of each connection at full speed, then ``nbytes`` every ``interval`` seconds."""

    nbytes: int = 1
    interval: float = 0.5
    after: int = 0
    direction: Direction = "down"


@dataclass(frozen=True)
class Stall:
    """``after`` bytes of each connection, then nothing: the connection stays open, silent."""

    after: int = 0
    direction: Direction = "down"


Mode = Pass | Trickle | Stall
PASS = Pass()


def parse_mode(text: str) -> Mode:
    """``pass``, ``trickle:1/0.5``, ``trickle:1/0.5@65536,up``, ``stall@0,both``."""
    body, _, direction = text.strip().partition(",")
    where: Direction = "down"
    if direction:
        if direction not in {"down", "up", "both"}:
            raise ValueError(f"direction {direction!r} is not down, up or both")
        where = direction  # type: ignore[assignment]  # checked just above
    head, _, after_text = body.partition("@")
    after = int(after_text or 0)
    if head == "pass":
        return PASS
    if head == "stall":
        return Stall(after=after, direction=where)
    if head.startswith("trickle:"):
        nbytes, _, interval = head.removeprefix("trickle:").partition("/")
        return Trickle(nbytes=int(nbytes), interval=float(interval or 0.5), after=after, direction=where)
    raise ValueError(f"mode {text!r} is not pass, trickle:N/SECONDS[@AFTER] or stall@AFTER")


@dataclass(frozen=True)
class Stats:
    """What the proxy has seen: connections open now and ever accepted, bytes each way."""

    open: int
    accepted: int
    down_bytes: int  # store -> client
    up_bytes: int  # client -> store


class _Connection:
    """One client connection and its upstream one; closed as a pair, once."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.closed = threading.Event()

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class TrickleProxy:
    """A running proxy: ``endpoint`` to give a client, ``set_mode`` to shape, ``stop`` to end."""

    def __init__(self, upstream: str, *, mode: Mode = PASS, host: str = "127.0.0.1", port: int = 0) -> None:
        target = urlsplit(upstream if "://" in upstream else f"tcp://{upstream}")
        self.upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self._mode = mode
        self._lock = threading.Lock()
        self._connections: set[_Connection] = set()
        self._accepted = 0
        self._moved = {"down": 0, "up": 0}
        self._stopped = threading.Event()
        self._listener = socket.create_server((host, port))
        self.port: int = self._listener.getsockname()[1]
        self.endpoint = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._accept, name="trickle-accept", daemon=True)

    def start(self) -> TrickleProxy:
        self._thread.start()
        return self

    def set_mode(self, mode: Mode) -> None:
        """Shape every connection, live ones too, from its next byte on."""
        self._mode = mode  # one reference: each pump reads it before every step

    @property
    def mode(self) -> Mode:
        return self._mode

    def stats(self) -> Stats:
        with self._lock:
            return Stats(len(self._connections), self._accepted, self._moved["down"], self._moved["up"])

    def stop(self) -> None:
        """Stop accepting and close every connection (the store went away)."""
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            live = list(self._connections)
        for conn in live:
            conn.close()
        self._thread.join(timeout=5)

    # --- the pumps --------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed by stop()
            try:
                upstream = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()  # as a store that refuses: the client sees its connection drop
                continue
            upstream.settimeout(None)
            conn = _Connection(client, upstream)
            with self._lock:
                self._connections.add(conn)
                self._accepted += 1
            for src, dst, way in ((client, upstream, "up"), (upstream, client, "down")):
                threading.Thread(
                    target=self._pump, args=(conn, src, dst, way), name=f"trickle-{way}", daemon=True
                ).start()

    def _pump(self, conn: _Connection, src: socket.socket, dst: socket.socket, way: str) -> None:
        sent = 0
        try:
            while not conn.closed.is_set():
                data = src.recv(_RECV)
                if not data:
                    break  # either side closing ends the pair: HTTP clients never half-close
                while data:
                    step = self._allowed(conn, src, way, sent, len(data))
                    if step is None:
                        return
                    dst.sendall(data[:step])
                    data = data[step:]
                    sent += step
                    with self._lock:
                        self._moved[way] += step
        except OSError:
            pass  # a reset or our own close: the pair goes
        finally:
            conn.close()
            with self._lock:
                self._connections.discard(conn)

    def _allowed(self, conn: _Connection, src: socket.socket, way: str, sent: int, have: int) -> int | None:
        """How many of ``have`` bytes to send now, after waiting as the mode says; None: closed.
        While it holds bytes back it still notices ``src`` hanging up (a client killed mid-upload)."""
        while not conn.closed.is_set() and not _hung_up(src):
            mode = self._mode
            if isinstance(mode, Pass) or mode.direction not in {way, "both"}:
                return have
            if sent < mode.after:
                return min(have, mode.after - sent)
            if isinstance(mode, Trickle):
                if conn.closed.wait(mode.interval):
                    return None
                if self._mode is mode:
                    return min(have, max(1, mode.nbytes))
                continue  # the mode changed meanwhile: decide again
            conn.closed.wait(0.1)  # Stall: silent until the mode changes or the connection goes
        return None


_TCP_CLOSE_WAIT, _TCP_CLOSE = 8, 7  # linux/tcp_states.h


def _hung_up(sock: socket.socket) -> bool:
    """The peer closed or reset ``sock``, even with bytes of it still unread here (TCP_INFO's
    state: CLOSE_WAIT once its FIN arrived, queued behind what it sent)."""
    try:
        state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    except OSError:
        return True
    return state in {_TCP_CLOSE_WAIT, _TCP_CLOSE}


@contextlib.contextmanager
def trickle_proxy(upstream: str, *, mode: Mode = PASS) -> Iterator[TrickleProxy]:
    """A proxy to ``upstream`` (``http://host:port``) for the ``with`` block; closed after."""
    proxy = TrickleProxy(upstream, mode=mode).start()
    try:
        yield proxy
    finally:
        proxy.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="http://HOST:PORT of the store")
    parser.add_argument("--mode", default="pass", help="pass, trickle:N/SECONDS[@AFTER], stall@AFTER")
    args = parser.parse_args(argv)
    proxy = TrickleProxy(args.upstream, mode=parse_mode(args.mode)).start()
    print(f"listening on {proxy.port}", flush=True)
    try:
        for line in sys.stdin:  # one mode per line; EOF (or SIGTERM) ends the proxy
            if line.strip():
                proxy.set_mode(parse_mode(line))
    finally:
        proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
