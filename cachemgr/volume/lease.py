"""The compile lease: one pod compiles a key while its peers wait.

The mechanism is :class:`cachemgr.volume.softlease.SoftLease`, a marker lease with the semantics of
filelock's ``SoftFileLease`` (a marker its holder refreshes; contenders judge expiry on their own
monotonic clock from the last change they observed, so clock skew between nodes does not matter;
a holder on the same host whose process is gone is taken over at once, any other after its lease
duration). That module says where filelock's falls short: pods with different
``--lease-duration`` crashed on each other's markers, and on FUSE mounts such as SeaweedFS's a
marker held open is invisible to other nodes and two nodes can both win the exclusive create.
It needs no flock, so it works where NFS ``nolock`` or FUSE would make flock lie.

The lease only saves duplicate work. Correctness rests on private staging and an atomic
publish (see :mod:`cachemgr.volume.store`), so a lease that fails or is stolen can cost at most a
second compile.

Beside the marker, the holder writes ``<digest>.holder.json`` (pod, node, since, token) so
waiters and ``cachemgr locks`` can say who is compiling and for how long.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cachemgr.core import jsonread, safefs
from cachemgr.core.fsutil import atomic_write_json
from cachemgr.core.log import get_logger
from cachemgr.core.procs import Flag
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.lease_defaults import DEFAULT_DURATION
from cachemgr.volume.liveness import gone_here
from cachemgr.volume.softlease import (
    MarkerRecord,
    SoftLease,
    default_confirm,
    holder_gone,
    patience,
    read_marker_view,
)

log = get_logger("cachemgr.volume.lease")

_POLL = 0.2  # waiters look for the published entry this often: start within a second of it
_LOG_EVERY = 5.0


@dataclass(frozen=True)
class Holder:
    """Who holds a key's lease, as recorded beside its marker."""

    pod: str
    node: str
    pid: int
    host: str
    since: float
    token: str | None
    current: bool  # the record's token matches the live marker
    refreshed_age: float | None = None  # since the holder's last heartbeat, by this node's clock
    duration: float | None = None  # as the holder wrote it into its marker (None: it names none)
    confirm: float = 0.0  # the holder's confirm window, during which it does not refresh
    # Its process is known gone (it ran on this host: cachemgr.volume.liveness): a contender here
    # takes the lease over at once, as cachemgr.volume.softlease does.
    gone: bool = False
    entry: str = ""  # the entry it compiles, as its holder record names it

    @property
    def expired(self) -> bool:
        """Not refreshed within its holder's own promise: any contender takes it over.

        The holder's recorded duration (and confirm window) is authoritative, as contenders judge
        it (:func:`cachemgr.volume.softlease.patience`); a marker that names no duration (damaged
        or foreign) is judged by the default duration, as a pod with default settings judges it.
        Ages are by this node's clock from the marker's mtime.
        """
        record = MarkerRecord(duration=self.duration, confirm=self.confirm)
        return self.refreshed_age is not None and self.refreshed_age > patience(
            record, default=DEFAULT_DURATION
        )

    @property
    def stale(self) -> bool:
        """The one rule for ``locks``, ``show``, ``explain``, ``ls`` and ``prune``: the next
        contender takes the lease over, because its holder is gone (here) or silent too long."""
        return self.gone or self.expired

    @property
    def state(self) -> str:
        """``dead`` (its process is gone), ``expired`` (not refreshed for its duration) or ``live``."""
        return "dead" if self.gone else "expired" if self.expired else "live"

    @property
    def held_for(self) -> float:
        return max(0.0, time.time() - self.since)

    def describe(self) -> str:
        where = f" on node {self.node}" if self.node else ""
        return f"pod {self.pod}{where} (pid {self.pid}), for {self.held_for:.0f}s"


def marker_path(root: CacheRoot, digest: str) -> Path:
    return root.leases / f"{digest}.lock"


def holder_path(root: CacheRoot, digest: str) -> Path:
    return root.leases / f"{digest}.holder.json"


