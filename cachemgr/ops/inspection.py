"""What operators ask from inside a pod: what is cached (``ls``, ``show``), how much space is
left (``du``), who holds a lease (``locks``). Why a pod compiled again is :mod:`cachemgr.ops.explain`,
whether anything is damaged :mod:`cachemgr.ops.verify`, what can go :mod:`cachemgr.ops.prune`. Every
answer is a frozen result with raw numbers (and human renderings beside them); the CLI only
renders them.

This image's compiler and NPU matter only to mark entries "incompatible": they are resolved
best effort (flags, environment, package metadata; never by probing a device), and when
unknown, nothing is judged on them and a note says what to set.

Nothing here writes to the volume, so these commands work on a read-only mount. Damage never
aborts a listing: it becomes a status or a warning; an I/O error reading the volume itself
becomes a VolumeError naming the path (exit 74).
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachemgr.core.coerce import as_dict, read_dict
from cachemgr.core.errors import ConfigError, UsageError, VolumeError
from cachemgr.core.units import human_bytes, human_duration
from cachemgr.key.cachekey import resolve_compiler, resolve_npu
from cachemgr.ops.attempts import (
    Attempt,
    FailureHistory,
    Quarantined,
    attempt_of,
    failure_histories,
    quarantined,
)
from cachemgr.ops.progress import Seen, read_record
from cachemgr.ops.scan import Compat, EntryInfo, scan, scan_entry
from cachemgr.ops.space import VolumeSpace, prunable_now
from cachemgr.volume.drift import records as drift_records
from cachemgr.volume.entries import entry_digest, entry_names, listdir, tree_usage
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.manifest import KEY_NAME, ManifestError, check_files, read_manifest
from cachemgr.volume.records import failures
from cachemgr.volume.store import list_staging

if TYPE_CHECKING:
    from cachemgr.volume.lease import Holder

_NPU_SETTINGS = ("CACHEMGR_NPU_TYPE", "RBLN_FORCE_NPU_NAME", "RBLN_TARGET_SOC")


# --- this image -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageInfo:
    """This image's compiler and NPU, as far as they can be told without probing a device."""

    compat: Compat
    compiler_source: str | None
    npu_source: str | None
    notes: tuple[str, ...] = ()

    def require(self) -> Compat:
        """The compiler, or a ConfigError naming what to set (``prune --incompatible``).

        The NPU type is not needed: entries for another NPU are not incompatible (scan.Compat).
        """
        if not self.compat.compiler:
            raise ConfigError(
                "prune --incompatible needs this image's RBLN Compiler version, and "
                "CACHEMGR_COMPILER_VERSION cannot be told here",
                remedy="set CACHEMGR_COMPILER_VERSION (or --compiler-version), e.g. CACHEMGR_COMPILER_VERSION=0.12.0",
            )
        return self.compat


def resolve_image(
    *, compiler_version: str | None, npu_type: str | None, environ: Mapping[str, str]
) -> ImageInfo:
    """Best effort, as ``key`` resolves them but never probing the device (slow, maybe absent)."""
    notes: list[str] = []
    compiler: str | None = None
    compiler_source: str | None = None
    try:
        compiler, compiler_source = resolve_compiler(compiler_version, environ)
    except ConfigError as error:
        notes.append(
            f"this image's RBLN Compiler version is unknown ({error.what}): entries are not judged "
            "by compiler; set CACHEMGR_COMPILER_VERSION to mark those for other versions incompatible"
        )
    npu: str | None = None
    npu_source: str | None = None
    try:
        npu, npu_source = resolve_npu(npu_type, environ, probe=False)
    except ConfigError as error:
        unset = not (npu_type or any(environ.get(name, "").strip() for name in _NPU_SETTINGS))
        notes.append(
            "this pod's NPU type is unknown (inspection never probes the device): entries for other NPUs "
            "are not told apart; set CACHEMGR_NPU_TYPE or RBLN_FORCE_NPU_NAME to see them"
            if unset
            else f"this pod's NPU type is unusable ({error.what}); entries are not judged by NPU"
        )
    return ImageInfo(Compat(compiler, npu), compiler_source, npu_source, tuple(notes))


