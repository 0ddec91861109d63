"""The run's heartbeats: how peers, prune and the probes tell a live pod from a dead one.

Two daemon threads. The volume's touches this pod's use record (prune leaves an entry in use
alone) and the owner file of each staging attempt (a silent attempt is dead and may be
removed); the pod state's refreshes the state record the probes read. A frozen or killed
process stops both, and goes stale.

A use record found missing at a beat (removed by a peer: ``usage/`` is writable to every pod that
records its use) is written again, whole, as it was (issue 40): prune judges by it. A use record
the volume refused (full, read-only, not ours to write) is tried again at every
beat of the volume's heartbeat until it is written: a full volume is when operators prune, and
prune keeps an entry only for the pods it can see. Meanwhile the empty record, if the volume
took that much, beats and stands for the pod (cachemgr.volume.records.register_use).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachemgr.core.log import get_logger
from cachemgr.volume.heartbeat import HEARTBEAT_SECONDS, Heartbeat, why
from cachemgr.volume.records import UseNotRecordedError, register_use, release_use

if TYPE_CHECKING:
    from cachemgr.key.cachekey import CacheKey
    from cachemgr.runtime.state import StateWriter
    from cachemgr.volume.identity import PodIdentity
    from cachemgr.volume.layout import CacheRoot

log = get_logger("cachemgr.run")


class Heartbeats:
    """The volume's heartbeat and the pod state's, with this pod's use record."""

    def __init__(self, state: StateWriter, identity: PodIdentity) -> None:
        self.identity = identity
        self.volume = Heartbeat(interval=HEARTBEAT_SECONDS)
        self._state = Heartbeat(interval=state.current.heartbeat_interval)
        self._state.on_beat(state.beat)
        self._use_record: Path | None = None
        self._start = "hit"  # how this start got its entry: its use record's kind (records.STARTS)
        # The use record still to be written (the volume refused it), tried at every volume beat;
        # the lock keeps a retry from recreating a record the main thread just released.
        self._pending: Callable[[], Path] | None = None
        self._register: Callable[[], Path] | None = None  # writes this pod's use record (again)
        self._root: Path | None = None  # the cache root the pending record lies under
        self._lock = threading.Lock()
        self.volume.on_beat(self._retry_use)

    def start(self) -> None:
        self._state.start()
        self.volume.start()

    def stop(self) -> None:
        """Stop beating and end the use: the record goes into the entry's history (cachemgr stats)."""
        self.volume.stop()
        self._state.stop()
        self.volume.discard(self._use_record)  # before the lock: a restore under way takes it
        with self._lock:
            self._pending = None
            release_use(self._use_record, ended=self._start)

    def add(self, path: Path, *, within: Path, restore: Callable[[], bool] | None = None) -> None:
        """Keep ``path`` fresh (a staging attempt's owner file under root ``within``) until :meth:`discard`;
        ``restore`` writes it again when a beat finds it removed."""
        self.volume.add(path, within=within, restore=restore)

    def discard(self, path: Path) -> None:
        self.volume.discard(path)

    def use(
        self,
        root: CacheRoot,
        key: CacheKey,
        *,
        start: str = "hit",
        saved_s: float | None = None,
        waited_s: float | None = None,
    ) -> None:
        """Record that this pod uses the key's entry (and how it got it), and keep the record fresh.

        If the volume refuses, the pod serves anyway and the record is tried again at every beat.
        """
        self._start = start
        register = partial(
            register_use,
            root,
            key.digest,
            self.identity,
            entry=key.entry_name,
            start=start,
            saved_s=saved_s,
            waited_s=waited_s,
            since=time.time(),
        )
        with self._lock:
            self._pending, self._register, self._root = register, register, root.path
            self._record(first=True)

    def release_use(self) -> None:
        """The entry went before this pod used it (pruned): no start to keep."""
        self.volume.discard(self._use_record)  # before the lock: a restore under way takes it
        with self._lock:
            self._pending = None
            release_use(self._use_record)
            self._use_record = None

    def _restore_use(self) -> bool:
        """The record went missing (a beat found it gone): write it again, as it was first written.
        Called by the volume's heartbeat under its own lock, never this one's (release_use and stop
        take that lock only after taking the record off the beat)."""
        register = self._register
        if register is None:
            return False
        register()
        return True

    def _retry_use(self) -> None:
        with self._lock:
            if self._pending is not None:
                self._record(first=False)

    def _record(self, *, first: bool) -> None:
        """One attempt at the pending use record (under the lock); logs the first failure and the late success."""
        assert self._pending is not None
        assert self._root is not None
        within = self._root
        try:
            self._use_record = self._pending()
        except OSError as error:
            # UseNotRecordedError: the empty record may be there; an UnsafePathError (a link
            # planted as the usage folder) or a failed mkdir leaves nothing to beat.
            placeholder = error.placeholder if isinstance(error, UseNotRecordedError) else None
            if placeholder is not None:
                self._use_record = placeholder
                self.volume.add(placeholder, within=within)
            if first:
                log.warning("use_not_recorded", **refusal(error))
            return
        self._pending = None
        self.volume.add(self._use_record, within=within, restore=self._restore_use, refused=_restore_refused)
        if not first:
            log.info("use_recorded", record=self._use_record.name)


_UNSEEN = (
    "serving anyway; prune cannot see this pod until its use record is written, retried at every heartbeat"
)


def _restore_refused(error: Exception) -> None:
    """A removed use record the volume will not take again (``usage/`` made another user's, a
    full volume): the pod is unseen by prune until a beat writes it, as at its first write (an
    empty record the volume did take stands for the pod meanwhile, as there)."""
    if isinstance(error, OSError):
        log.warning("use_not_recorded", **refusal(error), removed=True)
    else:
        log.warning("use_not_recorded", error=str(error), removed=True, note=_UNSEEN)


def refusal(error: OSError) -> dict[str, Any]:
    """The log fields saying why a write to the volume failed: errno name, cause, whether an empty
    record stands for the pod meanwhile, and what happens now."""
    placeholder = isinstance(error, UseNotRecordedError) and error.placeholder is not None
    return {
        "placeholder": placeholder,
        **why(error),
        "note": (
            "serving anyway; an empty use record stands for this pod (prune sees it) until the whole one is written,"
            " retried at every heartbeat"
            if placeholder
            else _UNSEEN
        ),
    }
