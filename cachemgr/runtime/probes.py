"""Kubernetes probes over the pod-local state record: startup, live and ready.

Each probe returns a :class:`Verdict`: pass or fail, and one line saying why. The same
verdicts answer ``cachemgr probe startup|live|ready`` (exit 0 or 1, as exec probes expect)
and ``/startupz``, ``/livez``, ``/readyz`` of ``run --status-port``.

The rules, in the order they are checked:

* every probe fails when there is no state record (``run`` has not started, or another
  ``--state-dir``), and in the ``failed`` and ``stopped`` phases, saying why;
* **startup** and **live**: the ``run`` process must exist (a dead or zombie pid fails at
  once, without waiting for its heartbeat to age), its heartbeat must be fresh (younger than
  :func:`stale_after` of its interval: a frozen or starved process stops beating), and a
  compile must not be stalled (no CPU, writes or output for ``--stall-timeout``, as the
  runner reports it, or its progress reports themselves stopped for that long). Startup
  therefore passes as soon as ``run`` is alive and progressing, whether it is resolving,
  waiting on a peer's lease, compiling or loading; its budget no longer has to cover the
  compile, and a hung compile is still caught by liveness. The two differ only in name, so
  the chart can give each its own period and threshold;
* **ready**: the phase is ``serving``, the ``run`` process exists, and the server's health
  endpoint answers 200 now. The heartbeat is not consulted: a server that answers can take
  traffic even while ``run`` itself is frozen (liveness will restart the pod).

Standard library only, and nothing from cachemgr beyond :mod:`cachemgr.runtime.state`,
:mod:`cachemgr.core.procs` and :mod:`cachemgr.core.units`: a probe runs in every pod every few seconds, and must start fast.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal, NamedTuple

from cachemgr.core.printable import safe
from cachemgr.core.procs import same_process
from cachemgr.core.units import human_bytes, human_duration
from cachemgr.runtime.state import STATE_FILE, State, heartbeat_age, read_state

ProbeKind = Literal["startup", "live", "ready"]
KINDS: tuple[ProbeKind, ...] = ("startup", "live", "ready")
STALE_INTERVALS = 3  # beats a heartbeat may miss before it counts as stopped
MIN_STALE_SECONDS = 5.0  # ...but never less than this: a busy node delays a thread by a second or two


class Verdict(NamedTuple):
    """A probe's answer: pass or fail, and why, in one line (no dataclass: see State)."""

    kind: ProbeKind
    ok: bool
    reason: str

    def line(self) -> str:
        # The reason may quote the volume (a holder's pod name): printed for the kubelet, escaped.
        return f"{self.kind} {'ok' if self.ok else 'failed'}: {safe(self.reason)}"

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "reason": self.reason}


def stale_after(heartbeat_interval: float) -> float:
    """The heartbeat age past which ``run`` counts as frozen or starved."""
    return max(STALE_INTERVALS * heartbeat_interval, MIN_STALE_SECONDS)


def check(kind: ProbeKind, state_dir: Path, *, timeout: float = 1.0, now: float | None = None) -> Verdict:
    """Run probe ``kind`` against the state record in ``state_dir``."""
    if kind == "ready":
        return check_ready(state_dir, timeout=timeout, now=now)
    return check_alive(kind, state_dir, now=now)


def check_alive(kind: ProbeKind, state_dir: Path, *, now: float | None = None) -> Verdict:
    """startup / live: the process is there, beating, and not stuck in a compile."""
    now = time.time() if now is None else now
    state, unreadable = _load(state_dir)
    if state is None:
        return Verdict(kind, False, unreadable)
    problem = _ended(state) or _dead(state) or _frozen(state, state_dir, now) or _stalled(state, now)
    if problem is not None:
        return Verdict(kind, False, problem)
    return Verdict(kind, True, describe(state, now=now))


