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

from cachemgr.core.errors import DiskFullError
from cachemgr.core.log import get_logger
from cachemgr.core.units import human_bytes, human_duration
from cachemgr.key.cachekey import CacheKey
from cachemgr.ops.expected import Expectation, expected_size
from cachemgr.ops.generation import labels
from cachemgr.ops.rollout import UNUSED_AFTER, Prunable, RolloutSpace, prunable_now, rollout_space
from cachemgr.ops.scan import Compat, EntryInfo, scan
from cachemgr.volume.layout import CacheRoot

log = get_logger("cachemgr.ops.space")

SpaceCheck = Literal["fail", "warn"]
CHART_KEY = "storage.compileCache.size"
# Where to type the prune a full volume's message names: not in the pod that says it, which
# crash-loops (issue 32, item 9). The chart's toolbox mounts the role's claim without an NPU.
WHERE_TO_PRUNE = "in a pod that mounts this volume (the chart's toolbox: toolbox.enabled=true)"


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
class DiskReport:
    """The one report for a full volume: the same in the log, termination message and failure record.

    Mid-compile it says what was free when the compile started (the figure "free now" is
    measured after the attempt was removed), what the attempt was seen writing, and advises on
    the larger of the estimate and what the attempt filled (a lower bound: it stopped because it
    could not write more). An estimate learned from another configuration may be far too low,
    and the attempt just proved it so; the failure record keeps the figures for the next
    preflight (``_failed_attempt``).
    """

    volume: str
    total_bytes: int
    free_bytes: int
    expected: Expectation
    cause: str
    prunable: Prunable
    written_bytes: int = 0
    free_at_start: int | None = None  # statvfs when the compile started (None: before it did)
    # What the compiler printed (a copytree error lists every file): the report's, not the line's.
    printed: str = ""
    # A warm Job run as the chart's pre-upgrade hook (CACHEMGR_WARM_HOOK): Helm runs it before any
    # Deployment changes, so no old pod can go first, and the remedy says what works there.
    hook: bool = False

    @property
    def filled_bytes(self) -> int:
        """What the volume proved too small for: mid-compile it filled all that was free at the
        start (unless another writer took part of it), however much of its output the compiler
        removed before it exited; always at least what the attempt was seen writing."""
        return max(self.written_bytes, self.free_at_start or 0)

    @property
    def needed_bytes(self) -> int | None:
        """What this compile needs at least: the larger of the estimate and what it filled."""
        if self.expected.bytes is None:
            return self.filled_bytes or None
        return max(self.expected.bytes, self.filled_bytes)

    @property
    def needed_source(self) -> str:
        if self.filled_bytes and self.filled_bytes >= (self.expected.bytes or 0):
            estimate = (
                f"; the estimate was {human_bytes(self.expected.bytes)}, {self.expected.source}"
                if self.expected.bytes is not None
                else ""
            )
            return f"the space the attempt filled{estimate}"
        return self.expected.source

    def what(self) -> str:
        """One line: the volume, the figures that explain it, what the compile needs, and what
        holds the space that prune could free (now, or once an older generation's pods are gone)."""
        head = f"compile cache volume {self.volume} is out of space ({self.cause}): "
        if self.free_at_start is None and not self.written_bytes:
            facts = [f"{human_bytes(self.free_bytes)} free of {human_bytes(self.total_bytes)}"]
        else:
            facts = (
                [
                    f"{human_bytes(self.free_at_start)} of {human_bytes(self.total_bytes)} were free when the compile started"
                ]
                if self.free_at_start is not None
                else [f"the volume has {human_bytes(self.total_bytes)}"]
            )
            if self.written_bytes:
                facts.append(f"the attempt was seen writing {human_bytes(self.written_bytes)}")
            if self.free_at_start is None or human_bytes(self.free_bytes) != human_bytes(self.free_at_start):
                facts.append(f"{human_bytes(self.free_bytes)} free now that it is removed")
        return head + ", ".join(facts) + f"; {self._need()}" + self._held()

    def _held(self) -> str:
        """What prune frees now, by what; else an older generation its pods still use (a rollout
        under way): what it holds, and who. The remedy then names the one command."""
        found = self.prunable
        parts = [
            f"{human_bytes(size)} {status} (an older generation: {labels(e.generation for e in entries)})"
            for status, entries, size in (
                ("incompatible", found.incompatible, found.incompatible_bytes),
                ("superseded", found.superseded, found.superseded_bytes),
            )
            if entries
        ]
        if found.unused:
            newer = found.unused_newer
            of_newer = (
                f" ({human_bytes(found.unused_newer_bytes)} of it a newer image's: {labels(e.generation for e in newer)})"
                if newer
                else ""
            )
            parts.append(
                f"{human_bytes(found.unused_bytes)} unused for {human_duration(UNUSED_AFTER)}{of_newer}"
            )
        if parts:
            return f"; prune can free {human_bytes(self._freeable)} of entries no pod uses now: {', '.join(parts)}"
        if not found.kept:
            return ""
        pods = found.kept_pods
        shown = ", ".join(pods[:2]) + (f" and {len(pods) - 2} more" if len(pods) > 2 else "")
        return (
            f"; nothing can be pruned now: the older generation ({labels(e.generation for e in found.kept)}) holds "
            f"{human_bytes(found.kept_bytes)} in {_count(found.kept, 'entry', 'entries')}, in use by {shown}"
        )

    @property
    def _freeable(self) -> int:
        found = self.prunable
        return found.incompatible_bytes + found.superseded_bytes + found.unused_bytes

    def _need(self) -> str:
        needed = self.needed_bytes
        if needed is None:
            return f"expected size {self.expected.source}"
        if self.filled_bytes or self.expected.lower_bound:
            return f"this compile needs more than {human_bytes(needed)} ({self.needed_source})"
        return f"this compile needs about {human_bytes(needed)} ({self.needed_source})"

    def remedy(self) -> str:
        """At most what one line's remedy holds (core.errors.MESSAGE_LIMIT): one prune command
        with every selector that frees something, where to run it, and the chart key."""
        found = self.prunable
        selectors = [
            flag
            for flag, entries in (
                ("--incompatible", found.incompatible),
                ("--superseded", found.superseded),
                (f"--unused-for {human_duration(UNUSED_AFTER)}", found.unused),
            )
            if entries
        ]
        if self.hook:
            return self._hook_remedy(selectors)
        steps = []
        if self.filled_bytes and self.needed_bytes is not None:
            steps.append(f"give it more than {human_bytes(self.needed_bytes)} of free space")
        raise_it = f"raise {CHART_KEY} (only where the StorageClass allows volume expansion)"
        if selectors:
            steps.append(f"run 'cachemgr prune {' '.join(selectors)} --yes' {WHERE_TO_PRUNE}")
            steps.append(f"or {raise_it}")
        elif found.kept:
            steps.append(raise_it)
            steps.append(
                "or let every old pod go first (rollingUpdate.maxUnavailable: replicas), then run "
                f"'cachemgr prune {found.older_selectors} --yes' {WHERE_TO_PRUNE}"
            )
        else:
            steps += ["nothing can be pruned now ('cachemgr du' shows what uses the space)", f"or {raise_it}"]
        return "; ".join(steps)

    def _hook_remedy(self, selectors: list[str]) -> str:
        """The pre-upgrade hook runs while every old pod serves: letting them go first cannot
        help there. What can: room for both generations (the number), a prune of what no pod
        uses, or the warm Job beside the rollout (warm.hook off)."""
        needed = self.needed_bytes
        size = (
            f" to {human_bytes(self.total_bytes - self.free_bytes + needed)} or more (what it holds now and this compile)"
            if needed is not None
            else ""
        )
        steps = [
            f"the pre-upgrade hook runs before any pod rolls: raise {CHART_KEY}{size} where the StorageClass "
            "allows volume expansion"
        ]
        if selectors:
            steps.append(f"or run 'cachemgr prune {' '.join(selectors)} --yes' {WHERE_TO_PRUNE}")
        later = self.prunable.older_selectors if self.prunable.kept else ""
        steps.append(
            "or set warm.hook=false (the Job then runs beside the rollout"
            + (f"; once the old pods are gone 'cachemgr prune {later} --yes' frees theirs)" if later else ")")
        )
        return "; ".join(steps)

    def to_json(self) -> dict[str, Any]:
        return {
            "volume": self.volume,
            "total_bytes": self.total_bytes,
            "free_bytes": self.free_bytes,
            "free_at_start_bytes": self.free_at_start,
            "expected_bytes": self.expected.bytes,
            "expected_source": self.expected.source,
            "cause": self.cause,
            "printed": self.printed[:2000],
            "written_bytes": self.written_bytes,
            "filled_bytes": self.filled_bytes,
            "needed_bytes": self.needed_bytes,
            "needed_source": self.needed_source,
            "prunable_incompatible_bytes": self.prunable.incompatible_bytes,
            "prunable_incompatible": [e.name for e in self.prunable.incompatible],
            "prunable_unused_bytes": self.prunable.unused_bytes,
            "prunable_unused": [e.name for e in self.prunable.unused],
            "prunable_unused_newer_bytes": self.prunable.unused_newer_bytes,
            "prunable_superseded_bytes": self.prunable.superseded_bytes,
            "prunable_superseded": [e.name for e in self.prunable.superseded],
            "older_in_use_bytes": self.prunable.kept_bytes,
            "older_in_use": [e.name for e in self.prunable.kept],
            "older_in_use_by": list(self.prunable.kept_pods),
            "chart_key": CHART_KEY,
            "hook": self.hook,
        }

    def error(self) -> DiskFullError:
        return DiskFullError(self.what(), remedy=self.remedy(), report=self.to_json())


