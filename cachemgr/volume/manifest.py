"""The manifest: an entry's commit record, written last, checked on every hit.

An entry is ``key.json`` (its full key inputs, for explaining misses), ``artifacts/`` (what
the compiler produced) and ``manifest.json``: every file's path, size, mtime and xxh3-128, and
the key it was compiled for. The manifest is written last in private staging, so a directory
without a valid one was never committed. A hit checks the manifest against the files: sizes
and mtimes on every start (fast), hashes on request (full).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from stat import S_ISREG
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

from cachemgr import __version__
from cachemgr.core import jsonread, safefs, safewalk
from cachemgr.core.fsutil import atomic_write_json, hash_fd, hash_file, walk_files

MANIFEST_NAME = "manifest.json"
KEY_NAME = "key.json"
# A few hundred bytes that `ls` and `du` read instead of the manifest (which lists every file).
SUMMARY_NAME = "summary.json"
ARTIFACTS = "artifacts"
MANIFEST_FORMAT = 1

VerifyMode = Literal["fast", "full"]


# NamedTuples, not dataclasses: this module is on every hit, where importing ``dataclasses`` (and
# with it ``inspect``) and defining one cost a pod's start milliseconds (docs/benchmarks.md, "The
# hit path without dataclasses"); and a hit makes one FileRecord per file.
class FileRecord(NamedTuple):
    path: str
    size: int
    xxh3: str
    # Nanoseconds, as published: a write into the entry (root, or its owner after a chmod) moves
    # it, and the fast check compares it from the lstat it makes anyway. None in older manifests.
    mtime_ns: int | None = None
    # BLAKE3 of the bytes, in a signed entry only (cachemgr.volume.trust: the signed statement
    # commits to every artifact's path, size and this hash). None in the open mode.
    blake3: str | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "path": self.path,
            "size": self.size,
            "xxh3": self.xxh3,
            "mtime_ns": self.mtime_ns,
        }
        if self.blake3 is not None:
            data["blake3"] = self.blake3
        return data


class Manifest(NamedTuple):
    """What was published: files with sizes and hashes, and the key they were compiled for."""

    key: str
    inputs: Mapping[str, Any]
    files: tuple[FileRecord, ...]
    created_at: float
    created_by: Mapping[str, Any]
    compile_seconds: float
    strategy: str
    model_name: str = ""
    format: int = MANIFEST_FORMAT
    extra: Mapping[str, Any] = MappingProxyType({})

    @property
    def total_bytes(self) -> int:
        return sum(record.size for record in self.files)

    def to_json(self) -> dict[str, Any]:
        data = {
            name: dict(value) if isinstance(value, Mapping) else value
            for name, value in self._asdict().items()
        }
        data["files"] = [record.to_json() for record in self.files]
        data["total_bytes"] = self.total_bytes
        return data


class ManifestError(ValueError):
    """A manifest is missing or not a manifest: the entry was never committed or is damaged."""


class Problem(NamedTuple):
    """One thing wrong with an entry, in words an operator can act on."""

    path: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


def build_manifest(
    entry_dir: Path,
    *,
    key: str,
    inputs: Mapping[str, Any],
    created_by: Mapping[str, Any],
    compile_seconds: float,
    strategy: str,
    model_name: str,
    extra: Mapping[str, Any] | None = None,
    blake3: bool = False,
) -> Manifest:
    """Hash every file under ``entry_dir`` (key.json and artifacts/) into a manifest.

    ``blake3`` (a signed publish): each file's BLAKE3 too, from the same read as its xxh3.
    """
    files = tuple(
        _record(entry_dir, rel, st, blake3=blake3)
        for rel, st in walk_files(entry_dir)
        if rel != MANIFEST_NAME
    )
    return Manifest(
        key=key,
        inputs=dict(inputs),
        files=files,
        created_at=time.time(),
        created_by={**created_by, "cachemgr": __version__},
        compile_seconds=round(compile_seconds, 3),
        strategy=strategy,
        model_name=model_name,
        extra=dict(extra or {}),
    )


def _record(entry_dir: Path, rel: str, st: os.stat_result, *, blake3: bool) -> FileRecord:
    if not blake3:
        return FileRecord(rel, st.st_size, hash_file(entry_dir / rel), st.st_mtime_ns)
    from blake3 import blake3 as hasher  # a signed publish only

    second = hasher()
    xxh3 = hash_file(entry_dir / rel, also=second)
    return FileRecord(rel, st.st_size, xxh3, st.st_mtime_ns, second.hexdigest())


def write_manifest(entry_dir: Path, manifest: Manifest, *, within: Path | None = None) -> None:
    """``within``: the cache root, from which ``entry_dir`` is reached one level at a time."""
    atomic_write_json(entry_dir / MANIFEST_NAME, manifest.to_json(), within=within)


def read_manifest(entry_dir: Path) -> Manifest:
    """Parse ``entry_dir/manifest.json``; ``ManifestError`` for missing or damaged ones.

    Anything but a regular file there (a directory, a symlink, a FIFO), one past the size cap, or
    one the reader refuses is damage, not an I/O error: a pod quarantines the entry and compiles,
    instead of exiting 74 on every start. Other I/O errors are ``OSError``: a flaky volume.
    """
    path = entry_dir / MANIFEST_NAME
    try:
        raw = jsonread.read_bytes(path)
    except (FileNotFoundError, NotADirectoryError):
        raise ManifestError(f"{path} is missing: the entry was never committed") from None
    except ValueError as error:
        raise ManifestError(f"{path} is not valid JSON ({error})") from None
    return parse_manifest(raw, path=path)


def parse_manifest(raw: bytes, *, path: Path) -> Manifest:
    """A manifest's bytes, read by the caller (from a descriptor, or from the remote) -> Manifest.

    ``ManifestError`` naming ``path`` if they are not a cachemgr manifest (:mod:`cachemgr.core.jsonread`
    bounds what is parsed: a document nested 200,000 deep is damage like any other).
    """
    try:
        data = jsonread.parse(raw)
    except ValueError as error:
        raise ManifestError(f"{path} is not valid JSON ({error})") from None
    try:
        return _from_json(data)
    # AttributeError: a file record that is not an object ("files": ["x"], planted on the volume
    # or in the bucket) has no .get; it made every pod that hit the entry exit 70.
    except (AttributeError, KeyError, TypeError, ValueError, OverflowError) as error:
        raise ManifestError(f"{path} is not a cachemgr manifest ({_why(error)})") from None


def _why(error: Exception) -> str:
    """What is wrong, in words of ours: a KeyError's or TypeError's text may quote the document."""
    if isinstance(error, KeyError):
        return "a field is missing"
    if isinstance(error, AttributeError | TypeError | OverflowError):
        return "a field is of the wrong type"
    return str(error)[:200]


def _from_json(data: Any) -> Manifest:
    if not isinstance(data, dict):
        raise TypeError("top level is not an object")
    if int(data["format"]) > MANIFEST_FORMAT:
        raise ValueError(f"manifest format {data['format']} is newer than this cachemgr reads")
    files = tuple(map(_file_record, data["files"]))
    _check_paths(files)
    if not isinstance(data["inputs"], dict):
        raise TypeError("inputs is not an object")
    return Manifest(
        key=str(data["key"]),
        inputs=data["inputs"],
        files=files,
        created_at=float(data["created_at"]),
        created_by=dict(data.get("created_by") or {}),
        compile_seconds=float(data.get("compile_seconds") or 0.0),
        strategy=str(data.get("strategy", "")),
        model_name=str(data.get("model_name", "")),
        format=int(data["format"]),
        extra=dict(data.get("extra") or {}),
    )


def _file_record(item: Mapping[str, Any]) -> FileRecord:
    """One file's entry of the list, its types checked (positional: this runs per file on a hit)."""
    path, size, xxh3 = item["path"], item["size"], item["xxh3"]
    mtime_ns, blake3 = item.get("mtime_ns"), item.get("blake3")
    if not (
        type(path) is str
        and type(size) is int
        and size >= 0
        and type(xxh3) is str
        and (mtime_ns is None or type(mtime_ns) is int)
        and (blake3 is None or type(blake3) is str)
    ):
        raise TypeError("a file record holds a field of the wrong type")
    return FileRecord(path, size, xxh3, mtime_ns, blake3)