# --- ls -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Listing:
    """``ls``: entries, then attempts, failure histories and quarantined entries."""

    entries: tuple[EntryInfo, ...]
    attempts: tuple[Attempt, ...]
    failures: tuple[FailureHistory, ...]
    quarantined: tuple[Quarantined, ...]
    warnings: tuple[str, ...] = ()

    def count(self, status: str) -> int:
        return sum(1 for e in self.entries if e.status == status)

    def to_json(self) -> list[dict[str, Any]]:
        """A flat list (DESIGN.md's contract); ``kind`` tells entries from the other rows."""
        rows: list[dict[str, Any]] = [e.to_json() for e in self.entries]
        rows += [a.to_json() for a in self.attempts]
        rows += [f.to_json() for f in self.failures]
        rows += [q.to_json() for q in self.quarantined]
        return rows


def list_cache(root: CacheRoot, *, compat: Compat | None) -> Listing:
    found = scan(root, compat=compat)
    published = {e.key for e in found.entries if e.key}
    attempts = tuple(attempt_of(root, info, published=published) for info in found.staging)
    warnings = list(found.warnings)
    return Listing(
        entries=found.entries,
        attempts=attempts,
        failures=tuple(failure_histories(root, warnings=warnings, last_only=True)),
        quarantined=tuple(quarantined(root)),
        warnings=tuple(warnings),
    )


# --- show -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyMatch:
    digest: str
    entry: str | None  # the published entry's directory name, if there is one


@dataclass(frozen=True)
class EntryDetail:
    """``show``: one key, everything known of it."""

    digest: str
    name: str
    entry: EntryInfo | None
    key_doc: Mapping[str, Any]
    manifest: Mapping[str, Any] | None
    problems: tuple[str, ...]
    history: FailureHistory | None
    holder: Holder | None
    attempts: tuple[Attempt, ...]
    warnings: tuple[str, ...] = ()
    # recompiled_on_hit records of this key (cachemgr.volume.drift), oldest first.
    recompiled: tuple[Mapping[str, Any], ...] = ()

    @property
    def inputs(self) -> Mapping[str, Any]:
        return as_dict(self.key_doc.get("inputs")) or as_dict((self.manifest or {}).get("inputs"))

    def to_json(self) -> dict[str, Any]:
        doc = self.key_doc
        return {
            "key": self.digest,
            "entry": self.name,
            "published": self.entry is not None,
            "status": self.entry.status if self.entry else None,
            "origin": self.entry.to_json()["origin"] if self.entry else None,
            "problem": self.entry.problem if self.entry else None,
            "size_bytes": self.entry.size_bytes if self.entry else None,
            "created_at": self.entry.created_at if self.entry else None,
            "last_used_at": self.entry.last_used_at if self.entry else None,
            "in_use": self.entry.in_use if self.entry else False,
            "users": [u.to_json() for u in self.entry.users] if self.entry else [],
            "silent_users": [u.to_json() for u in self.entry.silent_users] if self.entry else [],
            "inputs": dict(self.inputs),
            "sources": as_dict(doc.get("sources")),
            "details": as_dict(doc.get("details")),
            "dropped_runtime_flags": doc.get("dropped_runtime_flags", []),
            "unknown_flags": doc.get("unknown_flags", []),
            "manifest": dict(self.manifest) if self.manifest else None,
            "check": list(self.problems),
            "failures": [dict(r) for r in self.history.records] if self.history else [],
            "lease": holder_json(self.holder),
            "attempts": [a.to_json() for a in self.attempts],
            "warnings": list(self.warnings),
            "recompiled_on_hit": [dict(r) for r in self.recompiled],
        }


