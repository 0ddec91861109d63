"""Bookkeeping kept beside entries, never inside them: who uses an entry, and failed compiles.

A published entry is immutable, so its users and its last use are recorded under
``usage/<digest>/``: one file per running pod, refreshed by a heartbeat and removed on exit,
and a ``last-used`` file touched at each start. Failed compiles are recorded under
``failures/<digest>/`` for inspection and never replayed (cachemgr.volume.failure_records).

Whether a use record belongs to a live pod (docs/design.md principle 6: no decision depends on
clocks agreeing across nodes). A record's mtime is set by whoever wrote it last, and that
clock is not ours: on a local disk and NFS (``utime(NULL)`` is SET_TO_SERVER_TIME) it is the
kernel's or the server's, but on JuiceFS and CephFS it is the writing client's: for a
``utime(NULL)`` FUSE sends MTIME_NOW and JuiceFS's client sets ``cur.Mtime = now`` from its own
``time.Now()`` (juicedata/juicefs pkg/meta/redis.go and tkv.go, ``SetAttr``). So
"now minus mtime" on a node whose clock is ten minutes ahead makes every live record look ten
minutes old, and a probe file touched on the volume would only move the problem (on JuiceFS
the probe gets *our* client's clock, not the writer's). What no clock can fake is change:
the heartbeat rewrites the record's mtime every ``HEARTBEAT_SECONDS``, and an observer that
sees the (inode, mtime, size) of a record differ from one look to the next, by its own
monotonic clock, has seen its pod alive. Hence three verdicts:

* fresh: within ``IN_USE_WINDOW`` of this node's clock, either way. Kept as in use without
  looking twice. Skew can only make a dead record look fresh (our clock behind theirs), and
  then its use expires that much later: the cost of skew is a late expiry, never a removal.
* silent: older than the window, or further ahead in the future. Alive or dead is then told
  only by ``observe``: a record that does not change for ``OBSERVE_SECONDS`` on our monotonic
  clock (three beats and the JuiceFS attribute cache) is a dead pod's.
* gone: removed, its pod stopped using the entry.

A dead pod's use therefore still expires (after the window, plus the skew if our clock is
behind), while skew of any size in either direction never turns a live record into a dead
one: removal needs a record seen silent *and* unchanged by our own clock. The cost: ``ls``
and ``du`` never wait (they show silent records apart); ``prune`` waits up to
``OBSERVE_SECONDS`` once, for all silent records of the entries it would remove together,
and only when there are any (a pod killed without cleanup, or a node whose clock is off by
more than the window); live records end the wait at their next beat. A record that is gone
is not trusted at once either: its pod writes it again at its next beat if it lives
(cachemgr.volume.heartbeat), so ``prune`` removes no entry until ``OBSERVE_SECONDS`` after its
plan looked (cachemgr.ops.prune), and that wait includes the one above. A running pod pays one
``utime`` on the volume per record every ``HEARTBEAT_SECONDS``, plus one walk from the root to
each record's folder (never a path: a folder swapped for a symlink is not followed).

``prune`` also keeps what it saw (``Usage.seen``): between its plan and each removal it
compares the usage folder with that, not with a clock, so a pod that registers meanwhile,
whatever its clock, stops the removal.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

from cachemgr.core import coerce, jsonread, safefs
from cachemgr.core.fsutil import atomic_write_json_at, fit_name, touch_at

# Re-exported (the "as" form is mypy's explicit re-export): the heartbeat moved out of this
# module, and cachemgr.remote.hooks and cachemgr.ops.progress still import them from here.
from cachemgr.volume.heartbeat import HEARTBEAT_SECONDS as HEARTBEAT_SECONDS  # noqa: PLC0414
from cachemgr.volume.heartbeat import Heartbeat as Heartbeat  # noqa: PLC0414
from cachemgr.volume.identity import PodIdentity

if TYPE_CHECKING:
    from cachemgr.volume.layout import CacheRoot

# A use record within this of this node's clock is taken as live without looking twice.
IN_USE_WINDOW = 120.0
# How long prune watches a silent record for a beat: three beats, plus JuiceFS's default 1 s
# attribute cache, plus a margin for a heartbeat thread delayed by a busy node.
OBSERVE_SECONDS = 3 * HEARTBEAT_SECONDS + 2.0
_OBSERVE_POLL = 0.25


# --- usage ---------------------------------------------------------------------------------


# (inode, mtime in ns, size): what changes at each heartbeat (utime) or re-registration (rename).
Mark = tuple[int, int, int]


class User:
    """A pod using an entry, as recorded on the volume.

    Equal by who and when (pod, node, since, age, silent): the record's path, mark and how the
    start got the entry are not compared. A plain class (this module is on the hit path, which
    makes no dataclass: docs/benchmarks.md, "The hit path without dataclasses").
    """

    __slots__ = ("age", "mark", "node", "path", "pod", "silent", "since", "start", "waited_s")

    def __init__(  # noqa: PLR0917 -- read_usage builds it positionally, from a record
        self,
        pod: str,
        node: str,
        since: float,
        age: float,  # by this node's clock: only a hint, skew shifts it
        # Older than the in-use window by this node's clock, or from its future: alive only if
        # ``observe`` sees it beat (see the module docstring).
        silent: bool = False,
        path: str = "",
        mark: Mark | None = None,
        start: str = "other",  # how this start got the entry (STARTS)
        waited_s: float = 0.0,
    ) -> None:
        self.pod = pod
        self.node = node
        self.since = since
        self.age = age
        self.silent = silent
        self.path = path
        self.mark = mark
        self.start = start
        self.waited_s = waited_s

    def _compared(self) -> tuple[str, str, float, float, bool]:
        return (self.pod, self.node, self.since, self.age, self.silent)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, User)
        return self._compared() == other._compared()

    def __hash__(self) -> int:
        return hash(self._compared())

    def __repr__(self) -> str:
        return (
            f"User(pod={self.pod!r}, node={self.node!r}, since={self.since!r}, age={self.age!r}, "
            f"silent={self.silent!r}, start={self.start!r}, waited_s={self.waited_s!r})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "pod": self.pod,
            "node": self.node,
            "since": self.since,
            "age": self.age,
            "silent": self.silent,
        }


# usage/<digest>/recompiled-on-hit.<pod>.<pid>: a hit whose server compiled anyway (cachemgr.volume.drift).
# Not ".json", so never read as a use record; prune removes them with the entry's usage folder.
RECOMPILED_PREFIX = "recompiled-on-hit."
# usage/<digest>/ended.<start>.<stamp>.<pod>.<pid>: the use record of a pod start that has ended,
# renamed (not removed) when the pod stopped using the entry. Not ".json", so never a user; the
# history `cachemgr stats` counts: one per start, with no write on the hit path (the record is
# the one every start writes anyway, and the rename replaces the unlink at exit).
ENDED_PREFIX = "ended."
# How a start got its entry, as its use record says: found it, waited for a peer's compile,
# compiled it itself, or downloaded it from the remote tier. Anything else (a record of an older cachemgr) counts as a start, not a hit.
STARTS = ("hit", "waited", "compiled", "fetched")
_RECORD_MAX = 64 * 1024  # a use record is a few hundred bytes


class Usage(NamedTuple):
    """One read of ``usage/<digest>/``: live and silent users, and what was seen, to compare later."""

    live: tuple[User, ...] = ()
    silent: tuple[User, ...] = ()
    # (name, mark) of each record, with "." for the folder itself: equal to a later read
    # exactly when nobody registered, beat or left in between.
    seen: frozenset[tuple[str, Mark]] = frozenset()
    last: float | None = None  # the latest mtime there: when a pod last started, beat or left
    recompiled_on_hit: int = 0  # records of hits that saw the server compile anyway (cachemgr.volume.drift)
    # Pod starts by how they got the entry (STARTS; "other" for a record that does not say):
    # the ended ones by name, the live and silent ones from the records read anyway.
    starts: Mapping[str, int] = MappingProxyType({})
    # Names of ended starts that waited for a peer (their records say how long: stats reads them).
    waited: tuple[str, ...] = ()
    # Pre-ready server exits on a hit, per published copy of the key (cachemgr.volume.serverfail).
    server_failed: Mapping[str, int] = MappingProxyType({})

    @property
    def records(self) -> frozenset[tuple[str, Mark]]:
        """What ``seen`` holds of the use records alone."""
        return frozenset(item for item in self.seen if item[0] != ".")


class UseNotRecordedError(OSError):
    """The use record's content could not be written (the errno says why: ENOSPC, EROFS, EACCES).

    ``placeholder``: the empty record that stands for it meanwhile (named, beating: prune counts
    it as a user), or None if the volume refused even that.
    """

    def __init__(self, error: OSError, placeholder: Path | None) -> None:
        super().__init__(error.errno, error.strerror or str(error), error.filename)
        self.placeholder = placeholder


def register_use(
    root: CacheRoot,
    digest: str,
    identity: PodIdentity,
    *,
    entry: str,
    start: str = "hit",
    saved_s: float | None = None,
    waited_s: float | None = None,
    since: float | None = None,
) -> Path:
    """Record that this pod uses the entry now (before it is checked, so prune sees us first).

    ``start``: how this start got the entry (STARTS); ``saved_s``: the compile time it did not
    spend; ``waited_s``: how long it waited for a peer's compile; ``since``: when the use began
    (a retry keeps the first attempt's). In the one record a start writes anyway: ``cachemgr
    stats`` counts from it, the hit path pays nothing more.

    When the content does not fit, the record is made by name alone: on a full volume an empty
    file still fits (an inode and a directory entry, no data block: tried on tmpfs, ext4 and
    JuiceFS over its quota) and ``utime`` needs no space, so the pod's use shows and beats while
    its content cannot be written; the caller retries (:class:`UseNotRecordedError`), and a
    retry that succeeds replaces the empty record. A hit that fits pays one write, as before.
    """
    folder = root.usage / digest
    record = {**identity.to_json(), "entry": entry, "since": since or time.time(), "start": start}
    if saved_s is not None:
        record["saved_s"] = round(saved_s, 3)
    if waited_s is not None:
        record["waited_s"] = round(waited_s, 3)
    # Reached once from the root (a symlink planted as usage/<digest> is refused, not written
    # through); the record and the last-used mark are written from that descriptor.
    try:
        with safefs.open_dir(root.path, folder, create=True) as fd:
            try:
                atomic_write_json_at(fd, identity.record_name, record)
            except OSError as error:
                raise UseNotRecordedError(error, _placeholder(fd, folder / identity.record_name)) from error
            finally:
                with contextlib.suppress(OSError):
                    touch_at(fd, "last-used")
    except (safefs.UnsafePathError, UseNotRecordedError):
        raise
    except OSError as error:  # usage/<digest> could not be made (a new folder needs a block on ext4)
        raise UseNotRecordedError(error, None) from error
    return folder / identity.record_name


def _placeholder(fd: int, record: Path) -> Path | None:
    """The use record by name alone, empty (or as it was), with a fresh mtime; None if even that fails."""
    try:
        touch_at(fd, record.name)
    except OSError:
        # Not even an empty file (no inode left): the folder's mtime is the entry's last use
        # (Usage.last), so a fresh one keeps --unused-for off it until a retry succeeds.
        with contextlib.suppress(OSError):
            os.utime(fd)
        return None
    return record


def release_use(record: Path | None, *, ended: str | None = None) -> None:
    """End this pod's use (``ROOT/usage/<digest>/<name>``, as :func:`register_use` made it).

    With ``ended`` (the start's kind) the record is renamed into the entry's history
    (``ENDED_PREFIX``), else removed. Reached from the root one level at a time: if
    ``usage/<digest>`` was swapped for a symlink since registration, nothing in the link's target
    is renamed or removed. A pod that is leaving does not fail for that: the record it could not
    move stops beating, and prune expires it.
    """
    if record is None:
        return
    with contextlib.suppress(OSError):
        if ended is None:
            safefs.unlink(record.parents[2], record)
            return
        with safefs.open_dir(record.parents[2], record.parent) as folder:
            os.rename(record.name, ended_name(ended, record.name), src_dir_fd=folder, dst_dir_fd=folder)


def ended_name(start: str, record_name: str) -> str:
    """``ended.<start>.<stamp>.<pod>.<pid>``: unique per start, within a file name's 255 bytes."""
    kind = start if start in STARTS else "other"
    stem = record_name.removesuffix(".json")
    return fit_name(f"{ENDED_PREFIX}{kind}.{time.time_ns():x}.", stem, keep_end=True)


def start_of(name: str) -> str | None:
    """The kind of an ended start from its history name (None: not one)."""
    if not name.startswith(ENDED_PREFIX):
        return None
    kind = name[len(ENDED_PREFIX) :].split(".", 1)[0]
    return kind if kind in STARTS else "other"


def read_usage(
    root: CacheRoot,
    digest: str,
    *,
    usage_fd: int | None = None,
    now: float | None = None,
    window: float = IN_USE_WINDOW,
) -> Usage:
    """The use records in ``usage/<digest>``, judged fresh or silent.

    The folder is opened one level at a time without following a link (from ``usage_fd``, the
    open ``usage/``, when a scan has it): a symlink or a file planted as ``usage/<digest>`` is
    refused (exit 74), never read through, and never taken for "nobody uses it".
    """
    shown = root.usage / digest
    try:
        if usage_fd is None:
            with safefs.open_dir(root.path, shown) as folder:
                return _read_usage(folder, os.fspath(shown), now=now, window=window)
        folder = safefs.open_below(usage_fd, digest, dev=os.fstat(usage_fd).st_dev, shown=shown)
        try:
            return _read_usage(folder, os.fspath(shown), now=now, window=window)
        finally:
            os.close(folder)
    except FileNotFoundError:
        return Usage()


def _read_usage(folder_fd: int, folder: str, *, now: float | None, window: float) -> Usage:
    names = os.listdir(folder_fd)
    st = os.fstat(folder_fd)
    now = time.time() if now is None else now
    seen: set[tuple[str, Mark]] = {(".", _mark_of(st))}
    live: list[User] = []
    silent: list[User] = []
    last = st.st_mtime
    recompiled = sum(1 for name in names if name.startswith(RECOMPILED_PREFIX))
    starts: dict[str, int] = {}
    waited: list[str] = []
    for name in names:
        kind = start_of(name)
        if kind is not None:
            starts[kind] = starts.get(kind, 0) + 1
            if kind == "waited":
                waited.append(name)
    for name in sorted(names):
        if name.startswith(".") or not name.endswith(".json"):
            # A record being written (tmp file, then rename) shows in the folder's mtime; so
            # does a pod that came and went. ``last-used`` adds nothing to those.
            continue
        path = f"{folder}/{name}"
        mark = record_mark(path)
        if mark is None:
            continue
        seen.add((name, mark))
        last = max(last, mark[1] / 1e9)
        user = _user(path, name, mark, now - mark[1] / 1e9, window)
        (silent if user.silent else live).append(user)
        starts[user.start] = starts.get(user.start, 0) + 1
    from cachemgr.volume.serverfail import counts_by_instance  # readers only, not a pod's hit

    failed = counts_by_instance(names)
    return Usage(tuple(live), tuple(silent), frozenset(seen), last, recompiled, starts, tuple(waited), failed)


def _user(path: str, name: str, mark: Mark, age: float, window: float) -> User:
    silent = not -window <= age <= window
    data: Any = None
    # An empty record is a pod whose content did not fit yet (register_use); one far larger than
    # any cachemgr writes was planted, and is not read into memory: both are users all the same.
    if 0 < mark[2] <= _RECORD_MAX:
        with contextlib.suppress(OSError, ValueError):
            data = jsonread.read(path)
    if not isinstance(data, dict):
        # Unreadable (half-written, damaged): someone may be there; prune must not guess.
        return User(name.removesuffix(".json"), "", 0.0, age, silent, path, mark)
    since, waited = _number(data.get("since")), _number(data.get("waited_s"))
    start = data.get("start") if data.get("start") in STARTS else "other"
    return User(
        coerce.text(data.get("pod")),
        coerce.text(data.get("node")),
        since,
        age,
        silent,
        path,
        mark,
        str(start),
        waited,
    )


def _number(value: Any) -> float:
    try:
        number = float(value or 0)
    except (TypeError, ValueError):
        return 0.0
    return number if 0 <= number < 1e12 else 0.0  # nan, inf and garbage from the volume: nothing


def record_mark(path: str) -> Mark | None:
    """The record as the volume has it now; None if it is gone.

    Opened, not only stat'ed: NFS revalidates attributes on open (close-to-open consistency),
    where a bare stat may answer from an attribute cache up to a minute old.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ENAMETOOLONG:  # a record named past NAME_MAX (its attempt's name is)
            return None
        # Unreadable to us (mode, a symlink planted there): its own attributes still tell change.
        try:
            return _mark_of(os.lstat(path))
        except FileNotFoundError:
            return None
    try:
        return _mark_of(os.fstat(fd))
    finally:
        os.close(fd)


def _mark_of(st: os.stat_result) -> Mark:
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def observe(silent: Iterable[User], *, seconds: float = OBSERVE_SECONDS) -> frozenset[str]:
    """Watch silent records for a beat; returns the paths of those seen alive.

    A record whose mark changes is alive (its pod beat or registered again); one that vanishes
    is not (its pod left); one unchanged for ``seconds`` of this node's monotonic clock is a
    dead pod's. Ends as soon as every record has been told, so live ones cost one beat.
    """
    return observe_marks({user.path: user.mark for user in silent if user.path}, seconds=seconds)


def observe_marks(marks: Mapping[str, Mark | None], *, seconds: float = OBSERVE_SECONDS) -> frozenset[str]:
    """``observe`` for any heartbeat files (a staging attempt's owner record): path -> mark seen."""
    pending = dict(marks)
    alive: set[str] = set()
    deadline = time.monotonic() + seconds
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(_OBSERVE_POLL, left))
        for path, mark in list(pending.items()):
            now = record_mark(path)
            if now == mark:
                continue
            del pending[path]
            if now is not None:
                alive.add(path)
    return frozenset(alive)


def users(
    root: CacheRoot, digest: str, *, window: float = IN_USE_WINDOW, now: float | None = None
) -> list[User]:
    """Pods whose use record is fresh by this node's clock (silent ones need ``observe``)."""
    return list(read_usage(root, digest, now=now, window=window).live)


def last_used(root: CacheRoot, digest: str) -> float | None:
    try:
        return (root.usage / digest / "last-used").stat().st_mtime
    except FileNotFoundError:
        return None
