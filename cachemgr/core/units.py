"""Human renderings and parsing of sizes and durations (``200Gi``, ``14d``), and counts of things
(``1 entry``, ``2 entries``)."""

from __future__ import annotations

import re
import time

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?B?|[kmgtp]B?|B)?\s*", re.IGNORECASE)
_BINARY = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_DECIMAL = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
MAX_BYTES = float(1 << 63)  # sizes are compared with statvfs figures: 8 EiB is beyond any volume
MAX_SECONDS = 10 * 365 * 86400.0  # a longer duration means "never"; threading waits overflow past ~292 years
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_size(text: str) -> int:
    """``1234``, ``200Gi``, ``200GiB``, ``1.5G`` (decimal, as Kubernetes), ``512Mi`` -> bytes."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"{_quoted(text)} is not a size (try 200Gi, 512Mi or a number of bytes)")
    number, unit = float(match.group(1)), (match.group(2) or "")
    letter = unit[:1].upper()
    scale = (
        1
        if letter in ("", "B")
        else (_BINARY if len(unit) > 1 and unit[1].lower() == "i" else _DECIMAL)[letter]
    )
    size = number * scale
    if not size < MAX_BYTES:  # also inf: float() of 400 digits overflows
        raise ValueError(f"{_quoted(text)} is too large (at most 8 EiB)")
    return int(size)


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``14d``, ``1h30m`` -> seconds."""
    text = text.strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        seconds = float(text)
    else:
        parts = _DURATION.findall(text)
        if not parts or "".join(n + u for n, u in parts) != text:
            raise ValueError(f"{_quoted(text)} is not a duration (try 30s, 15m, 14d)")
        seconds = sum(float(n) * _SECONDS[u] for n, u in parts)
    if not seconds <= MAX_SECONDS:  # also inf: float() of 400 digits overflows
        raise ValueError(f"{_quoted(text)} is too long (at most 10 years)")
    return seconds


def _quoted(text: str) -> str:
    """A value for an error message: repr, long ones cut (a 100 KB flag makes no 100 KB line)."""
    return repr(text) if len(text) <= 40 else repr(text[:37] + "...")


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


def plural(count: int, noun: str) -> str:
    """``1 entry``, ``2 entries``, ``2 keys``, ``0 matches``: a count and its noun, agreed."""
    if count == 1:
        return f"1 {noun}"
    if noun.endswith("y") and noun[-2:-1] not in ("a", "e", "i", "o", "u"):
        return f"{count} {noun[:-1]}ies"
    return f"{count} {noun}es" if noun.endswith(("s", "sh", "ch", "x")) else f"{count} {noun}s"