def read_holder(root: CacheRoot, digest: str) -> Holder | None:
    """The current holder, or None when nobody holds the key's lease."""
    view = read_marker_view(marker_path(root, digest))
    if view is None:
        return None
    marker, age = view.record, max(0.0, time.time() - view.mtime)
    try:
        data: Any = jsonread.read(holder_path(root, digest))
    except (OSError, ValueError):
        data = {}
    if not isinstance(data, dict):
        data = {}
    # Anyone who can write the volume writes this record: a field of the wrong type reads as
    # absent (a "pid": "abc" once made every waiting pod, ls and locks exit 70).
    token = _text(data.get("token")) or None
    return Holder(
        pod=_text(data.get("pod")) or marker.host or "?",
        node=_text(data.get("node")),
        pid=_pid(data.get("pid")) or marker.pid or 0,
        host=_text(data.get("host")) or marker.host or "",
        since=_when(data.get("since")) or time.time() - age,
        token=token,
        current=token is not None and token == marker.token,
        refreshed_age=age,
        duration=marker.duration,
        confirm=marker.confirm,
        gone=holder_gone(marker),
        entry=_text(data.get("entry")),
    )


def _text(value: Any) -> str:
    return value[:253] if isinstance(value, str) else ""  # a pod or node name is at most 253