def find_key(root: CacheRoot, query: str) -> KeyMatch:
    """A unique digest prefix or an entry name -> the key; UsageError when none or several match."""
    if query in entry_names(root):
        return KeyMatch(entry_digest(root, query), query)
    prefix = query.strip().lower()
    if not prefix:
        raise UsageError("an empty KEY matches everything", remedy="pass a key prefix or an entry name")
    matches = _keys_starting(root, prefix)
    if len(matches) == 1:
        digest, entry = next(iter(matches.items()))
        return KeyMatch(digest, entry)
    if not matches:
        raise UsageError(
            f"no entry, compile attempt or failure record under {root.path} matches {query!r}",
            remedy="'cachemgr ls' lists the keys; pass a prefix of one or an entry name",
        )
    listed = ", ".join(sorted(d[:12] for d in matches)[:6])
    raise UsageError(
        f"{query!r} matches {len(matches)} keys ({listed}{', ...' if len(matches) > 6 else ''})",
        remedy="pass a longer prefix or the entry name",
    )


def _keys_starting(root: CacheRoot, prefix: str) -> dict[str, str | None]:
    """Every key with that prefix: entries (-> their name), attempts, failures and leases (-> None)."""
    matches: dict[str, str | None] = {}
    for name in entry_names(root):
        if name.rsplit("__", 1)[-1].startswith(prefix[:16]):
            digest = entry_digest(root, name)
            if digest.startswith(prefix) or (len(digest) == 16 and prefix.startswith(digest)):
                matches[digest] = name
    others = [*listdir(root.staging), *listdir(root.failures)]
    others += [m.removesuffix(".lock") for m in listdir(root.leases) if m.endswith(".lock")]
    for digest in others:
        if digest.startswith(prefix):
            matches.setdefault(digest, None)
    for partial in [d for d in matches if len(d) < 32]:
        # A damaged entry whose full key is unknown, and records of that key: one key.
        full = [d for d in matches if len(d) == 32 and d.startswith(partial)]
        if len(full) == 1:
            entry = matches.pop(partial)
            matches[full[0]] = matches[full[0]] or entry
    return matches


def show(root: CacheRoot, query: str, *, compat: Compat | None) -> EntryDetail:
    match = find_key(root, query)
    warnings: list[str] = []
    entry = scan_entry(root, match.entry, compat=compat) if match.entry else None
    published = {match.digest} if entry else set()
    attempts = tuple(attempt_of(root, info, published=published) for info in list_staging(root, match.digest))
    manifest: dict[str, Any] | None = None
    problems: tuple[str, ...] = ()
    key_doc: dict[str, Any] = {}
    if entry is not None:
        key_doc = read_dict(entry.path / KEY_NAME)
        if not key_doc:
            warnings.append(f"{entry.name}/key.json is missing or not JSON: inputs shown from the manifest")
        manifest, problems = _manifest_summary(entry.path)
    elif attempts:
        key_doc = read_dict(attempts[0].path / KEY_NAME)
    records = failures(root, match.digest)
    named = (
        [str(key_doc.get("entry") or "")]
        + [a.entry for a in attempts]
        + [str(r.get("entry", "")) for r in records]
    )
    return EntryDetail(
        digest=match.digest,
        name=match.entry or next((n for n in named if n), ""),
        entry=entry,
        key_doc=key_doc,
        manifest=manifest,
        problems=problems,
        history=FailureHistory(match.digest, tuple(records), len(records)) if records else None,
        holder=read_holder_of(root, match.digest),
        attempts=attempts,
        recompiled=tuple(drift_records(root, match.digest)),
        warnings=tuple(warnings),
    )


def _manifest_summary(path: Path) -> tuple[dict[str, Any] | None, tuple[str, ...]]:
    """The manifest without its file list, and a fast check (sizes, mtimes) of the files against it."""
    try:
        manifest = read_manifest(path)
    except ManifestError as error:
        return None, (str(error),)
    try:
        problems = tuple(str(p) for p in check_files(path, manifest, mode="fast"))
    except OSError as error:
        problems = (f"cannot read the files: {error.strerror}",)
    summary = {
        "files": len(manifest.files),
        "total_bytes": manifest.total_bytes,
        "created_at": manifest.created_at,
        "created_by": dict(manifest.created_by),
        "compile_seconds": manifest.compile_seconds,
        "strategy": manifest.strategy,
        "model_name": manifest.model_name,
        "format": manifest.format,
        "inputs": dict(manifest.inputs),
    }
    return summary, problems


