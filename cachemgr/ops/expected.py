"""How many bytes a compile is expected to write, and where that figure comes from: the
operator's ``--expected-size``, else what earlier compiles of the same model took (scaled by the
pipeline-parallel degree: each rank's output grows with PP) or what an attempt that ran out of
space proved it needs, else an estimate from the weights, else this key's own entry set aside as
damaged. cachemgr.ops.space compares it with the volume's free space.

Every figure but the operator's and the weights' is read from the volume, where anyone who can
write it can plant one: a size recorded there counts only as a whole number of bytes from 0 to the
volume's own size (statvfs of the cache root). Everything on the volume was written to it, so a
larger figure (1e300 in a planted summary.json) is no size of anything there; it is skipped, and
the estimate comes from the next figure or source, never a false "volume full". An entry of the
model counts for no more than its files hold (a summary rewritten to just under the volume's size
is bounded by one walk of that entry, on a miss only).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachemgr.core import jsonread, safefs
from cachemgr.core.fsutil import tree_bytes
from cachemgr.core.units import human_bytes
from cachemgr.key.cachekey import CacheKey, digest_of
from cachemgr.ops.scan import EntryInfo
from cachemgr.volume.failure_records import failures
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.manifest import SUMMARY_NAME

# Compiled RBLN models carry the weights plus graphs and metadata: a little more than the weights.
WEIGHTS_FACTOR = 1.1


@dataclass(frozen=True)
class Expectation:
    """How many bytes this compile is expected to write, and where that figure comes from."""

    bytes: int | None
    source: str
    # True when learned from an attempt that ran out of space: the compile needs more than this.
    lower_bound: bool = False

    def fits(self, free_bytes: int) -> bool:
        if self.bytes is None:
            return True
        return free_bytes > self.bytes if self.lower_bound else free_bytes >= self.bytes


def expected_size(
    root: CacheRoot, key: CacheKey, *, given: int | None, entries: tuple[EntryInfo, ...] = ()
) -> Expectation:
    """The operator's figure, else learned from earlier compiles, else estimated from the weights."""
    if given is not None:
        return Expectation(given, "--expected-size")
    volume = _volume_bytes(root)
    learned = _learned(root, key, entries, volume)
    if learned is not None:
        return learned
    weights = _weight_bytes(key)
    if weights:
        pp = key.server.pipeline_parallel_size
        estimate = int(weights * WEIGHTS_FACTOR * pp)
        return Expectation(
            estimate, f"estimated from the weights ({human_bytes(weights)} x {WEIGHTS_FACTOR} x PP {pp})"
        )
    aside = _set_aside(root, key, volume)
    if aside is not None:
        return aside
    return Expectation(
        None,
        "unknown: no entry of this model on this volume to learn from, and no local weights; "
        "pass --expected-size",
    )


def _volume_bytes(root: CacheRoot) -> int | None:
    """The volume's size as the space check measures it (None: statvfs cannot tell)."""
    try:
        st = os.statvfs(root.path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def _on_volume(value: Any, volume: int | None) -> int | None:
    """A size read from the volume, if it can be one: a whole number of bytes, not negative, and
    no larger than the volume (None: not a size of anything on it, planted or damaged)."""
    if isinstance(value, float) and value.is_integer():  # false for inf and nan
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value if volume is None or value <= volume else None


def _set_aside(root: CacheRoot, key: CacheKey, volume: int | None) -> Expectation | None:
    """This key's own entry, moved to quarantine/ as damaged (a moment ago, by this very start,
    as often as not): the size it was published with (if it can be a size on this volume), else
    what is left of it."""
    copies = [n for n in safefs.listdir(root.path, root.quarantine) if n.startswith(key.entry_name + ".")]
    for name in sorted(copies, reverse=True):  # NAME.<UTC stamp>.<random>: the newest first
        path = root.quarantine / name
        published = 0
        with (
            contextlib.suppress(OSError, ValueError, safefs.UnsafePathError),
            safefs.open_dir(root.path, path) as fd,
        ):
            summary = jsonread.read(SUMMARY_NAME, dir_fd=fd, limit=1 << 20)
            claimed = summary.get("size_bytes") if isinstance(summary, dict) else None
            published = _on_volume(claimed, volume) or 0
        try:
            found = published or tree_bytes(path, within=root.path)
        except (OSError, safefs.UnsafePathError):
            continue
        if found > 0:
            how = "as published" if published else "what is left of it"
            return Expectation(
                found,
                f"learned from this key's entry set aside as damaged (quarantine/{name}: {human_bytes(found)}, {how})",
            )
    return None


def _learned(
    root: CacheRoot, key: CacheKey, entries: tuple[EntryInfo, ...], volume: int | None
) -> Expectation | None:
    """The largest of this model's entries (scaled by PP) and of what this key's attempts that ran
    out of space proved, counting only sizes that can be sizes on this volume (``_on_volume``)."""
    model_id = digest_of(key.inputs["model"])[:16]
    pp = key.server.pipeline_parallel_size
    best: tuple[int, str, bool] | None = None
    claims = sorted(
        (
            (entry.size_bytes * pp // max(1, entry.pipeline_parallel_size), entry)
            for entry in entries
            if entry.model_id == model_id
            and entry.status != "damaged"
            and entry.size_bytes
            and _on_volume(entry.size_bytes, volume) is not None
        ),
        key=lambda claim: claim[0],
        reverse=True,
    )
    for claimed, entry in claims:
        if best is not None and claimed <= best[0]:
            break  # the largest that holds what it claims is found: no other can beat it
        # What its files hold, not only what its summary says (a writer can rewrite that): one
        # walk of one entry, most often, on a miss about to compile for minutes.
        size = min(entry.size_bytes, tree_bytes(entry.path, within=root.path))
        scaled = size * pp // max(1, entry.pipeline_parallel_size)
        if size and (best is None or scaled > best[0]):
            note = (
                f", scaled by PP {entry.pipeline_parallel_size} -> {pp}"
                if entry.pipeline_parallel_size != pp
                else ""
            )
            best = (scaled, f"learned from entry {entry.short} ({human_bytes(size)}{note})", False)
    for record in failures(root, key.digest):
        failed = _failed_attempt(record, volume)
        if failed is not None and (best is None or failed[0] >= best[0]):
            best = failed
    return Expectation(*best) if best else None


def _failed_attempt(record: Mapping[str, Any], volume: int | None) -> tuple[int, str, bool] | None:
    """What an attempt that ran out of space proved: it needs more than it wrote, and more than
    the volume had free when it started (it filled that). A lower bound, never an estimate; a
    figure that cannot be a size on this volume proves nothing."""
    if record.get("reason") != "disk-full":
        return None
    report = record.get("report")
    report = report if isinstance(report, Mapping) else {}
    written = _on_volume(record.get("bytes_written"), volume) or 0
    free = _on_volume(report.get("free_at_start_bytes"), volume) or 0
    if not (written or free):
        return None
    if free > written:
        source = f"an earlier attempt filled the {human_bytes(free)} that were free when it started"
    else:
        source = f"an earlier attempt ran out of space after writing {human_bytes(written)}"
    return max(written, free), source, True


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
