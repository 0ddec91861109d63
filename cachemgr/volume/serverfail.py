"""Server exits before ready on a hit: the record kept beside the entry, and how it is read.

An entry the server cannot load (a graph the runtime rejects, a bundle of another SDK build)
makes every pod that hits it crash-loop, and the entry itself looks fine: its files match its
manifest. So each pre-ready exit of a server launched on a hit leaves a record beside the
entry's use records, under ``usage/<digest>/``::

    server-failed.<instance>.<stamp>.<pod>.<pid>      JSON: pod, node, exit status, when, last lines

Not ``*.json``, so never read as a use record; prune keeps the usage folder's records as it
keeps the others. ``<instance>`` names the published copy the server failed on (from its
summary's ``created_at``): the count ``ls`` shows, and the policy acts on, is the current
copy's; a copy compiled afresh starts at zero, while the records of a copy set aside stay
(the evidence that a fresh copy fails the same way, so the entry is not the cause).

Anyone who can write the volume writes these files, so a reader treats them as hostile: at
most ``READ_LIMIT`` records, each read only up to ``RECORD_MAX`` bytes, through ``O_NOFOLLOW``
from the folder reached from the root; a malformed one is skipped with a note, and every
string is shown escaped (cachemgr.core.printable) by whoever prints it. Writers bound what they
write: ``LINES_MAX`` lines of at most ``LINE_MAX`` characters, ``KEEP`` records of the copy there
now and ``KEEP_BEFORE`` of the copies before it, the oldest dropped.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cachemgr.core import jsonread, safefs
from cachemgr.core.fsutil import atomic_write_json_at, fit_name
from cachemgr.volume.manifest import SUMMARY_NAME

if TYPE_CHECKING:
    from cachemgr.volume.identity import PodIdentity
    from cachemgr.volume.layout import CacheRoot

PREFIX = "server-failed."
LINES_MAX = 20  # the server's last lines kept per record (a traceback's end names the cause)
LINE_MAX = 300  # characters kept of each line (a progress bar without a newline is one line)
RECORD_MAX = 16 * 1024  # bytes: a record written by cachemgr is well under; a larger one is not ours
KEEP = 20  # records kept of the copy there now, newest first: what `show` needs, never a growing folder
KEEP_BEFORE = 5  # and of the copies before it (set aside, pruned): what the set-aside policy compares with
READ_LIMIT = 64  # names read at most per key: a planted folder of a million files costs a listing
_SUMMARY_MAX = 1 << 20


def instance_of(created_at: Any) -> str:
    """The published copy's name in record names: its summary's ``created_at`` in microseconds."""
    if isinstance(created_at, bool) or not isinstance(created_at, int | float):
        return "0"
    if not 0 < created_at < 1e11:  # nan, inf, negative, garbage from the volume
        return "0"
    return f"{int(created_at * 1_000_000):x}"


def instance_at(root: CacheRoot, entry: str) -> str:
    """The copy of ``entries/<entry>`` there now, from its summary (read bounded, never through a link)."""
    try:
        with safefs.open_dir(root.path, root.entries / entry) as folder:
            doc = jsonread.read(SUMMARY_NAME, dir_fd=folder, limit=_SUMMARY_MAX)
    except (OSError, ValueError):
        return "0"
    return instance_of(doc.get("created_at")) if isinstance(doc, dict) else "0"


def counts_by_instance(names: Iterable[str]) -> dict[str, int]:
    """Records per published copy, from the folder's names alone (what ``ls`` pays: no reads)."""
    counts: dict[str, int] = {}
    for name in names:
        if name.startswith(PREFIX):
            instance = name[len(PREFIX) :].split(".", 1)[0]
            counts[instance] = counts.get(instance, 0) + 1
    return counts


def count_on(root: CacheRoot, digest: str, counts: Mapping[str, int], created_at: Any) -> int:
    """Pre-ready exits on the copy made at ``created_at``: counted by name (``counts``, no read), and
    where there are any, only the records that parse as records (a name anyone can plant is none)."""
    instance = instance_of(created_at)
    if not counts.get(instance):
        return 0
    return len(read(root, digest).of(instance))


@dataclass(frozen=True)
class ServerFailure:
    """One pre-ready exit of a server launched on a hit, as its record says (checked for shape)."""

    instance: str
    pod: str
    node: str
    time: float
    exit_status: int  # as a shell sees it: 128+N when killed by signal N
    signal: str | None  # "SIGKILL" when killed by a signal
    last_lines: tuple[str, ...] = ()
    compiled_here: bool = False  # the failing pod compiled this copy itself just before
    name: str = field(default="", compare=False)

    @property
    def how(self) -> str:
        """``exit code 1``, ``killed by SIGSEGV (139)``."""
        if self.signal:
            return f"killed by {self.signal} ({self.exit_status})"
        return f"exit code {self.exit_status}"

    def to_json(self) -> dict[str, Any]:
        return {
            "pod": self.pod,
            "node": self.node,
            "time": self.time,
            "exit_status": self.exit_status,
            "signal": self.signal,
            "last_lines": list(self.last_lines),
            "compiled_here": self.compiled_here,
            "instance": self.instance,
        }


@dataclass(frozen=True)
class Records:
    """The records of one key, newest first, and the notes on those skipped as malformed."""

    failures: tuple[ServerFailure, ...] = ()
    notes: tuple[str, ...] = ()

    def of(self, instance: str) -> tuple[ServerFailure, ...]:
        return tuple(f for f in self.failures if f.instance == instance)

    def before(self, instance: str) -> tuple[ServerFailure, ...]:
        """Records of other copies of the key: one set aside, pruned or replaced."""
        return tuple(f for f in self.failures if f.instance != instance)


