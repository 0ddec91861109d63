"""Structured logging to stderr: JSON in a pod, a readable console on a terminal.

Results go to stdout through :mod:`cachemgr.cli.render`; logs never carry results.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

from cachemgr.errors import ConfigError

LogFormat = Literal["json", "console"]


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


_configured: list[LogFormat] = []


def configured_format() -> LogFormat | None:
    """The format set by :func:`configure`, or None when logging was never configured."""
    return _configured[-1] if _configured else None


def configure(fmt: LogFormat, *, level: int = logging.INFO) -> None:
    _configured.append(fmt)
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer(sort_keys=False)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
