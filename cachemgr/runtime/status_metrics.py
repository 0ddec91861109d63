"""What ``run --status-port`` reports beside the probes: the volume's figures, measured in the
background, and the ``/metrics`` families, built at scrape time (cachemgr.runtime.status_server
serves them).

Figures that cost a walk of the shared volume (cache bytes) or may block on it (statvfs on a hung
NFS mount) are measured by a background thread, at most every :data:`VOLUME_REFRESH_SECONDS` and
soon after this pod publishes or quarantines an entry; a request only reads the last measurement.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cachemgr import __version__
from cachemgr.core.printable import safe
from cachemgr.ops.entryinfo import EntryInfo
from cachemgr.ops.scan import scan, total_bytes
from cachemgr.ops.space import VolumeSpace
from cachemgr.runtime.metrics import FAILURE_REASONS, Metrics
from cachemgr.runtime.probes import stalled
from cachemgr.runtime.state import PHASES, State, heartbeat_age, read_state
from cachemgr.volume.layout import open_root

VOLUME_REFRESH_SECONDS = 30.0


# --- the volume's figures -------------------------------------------------------------------


@dataclass(frozen=True)
class VolumeFigures:
    """The cache volume as last measured: None where a figure could not be taken."""

    path: str
    measured_at: float | None = None
    free_bytes: int | None = None
    size_bytes: int | None = None
    cache_bytes: int | None = None
    entries: int | None = None
    # The largest published entry (damaged ones aside): the room the next compile of this role needs.
    largest_entry_bytes: int | None = None
    # (generation, bytes, entries), largest first (:func:`generation_figures`): what a rollout's
    # second generation needs beside the first.
    generations: tuple[tuple[str, int, int], ...] = ()
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "measured_at": self.measured_at,
            "free_bytes": self.free_bytes,
            "size_bytes": self.size_bytes,
            "cache_bytes": self.cache_bytes,
            "entries": self.entries,
            "largest_entry_bytes": self.largest_entry_bytes,
            "generations": [
                {"generation": name, "bytes": size, "entries": count}
                for name, size, count in self.generations
            ],
            "error": self.error,
        }


def measure_volume(cache_root: Path) -> VolumeFigures:
    """statvfs, and the entries' sizes from their summaries (a scan, never a hash)."""
    try:
        space = VolumeSpace.measure(cache_root)
    except OSError as error:
        return VolumeFigures(str(cache_root), time.time(), error=f"statvfs: {error.strerror or error}")
    figures = VolumeFigures(
        str(cache_root), time.time(), free_bytes=space.free_bytes, size_bytes=space.total_bytes
    )
    try:
        found = scan(open_root(cache_root, create=False), with_staging=False, hints=True)
    except OSError as error:  # VolumeError is one: no layout yet, or a newer one
        return VolumeFigures(**{**figures.__dict__, "error": str(error)})
    usable = [e for e in found.entries if e.status != "damaged"]
    return VolumeFigures(
        **{
            **figures.__dict__,
            "cache_bytes": total_bytes(found.entries),
            "entries": len(found.entries),
            "largest_entry_bytes": max((e.size_bytes for e in usable), default=0),
            "generations": generation_figures(usable),
        }
    )


# A label value is the volume's text (key.json's versions, anyone's to write): bounded in length
# and in number of series, so a planted key.json cannot blow up Prometheus's series count.
GENERATION_SERIES = 8
GENERATION_LABEL_MAX = 120
OTHER_GENERATIONS = "other generations"


def generation_figures(entries: Iterable[EntryInfo]) -> tuple[tuple[str, int, int], ...]:
    """Bytes and entries by generation, named by compiler and vllm-rbln as ``du`` and ``ls`` name
    them (stable as generations come and go), largest first; past :data:`GENERATION_SERIES`, the
    rest summed under ``other generations``."""
    found: dict[str, list[int]] = {}
    for entry in entries:
        gen = entry.generation
        name = safe(gen.label() if gen is not None else "unknown generation")[:GENERATION_LABEL_MAX]
        figures = found.setdefault(name, [0, 0])
        figures[0] += entry.size_bytes
        figures[1] += 1
    ranked = sorted(found.items(), key=lambda item: (-item[1][0], item[0]))
    kept = [(name, size, count) for name, (size, count) in ranked[: GENERATION_SERIES - 1]]
    rest = ranked[GENERATION_SERIES - 1 :]
    if len(rest) == 1:
        kept.append((rest[0][0], rest[0][1][0], rest[0][1][1]))
    elif rest:
        kept.append((OTHER_GENERATIONS, sum(r[1][0] for r in rest), sum(r[1][1] for r in rest)))
    return tuple(kept)