def bounded_lines(lines: Sequence[str]) -> list[str]:
    """The last ``LINES_MAX`` lines, each cut to ``LINE_MAX`` characters (kept raw: escaped when shown)."""
    kept = [str(line) for line in lines][-LINES_MAX:]
    return [line if len(line) <= LINE_MAX else line[: LINE_MAX - 3] + "..." for line in kept]


def write(
    root: CacheRoot,
    digest: str,
    identity: PodIdentity,
    *,
    instance: str,
    entry: str,
    exit_status: int,
    signal_name: str | None,
    last_lines: Sequence[str],
    compiled_here: bool,
) -> str:
    """Record one pre-ready exit; the record's name. ``OSError`` when the volume refuses it
    (the caller logs it: a read-only or full volume must not turn the server's failure into another)."""
    lines = bounded_lines(last_lines)
    record: dict[str, Any] = {
        "event": "server_failed",
        "key": digest,
        "entry": entry,
        "instance": instance,
        "pod": identity.pod,
        "node": identity.node,
        "pid": identity.pid,
        "time": time.time(),
        "exit_status": exit_status,
        "signal": signal_name,
        "compiled_here": compiled_here,
        "last_lines": lines,
    }
    while len(json.dumps(record)) > RECORD_MAX - 512 and lines:
        lines = record["last_lines"] = lines[1:]  # escaped, a character takes up to 12 bytes: fewer lines
    name = _name(instance, identity)
    with safefs.open_dir(root.path, root.usage / digest, create=True) as folder:
        atomic_write_json_at(folder, name, record)
        _drop_oldest(folder, instance, keep=name)
    return name


def _name(instance: str, identity: PodIdentity) -> str:
    tail = f"{identity.pod}.{identity.pid}".replace("/", "_")
    return fit_name(f"{PREFIX}{instance}.{time.time_ns():x}.", tail, keep_end=True)


def _drop_oldest(folder: int, instance: str, *, keep: str) -> None:
    """Keep the newest ``KEEP`` records of this copy and the newest ``KEEP_BEFORE`` of the copies
    before it (by the stamp in their names): those are the evidence that a fresh copy fails alike,
    and must not be pushed out by the fresh copy's own records."""
    names = sorted((n for n in os.listdir(folder) if n.startswith(PREFIX)), key=_stamp, reverse=True)
    this = [n for n in names if n[len(PREFIX) :].split(".", 1)[0] == instance]
    before = [n for n in names if n not in set(this)]
    for name in this[KEEP:] + before[KEEP_BEFORE:]:
        if name == keep:
            continue  # the record just written is never what makes room (planted names rank above it)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=folder)


def _stamp(name: str) -> int:
    """The time in the name (ns); 0 for none, and for one past tomorrow: a planted name cannot
    rank above real records by claiming the future."""
    parts = name[len(PREFIX) :].split(".")
    try:
        stamp = int(parts[1], 16) if len(parts) > 1 else 0
    except ValueError:
        return 0
    return stamp if stamp <= time.time_ns() + _SKEW_NS else 0


_SKEW_NS = 24 * 3600 * 10**9


def read(root: CacheRoot, digest: str) -> Records:
    """The key's records, newest first; malformed ones skipped with a note (never an abort)."""
    shown = root.usage / digest
    try:
        with safefs.open_dir(root.path, shown) as folder:
            names = [n for n in os.listdir(folder) if n.startswith(PREFIX)]
            names = sorted(names, key=_stamp, reverse=True)[:READ_LIMIT]
            found, notes = [], []
            for name in names:
                parsed = _read_one(folder, name)
                if isinstance(parsed, str):
                    notes.append(f"usage/{digest}/{name}: {parsed}: ignored")
                else:
                    found.append(parsed)
    except FileNotFoundError:
        return Records()
    except OSError as error:  # a symlink or a file planted as usage/<digest>: nothing of ours there
        return Records(notes=(f"usage/{digest}: {getattr(error, 'strerror', None) or error}: not read",))
    return Records(tuple(found), tuple(notes))


def _read_one(folder: int, name: str) -> ServerFailure | str:
    try:
        doc = jsonread.read(name, dir_fd=folder, limit=RECORD_MAX)
    except jsonread.NotRegularError:
        return "not a regular file"
    except ValueError as error:
        return str(error)
    except OSError as error:
        return error.strerror or "unreadable"
    return _checked(doc, name)


def _checked(doc: Any, name: str) -> ServerFailure | str:
    if not isinstance(doc, dict):
        return "not a record"
    status, when = doc.get("exit_status"), doc.get("time")
    if isinstance(status, bool) or not isinstance(status, int) or not 0 <= status < 1 << 16:
        return "no exit status"
    if isinstance(when, bool) or not isinstance(when, int | float) or not 0 <= when < 1e11:
        return "no time"
    lines = doc.get("last_lines")
    lines = bounded_lines([x for x in lines if isinstance(x, str)]) if isinstance(lines, list) else []
    sig = doc.get("signal")
    return ServerFailure(
        instance=name[len(PREFIX) :].split(".", 1)[0],
        pod=_text(doc.get("pod")),
        node=_text(doc.get("node")),
        time=float(when),
        exit_status=status,
        signal=_text(sig) if isinstance(sig, str) and sig else None,
        last_lines=tuple(lines),
        compiled_here=doc.get("compiled_here") is True,
        name=name,
    )


def _text(value: Any, limit: int = 253) -> str:
    return value[:limit] if isinstance(value, str) else ""
