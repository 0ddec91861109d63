"""The heartbeat: a daemon thread touching files on the volume, so peers tell a live pod from a dead one.

What it touches: use records (cachemgr.volume.records), staging owners, the pod state. A frozen or
killed process stops refreshing and goes stale; how an observer tells that without trusting
clocks is in cachemgr.volume.records.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cachemgr.core import safefs

# How often a running pod touches its records on the volume (one utime each: cheap even on a
# busy metadata server, and it keeps prune's observation of a silent record short).
HEARTBEAT_SECONDS = 2.0


class Heartbeat:
    """Touches a set of files every few seconds: use records, staging owners, the pod state.

    A daemon thread, so a frozen or killed process stops refreshing and goes stale: that is
    how peers and probes tell a dead pod from a slow one.
    """

    def __init__(self, *, interval: float = HEARTBEAT_SECONDS) -> None:
        self._interval = interval
        self._paths: dict[Path, Path] = {}  # a watched file -> the cache root it lies under
        self._callbacks: list[Any] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cachemgr-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def add(self, *paths: Path, within: Path) -> None:
        """Keep ``paths`` fresh; each is reached from ``within`` (the cache root) at every beat."""
        with self._lock:
            self._paths.update(dict.fromkeys(paths, within))

    def discard(self, *paths: Path | None) -> None:
        with self._lock:
            for path in paths:
                if path is not None:
                    self._paths.pop(path, None)

    def on_beat(self, callback: Any) -> None:
        """Also call ``callback()`` on every beat (the pod state's heartbeat)."""
        with self._lock:
            self._callbacks.append(callback)

    def beat(self) -> None:
        with self._lock:
            folders: dict[tuple[Path, Path], list[str]] = {}
            for path, root in self._paths.items():
                folders.setdefault((root, path.parent), []).append(path.name)
            callbacks = list(self._callbacks)
        for (root, folder), names in folders.items():
            with contextlib.suppress(OSError):
                _touch_in(root, folder, names)
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


def _touch_in(root: Path, folder: Path, names: Iterable[str]) -> None:
    """Refresh the mtime of each of ``names`` in ``folder``, opened once from ``root`` one level at
    a time: a folder swapped for a symlink is refused (UnsafePathError), so no file outside the
    root is touched. Nothing is created: a folder or file that is gone was removed on purpose
    (an attempt published or discarded, a use released) and must not come back."""
    with safefs.open_dir(root, folder) as fd:
        for name in names:
            with contextlib.suppress(OSError):
                os.utime(name, dir_fd=fd, follow_symlinks=False)  # a link planted as the file: the link