def check_ready(state_dir: Path, *, timeout: float = 1.0, now: float | None = None) -> Verdict:
    """ready: serving, and the server's health endpoint answers now."""
    now = time.time() if now is None else now
    state, unreadable = _load(state_dir)
    if state is None:
        return Verdict("ready", False, unreadable)
    problem = _ended(state) or _dead(state)
    if problem is not None:
        return Verdict("ready", False, problem)
    if state.phase != "serving":
        doing = _stalled(state, now) or describe(state, now=now)
        return Verdict("ready", False, f"not serving yet: {doing}")
    what = describe(state, now=now)
    if not state.health_url:
        return Verdict("ready", True, f"{what}; no health URL is known, so the phase decides")
    answered, how = _health(state.health_url, timeout=timeout)
    if not answered:
        return Verdict("ready", False, f"{what}, but {state.health_url} {how}")
    return Verdict("ready", True, f"{what}; {state.health_url} {how}")


def describe(state: State, *, now: float) -> str:
    """What ``run`` is doing, in a few words: the reason a passing probe prints."""
    took = human_duration(now - state.since)
    key = f"key {state.key[:12]}" if state.key else "its key"
    entry = state.detail.get("entry") or state.entry or key
    if state.phase == "waiting":
        return _describe_waiting(state.detail, key, took)
    if state.phase == "compiling":
        return _describe_compiling(state, key, took)
    plain = {
        "resolving": f"resolving the cache key ({took})",
        "publishing": f"publishing {key} ({took})",
        "launching": f"launching the server on {entry} ({took})",
        "serving": f"serving {entry} for {took}",
    }
    return plain.get(state.phase) or _ended(state) or state.phase


def _describe_waiting(detail: Any, key: str, took: str) -> str:
    holder = detail.get("holder")
    who = f"pod {holder}" if holder else "the pod holding the lease"
    if detail.get("holder_node"):
        who += f" on node {detail['holder_node']}"
    held = f"; lease held {human_duration(detail['held_for_s'])}" if "held_for_s" in detail else ""
    return f"waiting {took} for {who} to compile {key}{held}"


def _describe_compiling(state: State, key: str, took: str) -> str:
    detail = state.detail
    text = f"compiling {key} for {took}"
    if "no_progress_s" not in detail:
        return text
    limit = f" (--stall-timeout {human_duration(state.stall_timeout)})" if state.stall_timeout else ""
    return (
        f"{text}: CPU {float(detail.get('cpu_seconds', 0)):.0f}s, "
        f"{human_bytes(int(detail.get('staging_bytes', 0)))} staged, "
        f"{int(detail.get('output_lines', 0))} output lines, "
        f"last progress {human_duration(float(detail['no_progress_s']))} ago{limit}"
    )


# --- the rules ------------------------------------------------------------------------


def _load(state_dir: Path) -> tuple[State | None, str]:
    try:
        return read_state(state_dir), ""
    except FileNotFoundError:
        return None, (
            f"no state record at {state_dir / STATE_FILE}: cachemgr run has not started yet, "
            "or it uses another --state-dir (CACHEMGR_STATE_DIR)"
        )
    except NotADirectoryError:
        return None, (
            f"{state_dir} is not a directory: set CACHEMGR_STATE_DIR (or --state-dir) to the folder "
            "cachemgr run writes its state record in, as the pod's run does"
        )
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        return None, (
            f"cannot read {state_dir / STATE_FILE}: {reason}; it is cachemgr run's own record: "
            "check CACHEMGR_STATE_DIR (or --state-dir) names the pod's state folder"
        )


def _ended(state: State) -> str | None:
    """The failed and stopped phases fail every probe, with the reason ``run`` recorded."""
    detail = state.detail
    if state.phase == "failed":
        return f"failed: {detail.get('reason') or 'no reason recorded'}"
    if state.phase != "stopped":
        return None
    if detail.get("published"):
        return "stopped: the entry is published and this run serves nothing (warm)"
    return f"stopped: the server exited with code {detail.get('exit_code', '?')}; cachemgr run ends with it"


def _dead(state: State) -> str | None:
    if same_process(state.pid, state.pid_start_ticks):
        return None
    return f"cachemgr run (pid {state.pid}) is not running; its last phase was {state.phase}"


