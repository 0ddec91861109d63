"""The pod-local state record that probes read: phase, key, since, heartbeat, detail.

``run`` rewrites ``state.json`` atomically on every phase change and detail update, and
touches ``heartbeat`` every few seconds from a thread; a probe reads both without importing
anything heavy (this module uses the standard library only, so ``cachemgr probe`` stays fast).
The rules the probes apply to them are in :mod:`cachemgr.runtime.probes`.

The directory is pod-local (an emptyDir), so it may outlive a container restart: a new
``StateWriter`` replaces the record at once and drops what only the old process could vouch
for (its status port).

One ``run`` owns the directory (:func:`claim_state_dir`): ``kubectl exec ... cachemgr run``
inherits ``CACHEMGR_STATE_DIR`` from the pod, and a second writer would replace the live
server's record (its probes would then fail and the kubelet restart a healthy server). ``warm``
writes no state at all (``StateWriter(None)`` keeps the record in memory).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

from cachemgr.core.procs import same_process, start_ticks  # stdlib only, like this module

Phase = Literal[
    "resolving", "waiting", "compiling", "publishing", "launching", "serving", "failed", "stopped"
]
PHASES: tuple[Phase, ...] = (
    "resolving",
    "waiting",
    "compiling",
    "publishing",
    "launching",
    "serving",
    "failed",
    "stopped",
)
STATE_FILE = "state.json"
HEARTBEAT_FILE = "heartbeat"
OWNER_FILE = "owner"  # flock-ed by the run that owns the directory; holds its pid and start time
STATUS_PORT_FILE = "status-port"  # the port --status-port actually bound (0 picks a free one)
# An emptyDir in the pod; each pod has its own. Not "/tmp/cachemgr": run from /tmp, that directory
# would shadow the cachemgr package as a namespace package.
DEFAULT_STATE_DIR = "/tmp/cachemgr-state"  # noqa: S108


class State(NamedTuple):
    """One snapshot of the pod's state, as written to ``state.json``.

    A NamedTuple rather than a frozen dataclass: importing ``dataclasses`` (and ``inspect``
    behind it) costs a probe about 10 ms, a tenth of its budget, in every pod every few seconds.
    """

    phase: Phase
    since: float
    started_at: float
    pid: int
    key: str | None = None
    entry: str | None = None
    health_url: str | None = None
    stall_timeout: float | None = None
    heartbeat_interval: float = 2.0
    detail: Mapping[str, Any] = MappingProxyType({})  # read-only: one default shared by all
    # When the record was last written: during a compile the runner reports progress every
    # tick, so a record that stops changing means its progress watch itself is stuck.
    updated_at: float = 0.0
    # When ``pid`` started (procs.start_ticks): the next container's run is pid 1 again, and a
    # record it has not replaced yet must not pass for its own.
    pid_start_ticks: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "since": self.since,
            "started_at": self.started_at,
            "pid": self.pid,
            "key": self.key,
            "entry": self.entry,
            "health_url": self.health_url,
            "stall_timeout": self.stall_timeout,
            "heartbeat_interval": self.heartbeat_interval,
            "detail": dict(self.detail),
            "updated_at": self.updated_at,
            "pid_start_ticks": self.pid_start_ticks,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> State:
        phase = data["phase"]
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        return cls(
            phase=phase,
            since=float(data["since"]),
            started_at=float(data["started_at"]),
            pid=int(data["pid"]),
            key=data.get("key"),
            entry=data.get("entry"),
            health_url=data.get("health_url"),
            stall_timeout=data.get("stall_timeout"),
            heartbeat_interval=float(data.get("heartbeat_interval", 2.0)),
            detail=dict(data.get("detail") or {}),
            updated_at=float(data.get("updated_at") or data["since"]),
            pid_start_ticks=_int_or_none(data.get("pid_start_ticks")),
        )


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_state(state_dir: Path) -> State:
    """The last state written; ``FileNotFoundError`` before ``run`` wrote one."""
    return State.from_json(json.loads((state_dir / STATE_FILE).read_bytes()))


def heartbeat_age(state_dir: Path, *, now: float | None = None) -> float | None:
    """Seconds since the last beat; None when there is no heartbeat file."""
    try:
        mtime = (state_dir / HEARTBEAT_FILE).stat().st_mtime
    except FileNotFoundError:
        return None
    return max(0.0, (time.time() if now is None else now) - mtime)


def read_status_port(state_dir: Path) -> int | None:
    """The port ``run --status-port`` bound, or None when it serves none (or has not yet)."""
    try:
        return int((state_dir / STATUS_PORT_FILE).read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return None


def write_status_port(state_dir: Path, port: int) -> None:
    """Record the bound port (tests and operators use --status-port 0 and look it up here)."""
    tmp = state_dir / f".{STATUS_PORT_FILE}.tmp"
    tmp.write_text(f"{port}\n", encoding="ascii")
    os.replace(tmp, state_dir / STATUS_PORT_FILE)


class StateDirBusy(Exception):  # noqa: N818  # a condition reported to the caller, not a fault
    """Another live process owns the state directory."""

    def __init__(self, state_dir: Path, pid: int | None) -> None:
        self.state_dir = state_dir
        self.pid = pid
        super().__init__(f"{state_dir} is owned by pid {pid}")


def claim_state_dir(state_dir: Path) -> int:
    """Own ``state_dir`` for this process's lifetime; the returned fd holds the claim.

    An exclusive ``flock`` on ``owner``: the kernel drops it when the owner dies, however it
    dies, so a dead container's record never blocks the next one. Where the directory's
    filesystem has no flock (the state dir is meant to be an emptyDir, which has), the owner
    record decides: pid plus start time, so a reused pid is not taken for the owner. Raises
    :class:`StateDirBusy` while a live process owns it, ``OSError`` when it cannot be written.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / OWNER_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        locked = _lock(fd)
        owner = _read_owner(fd)  # after the lock: a winner writes its record while holding it
        busy = locked is False or (locked is None and owner is not None and same_process(*owner))
        if not busy:
            mine = os.getpid()
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": mine, "start_ticks": start_ticks(mine)}).encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    if busy:
        os.close(fd)
        raise StateDirBusy(state_dir, owner[0] if owner else None)
    return fd


