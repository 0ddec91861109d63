"""The pod-local state record that probes read: phase, key, since, heartbeat, detail.

``run`` rewrites ``state.json`` atomically on every phase change and detail update, and
touches ``heartbeat`` every few seconds from a thread; a probe reads both without importing
anything heavy (this module uses the standard library only, so ``cachemgr probe`` stays fast).
The rules the probes apply to them are in :mod:`cachemgr.probes`.

The directory is pod-local (an emptyDir), so it may outlive a container restart: a new
``StateWriter`` replaces the record at once and drops what only the old process could vouch
for (its status port).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

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
        )


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


class StateWriter:
    """Owned by ``run``: records phases and details, and beats the heartbeat."""

    def __init__(
        self, state_dir: Path, *, heartbeat_interval: float = 2.0, stall_timeout: float | None = None
    ):
        self.dir = state_dir
        self._lock = threading.Lock()
        self._started = time.time()
        self._state = State(
            phase="resolving",
            since=self._started,
            started_at=self._started,
            pid=os.getpid(),
            heartbeat_interval=heartbeat_interval,
            stall_timeout=stall_timeout,
            updated_at=self._started,
        )
        self._listeners: list[Any] = []
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
            self._write()
        for listener in self._listeners:
            listener(old, new)

    def update(self, **changes: Any) -> None:
        """Change fields (key, entry, health_url) or merge into the current detail."""
        with self._lock:
            detail = {**self._state.detail, **changes.pop("detail", {})}
            self._state = self._state._replace(**changes, detail=detail, updated_at=time.time())
            self._write()

    def beat(self) -> None:
        """Touch the heartbeat file (from the heartbeat thread: a frozen process stops beating)."""
        path = self.dir / HEARTBEAT_FILE
        with contextlib.suppress(OSError):
            try:
                os.utime(path)
            except FileNotFoundError:
                path.touch()

    def _write(self) -> None:
        tmp = self.dir / f".{STATE_FILE}.tmp"
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(self._state.to_json(), sort_keys=True), encoding="utf-8")
            os.replace(tmp, self.dir / STATE_FILE)