def _frozen(state: State, state_dir: Path, now: float) -> str | None:
    age = heartbeat_age(state_dir, now=now)
    limit = stale_after(state.heartbeat_interval)
    if age is None:
        return f"no heartbeat file in {state_dir}: cachemgr run is not beating"
    if age <= limit:
        return None
    return (
        f"heartbeat is {age:.0f}s old (limit {limit:.0f}s, {STALE_INTERVALS} beats of "
        f"{state.heartbeat_interval:g}s): cachemgr run (pid {state.pid}) is frozen or starved "
        f"in phase {state.phase}"
    )


def stalled(state: State, now: float) -> str | None:
    """No progress for --stall-timeout: as the runner says, or as its silence says. The one rule
    for the probes and the ``cachemgr_compile_stalled`` gauge (a gauge that disagreed with a
    failing liveness probe under load told the operator nothing was wrong)."""
    return _stalled(state, now)


def _stalled(state: State, now: float) -> str | None:
    detail = state.detail
    if "no_progress_s" not in detail:
        return None
    # The runner rewrites the record with its progress every tick (well under a heartbeat
    # interval); silence beyond that is time nobody has seen progress either (its progress
    # watch may be stuck on the volume), so it counts toward the stall.
    silent = max(0.0, now - state.updated_at - state.heartbeat_interval)
    quiet = float(detail["no_progress_s"]) + silent
    limit = state.stall_timeout
    if not detail.get("stalled") and (not limit or quiet < limit):
        return None
    if state.phase == "compiling":
        what = "compile"
        who = "the server (compiling)" if detail.get("strategy") == "vllm" else "the compiler"
    else:  # the same rule for any phase whose progress the runner watches (a model load)
        what, who = state.phase, "the server"
    allowed = f" (--stall-timeout {human_duration(limit)})" if limit else ""
    return (
        f"{what} stalled: {who} has shown no progress (CPU time, writes, output) for "
        f"{human_duration(quiet)}{allowed}; it looks hung, a restart retries from the shared cache"
    )


def _health(url: str, *, timeout: float) -> tuple[bool, str]:
    """GET the server's health URL; (answered 200, how it went)."""
    import urllib.parse  # lazy, like every import only the ready probe needs

    parsed = urllib.parse.urlsplit(url)
    started = time.monotonic()
    try:
        if parsed.scheme == "https":
            status = _https_status(parsed, timeout=timeout)
        else:
            status = _http_status(parsed, timeout=timeout)
    except TimeoutError:
        return False, f"did not answer within {timeout:g}s"
    except (OSError, ValueError) as error:
        return False, f"did not answer: {getattr(error, 'strerror', None) or error}"
    millis = (time.monotonic() - started) * 1000
    if status != 200:
        return False, f"answered {status} (not 200) in {millis:.0f} ms"
    return True, f"answered 200 in {millis:.0f} ms"


def _http_status(parsed: Any, *, timeout: float) -> int:
    """The status code of a plain HTTP GET, over a bare socket.

    Not http.client: it imports ssl and email, about 25 ms of a probe's 100 ms budget.
    """
    import socket  # lazy: startup and live need no network

    deadline = time.monotonic() + timeout
    request = (
        f"GET {parsed.path or '/'} HTTP/1.1\r\nHost: {parsed.netloc}\r\n"
        "User-Agent: cachemgr-probe\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection(
        (parsed.hostname or "127.0.0.1", parsed.port or 80), timeout=timeout
    ) as sock:
        sock.sendall(request.encode("ascii"))
        head = b""
        while b"\r\n" not in head and len(head) < 4096:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            chunk = sock.recv(4096)
            if not chunk:
                break
            head += chunk
    # "HTTP/1.1 200 OK": the code is the second word of the status line.
    words = head.split(b"\r\n", 1)[0].split()
    if len(words) < 2 or not words[0].startswith(b"HTTP/") or not words[1].isdigit():
        raise ValueError(f"not an HTTP answer: {head[:60]!r}")
    return int(words[1])


def _https_status(parsed: Any, *, timeout: float) -> int:
    import http.client  # TLS only: the server was started with --ssl-keyfile

    conn = http.client.HTTPSConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=timeout)
    try:
        conn.request("GET", parsed.path or "/")
        return conn.getresponse().status
    except http.client.HTTPException as error:
        raise ValueError(str(error)) from error
    finally:
        conn.close()