# --- locks ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LockInfo:
    """A lease marker and its holder."""

    key: str
    entry: str
    holder: Holder
    progress: Seen | None = None  # the holder's own progress record (cachemgr.ops.progress)

    @property
    def stale(self) -> bool:
        """Dead or frozen: the next contender takes it over (:attr:`cachemgr.volume.lease.Holder.stale`)."""
        return self.holder.stale

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "short": self.key[:12],
            "entry": self.entry,
            **(holder_json(self.holder) or {}),
            "stale": self.stale,
            "progress": self.progress.to_json() if self.progress is not None else None,
        }


def list_locks(root: CacheRoot) -> list[LockInfo]:
    """Every lease marker on the volume and its holder (ages by this node's clock)."""
    names = {name.rsplit("__", 1)[-1]: name for name in entry_names(root)}
    found = []
    for marker in listdir(root.leases):
        if not marker.endswith(".lock") or marker.startswith("."):
            continue
        digest = marker.removesuffix(".lock")
        holder = read_holder_of(root, digest)
        if holder is None:
            continue  # released while we looked
        entry = names.get(digest[:16]) or _staged_entry(root, digest)
        seen = read_record(root, digest, token=holder.token) if holder.current else None
        found.append(LockInfo(digest, entry, holder, seen))
    return found


def _staged_entry(root: CacheRoot, digest: str) -> str:
    for info in list_staging(root, digest) if root.staging.is_dir() else []:
        if info.owner.get("entry"):
            return str(info.owner["entry"])
    return ""


def holder_json(holder: Holder | None) -> dict[str, Any] | None:
    if holder is None:
        return None
    return {
        "pod": holder.pod,
        "node": holder.node,
        "pid": holder.pid,
        "host": holder.host,
        "since": holder.since,
        "held_for_seconds": round(holder.held_for, 1),
        "refreshed_age_seconds": None if holder.refreshed_age is None else round(holder.refreshed_age, 1),
        "duration_seconds": holder.duration,
        "stale": holder.stale,
        "current": holder.current,
    }


# --- du -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompilerUsage:
    compiler: str
    entries: int
    size_bytes: int

    @property
    def size_str(self) -> str:
        return human_bytes(self.size_bytes)


@dataclass(frozen=True)
class Freeable:
    """What one ``prune`` selector would free now."""

    selector: str
    flag: str
    items: int
    bytes: int

    @classmethod
    def of(cls, selector: str, flag: str, sizes: list[int]) -> Freeable:
        return cls(selector, flag, len(sizes), sum(sizes))

    @property
    def bytes_str(self) -> str:
        return human_bytes(self.bytes)


