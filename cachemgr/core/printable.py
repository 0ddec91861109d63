"""What the volume holds, made safe to print: the one escaping function every human output uses.

The volume is written by every pod, Job and person with access to it (docs/design.md principle
6): a model name in ``summary.json``, a pod name in a use record, a compiler's kept output can
carry ANSI escapes (a cleared screen, a moved cursor) or newlines (a fake table row). Every
human output (tables, pairs, notes, error lines, probe lines) shows such text through
:func:`safe`, which escapes each non-printable character the way Python writes it. Machine forms
(JSON, YAML) escape by their own rules. Standard library only: the probes use it too.
"""

from __future__ import annotations

from typing import Any

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def safe(value: Any) -> str:
    """``value`` as text with every non-printable character escaped (``\\x1b``, ``\\n``, ``\\u202e``)."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(char: str) -> str:
    if char in _ESCAPES:
        return _ESCAPES[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
