"""``prune``: plan first, then remove in a safe order, never an entry in use.

The plan (:mod:`cachemgr.ops.prune_plan`) is a frozen list of what would go and the bytes it frees; ``--dry-run`` prints it.
Execution is safe while pods start and compile beside it:

1. an entry with a live use record is never planned (a record that looks old by this node's
   clock is watched for a heartbeat first: cachemgr.volume.records), and one whose usage folder
   changed since the plan (a pod came, beat or left) is skipped. No entry is removed before
   ``OBSERVE_SECONDS`` (8 s: three heartbeats and a margin) have passed on this node's monotonic
   clock since the plan looked: a serving pod whose use record someone removed writes it again
   at its next beat (cachemgr.volume.heartbeat), and its entry is then skipped. Absence is never
   trusted for less than a heartbeat can repair, whatever the folder's times say (anyone who can
   remove a record can also set them);
2. an entry is first *renamed* into ``trash/`` (atomic: a starting pod now sees a miss,
   never a half-deleted entry);
3. its usage folder is compared with the plan's again at once: a pod that registered in
   between gets the entry renamed back (pods register before they check that the entry is
   still published, so one of the two sees the other). Comparing with what the plan saw, not
   with a clock, makes this hold whatever the registering node's clock says;
4. only then is the trashed copy deleted. Use records are never deleted wholesale: a pod
   registering for a republished entry while a large tree is being deleted keeps its record.

Failure records (``--failures``) go a key's folder at a time, claimed by the same rename; a
record a pod writes into the folder just then goes with it (records are history, best effort).

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
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachemgr.core import safefs
from cachemgr.core.fsutil import fit_name, fsync_dir, random_suffix, remove_tree
from cachemgr.core.log import get_logger
from cachemgr.key.cachekey import CacheKey
from cachemgr.ops.attempts import STALE_STAGING_AFTER
from cachemgr.ops.prune_plan import (
    PruneItem,
    PrunePlan,
    PruneRequest,
    PruneResult,
    has_users,
    owner_seen,
    plan_prune,
)
from cachemgr.ops.scan import Compat, scan
from cachemgr.volume.entries import DIGEST
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.records import OBSERVE_SECONDS, Mark, read_usage, record_mark
from cachemgr.volume.stale import StagingInfo, list_staging

if TYPE_CHECKING:
    from cachemgr.ops.meter import Meter

log = get_logger("cachemgr.ops.prune")
# Execution order: leftovers first, entries (which pods may be starting on) last.
_ORDER = {"trash": 0, "failures": 0, "quarantine": 1, "staging": 2, "entry": 3}


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
    repaired_by = plan.looked_at + OBSERVE_SECONDS  # step 1: no entry goes before then
    for item in sorted(plan.items, key=lambda i: _ORDER[i.kind]):
        try:
            why_not = _remove(root, item, stale_after=stale_after, identity=identity, repaired_by=repaired_by)
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


def _await_repairs(repaired_by: float) -> None:
    """Wait until a live pod's heartbeat could have written again a use record removed before the
    plan looked (step 1; ``repaired_by`` on this node's monotonic clock): what shows up by then
    stops the removal (:func:`_come_since_plan`). Once per prune: later entries find it passed."""
    left = repaired_by - time.monotonic()
    if left > 0:
        # Debug, not info: the transcripts of the guide and the reference stay as they are; the
        # wait is documented in reference.md (prune).
        log.debug("prune_waits_for_heartbeats", seconds=round(left, 1))
        time.sleep(left)


def _remove(
    root: CacheRoot, item: PruneItem, *, stale_after: float, identity: PodIdentity, repaired_by: float
) -> str | None:
    if item.kind == "entry":
        return _remove_entry(root, item, repaired_by=repaired_by)
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
    remove_tree(now[0].owner_file, within=root.path)  # a record, or a folder planted as one
    remove_tree(trashed, within=root.path)
    with contextlib.suppress(OSError):
        safefs.rmdir(root.path, item.path.parent)  # the key's staging folder, if this was its last attempt
    _remove_dead_lease(root, item.path.parent.name, now[0].owner)
    return None


def _remove_dead_lease(root: CacheRoot, digest: str, owner: Mapping[str, Any]) -> None:
    """The dead attempt's lease goes with it (marker, holder and progress records), if its pod
    held it and it is stale by the one rule (cachemgr.volume.lease.Holder.stale); never another's."""
    from cachemgr.ops.progress import remove_record
    from cachemgr.volume.lease import remove_dead

    pod, pid = owner.get("pod"), owner.get("pid")
    if not isinstance(pod, str) or not isinstance(pid, int):
        return
    with contextlib.suppress(OSError):
        token = remove_dead(root, digest, pod=pod, pid=pid)
        if token is not None:
            remove_record(root, digest, token=token or None)


def _owner_changed(info: StagingInfo, item: PruneItem) -> bool:
    """The owner record differs from the plan's look at it: its pod beat (no clock involved)."""
    if item.seen is None:
        return False
    mark = record_mark(os.fspath(info.owner_file))
    return owner_seen(info, mark) != item.seen


def _remove_entry(root: CacheRoot, item: PruneItem, *, repaired_by: float) -> str | None:
    if not item.key or item.seen is None:
        # A damaged entry whose key is unknown: the plan read no usage for it, so judge any
        # key with its 16 digits now (watching silent records), and compare with that after.
        if _in_use_by_prefix(root, item):
            return "in use now"
        item = replace(item, seen=_prefix_seen(root, item))
    # Every key with the entry's 16 digits, as seen now: its summary may name a wrong full key,
    # and pods record their use under the one they computed.
    digests = _prefix_digests(root, item) if item.key else []
    around = _seen_of(root, digests)
    # The watch of other keys' silent records (up to OBSERVE_SECONDS) counts toward the wait.
    why_not = _used_under_another_key(root, item, digests)
    _await_repairs(repaired_by)
    why_not = why_not or _come_since_plan(root, item)
    if why_not is not None:
        return why_not
    trashed = _to_trash(root, item)
    if trashed is None:
        return "already gone"
    # Step 3 right after the rename, before any fsync: the window for a starting pod stays tiny.
    if _come_since_plan(root, item) is not None or (item.key and _prefix_seen(root, item) != around):
        return _give_back(root, item, trashed)
    fsync_dir(root.entries)
    remove_tree(trashed, within=root.path)
    if item.key:
        _forget_usage(root, item)
    return None


def _to_trash(root: CacheRoot, item: PruneItem) -> Path | None:
    """Rename the item to a name of its own in ``trash/`` (atomic); None if it is gone already."""
    safefs.make_dirs(root.path, root.trash)
    trashed = root.trash / fit_name("", item.path.name, f".{random_suffix(4)}")
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


def _used_under_another_key(root: CacheRoot, item: PruneItem, digests: list[str]) -> str | None:
    """Users under a key with the entry's 16 digits other than the one the plan read (its
    summary.json may name a wrong full key; pods record their use under the one they computed)."""
    if has_users(root, *(d for d in digests if d != item.key)):
        return "in use now (under another key with its digits)"
    return None


def _prefix_digests(root: CacheRoot, item: PruneItem) -> list[str]:
    """The keys in usage/ with the entry's 16 digits (a pod names its folder by its key: any
    other name there is not a pod's)."""
    prefix = item.name.rsplit("__", 1)[-1]
    return [d for d in safefs.listdir(root.path, root.usage) if d.startswith(prefix) and DIGEST.fullmatch(d)]


def _in_use_by_prefix(root: CacheRoot, item: PruneItem) -> bool:
    return has_users(root, *_prefix_digests(root, item))


def _prefix_seen(root: CacheRoot, item: PruneItem) -> frozenset[tuple[str, Mark]]:
    """The usage folders of every key with the entry's 16 digits, as one ``seen``."""
    return _seen_of(root, _prefix_digests(root, item))


def _seen_of(root: CacheRoot, digests: list[str]) -> frozenset[tuple[str, Mark]]:
    seen: set[tuple[str, Mark]] = set()
    for digest in digests:
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
    compat = Compat.of_key(key.inputs)
    found = scan(root, compat=compat, with_staging=False)
    plan = plan_prune(root, found, PruneRequest(incompatible=True), identity=PodIdentity.current())
    result = execute(root, plan)
    if result.removed:
        log.warning("auto_pruned_incompatible", freed_bytes=result.freed_bytes, entries=len(result.removed))
    return result
