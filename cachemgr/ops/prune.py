"""``prune``: plan first, then remove in a safe order, never an entry in use.

The plan is a frozen list of what would go and the bytes it frees; ``--dry-run`` prints it.
Execution is safe while pods start and compile beside it:

1. an entry with a live use record is never planned (a record that looks old by this node's
   clock is watched for a heartbeat first: cachemgr.volume.records), and one whose usage folder
   changed since the plan (a pod came, beat or left) is skipped;
2. an entry is first *renamed* into ``trash/`` (atomic: a starting pod now sees a miss,
   never a half-deleted entry);
3. its usage folder is compared with the plan's again at once: a pod that registered in
   between gets the entry renamed back (pods register before they check that the entry is
   still published, so one of the two sees the other). Comparing with what the plan saw, not
   with a clock, makes this hold whatever the registering node's clock says;
4. only then is the trashed copy deleted. Use records are never deleted wholesale: a pod
   registering for a republished entry while a large tree is being deleted keeps its record.

Staging attempts go only when their pod is dead (same host and its pid gone, or silent for
the stale window), judged again just before removal. Every item is claimed by one rename into
``trash/`` before it is deleted, so two prunes never delete the same tree; what a killed prune
left in ``trash/`` goes with ``--stale-staging`` an hour later. Leases are never touched: a
held lease is refreshed by its holder, a dead one is taken over by the next contender.

The one window left: a pod that passes its "still published?" check in the microseconds
between step 1 and step 2 and whose server opens its files before step 3 puts the entry
back. The pod has to build its view and start the server in between (milliseconds at
least), so prune keeps steps 2 and 3 adjacent (the directory fsync comes after).
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cachemgr.core import safefs
from cachemgr.core.fsutil import fsync_dir, random_suffix, read_json, remove_tree, tree_bytes
from cachemgr.core.log import get_logger
from cachemgr.core.units import human_bytes, human_duration
from cachemgr.key.cachekey import CacheKey
from cachemgr.ops.attempts import STALE_STAGING_AFTER
from cachemgr.ops.scan import Compat, EntryInfo, Scan, scan
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.records import Mark, User, observe, read_usage, record_mark
from cachemgr.volume.store import StagingInfo, dead_attempts, list_staging

if TYPE_CHECKING:
    from cachemgr.ops.meter import Meter

log = get_logger("cachemgr.ops.prune")

ItemKind = Literal["entry", "staging", "quarantine", "trash"]
# A trash item older than this was left by a prune that died mid-delete. Younger ones may
# belong to a prune running now (which may still rename its entry back), so they stay.
TRASH_GRACE = 3600.0
_ORDER = {"trash": 0, "quarantine": 1, "staging": 2, "entry": 3}


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
        }


@dataclass(frozen=True)
class PrunePlan:
    """What would be removed, and what was kept back and why."""

    items: tuple[PruneItem, ...]
    kept: tuple[tuple[str, str], ...] = ()

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
    incompatible: bool = False
    unused_for: float | None = None
    keep_bytes: int | None = None
    stale_staging: bool = False
    damaged: bool = False
    stale_after: float = STALE_STAGING_AFTER
    # Entries for these NPU types (upper case), named by the operator: another NPU's entries are
    # not incompatible (that hardware's pods may share the volume), so they go only when asked.
    npu: frozenset[str] = frozenset()

    @property
    def empty(self) -> bool:
        return not (self.incompatible or self.unused_for is not None or self.keep_bytes is not None) and not (
            self.stale_staging or self.damaged or self.npu
        )


def plan_prune(root: CacheRoot, found: Scan, request: PruneRequest, *, identity: PodIdentity) -> PrunePlan:
    """Choose what goes: damaged, stale staging, incompatible, unused, then LRU down to --keep-bytes."""
    items: list[PruneItem] = []
    kept: list[tuple[str, str]] = []
    if request.damaged:
        items += _quarantined(root)
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
            kept.append((entry.name, f"in use by {_pods(entry.users)}"))
            continue
        chosen[entry.name] = _entry_item(entry, reason)
    if request.keep_bytes is not None:
        chosen.update(_over_budget(entries, chosen, request.keep_bytes, kept))
    ordered = sorted(chosen.values(), key=lambda i: i.last_used_at or 0.0)
    return PrunePlan(items=tuple(items) + tuple(ordered), kept=tuple(kept))


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
    )


def _pods(found: Iterable[User]) -> str:
    # A user seen beating although its record looked old by our clock: skew, or a pod that stalled.
    return ", ".join(
        u.pod + (" (beating, though its record looked old here)" if u.silent else "") for u in found
    )


def _entry_reason(entry: EntryInfo, request: PruneRequest) -> str | None:
    if request.damaged and entry.status == "damaged":
        return f"damaged: {entry.problem}"
    if request.incompatible and entry.status == "incompatible":
        return f"incompatible: {entry.problem}"
    if entry.npu.upper() in request.npu:
        return f"for NPU {entry.npu} (--npu)"
    if request.unused_for is not None and entry.unused_for() >= request.unused_for:
        # Whatever its status: an entry nobody used for that long goes (space.Prunable agrees).
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
            kept.append(
                (
                    entry.name,
                    f"in use by {_pods(entry.users)} (over --keep-bytes, but never removed while used)",
                )
            )
            continue
        extra[entry.name] = _entry_item(entry, f"least recently used, cache over {human_bytes(keep_bytes)}")
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
        items.append(PruneItem("quarantine", path, name, size, "moved aside as damaged"))
    return items


def _stale_attempts(
    root: CacheRoot, staging: Iterable[StagingInfo], request: PruneRequest, identity: PodIdentity
) -> list[PruneItem]:
    """Attempts of dead pods, watched before they are taken (store.dead_attempts: no clocks)."""
    return [
        PruneItem(
            "staging",
            info.path,
            f"{info.path.parent.name[:12]}/{info.path.name}",
            tree_bytes(info.path, within=root.path),
            _stale_reason(info.heartbeat_age),
            info.path.parent.name,
            seen=_owner_seen(info, mark),
        )
        for info, mark in dead_attempts(staging, stale_after=request.stale_after, identity=identity)
    ]


def _owner_seen(info: StagingInfo, mark: Mark | None) -> frozenset[tuple[str, Mark]]:
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
        key = _trashed_key(path)
        if key and _has_users(root, key):
            kept.append((f"trash/{path.name}", "a pod uses it: a prune died before renaming it back"))
            continue
        reason = f"left by an interrupted prune {human_duration(age)} ago"
        size = tree_bytes(path, within=root.path)
        items.append(PruneItem("trash", path, f"trash/{path.name}", size, reason, key))
    return items


def _has_users(root: CacheRoot, key: str) -> bool:
    usage = read_usage(root, key)
    return bool(usage.live or observe(usage.silent))


def _trashed_key(path: Path) -> str | None:
    for name in ("summary.json", "key.json"):
        with contextlib.suppress(OSError, ValueError):
            data = read_json(path / name)
            if isinstance(data, dict) and isinstance(data.get("key"), str):
                return str(data["key"])
    return None


def _stale_reason(age: float | None) -> str:
    return (
        "attempt of a dead pod (no owner record)"
        if age is None
        else f"attempt silent for {human_duration(age)}"
    )


# --- execution ------------------------------------------------------------------------------


def execute(
    root: CacheRoot,
    plan: PrunePlan,
    *,
    stale_after: float = STALE_STAGING_AFTER,
    identity: PodIdentity | None = None,
    meter: Meter | None = None,
) -> PruneResult:
    """Remove what the plan lists, in a safe order, re-checking use at each step.

    ``stale_after`` and ``identity`` must be the plan's, so an attempt is judged as it was.
    ``meter`` hears each item's bytes once it is done with (removed, skipped or failed).
    """
    if meter is not None:
        meter.total(plan.bytes)
    identity = identity or PodIdentity.current()
    removed: list[PruneItem] = []
    skipped: list[tuple[PruneItem, str]] = []
    failed: list[tuple[PruneItem, str]] = []
    for item in sorted(plan.items, key=lambda i: _ORDER[i.kind]):
        try:
            why_not = _remove(root, item, stale_after=stale_after, identity=identity)
        except OSError as error:
            failed.append((item, f"{error.strerror or error} ({error.filename or item.path})"))
            log.warning("prune_failed", kind=item.kind, name=item.name, error=str(error))
            continue
        finally:
            if meter is not None:
                meter.advance(item.bytes)
        if why_not is None:
            removed.append(item)
            log.info("pruned", kind=item.kind, name=item.name, bytes=item.bytes, reason=item.reason)
        else:
            skipped.append((item, why_not))
            log.info("prune_skipped", kind=item.kind, name=item.name, because=why_not)
    return PruneResult(tuple(removed), tuple(skipped), tuple(failed))


def _remove(root: CacheRoot, item: PruneItem, *, stale_after: float, identity: PodIdentity) -> str | None:
    if item.kind == "entry":
        return _remove_entry(root, item)
    if item.kind == "staging":
        return _remove_attempt(root, item, stale_after=stale_after, identity=identity)
    # Claimed by one rename first: a prune running beside this one then finds it gone instead
    # of deleting the same tree at the same time (and failing on files the other removed).
    claimed = _to_trash(root, item)
    if claimed is None:
        return "already gone"
    if item.kind == "quarantine":
        safefs.unlink(root.path, item.path.with_name(item.path.name + ".reason.json"))
    remove_tree(claimed, within=root.path)
    return None


def _remove_attempt(
    root: CacheRoot, item: PruneItem, *, stale_after: float, identity: PodIdentity
) -> str | None:
    """A stale attempt, judged again as the plan judged it (its pod may have woken since),
    then renamed away and deleted."""
    now = [info for info in list_staging(root, item.path.parent.name) if info.path == item.path]
    if not now:
        return "already gone"
    if not now[0].is_stale(stale_after=stale_after, identity=identity) or _owner_changed(now[0], item):
        return "its pod refreshed it since the plan: alive"
    trashed = _to_trash(root, item)
    if trashed is None:
        return "already gone"
    safefs.unlink(root.path, now[0].owner_file)
    remove_tree(trashed, within=root.path)
    with contextlib.suppress(OSError):
        safefs.rmdir(root.path, item.path.parent)  # the key's staging folder, if this was its last attempt
    return None


def _owner_changed(info: StagingInfo, item: PruneItem) -> bool:
    """The owner record differs from the plan's look at it: its pod beat (no clock involved)."""
    if item.seen is None:
        return False
    mark = record_mark(os.fspath(info.owner_file))
    return _owner_seen(info, mark) != item.seen


