"""A trusting pod's content check: every artifact's bytes against its signed BLAKE3, before the launch.

The interface is what a parallel reader of an entry needs: files in order -> the first problem.
Files are read by a few threads at once (a network filesystem answers one request per round
trip; BLAKE3 hashes several GiB/s per core and releases the GIL), so a check keeps up with the
disk rather than with one request at a time, and what it reads is in the page cache when the
server loads it (docs/benchmarks.md, "Trust checks", from bench/bench_trust.py).

Everything is reached from the cache root as the rest of cachemgr reaches it
(:mod:`cachemgr.core.safefs`): the entry from the root one level at a time, each folder below it
from its parent with ``O_NOFOLLOW|O_DIRECTORY`` on the root's filesystem, each file with
``O_NOFOLLOW`` (``O_NONBLOCK``: a FIFO cannot block the open), and the bytes hashed are those of
what was opened. A folder opens once however many files it holds, and at most a window of
folders stays open.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from cachemgr.core import safefs
from cachemgr.volume.manifest import Problem

_READ_CHUNK = 1 << 20  # BLAKE3's SIMD wants large updates; 1 MiB keeps the buffer in L2
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_OPEN_FOLDERS = 64
# Threads reading at once: enough to keep a disk's or a network filesystem's queue full (each
# waits on its read most of the time; BLAKE3 hashes several GiB/s a core without the GIL).
# Fewer left the disk idle here, on two cores (docs/benchmarks.md, "Trust checks").
WORKERS = 8


class Expected(NamedTuple):  # one per file of a trusting hit: a NamedTuple is the cheap record
    """One file as signed: its path in the entry, its size and its BLAKE3 (hex)."""

    path: str
    size: int
    blake3: str


def first_problem(
    root: Path,
    entry: Path,
    files: Sequence[Expected],
    *,
    workers: int = WORKERS,
    stop: StopFlag | None = None,
) -> Problem | None:
    """The first of ``files`` (in their order) whose bytes are not what was signed; None if all are.

    Missing, not a regular file, another size, other bytes: each a :class:`Problem` saying the file
    changed after signing. Raises ``OSError`` for an I/O error (a flaky volume is not tampering),
    :class:`~cachemgr.core.safefs.UnsafePathError` if the entry itself is not a real directory,
    and ``InterruptedError`` once ``stop`` is set (SIGTERM: no server starts after it).
    """
    if not files:
        return None
    with safefs.open_dir(root, entry) as top, _Folders(top, entry) as folders:
        return _Pool(folders, max(1, min(workers, len(files))), stop).run(files)


class StopFlag(Protocol):
    """``threading.Event`` or the runner's signal-safe flag."""

    def is_set(self) -> bool: ...