def _check_paths(files: Sequence[FileRecord]) -> None:
    """Each path spelled as :func:`build_manifest` writes it (``a/b``: no empty, ``.`` or ``..``
    part, no NUL, a name the filesystem can hold), each once. The kernel reads ``a//b`` or
    ``./b`` as a plain path and a full check passes, but a pod's view joins and counts the
    parts: ``artifacts//x`` became the absolute ``/x``, and ``a/./b`` a link one level off; a
    path listed twice is a second link."""
    paths = [record.path for record in files]
    if len(set(paths)) != len(paths):
        twice = next(path for path in paths if paths.count(path) > 1)
        raise ValueError(f"file path {twice!r} is listed twice")
    every = "/".join(paths)  # one look at them all: this is on the hit path
    if "\0" in every or not _encodes(every):
        plain = next(path for path in paths if "\0" in path or not _encodes(path))
        raise ValueError(f"file path {plain!r} is not a plain relative path")
    for path in paths:
        parts = path.split("/")
        if ".." in parts or path.startswith("/"):
            raise ValueError(f"file path {path!r} leaves the entry")
        if "" in parts or "." in parts:
            raise ValueError(f"file path {path!r} is not a plain relative path")


def _encodes(path: str) -> bool:
    """A name read from a directory always encodes back; a lone surrogate from JSON does not."""
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        return False
    return True


