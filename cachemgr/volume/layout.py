"""The cache root: where each part of the layout lives, and the marker that says it is one.

A root is a directory on the role's compile cache volume (the ReadWriteMany PVC). Its layout
directories are made by the first pod that needs them; the marker ``cachemgr-layout.json``
records the layout version, so that an older cachemgr refuses a newer layout instead of
misreading it. ``CACHEDIR.TAG`` tells backup tools the directory is a cache.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from cachemgr import __version__
from cachemgr.core import jsonread, safefs
from cachemgr.core.errors import DiskFullError, VolumeError
from cachemgr.core.fsutil import atomic_write_json, fsync_dir, random_suffix, write_bytes_durably

if TYPE_CHECKING:
    from cachemgr.key.cachekey import CacheKey


LAYOUT_VERSION = 1
MARKER = "cachemgr-layout.json"
_SUBDIRS = ("entries", "staging", "leases", "usage", "failures", "quarantine", "trash")
_CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This directory is a compile cache managed by cachemgr; see cachemgr ls / du / prune.\n"
)


class CacheRoot(NamedTuple):
    """A cache volume's root directory and the places inside it."""

    path: Path

    @property
    def entries(self) -> Path:
        return self.path / "entries"

    @property
    def staging(self) -> Path:
        return self.path / "staging"

    @property
    def leases(self) -> Path:
        return self.path / "leases"

    @property
    def usage(self) -> Path:
        return self.path / "usage"

    @property
    def failures(self) -> Path:
        return self.path / "failures"

    @property
    def quarantine(self) -> Path:
        return self.path / "quarantine"

    @property
    def trash(self) -> Path:
        return self.path / "trash"

    def entry_path(self, key: CacheKey) -> Path:
        return self.entries / key.entry_name

    def iter_entries(self) -> Iterator[Path]:
        """Published entry directories (a scan: used by inspection, never by the hit path)."""
        for name in safefs.subdirs(self.path, self.entries):
            if not name.startswith("."):
                yield self.entries / name

    def check_layout(self) -> None:
        """Refuse (exit 74) a layout directory that is a symlink, not a directory, or another
        filesystem: every command would otherwise list, move or delete through it, outside
        the root. One open per directory; missing ones are made by the first miss."""
        safefs.check_children(self.path, _SUBDIRS)


def is_read_only(path: Path) -> bool:
    """The volume at ``path`` cannot be written by this pod: mounted read-only (a PVC with
    ``readOnly: true``, a read-only bind mount: ``ST_RDONLY``), or not writable by its user.
    Such a pod writes nothing there: a hit needs no write (principle 3), a miss waits for a
    publisher."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return True
    except OSError:
        return False  # the root's own checks report an unusable volume
    return not os.access(path, os.W_OK)


def is_writable_folder(path: Path) -> bool:
    """``path`` is a real folder (no link) this pod can write: ``usage/`` mounted read-write over a
    read-only volume (the chart's ``trust.recordUse``). Missing or unreadable: False."""
    try:
        folder = stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False
    return folder and not is_read_only(path)


def open_root(path: Path, *, create: bool) -> CacheRoot:
    """Check (and with ``create``, initialise) the layout at ``path``.

    Read-only use (the hit path, inspection) needs no write access; ``create`` makes the
    layout on first use. A root written by a newer layout is refused, never misread.
    """
    root = CacheRoot(path)
    marker = path / MARKER
    try:
        layout = _read_marker(marker)
    except FileNotFoundError:
        if not path.is_dir():
            # Never created here: a missing mount would silently cache to the container's disk.
            raise VolumeError(
                f"cache root {path} does not exist",
                remedy="mount the compile cache PVC there, or set CACHEMGR_CACHE_ROOT to where it is mounted",
                path=str(path),
            ) from None
        layout = None
    if layout is not None and layout > LAYOUT_VERSION:
        raise VolumeError(
            f"cache root {path} was written by a newer cachemgr (layout {layout} in {marker}; this one "
            f"reads {LAYOUT_VERSION})",
            remedy="run the newer image, or give this one a separate cache volume",
            path=str(marker),
        )
    root.check_layout()
    if create:
        _initialise(root, has_marker=layout is not None)
    return root


# Layouts are numbered 1, 2, ...: a number past this is no layout any cachemgr writes, and is
# called damage rather than "a newer cachemgr" (a marker claiming layout 2**63: the fuzzer).
_LAYOUT_MAX = 999


def _read_marker(marker: Path) -> int:
    try:
        layout = jsonread.read(marker)["layout"]
    except FileNotFoundError:
        raise
    except PermissionError as error:
        raise _volume_error(marker.parent, error, "read") from error
    except (ValueError, KeyError, TypeError, OverflowError):
        layout = None
    except OSError as error:
        raise _volume_error(marker.parent, error, "read") from error
    if not isinstance(layout, int) or isinstance(layout, bool) or not 1 <= layout <= _LAYOUT_MAX:
        raise VolumeError(
            f"cache root marker {marker} is damaged (not a cachemgr layout record)",
            remedy=f"if this volume is a cachemgr cache, delete {marker} and cachemgr recreates it",
            path=str(marker),
        )
    return layout


def _initialise(root: CacheRoot, *, has_marker: bool) -> None:
    try:
        for name in _SUBDIRS:
            safefs.make_dirs(root.path, root.path / name)
        if not has_marker:
            _create_marker(root.path)
    except OSError as error:
        raise _volume_error(root.path, error, "initialise") from error


def _create_marker(path: Path) -> None:
    with contextlib.suppress(FileExistsError):  # O_EXCL|O_NOFOLLOW: never through a planted link
        write_bytes_durably(path / "CACHEDIR.TAG", _CACHEDIR_TAG.encode("ascii"))
    tmp = path / f".{MARKER}.{os.getpid()}.{random_suffix(4)}"
    atomic_write_json(
        tmp, {"layout": LAYOUT_VERSION, "created_at": time.time(), "created_by": __version__}, within=path
    )
    try:
        # link() fails if the marker exists: two pods initialising at once keep the first one's.
        os.link(tmp, path / MARKER)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path)


def _volume_error(path: Path, error: OSError, doing: str) -> VolumeError | DiskFullError:
    reason = os.strerror(error.errno) if error.errno else str(error)
    if error.errno in {errno.ENOSPC, errno.EDQUOT}:
        # The runner turns this into the full space report (it knows the key).
        return DiskFullError(
            f"cannot {doing} cache root {path}: {reason}",
            remedy="free space on the volume ('cachemgr du', 'cachemgr prune') or raise storage.compileCache.size",
            path=str(path),
        )
    remedy = {
        errno.EROFS: "mount the compile cache PVC read-write",
        errno.EACCES: "make the volume writable by the pod's user (fsGroup in the pod securityContext)",
        errno.EPERM: "make the volume writable by the pod's user (fsGroup in the pod securityContext)",
    }.get(error.errno or 0, "check the compile cache PVC and its mount")
    return VolumeError(f"cannot {doing} cache root {path}: {reason}", remedy=remedy, path=str(path))