def _lock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: this filesystem has no flock."""
    import fcntl  # not for probes

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}:
            return None
        raise
    return True


def _read_owner(fd: int) -> tuple[int, int | None] | None:
    """(pid, start ticks) from the owner record; None when empty or unreadable."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"null")
        return (int(data["pid"]), data.get("start_ticks"))
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError):
        return None


class StateWriter:
    """Owned by ``run``: records phases and details, and beats the heartbeat.

    With ``state_dir`` None (``warm``) the record lives in memory only: phase changes still
    reach the listeners (metrics, logs), and nothing is written for probes to read.
    """

    def __init__(
        self, state_dir: Path | None, *, heartbeat_interval: float = 2.0, stall_timeout: float | None = None
    ):
        self.dir = state_dir
        self._lock = threading.Lock()
        self._started = time.time()
        self._state = State(
            phase="resolving",
            since=self._started,
            started_at=self._started,
            pid=os.getpid(),
            pid_start_ticks=start_ticks(os.getpid()),
            heartbeat_interval=heartbeat_interval,
            stall_timeout=stall_timeout,
            updated_at=self._started,
        )
        self._listeners: list[Any] = []
        if state_dir is None:
            return
        state_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            (state_dir / STATUS_PORT_FILE).unlink(missing_ok=True)  # a previous container's port
        self._write()
        self.beat()

    @property
    def current(self) -> State:
        with self._lock:
            return self._state

    def on_change(self, listener: Any) -> None:
        """Call ``listener(old, new)`` on each phase change (metrics and logs hang off this)."""
        self._listeners.append(listener)

    def phase(self, phase: Phase, **detail: Any) -> None:
        """Enter ``phase``; its detail replaces the previous phase's."""
        with self._lock:
            old = self._state
            now = time.time()
            self._state = old._replace(phase=phase, since=now, detail=detail, updated_at=now)
            new = self._state
        # The listeners first (the metrics count the phase that ended): whoever sees the new phase
        # in the record (a probe, a test, /metrics) then sees the counters that go with it.
        for listener in self._listeners:
            listener(old, new)
        with self._lock:
            self._write()

    def update(self, **changes: Any) -> None:
        """Change fields (key, entry, health_url) or merge into the current detail."""
        with self._lock:
            detail = {**self._state.detail, **changes.pop("detail", {})}
            self._state = self._state._replace(**changes, detail=detail, updated_at=time.time())
            self._write()

    def beat(self) -> None:
        """Touch the heartbeat file (from the heartbeat thread: a frozen process stops beating).

        What the probes read is written again when found missing (a stray cleanup of the pod's
        directory, issue 40): the heartbeat at once, the state record from memory.
        """
        if self.dir is None:
            return
        path = self.dir / HEARTBEAT_FILE
        with contextlib.suppress(OSError):
            try:
                os.utime(path)
            except FileNotFoundError:
                self.dir.mkdir(parents=True, exist_ok=True)
                path.touch()
        if not os.path.lexists(self.dir / STATE_FILE):
            with self._lock:
                self._write()

    def _write(self) -> None:
        if self.dir is None:
            return
        tmp = self.dir / f".{STATE_FILE}.tmp"
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(self._state.to_json(), sort_keys=True), encoding="utf-8")
            os.replace(tmp, self.dir / STATE_FILE)