def _count(items: tuple[EntryInfo, ...], one: str, many: str) -> str:
    return f"{len(items)} {one if len(items) == 1 else many}"


def disk_report(
    root: CacheRoot,
    key: CacheKey,
    *,
    cause: str,
    given: int | None,
    written: int = 0,
    free_at_start: int | None = None,
    printed: str = "",
    hook: bool = False,
) -> DiskReport:
    """Measure the volume and the cache now and build the report.

    Called after the attempt was removed and before its failure record is written, so the
    estimate here does not include this attempt yet; ``needed_bytes`` takes the larger of the two.
    """
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
        free_at_start=free_at_start,
        printed=printed,
        hook=hook,
    )


def _compat(key: CacheKey) -> Compat:
    return Compat.of_key(key.inputs)


@dataclass(frozen=True)
class Preflight:
    """What the check before compiling found: the expectation, the volume then, the entries."""

    expectation: Expectation
    space: VolumeSpace
    entries: tuple[EntryInfo, ...]


def preflight(
    root: CacheRoot,
    key: CacheKey,
    *,
    given: int | None,
    check: SpaceCheck,
    environ: Mapping[str, str] | None = None,
    hook: bool = False,
) -> Preflight:
    """Stop before compiling when the volume (or the pod's $TMPDIR) cannot hold the expected output."""
    entries = scan(root, compat=_compat(key), with_staging=False).entries
    expectation = expected_size(root, key, given=given, entries=entries)
    space = VolumeSpace.measure(root.path)
    tmp_shares_volume = False
    if environ is not None and expectation.bytes is not None:
        tmp_shares_volume = _tmpdir_preflight(root, key, expectation, environ=environ, check=check)
    if tmp_shares_volume and expectation.bytes is not None:
        # The $TMPDIR copy and the cache copy live side by side on one filesystem for a moment.
        expectation = Expectation(
            2 * expectation.bytes,
            f"{expectation.source}, twice: $TMPDIR is on this volume",
            lower_bound=expectation.lower_bound,
        )
    log.info(
        "space_preflight",
        volume=str(root.path),
        free_bytes=space.free_bytes,
        total_bytes=space.total_bytes,
        expected_bytes=expectation.bytes,
        expected_source=expectation.source,
    )
    found = Preflight(expectation, space, entries)
    if expectation.fits(space.free_bytes):
        return found
    report = DiskReport(
        volume=str(root.path),
        total_bytes=space.total_bytes,
        free_bytes=space.free_bytes,
        expected=expectation,
        cause="checked before compiling",
        prunable=prunable_now(entries),
        hook=hook,
    )
    if check == "warn":
        log.warning("space_preflight_short", message=report.what(), remedy=report.remedy())
        return found
    raise report.error()


