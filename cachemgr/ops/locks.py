"""``locks``: every lease marker on the volume and who holds it (ages by this node's clock).

The lease module is imported only when a holder is read: ``ls`` and ``du`` never need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cachemgr.ops.progress import Seen, read_record
from cachemgr.volume.entries import entry_names, listdir
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.stale import StagingInfo, list_staging

if TYPE_CHECKING:
    from cachemgr.volume.lease import Holder


@dataclass(frozen=True)
class LockInfo:
    """A lease marker and its holder."""

    key: str
    entry: str
    holder: Holder
    progress: Seen | None = None  # the holder's own progress record (cachemgr.ops.progress)
    # The holder's compile attempt stopped beating (the rule ls uses: cachemgr.ops.attempts): its
    # pod is gone or frozen, or its node's clock is off, while the lease has not expired yet.
    silent: bool = False

    @property
    def stale(self) -> bool:
        """Dead or frozen: the next contender takes it over (:attr:`cachemgr.volume.lease.Holder.stale`)."""
        return self.holder.stale

    @property
    def state(self) -> str:
        """``live``; ``stalled`` (live, but its compile shows no progress past --stall-timeout);
        ``silent`` (its attempt stopped beating, as ``ls`` says; the lease not expired yet); or the
        holder's stale state: ``dead`` (its process is gone) or ``expired``."""
        if self.holder.stale:
            return self.holder.state
        if self.silent:
            return "silent"
        return "stalled" if self.progress is not None and self.progress.snapshot.stalled else "live"

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "short": self.key[:12],
            "entry": self.entry,
            **(holder_json(self.holder) or {}),
            "stale": self.stale,
            "state": self.state,
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
        attempts = list_staging(root, digest) if root.staging.is_dir() else []
        entry = (
            names.get(digest[:16])
            or holder.entry
            or next((str(a.owner["entry"]) for a in attempts if a.owner.get("entry")), "")
        )
        seen = read_record(root, digest, token=holder.token) if holder.current else None
        found.append(LockInfo(digest, entry, holder, seen, silent=_silent(holder, attempts)))
    return found


def _silent(holder: Holder, attempts: list[StagingInfo]) -> bool:
    """The holder's own attempt (its pod and pid) has not beaten for the window ``ls`` uses."""
    from cachemgr.ops.attempts import SILENT_ATTEMPT_AFTER

    own = [a for a in attempts if a.owner.get("pod") == holder.pod and a.owner.get("pid") == holder.pid]
    return bool(own) and all(a.heartbeat_age is None or a.heartbeat_age > SILENT_ATTEMPT_AFTER for a in own)


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
        "state": holder.state,
        "current": holder.current,
    }


def read_holder_of(root: CacheRoot, digest: str) -> Holder | None:
    """The key's lease holder, if any; the lease module is imported only here (ls and du never need it)."""
    from cachemgr.volume.lease import read_holder

    return read_holder(root, digest)
