"""Counters of one ``run``: what the pod did, for ``/metrics``, ``/status`` and the logs.

The runner increments the fields directly and registers :meth:`Metrics.on_phase` with its
:class:`~cachemgr.runtime.state.StateWriter`; that listener also writes the ``phase`` log event, so
every phase change is logged once, with the key and its timings.

Failures are the exception to "one process": a failing ``run`` exits right after counting
its failure, before anyone scrapes it. With :meth:`Metrics.keep_failures_in` (the status
server sets it up) they are also kept in the pod-local state directory, which survives a
container restart, so the restarted container's ``/metrics`` still shows why the last one
died.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

from cachemgr.core.errors import CacheMgrError, StateDirInUseError
from cachemgr.core.log import get_logger

log = get_logger("cachemgr.run")


def _failure_reasons() -> tuple[str, ...]:
    """The reason of each error class in cachemgr.core.errors that a run can count.

    A busy state dir is refused before the run has metrics, so it is never counted here.
    """
    classes = CacheMgrError.__subclasses__()  # in definition order
    return tuple(
        cls.reason
        for cls in classes
        if cls.__module__ == CacheMgrError.__module__ and cls is not StateDirInUseError
    )


# Reasons a run can fail with: exported at 0 from the start, so a rate() sees the first one.
FAILURE_REASONS: tuple[str, ...] = _failure_reasons()
FAILURES_FILE = "failures.json"


class MetricsSnapshot(NamedTuple):
    """A consistent copy of the counters, safe to render from another thread."""

    hits: int
    misses: int
    compiles: int
    compile_seconds: float
    lease_wait_seconds: float
    damaged: int
    recompiled_on_hit: int
    failures: dict[str, int]
    phase: str
    phase_seconds: dict[str, float]
    remote: dict[str, Any]
    prefetch: dict[str, Any]
    untrusted: int = 0
    saved_seconds: float = 0.0
    server_failed: int = 0
    resaved_on_hit: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "compiles": self.compiles,
            "compile_seconds": round(self.compile_seconds, 3),
            "saved_seconds": round(self.saved_seconds, 3),
            "lease_wait_seconds": round(self.lease_wait_seconds, 3),
            "damaged": self.damaged,
            "untrusted": self.untrusted,
            "recompiled_on_hit": self.recompiled_on_hit,
            "resaved_on_hit": self.resaved_on_hit,
            "server_failed": self.server_failed,
            "failures": dict(sorted(self.failures.items())),
            "phase": self.phase,
            "phase_seconds": {k: round(v, 3) for k, v in sorted(self.phase_seconds.items())},
            "remote": dict(self.remote),
            "prefetch": dict(self.prefetch),
        }


class Metrics:
    """The counters, incremented by the runner (a plain class: the hit path makes no dataclass)."""

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.compiles = 0
        self.compile_seconds = 0.0
        # Compile time this start did not spend: the entry's compile on a hit, less the wait after one.
        self.saved_seconds = 0.0
        self.lease_wait_seconds = 0.0
        self.damaged = 0
        # Entries not trusted (cachemgr.volume.trust): unsigned, another key's, changed after signing.
        self.untrusted = 0
        # Hits after which the server compiled anyway (cachemgr.volume.drift): the key missed an input.
        self.recompiled_on_hit = 0
        # Hits after which the server saved a bundle again, not larger, with other bytes: no alarm, said apart.
        self.resaved_on_hit = 0
        # Servers launched on a hit that exited before they were ready (cachemgr.runtime.server_failures).
        self.server_failed = 0
        self.failures: Counter[str] = Counter()
        self.phase = "resolving"
        # Seconds spent in each phase this run, counted when the phase ends.
        self.phase_seconds: dict[str, float] = {}
        # Failures of earlier containers of this pod (see keep_failures_in).
        self.previous_failures: Counter[str] = Counter()
        # The remote tier (cachemgr.remote): downloads that replaced a compile, uploads, failures by problem.
        self.remote_hits = 0
        self.remote_misses = 0
        self.remote_bytes = 0
        self.remote_seconds = 0.0
        self.remote_uploads = 0
        self.remote_upload_bytes = 0
        self.remote_failures: Counter[str] = Counter()
        # The read-ahead after a hit's launch (cachemgr.runtime.prefetch): bytes, seconds, files left by reason.
        self.prefetch_bytes = 0
        self.prefetch_seconds = 0.0
        self.prefetch_files = 0
        self.prefetch_skipped: Counter[str] = Counter()
        self._failures_file: Path | None = None
        self._lock = threading.Lock()

    def failure(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] += 1
            total = self.previous_failures + self.failures
        if self._failures_file is not None:
            _save_counts(self._failures_file, total)

    def remote_hit(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.remote_hits += 1
            self.remote_bytes += nbytes
            self.remote_seconds += seconds

    def remote_upload(self, nbytes: int, seconds: float) -> None:
        del seconds  # the upload runs beside the server; its time is in the log, not a counter
        with self._lock:
            self.remote_uploads += 1
            self.remote_upload_bytes += nbytes

    def remote_failure(self, problem: str) -> None:
        with self._lock:
            self.remote_failures[problem] += 1

    def prefetched(self, result: Any, *, files: int) -> None:
        """A read-ahead ended (a :class:`cachemgr.volume.reader.ReadResult`)."""
        with self._lock:
            self.prefetch_bytes += result.bytes
            self.prefetch_seconds += result.seconds
            self.prefetch_files += len(result.files_done)
            self.prefetch_skipped.update(result.skipped)
            if result.stopped:
                self.prefetch_skipped[f"stopped:{result.stopped}"] += (
                    files - len(result.files_done) - sum(result.skipped.values())
                )

    def on_phase(self, old: Any, new: Any) -> None:
        """StateWriter listener: count the time in the phase that ended, and log the change."""
        spent = max(0.0, float(new.since) - float(old.since))
        with self._lock:
            self.phase = new.phase
            self.phase_seconds[old.phase] = self.phase_seconds.get(old.phase, 0.0) + spent
        log_phase(old, new, seconds_in_previous=spent)

    def keep_failures_in(self, state_dir: Path) -> None:
        """Load the failure counts of earlier containers from ``state_dir`` and keep ours there."""
        path = state_dir / FAILURES_FILE
        loaded = _load_counts(path)
        with self._lock:
            self.previous_failures = loaded
            self._failures_file = path

    def all_failures(self) -> Counter[str]:
        """This pod's failures: earlier containers' (kept in the state dir) and this run's."""
        with self._lock:
            return self.previous_failures + self.failures

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            failures = self.previous_failures + self.failures
            return MetricsSnapshot(
                hits=self.hits,
                misses=self.misses,
                compiles=self.compiles,
                compile_seconds=self.compile_seconds,
                saved_seconds=self.saved_seconds,
                lease_wait_seconds=self.lease_wait_seconds,
                damaged=self.damaged,
                untrusted=self.untrusted,
                recompiled_on_hit=self.recompiled_on_hit,
                resaved_on_hit=self.resaved_on_hit,
                server_failed=self.server_failed,
                failures=dict(failures),
                phase=self.phase,
                phase_seconds=dict(self.phase_seconds),
                remote={
                    "hits": self.remote_hits,
                    "misses": self.remote_misses,
                    "bytes": self.remote_bytes,
                    "seconds": round(self.remote_seconds, 3),
                    "uploads": self.remote_uploads,
                    "upload_bytes": self.remote_upload_bytes,
                    "failures": dict(sorted(self.remote_failures.items())),
                },
                prefetch={
                    "bytes": self.prefetch_bytes,
                    "seconds": round(self.prefetch_seconds, 3),
                    "files": self.prefetch_files,
                    "skipped": dict(sorted(self.prefetch_skipped.items())),
                },
            )


def log_phase(old: Any, new: Any, *, seconds_in_previous: float) -> None:
    """One ``phase`` event per change: from, to, the key, and how long the last phase took."""
    fields: dict[str, Any] = {
        "from": old.phase,
        "to": new.phase,
        "seconds_in_previous": round(seconds_in_previous, 3),
        "seconds_since_start": round(float(new.since) - float(new.started_at), 3),
        "key": new.key[:12] if new.key else None,
        "entry": new.entry,
    }
    if new.detail:
        fields["detail"] = dict(new.detail)
    log.info("phase", **fields)


def _load_counts(path: Path) -> Counter[str]:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return Counter()
    if not isinstance(data, dict):
        return Counter()
    return Counter({str(k): int(v) for k, v in data.items() if isinstance(v, int) and v > 0})


def _save_counts(path: Path, counts: Counter[str]) -> None:
    """Best effort: a full or read-only state dir must not turn one failure into another."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(dict(sorted(counts.items()))), encoding="utf-8")
        os.replace(tmp, path)
