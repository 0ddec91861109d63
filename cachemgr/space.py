"""Disk space: see a full volume coming, and say exactly what to do when it comes anyway.

The chart page warns that a too-small compile cache volume fails the pod's compile step with
``Disk quota exceeded``. Before compiling, cachemgr compares the volume's free space
(statvfs; on CephFS and JuiceFS a directory quota shows there) with the expected size of
this compile: the operator's ``--expected-size``, else what earlier compiles of the same
model took (scaled by the pipeline-parallel degree: each rank's output grows with PP), else
an estimate from the weights. During the compile, ENOSPC/EDQUOT from any write end the
attempt. Either way the same report names the volume, the figures, what can be pruned now
and the chart key to raise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cachemgr.errors import DiskFullError
from cachemgr.key import CacheKey, digest_of
from cachemgr.log import get_logger
from cachemgr.records import failures
from cachemgr.scan import Compat, EntryInfo, scan
from cachemgr.store import CacheRoot
from cachemgr.units import human_bytes, human_duration

log = get_logger("cachemgr.space")

# Compiled RBLN models carry the weights plus graphs and metadata: a little more than the weights.
WEIGHTS_FACTOR = 1.1
UNUSED_AFTER = 14 * 86400.0
SpaceCheck = Literal["fail", "warn"]
CHART_KEY = "storage.compileCache.size"


@dataclass(frozen=True)
class VolumeSpace:
    """statvfs of the cache volume, in bytes (what an unprivileged writer may use)."""

    path: str
    total_bytes: int
    free_bytes: int

    @property
    def used_bytes(self) -> int:
        return max(0, self.total_bytes - self.free_bytes)

    @classmethod
    def measure(cls, path: Path) -> VolumeSpace:
        st = os.statvfs(path)
        return cls(str(path), st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


@dataclass(frozen=True)
class Expectation:
    """How many bytes this compile is expected to write, and where that figure comes from."""

    bytes: int | None
    source: str


def expected_size(
    root: CacheRoot, key: CacheKey, *, given: int | None, entries: tuple[EntryInfo, ...] = ()
) -> Expectation:
    """The operator's figure, else learned from earlier compiles, else estimated from the weights."""
    if given is not None:
        return Expectation(given, "--expected-size")
    learned = _learned(root, key, entries)
    if learned is not None:
        return learned
    weights = _weight_bytes(key)
    if weights:
        pp = key.server.pipeline_parallel_size
        estimate = int(weights * WEIGHTS_FACTOR * pp)
        return Expectation(
            estimate, f"estimated from the weights ({human_bytes(weights)} x {WEIGHTS_FACTOR} x PP {pp})"
        )
    return Expectation(
        None, "unknown: nothing compiled for this model yet and no local weights; pass --expected-size"
    )


def _learned(root: CacheRoot, key: CacheKey, entries: tuple[EntryInfo, ...]) -> Expectation | None:
    model_id = digest_of(key.inputs["model"])[:16]
    pp = key.server.pipeline_parallel_size
    best: tuple[int, str] | None = None
    for entry in entries:
        if entry.model_id != model_id or entry.status == "damaged" or not entry.size_bytes:
            continue
        scaled = entry.size_bytes * pp // max(1, entry.pipeline_parallel_size)
        if best is None or scaled > best[0]:
            note = (
                f", scaled by PP {entry.pipeline_parallel_size} -> {pp}"
                if entry.pipeline_parallel_size != pp
                else ""
            )
            best = (scaled, f"learned from entry {entry.short} ({human_bytes(entry.size_bytes)}{note})")
    for record in failures(root, key.digest):
        # An attempt that ran out of space had written this much: the compile needs more.
        written = int(record.get("bytes_written") or 0)
        if record.get("reason") == "disk-full" and written and (best is None or written > best[0]):
            best = (written, f"an earlier attempt ran out of space after writing {human_bytes(written)}")
    return Expectation(best[0], best[1]) if best else None


def _weight_bytes(key: CacheKey) -> int:
    local = key.details.get("weight_bytes")
    if isinstance(local, int) and local > 0:
        return local
    model = key.inputs.get("model", {})
    if isinstance(model, Mapping) and model.get("kind") == "hub":
        return _hub_cache_weights(str(model["id"]), model.get("revision"))
    return 0


def _hub_cache_weights(model_id: str, revision: Any) -> int:
    """Weights already downloaded to the Hugging Face cache, if any (no network)."""
    hub = Path(
        os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")) / "hub"
    )
    snapshots = hub.expanduser() / f"models--{model_id.replace('/', '--')}" / "snapshots"
    if not snapshots.is_dir():
        return 0
    candidates = [snapshots / str(revision)] if revision else sorted(snapshots.iterdir())
    for snapshot in candidates:
        if snapshot.is_dir():
            total = sum(
                p.stat().st_size for p in snapshot.iterdir() if p.suffix in {".safetensors", ".bin", ".pt"}
            )
            if total:
                return total
    return 0