# O_NONBLOCK: a FIFO where a file should be must not block the check; reads of files ignore it.
_OPEN_NOFOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _survey(
    base: str, files: Sequence[FileRecord], *, within: Path | None
) -> tuple[dict[str, os.stat_result], list[Problem]]:
    """One walk of the entry: the ``lstat`` of each manifest path found, and what the entry holds
    besides regular files and real directories (principle 6: a symlink, FIFO, socket or device
    anywhere in it is damage, listed in the manifest or not; a symlinked directory would serve
    files from outside the volume).

    The walk reads each directory once, relative to its parent's descriptor and never through a
    symlink. A listing brings each file's attributes along on network filesystems (FUSE
    READDIRPLUS, NFS READDIRPLUS), so the size check that follows needs no round trip per file
    (against an ``lstat`` per path: docs/benchmarks.md, "Warm start", from bench/bench_warm.py).
    An entry that is gone leaves its files out: missing.
    """
    wanted = {record.path for record in files}
    found: dict[str, os.stat_result] = {}
    problems: list[Problem] = []
    try:
        with safefs.open_tree(Path(base), within=within) as top:
            for rel, entry, _ in safewalk.walk(top):
                if rel in wanted:  # first: the one test most names need (2,000 on a hit)
                    st = _lstat(entry)
                    if st is not None:
                        found[rel] = st
                    continue
                if entry.is_dir(follow_symlinks=False) or entry.is_file(follow_symlinks=False):
                    continue
                st = _lstat(entry)
                if st is not None and not safefs.is_plain(st):
                    problems.append(
                        Problem(rel, f"{safefs.describe(st)}: an entry holds only files and directories")
                    )
    except (FileNotFoundError, NotADirectoryError):
        return {}, []
    except safefs.UnsafePathError as error:
        return {}, [Problem(".", error.what)]
    return found, problems


def _lstat(entry: safewalk.Found) -> os.stat_result | None:  # only while its directory is open
    try:
        return entry.stat(follow_symlinks=False)
    except FileNotFoundError:  # listed, then removed: a peer moved the entry away meanwhile
        return None


