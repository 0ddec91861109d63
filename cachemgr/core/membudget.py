"""How much page cache a pod may fill without pushing its server's memory into reclaim.

Pages a process reads into the page cache are charged to its memory cgroup (the pod's, in
Kubernetes), and count in ``memory.current`` against ``memory.max`` like the server's own
memory. A read-ahead that fills the cgroup to its limit makes the kernel reclaim, first the
oldest page cache (very likely the read-ahead's own pages, before the server gets to them), and
under pressure the server's memory too; with no swap, an allocation that reclaim cannot satisfy
is an OOM kill. So a read-ahead may take a fraction of the room that is left: ``limit -
current`` of the tightest cgroup on the way to the root (a parent's limit binds its children)
and of the node (``MemAvailable``), and stops early if the pod's usage grows into the rest
(the server allocating while it initialises).

Both cgroup hierarchies are read: v2 (``memory.max``, ``memory.current``; Kubernetes nodes
since 1.25 default to it) and v1 (``memory.limit_in_bytes``, ``memory.usage_in_bytes``). The
pod's own cgroup is the path in ``/proc/self/cgroup``, under the hierarchy's mount; inside a
container with a cgroup namespace that path is ``/`` and the mount is the pod's cgroup itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")
DEFAULT_FRACTION = 0.5
_UNLIMITED = 1 << 60  # v1 writes "no limit" as 9223372036854771712; v2 as "max"


@dataclass(frozen=True)
class Limit:
    """One memory limit that binds this process, and the usage it is counted against."""

    where: str  # the file it was read from, or "node" for MemAvailable
    limit: int
    usage: int

    @property
    def room(self) -> int:
        return max(0, self.limit - self.usage)


@dataclass(frozen=True)
class CgroupFiles:
    """The usage and limit files of one cgroup directory."""

    directory: Path
    limit_name: str
    usage_name: str

    def read(self) -> Limit | None:
        limit = _read_number(self.directory / self.limit_name)
        usage = _read_number(self.directory / self.usage_name)
        if limit is None or usage is None or limit >= _UNLIMITED:
            return None
        return Limit(str(self.directory / self.limit_name), limit, usage)

    def usage(self) -> int | None:
        return _read_number(self.directory / self.usage_name)


@dataclass(frozen=True)
class MemoryBudget:
    """What a read-ahead may bring into the page cache, and the usage at which it must stop.

    ``bytes``: at most this much (a fraction of the tightest room); ``ceiling``: the watched
    cgroup's usage must stay under this (its limit minus the headroom the fraction leaves);
    ``binding``: which limit decided, for the log. ``watch`` is None where no cgroup limits the
    pod (then only the node's MemAvailable, read at the start, bounds it).
    """

    bytes: int
    ceiling: int | None
    binding: str
    watch: CgroupFiles | None = None

    def exceeded(self, *, margin: int = 0) -> bool:
        """The pod's usage is within ``margin`` of the ceiling (what a reader has in flight and
        is about to add): its server grew into the headroom, or we did."""
        if self.watch is None or self.ceiling is None:
            return False
        usage = self.watch.usage()
        return usage is not None and usage + margin >= self.ceiling

    def to_json(self) -> dict[str, object]:
        return {"bytes": self.bytes, "ceiling": self.ceiling, "binding": self.binding}


def budget(
    *,
    fraction: float = DEFAULT_FRACTION,
    cgroup_fs: Path = CGROUP_FS,
    proc_cgroup: Path = PROC_CGROUP,
    meminfo: Path = MEMINFO,
) -> MemoryBudget:
    """``fraction`` of the room left under the tightest of the pod's cgroup limits and the node's."""
    limits = [(limit, files) for files in cgroup_chain(cgroup_fs=cgroup_fs, proc_cgroup=proc_cgroup)
              if (limit := files.read()) is not None]  # fmt: skip
    node = node_available(meminfo)
    candidates: list[tuple[Limit, CgroupFiles | None]] = [*limits]
    if node is not None:
        candidates.append((Limit("node MemAvailable", node, 0), None))
    if not candidates:
        return MemoryBudget(0, None, "no memory figures readable (no /proc/meminfo)")
    tightest, files = min(candidates, key=lambda item: item[0].room)
    allowed = int(tightest.room * fraction)
    if files is None:
        return MemoryBudget(allowed, None, tightest.where)
    return MemoryBudget(allowed, tightest.limit - (tightest.room - allowed), tightest.where, files)


def cgroup_chain(*, cgroup_fs: Path = CGROUP_FS, proc_cgroup: Path = PROC_CGROUP) -> list[CgroupFiles]:
    """This process's memory cgroup and each of its parents up to the mount, v2 and v1."""
    found: list[CgroupFiles] = []
    for version, controllers, path in _memberships(proc_cgroup):
        if version == 2:
            mount, limit, usage = cgroup_fs, "memory.max", "memory.current"
            unified = cgroup_fs / "unified"  # hybrid hosts mount v2 there
            if not (cgroup_fs / "cgroup.controllers").exists() and unified.is_dir():
                mount = unified
        elif "memory" in controllers:
            mount, limit, usage = cgroup_fs / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        found.extend(CgroupFiles(d, limit, usage) for d in _up_to(mount, path))
    return found


def _memberships(proc_cgroup: Path) -> list[tuple[int, set[str], str]]:
    """``/proc/self/cgroup`` lines: ``0::/path`` (v2), ``4:memory:/path`` (v1)."""
    try:
        text = proc_cgroup.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path.startswith("/"):
            continue
        out.append((2 if number == "0" and not controllers else 1, set(controllers.split(",")), path))
    return out


def _up_to(mount: Path, path: str) -> list[Path]:
    """The cgroup's directory and its parents, up to the mount. Inside a container without a
    cgroup namespace the host's path is not under the mount: the mount is the pod's cgroup."""
    parts = [part for part in path.split("/") if part and part not in {".", ".."}]
    chain = [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    existing = [d for d in chain if d.is_dir()]
    return existing or ([mount] if mount.is_dir() else [])


def node_available(meminfo: Path = MEMINFO) -> int | None:
    """The node's ``MemAvailable`` in bytes (memory that can be had without swapping)."""
    try:
        for line in meminfo.read_text(encoding="ascii", errors="replace").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_number(path: Path) -> int | None:
    """A cgroup file holding one number, or "max" (unlimited); None if unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        text = os.read(fd, 64).decode("ascii", errors="replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    if text == "max":
        return _UNLIMITED
    return int(text) if text.isdigit() else None
