"""The local side of a transfer: every file opened from the cache root, never by its path.

boto3's ``upload_file`` and ``download_file`` open a local file by its path, and the kernel
follows a symlink at any level of a path. On the shared volume anyone can replace an entry's
artifact file, its ``artifacts/`` directory or a pod's staging directory by a link (to
``/etc/shadow``, to the pod's model weights): an upload would then send a file from outside the
cache root to the bucket, and a download would write through the link, outside the root
(DESIGN.md, principle 6).

So a transfer opens the entry's (or the staging attempt's) directory once from the root
(:func:`cachemgr.core.safefs.open_dir`: one level at a time, ``O_NOFOLLOW|O_DIRECTORY``, on the root's
filesystem), each directory below it relative to its parent the same way, and each file with
``O_NOFOLLOW`` for reading (it must be a regular file; ``O_NONBLOCK``: a FIFO cannot block the
open) or ``O_CREAT|O_EXCL|O_NOFOLLOW`` for writing (a new file in private staging: nothing that
is already there is ever written through or over). boto3 then moves the open file objects; an
upload's through a :class:`HashedReader`, so the bytes sent are the bytes checked.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import xxhash

from cachemgr.core import safefs
from cachemgr.core.errors import VolumeError

READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
DIR_CACHE = 32  # directory descriptors a LocalDir keeps open at most
_NOT_A_FILE = frozenset({errno.ELOOP, errno.ENXIO})  # a symlink; a socket


class LocalDir:
    """A directory under the cache root held open, with the directories below it as they are reached.

    Directory descriptors are kept, the most recently used :data:`DIR_CACHE` of them, until
    :meth:`close`: an entry of 2,000 files in a few folders costs one open per folder, not one
    walk from the root per file (a round trip each on FUSE), and an entry of 10,000 folders does
    not run out of descriptors. Used from one thread (the transfer's, which opens each file
    before handing it to the transfer manager), so a descriptor is never closed while in use.
    """

    def __init__(self, fd: int, shown: Path) -> None:
        self.fd = fd
        self.shown = shown
        self._dev = os.fstat(fd).st_dev
        self._dirs: OrderedDict[str, int] = OrderedDict()

    @classmethod
    @contextlib.contextmanager
    def open(cls, root: Path, path: Path) -> Iterator[LocalDir]:
        """``path`` (under the cache root ``root``) reached safely; UnsafePathError otherwise."""
        with safefs.open_dir(root, path) as fd:
            local = cls(fd, path)
            try:
                yield local
            finally:
                local.close()

    def close(self) -> None:
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()

    def open_file(self, rel: str) -> tuple[BinaryIO, os.stat_result]:
        """``rel`` opened for reading and its ``fstat``: a regular file, reached without a link."""
        parent, name = self._parent(rel, create=False)
        shown = self.shown / rel
        try:
            fd = os.open(name, READ_FLAGS, dir_fd=parent)
        except OSError as error:
            if error.errno in _NOT_A_FILE:
                raise not_a_file(shown, parent, name, doing="reads") from None
            raise
        handle = os.fdopen(fd, "rb")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a FIFO or a device: O_NONBLOCK let the open return
            handle.close()
            raise not_a_file(shown, parent, name, doing="reads")
        return handle, st

    def read_bytes(self, rel: str, *, limit: int) -> bytes:
        """Up to ``limit`` bytes of ``rel`` (a record; one byte more tells the caller it is larger)."""
        handle, _ = self.open_file(rel)
        with handle:
            return handle.read(limit + 1)

    def create_file(self, rel: str) -> BinaryIO:
        """A new file ``rel`` for writing; its folders are made as needed. Never opens what exists."""
        parent, name = self._parent(rel, create=True)
        try:
            fd = os.open(name, CREATE_FLAGS, 0o644, dir_fd=parent)
        except FileExistsError:
            raise not_a_file(self.shown / rel, parent, name, doing="writes", planted=True) from None
        return os.fdopen(fd, "wb")

    def write_new(self, rel: str, data: bytes) -> None:
        with self.create_file(rel) as handle:
            handle.write(data)

    def unlink(self, rel: str) -> None:
        """Remove file ``rel`` (missing is fine): a name of ours the transfer is about to create."""
        parent, name = self._parent(rel, create=False)
        safefs.unlink_at(parent, name)

    def _parent(self, rel: str, *, create: bool) -> tuple[int, str]:
        folder, _, name = rel.rpartition("/")
        if not name or any(part in {"", ".", ".."} for part in rel.split("/")):
            raise ValueError(f"{rel!r} is not a plain relative path")
        return (self._dir(folder, create=create) if folder else self.fd), name

    def _dir(self, folder: str, *, create: bool) -> int:
        """The descriptor of ``folder``, reached from the deepest one already open: a loop, not a
        recursion (a manifest may list a path hundreds of folders deep)."""
        known = self._dirs.get(folder)
        if known is not None:
            self._dirs.move_to_end(folder)
            return known
        parts = folder.split("/")
        start = next((i for i in range(len(parts) - 1, 0, -1) if "/".join(parts[:i]) in self._dirs), 0)
        fd = self._dirs[("/".join(parts[:start]))] if start else self.fd
        for i in range(start, len(parts)):
            reached = "/".join(parts[: i + 1])
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(parts[i], 0o755, dir_fd=fd)
            fd = safefs.open_below(fd, parts[i], dev=self._dev, shown=self.shown / reached)
            self._dirs[reached] = fd
            self._dirs.move_to_end(reached)
            while len(self._dirs) > DIR_CACHE:
                # The least recently used; never ``fd`` (just added) nor a parent still to be used
                # (each is used once, to open the next, before the loop moves on).
                os.close(self._dirs.popitem(last=False)[1])
        return fd


def not_a_file(
    shown: Path, parent: int, name: str, *, doing: str, planted: bool = False
) -> safefs.UnsafePathError:
    """The refusal of ``shown``: what it is instead of a regular file, and what to do."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        what = "gone"
    else:
        what = safefs.describe(st)
        if stat.S_ISLNK(st.st_mode):
            with contextlib.suppress(OSError):
                what += f" (to {os.readlink(name, dir_fd=parent)[:200]!r})"
    if planted:
        return safefs.UnsafePathError(
            f"{shown} already exists ({what}) in this transfer's private staging; cachemgr never "
            "writes through or over it",
            remedy=f"find what else writes into {shown.parent} on the cache volume",
            path=str(shown),
        )
    return safefs.UnsafePathError(
        f"{shown} is {what}, not a regular file; cachemgr never {doing} through it",
        remedy=f"remove it (rm {shown}); 'cachemgr verify --fix' moves the damaged entry aside",
        path=str(shown),
    )


