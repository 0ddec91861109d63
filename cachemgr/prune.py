"""``prune``: plan first, then remove in a safe order, never an entry in use.

The plan is a frozen list of what would go and the bytes it frees; ``--dry-run`` prints it.
Execution is safe while pods start and compile beside it:

1. an entry with a fresh use record is skipped;
2. an entry is first *renamed* into ``trash/`` (atomic: a starting pod now sees a miss,
   never a half-deleted entry);
3. its use records are checked again: a pod that registered in between gets the entry
   renamed back (pods register before they check the entry, so one of the two sees the other);
4. only then is the trashed copy deleted.

Leases are never touched: a held lease is refreshed by its holder, a dead one is taken over
by the next contender.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog

from cachemgr.fsutil import fsync_dir, remove_tree, tree_bytes
from cachemgr.key import CacheKey
from cachemgr.records import PodIdentity, users
from cachemgr.scan import Compat, EntryInfo, Scan, scan
from cachemgr.store import CacheRoot
from cachemgr.units import human_bytes, human_duration

log = structlog.get_logger("cachemgr.prune")

ItemKind = Literal["entry", "staging", "quarantine"]


@dataclass(frozen=True)
class PruneItem:
    kind: ItemKind
    path: Path
    name: str
    bytes: int
    reason: str
    key: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "path": str(self.path),
            "bytes": self.bytes,
            "reason": self.reason,
            "key": self.key,
        }


@dataclass(frozen=True)
class PrunePlan:
    """What would be removed, and what was kept back and why."""

    items: tuple[PruneItem, ...]
    kept: tuple[tuple[str, str], ...] = ()

    @property
    def bytes(self) -> int:
        return sum(item.bytes for item in self.items)

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "items": [item.to_json() for item in self.items],
            "kept": [{"name": name, "reason": why} for name, why in self.kept],
        }


@dataclass(frozen=True)
class PruneResult:
    removed: tuple[PruneItem, ...]
    skipped: tuple[tuple[PruneItem, str], ...]

    @property
    def freed_bytes(self) -> int:
        return sum(item.bytes for item in self.removed)

    def to_json(self) -> dict[str, Any]:
        return {
            "freed_bytes": self.freed_bytes,
            "removed": [item.to_json() for item in self.removed],
            "skipped": [{**item.to_json(), "skipped_because": why} for item, why in self.skipped],
        }


@dataclass(frozen=True, kw_only=True)
class PruneRequest:
    incompatible: bool = False
    unused_for: float | None = None
    keep_bytes: int | None = None
    stale_staging: bool = False
    damaged: bool = False
    stale_after: float = 3600.0

    @property
    def empty(self) -> bool:
        return not (self.incompatible or self.unused_for is not None or self.keep_bytes is not None) and not (
            self.stale_staging or self.damaged
        )


def plan_prune(root: CacheRoot, found: Scan, request: PruneRequest, *, identity: PodIdentity) -> PrunePlan:
    """Choose what goes: damaged, stale staging, incompatible, unused, then LRU down to --keep-bytes."""
    items: list[PruneItem] = []
    kept: list[tuple[str, str]] = []
    if request.damaged:
        items += _quarantined(root)
    if request.stale_staging:
        items += [
            PruneItem(
                "staging", info.path, info.path.name, tree_bytes(info.path), _stale_reason(info.heartbeat_age)
            )
            for info in found.staging
            if info.is_stale(stale_after=request.stale_after, identity=identity)
        ]
    chosen: dict[str, PruneItem] = {}
    for entry in found.entries:
        reason = _entry_reason(entry, request)
        if reason is None:
            continue
        if entry.in_use:
            kept.append((entry.name, f"in use by {', '.join(u.pod for u in entry.users)}"))
            continue
        chosen[entry.name] = PruneItem("entry", entry.path, entry.name, entry.size_bytes, reason, entry.key)
    if request.keep_bytes is not None:
        chosen.update(_over_budget(found.entries, chosen, request.keep_bytes, kept))
    return PrunePlan(items=tuple(items) + tuple(chosen.values()), kept=tuple(kept))


def _entry_reason(entry: EntryInfo, request: PruneRequest) -> str | None:
    if request.damaged and entry.status == "damaged":
        return f"damaged: {entry.problem}"
    if request.incompatible and entry.status == "incompatible":
        return f"incompatible: {entry.problem}"
    if request.unused_for is not None and entry.status == "ok" and entry.unused_for() >= request.unused_for:
        return f"unused for {human_duration(entry.unused_for())}"
    return None


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
            kept.append((entry.name, "in use (over --keep-bytes, but never removed while used)"))
            continue
        reason = f"least recently used, cache over {human_bytes(keep_bytes)}"
        extra[entry.name] = PruneItem("entry", entry.path, entry.name, entry.size_bytes, reason, entry.key)
        total -= entry.size_bytes
    return extra


def _quarantined(root: CacheRoot) -> list[PruneItem]:
    items: list[PruneItem] = []
    if not root.quarantine.is_dir():
        return items
    for path in sorted(root.quarantine.iterdir()):
        if path.is_dir():
            items.append(PruneItem("quarantine", path, path.name, tree_bytes(path), "moved aside as damaged"))
    return items


def _stale_reason(age: float | None) -> str:
    return (
        "attempt of a dead pod (no owner record)"
        if age is None
        else f"attempt silent for {human_duration(age)}"
    )


def execute(root: CacheRoot, plan: PrunePlan) -> PruneResult:
    """Remove what the plan lists, in a safe order, re-checking use at each step."""
    removed: list[PruneItem] = []
    skipped: list[tuple[PruneItem, str]] = []
    for item in sorted(plan.items, key=lambda i: {"quarantine": 0, "staging": 1, "entry": 2}[i.kind]):
        why_not = _remove(root, item)
        if why_not is None:
            removed.append(item)
            log.info("pruned", kind=item.kind, name=item.name, bytes=item.bytes, reason=item.reason)
        else:
            skipped.append((item, why_not))
            log.info("prune_skipped", kind=item.kind, name=item.name, because=why_not)
    return PruneResult(tuple(removed), tuple(skipped))


def _remove(root: CacheRoot, item: PruneItem) -> str | None:
    if item.kind != "entry":
        if not item.path.exists():
            return "already gone"
        remove_tree(item.path)
        with contextlib.suppress(OSError):
            item.path.with_name(item.path.name + ".json").unlink(missing_ok=True)
            item.path.with_name(item.path.name + ".reason.json").unlink(missing_ok=True)
        return None
    return _remove_entry(root, item)


def _remove_entry(root: CacheRoot, item: PruneItem) -> str | None:
    if item.key and users(root, item.key):
        return "in use now"
    root.trash.mkdir(exist_ok=True)
    trashed = root.trash / f"{item.name}.{secrets.token_hex(4)}"
    try:
        os.rename(item.path, trashed)
    except FileNotFoundError:
        return "already gone"
    fsync_dir(root.entries)
    if item.key and users(root, item.key):
        # A pod registered between our check and the rename: give the entry back.
        with contextlib.suppress(OSError):
            os.rename(trashed, item.path)
            return "in use now (restored)"
        remove_tree(trashed)  # an identical entry was published meanwhile; ours is redundant
        return "in use now (a copy was published meanwhile)"
    remove_tree(trashed)
    if item.key:
        with contextlib.suppress(OSError):
            remove_tree(root.usage / item.key)
    return None


def prune_incompatible_for_space(root: CacheRoot, key: CacheKey, *, given: int | None) -> PruneResult:
    """``--auto-prune incompatible``: free entries this image can never use, before compiling."""
    del given  # the expectation is checked by the preflight that follows
    compat = Compat(compiler=str(key.inputs["compiler"]), npu=str(key.inputs["npu"]))
    found = scan(root, compat=compat, with_staging=False)
    plan = plan_prune(root, found, PruneRequest(incompatible=True), identity=PodIdentity.current())
    result = execute(root, plan)
    if result.removed:
        log.warning("auto_pruned_incompatible", freed_bytes=result.freed_bytes, entries=len(result.removed))
    return result
