"""A trusting pod's content check: every artifact's bytes against its signed BLAKE3, before the launch.

The interface is what a parallel reader of an entry needs: files in order -> the first problem.
The reading is :func:`cachemgr.volume.reader.read_entry`'s, the one parallel reader of an entry
that the read-ahead after a launch uses too: a few threads at once (a network filesystem answers
one request per round trip; BLAKE3 hashes several GiB/s per core and releases the GIL), each file
whole by one of them with its hash riding on the read, so a check keeps up with the disk rather
than with one request at a time, and what it reads is in the page cache when the server loads it.
That is why a trusting hit needs no read-ahead: the check was it, one pass, not two
(docs/benchmarks.md, "Trust checks", from bench/bench_trust.py).

Everything is reached from the cache root as the rest of cachemgr reaches it
(:mod:`cachemgr.core.safefs`): the entry from the root one level at a time, each folder below it
from its parent with ``O_NOFOLLOW|O_DIRECTORY`` on the root's filesystem, each file with
``O_NOFOLLOW`` (``O_NONBLOCK``: a FIFO cannot block the open), and the bytes hashed are those of
what was opened.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

from cachemgr.core.units import plural
from cachemgr.volume.manifest import Problem

if TYPE_CHECKING:
    from blake3 import blake3 as Blake3  # noqa: N812  # the hasher's class, named as a type

# Threads reading at once: enough to keep a disk's or a network filesystem's queue full (each
# waits on its read most of the time; BLAKE3 hashes several GiB/s a core without the GIL).
# Fewer left the disk idle here, on two cores (docs/benchmarks.md, "Trust checks").
WORKERS = 8
# EACCES is no flaky volume: a writer took the read away (a mode changed after signing, which the
# pod's user cannot undo). Untrusted, then, like any change: never an exit of every pod that reads
# the volume, and the signing key's holder replaces the entry (cachemgr.runtime.unusable).
_UNREADABLE = "not readable by this pod: its mode was changed"
# The reader's reasons for leaving a file (cachemgr.volume.reader._why), as what changed.
_CHANGES = {
    "missing": "missing",
    "unsafe_path": "its folder is missing or not a directory",
    "not_a_regular_file": "not a regular file",
    "not_permitted": _UNREADABLE,
    "size_changed": "its size is not the signed size",
}


class Expected(NamedTuple):  # one per file of a trusting hit: a NamedTuple is the cheap record
    """One file as signed: its path in the entry, its size and its BLAKE3 (hex)."""

    path: str
    size: int
    blake3: str


class StopFlag(Protocol):
    """``threading.Event`` or the runner's signal-safe flag."""

    def is_set(self) -> bool: ...


def first_problem(
    root: Path,
    entry: Path,
    files: Sequence[Expected],
    *,
    workers: int = WORKERS,
    stop: StopFlag | None = None,
) -> Problem | None:
    """The first of ``files`` (in their order) whose bytes are not what was signed; None if all are.

    Missing, not a regular file, not readable (EACCES), another size, other bytes: each a
    :class:`Problem` saying the file changed after signing; the read stops at the first wrong
    hash. Raises ``OSError`` for any other I/O error (a flaky volume is not tampering),
    :class:`~cachemgr.core.safefs.UnsafePathError` if the entry itself is not a real directory,
    and ``InterruptedError`` once ``stop`` is set (SIGTERM: no server starts after it).
    """
    if not files:
        return None
    from blake3 import blake3  # a trusting pod's hit only

    from cachemgr.volume.reader import read_entry

    hashers: dict[int, Blake3] = {}
    wrong: dict[int, Problem] = {}
    found_wrong = threading.Event()

    def hashing(index: int, offset: int, data: memoryview) -> None:
        # One worker reads a file whole, in order (read_entry with a chunk callback).
        hasher = hashers[index] = blake3() if offset == 0 else hashers[index]
        hasher.update(data)
        expected = files[index]
        if offset + len(data) == expected.size and hasher.hexdigest() != expected.blake3:
            wrong[index] = _changed(expected, "its bytes differ from the signed BLAKE3")
            found_wrong.set()  # nothing more to read: the entry is untrusted

    result = read_entry(
        entry,
        files,
        range(len(files)),
        within=root,
        mechanism="read",
        workers=max(1, min(workers, len(files))),
        stop=_Either(stop, found_wrong),
        on_chunk=hashing,
    )
    if stop is not None and stop.is_set():
        raise InterruptedError("stopped while checking the entry")
    problems = dict(wrong)
    for index, why in result.left.items():
        if why == "unreadable":
            raise result.error or OSError(f"{files[index].path}: could not be read")
        if why in _CHANGES:
            problems.setdefault(index, _changed(files[index], _CHANGES[why]))
    empty = blake3().hexdigest()
    for index in result.files_done:  # an empty file has no chunk to hash
        if files[index].size == 0 and files[index].blake3 != empty:
            problems.setdefault(index, _changed(files[index], "its bytes differ from the signed BLAKE3"))
    if problems:
        # The workers stop at the first wrong file any of them finds, which need not be the first
        # in order: the files before it that were not read whole are read again, one at a time.
        first = min(problems)
        done = set(result.files_done)
        earlier = [files[i] for i in range(first) if i not in done]
        if earlier:
            again = first_problem(root, entry, earlier, workers=1, stop=stop)
            if again is not None:
                return again
        return problems[first]
    if not found_wrong.is_set() and len(result.files_done) < len(files):
        raise OSError(f"{entry}: {plural(len(files) - len(result.files_done), 'file')} not read whole")
    return None


def _changed(expected: Expected, how: str) -> Problem:
    return Problem(expected.path, f"changed after signing ({how})")


class _Either:
    """Set when either flag is: the pod's stop (SIGTERM), or a file already found wrong."""

    def __init__(self, first: StopFlag | None, second: threading.Event) -> None:
        self._first = first
        self._second = second

    def is_set(self) -> bool:
        return self._second.is_set() or (self._first is not None and self._first.is_set())
