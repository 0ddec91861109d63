"""Walking and removing trees under the cache root: a few descriptors whatever the depth.

The levels of the layout are reached by :mod:`cachemgr.core.safefs` (from the root, one level at a
time, never through a link); below them, an entry, an attempt or a quarantined entry is walked
(a survey, a size, a copy, a fsync, a chmod) and removed here. A descriptor per level (the obvious
walk, and ``os.walk``'s recursion) met a folder 1,100 levels deep under the usual container limit
of 1,024 open files with EMFILE: a pod, the builder, verify and prune all failed on one planted
chain (issue 33). So a walk holds the top and the folder it lists, and for a moment a child being
opened or listed; going back up, a folder is reopened as ``..`` of the one below and must be the
folder the walk left (device and inode); a folder moved meanwhile is reached again by name from
the top, each level checked the same way, or the walk stops with an UnsafePathError. Nothing
outside the root is entered: every level down is opened relative to its parent, ``O_NOFOLLOW``,
on the root's device.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from cachemgr.core.safefs import (
    DIR_FLAGS,
    REFUSED,
    UnsafePathError,
    open_below,
    open_dir,
    retry_in,
    unlink_at,
)


def remove(root: Path, path: Path) -> None:
    """Remove ``path`` under ``root``: a file or symlink is unlinked, a directory emptied first.

    Missing is fine. Nothing is followed at any level, nothing on another filesystem is touched.
    """
    try:
        with open_dir(root, path.parent) as fd:
            remove_at(fd, path.name, shown=path)
    except FileNotFoundError:
        return


def remove_at(parent_fd: int, name: str, *, shown: Path) -> None:
    """Remove ``name`` in ``parent_fd`` and, for a real directory, everything below it."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError as error:
        if error.errno == errno.ENAMETOOLONG:  # no file has that name (a record of a planted name's)
            return
        raise
    if not stat.S_ISDIR(st.st_mode):
        unlink_at(parent_fd, name)
        return
    top = open_below(parent_fd, name, dev=os.fstat(parent_fd).st_dev, shown=shown)
    try:
        _clear(top, shown=shown)
    finally:
        os.close(top)
    retry_in(parent_fd, lambda: os.rmdir(name, dir_fd=parent_fd))


def _clear(top: int, *, shown: Path) -> None:
    """Empty the directory open as ``top``: depth first, no recursion, a few descriptors whatever
    the depth (:class:`_Cursor`)."""
    with _Cursor(top, shown=shown) as cursor:
        while True:
            item = cursor.next()
            if item is None:
                if not cursor.depth:
                    return
                emptied = cursor.up()  # first: the descriptor is the parent's only after it
                _rmdir_in(cursor.fd, emptied)
                continue
            name, kind = item
            if kind != _DIR:
                unlink_at(cursor.fd, name)
                continue
            with contextlib.suppress(FileNotFoundError):  # a concurrent remover took it
                cursor.down(name, strict=True)