def check_files(
    entry_dir: Path,
    manifest: Manifest,
    *,
    mode: VerifyMode,
    within: Path | None = None,
    on_file: Callable[[int], None] | None = None,
) -> list[Problem]:
    """Compare the files with the manifest: presence, type and size, and with ``full`` their hashes
    (a signed entry's BLAKE3 too, from the same read as the xxh3).

    Anything in the entry other than regular files and real directories is a problem too.
    ``within`` (the cache root) makes the walk refuse a symlink above the entry as well.
    Raises ``OSError`` for I/O errors other than a missing file: a flaky volume is not damage.
    ``on_file(size)`` follows each file of a full check (a progress bar's bytes).
    """
    base = os.fspath(entry_dir)
    found, problems = _survey(base, manifest.files, within=within)
    if mode == "full":
        # Each file is opened by its path, not from the survey's descriptors: an entry a peer
        # moves away meanwhile then shows its files missing, never a hit for a gone path.
        bad = tuple(p.path + "/" for p in problems)
        for record in manifest.files:
            if record.path.startswith(bad):
                problem: Problem | None = Problem(record.path, "missing")  # never read through a link
            else:
                problem = _check_full(base, record)
            if problem is not None:
                problems.append(problem)
            if on_file is not None:
                on_file(record.size)
        return problems
    for record in manifest.files:
        st = found.get(record.path)
        if (
            st is not None
            and st.st_size == record.size
            and S_ISREG(st.st_mode)
            and (record.mtime_ns is None or st.st_mtime_ns == record.mtime_ns)
        ):
            continue  # as published: the common case, without a call per file (2,000 on a hit)
        problem = _check_stat(record, st)
        if problem is not None:
            problems.append(problem)
    return problems


def _check_stat(record: FileRecord, st: os.stat_result | None) -> Problem | None:
    return _check_shape(record, st) or _check_mtime(record, st)


def _check_shape(record: FileRecord, st: os.stat_result | None) -> Problem | None:
    if st is None:
        return Problem(record.path, "missing")
    if not S_ISREG(st.st_mode):
        return Problem(record.path, "not a regular file")
    if st.st_size != record.size:
        return Problem(record.path, f"size {st.st_size} bytes, manifest says {record.size}")
    return None


def _check_mtime(record: FileRecord, st: os.stat_result | None) -> Problem | None:
    if st is not None and record.mtime_ns is not None and st.st_mtime_ns != record.mtime_ns:
        return Problem(record.path, "modified after it was published (its mtime changed)")
    return None


def _check_bytes(fd: int, record: FileRecord) -> Problem | None:
    if record.blake3 is None:
        if hash_fd(fd) != record.xxh3:
            return Problem(record.path, "content differs from the manifest's xxh3-128")
        return None
    from blake3 import blake3  # a signed entry only

    second = blake3()
    if hash_fd(fd, also=second) != record.xxh3:
        return Problem(record.path, "content differs from the manifest's xxh3-128")
    if second.hexdigest() != record.blake3:
        return Problem(record.path, "content differs from its signed BLAKE3 (changed after signing)")
    return None


def _check_full(base: str, record: FileRecord) -> Problem | None:
    """One file as ``cat`` reads it: open (no symlink followed), fstat, hash what was opened."""
    try:
        fd = os.open(os.path.join(base, record.path), _OPEN_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        # Also a file gone since the check began: a peer quarantined the entry, or prune took it.
        return Problem(record.path, "missing")
    except OSError as error:
        if error.errno in {errno.ELOOP, errno.ENXIO}:  # a symlink; a socket
            return Problem(record.path, "not a regular file")
        raise
    try:
        st = os.fstat(fd)
        problem = _check_shape(record, st)
        if problem is None:
            problem = _check_bytes(fd, record)
        # A changed mtime with the same bytes is still a write into a published entry.
        problem = problem or _check_mtime(record, st)
    finally:
        os.close(fd)
    return problem
