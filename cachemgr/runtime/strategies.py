"""How a compile happens, and how a server is pointed at a published entry.

``command``: an operator-given compiler runs before the server, writing to ``{output_dir}``
(private staging); the server's argv may name ``{artifact_dir}``.

``vllm``: vllm-rbln compiles inside the server at start-up and writes under
``VLLM_CACHE_ROOT`` (``compiled_models/`` on the optimum path, mega-cache bundles under
``rbln/`` on the vLLM-model path). On a miss the server runs with ``VLLM_CACHE_ROOT`` in
staging; once its health endpoint answers, the staging content is published by hard-linking
it into a second attempt directory that is renamed into place, so the running server keeps
its own directory undisturbed.

On a hit, either server gets a pod-local *view* of the entry: real directories with a
symlink per file. The server reads the shared files, and anything it writes (vllm-rbln
saves its bundle again after every warm-up, by tmp file + rename) lands in the view, never
in the shared entry, whose files are also read-only.
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

from cachemgr.core import safefs
from cachemgr.core.errors import CompileError
from cachemgr.core.fsutil import remove_tree
from cachemgr.core.procs import same_process, start_ticks
from cachemgr.volume.manifest import ARTIFACTS, Manifest

ARTIFACT_DIR = "{artifact_dir}"
OUTPUT_DIR = "{output_dir}"
_LINK_FALLBACK = frozenset({errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EMLINK, errno.EOPNOTSUPP})


def render(argv: Sequence[str], **values: str) -> list[str]:
    """Fill ``{artifact_dir}`` / ``{output_dir}`` placeholders in argv words."""
    out = []
    for word in argv:
        filled = word
        for name, value in values.items():
            filled = filled.replace("{" + name + "}", value)
        out.append(filled)
    return out


def build_view(views: Path, entry: Path, manifest: Manifest) -> Path:
    """A fresh pod-local tree mirroring ``entry/artifacts`` with a symlink per file.

    Built from the manifest's file list (no walk of the shared volume): one mkdir per
    directory and one symlink per file, with plain strings (this is on the hit path). Each
    start gets a new directory under ``views``; earlier ones are removed after the server
    started (:func:`remove_old_views`), since unlinking thousands of links costs as much as
    making them.
    """
    views.mkdir(parents=True, exist_ok=True)
    view = Path(tempfile.mkdtemp(prefix=f"{entry.name[-16:]}.{_owner_tag()}.", dir=views))
    prefix = ARTIFACTS + "/"
    cut = len(prefix)
    # Absolute: the links are read from the view, so a relative --cache-root would dangle.
    target_base = os.path.join(os.path.abspath(entry), ARTIFACTS)
    view_base = os.fspath(view)
    join, symlink, dirname = os.path.join, os.symlink, os.path.dirname
    made: set[str] = {""}
    for record in manifest.files:
        if not record.path.startswith(prefix):
            continue
        rel = record.path[cut:]
        parent = dirname(rel)
        if parent not in made:
            os.makedirs(join(view_base, parent), exist_ok=True)
            made.add(parent)
        symlink(join(target_base, rel), join(view_base, rel))
    return view


def remove_old_views(views: Path, *, keep: Path) -> None:
    """Delete the views of earlier starts (a background thread calls this after launch).

    Only views whose owner is gone: a second ``run`` in the same pod (``kubectl exec``
    inherits the state dir) must never pull the files from under the live server.
    """
    try:
        names = os.listdir(views)
    except FileNotFoundError:
        return
    for name in names:
        path = views / name
        if path != keep and not _owner_alive(name):
            remove_tree(path)


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


def snapshot_tree(source: Path, target: Path, *, within: Path) -> str:
    """Hard-link every file of ``source`` into ``target`` (copy where links are refused).

    Returns "hardlink" or "copy". Directory structure and empty directories are kept. Both live
    under the cache root ``within``: ``source`` is walked from directory descriptors, never
    through a symlink (a link swapped in for the server's directory would otherwise publish,
    hard-link and chmod files from outside the volume), and each file is linked or copied from
    its own directory's descriptor. Anything but regular files and directories in the server's
    output is a failed compile: an entry holds nothing else.
    """
    method = "hardlink"
    safefs.make_dirs(within, target)
    with safefs.open_tree(source, within=within) as top:
        for rel, entry, parent in safefs.walk(top):
            dst = target / rel
            if entry.is_dir(follow_symlinks=False):
                safefs.make_dirs(within, dst)
                continue
            if not entry.is_file(follow_symlinks=False):
                what = safefs.describe(entry.stat(follow_symlinks=False))
                raise CompileError(
                    f"the server left {what} at {rel} in its output; an entry holds only regular files "
                    "and directories",
                    remedy="nothing was published; the server's own compile cache must hold real files",
                    path=rel,
                )
            if method == "hardlink":
                try:
                    os.link(entry.name, dst, src_dir_fd=parent, follow_symlinks=False)
                    continue
                except OSError as error:
                    if error.errno not in _LINK_FALLBACK:
                        raise
                    method = "copy"
            _copy_at(parent, entry.name, dst)
    return method


def _copy_at(parent: int, name: str, dst: Path) -> None:
    """Copy file ``name`` of directory ``parent`` to a new ``dst``, mtime kept (never via a link)."""
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            while chunk := os.read(src, 1 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view) :]
            st = os.fstat(src)
            os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(out)
    finally:
        os.close(src)


def default_health_url(host: str | None, port: int | None) -> str | None:
    if port is None:
        return None
    if not host or host in {"0.0.0.0", "::", ""}:  # noqa: S104  # a wildcard bind is reached on loopback
        host = "127.0.0.1"
    return f"http://{host}:{port}/health"


def health_ok(url: str, *, timeout: float = 1.0) -> bool:
    """True when the server's health endpoint answers 200 now."""
    import http.client  # with ssl behind it: not needed before the server starts

    parsed = urllib.parse.urlsplit(url)
    conn_cls = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parsed.hostname or "127.0.0.1", parsed.port, timeout=timeout)
    try:
        conn.request("GET", parsed.path or "/")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def wait_healthy(url: str, *, deadline: float, every: float = 0.2) -> bool:
    """Poll the health endpoint until it answers or ``deadline`` (monotonic) passes."""
    while time.monotonic() < deadline:
        if health_ok(url):
            return True
        time.sleep(every)
    return False
