"""``stats``: how well the cache works, per key and for the volume (ccache ``-s``, sccache
``--show-stats``), counted from records the volume holds anyway.

No write is added for it on the hit path: every pod start already writes a use record under
``usage/<digest>/`` (cachemgr.volume.records), which now says how the start got its entry (found
it, waited for a peer, compiled it, downloaded it) and is renamed into the entry's history when
the pod stops instead of being removed. A compile is known from the entry's summary (its compile
time) and from the failure records of its key. What this counts, precisely:

* ``hits``: starts that found the entry published; ``saved_seconds`` counts the entry's compile
  time for each, and for a start that waited for a peer's compile, that time less its wait;
* ``waits``: starts that waited for a peer's compile and then loaded its entry (no compile of their
  own: a "miss" that cost a wait, not a compile);
* ``downloads``: starts that downloaded the entry from the remote tier;
* ``compiles`` and ``compile_seconds``: the entry's own compile (none for a download) and the
  failed ones;
* ``pod_starts``: every start counted (hits, waits, downloads, starts that compiled, failed
  compiles; ``starts`` breaks a key's down by kind); ``misses``: those that were not hits (kept for
  scripts that read it: waits are in it).

Counts cover the entries and failure records on the volume now: pruning an entry drops its
history with it, a key keeps its newest 20 failure records (cachemgr.volume.failure_records), and
``prune --failures`` drops them. A start killed with SIGKILL whose container restarts in the same pod rewrites
the same record, so it counts once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from cachemgr.core import jsonread, safefs
from cachemgr.core.coerce import number
from cachemgr.ops.attempts import failure_histories
from cachemgr.ops.scan import EntryInfo, scan
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.records import read_usage


@dataclass(frozen=True)
class Counts:
    hits: int = 0
    misses: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    saved_seconds: float = 0.0
    failed: int = 0
    waits: int = 0
    downloads: int = 0

    @property
    def started(self) -> int:
        """Starts counted: the hits and the misses (waits, downloads, compiles, failed ones)."""
        return self.hits + self.misses

    @property
    def no_compile(self) -> int:
        """Starts that loaded an entry without compiling it themselves: hits, waits, downloads."""
        return self.hits + self.waits + self.downloads

    def to_json(self) -> dict[str, Any]:
        return {
            "pod_starts": self.started,
            "hits": self.hits,
            "waits": self.waits,
            "downloads": self.downloads,
            "misses": self.misses,
            "compiles": self.compiles,
            "compile_seconds": round(self.compile_seconds, 3),
            "saved_seconds": round(self.saved_seconds, 3),
            "failed_compiles": self.failed,
        }


@dataclass(frozen=True)
class KeyStats(Counts):
    key: str = ""
    entry: str | None = None  # the published entry; None for a key that only ever failed
    model: str = ""
    role: str = ""
    compiler: str = ""
    npu: str = ""
    status: str = "not published"
    starts: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "short": self.key[:12],
            "entry": self.entry,
            "model": self.model,
            "role": self.role,
            "compiler": self.compiler,
            "npu": self.npu,
            "status": self.status,
            **super().to_json(),
            "starts": dict(self.starts),
        }


@dataclass(frozen=True)
class VolumeStats:
    keys: tuple[KeyStats, ...]
    warnings: tuple[str, ...] = ()

    @property
    def total(self) -> Counts:
        return Counts(
            hits=sum(k.hits for k in self.keys),
            misses=sum(k.misses for k in self.keys),
            compiles=sum(k.compiles for k in self.keys),
            compile_seconds=sum(k.compile_seconds for k in self.keys),
            saved_seconds=sum(k.saved_seconds for k in self.keys),
            failed=sum(k.failed for k in self.keys),
            waits=sum(k.waits for k in self.keys),
            downloads=sum(k.downloads for k in self.keys),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "volume": self.total.to_json(),
            "items": [k.to_json() for k in self.keys],  # one per key (-o json's envelope: items)
            "warnings": list(self.warnings),
        }


def volume_stats(root: CacheRoot) -> VolumeStats:
    found = scan(root, with_staging=False)
    warnings = list(found.warnings)
    failed = {h.key: h for h in failure_histories(root, warnings=warnings)}
    keys = [_entry_stats(root, e, failed.pop(e.key, None)) for e in found.entries if e.key]
    for history in failed.values():
        last = history.to_json()
        seconds = sum(_seconds(r.get("elapsed_s")) for r in history.records)
        keys.append(
            KeyStats(
                key=history.key,
                model=str(last.get("model") or ""),
                role=str(last.get("role") or ""),
                compiler=str(last.get("compiler") or ""),
                npu=str(last.get("npu") or ""),
                misses=history.count,
                compiles=history.count,
                compile_seconds=seconds,
                failed=history.count,
            )
        )
    return VolumeStats(tuple(keys), tuple(warnings))


def _entry_stats(root: CacheRoot, entry: EntryInfo, history: Any) -> KeyStats:
    starts = dict(entry.starts)
    compile_s = _seconds(entry.compile_seconds)
    waited = _waited_seconds(root, entry.key)
    saved = entry.hits * compile_s + sum(max(0.0, compile_s - w) for w in waited)
    failures = history.count if history is not None else 0
    failed_s = sum(_seconds(r.get("elapsed_s")) for r in history.records) if history is not None else 0.0
    compiled_here = 0 if entry.origin_kind == "remote" else 1
    misses = sum(count for kind, count in starts.items() if kind in ("waited", "compiled", "fetched"))
    return KeyStats(
        key=entry.key,
        entry=entry.name,
        model=entry.model,
        role=entry.role,
        compiler=entry.compiler,
        npu=entry.npu,
        status=entry.status,
        starts=starts,
        hits=entry.hits,
        waits=starts.get("waited", 0),
        downloads=starts.get("fetched", 0),
        misses=misses + failures,
        compiles=compiled_here + failures,
        compile_seconds=compiled_here * compile_s + failed_s,
        saved_seconds=saved,
        failed=failures,
    )


def _waited_seconds(root: CacheRoot, digest: str) -> list[float]:
    """How long each start that waited for a peer's compile waited (its use record says)."""
    usage = read_usage(root, digest)
    waits = [u.waited_s for u in (*usage.live, *usage.silent) if u.start == "waited"]
    if not usage.waited:
        return waits
    folder = root.usage / digest
    # Each record read by name from the folder, reached from the root: a symlink is never followed.
    with contextlib.suppress(OSError), safefs.open_dir(root.path, folder) as fd:
        for name in usage.waited:
            with contextlib.suppress(OSError, ValueError):
                data = jsonread.read(name, dir_fd=fd)
                waits.append(_seconds(data.get("waited_s")) if isinstance(data, dict) else 0.0)
    return waits


def _seconds(value: Any) -> float:
    """A figure of seconds from the volume: finite and within a century, else nothing."""
    seconds = number(value)
    return seconds if seconds is not None and 0.0 <= seconds < 3e9 else 0.0