def _rmdir_in(parent: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        retry_in(parent, lambda: os.rmdir(name, dir_fd=parent))


_DIR, _FILE, _LINK, _OTHER = range(4)


class Found:
    """One item of a walk, as ``os.DirEntry`` shows it: its ``name``, its type as the listing
    gave it (never following a link), and its ``lstat`` by name from its folder's descriptor,
    which is open while the walk is at it (in the loop body that received it)."""

    __slots__ = ("_fd", "_kind", "_st", "name")

    def __init__(self, name: str, kind: int, fd: int) -> None:
        self.name, self._kind, self._fd = name, kind, fd
        self._st: os.stat_result | None = None

    def is_dir(self, *, follow_symlinks: bool = False) -> bool:  # never follows: the argument is DirEntry's
        return self._kind == _DIR

    def is_file(self, *, follow_symlinks: bool = False) -> bool:
        return self._kind == _FILE

    def is_symlink(self) -> bool:
        return self._kind == _LINK

    def stat(self, *, follow_symlinks: bool = False) -> os.stat_result:
        if self._st is None:
            self._st = os.stat(self.name, dir_fd=self._fd, follow_symlinks=False)
        return self._st


def _kind(entry: os.DirEntry[str]) -> int:
    """What a listed name is, from the listing's type (an lstat where the filesystem gives none)."""
    try:
        if entry.is_dir(follow_symlinks=False):
            return _DIR
        if entry.is_file(follow_symlinks=False):
            return _FILE
        return _LINK if entry.is_symlink() else _OTHER
    except FileNotFoundError:  # gone since the listing
        return _OTHER


def _listing(fd: int) -> list[tuple[str, int]]:
    """The names in the directory open as ``fd`` with their kinds, last first (popped in order)."""
    with os.scandir(fd) as found:
        items = [(entry.name, _kind(entry)) for entry in found]
    items.reverse()
    return items


class _Level:
    """A folder on the walk's path: its name in its parent, its (device, inode), its path from
    the top, and the names in it still to visit."""

    __slots__ = ("ident", "name", "pending", "rel")

    def __init__(self, name: str, ident: tuple[int, int], rel: str, pending: list[tuple[str, int]]) -> None:
        self.name, self.ident, self.rel, self.pending = name, ident, rel, pending


def _ident(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


class _Cursor:
    """Where a walk is: ``fd``, the folder it lists, and the levels from the top down to it."""

    def __init__(self, top: int, *, shown: Path | None) -> None:
        self._shown = shown
        self._top = top  # the caller's, held open by the caller for the whole walk
        self.fd = top
        ident = _ident(top)
        self.dev = ident[0]
        self._levels = [_Level("", ident, "", _listing(top))]

    def __enter__(self) -> _Cursor:
        return self

    def __exit__(self, *_: object) -> None:
        if self.fd != self._top:
            os.close(self.fd)

    @property
    def depth(self) -> int:
        return len(self._levels) - 1

    @property
    def rel(self) -> str:
        return self._levels[-1].rel

    def next(self) -> tuple[str, int] | None:
        """The next name in the current folder and its kind; None when it has none left."""
        pending = self._levels[-1].pending
        return pending.pop() if pending else None

    def down(self, name: str, *, strict: bool) -> bool:
        """Enter subfolder ``name``: False if it is not one to enter (gone, a link, a file, a mount);
        ``strict``: a link, file or mount there is an UnsafePathError instead."""
        rel = f"{self.rel}/{name}" if self.depth else name
        if strict:
            child: int | None = open_below(self.fd, name, dev=self.dev, shown=self._where(rel))
        else:
            child = _open_quietly(self.fd, name, self.dev)
        if child is None:
            return False
        try:
            level = _Level(name, _ident(child), rel, _listing(child))
        except BaseException:
            os.close(child)
            raise
        if self.fd != self._top:
            os.close(self.fd)
        self.fd = child
        self._levels.append(level)
        return True

    def up(self) -> str:
        """Back to the parent of the current folder, checked to be the one the walk came from;
        the name of the folder left."""
        left = self._levels.pop()
        if len(self._levels) == 1:
            parent = self._top
        else:
            parent = os.open("..", DIR_FLAGS, dir_fd=self.fd)
            if _ident(parent) != self._levels[-1].ident:
                os.close(parent)
                parent = self._from_top()
        os.close(self.fd)
        self.fd = parent
        return left.name

    def _from_top(self) -> int:
        """The current level reached again by name from the top, each level checked to be the
        folder the walk entered: a folder moved meanwhile is not followed to where it went."""
        fd = self._top
        for level in self._levels[1:]:
            try:
                child = os.open(level.name, DIR_FLAGS, dir_fd=fd)  # FileNotFoundError: removed meanwhile
            finally:
                if fd != self._top:
                    os.close(fd)
            fd = child
            if _ident(fd) != level.ident:
                os.close(fd)
                raise self._moved(level.rel)
        return fd

    def _where(self, rel: str) -> Path:
        return self._shown / rel if self._shown is not None else Path(rel)

    def _moved(self, rel: str) -> UnsafePathError:
        shown = self._where(rel)
        return UnsafePathError(
            f"{shown} was replaced while cachemgr walked it (another folder now has its name); "
            "cachemgr never follows a folder to where it was moved",
            remedy="run the command again; if this recurs, find what moves folders inside the cache volume",
            path=str(shown),
        )


def walk(
    top: int, *, shown: Path | None = None, enter: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, Found, int]]:
    """Everything below the directory open as ``top``: (posix relative path, its entry, and a
    descriptor of the directory holding it, to act on the entry by name without a path walk).

    Depth first, a few descriptors whatever the depth (:class:`_Cursor`); only real directories
    of the same filesystem are entered (a symlink is yielded, never followed). Each entry is
    yielded while its directory is open, so ``entry.stat(follow_symlinks=False)`` works on it.
    ``shown``: the path of ``top`` in errors; ``enter(rel)``: whether to go into folder ``rel``
    (it is yielded either way).
    """
    with _Cursor(top, shown=shown) as cursor:
        while True:
            item = cursor.next()
            if item is None:
                if not cursor.depth:
                    return
                cursor.up()
                continue
            name, kind = item
            rel = f"{cursor.rel}/{name}" if cursor.depth else name
            yield rel, Found(name, kind, cursor.fd), cursor.fd
            if kind == _DIR and (enter is None or enter(rel)):
                cursor.down(name, strict=False)


def _open_quietly(parent_fd: int, name: str, dev: int) -> int | None:
    """A subdirectory to walk into; None if it went away, turned into a symlink, or is a mount."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        if error.errno in REFUSED:
            return None
        raise
    if os.fstat(fd).st_dev != dev:
        os.close(fd)
        return None
    return fd
