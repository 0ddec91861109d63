"""Structured logging to stderr: JSON in a pod, a readable console on a terminal.

Results go to stdout through :mod:`cachemgr.cli.render`; logs never carry results.

structlog renders every event, but it is imported on first use, not at start-up: importing
it (asyncio comes with it) costs more than half of what a warm start may add before the server
runs (bench/bench_warm.py's import breakdown; docs/benchmarks.md, "Warm start"). ``run`` therefore *holds* the events of its first steps (key,
lookup, view) with their own timestamps and writes them, in order, right after the server
is launched or as soon as anything else happens (a miss, a failure, the exit).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from contextlib import AbstractContextManager
from typing import Any, Literal

from cachemgr.core.errors import ConfigError
from cachemgr.core.printable import safe

LogFormat = Literal["json", "console"]
# The stdlib logging levels, without importing logging (~15 ms) for four numbers.
DEBUG, INFO, WARNING, ERROR = 10, 20, 30, 40
_LEVELS = {"debug": DEBUG, "info": INFO, "warning": WARNING, "error": ERROR}


class _Sink:
    """Where events go: held in memory, or rendered by structlog (configured on first write)."""

    def __init__(self) -> None:
        self.format: LogFormat | None = None
        self.level = INFO
        self.held: list[tuple[str, str, dict[str, Any], float]] | None = None
        self.lock = threading.Lock()
        self.logger: Any = None

    def emit(self, level: str, event: str, fields: dict[str, Any]) -> None:
        if _LEVELS[level] < self.level:
            return
        record = (level, event, fields, time.time())
        with self.lock:
            if self.held is not None:
                self.held.append(record)
                return
            self.write(record)

    def write(self, record: tuple[str, str, dict[str, Any], float]) -> None:
        level, event, fields, at = record
        if self.logger is None:
            self.logger = _structlog_logger(self.format or resolve_format(None), self.level)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1e6):06d}Z"
        with terminal_guard():
            if _OPEN_LINE.is_set():  # a child's line left open on stderr: ours starts a line of its own
                _OPEN_LINE.clear()
                with contextlib.suppress(OSError, ValueError):
                    sys.stderr.write("\n")
            getattr(self.logger, level)(event, timestamp=stamp, **fields)


# Set while the last bytes a child wrote to cachemgr's stderr end no line (cachemgr.runtime.output:
# a server frozen, killed or silent mid-line): the next event would be spliced onto that line, and
# a log collector would read neither as JSON.
_OPEN_LINE = threading.Event()


def stderr_line_open(open_: bool) -> None:
    """What a relay of a child's stderr says after each write: whether it left a line open."""
    if open_:
        _OPEN_LINE.set()
    else:
        _OPEN_LINE.clear()


_GUARD: list[Callable[[], AbstractContextManager[Any]]] = []


def set_write_guard(guard: Callable[[], AbstractContextManager[Any]] | None) -> None:
    """While a progress bar is drawn on the terminal, writes to it go through ``guard()``,
    which clears the bar first and redraws it after (see cachemgr.ops.meter)."""
    _GUARD[:] = [guard] if guard is not None else []


def terminal_guard() -> AbstractContextManager[Any]:
    """Wrap a write to stderr/stdout: log events here, a compiler's output in the launcher."""
    guard = _GUARD[:1]
    return guard[0]() if guard else contextlib.nullcontext()


_SINK = _Sink()


class Logger:
    """The subset of structlog's bound logger cachemgr uses: ``log.info("event", key=value)``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def debug(self, event: str, **fields: Any) -> None:
        _SINK.emit("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        _SINK.emit("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        _SINK.emit("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        _SINK.emit("error", event, fields)


def get_logger(name: str) -> Logger:
    return Logger(name)


def resolve_format(value: str | None) -> LogFormat:
    """``json`` or ``console``; unset means console on a terminal and JSON otherwise (a pod)."""
    if not value:
        return "console" if sys.stderr.isatty() else "json"
    lowered = value.strip().lower()
    if lowered == "json":
        return "json"
    if lowered == "console":
        return "console"
    raise ConfigError(
        f"log format {value!r} is not json or console",
        remedy="set CACHEMGR_LOG_FORMAT (or --log-format) to json or console",
    )


def configure(fmt: LogFormat, *, level: int = INFO) -> None:
    """Choose the format; structlog itself is set up when the first event is written."""
    with _SINK.lock:
        _SINK.format, _SINK.level, _SINK.logger = fmt, level, None


def configured_format() -> LogFormat | None:
    return _SINK.format


def person_at_terminal() -> bool:
    """stderr is a terminal and the log is for a person: where a progress bar may be drawn and a
    question asked. In JSON mode every line on stderr is an event, so neither is (issue 34)."""
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    return tty and _SINK.format != "json"


def hold() -> None:
    """Keep events in memory (with their timestamps) until :func:`release`."""
    with _SINK.lock:
        if _SINK.held is None:
            _SINK.held = []


def release() -> None:
    """Write the held events, in order, and log directly from now on. Idempotent."""
    with _SINK.lock:
        held, _SINK.held = _SINK.held, None
        for record in held or ():
            _SINK.write(record)


# Rendered as they are: a traceback's lines (cachemgr's own text) and the timestamp.
_UNESCAPED = frozenset({"exception", "stack", "timestamp"})


def escape_fields(_logger: Any, _method: str, fields: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Console events only: every string field escaped (core.printable). Fields carry what the
    volume holds (a lease holder's pod name, a use record's, an entry's name), and structlog's
    console renderer writes a string without a newline as it is: an ANSI escape planted in a
    ``.holder.json`` would reach the terminal of whoever runs cachemgr there. JSON needs none of
    this: its renderer writes ASCII only."""
    for name, value in fields.items():
        if isinstance(value, str) and name not in _UNESCAPED and not value.isprintable():
            fields[name] = safe(value)
    return fields


def _structlog_logger(fmt: LogFormat, level: int) -> Any:
    import structlog  # the costly import, paid at the first written event (see the module doc)

    renderer: Any = (
        structlog.processors.JSONRenderer(sort_keys=False)
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.format_exc_info,
            *([] if fmt == "json" else [escape_fields]),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger()
