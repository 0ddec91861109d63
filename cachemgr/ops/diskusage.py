"""``du``: the volume (statvfs: a CephFS/JuiceFS directory quota shows here), the cache's share
of it, what each generation of entries holds (cachemgr.ops.rollout), and what each ``prune``
selector would free now."""

from __future__ import annotations

import contextlib
import os
import stat
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachemgr.core.units import human_bytes, human_duration
from cachemgr.ops.attempts import Attempt, Quarantined, attempt_of, quarantined
from cachemgr.ops.generation import Generation
from cachemgr.ops.rollout import Share, prunable_now, shares
from cachemgr.ops.scan import Compat, EntryInfo, scan
from cachemgr.ops.space import VolumeSpace
from cachemgr.volume.entries import listdir, tree_usage
from cachemgr.volume.layout import CacheRoot


@dataclass(frozen=True)
class CompilerUsage:
    compiler: str
    entries: int
    size_bytes: int

    @property
    def size_str(self) -> str:
        return human_bytes(self.size_bytes)


@dataclass(frozen=True)
class Freeable:
    """What one ``prune`` selector would free now."""

    selector: str
    flag: str
    items: int
    bytes: int

    @classmethod
    def of(cls, selector: str, flag: str, sizes: list[int]) -> Freeable:
        return cls(selector, flag, len(sizes), sum(sizes))

    @property
    def bytes_str(self) -> str:
        return human_bytes(self.bytes)


