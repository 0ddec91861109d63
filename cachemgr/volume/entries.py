"""Reading the layout's directories: entry names, an entry's digest, what a tree occupies.

Every listing refuses a symlink where a directory of the layout should be (a link planted in
``entries/`` or ``staging/`` is never read through) and skips temporary dot names.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from pathlib import Path

from cachemgr.core import safefs, safewalk
from cachemgr.core.coerce import read_dict
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.manifest import KEY_NAME, SUMMARY_NAME

DIGEST = re.compile(r"[0-9a-f]{32}")


def entry_names(root: CacheRoot) -> list[str]:
    """Names of published entry directories, sorted; temporary dot names are skipped.

    Real directories only: a symlink in ``entries/`` is not an entry and is never read through
    (a pod that looks its key up moves it aside).
    """
    return [name for name in safefs.subdirs(root.path, root.entries) if not name.startswith(".")]


def entry_digest(root: CacheRoot, name: str) -> str:
    """An entry's full digest from its summary or key.json, else the 16 digits in its name."""
    for file in (SUMMARY_NAME, KEY_NAME):
        key = read_dict(root.entries / name / file).get("key")
        if isinstance(key, str) and DIGEST.fullmatch(key) and name.endswith(key[:16]):
            return key
    return name.rsplit("__", 1)[-1]


def listdir(path: Path) -> list[str]:
    """Names in a directory of the layout, never listed through a symlink (then: nothing)."""
    try:
        fd = os.open(path, safefs.DIR_FLAGS)
    except OSError as error:
        if isinstance(error, FileNotFoundError | NotADirectoryError) or error.errno == errno.ELOOP:
            return []
        raise
    try:
        return sorted(n for n in os.listdir(fd) if not n.startswith("."))
    finally:
        os.close(fd)


def tree_usage(path: Path) -> tuple[int, int]:
    """(own bytes, bytes shared by hard link) of a tree: the vllm strategy's staging copy and
    its published entry share inodes, and counting both would double the figure."""
    own = shared = 0
    try:
        # Its last component refused as a link, nothing below followed (the layout directories
        # above it were checked when the root was opened).
        with safefs.open_tree(path, within=None) as top:
            for _, item, _ in safewalk.walk(top):
                with contextlib.suppress(FileNotFoundError):
                    st = item.stat(follow_symlinks=False)
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    if st.st_nlink > 1:
                        shared += st.st_size
                    else:
                        own += st.st_size
    except (FileNotFoundError, NotADirectoryError, safefs.UnsafePathError):
        return own, shared
    return own, shared