def _remove_entry(root: CacheRoot, item: PruneItem) -> str | None:
    if not item.key or item.seen is None:
        # A damaged entry whose key is unknown: the plan read no usage for it, so judge any
        # key with its 16 digits now (watching silent records), and compare with that after.
        if _in_use_by_prefix(root, item):
            return "in use now"
        item = replace(item, seen=_prefix_seen(root, item))
    why_not = _come_since_plan(root, item)
    if why_not is not None:
        return why_not
    trashed = _to_trash(root, item)
    if trashed is None:
        return "already gone"
    # Step 3 right after the rename, before any fsync: the window for a starting pod stays tiny.
    if _come_since_plan(root, item) is not None:
        return _give_back(root, item, trashed)
    fsync_dir(root.entries)
    remove_tree(trashed, within=root.path)
    if item.key:
        _forget_usage(root, item)
    return None


def _to_trash(root: CacheRoot, item: PruneItem) -> Path | None:
    """Rename the item to a name of its own in ``trash/`` (atomic); None if it is gone already."""
    safefs.make_dirs(root.path, root.trash)
    trashed = root.trash / f"{item.path.name}.{random_suffix(4)}"
    try:
        # From descriptors of both parents: a layout directory swapped for a symlink since the
        # plan makes this fail, never moves (then deletes) what the link points to.
        safefs.rename(root.path, item.path, trashed)
    except FileNotFoundError:
        return None
    return trashed


