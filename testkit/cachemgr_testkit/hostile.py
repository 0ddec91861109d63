"""What a writer of the volume or the bucket plants, for the tests of issue 33 and its fuzzer.

* :data:`DEEP_JSON`: ``'[' * 200000 + ']' * 200000``, 400 KB, under every size cap: a bare
  ``json.loads`` of it reaches Python's recursion limit.
* :func:`deep_folder`: a chain of folders ``depth`` levels deep, made level by level from
  descriptors (a path of 1,100 levels is longer than the kernel takes in one call), with whatever
  ``leaf`` makes at its bottom.
* :func:`remove_deep`: removes what :func:`deep_folder` made (``shutil.rmtree`` recurses and stops
  at the interpreter's limit, which pytest's own cleanup of ``tmp_path`` then meets too).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

DEEP_JSON = b"[" * 200_000 + b"]" * 200_000
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def deep_folder(
    parent: Path, depth: int, *, name: str = "d", leaf: Callable[[int], None] | None = None
) -> Path:
    """``parent/name/name/...`` ``depth`` levels deep; ``leaf(fd)`` is called with the deepest
    folder open (to make a file, a link or a FIFO there by ``dir_fd``). Returns the first level."""
    fd = os.open(parent, _DIR_FLAGS)
    try:
        for _ in range(depth):
            os.mkdir(name, dir_fd=fd)
            child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
        if leaf is not None:
            leaf(fd)
    finally:
        os.close(fd)
    return parent / name


def file_leaf(data: bytes, name: str = "planted.bin") -> Callable[[int], None]:
    def make(fd: int) -> None:
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=fd)
        try:
            os.write(out, data)
        finally:
            os.close(out)

    return make


def link_leaf(target: Path, name: str = "planted.link") -> Callable[[int], None]:
    def make(fd: int) -> None:
        os.symlink(target, name, dir_fd=fd)

    return make


def depth_of(path: Path) -> int:
    """How many folders deep the chain under ``path`` goes (``path`` itself is 1)."""
    depth = 0
    fd = os.open(path, _DIR_FLAGS)
    try:
        while True:
            depth += 1
            with os.scandir(fd) as found:
                folders = [e.name for e in found if e.is_dir(follow_symlinks=False)]
            if not folders:
                return depth
            child = os.open(folders[0], _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)


def remove_deep(path: Path) -> None:
    """Remove ``path`` however deep it goes, read-only folders included, without recursion: a
    descriptor per level (a test process has thousands), no process started (quick tests use it)."""
    parent = os.open(path.parent, _DIR_FLAGS)
    try:
        _remove_in(parent, path.name)
    finally:
        os.close(parent)


def _remove_in(parent: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent)
        return
    stack = [(parent, name, _opened(parent, name))]
    try:
        while stack:
            _, _, fd = stack[-1]
            with os.scandir(fd) as found:
                items = [(e.name, e.is_dir(follow_symlinks=False)) for e in found]
            folder = next((n for n, is_dir in items if is_dir), None)
            for item, is_dir in items:
                if not is_dir:
                    os.unlink(item, dir_fd=fd)
            if folder is not None:
                stack.append((fd, folder, _opened(fd, folder)))
                continue
            up, emptied, _ = stack.pop()
            os.close(fd)
            os.rmdir(emptied, dir_fd=up)
    finally:
        for _, _, fd in stack:
            os.close(fd)


def _opened(parent: int, name: str) -> int:
    os.chmod(name, 0o755, dir_fd=parent, follow_symlinks=True)  # a folder: no link to follow
    return os.open(name, _DIR_FLAGS, dir_fd=parent)
