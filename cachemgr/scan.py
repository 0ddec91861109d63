"""A scan of the cache volume: entries, their status, users, and what could be pruned.

The scan reads each entry's small ``summary.json`` and checks that its manifest exists; it
never hashes (that is ``verify``). It survives damage: a broken entry becomes a status and
a warning, never an abort. The hit path does not scan; inspection, space reports and
``prune`` do.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cachemgr.fsutil import read_json, tree_bytes
from cachemgr.manifest import KEY_NAME, MANIFEST_NAME, SUMMARY_NAME
from cachemgr.records import IN_USE_WINDOW, User, last_used, users
from cachemgr.store import CacheRoot, StagingInfo, list_staging

EntryStatus = Literal["ok", "damaged", "incompatible"]


@dataclass(frozen=True)
class Compat:
    """What this image can use: entries for another compiler or NPU can never hit here."""

    compiler: str | None
    npu: str | None

    def why_incompatible(self, compiler: str, npu: str) -> str | None:
        reasons = []
        if self.compiler and compiler and compiler != self.compiler:
            reasons.append(f"compiler {compiler}, this image has {self.compiler}")
        if self.npu and npu and npu != self.npu:
            reasons.append(f"NPU {npu}, this pod has {self.npu}")
        return "; ".join(reasons) or None


@dataclass(frozen=True)
class EntryInfo:
    """One published entry as the scan sees it."""

    name: str
    path: Path
    key: str
    model: str
    model_id: str
    role: str
    compiler: str
    npu: str
    strategy: str
    size_bytes: int
    files: int
    pipeline_parallel_size: int
    created_at: float | None
    last_used_at: float | None
    users: tuple[User, ...]
    status: EntryStatus
    problem: str | None = None

    @property
    def in_use(self) -> bool:
        return bool(self.users)

    @property
    def short(self) -> str:
        return self.key[:12]

    def unused_for(self, now: float | None = None) -> float:
        ref = self.last_used_at or self.created_at or 0.0
        return max(0.0, (time.time() if now is None else now) - ref)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "short": self.short,
            "entry": self.name,
            "model": self.model,
            "role": self.role,
            "compiler": self.compiler,
            "npu": self.npu,
            "strategy": self.strategy,
            "size_bytes": self.size_bytes,
            "files": self.files,
            "created_at": self.created_at,
            "last_used_at": self.last_used_at,
            "in_use": self.in_use,
            "users": [user.to_json() for user in self.users],
            "status": self.status,
            "problem": self.problem,
        }


@dataclass(frozen=True)
class Scan:
    """Everything on the volume, with warnings instead of aborts."""

    entries: tuple[EntryInfo, ...]
    staging: tuple[StagingInfo, ...]
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def by_key_prefix(self, prefix: str) -> list[EntryInfo]:
        prefix = prefix.lower()
        return [e for e in self.entries if e.key.startswith(prefix) or e.name == prefix]


def scan(root: CacheRoot, *, compat: Compat | None = None, with_staging: bool = True) -> Scan:
    """Read every entry's summary; damaged ones are reported, not fatal."""
    warnings: list[str] = []
    now = time.time()
    entries = tuple(_entry_info(path, root, compat, now, warnings) for path in root.iter_entries())
    staging = tuple(list_staging(root)) if with_staging and root.staging.is_dir() else ()
    return Scan(entries=entries, staging=staging, warnings=tuple(warnings))


def _entry_info(
    path: Path, root: CacheRoot, compat: Compat | None, now: float, warnings: list[str]
) -> EntryInfo:
    summary, problem = _read_summary(path)
    if problem is not None:
        warnings.append(f"{path.name}: {problem}")
        return _damaged(path, root, problem, summary)
    key = str(summary["key"])
    compiler, npu = str(summary.get("compiler", "")), str(summary.get("npu", ""))
    why = compat.why_incompatible(compiler, npu) if compat else None
    return EntryInfo(
        name=path.name,
        path=path,
        key=key,
        model=str(summary.get("model", "")),
        model_id=str(summary.get("model_id", "")),
        role=str(summary.get("role", "")),
        compiler=compiler,
        npu=npu,
        strategy=str(summary.get("strategy", "")),
        size_bytes=int(summary.get("size_bytes", 0)),
        files=int(summary.get("files", 0)),
        pipeline_parallel_size=int(summary.get("pipeline_parallel_size", 1) or 1),
        created_at=_float(summary.get("created_at")),
        last_used_at=last_used(root, key),
        users=tuple(users(root, key, window=IN_USE_WINDOW, now=now)),
        status="incompatible" if why else "ok",
        problem=why,
    )


def _read_summary(path: Path) -> tuple[dict[str, Any], str | None]:
    if not (path / MANIFEST_NAME).is_file():
        return _key_json(
            path
        ), "no manifest.json: never committed or damaged (cachemgr verify --fix moves it aside)"
    try:
        data = read_json(path / SUMMARY_NAME)
    except FileNotFoundError:
        return _key_json(path), "summary.json is missing (cachemgr verify tells whether files are intact)"
    except (OSError, ValueError) as error:
        return _key_json(path), f"summary.json is unreadable ({error})"
    if not isinstance(data, dict) or "key" not in data:
        return _key_json(path), "summary.json is not a cachemgr summary"
    return data, None


def _key_json(path: Path) -> dict[str, Any]:
    """What can still be told of a damaged entry from its key.json."""
    try:
        data = read_json(path / KEY_NAME)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    raw_inputs = data.get("inputs")
    inputs: dict[str, Any] = raw_inputs if isinstance(raw_inputs, dict) else {}
    return {
        "key": data.get("key", ""),
        "role": inputs.get("role", ""),
        "compiler": inputs.get("compiler", ""),
        "npu": inputs.get("npu", ""),
        "model": (data.get("details") or {}).get("model_name", ""),
    }


def _damaged(path: Path, root: CacheRoot, problem: str, known: dict[str, Any]) -> EntryInfo:
    key = str(known.get("key") or "")
    return EntryInfo(
        name=path.name,
        path=path,
        key=key,
        model=str(known.get("model", "")),
        model_id="",
        role=str(known.get("role", "")),
        compiler=str(known.get("compiler", "")),
        npu=str(known.get("npu", "")),
        strategy="",
        size_bytes=tree_bytes(path),
        files=0,
        pipeline_parallel_size=1,
        created_at=_mtime(path),
        last_used_at=last_used(root, key) if key else None,
        users=tuple(users(root, key)) if key else (),
        status="damaged",
        problem=problem,
    )


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _mtime(path: Path) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def total_bytes(entries: Iterable[EntryInfo]) -> int:
    return sum(entry.size_bytes for entry in entries)
