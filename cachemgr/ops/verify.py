"""``verify``: is anything damaged? A full check of entries against their manifests.

Every file's size and xxh3-128 is compared with the manifest written when the entry was
published, and the manifest itself with its key (the entry's name carries 16 digits of it, and
its inputs hash to it). Damage is reported per entry; with ``fix`` the damaged entries are moved
aside to ``quarantine/`` (as a pod's lookup would), where ``prune --damaged`` removes them.
Healthy entries are only read. A file that cannot be read (EIO, EACCES) is ``unreadable`` and
never moved: a flaky volume is not damage. Files in an entry that its manifest does not list
are warnings: pods never see them (their views list the manifest's files only).

A signed entry's BLAKE3s are checked in the same read as its xxh3s. With trusted keys, each
entry's signature is judged as a trusting pod judges it (cachemgr.volume.trust): an entry no
trusted key signed as it is, is ``untrusted``, and ``fix`` moves it aside too, with the reason
(nothing is deleted for being untrusted: ``quarantine/`` keeps it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cachemgr.core import safefs
from cachemgr.core.errors import NotFoundError, VolumeError
from cachemgr.core.fsutil import walk_names
from cachemgr.core.units import human_bytes, plural
from cachemgr.key.cachekey import digest_of
from cachemgr.ops.inspection import strip_kind
from cachemgr.ops.scan import scan_entry
from cachemgr.volume.entries import entry_digest, entry_names
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.manifest import MANIFEST_NAME, Manifest, ManifestError, check_files, read_manifest
from cachemgr.volume.store import quarantine
from cachemgr.volume.trust import judge, signer_of

if TYPE_CHECKING:
    from cachemgr.core.signing import TrustedKeys
    from cachemgr.ops.meter import Meter

VerifyStatus = Literal["ok", "damaged", "untrusted", "unreadable", "gone"]


@dataclass(frozen=True)
class Verified:
    """One entry's full check: every file's size and xxh3-128 against its manifest."""

    name: str
    key: str
    status: VerifyStatus
    problems: tuple[str, ...]
    size_bytes: int
    seconds: float
    users: tuple[str, ...] = ()
    moved_to: str | None = None
    warnings: tuple[str, ...] = ()
    signer: str | None = None  # the key its signature names (a claim unless trust is "trusted")
    trust: str | None = None  # with trusted keys: "trusted" or why not; None: not checked

    @property
    def size_str(self) -> str:
        return human_bytes(self.size_bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "entry": self.name,
            "key": self.key,
            "status": self.status,
            "problems": list(self.problems),
            "size_bytes": self.size_bytes,
            "seconds": round(self.seconds, 3),
            "in_use_by": list(self.users),
            "moved_to": self.moved_to,
            "warnings": list(self.warnings),
            "signer": self.signer,
            "trust": self.trust,
        }


@dataclass(frozen=True)
class VerifyReport:
    items: tuple[Verified, ...]
    seconds: float
    fix: bool

    @property
    def damaged(self) -> tuple[Verified, ...]:
        return tuple(i for i in self.items if i.status in {"damaged", "untrusted", "unreadable"})

    @property
    def checked_bytes(self) -> int:
        return sum(i.size_bytes for i in self.items)

    def damage_error(self) -> VolumeError | None:
        """Exit 74 ("the cache volume has damage") when anything was damaged or unreadable,
        also once ``fix`` moved it aside: damage on a volume is worth an alert."""
        if not self.damaged:
            return None
        names = ", ".join(i.name for i in self.damaged[:3]) + (", ..." if len(self.damaged) > 3 else "")
        moved = sum(1 for i in self.damaged if i.moved_to)
        untrusted = sum(1 for i in self.damaged if i.status == "untrusted")
        what = (
            "damage"
            if not untrusted
            else ("untrusted entries" if untrusted == len(self.damaged) else "damaged or untrusted entries")
        )
        found = f"found {what} in {len(self.damaged)} of {plural(len(self.items), 'entry')} checked ({names})"
        # Who makes them again, and what to look for: an untrusted entry is no accident of the
        # storage, and only a pod with the signing key replaces it (pods that trust keys wait).
        them = "them" if len(self.damaged) > 1 else "it"
        again = (
            f"the next pod start compiles {them} again"
            if not untrusted
            else "a publisher with the signing key (the builder, a warm Job) compiles untrusted ones again, "
            "and pods that trust the keys wait for it"
        )
        look = (
            "look for what damages the volume (node dmesg, the storage backend)"
            if not untrusted
            else "look for who writes the volume without a trusted key ('cachemgr ls' shows each reason)"
        )
        if self.fix:
            return VolumeError(
                f"{found}; moved {moved} to quarantine",
                remedy=f"{again}; {look}",
                damaged=[i.name for i in self.damaged],
            )
        return VolumeError(
            found,
            remedy=f"run 'cachemgr verify --fix' to move {them} aside; {again}",
            damaged=[i.name for i in self.damaged],
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "checked": len(self.items),
            "checked_bytes": self.checked_bytes,
            "seconds": round(self.seconds, 3),
            "damaged": len(self.damaged),
            "fix": self.fix,
            "items": [i.to_json() for i in self.items],
        }


def verify(
    root: CacheRoot,
    queries: list[str],
    *,
    fix: bool,
    meter: Meter | None = None,
    trusted: TrustedKeys | None = None,
) -> VerifyReport:
    """Hash-check the chosen entries (all by default); with ``fix``, quarantine damaged ones.

    Healthy entries are only read. A file that cannot be read (EIO, EACCES) is reported as
    ``unreadable`` and never moved: a flaky volume is not damage. ``meter`` hears the bytes
    hashed, file by file (a bar on a terminal, progress events in a log).
    """
    started = time.monotonic()
    items = []
    names = _chosen(root, queries)
    if meter is not None:
        meter.total(sum(info.size_bytes for name in names if (info := scan_entry(root, name)) is not None))
    for name in names:
        item = _verify_one(root, name, meter=meter, trusted=trusted)
        if fix and item.status in {"damaged", "untrusted"}:
            item = _move_aside(root, item)
        items.append(item)
    return VerifyReport(tuple(items), time.monotonic() - started, fix)


def _chosen(root: CacheRoot, queries: list[str]) -> list[str]:
    names = entry_names(root)
    if not queries:
        return names
    chosen: dict[str, None] = {}
    for query in map(strip_kind, queries):
        prefix = query.strip().lower()
        matched = [n for n in names if n == query]
        if not matched and prefix:
            matched = [n for n in names if entry_digest(root, n).startswith(prefix)]
        if not matched:
            raise NotFoundError(
                f"no entry under {root.path} matches {query!r}", remedy="'cachemgr ls' lists the entries"
            )
        chosen.update(dict.fromkeys(matched))
    return list(chosen)


def _verify_one(
    root: CacheRoot, name: str, *, meter: Meter | None = None, trusted: TrustedKeys | None = None
) -> Verified:
    path = root.entries / name
    started = time.monotonic()
    info = scan_entry(root, name)
    users = tuple(u.pod for u in info.users) if info else ()
    manifest: Manifest | None = None
    status: VerifyStatus
    warnings: list[str] = []
    try:
        manifest = read_manifest(path)
    except ManifestError as error:
        status, problems = "damaged", [str(error)]
    else:
        status, problems, warnings = _check_entry(
            root, path, manifest, on_file=meter.advance if meter else None
        )
    signer = signer_of(path, within=root.path)
    trust = None
    if trusted and manifest is not None and status == "ok":
        trust = _trust(root, path, manifest, trusted)
        if trust != "trusted":
            status, problems = "untrusted", [trust]
    if status != "ok" and safefs.lstat(root.path, path) is None:
        status, problems = "gone", ["removed while being checked (pruned or quarantined)"]
    return Verified(
        name=name,
        key=(info.key if info else "") or (manifest.key if manifest else ""),
        status=status,
        problems=tuple(problems),
        size_bytes=manifest.total_bytes if manifest else (info.size_bytes if info else 0),
        seconds=time.monotonic() - started,
        users=users,
        warnings=tuple(warnings),
        signer=signer,
        trust=trust,
    )


def _trust(root: CacheRoot, path: Path, manifest: Manifest, trusted: TrustedKeys) -> str:
    """The signature, the key it is for and the signed file list; the bytes were just hashed."""
    try:
        verdict = judge(
            path, manifest, digest=manifest.key, inputs=manifest.inputs, trusted=trusted, within=root.path
        )
    except OSError as error:
        return f"untrusted: signature.json is unreadable ({error.strerror})"
    return "trusted" if verdict.trusted else verdict.reason


def _check_entry(
    root: CacheRoot, path: Path, manifest: Manifest, *, on_file: Callable[[int], None] | None = None
) -> tuple[VerifyStatus, list[str], list[str]]:
    """Status, problems and warnings of one committed entry: its key, then every file's hash."""
    problems = []
    if not path.name.endswith(manifest.key[:16]):
        problems.append(f"manifest.json is for key {manifest.key[:12]}, not this entry")
    elif digest_of(manifest.inputs) != manifest.key:
        problems.append("manifest.json's inputs do not hash to its key (edited after publishing?)")
    try:
        problems += [
            str(p) for p in check_files(path, manifest, mode="full", within=root.path, on_file=on_file)
        ]
        listed = {record.path for record in manifest.files} | {MANIFEST_NAME}
        extra = [rel for rel in walk_names(path, within=root.path) if rel not in listed]
    except safefs.UnsafePathError as error:  # swapped for a link while being checked
        return "damaged", [error.what], []
    except OSError as error:
        return "unreadable", [f"{error.filename or path}: {error.strerror}"], []
    warnings = [
        f"{rel}: not in the manifest (something wrote into a published entry; pods never see it)"
        for rel in extra
    ]
    return ("damaged" if problems else "ok"), problems, warnings


def _move_aside(root: CacheRoot, item: Verified) -> Verified:
    try:
        moved = quarantine(root, root.entries / item.name, reason="; ".join(item.problems))
    except OSError as error:
        return replace(item, problems=(*item.problems, f"could not move it aside: {error.strerror}"))
    if moved is None:
        return replace(item, status="gone", problems=("removed while being checked",))
    return replace(item, moved_to=str(moved))
