"""The pod-local state record that probes read: phase, key, since, heartbeat, detail.

``run`` rewrites ``state.json`` atomically on every phase change and touches ``heartbeat``
every few seconds from a thread; a probe reads both without importing anything heavy (this
module uses the standard library only, so ``cachemgr probe`` stays fast).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

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
DEFAULT_STATE_DIR = "/tmp/cachemgr"  # noqa: S108  # an emptyDir in the pod; each pod has its own


@dataclass(frozen=True)
class State:
    """One snapshot of the pod's state, as written to ``state.json``."""

    phase: Phase
    since: float
    started_at: float
    pid: int
    key: str | None = None
    entry: str | None = None
    health_url: str | None = None
    stall_timeout: float | None = None
    heartbeat_interval: float = 2.0
    detail: Mapping[str, Any] = field(default_factory=dict)

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
        )


def read_state(state_dir: Path) -> State:
    """The last state written; ``FileNotFoundError`` before ``run`` wrote one."""
    return State.from_json(json.loads((state_dir / STATE_FILE).read_bytes()))


def heartbeat_age(state_dir: Path, *, now: float | None = None) -> float | None:
    try:
        mtime = (state_dir / HEARTBEAT_FILE).stat().st_mtime
    except FileNotFoundError:
        return None
    return max(0.0, (time.time() if now is None else now) - mtime)


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
        )
        self._listeners: list[Any] = []
        state_dir.mkdir(parents=True, exist_ok=True)
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
            self._state = State(**{**old.__dict__, "phase": phase, "since": time.time(), "detail": detail})
            new = self._state
            self._write()
        for listener in self._listeners:
            listener(old, new)

    def update(self, **changes: Any) -> None:
        """Change fields (key, entry, health_url) or merge into the current detail."""
        with self._lock:
            detail = {**self._state.detail, **changes.pop("detail", {})}
            self._state = State(**{**self._state.__dict__, **changes, "detail": detail})
            self._write()

    def beat(self) -> None:
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
