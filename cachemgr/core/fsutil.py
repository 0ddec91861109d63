"""Small filesystem helpers with the durability shared volumes need.

On NFS, CephFS and JuiceFS a rename is atomic and visible to every client, but data written
before it is not durable until fsynced: a node crash between write and rename could publish
a torn file. Every helper here fsyncs what it writes and the directory it renames into.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import xxhash

from cachemgr.core import safefs, safewalk

# 256 KiB reads: the buffer stays in the CPU cache between the read and the hash, which is what
# keeps a full check near `cat`'s speed (bench/bench_verify.py: 8 MiB reads ran at 37-72% of cat).
_READ_CHUNK = 256 << 10
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC (volume full) or EDQUOT (quota exceeded), however deep in the cause chain."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in DISK_FULL_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


NAME_MAX = 255  # bytes in one file name (Linux, and every filesystem a PVC is)


def fit_name(head: str, body: str, tail: str = "", *, room: int = 0, keep_end: bool = False) -> str:
    """``head + body + tail`` within NAME_MAX bytes, ``room`` bytes left for a sibling's suffix
    (``.reason.json``): ``body`` is cut, at its end (or its start, ``keep_end``), never inside a
    character. A name read from the volume may use all 255 bytes already."""
    fits = NAME_MAX - room - len(head.encode()) - len(tail.encode())
    raw = body.encode("utf-8", "surrogateescape")
    if len(raw) <= fits:
        return head + body + tail  # as read, undecodable bytes and all
    raw = raw[-fits:] if keep_end else raw[:fits]
    return head + raw.decode("utf-8", "ignore") + tail  # no character cut in two


def random_suffix(nbytes: int) -> str:
    """A random suffix for private names (os.urandom: secrets pulls in hashlib, ~10 ms at start-up)."""
    return os.urandom(nbytes).hex()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new name in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _fsync_fd(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: Path, data: bytes, *, dir_fd: int | None = None) -> None:
    """Create a new file with ``data``, fsync it, and close: ENOSPC surfaces here, not later.

    The file must not exist: ``O_EXCL|O_NOFOLLOW`` never writes through a name someone planted
    (a symlink to a file outside the volume), and never truncates another writer's file.
    """
    fd = os.open(
        path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd
    )
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def atomic_write_json(path: Path, obj: Any, *, within: Path | None = None) -> None:
    """Replace ``path`` with JSON atomically: readers see the old or the new file, never half.

    The new bytes go to a temporary name nobody can guess (created with ``O_EXCL|O_NOFOLLOW``,
    so a planted symlink is never written through), renamed over ``path`` inside the parent
    directory opened once: with ``within`` (the cache root) that directory is reached from the
    root one level at a time (:func:`cachemgr.core.safefs.open_dir`), else only its last component
    is refused as a symlink (pod-local paths).
    """
    with _parent_dir(path, within=within) as parent:
        atomic_write_json_at(parent, path.name, obj)


def atomic_write_json_at(parent: int, name: str, obj: Any) -> None:
    """:func:`atomic_write_json` into the directory open as ``parent`` (already reached safely)."""
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    tmp = fit_name(".", name, f".{random_suffix(8)}.tmp")  # within NAME_MAX, however long the name
    try:
        write_bytes_durably(Path(tmp), data, dir_fd=parent)
        os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=parent)
        raise
    _fsync_fd(parent)


@contextlib.contextmanager
def _parent_dir(path: Path, *, within: Path | None) -> Iterator[int]:
    if within is not None:
        with safefs.open_dir(within, path.parent) as fd:
            yield fd
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


class Hasher(Protocol):
    """A second digest fed from the same reads (``blake3.blake3``, ``hashlib.sha256``)."""

    def update(self, data: memoryview, /) -> object: ...


def hash_file(path: Path, *, also: Hasher | None = None) -> str:
    """xxh3-128 of a file's bytes (and ``also`` fed the same bytes, in the same pass)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return hash_fd(fd, also=also)
    finally:
        os.close(fd)


