"""Progress of long commands: a bar on a terminal, progress events in a log.

``verify`` of a 100 GiB entry, ``prune --yes`` of large entries and ``warm`` take minutes. On a
terminal (stderr is a TTY) they draw a tqdm bar on stderr: bytes, rate and ETA. tqdm rather
than rich: one pure-Python package without dependencies of its own, and it is imported only
here, only when a bar is drawn; the hit path and ``cachemgr probe`` never import it. Off a
terminal (a pod, a Job, a pipe) the same progress goes to the log as ``EVENT`` lines, at most
one per progress interval, and stdout (``-o json``) carries nothing but the result.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any, Protocol

from cachemgr.core.errors import ConfigError, UsageError
from cachemgr.core.log import get_logger, person_at_terminal, set_write_guard
from cachemgr.core.units import parse_duration

log = get_logger("cachemgr.ops.meter")

# How often a compiling pod logs compile_progress and a waiting pod logs waiting_for_compile:
# about 22 lines per pod for an 11-minute compile (it was every 5 s: 130 lines).
DEFAULT_INTERVAL = 30.0
INTERVAL_ENV = "CACHEMGR_PROGRESS_INTERVAL"


class Every:
    """A rate limit on the monotonic clock: :meth:`due` is true at most once per ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._last: float | None = None

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if self._last is not None and now - self._last < self.seconds:
            return False
        self._last = now
        return True


def clock(seconds: float | None) -> str:
    """``10m52s``, ``1h04m``, ``45s``: precise enough to say what an estimate rests on."""
    if seconds is None:
        return "?"
    total = round(max(0.0, seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def about(seconds: float) -> str:
    """``~11m``, ``~40s``: an ETA is an estimate, shown as one."""
    if seconds >= 90:
        return f"~{round(seconds / 60)}m"
    return f"~{max(1, round(seconds))}s"


class Meter(Protocol):
    """Bytes done out of a total: what verify, prune and warm report their progress to."""

    def total(self, count: int) -> None: ...
    def advance(self, count: int) -> None: ...
    def set(self, done: int) -> None: ...
    def close(self) -> None: ...


def interval_from(value: float | None, environ: Mapping[str, str] | None = None) -> float:
    """``--progress-interval`` (parsed by the parser), else ``CACHEMGR_PROGRESS_INTERVAL``; default 30 s.

    A bad value in the environment is configuration (exit 78); a flag's sign is a usage error.
    """
    env = os.environ if environ is None else environ
    seconds = value
    if seconds is None:
        text = env.get(INTERVAL_ENV) or ""
        if not text:
            return DEFAULT_INTERVAL
        try:
            seconds = parse_duration(text)
        except ValueError as error:
            raise ConfigError(
                f"{INTERVAL_ENV}: {error}", remedy=f"set {INTERVAL_ENV} to seconds or a duration such as 30s"
            ) from None
        if seconds <= 0:
            raise ConfigError(
                f"{INTERVAL_ENV} must be positive, not {text!r}", remedy=f"set {INTERVAL_ENV}=30s"
            )
    if seconds <= 0:
        raise UsageError(f"--progress-interval must be positive, not {seconds:g}", remedy="pass e.g. 30s")
    return seconds


def open_meter(*, what: str, event: str, interval: float = DEFAULT_INTERVAL, total: int = 0) -> Meter:
    """A bar when stderr is a person's terminal, else a meter that logs ``event`` every ``interval``."""
    if person_at_terminal():
        return _Bar(what, total)
    return _LogMeter(event, interval, total)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class _LogMeter:
    """Progress as log events: done, total, rate and ETA, at most once per interval."""

    def __init__(self, event: str, interval: float, total: int) -> None:
        self._event, self._total, self._done = event, total, 0
        self._started = time.monotonic()
        self._every = Every(interval)
        self._every.due()  # the first line one interval in: short runs log none

    def total(self, count: int) -> None:
        self._total = count

    def advance(self, count: int) -> None:
        self.set(self._done + count)

    def set(self, done: int) -> None:
        self._done = done
        if self._every.due():
            self._log()

    def _log(self) -> None:
        elapsed = max(time.monotonic() - self._started, 1e-6)
        rate = self._done / elapsed
        left = max(0, self._total - self._done)
        eta = left / rate if rate > 0 and self._total else None
        log.info(
            self._event,
            done_bytes=self._done,
            total_bytes=self._total or None,
            rate_bytes_per_s=round(rate),
            eta_s=None if eta is None else round(eta),
            eta=None if eta is None else about(eta),
        )

    def close(self) -> None:
        """Nothing to clear: the log's last word is the command's own result."""


def _size() -> tuple[int, int]:
    """The terminal's columns and lines; 80x24 where it reports none (a pty of 0x0: ``script``).

    tqdm hides a bar below the last row, and takes a 0-line terminal to have -1 rows.
    """
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
        columns, lines = size.columns, size.lines
    except (OSError, ValueError):
        columns, lines = 0, 0
    return columns or 80, lines or 24


class _Bar:
    """A tqdm bar on stderr; log lines written meanwhile appear above it, not through it.

    Drawn at the first figure, so a total learned a moment later (verify sums its entries
    first) does not show as a bar without one.
    """

    def __init__(self, what: str, total: int) -> None:
        self._what, self._total = what, total
        self._bar: Any = None

    def _draw(self) -> Any:
        if self._bar is None:
            from tqdm import tqdm  # only on a terminal: see the module doc

            columns, lines = _size()
            self._bar = tqdm(
                total=self._total or None,
                desc=self._what,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=sys.stderr,
                ncols=columns,
                nrows=lines,
                mininterval=0.2,
                leave=True,
            )
            set_write_guard(lambda: tqdm.external_write_mode(file=sys.stderr))
        return self._bar

    def total(self, count: int) -> None:
        self._total = count
        if self._bar is not None:
            self._bar.total = count or None
            self._bar.refresh()

    def advance(self, count: int) -> None:
        self.set(int(self._draw().n) + count)

    def set(self, done: int) -> None:
        bar = self._draw()
        if bar.total is not None and done > bar.total:
            # The total was an estimate (summaries leave out key.json; a compile outgrows the
            # expected size): never show more than 100 %.
            bar.total = done
        bar.update(done - bar.n)

    def close(self) -> None:
        if self._bar is not None:
            set_write_guard(None)
            self._bar.close()
