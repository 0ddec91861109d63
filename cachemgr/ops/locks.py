"""``locks``: every lease marker on the volume and who holds it (ages by this node's clock).

The lease module is imported only when a holder is read: ``ls`` and ``du`` never need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cachemgr.ops.progress import Seen, read_record
from cachemgr.volume.entries import entry_names, listdir
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.store import list_staging

if TYPE_CHECKING:
    from cachemgr.volume.lease import Holder


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

    @property
    def state(self) -> str:
        """``live``, ``stalled`` (live, but its compile shows no progress past --stall-timeout), or
        the holder's stale state: ``dead`` (its process is gone) or ``expired``."""
        if self.holder.stale:
            return self.holder.state
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
        entry = names.get(digest[:16]) or holder.entry or _staged_entry(root, digest)
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
        "state": holder.state,
        "current": holder.current,
    }


def read_holder_of(root: CacheRoot, digest: str) -> Holder | None:
    """The key's lease holder, if any; the lease module is imported only here (ls and du never need it)."""
    from cachemgr.volume.lease import read_holder

    return read_holder(root, digest)