def _tmpdir_preflight(
    root: CacheRoot, key: CacheKey, expectation: Expectation, *, environ: Mapping[str, str], check: SpaceCheck
) -> bool:
    """The optimum path compiles the whole model into ``$TMPDIR`` first (optimum-rbln modeling.py
    145-147), then copies it to the cache (modeling_base.py 681-718): that copy needs room too.

    Returns whether ``$TMPDIR`` is on the cache volume itself (then the volume needs both copies).
    """
    from cachemgr.key.vllm_rbln import model_impl  # the vllm strategy's facts, on the miss path only

    if key.inputs.get("strategy") != "vllm" or model_impl(key.server.settings, environ) == "vllm":
        return False
    tmp = Path(environ.get("TMPDIR") or "/tmp")  # noqa: S108  # tempfile's own default on Linux
    try:
        space = VolumeSpace.measure(tmp)
        same = os.stat(tmp).st_dev == os.stat(root.path).st_dev
    except OSError:
        return False  # no such TMPDIR: the server's tempfile falls back to another directory
    need = expectation.bytes or 0
    log.info(
        "tmpdir_preflight", tmpdir=str(tmp), free_bytes=space.free_bytes, expected_bytes=need, on_volume=same
    )
    if same or space.free_bytes >= need:
        return same
    message = (
        f"the pod's temporary directory {tmp} has {human_bytes(space.free_bytes)} free, and the optimum-rbln "
        f"compile writes the whole compiled model there first (about {human_bytes(need)}, {expectation.source})"
    )
    remedy = (
        f"give the pod a temporary directory of at least {human_bytes(need)}: an emptyDir mounted at {tmp} with "
        "that sizeLimit (the chart's storage.tmp.sizeLimit), or set TMPDIR to a directory with room"
    )
    if check == "warn":
        log.warning("tmpdir_preflight_short", message=message, remedy=remedy)
        return False
    raise DiskFullError(
        message,
        remedy=remedy,
        report={"tmpdir": str(tmp), "free_bytes": space.free_bytes, "expected_bytes": need},
    )


def warm_space(root: CacheRoot, key: CacheKey) -> RolloutSpace:
    """What a warm Job reports once its key is published: each generation's share, the room left.
    Only shown, never decided on: the scan takes the volume's hints (10,000 entries on JuiceFS in
    a second, not twelve, at the end of a Job a pre-upgrade hook waits for)."""
    compat = Compat.of_key(key.inputs)
    entries = scan(root, compat=compat, with_staging=False, hints=True).entries
    space = VolumeSpace.measure(root.path)
    entry = next((e for e in entries if e.key == key.digest), None)
    return rollout_space(
        entries,
        compat.generation,
        entry_bytes=entry.size_bytes if entry is not None else 0,
        free_bytes=space.free_bytes,
        total_bytes=space.total_bytes,
    )