@dataclass(frozen=True)
class DiskUsage:
    """``du``: the volume (statvfs: a CephFS/JuiceFS directory quota shows here) and the cache."""

    volume: str
    total_bytes: int
    free_bytes: int
    entries: tuple[EntryInfo, ...]
    attempts: tuple[Attempt, ...]
    quarantined: tuple[Quarantined, ...]
    trash_bytes: int
    unused_after: float
    reserved_bytes: int = 0  # free blocks only root may use (ext4's reserve); 0 on network filesystems
    warnings: tuple[str, ...] = ()

    @property
    def used_bytes(self) -> int:
        """As ``df`` shows it: neither free nor reserved."""
        return max(0, self.total_bytes - self.free_bytes - self.reserved_bytes)

    @property
    def entries_bytes(self) -> int:
        return sum(e.size_bytes for e in self.entries)

    @property
    def staging_bytes(self) -> int:
        return sum(a.size_bytes for a in self.attempts)

    @property
    def quarantine_bytes(self) -> int:
        return sum(q.size_bytes for q in self.quarantined)

    @property
    def cache_bytes(self) -> int:
        return self.entries_bytes + self.staging_bytes + self.quarantine_bytes + self.trash_bytes

    @property
    def by_compiler(self) -> tuple[CompilerUsage, ...]:
        sums: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for entry in self.entries:
            sums[entry.compiler or "?"][0] += 1
            sums[entry.compiler or "?"][1] += entry.size_bytes
        return tuple(CompilerUsage(c, n, b) for c, (n, b) in sorted(sums.items()))

    @property
    def prunable(self) -> tuple[Freeable, ...]:
        """What ``prune`` could free now, never counting an entry in use; the rows do not overlap,
        so they add up to what all four selectors together free. The first two are
        ``space.Prunable``, the figures a pod's disk-full report names."""
        found = prunable_now(self.entries, unused_after=self.unused_after)
        counted = {e.name for e in (*found.incompatible, *found.unused)}
        damaged = [
            e.size_bytes
            for e in self.entries
            if e.status == "damaged" and not e.in_use and e.name not in counted
        ]
        return (
            Freeable.of("incompatible", "--incompatible", [e.size_bytes for e in found.incompatible]),
            Freeable.of(
                "unused",
                f"--unused-for {human_duration(self.unused_after)}",
                [e.size_bytes for e in found.unused],
            ),
            Freeable.of(
                "stale_staging",
                "--stale-staging",
                [a.size_bytes for a in self.attempts if a.status == "stale"],
            ),
            Freeable.of("damaged", "--damaged", damaged + [q.size_bytes for q in self.quarantined]),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "volume": self.volume,
            "total_bytes": self.total_bytes,
            "used_bytes": self.used_bytes,
            "free_bytes": self.free_bytes,
            "reserved_bytes": self.reserved_bytes,
            "cache_bytes": self.cache_bytes,
            "entries_bytes": self.entries_bytes,
            "staging_bytes": self.staging_bytes,
            "quarantine_bytes": self.quarantine_bytes,
            "trash_bytes": self.trash_bytes,
            "entries": [
                {
                    "key": e.key,
                    "entry": e.name,
                    "compiler": e.compiler,
                    "size_bytes": e.size_bytes,
                    "status": e.status,
                }
                for e in self.entries
            ],
            "by_compiler": [
                {"compiler": c.compiler, "entries": c.entries, "size_bytes": c.size_bytes}
                for c in self.by_compiler
            ],
            "prunable": {
                f.selector: {"flag": f.flag, "items": f.items, "bytes": f.bytes} for f in self.prunable
            },
            "prunable_bytes": sum(f.bytes for f in self.prunable),
            "warnings": list(self.warnings),
        }


def disk_usage(root: CacheRoot, *, compat: Compat | None, unused_after: float = 14 * 86400.0) -> DiskUsage:
    space = VolumeSpace.measure(root.path)
    st = os.statvfs(root.path)
    found = scan(root, compat=compat)
    published = {e.key for e in found.entries if e.key}
    return DiskUsage(
        volume=str(root.path),
        total_bytes=space.total_bytes,
        free_bytes=space.free_bytes,
        entries=found.entries,
        attempts=tuple(attempt_of(root, info, published=published) for info in found.staging),
        quarantined=tuple(quarantined(root)),
        trash_bytes=sum(sum(tree_usage(root.trash / name)) for name in listdir(root.trash)),
        unused_after=unused_after,
        reserved_bytes=max(0, (st.f_bfree - st.f_bavail) * st.f_frsize),
        warnings=found.warnings,
    )


# --- helpers --------------------------------------------------------------------------------


@contextlib.contextmanager
def volume_errors(root: CacheRoot) -> Iterator[None]:
    """An I/O error reading the volume (EIO, EACCES on a directory) becomes a VolumeError
    naming the path, never an internal error. Damage inside one entry is not this: the scan
    reports it as that entry's status."""
    try:
        yield
    except VolumeError:
        raise
    except OSError as error:
        where = error.filename or root.path
        raise VolumeError(
            f"cannot read the cache volume at {where}: {error.strerror or error}",
            remedy="check the compile cache PVC mount and its permissions (kubectl describe pod; dmesg on the node)",
            path=str(where),
        ) from error


def read_holder_of(root: CacheRoot, digest: str) -> Holder | None:
    """The key's lease holder, if any; the lease module is imported only here (ls and du never need it)."""
    from cachemgr.volume.lease import read_holder

    return read_holder(root, digest)