def hash_fd(fd: int, *, also: Hasher | None = None) -> str:
    """xxh3-128 of what remains to read from ``fd``, read in chunks into one reused buffer;
    ``also`` (a signed publish's BLAKE3) is fed each chunk too: one read of the file for both."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(_READ_CHUNK)
    view = memoryview(buffer)
    with contextlib.suppress(OSError, AttributeError):  # advice only: larger readahead
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    while count := os.readv(fd, (buffer,)):
        digest.update(view[:count])
        if also is not None:
            also.update(view[:count])
    return digest.hexdigest()


def walk_files(root: Path, *, within: Path | None = None) -> Iterator[tuple[str, os.stat_result]]:
    """Every regular file under ``root`` as (posix relative path, lstat), sorted, no symlinks followed.

    ``within`` (the cache root) makes every level above ``root`` refuse symlinks too
    (:mod:`cachemgr.core.safefs`); below ``root`` nothing is ever followed.
    """
    found: list[tuple[str, os.stat_result]] = []
    with safefs.open_tree(root, within=within) as fd:
        for rel, entry, _ in safewalk.walk(fd):
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                found.append((rel, st))
    yield from sorted(found, key=lambda item: item[0])


def walk_names(root: Path, *, within: Path | None = None) -> list[str]:
    """Every non-directory under ``root`` (posix relative paths), from the listings alone.

    No stat per file (the directory entries' types say what is a directory), so on a network
    filesystem it costs one round trip per directory rather than one per file.
    """
    with safefs.open_tree(root, within=within) as fd:
        return sorted(rel for rel, entry, _ in safewalk.walk(fd) if not entry.is_dir(follow_symlinks=False))


def tree_bytes(root: Path, *, within: Path | None = None) -> int:
    """Apparent size of every regular file under ``root``; 0 if it vanished meanwhile."""
    total = 0
    try:
        with safefs.open_tree(root, within=within) as fd:
            for _, entry, _ in safewalk.walk(fd):
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    except (FileNotFoundError, safefs.UnsafePathError):
        return total
    return total


def fsync_tree(root: Path, *, within: Path | None = None) -> None:
    """fsync every file and directory under ``root``, so a rename publishes durable data."""
    with safefs.open_tree(root, within=within) as top:
        for _, entry, parent in safewalk.walk(top):
            if entry.is_file(follow_symlinks=False) or entry.is_dir(follow_symlinks=False):
                # Never a symlink or a FIFO (it would block): nothing of ours to make durable.
                with _opened(parent, entry.name) as fd:
                    _fsync_fd(fd)
        _fsync_fd(top)


@contextlib.contextmanager
def _opened(parent: int, name: str) -> Iterator[int]:
    """``name`` in directory ``parent``, opened for reading; a symlink is refused (ELOOP)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
    try:
        yield fd
    finally:
        os.close(fd)


def _fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as error:
        # Some FUSE filesystems refuse fsync on directories; their renames are synchronous.
        if error.errno not in {errno.EINVAL, errno.ENOTSUP, errno.EBADF}:
            raise


def make_read_only(root: Path, *, within: Path | None = None) -> None:
    """Files of a published entry become 0444 and the directories below it 0555.

    A server writing through a view (``open(path, "r+b")``) then fails with EACCES instead of
    changing the shared bytes, and nothing can be added, renamed or removed inside. ``root``
    itself stays writable by its owner: moving a directory to another parent (quarantine,
    prune's move to trash) needs write access to the directory itself, for its "..". The owner
    can chmod back, and root ignores modes: the manifest's size and mtime catch what they can.
    Each mode is set on what was opened (``fchmod``), never on what a swapped-in link names.
    """
    try:
        with safefs.open_tree(root, within=within) as top:
            for _, entry, parent in safewalk.walk(top):
                mode = 0o444 if entry.is_file(follow_symlinks=False) else 0o555
                if entry.is_file(follow_symlinks=False) or entry.is_dir(follow_symlinks=False):
                    # A directory is entered after it is yielded: 0555 still lets the walk read it.
                    with contextlib.suppress(FileNotFoundError), _opened(parent, entry.name) as fd:
                        os.fchmod(fd, mode)
    except FileNotFoundError:
        # A prune took the new entry away (no pod used it yet): nothing left to protect.
        return


def remove_tree(path: Path, *, within: Path | None = None) -> None:
    """Remove a directory tree (or a file or symlink), even one with read-only files; missing is fine.

    Never follows a symlink below ``path``; with ``within`` (the cache root) none above it
    either (:func:`cachemgr.core.safewalk.remove`). Without it, ``path``'s parents are a pod-local
    path and trusted as given.
    """
    if within is not None:
        safewalk.remove(within, path)
        return
    try:
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        safewalk.remove_at(parent, path.name, shown=path)
    finally:
        os.close(parent)


def refresh_at(parent: int, name: str) -> bool:
    """Refresh the mtime of the record ``name`` in the directory open as ``parent`` (which the
    caller reached safely: a folder swapped for a link since then is not followed, the descriptor
    is the folder); False if it is missing. A link planted as the file is touched, never its
    target. A hard link planted as the file (a regular file with other names: on one filesystem
    with the root, those may lie outside it) is removed, never touched (its times are the other
    names' too), and reported missing. Other errors propagate."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            os.unlink(name, dir_fd=parent)
            return False
        os.utime(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def touch_at(parent: int, name: str) -> None:
    """Refresh a heartbeat file's mtime as :func:`refresh_at` does, creating it (empty, our own)
    where it is missing or was a hard link."""
    if refresh_at(parent, name):
        return
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    os.close(os.open(name, flags, 0o644, dir_fd=parent))


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding path (``fuse.seaweedfs``, ``nfs4``...), from mountinfo."""
    target = os.path.realpath(path)
    best: tuple[int, str] | None = None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as mounts:
            for line in mounts:
                before, _, after = line.partition(" - ")
                fields = before.split()
                if len(fields) < 5 or not after:
                    continue
                point = fields[4].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and (best is None or len(point) >= best[0]):
                    best = (len(point), after.split()[0])
    except OSError:
        return None
    return best[1] if best else None


def age_seconds(path: Path, *, now: float | None = None) -> float | None:
    """Seconds since ``path`` last changed by this node's clock; None if it is gone."""
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    return max(0.0, (time.time() if now is None else now) - mtime)
