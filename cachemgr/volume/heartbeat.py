"""The heartbeat: a daemon thread touching files on the volume, so peers tell a live pod from a dead one.

What it touches: use records (cachemgr.volume.records), staging owners, the pod state. A frozen or
killed process stops refreshing and goes stale; how an observer tells that without trusting
clocks is in cachemgr.volume.records.

A record found missing at a beat is written again by the restore its owner gave (issue 40):
anyone who can write the volume can remove it (``usage/`` is writable to every pod that records
its use), and a live pod whose record is gone looks gone to prune and to its peers. So a removal
lasts at most one beat, and readers that find a record missing watch a beat and a margin
(cachemgr.volume.records.OBSERVE_SECONDS) before they act on its absence. The pod itself takes a
path off the beat (:meth:`Heartbeat.discard`) before it removes the file, so what it removed on
purpose (a use released, an attempt published or discarded) never comes back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from cachemgr.core import fsutil, safefs
from cachemgr.core.log import get_logger

log = get_logger("cachemgr.run")

# How often a running pod touches its records on the volume (one utime each: cheap even on a
# busy metadata server, and it keeps prune's observation of a silent record short).
HEARTBEAT_SECONDS = 2.0

_DENIED = (
    "permission denied: make the volume readable and writable by the pod's user (fsGroup),"
    " and remove what another user left at the path"
)
# Why the volume refused a write, in words an operator acts on (the log names the errno too).
CAUSES = {
    errno.ENOSPC: "no space left on the volume: free some ('cachemgr du', 'cachemgr prune')",
    errno.EDQUOT: "the volume's quota is exhausted: free some ('cachemgr du', 'cachemgr prune')",
    errno.EROFS: "read-only volume: pods serving from it record no use unless usage/ is mounted read-write (docs/design.md, the threat model)",
    errno.EACCES: _DENIED,
    errno.EPERM: _DENIED,
}

# What a record that does not beat means, for any record this heartbeat keeps.
_SILENT = (
    "peers and prune take a record that neither beats nor comes back for a dead pod's (an entry in use"
    " may be pruned, a live attempt's staging removed); retried at every beat"
)


def why(error: BaseException, folder: Path | None = None) -> dict[str, str]:
    """The log fields naming a refusal of the volume: the errno's name and the path it was met
    at, where the error has them (a refusal of our own, a link planted as a folder, says both in
    its text, with its remedy; a name met in ``folder``, opened as a descriptor, is given whole);
    the error's text; and for the errnos an operator meets on a volume, the cause and what to do."""
    code = getattr(error, "errno", None) or 0
    text = getattr(error, "strerror", None) or str(error)
    where = getattr(error, "filename", None)
    fields = {"errno": errno.errorcode.get(code, str(code))} if code else {}
    if isinstance(where, (str, bytes, os.PathLike)):
        at = Path(os.fsdecode(where)) if folder is None else folder / os.fsdecode(where)
        if at.is_absolute():  # a bare name met through a descriptor, with no folder: says nothing
            fields["path"] = os.fspath(at)
    if code in CAUSES:
        fields["cause"] = CAUSES[code]
    return {**fields, "error": text}