class VolumeWatch:
    """Re-measures the volume in the background: every 30s, and soon after the entries change."""

    def __init__(self, cache_root: Path, metrics: Metrics, *, every: float = VOLUME_REFRESH_SECONDS):
        self.figures = VolumeFigures(str(cache_root))
        self._root = cache_root
        self._metrics = metrics
        self._every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cachemgr-volume", daemon=True)

    def start(self) -> VolumeWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _changes(self) -> tuple[int, int, int]:
        """What moves when this pod changes the entries: a publish, a quarantine."""
        return (self._metrics.compiles, self._metrics.damaged, self._metrics.hits)

    def _run(self) -> None:
        seen: tuple[int, int, int] | None = None
        last = 0.0
        while not self._stop.is_set():
            changes = self._changes()
            if changes != seen or time.monotonic() - last >= self._every:
                seen, last = changes, time.monotonic()
                self.figures = measure_volume(self._root)  # one reference swap: readers see old or new
            self._stop.wait(1.0)


# --- /metrics -------------------------------------------------------------------------------


def _remote_families(remote: dict[str, Any]) -> Iterator[Metric]:
    """The remote tier (cachemgr.remote): 0 when it is off, so dashboards need no special case."""
    yield _counter(
        "cachemgr_remote_hits", "Local misses filled by a download from the remote", remote.get("hits", 0)
    )
    yield _counter("cachemgr_remote_bytes", "Bytes downloaded from the remote", remote.get("bytes", 0))
    yield _counter(
        "cachemgr_remote_seconds", "Seconds spent in downloads that published", remote.get("seconds", 0.0)
    )
    yield _counter("cachemgr_remote_uploads", "Entries uploaded to the remote", remote.get("uploads", 0))
    failed = CounterMetricFamily(
        "cachemgr_remote_failures",
        "Remote downloads or uploads that failed, by problem (the pod compiled or went on)",
        labels=["problem"],
    )
    for problem, count in sorted(remote.get("failures", {}).items()):
        failed.add_metric([problem], count)
    yield failed


def _prefetch_families(prefetch: dict[str, Any]) -> Iterator[Metric]:
    """The read-ahead after a hit's launch (cachemgr.runtime.prefetch); 0 until one ran."""
    yield _counter(
        "cachemgr_prefetch_bytes",
        "Bytes read ahead into the page cache after a launch",
        prefetch.get("bytes", 0),
    )
    yield _counter("cachemgr_prefetch_seconds", "Seconds the read-ahead ran", prefetch.get("seconds", 0.0))
    yield _counter("cachemgr_prefetch_files", "Files the read-ahead read whole", prefetch.get("files", 0))
    skipped = CounterMetricFamily(
        "cachemgr_prefetch_skipped_files",
        "Files the read-ahead left, by reason (server_read: the server got there first; "
        "stopped:memory or stopped:budget: the memory budget; stopped:stop: SIGTERM or the server exited)",
        labels=["reason"],
    )
    for reason, count in sorted(prefetch.get("skipped", {}).items()):
        skipped.add_metric([reason], count)
    yield skipped


