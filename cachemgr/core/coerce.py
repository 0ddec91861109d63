"""Reading untrusted JSON records: a record on the shared volume may be damaged, foreign or of
another release, so a field of the wrong type reads as empty, never as an exception."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cachemgr.core.fsutil import read_json


def read_dict(path: Path) -> dict[str, Any]:
    """The JSON object in the file, or ``{}`` when it is missing, unreadable or not an object."""
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def text(value: Any) -> str:
    return value if isinstance(value, str) else ""