@dataclass(frozen=True)
class Prunable:
    """What ``cachemgr prune`` could free right now, never counting an entry in use."""

    incompatible: tuple[EntryInfo, ...]
    unused: tuple[EntryInfo, ...]

    @property
    def incompatible_bytes(self) -> int:
        return sum(e.size_bytes for e in self.incompatible)

    @property
    def unused_bytes(self) -> int:
        return sum(e.size_bytes for e in self.unused)


def prunable_now(entries: tuple[EntryInfo, ...], *, unused_after: float = UNUSED_AFTER) -> Prunable:
    idle = [e for e in entries if not e.in_use]
    incompatible = tuple(e for e in idle if e.status == "incompatible")
    unused = tuple(e for e in idle if e.status != "incompatible" and e.unused_for() >= unused_after)
    return Prunable(incompatible, unused)


@dataclass(frozen=True)
class DiskReport:
    """The one report for a full volume: the same in the log, termination message and failure record."""

    volume: str
    total_bytes: int
    free_bytes: int
    expected: Expectation
    cause: str
    prunable: Prunable
    written_bytes: int = 0

    def what(self) -> str:
        need = (
            f"this compile needs about {human_bytes(self.expected.bytes)} ({self.expected.source})"
            if (self.expected.bytes is not None)
            else f"expected size {self.expected.source}"
        )
        wrote = f"; the attempt had written {human_bytes(self.written_bytes)}" if self.written_bytes else ""
        return (
            f"compile cache volume {self.volume} is out of space ({self.cause}): "
            f"{human_bytes(self.free_bytes)} free of {human_bytes(self.total_bytes)}{wrote}; {need}"
        )

    def remedy(self) -> str:
        steps = []
        if self.prunable.incompatible:
            steps.append(
                f"free {human_bytes(self.prunable.incompatible_bytes)} now with 'cachemgr prune --incompatible --yes' "
                f"({_count(self.prunable.incompatible, 'entry', 'entries')} for another compiler version)"
            )
        if self.prunable.unused:
            steps.append(
                f"free {human_bytes(self.prunable.unused_bytes)} with 'cachemgr prune --unused-for 14d --yes' "
                f"({_count(self.prunable.unused, 'entry', 'entries')} unused for {human_duration(UNUSED_AFTER)})"
            )
        if not steps:
            steps.append("nothing can be pruned now ('cachemgr du' shows what uses the space)")
        steps.append(
            f"or raise {CHART_KEY} (it can only grow, and only where the StorageClass allows volume expansion)"
        )
        return "; ".join(steps)

    def to_json(self) -> dict[str, Any]:
        return {
            "volume": self.volume,
            "total_bytes": self.total_bytes,
            "free_bytes": self.free_bytes,
            "expected_bytes": self.expected.bytes,
            "expected_source": self.expected.source,
            "cause": self.cause,
            "written_bytes": self.written_bytes,
            "prunable_incompatible_bytes": self.prunable.incompatible_bytes,
            "prunable_incompatible": [e.name for e in self.prunable.incompatible],
            "prunable_unused_bytes": self.prunable.unused_bytes,
            "prunable_unused": [e.name for e in self.prunable.unused],
            "chart_key": CHART_KEY,
        }

    def error(self) -> DiskFullError:
        return DiskFullError(self.what(), remedy=self.remedy(), report=self.to_json())


def _count(items: tuple[EntryInfo, ...], one: str, many: str) -> str:
    return f"{len(items)} {one if len(items) == 1 else many}"


def disk_report(
    root: CacheRoot, key: CacheKey, *, cause: str, given: int | None, written: int = 0
) -> DiskReport:
    """Measure the volume and the cache now and build the report."""
    entries = scan(root, compat=_compat(key), with_staging=False).entries
    space = VolumeSpace.measure(root.path)
    return DiskReport(
        volume=str(root.path),
        total_bytes=space.total_bytes,
        free_bytes=space.free_bytes,
        expected=expected_size(root, key, given=given, entries=entries),
        cause=cause,
        prunable=prunable_now(entries),
        written_bytes=written,
    )


def _compat(key: CacheKey) -> Compat:
    return Compat(compiler=str(key.inputs["compiler"]), npu=str(key.inputs["npu"]))


def preflight(root: CacheRoot, key: CacheKey, *, given: int | None, check: SpaceCheck) -> Expectation:
    """Stop before compiling when the volume cannot hold the expected output."""
    entries = scan(root, compat=_compat(key), with_staging=False).entries
    expectation = expected_size(root, key, given=given, entries=entries)
    space = VolumeSpace.measure(root.path)
    log.info(
        "space_preflight",
        volume=str(root.path),
        free_bytes=space.free_bytes,
        total_bytes=space.total_bytes,
        expected_bytes=expectation.bytes,
        expected_source=expectation.source,
    )
    if expectation.bytes is None or space.free_bytes >= expectation.bytes:
        return expectation
    report = DiskReport(
        volume=str(root.path),
        total_bytes=space.total_bytes,
        free_bytes=space.free_bytes,
        expected=expectation,
        cause="checked before compiling",
        prunable=prunable_now(entries),
    )
    if check == "warn":
        log.warning("space_preflight_short", message=report.what(), remedy=report.remedy())
        return expectation
    raise report.error()
