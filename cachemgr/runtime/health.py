"""Health checks and readiness: when a server counts as up, and when a compile or load is stalled.

A server that answers its health endpoint moves the pod from ``launching`` (or ``compiling``,
for a ``vllm`` compile) to ``serving``. Until then the process is sampled (CPU, I/O, output,
staged bytes) into the state record; one that makes no progress for ``--stall-timeout`` is a
stall, which fails the liveness probe (cachemgr.runtime.probes) so the kubelet restarts the pod.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from typing import TYPE_CHECKING, Any

from cachemgr.core.log import get_logger

if TYPE_CHECKING:
    import subprocess

    from cachemgr.runtime import launcher
    from cachemgr.runtime.state import StateWriter

log = get_logger("cachemgr.run")


def default_health_url(host: str | None, port: int | None) -> str | None:
    if port is None:
        return None
    if not host or host in {"0.0.0.0", "::", ""}:  # noqa: S104  # a wildcard bind is reached on loopback
        host = "127.0.0.1"
    return f"http://{host}:{port}/health"


def health_ok(url: str, *, timeout: float = 1.0) -> bool:
    """True when the server's health endpoint answers 200 now."""
    import http.client  # with ssl behind it: not needed before the server starts

    parsed = urllib.parse.urlsplit(url)
    conn_cls = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parsed.hostname or "127.0.0.1", parsed.port, timeout=timeout)
    try:
        conn.request("GET", parsed.path or "/")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


class StallWatch:
    """Samples a compiling or loading process into the state record; logs a stall once."""

    def __init__(self, state: StateWriter, *, stall_timeout: float) -> None:
        self.state = state
        self.stall_timeout = stall_timeout
        self.no_progress_s = 0.0  # at the last sample: what the progress record tells peers

    def sample(self, monitor: launcher.ProgressMonitor) -> launcher.Progress:
        progress = monitor.sample()
        stalled = monitor.stalled_for()
        self.no_progress_s = stalled
        detail: dict[str, Any] = {
            "cpu_seconds": round(progress.cpu_seconds, 1),
            "written_bytes": progress.written_bytes,
            "staging_bytes": progress.staging_bytes,
            "output_lines": progress.output_lines,
            "no_progress_s": round(stalled, 1),
            "stalled": stalled >= self.stall_timeout,
        }
        if detail["stalled"] and not self.state.current.detail.get("stalled"):
            log.error("compile_stalled", no_progress_s=round(stalled), stall_timeout=self.stall_timeout)
        self.state.update(detail=detail)
        return progress


def watch_readiness(
    url: str | None,
    child: subprocess.Popen[bytes],
    *,
    state: StateWriter,
    stall: StallWatch,
    exited: threading.Event,
) -> None:
    """Launching -> serving when the server first answers; meanwhile watch the model load.

    A load that stops making progress (no CPU, no I/O, no output) for --stall-timeout is a
    stall, like a compile's: liveness fails and the kubelet restarts the pod.
    """
    if url is None:
        state.phase("serving")
        return
    from cachemgr.runtime.launcher import ProgressMonitor

    monitor = ProgressMonitor(child, staging=None, output=None)

    def watch() -> None:
        next_sample = 0.0
        while not exited.is_set():
            if health_ok(url):
                state.phase("serving")
                return
            if time.monotonic() >= next_sample:
                stall.sample(monitor)
                next_sample = time.monotonic() + 1.0
            exited.wait(0.25)

    threading.Thread(target=watch, name="cachemgr-health", daemon=True).start()