@dataclass(frozen=True)
class DiskUsage:
    """``du``: the volume (statvfs: a CephFS/JuiceFS directory quota shows here) and the cache."""

    volume: str
    total_bytes: int
    free_bytes: int
    entries: tuple[EntryInfo, ...]
    attempts: tuple[Attempt, ...]
    quarantined: tuple[Quarantined, ...]
    trash_bytes: int
    unused_after: float
    reserved_bytes: int = 0  # free blocks only root may use (ext4's reserve); 0 on network filesystems
    # Bytes of failure records per key (failures/<digest>/, cachemgr.volume.failure_records).
    failures: tuple[int, ...] = ()
    warnings: tuple[str, ...] = ()
    # This image's compiler is known: without it no entry is judged incompatible, and
    # 'prune --incompatible' refuses to run (exit 78), so du does not offer it.
    compiler_known: bool = True
    image: Generation | None = None  # this image's generation, as far as it is known

    @property
    def by_generation(self) -> tuple[Share, ...]:
        return shares(self.entries, self.image)

    @property
    def used_bytes(self) -> int:
        """As ``df`` shows it: neither free nor reserved."""
        return max(0, self.total_bytes - self.free_bytes - self.reserved_bytes)

    @property
    def usable_bytes(self) -> int:
        """What the pod (not root: the chart's UID 10001) can use: used plus free, without the reserve."""
        return self.used_bytes + self.free_bytes

    @property
    def used_percent(self) -> float | None:
        """As ``df`` computes Use%: of what an unprivileged writer can use."""
        return 100 * self.used_bytes / self.usable_bytes if self.usable_bytes else None

    @property
    def entries_bytes(self) -> int:
        return sum(e.size_bytes for e in self.entries)

    @property
    def staging_bytes(self) -> int:
        return sum(a.size_bytes for a in self.attempts)

    @property
    def quarantine_bytes(self) -> int:
        return sum(q.size_bytes for q in self.quarantined)

    @property
    def failures_bytes(self) -> int:
        return sum(self.failures)

    @property
    def cache_bytes(self) -> int:
        return (
            self.entries_bytes
            + self.staging_bytes
            + self.quarantine_bytes
            + self.trash_bytes
            + self.failures_bytes
        )

    @property
    def by_compiler(self) -> tuple[CompilerUsage, ...]:
        sums: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for entry in self.entries:
            sums[entry.compiler or "?"][0] += 1
            sums[entry.compiler or "?"][1] += entry.size_bytes
        return tuple(CompilerUsage(c, n, b) for c, (n, b) in sorted(sums.items()))

    @property
    def prunable(self) -> tuple[Freeable, ...]:
        """What ``prune`` could free now, never counting an entry in use; the rows do not overlap,
        so they add up to what all the selectors together free. The first two are
        ``space.Prunable``, the figures a pod's disk-full report names."""
        found = prunable_now(self.entries, unused_after=self.unused_after)
        counted = {e.name for e in (*found.incompatible, *found.superseded, *found.unused)}
        damaged = [
            e.size_bytes
            for e in self.entries
            if e.status == "damaged" and not e.in_use and e.name not in counted
        ]
        incompatible = (
            [Freeable.of("incompatible", "--incompatible", [e.size_bytes for e in found.incompatible])]
            if self.compiler_known
            else []
        )
        return (
            *incompatible,
            Freeable.of("superseded", "--superseded", [e.size_bytes for e in found.superseded]),
            Freeable.of(
                "unused",
                f"--unused-for {human_duration(self.unused_after)}",
                [e.size_bytes for e in found.unused],
            ),
            Freeable.of(
                "stale_staging",
                "--stale-staging",
                [a.size_bytes for a in self.attempts if a.status in ("stale", "dead")],
            ),
            Freeable.of("damaged", "--damaged", damaged + [q.size_bytes for q in self.quarantined]),
            Freeable.of("failures", "--failures", list(self.failures)),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "volume": self.volume,
            "total_bytes": self.total_bytes,
            "used_bytes": self.used_bytes,
            "free_bytes": self.free_bytes,
            "reserved_bytes": self.reserved_bytes,
            "usable_bytes": self.usable_bytes,
            "used_percent": None if self.used_percent is None else round(self.used_percent, 1),
            "cache_bytes": self.cache_bytes,
            "entries_bytes": self.entries_bytes,
            "staging_bytes": self.staging_bytes,
            "quarantine_bytes": self.quarantine_bytes,
            "trash_bytes": self.trash_bytes,
            "failures_bytes": self.failures_bytes,
            "failure_keys": len(self.failures),
            "entries": [
                {
                    "key": e.key,
                    "entry": e.name,
                    "compiler": e.compiler,
                    "size_bytes": e.size_bytes,
                    "status": e.status,
                    "generation": e.generation.to_json() if e.generation is not None else None,
                }
                for e in self.entries
            ],
            "image": self.image.to_json() if self.image is not None else None,
            "by_generation": [s.to_json() for s in self.by_generation],
            "by_compiler": [
                {"compiler": c.compiler, "entries": c.entries, "size_bytes": c.size_bytes}
                for c in self.by_compiler
            ],
            "prunable": {
                f.selector: {"flag": f.flag, "items": f.items, "bytes": f.bytes} for f in self.prunable
            },
            "prunable_bytes": sum(f.bytes for f in self.prunable),
            "warnings": list(self.warnings),
        }


def disk_usage(root: CacheRoot, *, compat: Compat | None, unused_after: float = 14 * 86400.0) -> DiskUsage:
    space = VolumeSpace.measure(root.path)
    st = os.statvfs(root.path)
    found = scan(root, compat=compat, hints=True)
    published = {e.key for e in found.entries if e.key}
    return DiskUsage(
        volume=str(root.path),
        total_bytes=space.total_bytes,
        free_bytes=space.free_bytes,
        entries=found.entries,
        attempts=tuple(attempt_of(root, info, published=published) for info in found.staging),
        quarantined=tuple(quarantined(root)),
        trash_bytes=sum(sum(tree_usage(root.trash / name)) for name in listdir(root.trash)),
        failures=tuple(sum(tree_usage(folder)) for folder in _failure_folders(root)),
        unused_after=unused_after,
        reserved_bytes=max(0, (st.f_bfree - st.f_bavail) * st.f_frsize),
        warnings=found.warnings,
        compiler_known=bool(compat is not None and compat.compiler),
        image=compat.generation if compat is not None else None,
    )


def _failure_folders(root: CacheRoot) -> list[Path]:
    """The folders ``prune --failures`` would remove: real directories (a file or link planted
    there is no key's records, and is not followed)."""
    found = []
    for name in listdir(root.failures):
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.lstat(root.failures / name).st_mode):
                found.append(root.failures / name)
    return found