def _give_back(root: CacheRoot, item: PruneItem, trashed: Path) -> str:
    """A pod registered between the check and the rename: put the entry back where it was."""
    try:
        safefs.rename(root.path, trashed, item.path)
    except OSError:
        # The slot is taken: a pod published the same key meanwhile. Ours is a redundant copy.
        remove_tree(trashed, within=root.path)
        return "in use now (a copy was published meanwhile)"
    fsync_dir(root.entries)
    return "in use now (restored)"


def _come_since_plan(root: CacheRoot, item: PruneItem) -> str | None:
    """Why not to remove the entry now: its usage folder changed since the plan judged it.

    Compared with what the plan saw, not with a clock: a pod that registers or beats meanwhile
    changes the folder whatever its node's clock says (see cachemgr.volume.records).
    """
    assert item.seen is not None  # _remove_entry sees to it
    now = read_usage(root, item.key).seen if item.key else _prefix_seen(root, item)
    if now == item.seen:
        return None
    came = {x for x in now if x[0].endswith(".json")} - item.seen  # a record new or beating since
    return "in use now" if came else "used since the plan was made"


def _prefix_digests(root: CacheRoot, item: PruneItem) -> list[str]:
    prefix = item.name.rsplit("__", 1)[-1]
    return [d for d in safefs.listdir(root.path, root.usage) if d.startswith(prefix)]


def _in_use_by_prefix(root: CacheRoot, item: PruneItem) -> bool:
    return any(_has_users(root, digest) for digest in _prefix_digests(root, item))


def _prefix_seen(root: CacheRoot, item: PruneItem) -> frozenset[tuple[str, Mark]]:
    """The usage folders of every key with the entry's 16 digits, as one ``seen``."""
    seen: set[tuple[str, Mark]] = set()
    for digest in _prefix_digests(root, item):
        usage = read_usage(root, digest)
        seen.update((f"{digest}/{name}", mark) for name, mark in usage.seen)
    return frozenset(seen)


def _forget_usage(root: CacheRoot, item: PruneItem) -> None:
    """Drop the removed entry's last use and the records the plan judged dead, never another.

    The folder itself stays: a pod may be creating its record in it right now (for a copy
    published while we deleted), and removing the folder under it would lose that record.
    A record is removed only while it is exactly as the plan saw it (no clock involved).
    """
    assert item.key is not None  # callers check; mypy needs to know
    if safefs.lstat(root.path, item.path) is not None:
        return  # republished meanwhile: its bookkeeping is live
    dead = dict(x for x in (item.seen or ()) if x[0] != ".")
    shown = root.usage / item.key
    with contextlib.suppress(FileNotFoundError), safefs.open_dir(root.path, shown) as folder:
        for name in os.listdir(folder):
            if name.startswith("."):
                continue  # a record being written (tmp file, then rename): a live pod
            if name.endswith(".json") and (name not in dead or record_mark(f"{shown}/{name}") != dead[name]):
                continue
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISDIR(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode):
                    continue  # not ours: the folder holds files only
                os.unlink(name, dir_fd=folder)


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