class HashedReader:
    """A file being uploaded, hashed as the transfer manager reads it: what is sent is what is checked.

    A size check at the open cannot see a file rewritten in place afterwards (same size, other
    bytes), and the upload would then put bytes that disagree with the manifest under it. So
    every pass over the file from its start is hashed as it is read: s3transfer 0.19.3 reads a
    large file once, part by part in order; a small one whole for its PutObject, which botocore
    may read again from the start (a checksum, then the send, then a retry). A pass that reaches
    the recorded size must match the recorded xxh3-128; one that ends short or runs past it
    (the file shrank or grew) is refused at once. :meth:`verify` after the transfer refuses a
    file no complete pass matched. Used by one transfer at a time, as its file object.
    """

    def __init__(self, handle: BinaryIO, *, size: int, xxh3: str, shown: Path) -> None:
        self._handle = handle
        self._size = size
        self._xxh3 = xxh3
        self.shown = shown
        self._pos = 0
        self._digest = xxhash.xxh3_128()
        self._hashed = 0  # bytes of the current pass, which began at the start
        self._matched = size == 0 and xxh3 == xxhash.xxh3_128_hexdigest(b"")  # s3transfer may read none
        self.problem: str | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._pos = self._handle.seek(offset, whence)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        start = self._pos
        data = self._handle.read(-1 if size is None else size)
        self._pos += len(data)
        self._follow(start, data, wanted=size)
        return data

    def close(self) -> None:
        self._handle.close()

    @property
    def closed(self) -> bool:
        return self._handle.closed

    def verify(self) -> None:
        """After the transfer: LocalChangedError unless a whole pass matched and none disagreed."""
        if self.problem is None and not self._matched:
            self.problem = "it was never read whole"
        if self.problem is not None:
            raise self.error()

    def error(self) -> LocalChangedError:
        return LocalChangedError(
            f"{self.shown} changed while it was uploading ({self.problem}); the entry was not uploaded",
            remedy="find what writes into published entries; 'cachemgr verify --fix' moves a damaged "
            "entry aside (the next start compiles it again), 'cachemgr push' uploads a good one",
            path=str(self.shown),
            problem="local-changed",
        )

    def _follow(self, start: int, data: bytes, *, wanted: int | None) -> None:
        if start == 0:
            self._digest.reset()
            self._hashed = 0
        if self._hashed != start:  # not reading on from the pass: an order s3transfer never uses
            self._refuse("it was read out of order")
        self._digest.update(data)
        self._hashed = start + len(data)
        end = self._size if wanted is None or wanted < 0 else min(self._size, start + wanted)
        if self._hashed > self._size:
            self._refuse(f"it has grown past the {self._size} bytes its manifest lists")
        elif self._hashed < end:
            self._refuse(f"it ended at {self._hashed} of the {self._size} bytes its manifest lists")
        elif self._hashed == self._size and self._digest.hexdigest() != self._xxh3:
            self._refuse("its bytes no longer match the manifest's xxh3-128")
        elif self._hashed == self._size:
            self._matched = True

    def _refuse(self, problem: str) -> None:
        """Record the first problem and stop this read: the transfer fails, the manifest stays home."""
        if self.problem is None:
            self.problem = problem
        raise self.error()


class LocalChangedError(VolumeError):
    """A local file disagreed with its manifest while it uploaded: not uploaded (exit 74)."""

    reason = "local-changed"
