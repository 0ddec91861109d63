"""The status port against clients that do not behave (issue 26 item 6).

It listens on every address (the kubelet's HTTP probes need it), so any pod in the cluster can
reach it: a real serving pod, and real sockets that connect and say nothing, trickle a byte a
second, or reset the connection. Threads are counted in /proc/PID/task of the pod's cachemgr.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cachemgr_testkit.podlib import Cluster, Pod, free_port, status_get, status_port, wait_for
from cachemgr_testkit.scenarios import vllm_argv

from cachemgr.runtime.status_server import MAX_CONNECTIONS, REQUEST_SECONDS

STATUS = ["--status-port", "0"]
IDLE_CLIENTS = 400


def _threads(pod: Pod) -> int:
    return len(list(Path(f"/proc/{pod.proc.pid}/task").iterdir()))


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    # Closed with a reset, not a FIN: what a client killed mid-request or a dropped NAT entry gives.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return sock


@contextlib.contextmanager
def _idle_clients(port: int, count: int) -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    try:
        for _ in range(count):
            opened.append(_connect(port))
        yield opened
    finally:
        for sock in opened:
            sock.close()


@pytest.fixture
def serving(pods: Cluster, root: Path) -> Pod:
    pod = pods.start("a", vllm_argv(free_port()), cache_root=root, options=STATUS)
    pod.wait_phase("serving")
    return pod


def test_400_idle_connections_hold_no_thread_each_and_the_probes_still_answer(serving: Pod) -> None:
    port = status_port(serving)
    assert status_get(port, "/livez")[0] == 200
    before = _threads(serving)
    bound = before + MAX_CONNECTIONS + 4
    with _idle_clients(port, IDLE_CLIENTS):
        # Evicted connections' threads end as soon as their read returns: wait for that.
        wait_for(
            lambda: _threads(serving) <= bound,
            timeout=10,
            what=f"cachemgr's threads to stay under {bound} with {IDLE_CLIENTS} idle clients (now {_threads(serving)})",
        )
        for path in ("/livez", "/readyz", "/startupz", "/metrics"):
            code, body = status_get(port, path, timeout=3)
            assert code == 200, (path, code, body)
        assert _threads(serving) <= bound
    # The clients reset their connections: no traceback reaches the JSON log, one event at most.
    assert status_get(port, "/livez")[0] == 200
    log = serving.log.read_text(errors="replace")
    assert "Traceback" not in log
    errors = [e for e in serving.log_events() if e["event"] == "status_port_errors"]
    assert len(errors) <= 1, errors


def test_a_client_trickling_a_byte_a_second_is_cut_off_at_the_request_deadline(serving: Pod) -> None:
    port = status_port(serving)
    sock = socket.create_connection(("127.0.0.1", port), timeout=1)
    request = b"GET /livez HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 60 + b"\r\n\r\n"
    started = time.monotonic()
    closed_at = None
    try:
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
                if sock.recv(1024) == b"":
                    closed_at = time.monotonic()
                    break
            except TimeoutError:
                continue  # nothing from the server within the second: send the next byte
            except OSError:  # reset by the server
                closed_at = time.monotonic()
                break
    finally:
        sock.close()
    assert closed_at is not None, "the server kept a trickling client for the whole request"
    assert closed_at - started < REQUEST_SECONDS + 3


def test_a_silent_client_is_closed_at_the_deadline(serving: Pod) -> None:
    port = status_port(serving)
    sock = socket.create_connection(("127.0.0.1", port), timeout=REQUEST_SECONDS + 5)
    try:
        started = time.monotonic()
        assert sock.recv(1024) == b""
        assert time.monotonic() - started < REQUEST_SECONDS + 3
    finally:
        sock.close()
    assert status_get(port, "/livez")[0] == 200
