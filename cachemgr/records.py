"""Bookkeeping kept beside entries, never inside them: who uses an entry, and failed compiles.

A published entry is immutable, so its users and its last use are recorded under
``usage/<digest>/``: one file per running pod, refreshed by a heartbeat and removed on exit,
and a ``last-used`` file touched at each start. A pod is "in use" of an entry while its file
is fresher than the in-use window; a pod that died leaves a file that goes stale. Failed
compiles are recorded under ``failures/<digest>/`` for inspection and never replayed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachemgr import safefs
from cachemgr.fsutil import atomic_write_json, read_json, touch

if TYPE_CHECKING:
    from cachemgr.store import CacheRoot

# A user record older than this is a pod that stopped without saying so. Generous against
# clock skew between nodes: records are compared with this node's clock.
IN_USE_WINDOW = 120.0
HEARTBEAT_SECONDS = 10.0


@dataclass(frozen=True)
class PodIdentity:
    """Who is acting: the pod (HOSTNAME in Kubernetes), its node (downward API) and process."""

    pod: str
    node: str
    host: str
    pid: int

    @classmethod
    def current(cls, environ: Mapping[str, str] | None = None) -> PodIdentity:
        env = os.environ if environ is None else environ
        host = socket.gethostname()
        return cls(
            pod=env.get("POD_NAME") or env.get("HOSTNAME") or host,
            node=env.get("NODE_NAME") or env.get("CACHEMGR_NODE_NAME") or "",
            host=host,
            pid=os.getpid(),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def record_name(self) -> str:
        return f"{self.pod}.{self.pid}.json"


# --- usage ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class User:
    """A pod using an entry, as recorded on the volume."""

    pod: str
    node: str
    since: float
    age: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def register_use(root: CacheRoot, digest: str, identity: PodIdentity, *, entry: str) -> Path:
    """Record that this pod uses the entry now (before it is checked, so prune sees us first)."""
    folder = root.usage / digest
    safefs.make_dirs(root.path, folder)  # a symlink planted as usage/<digest> is refused, not written through
    record = folder / identity.record_name
    atomic_write_json(record, {**identity.to_json(), "entry": entry, "since": time.time()})
    touch(folder / "last-used")
    return record


def release_use(record: Path | None) -> None:
    if record is not None:
        record.unlink(missing_ok=True)


def users(
    root: CacheRoot, digest: str, *, window: float = IN_USE_WINDOW, now: float | None = None
) -> list[User]:
    """Pods whose use record is fresher than ``window``: the entry is in use."""
    folder = root.usage / digest
    found: list[User] = []
    now = time.time() if now is None else now
    # Listed from descriptors: a symlink planted as usage/<digest> is refused (exit 74), never
    # read through, and never taken for "nobody uses it".
    for name in safefs.listdir(root.path, folder):
        if not name.endswith(".json") or name.startswith("."):
            continue
        path = folder / name
        try:
            age = now - path.stat().st_mtime
        except OSError:
            continue
        if age > window:
            continue
        try:
            data = read_json(path)
        except (OSError, ValueError):
            data = None
        if not isinstance(data, dict):
            # Fresh but unreadable (half-written, damaged): someone is there; prune must not guess.
            found.append(User(name.removesuffix(".json"), "", 0.0, age))
            continue
        found.append(
            User(str(data.get("pod", "")), str(data.get("node", "")), float(data.get("since", 0)), age)
        )
    return found


def last_used(root: CacheRoot, digest: str) -> float | None:
    try:
        return (root.usage / digest / "last-used").stat().st_mtime
    except FileNotFoundError:
        return None


# --- failures ------------------------------------------------------------------------------


def record_failure(
    root: CacheRoot, digest: str, identity: PodIdentity, record: Mapping[str, Any]
) -> Path | None:
    """Keep a failed attempt's story (time, code, output tail). Best effort: the volume may be full."""
    folder = root.failures / digest
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = folder / f"{stamp}.{identity.pod}.{identity.pid}.json"
    try:
        safefs.make_dirs(root.path, folder)
        atomic_write_json(path, {**identity.to_json(), "time": time.time(), **record})
    except OSError:
        return None
    return path


def failures(root: CacheRoot, digest: str) -> list[dict[str, Any]]:
    folder = root.failures / digest
    found: list[dict[str, Any]] = []
    with contextlib.suppress(safefs.UnsafePathError):  # a symlink there: nothing of ours to read
        for name in safefs.listdir(root.path, folder):
            with contextlib.suppress(OSError, ValueError):
                data = read_json(folder / name)
                if isinstance(data, dict):
                    found.append(data)
    return found


# --- heartbeat -----------------------------------------------------------------------------


class Heartbeat:
    """Touches a set of files every few seconds: use records, staging owners, the pod state.

    A daemon thread, so a frozen or killed process stops refreshing and goes stale: that is
    how peers and probes tell a dead pod from a slow one.
    """

    def __init__(self, *, interval: float = HEARTBEAT_SECONDS) -> None:
        self._interval = interval
        self._paths: set[Path] = set()
        self._callbacks: list[Any] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cachemgr-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def add(self, *paths: Path) -> None:
        with self._lock:
            self._paths.update(paths)

    def discard(self, *paths: Path | None) -> None:
        with self._lock:
            self._paths.difference_update(p for p in paths if p is not None)

    def on_beat(self, callback: Any) -> None:
        """Also call ``callback()`` on every beat (the pod state's heartbeat)."""
        with self._lock:
            self._callbacks.append(callback)

    def beat(self) -> None:
        with self._lock:
            paths: Iterable[Path] = list(self._paths)
            callbacks = list(self._callbacks)
        for path in paths:
            with contextlib.suppress(OSError):
                os.utime(path, follow_symlinks=False)  # a link swapped in: touch the link, not its target
        for callback in callbacks:
            with contextlib.suppress(Exception):
                callback()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.beat()
