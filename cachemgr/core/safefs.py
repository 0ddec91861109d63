"""Walking, listing, moving and removing under the cache root without ever leaving it.

The volume is untrusted ground (docs/design.md, principle 6): any pod, Job or person in ``kubectl
exec`` can replace ``quarantine/`` or ``staging/<digest>`` by a symlink to the pod's model
weights, and a path-based ``shutil.rmtree(root / "quarantine" / name)`` then deletes them: the
kernel follows a symlink at any level of a path, and ``O_NOFOLLOW`` guards only the last one.
(``shutil.rmtree`` itself refuses a symlink at the top and unlinks, never follows, the ones it
meets inside; the hole is the path leading to it.)

So everything here goes ``openat``-style: the root is opened once (the operator's path, trusted
as given), and every level below it is opened relative to its parent with
``O_NOFOLLOW | O_DIRECTORY`` and checked to be on the root's filesystem (``st_dev``). A level
that is a symlink, not a directory, or another filesystem stops the operation with an
:class:`UnsafePathError` naming the path and the remedy (exit 74). Removal, renames and walks
then work on the directory descriptors, so a symlink swapped in after a check cannot redirect
them either. Walking and removing a whole tree below these levels: :mod:`cachemgr.core.safewalk`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import resource
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from cachemgr.core.errors import VolumeError

# O_NOFOLLOW|O_DIRECTORY: a symlink fails with ELOOP, a file or FIFO with ENOTDIR, never blocking.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
REFUSED = frozenset({errno.ELOOP, errno.ENOTDIR, errno.EMLINK})
_TARGET_SHOWN = 200


class UnsafePathError(VolumeError):
    """A directory of the layout is a symlink, not a directory, or on another filesystem."""


def describe(st: os.stat_result) -> str:
    """What a non-directory is, in an operator's words."""
    mode = st.st_mode
    for test, what in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return what
    return "not a regular file or directory"


def unsafe_error(shown: Path, parent_fd: int | None, name: str) -> UnsafePathError:
    """The one-line refusal for ``shown`` (``name`` in ``parent_fd``), saying what it is instead."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError:
        what = "not a directory"
    else:
        what = describe(st)
        if stat.S_ISLNK(st.st_mode):
            with contextlib.suppress(OSError):
                target = os.readlink(name, dir_fd=parent_fd)
                what += f" (to {target[:_TARGET_SHOWN]!r})"
    noun = "symlink" if what.startswith("a symbolic link") else "file"
    return UnsafePathError(
        f"{shown} is {what}, not a directory of the cache volume; cachemgr never follows or "
        "removes anything through it",
        remedy=f"remove the {noun} {shown} (rm {shown}); cachemgr recreates the directory",
        path=str(shown),
    )


def other_filesystem_error(shown: Path) -> UnsafePathError:
    return UnsafePathError(
        f"{shown} is on another filesystem than the cache root (a mount inside the layout)",
        remedy=f"unmount {shown}: the cache layout must live on the cache volume itself",
        path=str(shown),
    )


def open_below(parent_fd: int, name: str, *, dev: int, shown: Path) -> int:
    """Open directory ``name`` of ``parent_fd`` without following a symlink, on device ``dev``."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as error:
        if error.errno in REFUSED:
            raise unsafe_error(shown, parent_fd, name) from None
        # The whole path, not the level's name alone: an error line must say where (a folder
        # moved away by a writer of the volume, between two steps, names itself).
        raise type(error)(error.errno, error.strerror, str(shown)) from None
    if os.fstat(fd).st_dev != dev:
        os.close(fd)
        raise other_filesystem_error(shown)
    return fd


def _parts(root: Path, path: Path) -> tuple[str, ...]:
    parts = path.relative_to(root).parts
    if any(part in {"..", "."} for part in parts):
        raise ValueError(f"{path} is not a plain path under {root}")
    return parts