class Heartbeat:
    """Touches a set of files every few seconds: use records, staging owners, the pod state.

    A daemon thread, so a frozen or killed process stops refreshing and goes stale: that is
    how peers and probes tell a dead pod from a slow one.
    """

    def __init__(self, *, interval: float = HEARTBEAT_SECONDS) -> None:
        self._interval = interval
        self._paths: dict[Path, Path] = {}  # a watched file -> the cache root it lies under
        # A watched file -> how to write it again when a beat finds it missing, and what to log
        # when the volume refuses that (None: the generic record_not_restored).
        self._restores: dict[Path, tuple[Callable[[], bool], Callable[[Exception], None] | None]] = {}
        self._refused: set[Path] = set()  # restores the volume refused: warned about once
        self._stuck: set[Path] = set()  # files the beat could not refresh: warned about once
        self._callbacks: list[Any] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cachemgr-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def add(
        self,
        *paths: Path,
        within: Path,
        restore: Callable[[], bool] | None = None,
        refused: Callable[[Exception], None] | None = None,
    ) -> None:
        """Keep ``paths`` fresh; each is reached from ``within`` (the cache root) at every beat.

        ``restore``: writes the file again when a beat finds it (or its folder) missing; False when
        it had nothing to write again (the file went with the work it stood for: a staging attempt
        published, its owner record with it, before the pod took the record off the beat).
        ``refused``: logs the volume's refusal of that write in the owner's words (once, until a
        restore succeeds), in place of the generic ``record_not_restored``.
        """
        with self._lock:
            self._paths.update(dict.fromkeys(paths, within))
            for path in paths:
                if restore is not None:
                    self._restores[path] = (restore, refused)
                else:
                    self._restores.pop(path, None)

    def discard(self, *paths: Path | None) -> None:
        """Stop beating ``paths``; once this returns no beat writes them again (call it before
        removing one on purpose: a restore under way is waited for)."""
        with self._lock:
            for path in paths:
                if path is not None:
                    self._paths.pop(path, None)
                    self._restores.pop(path, None)
                    self._refused.discard(path)
                    self._stuck.discard(path)

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
        missing: list[Path] = []
        stuck: dict[Path, OSError] = {}
        for (root, folder), names in folders.items():
            gone, failed = _touch_in(root, folder, names)
            missing += [folder / name for name in gone]
            stuck.update({folder / name: error for name, error in failed.items()})
            with self._lock:  # a later refusal, after a beat that went through, is said again
                self._stuck.difference_update(folder / name for name in names if name not in failed)
                refreshed = (folder / name for name in names if name not in failed and name not in gone)
                self._refused.difference_update(refreshed)
        for path, error in stuck.items():
            self._not_refreshed(path, error)
        for path in missing:
            self._restore(path)
        for callback in callbacks:
            with contextlib.suppress(Exception):
                callback()

    def _restore(self, path: Path) -> None:
        """Write ``path`` again if it is still beaten (under the lock: a discard waits for it)."""
        with self._lock:
            if path not in self._restores or path not in self._paths:
                return
            restore, refused = self._restores[path]
            try:
                wrote = restore()
            except Exception as error:  # noqa: BLE001 -- the volume refused: tried again at the next beat
                if path not in self._refused:
                    self._refused.add(path)
                    if refused is not None:
                        refused(error)
                    else:
                        log.warning(
                            "record_not_restored", record=path.name, **why(error, path.parent), note=_SILENT
                        )
                return
            self._refused.discard(path)
            if not wrote:
                return  # gone with its work, on purpose: nothing was removed by anyone else
        log.warning(
            "record_restored",
            record=path.name,
            note="a record of this live pod was removed by someone else; written again",
        )

    def _not_refreshed(self, path: Path, error: OSError) -> None:
        """A record there that the beat could not refresh (its folder or the file closed to the
        pod by another user, a link planted as its folder): said once, until a beat refreshes it
        again."""
        with self._lock:
            if path in self._stuck or path not in self._paths:
                return
            self._stuck.add(path)
        log.warning("record_not_refreshed", record=path.name, **why(error, path.parent), note=_SILENT)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            # Nothing ends the thread but stop(): a pod whose beat died looks dead to its peers,
            # and a log write that fails (stderr gone) must not do that.
            with contextlib.suppress(Exception):
                self.beat()


def _touch_in(root: Path, folder: Path, names: Iterable[str]) -> tuple[list[str], dict[str, OSError]]:
    """Refresh the mtime of each of ``names`` in ``folder``, opened once from ``root`` one level at
    a time: a folder swapped for a symlink is refused (UnsafePathError), so no file outside the
    root is touched. Nothing is created here. Returns the names found missing (all of them when
    the folder is), for their restores, and the names the volume would not refresh, with why
    (all of them when the folder could not be opened): the next beat tries them again."""
    names = list(names)
    missing: list[str] = []
    failed: dict[str, OSError] = {}
    try:
        with safefs.open_dir(root, folder) as fd:
            for name in names:
                try:
                    if not fsutil.refresh_at(fd, name):  # missing, or a hard link it removed
                        missing.append(name)
                except OSError as error:
                    failed[name] = error
    except FileNotFoundError:
        return names, {}
    except OSError as error:
        return [], dict.fromkeys(names, error)
    return missing, failed
