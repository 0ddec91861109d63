"""Hints that let ``ls`` and ``du`` skip reading what has not changed: one file for the volume.

A scan reads, per entry, its ``summary.json``, the ``lstat`` of its manifest and its usage
folder: a handful of metadata round trips, one after another. On a network filesystem that is
milliseconds an entry (11.8 to 12.9 s for 10,000 entries on JuiceFS: docs/benchmarks.md, "`ls`
and `du` on 10,000 entries"). But a published entry does not change, and the usage folder of an
entry nobody uses changes only when a pod comes or goes. So ``ls`` and ``du`` keep what they read
in ``<root>/scan-hints.json`` and, next time, take each row only where a listing they make
anyway still shows the same thing: the entry directory's (and its usage folder's) inode, mtime
and ctime, which a listing brings along (FUSE and NFS READDIRPLUS fill the attribute cache, so
the ``stat`` of a listed name costs no round trip), and which change when anything is added,
removed or renamed in them. Anything else is read as before: a usage folder holding use records
(its pods beat every 2 s: their freshness is read, never hinted), an entry not in the hints, one
whose directory changed, every damaged one.

The file is on the volume, where anyone may write: a hint is trusted only for what is shown.
Rows are checked like the summaries they copy; a name the listing does not show is ignored; a
scan that decides anything (``prune``, the space check before a compile) never reads hints. What
a writer who keeps directory times intact can make ``ls`` show is what it could already make it
show by rewriting a summary. The file is rewritten (atomically; any failure, a read-only volume
among them, is ignored) by a scan that had to read many entries afresh.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachemgr.core import jsonread
from cachemgr.core.fsutil import random_suffix, write_bytes_durably
from cachemgr.volume.entries import entry_names
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.records import Usage

HINTS_NAME = "scan-hints.json"
FORMAT = 1
MAX_BYTES = 64 << 20  # far above 10,000 rows (~5 MB); a larger file is damage, not hints
REWRITE_AFTER = 64  # entries read afresh before a scan rewrites the file

Stamp = tuple[int, int, int]  # (inode, mtime ns, ctime ns) of a directory, from a listing


def stamp_of(st: os.stat_result) -> Stamp:
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def row_stamp(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """A row's stamp as a tuple to compare with a listing's; ``()`` (matching none) for anything
    but a list: the file is anyone's to write, and a ``"stamp": 5`` made ls and du exit 70."""
    stamp = row.get("stamp")
    return tuple(stamp) if isinstance(stamp, list) else ()


def listing(fd: int | None) -> dict[str, Stamp]:
    """The real directories in the layout directory open as ``fd``, with their stamps."""
    if fd is None:
        return {}
    found: dict[str, Stamp] = {}
    with os.scandir(fd) as items:
        for item in items:
            if item.name.startswith("."):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = item.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    found[item.name] = stamp_of(st)
    return found


