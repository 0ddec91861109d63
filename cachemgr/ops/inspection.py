"""What operators ask from inside a pod: what is cached (``ls``) and everything known of one key
(``show``). How much space is left (``du``) is :mod:`cachemgr.ops.diskusage`, who holds a lease
(``locks``) :mod:`cachemgr.ops.locks`, this image's compiler and NPU :mod:`cachemgr.ops.image`, why a
pod compiled again :mod:`cachemgr.ops.explain`, whether anything is damaged :mod:`cachemgr.ops.verify`,
what can go :mod:`cachemgr.ops.prune`. Every answer is a frozen result with raw numbers (and human
renderings beside them); the CLI only renders them.

Nothing here writes to the volume, so these commands work on a read-only mount. Damage never
aborts a listing: it becomes a status or a warning; an I/O error reading the volume itself
becomes a VolumeError naming the path (exit 74).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachemgr.core.coerce import as_dict, read_dict
from cachemgr.core.errors import NotFoundError, UsageError, VolumeError
from cachemgr.core.printable import safe
from cachemgr.core.units import plural
from cachemgr.ops.attempts import (
    Attempt,
    FailureHistory,
    Quarantined,
    attempt_of,
    failure_histories,
    quarantined,
)
from cachemgr.ops.locks import holder_json, read_holder_of
from cachemgr.ops.scan import Compat, EntryInfo, scan, scan_entry
from cachemgr.volume import serverfail
from cachemgr.volume.drift import records as drift_records
from cachemgr.volume.entries import entry_digest, entry_names, listdir
from cachemgr.volume.failure_records import failures
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.manifest import KEY_NAME, ManifestError, check_files, read_manifest
from cachemgr.volume.stale import list_staging

if TYPE_CHECKING:
    from cachemgr.core.signing import TrustedKeys
    from cachemgr.volume.lease import Holder
    from cachemgr.volume.serverfail import ServerFailure


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
        """A flat list (docs/design.md's contract); ``kind`` tells entries from the other rows."""
        rows: list[dict[str, Any]] = [e.to_json() for e in self.entries]
        rows += [a.to_json() for a in self.attempts]
        rows += [f.to_json() for f in self.failures]
        rows += [q.to_json() for q in self.quarantined]
        return rows


def list_cache(root: CacheRoot, *, compat: Compat | None, trusted: TrustedKeys | None = None) -> Listing:
    found = scan(root, compat=compat, trusted=trusted, hints=True)
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
    # What the entry's signature.json says (key, when, by whom): a claim unless entry.trust says
    # "trusted"; None when unsigned. And why it does not parse, if it does not.
    signature: Mapping[str, Any] | None = None
    # Pre-ready server exits on hits of this key, newest first (cachemgr.volume.serverfail): those
    # of the entry as it is now, then those of copies set aside or removed before.
    server_failed: tuple[ServerFailure, ...] = ()
    server_failed_before: tuple[ServerFailure, ...] = ()

    @property
    def status(self) -> str:
        """What ``show`` found, from the check it prints: the files' sizes and mtimes against the
        manifest (``damaged`` when any differs), then the scan's judgement (``damaged``, and by
        generation ``incompatible``, ``superseded``, ``newer``); ``ok`` only when the check passed
        and the entry is of this image's generation (or one it cannot order)."""
        if self.entry is None:
            return "not published"
        if self.problems or self.entry.status == "damaged":
            return "damaged"
        return self.entry.status if self.entry.status in {"incompatible", "superseded", "newer"} else "ok"

    @property
    def created_at(self) -> float | None:
        """When it was published, as its manifest (or summary) says; None for a damaged entry
        that has neither (its folder's mtime is no publication time)."""
        made = (self.manifest or {}).get("created_at")
        if isinstance(made, int | float) and not isinstance(made, bool):
            return float(made)
        if self.entry is None or self.entry.status == "damaged":
            return None
        return self.entry.created_at

    @property
    def inputs(self) -> Mapping[str, Any]:
        return as_dict(self.key_doc.get("inputs")) or as_dict((self.manifest or {}).get("inputs"))

    def to_json(self) -> dict[str, Any]:
        doc = self.key_doc
        return {
            "key": self.digest,
            "entry": self.name,
            "published": self.entry is not None,
            "status": self.status if self.entry else None,
            "checked": "sizes and mtimes against the manifest" if self.manifest else None,
            "origin": self.entry.to_json()["origin"] if self.entry else None,
            "problem": self.entry.problem if self.entry else None,
            "size_bytes": self.entry.size_bytes if self.entry else None,
            "created_at": self.created_at,
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
            "server_failed": [f.to_json() for f in self.server_failed],
            "server_failed_before": [f.to_json() for f in self.server_failed_before],
            "signer": self.entry.signer if self.entry else None,
            "trust": self.entry.trust if self.entry else None,
            "signature": dict(self.signature) if self.signature is not None else None,
            "generation": self.entry.to_json()["generation"] if self.entry else None,
            "vs_image": self.entry.vs_image if self.entry else None,
            "superseded_by": self.entry.superseded_by if self.entry else None,
        }


def find_key(root: CacheRoot, query: str) -> KeyMatch:
    """A unique digest prefix or an entry name (``entry/NAME`` too, as ``-o name`` prints it) -> the
    key; NotFoundError when none matches, UsageError when several do."""
    query = strip_kind(query)
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
        moved = _quarantined_matching(root, query, prefix)
        if moved is not None:
            reason = f" ({safe(moved.reason)})" if moved.reason else ""
            raise NotFoundError(
                f"no published entry, compile attempt or failure record under {root.path} matches {query!r}: "
                f"its entry was moved aside to quarantine/{safe(moved.name)}{reason}",
                remedy="the next pod start compiles the key again; 'cachemgr prune --damaged --yes' removes "
                "the quarantined copy ('cachemgr ls' lists it under QUARANTINE)",
            )
        raise NotFoundError(
            f"no entry, compile attempt or failure record under {root.path} matches {query!r}",
            remedy="'cachemgr ls' lists the keys; pass a prefix of one or an entry name",
        )
    raise UsageError(
        f"{query!r} matches {plural(len(matches), 'key')} ({_candidates(matches)})",
        remedy="pass a longer prefix or the entry name",
    )


def _candidates(matches: dict[str, str | None]) -> str:
    """The keys an ambiguous query matches, each as an operator can tell it from the others: 12
    digits, or the whole name where two share those (a name planted with a key's digits, seed
    7171 trial 86, printed "b9657c6a7a85, b9657c6a7a85"); an entry's name beside its key."""
    keys = sorted(matches)
    width = 12 if len({d[:12] for d in keys}) == len(keys) else max(len(d) for d in keys)
    shown = [safe(d[:width]) + (f" (entry {safe(matches[d] or '')})" if matches[d] else "") for d in keys[:6]]
    return ", ".join(shown) + (", ..." if len(keys) > 6 else "")


def _quarantined_matching(root: CacheRoot, query: str, prefix: str) -> Quarantined | None:
    """The newest quarantined copy of the key ``query`` names (a digest prefix, the entry's name,
    or the quarantine name ``ls -o name`` prints), or None."""
    name = query.removeprefix("quarantine/")
    found = []
    for moved in quarantined(root):
        # NAME.TIMESTAMP.RANDOM, NAME ending in __DIGEST16 (the model part may hold dots).
        entry, _, _ = moved.name.rpartition("__")
        digest16 = moved.name.rpartition("__")[2].split(".", 1)[0]
        own = f"{entry}__{digest16}"
        if name in {moved.name, own} or (
            len(digest16) == 16 and (digest16.startswith(prefix) or prefix.startswith(digest16))
        ):
            found.append(moved)
    return max(found, key=lambda q: q.moved_at or 0.0) if found else None


def strip_kind(query: str) -> str:
    """``entry/NAME`` (a line of ``ls -o name``) -> ``NAME``; other queries as given."""
    kind, slash, rest = query.partition("/")
    return rest if slash and kind in {"entry", "failure", "lease", "stats"} and rest else query


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


def show(
    root: CacheRoot, query: str, *, compat: Compat | None, trusted: TrustedKeys | None = None
) -> EntryDetail:
    match = find_key(root, query)
    warnings: list[str] = []
    entry = scan_entry(root, match.entry, compat=compat, trusted=trusted) if match.entry else None
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
    records = failures(root, match.digest, warnings=warnings)
    served = serverfail.read(root, match.digest)
    warnings += served.notes
    instance = serverfail.instance_of(entry.created_at) if entry is not None else ""
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
        server_failed=served.of(instance),
        server_failed_before=served.before(instance),
        warnings=tuple(warnings),
        signature=_signature(root, entry) if entry is not None else None,
    )


def _signature(root: CacheRoot, entry: EntryInfo) -> dict[str, Any] | None:
    """``show``: the signature's key and statement (not the file list's hash), as signed."""
    from cachemgr.volume.trust import SignatureError, read_signed

    try:
        signed = read_signed(entry.path, within=root.path)
    except (OSError, SignatureError) as error:
        return {"problem": str(error)}
    if signed is None:
        return None
    statement = signed.statement
    return {
        "key": signed.key_name,
        "signed_at": statement.signed_at,
        "built_by": dict(statement.built_by),
        "files": statement.files,
        "bytes": statement.total_bytes,
        "for_key": statement.key,
    }


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
