"""Reading untrusted JSON records: a record on the shared volume may be damaged, foreign or of
another release, so a field of the wrong type reads as empty, never as an exception. The bytes
are read and parsed by :mod:`cachemgr.core.jsonread`, within its bounds."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from cachemgr.core import jsonread


def read_dict(path: Path, *, dir_fd: int | None = None, limit: int = jsonread.JSON_LIMIT) -> dict[str, Any]:
    """The JSON object in the file, or ``{}`` when it is missing, unreadable or not an object."""
    try:
        data = jsonread.read(path if dir_fd is None else path.name, dir_fd=dir_fd, limit=limit)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def number(value: Any) -> float | None:
    """A finite number, else None (a boolean is no number; text is parsed as ``float`` parses it)."""
    if isinstance(value, bool):
        return None
    try:
        found = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return found if math.isfinite(found) else None


def text(value: Any) -> str:
    return value if isinstance(value, str) else ""
