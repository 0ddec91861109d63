"""Human renderings and parsing of sizes and durations (``200Gi``, ``14d``)."""

from __future__ import annotations

import re
import time

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?B?|[kmgtp]B?|B)?\s*", re.IGNORECASE)
_BINARY = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_DECIMAL = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_size(text: str) -> int:
    """``1234``, ``200Gi``, ``200GiB``, ``1.5G`` (decimal, as Kubernetes), ``512Mi`` -> bytes."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"{text!r} is not a size (try 200Gi, 512Mi or a number of bytes)")
    number, unit = float(match.group(1)), (match.group(2) or "")
    letter = unit[:1].upper()
    if letter in ("", "B"):
        return int(number)
    binary = len(unit) > 1 and unit[1].lower() == "i"
    return int(number * (_BINARY[letter] if binary else _DECIMAL[letter]))


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``14d``, ``1h30m`` -> seconds."""
    text = text.strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        return float(text)
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"{text!r} is not a duration (try 30s, 15m, 14d)")
    return sum(float(n) * _SECONDS[u] for n, u in parts)


def human_bytes(count: int | None) -> str:
    """Binary units, as ``kubectl`` shows PVC sizes: ``1.5 GiB``."""
    if count is None:
        return "?"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"  # pragma: no cover  # the loop returns at TiB


def human_duration(seconds: float | None) -> str:
    """``45s``, ``12m``, ``3h``, ``14d``: the largest unit that fits."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def human_age(timestamp: float | None, *, now: float | None = None) -> str:
    """``5m ago``, or ``never``."""
    if not timestamp:
        return "never"
    return f"{human_duration((time.time() if now is None else now) - timestamp)} ago"
