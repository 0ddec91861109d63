"""Reading an entry's files with parallel readers: the read-ahead after a launch, and any pass
that must see every byte (a content check can ride on the same read, one pass, not two).

:func:`read_entry` takes the files in the order given (the server's, see
:func:`loader_order`), cuts large ones into segments so several workers share one big file
(a single reader gets a fraction of what a network filesystem delivers: docs/benchmarks.md,
"Whole warm start"), and reads them from the cache root by descriptor: the entry is opened from
the root one level at a time and every file relative to its own folder with ``O_NOFOLLOW``
(:mod:`cachemgr.core.safefs`), so a symlink planted anywhere in or above the entry is refused,
never read through, and a FIFO cannot block a worker (``O_NONBLOCK``, then ``fstat``).

Two ways to bring a file into the page cache (:data:`Mechanism`):

* ``advise``: ``posix_fadvise(POSIX_FADV_WILLNEED)`` per segment: the kernel queues the reads
  and copies nothing to us. Local filesystems honour it (ext4, xfs...);
* ``read``: plain reads into one reused buffer per worker. FUSE (JuiceFS), NFS and CephFS
  clients fetch on read; with ``on_chunk`` (a hash riding on the read) it is the only way.

The caller bounds it: ``stop`` (SIGTERM, or the server exited) is checked before every chunk;
``budget`` (:class:`cachemgr.core.membudget.MemoryBudget`) caps the bytes brought in and stops
the read when the pod's memory usage reaches its ceiling; ``skip(index, offset)`` says where
the server itself already is in a file (a chunk it has read past is not read again).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from cachemgr.core import safefs
from cachemgr.core.membudget import MemoryBudget
from cachemgr.core.procs import Flag
from cachemgr.volume.manifest import FileRecord

Mechanism = Literal["advise", "read"]

# Stop and budget are checked between two chunks. A read waits for the volume (a second per MiB
# on a store capped at 1 MB/s), so a read is small; advice only queues the kernel's reads.
READ_CHUNK = 1 << 20
ADVISE_CHUNK = 8 << 20
KERNEL_READAHEAD = 8 << 20
SEGMENT = 64 << 20  # a file larger than this is shared among workers, a segment each
SMALL_FILE = 1 << 20  # configs a loader reads before the graphs they list
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_CACHE = 16  # folder descriptors a worker keeps open
# Where the kernel's readahead honours WILLNEED and a read-ahead needs no copy: local disks.
ADVISE_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs"})
# Already in memory: nothing to read ahead.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


class FileToRead(Protocol):
    """What a read needs of a file: its path in the entry and the size it should have (a
    manifest's :class:`FileRecord`, or a signed file of :mod:`cachemgr.volume.contentcheck`)."""

    @property
    def path(self) -> str: ...

    @property
    def size(self) -> int: ...


# on_chunk(index, offset, data): called from the worker reading file ``index``, in file order.
ChunkCallback = Callable[[int, int, memoryview], None]
# skip(index) -> how far into file ``index`` the server has read itself (0: not at all).
SkipCallback = Callable[[int], int]


@dataclass
class ReadResult:
    """What a read did: bytes brought in, files whole, and what was skipped, by reason."""

    mechanism: Mechanism
    workers: int
    bytes: int = 0
    files_done: set[int] = field(default_factory=set)
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> files
    stopped: str | None = None  # "stop", "budget", "memory": why it ended before the last file
    seconds: float = 0.0
    left: dict[int, str] = field(default_factory=dict)  # file -> why it was not read whole
    error: OSError | None = None  # the first I/O error a read met (reason "unreadable")

    @property
    def throughput(self) -> float:
        """Bytes per second over the whole read."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


def loader_order(files: Sequence[FileRecord], *, prefix: str = "") -> list[int]:
    """Indexes of ``files`` under ``prefix``, in the order a loader of compiled models reads them.

    Small files first (a loader reads its configs, ``rbln_config.json``, before the graphs they
    list), then by path in natural order (``rank2`` before ``rank10``; optimum-rbln loads a
    model's own graphs before its submodules' folders, vllm-rbln its ranks in order).
    """
    chosen = [i for i, record in enumerate(files) if record.path.startswith(prefix)]
    return sorted(chosen, key=lambda i: (files[i].size > SMALL_FILE, _natural(files[i].path)))


def _natural(path: str) -> list[tuple[int, int | str]]:
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", path)]


def mechanism_for(fstype: str | None) -> Mechanism | None:
    """``advise`` on local disks, ``read`` elsewhere; None where the files are memory already."""
    if fstype in MEMORY_FILESYSTEMS:
        return None
    return "advise" if fstype in ADVISE_FILESYSTEMS else "read"


@dataclass(frozen=True)
class _Segment:
    index: int
    start: int
    end: int


class _Shared:
    """What the workers of one read share: the queue, the counters, the budget."""

    def __init__(
        self, segments: list[_Segment], *, budget: MemoryBudget | None, stop: Flag | None, in_flight: int
    ) -> None:
        self.segments = segments
        self.in_flight = in_flight  # bytes the workers may have asked for and not yet seen charged
        self.next = 0
        self.lock = threading.Lock()
        self.budget = budget
        self.stop = stop
        self.charged = 0  # bytes counted against the budget
        self.halted: str | None = None
        self.remaining: Counter[int] = Counter(s.index for s in segments)  # segments left per file
        self.reasons: dict[int, str] = {}  # file -> why a segment of it was left (the first reason)
        self.error: OSError | None = None  # the first I/O error, for a caller that must know

    def take(self) -> _Segment | None:
        with self.lock:
            if self.halted is not None or self.next >= len(self.segments):
                return None
            segment = self.segments[self.next]
            self.next += 1
            return segment

    def halt(self, reason: str) -> None:
        with self.lock:
            self.halted = self.halted or reason

    def charge(self, nbytes: int) -> bool:
        """Count ``nbytes`` about to come in; False (and halt) if the budget or a stop forbids."""
        if self.stop is not None and self.stop.is_set():
            self.halt("stop")
            return False
        if self.budget is None:
            return self.halted is None
        if self.budget.exceeded(margin=self.in_flight):
            self.halt("memory")
            return False
        with self.lock:
            if self.halted is not None:
                return False
            if self.charged + nbytes > self.budget.bytes:
                self.halted = "budget"
                return False
            self.charged += nbytes
            return True


def read_entry(
    entry: Path,
    files: Sequence[FileToRead],
    order: Sequence[int],
    *,
    within: Path,
    mechanism: Mechanism,
    workers: int,
    budget: MemoryBudget | None = None,
    stop: Flag | None = None,
    skip: SkipCallback | None = None,
    on_chunk: ChunkCallback | None = None,
    into: ReadResult | None = None,
) -> ReadResult:
    """Read ``files[i]`` for ``i`` in ``order`` under ``entry`` (reached from the root ``within``).

    ``into``: the result to fill as the read goes (its ``bytes`` grow chunk by chunk), for a
    caller that may stop waiting for a reader blocked on the volume and report what it had.

    With ``on_chunk`` every file is read whole by one worker, in order, and the callback sees
    each chunk (``mechanism`` must be ``read``); without it large files are split among workers.
    A file that is not a regular file, or not the size its record says, is skipped and counted
    (``skipped``): the entry's check decides what that means, a read never raises for it.
    Raises :class:`cachemgr.core.safefs.UnsafePathError` if the entry itself cannot be reached
    without a link, ``FileNotFoundError`` if it is gone.
    """
    if on_chunk is not None and mechanism != "read":
        raise ValueError("a chunk callback needs the bytes: mechanism 'read'")
    step = SEGMENT if on_chunk is None else None  # a hash needs one reader per file, in order
    segments = [
        _Segment(i, start, min(files[i].size, start + (step or files[i].size)))
        for i in order
        for start in (range(0, max(files[i].size, 1), step) if step else (0,))
    ]
    result = into if into is not None else ReadResult(mechanism=mechanism, workers=max(1, workers))
    # Advice keeps two chunks per worker queued; a read has one in hand, and the kernel's own
    # readahead may run ahead of it (8 MiB on common disks; FUSE's is smaller).
    in_flight = result.workers * (
        2 * ADVISE_CHUNK if mechanism == "advise" else READ_CHUNK + KERNEL_READAHEAD
    )
    shared = _Shared(segments, budget=budget, stop=stop, in_flight=in_flight)
    job = _Job(files, shared, result, mechanism, skip, on_chunk)
    started = time.monotonic()
    with safefs.open_dir(within, entry) as top:
        threads = [
            threading.Thread(target=job.work, args=(top,), name=f"cachemgr-read-{n}", daemon=True)
            for n in range(min(result.workers, max(1, len(segments))))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    result.seconds = time.monotonic() - started
    result.stopped = shared.halted
    result.files_done = (
        {s.index for s in segments} - set(shared.reasons) - {i for i, n in shared.remaining.items() if n}
    )
    result.left = dict(shared.reasons)
    result.skipped = Counter(r for r in shared.reasons.values() if r != "halted")
    result.error = shared.error
    return result


@dataclass(frozen=True)
class _Job:
    """One read: what its workers share."""

    files: Sequence[FileToRead]
    shared: _Shared
    result: ReadResult
    mechanism: Mechanism
    skip: SkipCallback | None
    on_chunk: ChunkCallback | None

    def work(self, top: int) -> None:
        """A worker: segments from the queue until it is empty or the read halts."""
        dirs = _Folders(top)
        buffer = memoryview(bytearray(READ_CHUNK if self.mechanism == "read" else 0))
        shared = self.shared
        try:
            while (segment := shared.take()) is not None:
                why = self._segment(dirs, segment, buffer)
                with shared.lock:
                    if why is not None:
                        shared.reasons.setdefault(segment.index, why)
                    shared.remaining[segment.index] -= 1
        finally:
            dirs.close()

    def _segment(self, dirs: _Folders, segment: _Segment, buffer: memoryview) -> str | None:
        """None once read, or why the segment was left: "server_read", "halted" (stop or budget),
        or what is wrong with the file (it stays for the entry's own check to judge)."""
        record = self.files[segment.index]
        if self.skip is not None and self.skip(segment.index) >= segment.end:
            return "server_read"
        try:
            fd = dirs.open_file(record.path)
        except OSError as error:
            return self._failed(error)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return "not_a_regular_file"
            if st.st_size != record.size:
                return "size_changed"
            return self._pull(fd, segment, buffer)
        except OSError as error:  # EIO mid-read: a worker never dies of it, the file is left
            return self._failed(error)
        finally:
            os.close(fd)

    def _failed(self, error: OSError) -> str:
        why = _why(error)
        if why == "unreadable":
            with self.shared.lock:
                self.shared.error = self.shared.error or error
        return why

    def _pull(self, fd: int, segment: _Segment, buffer: memoryview) -> str | None:
        offset = segment.start
        chunk = READ_CHUNK if self.mechanism == "read" else ADVISE_CHUNK
        while offset < segment.end:
            if self.skip is not None:
                offset = max(offset, min(segment.end, self.skip(segment.index)))  # the server read past it
                if offset >= segment.end:
                    break
            length = min(chunk, segment.end - offset)
            if not self.shared.charge(length):
                return "halted"
            if self.mechanism == "advise":
                with contextlib.suppress(OSError):  # advice only: a filesystem may refuse it
                    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
                if offset > segment.start:
                    # Wait for the previous chunk's reads (its last byte): advice alone queues the
                    # whole entry in a moment, and the server's own first reads (its imports, on a
                    # node that has not cached its image) then wait behind all of it.
                    os.pread(fd, 1, offset - 1)
                count = length
            else:
                count = os.preadv(fd, (buffer[:length],), offset)
                if count == 0:
                    return "size_changed"  # shorter than its fstat a moment ago
                if self.on_chunk is not None:
                    self.on_chunk(segment.index, offset, buffer[:count])
            offset += count
            with self.shared.lock:
                self.result.bytes += count
        return None


def hash_entry(
    entry: Path,
    files: Sequence[FileRecord],
    order: Sequence[int],
    *,
    within: Path,
    workers: int,
    stop: Flag | None = None,
) -> tuple[dict[int, str], ReadResult]:
    """The xxh3-128 of each file read whole, in one parallel pass (the read a content check and
    a read-ahead can share): ``{index: hexdigest}`` for the files in ``result.files_done``; a
    file missing from it was left (``result.skipped``, or the read was stopped) and is unchecked."""
    import xxhash  # the content check's; a plain read-ahead needs no hash

    digests: dict[int, xxhash.xxh3_128] = {}

    def update(index: int, offset: int, data: memoryview) -> None:
        if offset == 0:
            digests[index] = xxhash.xxh3_128()
        digests[index].update(data)

    result = read_entry(
        entry, files, order, within=within, mechanism="read", workers=workers, stop=stop, on_chunk=update
    )
    empty = xxhash.xxh3_128_hexdigest(b"")
    return {i: digests[i].hexdigest() if i in digests else empty for i in result.files_done}, result


def _why(error: OSError) -> str:
    """Why a file could not be opened or read, as a reason the caller can judge: "unreadable"
    (an I/O error: a flaky volume) is the only one that is not about the entry's own files."""
    if isinstance(error, safefs.UnsafePathError):
        return "unsafe_path"
    if error.errno in {errno.ELOOP, errno.ENXIO}:  # a symlink; a socket
        return "not_a_regular_file"
    if isinstance(error, (FileNotFoundError, NotADirectoryError)):
        return "missing"
    if isinstance(error, PermissionError):  # a mode taken away: the entry was changed
        return "not_permitted"
    return "unreadable"


class _Folders:
    """One worker's folder descriptors below the entry, the most recent :data:`_DIR_CACHE`."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.dev = os.fstat(top).st_dev
        self.cache: OrderedDict[str, int] = OrderedDict()

    def open_file(self, rel: str) -> int:
        folder, _, name = rel.rpartition("/")
        parent = self._folder(folder) if folder else self.top
        return os.open(name, _READ_FLAGS, dir_fd=parent)

    def _folder(self, folder: str) -> int:
        known = self.cache.get(folder)
        if known is not None:
            self.cache.move_to_end(folder)
            return known
        above, _, part = folder.rpartition("/")
        parent = self._folder(above) if above else self.top
        fd = safefs.open_below(parent, part, dev=self.dev, shown=Path(folder))
        self.cache[folder] = fd
        while len(self.cache) > _DIR_CACHE:
            os.close(self.cache.popitem(last=False)[1])  # least recent: never ``fd`` or its parent
        return fd

    def close(self) -> None:
        for fd in self.cache.values():
            os.close(fd)
        self.cache.clear()
