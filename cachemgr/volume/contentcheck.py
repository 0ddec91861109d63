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
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from cachemgr.core import safefs
from cachemgr.volume.manifest import Problem

_READ_CHUNK = 1 << 20  # BLAKE3's SIMD wants large updates; 1 MiB keeps the buffer in L2
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_OPEN_FOLDERS = 64
# Threads reading at once: enough to keep a disk's or a network filesystem's queue full; the
# hashing itself needs one core for about 8 GiB/s.
WORKERS = max(2, min(8, 2 * (os.cpu_count() or 1)))


@dataclass(frozen=True)
class Expected:
    """One file as signed: its path in the entry, its size and its BLAKE3 (hex)."""

    path: str
    size: int
    blake3: str


def first_problem(
    root: Path, entry: Path, files: Sequence[Expected], *, workers: int = WORKERS
) -> Problem | None:
    """The first of ``files`` (in their order) whose bytes are not what was signed; None if all are.

    Missing, not a regular file, another size, other bytes: each a :class:`Problem` saying the file
    changed after signing. Raises ``OSError`` for an I/O error (a flaky volume is not tampering)
    and :class:`~cachemgr.core.safefs.UnsafePathError` if the entry itself is not a real directory.
    """
    if not files:
        return None
    with safefs.open_dir(root, entry) as top, _Folders(top, entry) as folders:
        return _run(folders, files, workers=max(1, workers))


def _run(folders: _Folders, files: Sequence[Expected], *, workers: int) -> Problem | None:
    found: dict[int, Problem] = {}
    todo: Iterator[tuple[int, Expected]] = iter(enumerate(files))
    running: dict[Future[Problem | None], tuple[int, str]] = {}
    with ThreadPoolExecutor(workers, thread_name_prefix="cachemgr-check") as pool:
        try:
            while True:
                while not found and len(running) < 2 * workers:
                    item = next(todo, None)
                    if item is None:
                        break
                    index, expected = item
                    folder, name = _split(expected.path)
                    try:
                        fd = folders.acquire(folder)
                    except (FileNotFoundError, NotADirectoryError, safefs.UnsafePathError):
                        found[index] = _changed(expected, "its folder is missing or not a directory")
                        break
                    running[pool.submit(_check_one, fd, name, expected)] = (index, folder)
                if not running:
                    break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    index, folder = running.pop(future)
                    folders.release(folder)
                    problem = None if future.cancelled() else future.result()
                    if problem is not None:
                        found[index] = problem
                if found:
                    # Files queued after the problem need no reading; those before it are all
                    # running or done already (the pool starts them in order), and are awaited.
                    for future in running:
                        future.cancel()
        finally:
            for future in running:
                future.cancel()
    return found[min(found)] if found else None


def _split(path: str) -> tuple[str, str]:
    folder, _, name = path.rpartition("/")
    return folder, name


def _changed(expected: Expected, how: str) -> Problem:
    return Problem(expected.path, f"changed after signing ({how})")


_buffers = threading.local()


def _buffer() -> bytearray:
    buffer: bytearray | None = getattr(_buffers, "buffer", None)
    if buffer is None:
        buffer = _buffers.buffer = bytearray(_READ_CHUNK)
    return buffer


def _check_one(folder: int, name: str, expected: Expected) -> Problem | None:
    from blake3 import blake3  # a trusting pod's hit only

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
        digest = blake3()
        buffer = _buffer()
        view = memoryview(buffer)
        with contextlib.suppress(OSError):  # advice only: larger readahead
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while count := os.readv(fd, (buffer,)):
            digest.update(view[:count])
        if digest.hexdigest() != expected.blake3:
            return _changed(expected, "its bytes differ from the signed BLAKE3")
        return None
    finally:
        os.close(fd)


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