@contextlib.contextmanager
def open_dir(root: Path, path: Path, *, create: bool = False) -> Iterator[int]:
    """A descriptor of directory ``path`` under ``root``, reached one level at a time.

    ``FileNotFoundError`` if a level is missing (``create``: made instead, ``mkdir -p``);
    :class:`UnsafePathError` if one is a symlink, not a directory, or on another filesystem.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        dev = os.fstat(fd).st_dev
        shown = root
        for part in _parts(root, path):
            shown = shown / part
            if create:
                try:
                    os.mkdir(part, dir_fd=fd)
                except FileExistsError:
                    pass
                except OSError as error:  # the whole path: a refusal (EACCES) must say where
                    raise type(error)(error.errno, error.strerror, str(shown)) from None
            child = open_below(fd, part, dev=dev, shown=shown)
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def pinned(root: Path, path: Path) -> Iterator[Path]:
    """Folder ``path`` under ``root`` by a path no writer of the volume can redirect, while the
    block runs: ``/proc/<pid>/fd/<n>``, this process's descriptor of it, reached one level at a
    time from the root (:func:`open_dir`).

    A compiler or a server is handed a path and resolves it itself: a writer who swaps one of
    its folders (``staging/<digest>``) for a symlink after cachemgr checked it would have it
    write wherever the link points, outside the root. The kernel resolves this path to the
    folder itself, wherever it has been moved, for this process's children and theirs (a
    server's own workers) as long as the block runs. Without ``/proc``, the plain path.

    After the block the kernel resolves the path to whatever this process then holds as that
    number: a process the compile left behind (a compiler's detached helper) that still writes
    under it would write into the next folder opened (the root, at publish; the entry the server
    is handed, pinned the same way). So the descriptor sits at a number far above any this
    process otherwise holds, and each pin of the process at a number of its own
    (:func:`_out_of_the_way`): such a straggler finds the path gone, as it would the attempt's
    plain path once published.
    """
    proc = Path(f"/proc/{os.getpid()}/fd")
    if not proc.is_dir():
        yield path
        return
    with open_dir(root, path) as fd:
        high = _out_of_the_way(fd)
        try:
            yield proc / str(high)
        finally:
            if high != fd:
                os.close(high)


# The lowest descriptor number a pin takes (half the open-file limit, if lower): a new
# descriptor takes the lowest free number, so this one is reused only by a process holding
# that many at once; cachemgr holds tens. Each pin of a process starts one number above the
# last (_PINS): a path handed out once never names a later pin's folder.
_PIN_FD_FLOOR = 4096
_PINS = itertools.count()


def _out_of_the_way(fd: int) -> int:
    """A duplicate of ``fd`` at a number nothing else in this process takes, and no earlier pin
    took; ``fd`` if none."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = 1 << 20 if soft == resource.RLIM_INFINITY else soft
    floor = min(_PIN_FD_FLOOR, limit // 2) + next(_PINS)
    if floor <= fd or floor >= limit:
        return fd
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor)
    except OSError:  # no free number there (EMFILE): the plain descriptor
        return fd


def check_dir(root: Path, path: Path) -> bool:
    """True if ``path`` is a real directory of the volume, False if missing; refuses the rest."""
    try:
        with open_dir(root, path):
            return True
    except FileNotFoundError:
        return False


def check_children(root: Path, names: Iterable[str]) -> None:
    """``check_dir`` for directories right under ``root``, with one open of the root."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        dev = os.fstat(fd).st_dev
        for name in names:
            try:
                os.close(open_below(fd, name, dev=dev, shown=root / name))
            except FileNotFoundError:
                continue
    finally:
        os.close(fd)


def listdir(root: Path, path: Path) -> list[str]:
    """Names in directory ``path`` under ``root``, sorted; [] if it is missing."""
    try:
        with open_dir(root, path) as fd:
            return sorted(os.listdir(fd))
    except FileNotFoundError:
        return []


def subdirs(root: Path, path: Path) -> list[str]:
    """Names of the real directories (never symlinks) in ``path`` under ``root``, sorted."""
    try:
        with open_dir(root, path) as fd, os.scandir(fd) as found:
            return sorted(e.name for e in found if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []


def lstat(root: Path, path: Path) -> os.stat_result | None:
    """``lstat`` of ``path`` under ``root`` (its parents reached safely); None if missing."""
    try:
        with open_dir(root, path.parent) as fd:
            return os.stat(path.name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def make_dirs(root: Path, path: Path) -> None:
    """``mkdir -p`` under ``root``, refusing a level that is a symlink or not a directory."""
    with open_dir(root, path, create=True):
        pass


def rename(root: Path, source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` (both under ``root``) from safely opened parents.

    A rename never follows its own last components, so a symlink there moves as a link.
    """
    with open_dir(root, source.parent) as src_fd, open_dir(root, target.parent) as dst_fd:
        try:
            os.rename(source.name, target.name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        except OSError as error:  # the whole paths, not two names: the error line must say where
            raise type(error)(error.errno, error.strerror, str(source), None, str(target)) from None


def unlink(root: Path, path: Path) -> None:
    """Remove a file or symlink under ``root``; missing (also a missing parent) is fine."""
    try:
        with open_dir(root, path.parent) as fd:
            unlink_at(fd, path.name)
    except FileNotFoundError:
        return


def rmdir(root: Path, path: Path) -> None:
    """Remove an empty directory under ``root`` (``OSError`` if it is not empty)."""
    with open_dir(root, path.parent) as fd:
        os.rmdir(path.name, dir_fd=fd)


def unlink_at(fd: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        retry_in(fd, lambda: os.unlink(name, dir_fd=fd))


def retry_in(fd: int, action: Callable[[], None]) -> None:
    """Run ``action`` (an unlink or rmdir in directory ``fd``); once more after making the
    directory writable: a published entry's directories may be read-only (0555), which refuses
    removals inside them even to their owner."""
    try:
        action()
    except PermissionError:
        # Our own directory, being emptied anyway; another user's cannot be made writable
        # (EPERM): then the action's own refusal (EACCES) is what the caller gets.
        with contextlib.suppress(PermissionError):
            os.fchmod(fd, 0o755)
        action()


@contextlib.contextmanager
def open_tree(path: Path, *, within: Path | None) -> Iterator[int]:
    """``path`` opened for a walk: reached safely from ``within`` (the cache root) when given,
    else with only its last component refused as a symlink (a pod-local path)."""
    if within is not None:
        with open_dir(within, path) as fd:
            yield fd
        return
    try:
        fd = os.open(path, DIR_FLAGS)
    except OSError as error:
        if error.errno in REFUSED:
            raise unsafe_error(path, None, os.fspath(path)) from None
        raise
    try:
        yield fd
    finally:
        os.close(fd)


def is_plain(st: os.stat_result) -> bool:
    """A regular file or a real directory: all a published entry may hold (principle 6)."""
    return stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)