@dataclass
class Hints:
    """The rows of ``scan-hints.json``, and what this scan learnt for the next one."""

    entries: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"stamp", "summary"}
    folders: dict[str, dict[str, Any]] = field(default_factory=dict)  # digest -> {"stamp", counts...}
    fresh: dict[str, dict[str, Any]] = field(default_factory=dict)  # rows this scan read itself
    fresh_usage: dict[str, dict[str, Any]] = field(default_factory=dict)
    listed: dict[str, Stamp] = field(default_factory=dict)  # entries/ as this scan listed it
    usage_listed: dict[str, Stamp] = field(default_factory=dict)  # usage/ as this scan listed it

    def summaries(
        self, check: Callable[[Any, str], dict[str, Any] | str]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(name, summary) of each listed entry whose directory is still what its row saw and
        whose hinted summary passes ``check`` (the scan's own check of a summary it reads)."""
        for name, seen in sorted(self.listed.items()):
            row = self.entries.get(name)
            if row is None or row_stamp(row) != seen or not isinstance(row.get("summary"), dict):
                continue
            checked = check(dict(row["summary"]), name)
            if isinstance(checked, dict):
                yield name, checked

    def usage(self, digest: str, read: Callable[[], Usage]) -> Usage:
        """A usage folder as hinted while it did not change and held no use records; else read
        now (and remembered, if it holds none)."""
        seen = self.usage_listed.get(digest)
        hinted = self.usage_of(digest, seen) if seen is not None else None
        if hinted is not None:
            return hinted
        usage = read()
        if not usage.live and not usage.silent:
            self.learn_usage(digest, seen, usage)
        return usage

    def usage_of(self, digest: str, seen: Stamp) -> Usage | None:
        """A usage folder without use records as hinted, if it did not change: its time (the
        folder's mtime, as a read takes it), its recompile marks and its ended starts."""
        row = self.folders.get(digest)
        if row is None or row_stamp(row) != seen:
            return None
        recompiled, starts, waited = row.get("recompiled"), row.get("starts"), row.get("waited")
        if not isinstance(recompiled, int) or recompiled < 0 or not isinstance(starts, dict):
            return None
        if not isinstance(waited, list) or not all(isinstance(n, str) for n in waited):
            return None
        if not all(isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in starts.items()):
            return None
        failed = row.get("server_failed", {})
        if not isinstance(failed, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in failed.items()
        ):
            return None
        sec, ns = divmod(seen[1], 10**9)  # as os.stat computes st_mtime, to the last bit
        return Usage(
            last=sec + ns * 1e-9,
            recompiled_on_hit=recompiled,
            starts=starts,
            waited=tuple(waited),
            server_failed=failed,
        )

    def learn(self, name: str, summary: Mapping[str, Any]) -> None:
        """A summary read and checked now, for the entry directory as this scan listed it."""
        seen = self.listed.get(name)
        if seen is not None:
            self.fresh[name] = {"stamp": list(seen), "summary": dict(summary)}

    def learn_usage(self, digest: str, seen: Stamp | None, usage: Usage) -> None:
        """A usage folder read now that held no use records (nobody there to beat)."""
        if seen is not None:
            self.fresh_usage[digest] = {
                "stamp": list(seen),
                "recompiled": usage.recompiled_on_hit,
                "starts": dict(usage.starts),
                "waited": list(usage.waited),
                "server_failed": dict(usage.server_failed),
            }


def names(
    root: CacheRoot, entries_fd: int | None, usage_fd: int | None, hints: Hints | None
) -> tuple[list[str], frozenset[str]]:
    """The entries' names, sorted, and the usage folders' (with ``hints``, both with their stamps,
    kept in ``hints`` for :meth:`Hints.summaries` and :meth:`Hints.usage`)."""
    if hints is None:
        return entry_names(root), frozenset(os.listdir(usage_fd)) if usage_fd is not None else frozenset()
    hints.listed, hints.usage_listed = listing(entries_fd), listing(usage_fd)
    return sorted(hints.listed), frozenset(hints.usage_listed)


def load(root: CacheRoot) -> Hints:
    """The volume's hints; none if the file is missing, not a regular file, too large or damaged."""
    try:
        data = jsonread.read(root.path / HINTS_NAME, limit=MAX_BYTES)
    except (OSError, ValueError):
        return Hints()
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return Hints()
    entries, usage = data.get("entries"), data.get("usage")
    return Hints(
        entries={k: v for k, v in entries.items() if isinstance(v, dict)}
        if isinstance(entries, dict)
        else {},
        folders={k: v for k, v in usage.items() if isinstance(v, dict)} if isinstance(usage, dict) else {},
    )


def save(root: CacheRoot, hints: Hints | None, *, read: int) -> None:
    """Rewrite the file when a scan read ``read`` entries afresh (:data:`REWRITE_AFTER` or more):
    the rows still listed, kept where the listing still matches them, with what was read.
    Best effort: never fails a scan."""
    if hints is None or read < REWRITE_AFTER:
        return
    entries, usage = hints.listed, hints.usage_listed
    rows = {n: r for n, r in hints.entries.items() if n in entries and row_stamp(r) == entries[n]}
    rows.update(hints.fresh)
    used = {d: r for d, r in hints.folders.items() if d in usage and row_stamp(r) == usage[d]}
    used.update(hints.fresh_usage)
    data = {"format": FORMAT, "entries": rows, "usage": used}
    # Compact: 5 MB for 10,000 entries, written in 40 ms (indented: 7.6 MB, 200 ms).
    raw = json.dumps(data, separators=(",", ":")).encode()
    tmp = f".{HINTS_NAME}.{random_suffix(8)}.tmp"
    with contextlib.suppress(OSError):
        fd = os.open(root.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # A new name nobody can guess (O_EXCL|O_NOFOLLOW), renamed over the old file: a link
            # planted as scan-hints.json is replaced, never written through.
            write_bytes_durably(Path(tmp), raw, dir_fd=fd)
            os.replace(tmp, HINTS_NAME, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            raise
        finally:
            os.close(fd)
