"""What else ``ls`` lists beside entries: compile attempts in ``staging/``, failure histories
and quarantined entries.

Fewer than entries by far (one attempt per compile running or dead, one failure history per
key that failed, one per damage found), so these read more per item: key.json, owner, lease,
a walk for sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cachemgr.core.coerce import as_dict, number, read_dict
from cachemgr.core.units import human_bytes, human_duration
from cachemgr.ops.progress import read_record
from cachemgr.volume.entries import listdir, tree_usage
from cachemgr.volume.failure_records import RECORDS_PER_KEY
from cachemgr.volume.failure_records import read_record as read_failure
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.manifest import KEY_NAME
from cachemgr.volume.records import OBSERVE_SECONDS
from cachemgr.volume.stale import StagingInfo, stale_staging_after

if TYPE_CHECKING:
    from cachemgr.volume.lease import Holder

AttemptStatus = Literal["compiling", "stalled", "published", "active", "silent", "stale", "dead"]

# An attempt whose owner record has not been refreshed for this long (by this node's clock) is
# a candidate for --stale-staging; prune then watches it for a beat before removing it (skew).
# The pods' lease durations are unknown here: the rule for the default lease.
STALE_STAGING_AFTER = stale_staging_after()
# An attempt whose owner record has not beaten for this long runs nothing that ``ls`` should
# vouch for: its pod was killed (or its node's clock is off: only a label depends on this).
SILENT_ATTEMPT_AFTER = OBSERVE_SECONDS


def row(kind: str, **fields: Any) -> dict[str, Any]:
    """One item of ``ls -o json``: every kind carries the entry fields (null when unknown)."""
    base: dict[str, Any] = dict.fromkeys(
        ("key", "short", "entry", "model", "role", "compiler", "npu", "created_at", "last_used_at", "problem")
    )
    return {"kind": kind, **base, "size_bytes": 0, "in_use": False, **fields}


@dataclass(frozen=True)
class Attempt:
    """A compile attempt in ``staging/``, with what its owner and the lease say of it."""

    key: str
    name: str
    path: Path
    entry: str
    model: str
    role: str
    compiler: str
    npu: str
    pod: str
    node: str
    started_at: float | None
    heartbeat_age: float | None
    size_bytes: int
    shared_bytes: int  # hard-linked with the published entry (the vllm strategy's copy)
    status: AttemptStatus
    holder: Holder | None = None

    @property
    def size_str(self) -> str:
        return human_bytes(self.size_bytes)

    @property
    def detail(self) -> str:
        if self.status == "compiling":
            refreshed = self.holder.refreshed_age if self.holder else None
            return f"holds the lease, refreshed {human_duration(refreshed)} ago"
        if self.status == "stalled":
            return "holds the lease, but its compile shows no progress past its --stall-timeout"
        if self.status == "published":
            return "entry published; the pod's server still runs from its own copy"
        if self.status == "active":
            return "owner alive, lease not held (publishing, or its lease lapsed)"
        if self.status == "silent":
            return (
                f"owner silent for {human_duration(self.heartbeat_age)}: its pod is gone (or its node's clock "
                "is off) and runs nothing here; 'cachemgr prune --stale-staging' removes it once silent "
                f"for {human_duration(STALE_STAGING_AFTER)}"
            )
        return f"{gone_reason(self.status, self.heartbeat_age)}: 'cachemgr prune --stale-staging' removes it"

    def to_json(self) -> dict[str, Any]:
        return row(
            "staging",
            key=self.key,
            short=self.key[:12],
            entry=self.entry,
            attempt=self.name,
            model=self.model,
            role=self.role,
            compiler=self.compiler,
            npu=self.npu,
            size_bytes=self.size_bytes,
            shared_bytes=self.shared_bytes,
            created_at=self.started_at,
            in_use=self.status not in ("silent", "stale", "dead"),
            pod=self.pod,
            node=self.node,
            heartbeat_age_seconds=self.heartbeat_age,
            status=self.status,
            problem=self.detail if self.status in ("silent", "stale", "dead") else None,
        )


# What each status means, once under the STAGING table (the per-row detail is in -o wide).
LEGEND: dict[str, str] = {
    "compiling": "its pod holds the lease and compiles ('cachemgr locks' shows how far)",
    "stalled": "its pod holds the lease, but the compile shows no progress past --stall-timeout: "
    "liveness restarts that pod",
    "published": "the entry is published; the pod's server still runs from its own copy",
    "active": "its pod is alive without the lease (publishing, or its lease lapsed)",
    "silent": "its pod stopped beating (gone, or its node's clock is off); "
    f"'cachemgr prune --stale-staging' removes it once silent for {human_duration(STALE_STAGING_AFTER)}",
    "stale": f"its pod stopped beating {human_duration(STALE_STAGING_AFTER)} ago or more: "
    "'cachemgr prune --stale-staging' removes it, and its lease",
    "dead": "its pod's process is gone from this host: 'cachemgr prune --stale-staging' removes it, and "
    "its lease",
}


def gone_reason(status: str, heartbeat_age: float | None) -> str:
    """Why an attempt may go, in the words ``ls`` and ``prune`` share: its pod's process is gone
    from this host (``dead``, by cachemgr.volume.liveness, the rule ``locks`` uses too), or it
    has been silent past the window (``stale``), or it has no owner record at all."""
    if status == "dead":
        return "dead: its pod's process is gone from this host"
    if heartbeat_age is None:
        return "stale: no owner record"
    return f"stale: its pod silent for {human_duration(heartbeat_age)}"


def gone_status(info: StagingInfo) -> AttemptStatus:
    """``dead`` or ``stale`` for an attempt that may go (:meth:`StagingInfo.is_stale`)."""
    return "dead" if info.died_here(PodIdentity.current()) else "stale"


@dataclass(frozen=True)
class FailureHistory:
    """Failed compiles of one key (records are kept for inspection, never replayed)."""

    key: str
    records: tuple[Mapping[str, Any], ...]  # oldest first; only the last one for ``ls``
    count: int

    @property
    def last(self) -> Mapping[str, Any]:
        return self.records[-1]

    @property
    def entry(self) -> str:
        return str(self.last.get("entry", ""))

    def to_json(self) -> dict[str, Any]:
        last = self.last
        # The record names the entry it would have been: model__role__c<compiler>__npu__digest.
        parts = self.entry.split("__") if self.entry.count("__") == 4 else ["", "", "", "", ""]
        return row(
            "failure",
            key=self.key,
            short=self.key[:12],
            entry=self.entry,
            model=parts[0].replace("--", "/"),  # the entry name writes a hub id's "/" as "--"
            role=parts[1],
            compiler=parts[2].removeprefix("c"),
            npu=parts[3],
            created_at=number(last.get("time")),
            status="failed",
            failures=self.count,
            reason=last.get("reason"),
            pod=last.get("pod"),
            node=last.get("node"),
            problem=last.get("message"),
        )


@dataclass(frozen=True)
class Quarantined:
    """An entry moved aside as damaged (by a pod's lookup or ``verify --fix``)."""

    name: str
    path: Path
    size_bytes: int
    reason: str
    moved_at: float | None

    def to_json(self) -> dict[str, Any]:
        return row(
            "quarantine",
            entry=self.name,
            size_bytes=self.size_bytes,
            created_at=self.moved_at,
            status="quarantined",
            problem=self.reason,
        )


def attempt_of(root: CacheRoot, info: StagingInfo, *, published: set[str]) -> Attempt:
    from cachemgr.volume.lease import read_holder  # lazy: listing entries needs no lease

    digest = info.path.parent.name
    doc = read_dict(info.path / KEY_NAME)
    inputs = as_dict(doc.get("inputs"))
    own, shared = tree_usage(info.path)
    holder = read_holder(root, digest)
    owner = info.owner
    status: AttemptStatus
    if info.is_stale(stale_after=STALE_STAGING_AFTER, identity=PodIdentity.current()):
        status = gone_status(info)
    elif info.heartbeat_age is None or info.heartbeat_age > SILENT_ATTEMPT_AFTER:
        # Checked before the lease and the entry: a killed pod's lease stays fresh for its
        # duration, and its key may be published (by it, or by the pod that took over), but a
        # pod whose heartbeat stopped is compiling nothing and serving nothing from here.
        status = "silent"
    elif holder is not None and not holder.stale and holder.pod == owner.get("pod"):
        seen = read_record(root, digest, token=holder.token) if holder.current else None
        status = "stalled" if seen is not None and seen.snapshot.stalled else "compiling"
    elif digest in published:
        status = "published"
    else:
        status = "active"
    return Attempt(
        key=digest,
        name=info.path.name,
        path=info.path,
        entry=str(owner.get("entry") or doc.get("entry") or ""),
        model=str(as_dict(doc.get("details")).get("model_name", "")),
        role=str(inputs.get("role", "")),
        compiler=str(inputs.get("compiler", "")),
        npu=str(inputs.get("npu", "")),
        pod=str(owner.get("pod", "")),
        node=str(owner.get("node", "")),
        started_at=number(owner.get("since")),
        heartbeat_age=info.heartbeat_age,
        size_bytes=own,
        shared_bytes=shared,
        status=status,
        holder=holder if status in ("compiling", "stalled") else None,
    )


def failure_histories(
    root: CacheRoot, *, warnings: list[str], last_only: bool = False
) -> list[FailureHistory]:
    """Failure records by key; ``last_only`` reads one record per key (``ls``)."""
    found: list[FailureHistory] = []
    for digest in listdir(root.failures):
        names = sorted(n for n in listdir(root.failures / digest) if n.endswith(".json"))
        # Only the newest are read, each within its size limit: the folder is anyone's to fill.
        chosen = names[-1:] if last_only else names[-RECORDS_PER_KEY:]
        records = [read_failure(root.failures / digest / name, warnings=warnings) for name in chosen]
        records = [r for r in records if r]
        if not records:
            if names:
                warnings.append(f"failures/{digest}: records are unreadable")
            continue
        found.append(FailureHistory(digest, tuple(records), len(names)))
    return found


def quarantined(root: CacheRoot) -> list[Quarantined]:
    found = []
    for name in listdir(root.quarantine):
        path = root.quarantine / name
        if name.endswith(".reason.json"):
            continue  # the rest: entries moved aside, also links or files found in their place
        note = read_dict(path.with_name(name + ".reason.json"))
        own, shared = tree_usage(path)
        found.append(
            Quarantined(name, path, own + shared, str(note.get("reason", "")), number(note.get("at")))
        )
    return found
