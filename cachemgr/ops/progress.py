"""Compile progress: what a compiling pod logs, and the record its waiting peers read.

A compile takes minutes (about 11 for the chart page's model). The holder of a key's lease
logs ``compile_progress`` every ``--progress-interval`` (30 s by default): elapsed time, CPU
seconds, bytes staged, the expected size and where it came from, and an ETA when an earlier
compile of the same model with the same compiler on this volume says how long it took.

Beside its lease the holder keeps ``leases/<digest>.progress.json``, rewritten atomically as
often as its volume heartbeat beats (every 10 s, or the progress interval if shorter). Waiting
pods and ``cachemgr locks`` read it to show the compile as the holder sees it. The volume is
untrusted ground (docs/design.md principle 6), so a reader opens the record without following a
symlink and without blocking on a FIFO, reads at most ``RECORD_MAX`` bytes, and treats
anything it cannot use (missing, garbage, huge, another holder's, not a regular file) as no
record: a waiter never fails because of it.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachemgr.core import jsonread, safefs
from cachemgr.core.fsutil import atomic_write_json, tree_bytes
from cachemgr.core.log import get_logger, person_at_terminal
from cachemgr.core.units import human_bytes
from cachemgr.key.cachekey import CacheKey, digest_of
from cachemgr.ops.meter import DEFAULT_INTERVAL, Every, about, clock
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.records import HEARTBEAT_SECONDS

if TYPE_CHECKING:
    from cachemgr.ops.meter import Meter
    from cachemgr.ops.space import Preflight

log = get_logger("cachemgr.ops.progress")

RECORD_MAX = 64 * 1024  # a record is a few hundred bytes; anything larger is not one
_SUFFIX = ".progress.json"
_MAX_SECONDS = 1e7  # 115 days: a compile time beyond this is a damaged summary


# --- what the estimate rests on --------------------------------------------------------------------


@dataclass(frozen=True)
class Duration:
    """How long this compile should take, and what that rests on."""

    seconds: float | None
    source: str


def learned_duration(entries: Iterable[Any], key: CacheKey) -> Duration:
    """The compile time of the closest earlier entry of the same model and compiler version.

    Closest: same NPU type and pipeline-parallel degree first, then the most recent. Entries
    of another compiler are not used: a compiler release can change the compile time a lot.
    """
    model_id = digest_of(key.inputs["model"])[:16]
    compiler = str(key.inputs["compiler"])
    npu, pp = str(key.inputs["npu"]), key.server.pipeline_parallel_size
    same = [
        e
        for e in entries
        if e.model_id == model_id
        and e.compiler == compiler
        and e.status != "damaged"
        and 0 < (e.compile_seconds or 0) < _MAX_SECONDS  # nan and inf from a damaged summary fail too
    ]
    if not same:
        return Duration(None, f"no earlier compile of this model with compiler {compiler} on this volume")
    best = max(same, key=lambda e: (e.npu == npu, e.pipeline_parallel_size == pp, e.created_at or 0.0))
    seconds = float(best.compile_seconds)
    differs = [f"NPU {best.npu}"] if best.npu != npu else []
    differs += [f"PP {best.pipeline_parallel_size}"] if best.pipeline_parallel_size != pp else []
    note = f" ({', '.join(differs)})" if differs else ""
    return Duration(seconds, f"from entry {best.short} compiled in {clock(seconds)}{note}")


# --- the record ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """The compile as its holder sees it: logged as compile_progress, kept beside the lease."""

    key: str
    token: str | None
    pod: str
    elapsed_s: float
    cpu_seconds: float
    staged_bytes: int
    expected_bytes: int | None
    expected_source: str
    eta_s: float | None
    eta_source: str
    every_s: float
    # How long the compile has shown no progress (CPU, writes, output), and the holder's
    # --stall-timeout: a compile past it is stalled (liveness fails; locks and ls say so).
    no_progress_s: float | None = None
    stall_timeout_s: float | None = None

    @property
    def stalled(self) -> bool:
        return (
            self.no_progress_s is not None
            and self.stall_timeout_s is not None
            and self.no_progress_s >= self.stall_timeout_s
        )

    def describe(self) -> str:
        """``4m12s in, 5m10s CPU, 1.2 GiB staged of ~7.6 GiB, ETA ~6m (from entry ... in 10m52s)``."""
        staged = human_bytes(self.staged_bytes) + " staged"
        if self.expected_bytes:
            staged += f" of ~{human_bytes(self.expected_bytes)}"
        text = f"{clock(self.elapsed_s)} in, {clock(self.cpu_seconds)} CPU, {staged}"
        if self.stalled:
            return (
                f"{text}, STALLED: no CPU, writes or output for {clock(self.no_progress_s)} "
                f"(--stall-timeout {clock(self.stall_timeout_s)}: liveness restarts the pod)"
            )
        if self.eta_s is None:
            return f"{text}, no ETA ({self.eta_source})"
        if self.eta_s <= 0:
            return f"{text}, past the estimate ({self.eta_source})"
        return f"{text}, ETA {about(self.eta_s)} ({self.eta_source})"

    def log_fields(self) -> dict[str, Any]:
        return {
            "elapsed_s": round(self.elapsed_s),
            "cpu_seconds": round(self.cpu_seconds, 1),
            "staged_bytes": self.staged_bytes,
            "expected_bytes": self.expected_bytes,
            "expected_source": self.expected_source,
            "eta_s": None if self.eta_s is None else round(max(0.0, self.eta_s)),
            "eta_source": self.eta_source,
            "no_progress_s": None if self.no_progress_s is None else round(self.no_progress_s),
            "stalled": self.stalled,
        }

    def to_json(self) -> dict[str, Any]:
        return {"format": 1, **asdict(self)}


@dataclass(frozen=True)
class Seen:
    """A holder's record as a reader found it; ``age_s`` by the reader's clock from its mtime."""

    snapshot: Snapshot
    age_s: float

    @property
    def stale(self) -> bool:
        """Not rewritten for three of its own periods: the holder may be frozen or gone."""
        return self.age_s > 3 * max(self.snapshot.every_s, 1.0) + 5

    def describe(self) -> str:
        text = self.snapshot.describe()
        if self.stale:
            text += f" [as of {clock(self.age_s)} ago: not refreshed since]"
        return text

    def to_json(self) -> dict[str, Any]:
        fields = self.snapshot.log_fields()
        return {**fields, "summary": self.describe(), "age_s": round(self.age_s, 1), "stale": self.stale}


def record_path(root: CacheRoot, digest: str) -> Path:
    return root.leases / f"{digest}{_SUFFIX}"


def write_record(root: CacheRoot, snapshot: Snapshot) -> None:
    """Best effort: a full volume or a lost mount must not end a compile over a progress note."""
    with contextlib.suppress(OSError):
        atomic_write_json(record_path(root, snapshot.key), snapshot.to_json(), within=root.path)


def remove_record(root: CacheRoot, digest: str, *, token: str | None) -> None:
    """Remove our own record (never a newer holder's).

    Read and removed from ``leases/`` opened from the root one level at a time: if it was
    swapped for a symlink meanwhile, a file of the same name in the link's target is neither
    read nor removed (the refusal is swallowed: a leaving holder does not fail over a note).
    """
    path = record_path(root, digest)
    with contextlib.suppress(OSError), safefs.open_dir(root.path, path.parent) as leases:
        if _seen(_read_capped(path, dir_fd=leases), digest, token=token) is not None:
            os.unlink(path.name, dir_fd=leases)


def read_record(root: CacheRoot, digest: str, *, token: str | None) -> Seen | None:
    """The holder's record, or None when there is none this reader can trust to be it.

    ``token`` is the current lease token (from the holder record): a record of an earlier
    holder that died before removing it is ignored.
    """
    return _seen(_read_capped(record_path(root, digest)), digest, token=token)


def _seen(raw: tuple[Any, float] | None, digest: str, *, token: str | None) -> Seen | None:
    if raw is None:
        return None
    data, mtime = raw
    snapshot = _parse(data, digest)
    if snapshot is None or (token is not None and snapshot.token != token):
        return None
    return Seen(snapshot, max(0.0, time.time() - mtime))


def _read_capped(path: Path, *, dir_fd: int | None = None) -> tuple[Any, float] | None:
    """``path``'s JSON and its mtime if it is a small regular file, read by the one bounded reader
    (a symlink planted in leases/ is not read through, a FIFO does not hang the waiter); with
    ``dir_fd`` (its folder, already reached safely) opened by name from there."""
    try:
        with jsonread.open_regular(path if dir_fd is None else path.name, dir_fd=dir_fd) as fd:
            mtime = os.fstat(fd).st_mtime
            return jsonread.parse(jsonread.read_fd(fd, limit=RECORD_MAX)), mtime
    except ValueError:
        return None
    except OSError as error:
        if error.errno not in {errno.ENOENT, errno.EACCES}:
            log.debug("progress_record_unreadable", path=str(path), error=error.strerror)
        return None


def _parse(data: Any, digest: str) -> Snapshot | None:
    """A Snapshot from the record's JSON, or None if any field is not what the writer writes."""
    if not isinstance(data, Mapping) or data.get("key") != digest:
        return None
    try:
        return Snapshot(
            key=digest,
            token=_opt(data.get("token"), str),
            pod=str(data.get("pod") or "?")[:253],
            elapsed_s=_num(data["elapsed_s"]),
            cpu_seconds=_num(data["cpu_seconds"]),
            staged_bytes=int(_num(data["staged_bytes"])),
            expected_bytes=_opt_int(data.get("expected_bytes")),
            expected_source=str(data.get("expected_source") or "")[:300],
            eta_s=None if data.get("eta_s") is None else _num(data["eta_s"], negative=True),
            eta_source=str(data.get("eta_source") or "")[:300],
            every_s=_num(data.get("every_s", HEARTBEAT_SECONDS)),
            no_progress_s=None if data.get("no_progress_s") is None else _num(data["no_progress_s"]),
            stall_timeout_s=None if data.get("stall_timeout_s") is None else _num(data["stall_timeout_s"]),
        )
    except (KeyError, TypeError, ValueError, OverflowError):
        return None


def holder_detail(root: CacheRoot, digest: str, *, token: str | None) -> dict[str, Any]:
    """The fields a waiting pod logs about the holder's compile; never fails on a bad record."""
    seen = read_record(root, digest, token=token)
    if seen is None:
        return {"holder_progress": "not reported yet"}
    fields = {f"holder_{k}": v for k, v in seen.snapshot.log_fields().items()}
    return {"holder_progress": seen.describe(), **fields, "progress_age_s": round(seen.age_s)}


def _num(value: Any, *, negative: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError("not a number")
    number = float(value)
    if not math.isfinite(number) or (number < 0 and not negative):
        raise ValueError("not a finite figure")
    return number


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(_num(value))


def _opt(value: Any, kind: type[str]) -> str | None:
    return value if isinstance(value, kind) else None


# --- the holder's side -----------------------------------------------------------------------------


class CompileProgress:
    """Turns the compile monitor's samples into compile_progress events and the progress record."""

    def __init__(
        self,
        root: CacheRoot,
        key: CacheKey,
        *,
        token: str | None,
        pod: str,
        expected_bytes: int | None,
        expected_source: str,
        duration: Duration,
        interval: float = DEFAULT_INTERVAL,
        meter: Meter | None = None,
    ) -> None:
        self._root, self._key, self._token, self._pod = root, key, token, pod
        self._expected = (expected_bytes, expected_source)
        self._duration = duration
        self._started = time.monotonic()
        self._every = min(interval, HEARTBEAT_SECONDS)
        self._log, self._write = Every(interval), Every(self._every)
        self._meter = meter  # a bar on a terminal (warm); None in a pod
        self.peak_staged = 0  # a lower bound for what the compile writes, if it fails
        self._log.due()  # the first event comes one interval in: "compiling" was just logged

    @property
    def expected_seconds(self) -> float | None:
        """How long this compile should take, learned from an earlier one (None: nothing to learn from)."""
        return self._duration.seconds

    @property
    def expected_bytes(self) -> int | None:
        return self._expected[0]

    def snapshot(
        self,
        *,
        cpu_seconds: float,
        staged_bytes: int,
        no_progress_s: float | None = None,
        stall_timeout: float | None = None,
    ) -> Snapshot:
        elapsed = time.monotonic() - self._started
        eta = None if self._duration.seconds is None else self._duration.seconds - elapsed
        return Snapshot(
            key=self._key.digest,
            token=self._token,
            pod=self._pod,
            elapsed_s=elapsed,
            cpu_seconds=cpu_seconds,
            staged_bytes=staged_bytes,
            expected_bytes=self._expected[0],
            expected_source=self._expected[1],
            eta_s=eta,
            eta_source=self._duration.source,
            every_s=self._every,
            no_progress_s=no_progress_s,
            stall_timeout_s=stall_timeout,
        )

    def tick(
        self,
        *,
        cpu_seconds: float,
        staged_bytes: int,
        no_progress_s: float | None = None,
        stall_timeout: float | None = None,
    ) -> None:
        """Called on every monitor sample (twice a second); logs and writes at their own pace."""
        now = time.monotonic()
        self.peak_staged = max(self.peak_staged, staged_bytes)
        snap = self.snapshot(
            cpu_seconds=cpu_seconds,
            staged_bytes=staged_bytes,
            no_progress_s=no_progress_s,
            stall_timeout=stall_timeout,
        )
        if self._meter is not None:
            self._meter.set(staged_bytes)
        if self._log.due(now):
            log.info("compile_progress", key=self._key.short, **snap.log_fields(), progress=snap.describe())
        if self._write.due(now):
            write_record(self._root, snap)

    def close(self, *, staged: Path | None = None) -> None:
        """``staged``: a compile that succeeded; the bar ends at what it wrote, not at the last sample."""
        if self._meter is not None:
            if staged is not None:
                self._meter.set(tree_bytes(staged, within=self._root.path))
            self._meter.close()
        remove_record(self._root, self._key.digest, token=self._token)


def start_compile_progress(
    root: CacheRoot,
    key: CacheKey,
    *,
    token: str | None,
    pod: str,
    preflight: Preflight | None,
    interval: float,
    bar: bool,
) -> CompileProgress:
    """The reporter of one compile, with what the preflight learned; a bar only on a terminal."""
    expectation = preflight.expectation if preflight is not None else None
    meter = None
    if bar and person_at_terminal():
        from cachemgr.ops.meter import open_meter  # tqdm: a terminal only

        meter = open_meter(
            what="compiling", event="warm_progress", total=(expectation and expectation.bytes) or 0
        )
    return CompileProgress(
        root,
        key,
        token=token,
        pod=pod,
        expected_bytes=expectation.bytes if expectation is not None else None,
        expected_source=expectation.source if expectation is not None else "not checked",
        duration=learned_duration(preflight.entries if preflight is not None else (), key),
        interval=interval,
        meter=meter,
    )
