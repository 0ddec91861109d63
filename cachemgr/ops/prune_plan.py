"""``prune``'s plan: what would go, and the bytes it frees, as a frozen list (``--dry-run`` prints it).

An entry with a live use record is never planned (a record that looks old by this node's clock is
watched for a heartbeat first: cachemgr.volume.records); staging attempts are planned only when their
pod is dead (same host and its pid gone, or silent for the stale window). Execution, which judges
everything again, is :mod:`cachemgr.ops.prune`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from cachemgr.core import jsonread, safefs
from cachemgr.core.fsutil import tree_bytes
from cachemgr.core.units import human_bytes, human_duration, plural
from cachemgr.ops.attempts import STALE_STAGING_AFTER, gone_reason, gone_status
from cachemgr.ops.scan import EntryInfo, Scan
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.records import Mark, User, observe, read_usage
from cachemgr.volume.stale import StagingInfo, dead_attempts

ItemKind = Literal["entry", "staging", "quarantine", "trash", "failures"]
# A trash item older than this was left by a prune that died mid-delete. Younger ones may
# belong to a prune running now (which may still rename its entry back), so they stay.
TRASH_GRACE = 3600.0


@dataclass(frozen=True)
class PruneItem:
    kind: ItemKind
    path: Path
    name: str
    bytes: int
    reason: str
    key: str | None = None
    # The entry's last use when planned (the order of removal).
    last_used_at: float | None = None
    # What the plan judged on, by name and mark (records.Mark): an entry's usage folder
    # (records.Usage.seen), an attempt's owner record. Any change since means a pod is there.
    seen: frozenset[tuple[str, Mark]] | None = field(default=None, repr=False, compare=False)
    # An entry's generation against this image's (cachemgr.ops.generation): "this image's",
    # "older", "newer", "other" or "unknown", and its name (compiler 0.12, vllm-rbln 0.12.0).
    standing: str = ""
    generation: str = ""

    @property
    def bytes_str(self) -> str:
        return human_bytes(self.bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "path": str(self.path),
            "bytes": self.bytes,
            "reason": self.reason,
            "key": self.key,
            "generation": self.generation or None,
            "vs_image": self.standing or None,
        }


@dataclass(frozen=True)
class PrunePlan:
    """What would be removed, and what was kept back and why."""

    items: tuple[PruneItem, ...]
    kept: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
    # When the plan was made, by this node's monotonic clock: it judged use from what the usage
    # folders held before then, and execution removes no entry until a heartbeat could have
    # written a removed use record again since (cachemgr.ops.prune, step 1).
    looked_at: float = field(default_factory=time.monotonic, compare=False)

    @property
    def bytes(self) -> int:
        return sum(item.bytes for item in self.items)

    @property
    def bytes_str(self) -> str:
        return human_bytes(self.bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "items": [item.to_json() for item in self.items],
            "kept": [{"name": name, "reason": why} for name, why in self.kept],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class PruneResult:
    removed: tuple[PruneItem, ...]
    skipped: tuple[tuple[PruneItem, str], ...]
    # Items that could not be removed because the volume refused (read-only, permissions, I/O).
    failed: tuple[tuple[PruneItem, str], ...] = ()

    @property
    def freed_bytes(self) -> int:
        return sum(item.bytes for item in self.removed)

    @property
    def freed_str(self) -> str:
        return human_bytes(self.freed_bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "freed_bytes": self.freed_bytes,
            "removed": [item.to_json() for item in self.removed],
            "skipped": [{**item.to_json(), "skipped_because": why} for item, why in self.skipped],
            "failed": [{**item.to_json(), "error": why} for item, why in self.failed],
        }


@dataclass(frozen=True, kw_only=True)
class PruneRequest:
    incompatible: bool = False  # an older compiler major.minor or key schema than this image's
    # An older server than this image's (same compiler), or an older generation than another entry
    # of its model, role and NPU (cachemgr.ops.scan.superseded). Never a newer image's entry.
    superseded: bool = False
    unused_for: float | None = None
    keep_bytes: int | None = None
    stale_staging: bool = False
    damaged: bool = False
    failures: bool = False  # the failure records (failures/<digest>/), every key's
    stale_after: float = STALE_STAGING_AFTER
    # Entries for these NPU types (upper case, --for-npu), named by the operator: another NPU's entries are
    # not incompatible (that hardware's pods may share the volume), so they go only when asked.
    npu: frozenset[str] = frozenset()
    # Entries named by the operator (--key, resolved to entry names): one the server cannot load.
    entries: frozenset[str] = frozenset()

    @property
    def empty(self) -> bool:
        return not (
            self.incompatible or self.superseded or self.unused_for is not None or self.keep_bytes is not None
        ) and not (self.stale_staging or self.damaged or self.failures or self.npu or self.entries)


def plan_prune(root: CacheRoot, found: Scan, request: PruneRequest, *, identity: PodIdentity) -> PrunePlan:
    """Choose what goes: damaged, stale staging, incompatible, unused, then LRU down to --keep-bytes."""
    items: list[PruneItem] = []
    kept: list[tuple[str, str]] = []
    if request.damaged:
        items += _quarantined(root)
    if request.failures:
        items += _failure_records(root)
    if request.stale_staging:
        items += _trash_leftovers(root, kept)
        items += _stale_attempts(root, found.staging, request, identity)
    chosen: dict[str, PruneItem] = {}
    entries = _settled(found.entries, request)
    for entry in entries:
        reason = _entry_reason(entry, request)
        if reason is None:
            continue
        if entry.in_use:
            kept.append((entry.name, f"in use by {_pods(entry.users)}{_generation_note(entry)}"))
            continue
        chosen[entry.name] = _entry_item(entry, reason)
    if request.keep_bytes is not None:
        chosen.update(_over_budget(entries, chosen, request.keep_bytes, kept))
    ordered = sorted(chosen.values(), key=lambda i: i.last_used_at or 0.0)
    return PrunePlan(
        items=tuple(items) + tuple(ordered), kept=tuple(kept), notes=_notes(entries, chosen, request)
    )


def _notes(
    entries: tuple[EntryInfo, ...], chosen: dict[str, PruneItem], request: PruneRequest
) -> tuple[str, ...]:
    """What the plan cannot see: signed entries may be served by pods on a read-only mount, which
    record no use unless usage/ is writable to them (the chart's trust.recordUse; docs/design.md,
    "The threat model"), so age and size are no proof of disuse."""
    notes: tuple[str, ...] = ()
    newer = [e for e in entries if e.status == "newer"]
    if newer and (request.incompatible or request.superseded):
        # Said, so that an operator in an older image's pod does not take "nothing to prune" for
        # a volume without a newer generation on it (the rollout's first days).
        notes += (
            f"{plural(len(newer), 'entry')} of a newer image ({human_bytes(sum(e.size_bytes for e in newer))}) "
            "left: this image's --incompatible and --superseded never remove a newer image's entries",
        )
    by_use = request.unused_for is not None or request.keep_bytes is not None
    signed = [e.name for e in entries if e.name in chosen and e.signer]
    if not by_use or not signed:
        return notes
    return (
        *notes,
        f"{len(signed)} of the planned entries are signed: pods serving from a read-only mount record no use "
        "without a writable usage/ (the chart's trust.recordUse), so --unused-for and --keep-bytes count from the builder's last use; run the builder (warm) for every "
        "configuration in use, or prune by --key, --incompatible, --superseded or --for-npu (docs/operator-guide.md, trusted entries)",
    )


def _settled(entries: tuple[EntryInfo, ...], request: PruneRequest) -> tuple[EntryInfo, ...]:
    """The entries, with the silent users of those the request could remove told alive or dead.

    One observation for all of them (records.observe: up to OBSERVE_SECONDS, and only when some
    record is silent by this node's clock), so no entry is removed on a clock's word.
    """
    unsure = [
        e
        for e in entries
        if e.silent_users and not e.in_use and (request.keep_bytes is not None or _entry_reason(e, request))
    ]
    if not unsure:
        return entries
    alive = observe(u for e in unsure for u in e.silent_users)
    told = {
        e.name: replace(e, users=tuple(u for u in e.silent_users if u.path in alive), silent_users=())
        for e in unsure
    }
    return tuple(told.get(e.name, e) for e in entries)


def _entry_item(entry: EntryInfo, reason: str) -> PruneItem:
    return PruneItem(
        "entry",
        entry.path,
        entry.name,
        entry.size_bytes,
        reason,
        entry.key or None,
        entry.last_used_at or entry.created_at,
        entry.usage_seen,
        standing=_STANDING.get(entry.vs_image or "", "unknown") if not entry.older else "older",
        generation=entry.generation.label() if entry.generation is not None else "unknown generation",
    )


_STANDING = {"same": "this image's", "older": "older", "newer": "newer", "unordered": "other"}


def _pods(found: Iterable[User]) -> str:
    # A user seen beating although its record looked old by our clock: skew, or a pod that stalled.
    return ", ".join(
        u.pod + (" (beating, though its record looked old here)" if u.silent else "") for u in found
    )


def _entry_reason(entry: EntryInfo, request: PruneRequest) -> str | None:
    by_status = {
        "damaged": request.damaged,
        "incompatible": request.incompatible,
        "superseded": request.superseded,
    }
    if by_status.get(entry.status) and entry.name not in request.entries:
        return f"{entry.status}: {entry.problem}"
    if entry.name in request.entries:
        failed = f"; its server exited before ready {entry.server_failed}x" if entry.server_failed else ""
        return f"named (--key){failed}{_generation_note(entry)}"
    if entry.npu.upper() in request.npu:
        return f"for NPU {entry.npu} (--for-npu){_generation_note(entry)}"
    if request.unused_for is not None and entry.unused_for() >= request.unused_for:
        # Whatever its status: an entry nobody used for that long goes (space.Prunable agrees).
        return f"unused for {human_duration(entry.unused_for())}{_generation_note(entry)}"
    return None


def _generation_note(entry: EntryInfo) -> str:
    """Which generation an entry chosen by another selector than its generation's is: an
    operator deciding during a rollout must see that a newer image's entry is in the plan."""
    if entry.generation is None:
        return ""
    if entry.status in {"newer", "incompatible", "superseded"}:
        return f" ({entry.status}: {entry.generation.label()})"
    return f" (another generation: {entry.generation.label()})" if entry.vs_image == "unordered" else ""


def _over_budget(
    entries: Iterable[EntryInfo], chosen: dict[str, PruneItem], keep_bytes: int, kept: list[tuple[str, str]]
) -> dict[str, PruneItem]:
    """Least recently used first, until what is left fits in ``keep_bytes``."""
    remaining = [e for e in entries if e.name not in chosen]
    total = sum(e.size_bytes for e in remaining)
    extra: dict[str, PruneItem] = {}
    for entry in sorted(remaining, key=lambda e: e.last_used_at or e.created_at or 0.0):
        if total <= keep_bytes:
            break
        if entry.in_use:
            kept.append(
                (
                    entry.name,
                    f"in use by {_pods(entry.users)} (over --keep-bytes, but never removed while used)"
                    + _generation_note(entry),
                )
            )
            continue
        reason = f"least recently used, cache over {human_bytes(keep_bytes)}{_generation_note(entry)}"
        extra[entry.name] = _entry_item(entry, reason)
        total -= entry.size_bytes
    return extra


def _quarantined(root: CacheRoot) -> list[PruneItem]:
    """What was moved aside: directories, and links or files a pod found in place of an entry
    (removing a link removes the link, never what it points to)."""
    items: list[PruneItem] = []
    for name in safefs.listdir(root.path, root.quarantine):
        if name.startswith(".") or name.endswith(".reason.json"):
            continue
        path = root.quarantine / name
        size = tree_bytes(path, within=root.path)
        items.append(PruneItem("quarantine", path, name, size, _why_moved(path)))
    return items


def _why_moved(path: Path) -> str:
    """What the pod that moved it aside wrote (its ``.reason.json``): untrusted, or damaged."""
    with contextlib.suppress(OSError, ValueError):
        note = jsonread.read(path.with_name(path.name + ".reason.json"))
        if isinstance(note, dict) and str(note.get("reason", "")).startswith("untrusted"):
            return "moved aside as untrusted (not signed by a trusted key as it is)"
    return "moved aside as damaged"


def _failure_records(root: CacheRoot) -> list[PruneItem]:
    """Each key's failure records, one item per key: history only, nothing reads them to decide."""
    items: list[PruneItem] = []
    for digest in safefs.subdirs(root.path, root.failures):
        path = root.failures / digest
        count = sum(1 for name in safefs.listdir(root.path, path) if name.endswith(".json"))
        size = tree_bytes(path, within=root.path)
        items.append(PruneItem("failures", path, digest, size, plural(count, "failure record"), digest))
    return items


def _stale_attempts(
    root: CacheRoot, staging: Iterable[StagingInfo], request: PruneRequest, identity: PodIdentity
) -> list[PruneItem]:
    """Attempts of dead pods, watched before they are taken (stale.dead_attempts: no clocks)."""
    return [
        PruneItem(
            "staging",
            info.path,
            f"{info.path.parent.name[:12]}/{info.path.name}",
            tree_bytes(info.path, within=root.path),
            gone_reason(gone_status(info), info.heartbeat_age),
            info.path.parent.name,
            seen=owner_seen(info, mark),
        )
        for info, mark in dead_attempts(staging, stale_after=request.stale_after, identity=identity)
    ]


def owner_seen(info: StagingInfo, mark: Mark | None) -> frozenset[tuple[str, Mark]]:
    return frozenset({(info.owner_file.name, mark)}) if mark is not None else frozenset()


def _trash_leftovers(root: CacheRoot, kept: list[tuple[str, str]]) -> list[PruneItem]:
    """What a prune that died mid-delete left in ``trash/`` (never what one is deleting now)."""
    items: list[PruneItem] = []
    now = time.time()
    for path in (root.trash / name for name in safefs.subdirs(root.path, root.trash)):
        st = safefs.lstat(root.path, path)
        if st is None:
            continue
        # rename() updates ctime: this is when the item went to the trash.
        age = now - st.st_ctime
        if age < TRASH_GRACE:
            continue
        key = _trashed_key(root, path)
        if key and has_users(root, key):
            kept.append((f"trash/{path.name}", "a pod uses it: a prune died before renaming it back"))
            continue
        reason = f"left by an interrupted prune {human_duration(age)} ago"
        size = tree_bytes(path, within=root.path)
        items.append(PruneItem("trash", path, f"trash/{path.name}", size, reason, key))
    return items


def has_users(root: CacheRoot, *keys: str) -> bool:
    """A live user under any of ``keys``; their silent records are watched together (one
    OBSERVE_SECONDS window, however many folders)."""
    usages = [read_usage(root, key) for key in keys]
    return any(u.live for u in usages) or bool(observe(user for u in usages for user in u.silent))


def _trashed_key(root: CacheRoot, path: Path) -> str | None:
    """The key of a trashed entry or attempt, read from its folder reached without a link (one
    swapped in since the listing is refused, never read through)."""
    try:
        with safefs.open_dir(root.path, path) as fd:
            for name in ("summary.json", "key.json"):
                with contextlib.suppress(OSError, ValueError):
                    data = jsonread.read(name, dir_fd=fd)
                    if isinstance(data, dict) and isinstance(data.get("key"), str):
                        return str(data["key"])
    except (OSError, safefs.UnsafePathError):
        return None
    return None


def named_entries(root: CacheRoot, queries: Iterable[str]) -> list[str]:
    """``--key``: each query (a unique key prefix or an entry name) -> its published entry's name.

    Not found (66) or ambiguous (64) as ``show`` says it: a prune removes only what was named exactly.
    """
    from cachemgr.core.errors import NotFoundError
    from cachemgr.ops.inspection import find_key

    names = []
    for query in queries:
        match = find_key(root, query)
        if match.entry is None:
            raise NotFoundError(
                f"key {match.digest[:12]} has records under {root.path} but no published entry to prune",
                remedy=f"'cachemgr ls' lists the entries; 'cachemgr show {match.digest[:12]}' says what is recorded of this key",
            )
        names.append(match.entry)
    return names