def _pid(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 31 else 0


def _when(value: Any) -> float:
    """A time in seconds since the epoch; 0 for anything else (nan, inf, a string, garbage)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value) if 0 < value < 1e11 else 0.0


WaitOutcome = Literal["acquired", "published"]


class KeyLease:
    """The lease on one key, held by this process while it compiles."""

    def __init__(
        self,
        root: CacheRoot,
        digest: str,
        identity: PodIdentity,
        *,
        duration: float = DEFAULT_DURATION,
        heartbeat: float | None = None,
        confirm: float | None = None,
        entry: str | None = None,
    ) -> None:
        """``confirm``: seconds a won create is held before it counts (None: by filesystem type);
        ``entry``: the entry this compile makes, for the holder record (``cachemgr locks``)."""
        self._entry = entry
        self._root = root
        self._digest = digest
        self._identity = identity
        path = marker_path(root, digest)
        self._lease = SoftLease(
            path,
            within=root.path,
            duration=duration,
            heartbeat=heartbeat,
            confirm=default_confirm(root.path) if confirm is None else confirm,
            on_lost=self._on_lost,
            on_beat=self._keep_holder,
            holder_evidence=self._holder_evidence,
        )
        self._holder: dict[str, Any] | None = None  # the holder record this pod wrote
        self._holder_lock = threading.Lock()  # a release and a beat's restore, one at a time

    @property
    def duration(self) -> float:
        return self._lease.duration

    @property
    def token(self) -> str | None:
        """This holder's marker token: its progress record carries it (cachemgr.ops.progress)."""
        return self._lease.token

    @property
    def lost(self) -> bool:
        """True once another pod took the lease over (we were frozen or cut off).

        Checks the marker itself too: a frozen process may reach publish before its heartbeat
        thread has looked.
        """
        return self._lease.lost

    def _on_lost(self, reason: str) -> None:
        log.warning("lease_lost", key=self._digest[:12], reason=reason)

    def wait_or_acquire(
        self,
        *,
        published: Callable[[], bool],
        stop: Flag,
        wait_timeout: float | None,
        on_wait: Callable[[Holder | None, float], None] | None = None,
        notify_every: float = _LOG_EVERY,
    ) -> WaitOutcome:
        """Take the lease, or return as soon as a peer publishes the entry.

        Raises ``TimeoutError`` after ``wait_timeout`` seconds and ``InterruptedError`` when
        ``stop`` is set (a termination signal): the caller turns these into exit codes.
        """
        started = time.monotonic()
        last_log = [started - notify_every]
        outcome: list[WaitOutcome] = []

        def should_stop() -> bool:
            now = time.monotonic()
            if published():
                outcome.append("published")
                return True
            if stop.is_set() or (wait_timeout is not None and now - started >= wait_timeout):
                return True
            # While confirming its own create this pod is not waiting for anyone.
            if now - last_log[0] >= notify_every and self._lease.token is None:
                last_log[0] = now
                if on_wait is not None:
                    on_wait(read_holder(self._root, self._digest), now - started)
            return False

        if published():
            return "published"
        if not self._lease.acquire(poll=_POLL, cancel=should_stop):
            if outcome:
                return outcome[0]
            if stop.is_set():
                raise InterruptedError("stopped while waiting for the lease")
            raise TimeoutError(f"waited {time.monotonic() - started:.0f}s for the lease")
        self._write_holder()
        return "acquired"

    def _write_holder(self) -> None:
        record = {**self._identity.to_json(), "since": time.time(), "token": self._lease.token}
        if self._entry:
            record["entry"] = self._entry
        self._holder = record
        with contextlib.suppress(OSError):
            atomic_write_json(holder_path(self._root, self._digest), record, within=self._root.path)

    def _keep_holder(self) -> None:
        """At each lease beat: the holder record written again if someone removed it (issue 40):
        waiters and ``locks`` say who compiles from it, and a contender waits for a removed
        marker while it stands (:meth:`_holder_evidence`)."""
        path = holder_path(self._root, self._digest)
        with self._holder_lock:
            record = self._holder
            if record is None or record.get("token") != self._lease.token:
                return
            if safefs.lstat(self._root.path, path) is not None:
                return
            atomic_write_json(path, record, within=self._root.path)
            log.warning(
                "lease_holder_restored", key=self._digest[:12], note="removed by someone else; written again"
            )

    def _holder_evidence(self) -> tuple[object, ...] | None:
        """The holder record as it stands (inode, mtime, size) when it names a holder not known
        gone (cachemgr.volume.liveness); None otherwise. A holder removes its record before its
        marker when it releases, so a record without a marker is a live holder's whose marker
        was removed, or a dead one's: contenders wait a lease duration for the marker to return."""
        path = holder_path(self._root, self._digest)
        try:
            with safefs.open_dir(self._root.path, path.parent) as folder:
                st = os.stat(path.name, dir_fd=folder, follow_symlinks=False)
                data: Any = jsonread.read(path.name, dir_fd=folder) if stat.S_ISREG(st.st_mode) else None
        except (OSError, ValueError, safefs.UnsafePathError):
            return None
        if not isinstance(data, dict) or not _text(data.get("token")):
            return None
        if gone_here(host=_text(data.get("host")) or None, pid=_pid(data.get("pid")) or None):
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def release(self) -> None:
        """Release if held (idempotent); the holder record goes with it."""
        token = self._lease.token
        if token is None:
            return
        with self._holder_lock:
            self._holder = None  # no beat writes it again from here on
        holder = holder_path(self._root, self._digest)
        # Read and removed from leases/ reached from the root one level at a time: a folder
        # swapped for a symlink is refused (and swallowed), never followed to a file of that name.
        with (
            contextlib.suppress(OSError, ValueError),
            safefs.open_dir(self._root.path, holder.parent) as leases,
        ):
            data = jsonread.read(holder.name, dir_fd=leases)
            if isinstance(data, dict) and data.get("token") == token:
                os.unlink(holder.name, dir_fd=leases)
        self._lease.release()


def remove_dead(root: CacheRoot, digest: str, *, pod: str, pid: int) -> str | None:
    """Remove the key's lease if its holder is that dead attempt's pod: ``prune --stale-staging``.

    Only a stale lease (its holder gone, or silent past its promise: :attr:`Holder.stale`) held by
    ``pod``/``pid`` goes, marker and holder record, as a contender would take it over; a marker
    that changed meanwhile (a new holder) is put back. Returns the removed marker's token (its
    progress record goes with it), or None when nothing was removed.
    """
    holder = read_holder(root, digest)
    if holder is None or not holder.stale or holder.pid != pid or holder.pod != pod:
        return None
    marker, record = marker_path(root, digest), holder_path(root, digest)
    with safefs.open_dir(root.path, root.leases) as folder:
        view = read_marker_view(marker, dir_fd=folder)
        if view is None:
            return None
        aside = f"{marker.name}.pruned.{os.getpid()}.{int(time.time_ns())}"
        try:
            os.rename(marker.name, aside, src_dir_fd=folder, dst_dir_fd=folder)
        except FileNotFoundError:
            return None  # a contender took it over first
        moved = read_marker_view(marker.with_name(aside), dir_fd=folder)
        if moved is None or moved.stamp[:1] != view.stamp[:1]:
            # A new holder's marker came in between our read and the rename: it is live, give it back.
            with contextlib.suppress(OSError):
                os.link(aside, marker.name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
            with contextlib.suppress(OSError):
                os.unlink(aside, dir_fd=folder)
            return None
        os.unlink(aside, dir_fd=folder)
        with contextlib.suppress(OSError, ValueError):
            data = jsonread.read(record.name, dir_fd=folder)
            if isinstance(data, dict) and data.get("token") in (None, view.record.token):
                os.unlink(record.name, dir_fd=folder)
    log.info("dead_lease_removed", key=digest[:12], holder=pod, pid=pid)
    return view.record.token or ""
