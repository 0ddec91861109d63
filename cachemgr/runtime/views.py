"""The pod-private views of a published entry, which a server on a hit reads and writes.

A view is a pod-local tree of real directories with a symlink per file of the entry. The server
reads the shared files through it, and anything it writes (vllm-rbln saves its bundle again
after every warm-up, by tmp file + rename) lands in the view, never in the shared entry, whose
files are also read-only. The ``vllm`` strategy points ``VLLM_CACHE_ROOT`` at it, the
``command`` strategy fills ``{artifact_dir}`` with it.

Each start's view lives in a home of its own under the state dir's ``views/``, with one anchor
per directory of the entry::

    views/ENTRY16.PID-TICKS.RANDOM/
        e/0 -> /var/cache/cachemgr/entries/NAME/artifacts                 (anchors: absolute)
        e/1 -> /var/cache/cachemgr/entries/NAME/artifacts/compiled_models/M/sub
        v/                                                                 (what the server gets)
            rank0.rbln -> ../e/0/rank0.rbln
            compiled_models/M/sub/graph.rbln -> ../../../../e/1/graph.rbln

The file links are relative, through their directory's anchor, so they stay short whatever the
entry's names: ext4 keeps a link target under 60 bytes in the inode itself and gives a longer
one a 4 KiB block of its own, which doubles the time a view of 2,000 files takes and costs its
emptyDir 8 MiB (bench/bench_warm.py; the absolute path of a file in an entry is over 100 bytes). A folder
nested so deep that the climb to its anchor is longer than its own path gets absolute links.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from cachemgr.core.fsutil import random_suffix, remove_tree
from cachemgr.core.log import get_logger
from cachemgr.core.procs import Flag, same_process, start_ticks
from cachemgr.volume.manifest import ARTIFACTS, Manifest

ANCHORS = "e"  # views/HOME/e/N -> a directory of the entry's artifacts
ROOT = "v"  # views/HOME/v: the view itself

log = get_logger("cachemgr.run")


_STOP_EVERY = 512  # files between looks at the stop flag: a view of 100,000 files takes seconds


def build_view(views: Path, entry: Path, manifest: Manifest, *, stop: Flag | None = None) -> Path:
    """A fresh pod-local tree mirroring ``entry/artifacts`` with a symlink per file; its path.

    Built from the manifest's file list (no walk of the shared volume): one mkdir per
    directory and one symlink per file, with plain strings (this is on the hit path). Each
    start gets a new home under ``views``; earlier ones are removed after the server started
    (:func:`remove_old_views`), since unlinking thousands of links costs as much as making them.
    ``InterruptedError`` once ``stop`` is set meanwhile (a termination signal): the half view is removed.
    """
    views.mkdir(parents=True, exist_ok=True)
    home = _new_dir(views, f"{entry.name[-16:]}.{_owner_tag()}.")
    # Absolute: a relative --cache-root would dangle from the view.
    target_base = os.path.join(os.path.abspath(entry), ARTIFACTS)
    view, anchors = os.path.join(home, ROOT), os.path.join(home, ANCHORS)
    try:
        os.mkdir(view)
        os.mkdir(anchors)
        for number, (folder, names) in enumerate(_by_folder(manifest).items()):
            _check_stop(stop)
            way = _anchor(anchors, str(number), folder, target_base)
            _link_folder(view, folder, way, names, stop=stop)
    except BaseException:
        remove_tree(home)  # half a view serves nothing: give its inodes back
        raise
    return Path(view)


def _check_stop(stop: Flag | None) -> None:
    if stop is not None and stop.is_set():
        raise InterruptedError("stopped while the view was built")


def _by_folder(manifest: Manifest) -> dict[str, list[str]]:
    """The artifacts' names by folder (``""``: the top), in the manifest's order."""
    prefix = ARTIFACTS + "/"
    cut = len(prefix)
    folders: dict[str, list[str]] = {}
    for record in manifest.files:
        if record.path.startswith(prefix):
            folder, _, name = record.path[cut:].rpartition("/")
            names = folders.get(folder)
            if names is None:
                names = folders[folder] = []
            names.append(name)
    return folders


def _anchor(anchors: str, number: str, folder: str, target_base: str) -> str:
    """How a link in the view's ``folder`` reaches the entry's: through anchor ``number``."""
    target = os.path.join(target_base, folder) if folder else target_base
    way = "../" * (folder.count("/") + 2 if folder else 1) + f"{ANCHORS}/{number}/"
    if len(way) > len(target):
        # Some 40 folders deep the climb is longer than the folder's own path (and past 800,
        # longer than a link may hold): the absolute path is the shorter way.
        return target + "/"
    os.symlink(target, os.path.join(anchors, number))
    return way


def _link_folder(view: str, folder: str, way: str, names: list[str], *, stop: Flag | None) -> None:
    """One link per name in the view's ``folder`` (made here), each to ``way`` + its name.

    The links are made relative to the folder's descriptor: the kernel then resolves one name
    per link, not the view's whole path (2,000 links: a fifth less time on ext4).
    """
    path = os.path.join(view, folder) if folder else view
    if folder:
        os.makedirs(path, exist_ok=True)
    fd = os.open(path, _DIR_FLAGS)
    try:
        symlink = os.symlink
        for count, name in enumerate(names, 1):
            symlink(way + name, name, dir_fd=fd)
            if count % _STOP_EVERY == 0:
                _check_stop(stop)  # SIGTERM: the caller removes the half-built view
    finally:
        os.close(fd)


# O_NOFOLLOW: the folder was made here a moment ago; a link in its place is not followed.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _new_dir(parent: Path, prefix: str) -> Path:
    """A new directory ``prefix`` + random hex under ``parent`` (what ``tempfile.mkdtemp`` does,
    without importing tempfile, shutil and random on the hit path)."""
    for _ in range(100):
        path = parent / f"{prefix}{random_suffix(4)}"
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free view name under {parent}")


def remove_old_views(views: Path, *, keep: Path) -> None:
    """Delete the views of earlier starts but ``keep`` (a background thread calls this after
    launch; ``keep`` is what :func:`build_view` returned).

    Only views whose owner is gone: a second ``run`` in the same pod (``kubectl exec``
    inherits the state dir) must never pull the files from under the live server.
    """
    try:
        names = os.listdir(views)
    except FileNotFoundError:
        return
    for name in names:
        path = views / name
        if path != keep.parent and not _owner_alive(name):
            try:
                remove_tree(path)
            except OSError as error:  # in a thread beside the server: the others still go
                log.warning("old_view_left", view=str(path), error=str(error))


def _owner_tag() -> str:
    """``PID-STARTTICKS`` of this process: who a view belongs to, safe against pid reuse."""
    pid = os.getpid()
    return f"{pid}-{start_ticks(pid) or 0}"


def _owner_alive(name: str) -> bool:
    """Is the process that built view ``name`` (``ENTRY16.PID-TICKS.RANDOM``) still running?

    Our own other views count as dead (a start makes one); a name without an owner tag comes
    from a cachemgr before owners were recorded, whose container is gone.
    """
    parts = name.split(".")
    pid_text, _, ticks_text = parts[1].partition("-") if len(parts) == 3 else ("", "", "")
    if not (pid_text.isdigit() and ticks_text.isdigit()):
        return False
    pid, ticks = int(pid_text), int(ticks_text)
    return pid != os.getpid() and same_process(pid, ticks or None)


def remove_old_views_later(views: Path, *, keep: Path) -> None:
    """:func:`remove_old_views` in a daemon thread: the server is already starting."""
    threading.Thread(
        target=remove_old_views, args=(views,), kwargs={"keep": keep}, name="cachemgr-views", daemon=True
    ).start()