class _Pool:
    """A few threads, each taking the next file in order and hashing it.

    Plain threads and one lock: ``concurrent.futures`` imports ``logging``, ``queue`` two extension
    modules, each a few milliseconds on the hit path before the server starts. The lock guards
    the order, the folders and the findings; hashing runs outside it (and without the GIL).
    """

    def __init__(self, folders: _Folders, workers: int, stop: StopFlag | None) -> None:
        self.folders = folders
        self.workers = workers
        self.stop = stop
        self.lock = threading.Lock()
        self.found: dict[int, Problem] = {}
        self.error: BaseException | None = None

    def run(self, files: Sequence[Expected]) -> Problem | None:
        todo = iter(enumerate(files))
        threads = [
            threading.Thread(target=self._work, args=(todo,), name=f"cachemgr-check-{n}", daemon=True)
            for n in range(self.workers)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self.stop is not None and self.stop.is_set():
            raise InterruptedError("stopped while checking the entry")
        if self.error is not None:
            raise self.error
        return self.found[min(self.found)] if self.found else None

    def _next(self, todo: Iterator[tuple[int, Expected]]) -> tuple[int, Expected, str, str, int] | None:
        """The next file and its folder's descriptor, in order; None once there is nothing to do.

        After a problem nothing more is started: every file before it was started first (they
        are taken in order) and is finished, so the first problem found is the first in order.
        """
        with self.lock:
            while (
                not self.found and self.error is None and not (self.stop is not None and self.stop.is_set())
            ):
                item = next(todo, None)
                if item is None:
                    return None
                index, expected = item
                folder, name = _split(expected.path)
                try:
                    return index, expected, folder, name, self.folders.acquire(folder)
                except (FileNotFoundError, NotADirectoryError, safefs.UnsafePathError):
                    self.found[index] = _changed(expected, "its folder is missing or not a directory")
            return None

    def _work(self, todo: Iterator[tuple[int, Expected]]) -> None:
        buffer = bytearray(_READ_CHUNK)
        while (task := self._next(todo)) is not None:
            index, expected, folder, name, fd = task
            outcome: Problem | BaseException | None
            try:
                outcome = _check_one(fd, name, expected, buffer, self.stop)
            except BaseException as error:  # noqa: BLE001  # raised in the caller's thread, after the join
                outcome = error
            with self.lock:
                self.folders.release(folder)
                if isinstance(outcome, BaseException):
                    self.error = self.error or outcome
                elif outcome is not None:
                    self.found[index] = outcome


def _split(path: str) -> tuple[str, str]:
    folder, _, name = path.rpartition("/")
    return folder, name


def _changed(expected: Expected, how: str) -> Problem:
    return Problem(expected.path, f"changed after signing ({how})")


def _check_one(
    folder: int, name: str, expected: Expected, buffer: bytearray, stop: StopFlag | None = None
) -> Problem | None:
    """One file; abandoned (None) once ``stop`` is set, which the caller then raises for."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=folder)
    except FileNotFoundError:
        return _changed(expected, "missing")
    except OSError as error:
        if error.errno in {errno.ELOOP, errno.ENXIO}:  # a symlink; a socket
            return _changed(expected, "not a regular file")
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return _changed(expected, "not a regular file")
        if st.st_size != expected.size:
            return _changed(expected, f"{st.st_size} bytes, signed {expected.size}")
        digest = _blake3(fd, buffer, stop)
        if digest is not None and digest != expected.blake3:
            return _changed(expected, "its bytes differ from the signed BLAKE3")
        return None
    finally:
        os.close(fd)


def _blake3(fd: int, buffer: bytearray, stop: StopFlag | None) -> str | None:
    """The BLAKE3 of what remains to read from ``fd``; None once ``stop`` is set (each 64 MiB)."""
    from blake3 import blake3  # a trusting pod's hit only

    digest = blake3()
    view = memoryview(buffer)
    with contextlib.suppress(OSError):  # advice only: larger readahead
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    chunks = 0
    while count := os.readv(fd, (buffer,)):
        digest.update(view[:count])
        chunks += 1
        if stop is not None and chunks % 64 == 0 and stop.is_set():
            return None
    return str(digest.hexdigest())


class _Folders:
    """Folders of the entry opened from its descriptor, one level at a time, shared by the threads.

    Only the checking loop acquires and releases (one thread); the workers only ``openat`` in a
    folder they were handed, which stays open until its file is done.
    """

    def __init__(self, top: int, shown: Path) -> None:
        self._top = top
        self._shown = shown
        self._dev = os.fstat(top).st_dev
        self._open: dict[str, int] = {}
        self._users: dict[str, int] = {}

    def __enter__(self) -> _Folders:
        return self

    def __exit__(self, *_: object) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()

    def acquire(self, folder: str) -> int:
        if not folder:
            return self._top
        fd = self._open.get(folder)
        if fd is None:
            above, _, part = folder.rpartition("/")
            parent = self.acquire(above)
            try:
                fd = safefs.open_below(parent, part, dev=self._dev, shown=self._shown / folder)
            finally:
                self.release(above)
            self._open[folder] = fd
        self._users[folder] = self._users.get(folder, 0) + 1
        return fd

    def release(self, folder: str) -> None:
        if not folder:
            return
        left = self._users[folder] - 1
        self._users[folder] = left
        if left == 0 and len(self._open) > _OPEN_FOLDERS:
            os.close(self._open.pop(folder))
            del self._users[folder]
