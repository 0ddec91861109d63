"""Attempts left by dead pods: listing every attempt on the volume, judging which pods are gone (by
this node's clock and by watching their owner records beat), and removing theirs.

Beside cachemgr.volume.store, whose staging a live pod makes and publishes from: what a lease
holder cleans before it compiles (``clean_stale_staging``), and what ``ls``, ``locks`` and
``prune --stale-staging`` report and remove.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from cachemgr.core import jsonread, safefs
from cachemgr.core.fsutil import remove_tree
from cachemgr.core.log import get_logger
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.records import Mark, observe_marks, record_mark

log = get_logger("cachemgr.volume.stale")

# An attempt's owner record beats every few seconds; silent for this long, its pod is gone.
_STAGING_SILENCE_FLOOR = 300.0


def stale_staging_after(lease_duration: float | None = None) -> float:
    """How long an attempt's owner record may stay silent (by this node's clock) before the
    attempt is a candidate for removal: far beyond its heartbeat, and ten lease durations, so a
    holder that may still hold its lease is never judged dead. ``None``: the pods' durations are
    unknown (``ls``, ``prune``): the floor, which is the rule for the default 30 s lease."""
    return max(_STAGING_SILENCE_FLOOR, 10 * (lease_duration or 0.0))


class StagingInfo(NamedTuple):
    """An attempt directory found on the volume, with what is known of its owner."""

    path: Path
    owner_file: Path
    owner: dict[str, Any]
    heartbeat_age: float | None

    def is_stale(self, *, stale_after: float, identity: PodIdentity) -> bool:
        """Dead for sure (same host, pid gone) or silent for longer than ``stale_after`` by this
        node's clock (a candidate only: :func:`dead_attempts` watches it before anyone removes it)."""
        if self.died_here(identity):
            return True
        return self.heartbeat_age is None or self.heartbeat_age > stale_after

    def died_here(self, identity: PodIdentity) -> bool:
        """Its owner ran on this host, and that process is gone (cachemgr.volume.liveness)."""
        from cachemgr.volume.liveness import owner_gone  # psutil: not on the hit path

        del identity  # this process, as the liveness rule knows it
        return owner_gone(self.owner)


def dead_attempts(
    found: Iterable[StagingInfo], *, stale_after: float, identity: PodIdentity
) -> list[tuple[StagingInfo, Mark | None]]:
    """The attempts whose pods are gone, each with its owner record as last seen.

    Silent by this node's clock is not enough: from a node whose clock is minutes ahead every
    live attempt looks silent. So the owner record of each candidate must also not beat while
    this node watches it on its own monotonic clock (:func:`cachemgr.volume.records.observe_marks`: up
    to ``OBSERVE_SECONDS``, ended by the first beat), unless its pod is known dead on this host.
    A live attempt therefore costs its watcher one heartbeat, a dead one the whole window: paid
    only where an attempt looks long silent, on a miss or by prune, never on a hit. An attempt
    whose owner record is missing is watched the same way: one that appears meanwhile is its
    live pod's, written again at its beat.
    """
    stale = [info for info in found if info.is_stale(stale_after=stale_after, identity=identity)]
    marks = {os.fspath(info.owner_file): record_mark(os.fspath(info.owner_file)) for info in stale}
    unsure = {
        os.fspath(info.owner_file): marks[os.fspath(info.owner_file)]
        for info in stale
        if not info.died_here(identity)
    }
    alive = observe_marks(unsure) if unsure else frozenset()
    return [
        (info, marks[os.fspath(info.owner_file)]) for info in stale if os.fspath(info.owner_file) not in alive
    ]


def list_staging(root: CacheRoot, digest: str | None = None) -> list[StagingInfo]:
    """Attempt directories for one key (or all keys), tolerant of half-written ones."""
    digests = [digest] if digest else safefs.subdirs(root.path, root.staging)
    found: list[StagingInfo] = []
    now = time.time()
    for name in digests:
        parent = root.staging / name
        # Real directories only, reached without following a link: a symlink planted as
        # staging/<digest> or as an attempt is never listed, walked or removed through.
        try:
            attempts = safefs.subdirs(root.path, parent)
        except safefs.UnsafePathError:
            continue  # whoever acts on this key refuses it with the remedy (clean_stale_staging)
        for attempt in (parent / a for a in attempts):
            owner_file = attempt.with_name(attempt.name + ".json")
            try:
                owner = jsonread.read(owner_file)
                age: float | None = max(0.0, now - owner_file.stat().st_mtime)
            except (OSError, ValueError):
                owner, age = {}, None
            found.append(StagingInfo(attempt, owner_file, owner if isinstance(owner, dict) else {}, age))
    return found


def clean_stale_staging(
    root: CacheRoot, digest: str | None, *, stale_after: float, identity: PodIdentity
) -> list[Path]:
    """Remove attempts left by dead pods (a later lease holder or prune does this)."""
    removed: list[Path] = []
    if digest is not None:
        safefs.check_dir(root.path, root.staging / digest)  # a link there: exit 74, never followed
    for info, _ in dead_attempts(list_staging(root, digest), stale_after=stale_after, identity=identity):
        try:
            remove_tree(info.path, within=root.path)
            remove_tree(info.owner_file, within=root.path)  # a record, or a folder planted as one
        except PermissionError as error:  # another user's (a root shell's): the compile goes on beside it
            log.warning(
                "stale_staging_kept",
                attempt=info.path.name,
                error=str(error),
                remedy="remove it as its owner",
            )
            continue
        removed.append(info.path)
    return removed
