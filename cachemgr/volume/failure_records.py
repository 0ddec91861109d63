"""Failure records: ``failures/<digest>/<stamp>.<pod>.<pid>.json``, one per failed attempt, kept
for ``show`` and ``ls`` and never replayed.

Bounded both ways, since a compiler can print anything and anyone who can write the volume can
plant anything: a record is written within :data:`RECORD_BYTES` (the output tail loses its oldest
lines first, then long strings are cut, each cut marked), a key keeps its newest
:data:`RECORDS_PER_KEY` (the oldest are removed after each write), and readers read at most
:data:`RECORD_BYTES` of a record and the newest :data:`RECORDS_PER_KEY` of a key: a larger file is
damage, skipped with a warning. ``prune --failures`` removes them all (cachemgr.ops.prune_plan).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachemgr.core import jsonread, safefs
from cachemgr.core.fsutil import atomic_write_json
from cachemgr.core.units import human_bytes
from cachemgr.volume.identity import PodIdentity

if TYPE_CHECKING:
    from cachemgr.volume.layout import CacheRoot

RECORD_BYTES = 64 << 10  # one record's JSON, as written and as read
RECORDS_PER_KEY = 20  # per key: enough to see a pattern across pods, small enough to list
_STRING_CHARS = 1024  # what a long string keeps when a record must shrink further
_CUT = " [... {cut} chars cut]"


def record_failure(
    root: CacheRoot, digest: str, identity: PodIdentity, record: Mapping[str, Any]
) -> Path | None:
    """Keep a failed attempt's story (time, code, output tail), bounded. Best effort: the volume may be full."""
    folder = root.failures / digest
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = folder / f"{stamp}.{identity.file_stem}.json"
    try:
        safefs.make_dirs(root.path, folder)
        atomic_write_json(
            path, bounded({**identity.to_json(), "time": time.time(), **record}), within=root.path
        )
        _drop_oldest(root, folder)
    except OSError:
        return None
    return path


def bounded(record: Mapping[str, Any], *, limit: int = RECORD_BYTES) -> dict[str, Any]:
    """``record`` within ``limit`` bytes of JSON: first every string but the output's is cut to
    :data:`_STRING_CHARS` (a report listing every file), then the output tail loses its oldest
    lines, and if even that is not enough the tail and the report go whole."""
    out = dict(record)
    if _size(out) <= limit:
        return out
    out = {key: value if key == "output_tail" else _cut(value) for key, value in out.items()}
    tail = [str(line) for line in out.get("output_tail") or []]
    dropped = 0
    while tail and _size({**out, "output_tail": tail}) > limit:
        tail.pop(0)
        dropped += 1
    out["output_tail"] = tail
    if dropped:
        out["output_tail_dropped"] = dropped
    if _size(out) > limit:
        out = {k: v for k, v in out.items() if k not in ("output_tail", "report")}
        out["cut"] = f"the output tail and the report did not fit in {human_bytes(limit)}"
    return out


def _size(record: Mapping[str, Any]) -> int:
    return len(json.dumps(record, indent=2, sort_keys=True)) + 1  # as atomic_write_json writes it (ASCII)


def _cut(value: Any) -> Any:
    if isinstance(value, str) and len(value) > _STRING_CHARS:
        return value[:_STRING_CHARS] + _CUT.format(cut=len(value) - _STRING_CHARS)
    if isinstance(value, list):
        return [_cut(item) for item in value]
    if isinstance(value, dict):
        return {key: _cut(item) for key, item in value.items()}
    return value


def _drop_oldest(root: CacheRoot, folder: Path) -> None:
    """Keep the newest :data:`RECORDS_PER_KEY` (names start with the time, so they sort by it)."""
    for name in _record_names(root, folder)[:-RECORDS_PER_KEY]:
        safefs.unlink(root.path, folder / name)


def _record_names(root: CacheRoot, folder: Path) -> list[str]:
    return [n for n in safefs.listdir(root.path, folder) if n.endswith(".json") and not n.startswith(".")]


def failures(root: CacheRoot, digest: str, *, warnings: list[str] | None = None) -> list[dict[str, Any]]:
    """The key's newest records, oldest first; what cannot be read, or is too large, is left out
    (with a line in ``warnings``)."""
    folder = root.failures / digest
    found: list[dict[str, Any]] = []
    with contextlib.suppress(safefs.UnsafePathError):  # a symlink there: nothing of ours to read
        for name in _record_names(root, folder)[-RECORDS_PER_KEY:]:
            data = read_record(folder / name, warnings=warnings)
            if data:
                found.append(data)
    return found


def read_record(path: Path, *, warnings: list[str] | None = None) -> dict[str, Any]:
    """One record, read within :data:`RECORD_BYTES`; ``{}`` (and a warning) if it is not one."""
    try:
        data = jsonread.read(path, limit=RECORD_BYTES)
    except (OSError, ValueError) as error:
        if warnings is not None and not isinstance(error, FileNotFoundError):
            warnings.append(
                f"failures/{path.parent.name}/{path.name}: {error}; 'cachemgr prune --failures' removes it"
            )
        return {}
    return data if isinstance(data, dict) else {}