class RunCollector:
    """Builds every cachemgr_* family at scrape time from the Metrics object, the state and the volume."""

    def __init__(self, metrics: Metrics, state_dir: Path, volume: VolumeWatch) -> None:
        self._metrics = metrics
        self._state_dir = state_dir
        self._volume = volume

    def collect(self) -> Iterator[Metric]:
        snap = self._metrics.snapshot()
        yield _counter("cachemgr_cache_hits", "Starts that found a published entry and used it", snap.hits)
        yield _counter(
            "cachemgr_cache_misses", "Lookups that found no usable entry (before the lease)", snap.misses
        )
        yield _counter("cachemgr_compiles", "Compiles this pod finished and published", snap.compiles)
        yield _counter(
            "cachemgr_compile_seconds", "Seconds spent in compiles that were published", snap.compile_seconds
        )
        yield _counter(
            "cachemgr_saved_seconds",
            "Compile seconds this pod's start did not spend: the entry's compile time on a hit, less the wait",
            snap.saved_seconds,
        )
        yield _counter(
            "cachemgr_lease_wait_seconds",
            "Seconds spent waiting on another pod's compile lease",
            snap.lease_wait_seconds,
        )
        yield _counter(
            "cachemgr_damaged_entries", "Damaged entries found and moved to quarantine", snap.damaged
        )
        yield _counter(
            "cachemgr_untrusted_entries",
            "Entries not used because no trusted key signed them as they are (unsigned, another key, changed)",
            snap.untrusted,
        )
        yield _counter(
            "cachemgr_recompiled_on_hit",
            "Hits after which the server compiled anyway: the key lacks an input the server hashes",
            snap.recompiled_on_hit,
        )
        yield _counter(
            "cachemgr_resaved_on_hit",
            "Hits after which the server saved a bundle again with other bytes, not larger (no alarm: rebel's "
            "bundles are not shown to be byte-stable)",
            snap.resaved_on_hit,
        )
        yield from _remote_families(snap.remote)
        yield from _prefetch_families(snap.prefetch)
        failures = CounterMetricFamily(
            "cachemgr_failures",
            "Failed runs by reason (kept in the state dir across container restarts of this pod)",
            labels=["reason"],
        )
        for reason in sorted(set(FAILURE_REASONS) | set(snap.failures)):
            failures.add_metric([reason], snap.failures.get(reason, 0))
        yield failures
        spent = CounterMetricFamily(
            "cachemgr_phase_seconds", "Seconds spent in each phase, counted when it ends", labels=["phase"]
        )
        for phase in PHASES:
            spent.add_metric([phase], snap.phase_seconds.get(phase, 0.0))
        yield spent
        yield from self._state_families(snap.phase)
        yield from self._volume_families()

    def _state_families(self, fallback_phase: str) -> Iterator[Metric]:
        try:
            state: State | None = read_state(self._state_dir)
        except (OSError, ValueError, KeyError, TypeError):
            state = None
        current = state.phase if state is not None else fallback_phase
        phase = GaugeMetricFamily(
            "cachemgr_phase", "1 for the phase run is in, 0 for the others", labels=["phase"]
        )
        for name in PHASES:
            phase.add_metric([name], 1.0 if name == current else 0.0)
        yield phase
        info = GaugeMetricFamily(
            "cachemgr_info", "The cache key and entry of this run", labels=["version", "key", "entry"]
        )
        key = (state.key or "") if state else ""
        info.add_metric([__version__, key, (state.entry or "") if state else ""], 1.0)
        yield info
        if state is None:
            return
        yield _gauge("cachemgr_phase_started_timestamp_seconds", "When the current phase began", state.since)
        age = heartbeat_age(self._state_dir)
        if age is not None:
            yield _gauge("cachemgr_heartbeat_age_seconds", "Age of run's heartbeat file", age)
        detail = state.detail
        yield _gauge(
            "cachemgr_compile_stalled",
            "1 while a compile has shown no progress for --stall-timeout",
            1.0 if stalled(state, time.time()) else 0.0,
        )
        for metric, text, known in (
            (
                "cachemgr_compile_expected_seconds",
                "How long the compile under way should take: an earlier compile of its model and compiler",
                "expected_compile_s",
            ),
            (
                "cachemgr_compile_expected_bytes",
                "Bytes the compile under way is expected to write (--expected-size, learned or estimated)",
                "expected_bytes",
            ),
        ):
            value = detail.get(known)
            if state.phase == "compiling" and isinstance(value, int | float) and not isinstance(value, bool):
                yield _gauge(metric, text, float(value))
        if "no_progress_s" in detail:
            yield _gauge(
                "cachemgr_compile_no_progress_seconds",
                "Seconds since the compile last used CPU, wrote or printed",
                float(detail["no_progress_s"]),
            )
            yield _gauge(
                "cachemgr_compile_staging_bytes",
                "Bytes the compile has written to its staging directory so far",
                float(detail.get("staging_bytes", 0)),
            )

    def _volume_families(self) -> Iterator[Metric]:
        figures = self._volume.figures
        for name, text, value in (
            ("cachemgr_cache_bytes", "Bytes of published entries on the cache volume", figures.cache_bytes),
            ("cachemgr_cache_entries", "Published entries on the cache volume", figures.entries),
            ("cachemgr_volume_free_bytes", "Free bytes on the cache volume (statvfs)", figures.free_bytes),
            ("cachemgr_volume_size_bytes", "Size of the cache volume in bytes (statvfs)", figures.size_bytes),
            (
                "cachemgr_cache_largest_entry_bytes",
                "Bytes of the largest published entry on the cache volume: the room the next compile needs",
                figures.largest_entry_bytes,
            ),
            (
                "cachemgr_volume_measured_timestamp_seconds",
                "When the volume figures were last measured",
                figures.measured_at,
            ),
        ):
            if value is not None:
                yield _gauge(name, text, float(value))
        if figures.entries is None:
            return
        by_bytes = GaugeMetricFamily(
            "cachemgr_generation_bytes",
            "Bytes of published entries on the cache volume by generation (compiler, vllm-rbln)",
            labels=["generation"],
        )
        by_count = GaugeMetricFamily(
            "cachemgr_generation_entries",
            "Published entries on the cache volume by generation (compiler, vllm-rbln)",
            labels=["generation"],
        )
        for generation, size, count in figures.generations:
            by_bytes.add_metric([generation], float(size))
            by_count.add_metric([generation], float(count))
        yield by_bytes
        yield by_count


def _counter(name: str, text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, text, value=value)


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)


def build_registry(metrics: Metrics, state_dir: Path, volume: VolumeWatch) -> CollectorRegistry:
    """A registry of its own (not the global one): this run's families and the process's."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(metrics, state_dir, volume))
    ProcessCollector(registry=registry)  # process_cpu_seconds_total, memory, open fds, start time
    return registry
