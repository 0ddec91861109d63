"""A lease on a marker file that holds on network filesystems: the mechanism under the compile lease.

docs/design.md asks for filelock's ``SoftFileLease`` "or a lease of the same semantics if it falls
short". It falls short on a shared volume in three ways, each seen for real:

* Peers must agree on ``lease_duration``: a contender that meets a marker written with another
  duration raises ``LeaseSettingsMismatch`` (filelock ``_soft/_lease.py``,
  ``_try_break_pinned_lock``), so a Deployment and a warm Job with different ``--lease-duration``
  crashed, and a dead holder's marker made every later pod crash. Here a waiter judges a marker
  by the duration its holder wrote into it: the holder promised to refresh within that time.
* It keeps the marker's descriptor open for the whole hold and refreshes it with ``futimens`` on
  that descriptor. On SeaweedFS's FUSE mount (``weed mount``) a file created and still open is
  not visible to other mounts at all until it is closed (seconds, or never), and a ``futimens``
  on an open descriptor does not reach them either, so a live holder looks dead to other nodes.
  Here the marker is written, fsynced and closed at once, and refreshed by ``utime`` on its name.
* It trusts ``O_CREAT|O_EXCL``. Over two ``weed mount`` clients both creates succeed when they
  come within the mounts' metadata propagation (tried: 2 of 4 runs of eight pods over two mounts
  compiled twice); NFS without server-side exclusive create and other FUSE clients behave alike.
  Here a winner writes a unique token into the marker, waits ``confirm`` seconds (longer than
  the filesystem's metadata cache horizon), and reads the marker back: only the pod whose token
  is still there holds the lease; a loser becomes a waiter. Every mount sees the same last
  write once its caches expire, so exactly one token survives.

The marker keeps filelock's ``filelock/2`` format (key=value lines: pid, host, mode=lease,
token, duration), so ``cachemgr locks`` and pods of older releases read it as before; the added
``confirm``, ``started``, ``boot`` and ``pidns`` lines are ignored by filelock's parser.

Expiry is judged without shared clocks: a waiter notes when, by its own monotonic clock, it
last saw the marker change (token, mtime, size, inode) and takes over once it has seen no
change for the holder's duration plus the holder's confirm window (the holder does not refresh
while it confirms). A holder on this host (same hostname, boot and pid namespace) whose process
is gone is taken over at once: a restarted container retakes its own lease without waiting.

As before, the lease only saves duplicate work: correctness rests on private staging and an
atomic publish, so a lease that is lost or stolen costs at most a second compile.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cachemgr.core import fsutil, safefs
from cachemgr.core.fsutil import filesystem_type
from cachemgr.core.log import get_logger
from cachemgr.volume.liveness import Here, gone_here

log = get_logger("cachemgr.volume.lease")

PROTOCOL = "filelock/2"
# The confirm window: how long a winner waits before trusting its exclusive create. Longer than
# the metadata caches of the filesystems a cache volume lives on (JuiceFS and most FUSE clients
# cache attributes and entries for 1 s; two `weed mount` clients see each other's writes within
# tens of milliseconds when idle). It is paid only on a miss, once, before a compile of minutes.
DEFAULT_CONFIRM = 2.0
# Filesystems of one kernel: O_EXCL is atomic there, so a create needs no confirming. (A volume of
# these types is mounted by one node only; ReadWriteMany volumes are NFS, CephFS, FUSE...)
_LOCAL_FILESYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "tmpfs", "ramfs", "overlay"}
)
# A marker on the volume is untrusted: a duration written into it counts up to this much.
MAX_JUDGED_SECONDS = 24 * 3600.0
_MAX_MARKER_BYTES = 4096
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK  # a FIFO planted as a marker must not block


@dataclass(frozen=True)
class MarkerRecord:
    """What a marker says about its holder; any field may be missing from a foreign or damaged one."""

    token: str | None = None
    pid: int | None = None
    host: str | None = None
    duration: float | None = None
    confirm: float = 0.0
    started: float | None = None  # the holder process's start time: a reused pid is not the holder
    boot: str | None = None
    pidns: str | None = None


@dataclass(frozen=True)
class MarkerView:
    """One read of a marker: its record and what a waiter watches for change."""

    record: MarkerRecord
    stamp: tuple[object, ...]
    mtime: float = 0.0  # by the refreshing node's clock: readers without a watch (locks, show) age it so


def parse_marker(text: str) -> MarkerRecord:
    fields = dict(line.partition("=")[::2] for line in text.splitlines() if "=" in line)

    def number(name: str) -> float | None:
        try:
            value = float(fields[name])
        except (KeyError, ValueError):
            return None
        return value if 0 < value < float("inf") else None

    pid = number("pid")
    return MarkerRecord(
        token=fields.get("token") or None,
        pid=int(pid) if pid is not None and pid == int(pid) else None,
        host=fields.get("host"),
        duration=number("duration"),
        confirm=number("confirm") or 0.0,
        started=number("started"),
        boot=fields.get("boot"),
        pidns=fields.get("pidns"),
    )


def read_marker_view(path: Path, *, dir_fd: int | None = None) -> MarkerView | None:
    """The marker at path (by name in its folder ``dir_fd``, when given), or None if there is none.
    Never follows a symlink or blocks on a FIFO."""
    name: str | Path = path if dir_fd is None else path.name
    try:
        fd = os.open(name, _OPEN_READ, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)  # a symlink planted as the marker: damage
        return MarkerView(MarkerRecord(), ("symlink", st.st_ino, st.st_mtime_ns), st.st_mtime)
    try:
        st = os.fstat(fd)
        data = os.read(fd, _MAX_MARKER_BYTES) if _is_regular(st) else b""
    finally:
        os.close(fd)
    record = parse_marker(data.decode("utf-8", errors="replace"))
    return MarkerView(record, (record.token, st.st_mtime_ns, st.st_size, st.st_ino), st.st_mtime)


def default_confirm(path: Path) -> float:
    """The confirm window for a volume: none on a local filesystem, DEFAULT_CONFIRM elsewhere."""
    return 0.0 if filesystem_type(path) in _LOCAL_FILESYSTEMS else DEFAULT_CONFIRM


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _is_regular(st: os.stat_result) -> bool:
    return (st.st_mode & 0o170000) == 0o100000


def patience(record: MarkerRecord, *, default: float) -> float:
    """How long a marker may stay unchanged: its holder's promise, not the reader's (pods differ).

    The holder refreshes within its duration, and does not refresh during its confirm window.
    ``default``: the reader's own duration, for a marker that names none (damaged, or foreign).
    """
    duration = min(record.duration or default, MAX_JUDGED_SECONDS)
    return duration + min(record.confirm, MAX_JUDGED_SECONDS)


def holder_gone(record: MarkerRecord) -> bool:
    """The marker's holder is known gone (cachemgr.volume.liveness): contenders here take it over at
    once, and ``locks`` says so. A marker that names no boot or pid namespace (foreign, or
    damaged) is judged by silence alone."""
    if record.boot is None or record.pidns is None:
        return False
    return gone_here(
        host=record.host, pid=record.pid, boot=record.boot, pidns=record.pidns, started=record.started
    )


class MarkerWatch:
    """How long a marker has gone unchanged, by this node's monotonic clock.

    Expiry judged this way needs no clock shared with the holder's node: an mtime written by a
    node minutes ahead or behind still changes at each refresh.
    """

    def __init__(self) -> None:
        self._seen: tuple[tuple[object, ...], float] | None = None  # (stamp, when first seen)

    def silent_for(self, view: MarkerView | None) -> float:
        """Seconds since this watch first saw the marker as it is now (0 for a change or none)."""
        now = time.monotonic()
        if view is None or self._seen is None or self._seen[0] != view.stamp:
            self._seen = None if view is None else (view.stamp, now)
            return 0.0
        return now - self._seen[1]


class SoftLease:
    """A lease on one marker file; see the module docstring for the protocol."""

    def __init__(
        self,
        path: Path,
        *,
        within: Path | None = None,
        duration: float,
        heartbeat: float | None = None,
        confirm: float = DEFAULT_CONFIRM,
        on_lost: Callable[[str], None] | None = None,
        on_beat: Callable[[], None] | None = None,
        holder_evidence: Callable[[], tuple[object, ...] | None] | None = None,
    ) -> None:
        """``on_beat``: called at each refresh of a held marker (the holder record kept there);
        ``holder_evidence``: a stamp of a live holder's record while the marker is missing (None:
        no holder), so a contender waits for a removed marker to be written again."""
        if not 0 < duration < float("inf"):
            raise ValueError(f"lease duration must be positive and finite, got {duration!r}")
        self.path = path
        # The cache root: every create, read, refresh, rename and unlink reaches the marker's
        # folder from it one level at a time (a folder swapped for a symlink is never followed).
        self._within = within
        self.duration = duration
        self.heartbeat = heartbeat if heartbeat is not None else duration / 3
        if not 0 < self.heartbeat < duration:
            raise ValueError(f"heartbeat must be positive and below the duration, got {self.heartbeat!r}")
        self.confirm = max(0.0, confirm)
        self._on_lost = on_lost
        self._on_beat = on_beat
        self._holder_evidence = holder_evidence
        self._vanished = MarkerWatch()  # how long a holder's record has stood without its marker
        self._broken: tuple[object, ...] | None = None  # the record of a holder this contender judged dead
        self._me = Here.current()
        self._token: str | None = None
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch = MarkerWatch()

    @property
    def token(self) -> str | None:
        return self._token

    @property
    def is_held(self) -> bool:
        return self._token is not None

    @property
    def lost(self) -> bool:
        """Held, but the marker is gone or another pod's (we were frozen, cut off, or raced)."""
        if self._token is None:
            return False
        if self._lost.is_set():
            return True
        try:
            view = self._view()
        except safefs.UnsafePathError:
            return True  # the folder is a symlink now: our marker is not where peers look
        return view is None or view.record.token != self._token

    def acquire(self, *, poll: float, cancel: Callable[[], bool]) -> bool:
        """Take the lease; False as soon as ``cancel()`` says so (checked every ``poll`` seconds).

        A free lease is tried before ``cancel`` is first called: an uncontended pod never waits.
        After that, ``cancel`` comes before every try: a waiter whose peer just published and
        released must not take the free lease (and pay the confirm window) for nothing.
        """
        first = True
        while first or not cancel():
            first = False
            if self._marker_removed_under_holder():
                pass  # its holder writes it again at its next beat: wait as for a live marker
            elif self._try_create():
                if self._confirmed(poll=poll, cancel=cancel):
                    self._start_heartbeat()
                    return True
            elif self._break_if_stale():
                continue  # the path is free: try to create at once
            time.sleep(poll)
        return False

    def release(self) -> None:
        """Stop refreshing and remove the marker if it is still ours (idempotent)."""
        token, self._token = self._token, None
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        if token is None:
            return
        with contextlib.suppress(OSError), self._folder() as folder:
            view = read_marker_view(self.path, dir_fd=folder)
            if view is not None and view.record.token == token:
                os.unlink(self.path.name, dir_fd=folder)

    # --- the marker's folder -------------------------------------------------------------

    def _folder(self) -> contextlib.AbstractContextManager[int]:
        """The marker's folder, open: from the root one level at a time when ``within`` is set."""
        return safefs.open_tree(self.path.parent, within=self._within)

    def _view(self) -> MarkerView | None:
        """The marker now; None if it, or its folder, is missing."""
        try:
            with self._folder() as folder:
                return read_marker_view(self.path, dir_fd=folder)
        except FileNotFoundError:
            return None

    # --- taking the marker ---------------------------------------------------------------

    def _encode(self, token: str) -> bytes:
        me = self._me
        lines = [
            PROTOCOL,
            f"pid={me.pid}",
            f"host={me.host}",
            "mode=lease",
            f"token={token}",
            f"duration={self.duration!r}",
            f"confirm={self.confirm!r}",
            f"started={me.started!r}",
        ]
        lines += [f"boot={me.boot}"] if me.boot else []
        lines += [f"pidns={me.pidns}"] if me.pidns else []
        return "".join(f"{line}\n" for line in lines).encode()

    def _try_create(self) -> bool:
        """Exclusive create, written and closed at once: other mounts see a file only once closed."""
        token = secrets.token_hex(16)
        if not self._create(token):
            return False
        self._token = token
        self._lost.clear()
        return True

    def _create(self, token: str) -> bool:
        """The marker with ``token``, by an exclusive create (never over another's); False if one is there."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with self._folder() as folder:
            try:
                fd = os.open(self.path.name, flags, 0o644, dir_fd=folder)
            except FileExistsError:
                return False
            try:
                _write_all(fd, self._encode(token))
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(self.path.name, dir_fd=folder)
                raise
            os.close(fd)
        return True

    def _confirmed(self, *, poll: float, cancel: Callable[[], bool]) -> bool:
        """After the confirm window, is the marker still ours? A racer's later write would show by now."""
        deadline = time.monotonic() + self.confirm
        while (left := deadline - time.monotonic()) > 0:
            if cancel():
                self.release()
                return False
            time.sleep(min(poll, left))
        view = self._view()
        if view is not None and view.record.token == self._token:
            with contextlib.suppress(OSError):  # the heartbeat retries
                self._refresh()  # the confirm window counted as silence; restart the clock now
            return True
        log.info("lease_race_lost", marker=self.path.name, note="another pod's create won; waiting for it")
        self._token = None  # the marker is the winner's: never remove it
        return False

    # --- judging a peer's marker ---------------------------------------------------------

    def _break_if_stale(self) -> bool:
        """Take the marker away from a dead or frozen holder; True if the path may now be free."""
        view = self._view()
        silent = self._watch.silent_for(view)
        if view is None:
            return True
        if self._holder_dead(view.record) or silent >= patience(view.record, default=self.duration):
            with self._folder() as folder:
                return self._break(folder, view)
        return False

    def _marker_removed_under_holder(self) -> bool:
        """No marker, but its holder's record is there: someone removed a live holder's marker
        (issue 40), and the holder writes it again at its next beat. Judged like a silent marker:
        once the record has stood without its marker for a lease duration (by this node's
        monotonic clock), the lease is free; a holder this contender judged dead is not waited for."""
        if self._holder_evidence is None or self._view() is not None:
            self._vanished = MarkerWatch()
            return False
        evidence = self._holder_evidence()
        if evidence is None or evidence == self._broken:
            self._vanished = MarkerWatch()
            return False
        silent = self._vanished.silent_for(MarkerView(MarkerRecord(), evidence))
        if silent < patience(MarkerRecord(), default=self.duration):
            return True
        log.info("lease_marker_missing", marker=self.path.name, note="its holder did not write it again")
        return False

    def _holder_dead(self, record: MarkerRecord) -> bool:
        return holder_gone(record)

    def _break(self, folder: int, view: MarkerView) -> bool:
        """Move the stale marker aside; if a live one was swapped in meanwhile, put it back."""
        name, aside = self.path.name, f"{self.path.name}.taken.{secrets.token_hex(8)}"
        try:
            os.rename(name, aside, src_dir_fd=folder, dst_dir_fd=folder)
        except FileNotFoundError:
            return True  # another contender moved it first
        self._watch = MarkerWatch()
        moved = read_marker_view(self.path.with_name(aside), dir_fd=folder)
        undone = moved is not None and moved.stamp[:1] != view.stamp[:1]
        if undone:
            # A peer replaced the stale marker between our read and our rename: that one is live.
            # Never over a marker that appeared in the meantime; a symlink is linked as itself.
            with contextlib.suppress(OSError):
                os.link(aside, name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
            log.info("lease_break_undone", marker=name)
        else:
            record = view.record
            self._broken = self._holder_evidence() if self._holder_evidence is not None else None
            log.info(
                "lease_taken_over",
                marker=name,
                holder_pid=record.pid,
                holder_host=record.host,
                holder_duration=record.duration,
            )
        with contextlib.suppress(OSError):
            os.unlink(aside, dir_fd=folder)
        return not undone

    # --- holding: the heartbeat ----------------------------------------------------------

    def _refresh(self) -> None:
        """Change the marker's mtime by name: a utime on the file's descriptor may not reach other
        mounts. A marker missing, or a hard link planted as it (removed, never touched), is for the
        next beat's view of the lease to find."""
        with self._folder() as folder:
            fsutil.refresh_at(folder, self.path.name)

    def _start_heartbeat(self) -> None:
        self._stop = threading.Event()
        token = self._token
        thread = threading.Thread(target=self._beat, args=(token, self._stop), daemon=True)
        thread.name = f"cachemgr-lease-{self.path.name[:12]}"
        self._thread = thread
        thread.start()

    def _beat(self, token: str | None, stop: threading.Event) -> None:
        last_ok = time.monotonic()
        while not stop.wait(self.heartbeat) and self._token == token:
            try:
                view = self._view()
                if view is None and not stop.is_set() and self._token == token:
                    if time.monotonic() - last_ok >= self.duration - self.heartbeat:
                        # Silent past what peers wait (frozen, cut off): one may have taken the
                        # lease over and released it since. Lost, never taken back.
                        return self._report_lost("marker missing after this pod could not beat for a lease")
                    # Removed by someone else (issue 40): written again with our token, unless a
                    # contender's marker took the name meanwhile (then it holds the lease).
                    view = self._recreate(token)
                if view is not None and view.record.token == token:
                    self._refresh()
                    last_ok = time.monotonic()
                    if self._on_beat is not None:
                        with contextlib.suppress(OSError):
                            self._on_beat()
                    continue
            except OSError as error:
                if time.monotonic() - last_ok < self.duration - self.heartbeat:
                    continue  # a transient error; the lease survives until it could expire
                return self._report_lost(f"refresh failed: {error}")
            return self._report_lost("marker missing" if view is None else "another pod holds it")
        return None

    def _recreate(self, token: str | None) -> MarkerView | None:
        """Our marker again, by the same exclusive create as the first; the marker now, whoever's."""
        assert token is not None
        if self._create(token):
            log.warning(
                "lease_marker_restored", marker=self.path.name, note="removed by someone else; written again"
            )
        return self._view()

    def _report_lost(self, reason: str) -> None:
        self._lost.set()
        if self._on_lost is not None:
            self._on_lost(reason)
