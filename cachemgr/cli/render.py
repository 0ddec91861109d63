"""The output layer: aligned tables for people, JSON for machines (``-o json``). Stdout only."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Output = Literal["table", "json"]


@dataclass(frozen=True)
class Column:
    header: str
    key: str
    align: Literal["<", ">"] = "<"


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """Rows under upper-case headers, columns padded to their widest cell."""
    cells = [[c.header.upper() for c in columns]] + [[_cell(row.get(c.key)) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = []
    for line in cells:
        parts = [f"{text:{col.align}{width}}" for text, col, width in zip(line, columns, widths, strict=True)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def emit(text: str) -> None:
    sys.stdout.write(text.rstrip("\n") + "\n")


def flatten(prefix: str, value: Any) -> Iterable[tuple[str, Any]]:
    """``{"serving": {"tp": 4}}`` -> ``("serving.tp", 4)``: nested inputs as table rows."""
    if isinstance(value, dict) and value:
        for key in sorted(value):
            yield from flatten(f"{prefix}.{key}" if prefix else str(key), value[key])
    else:
        yield prefix, json.dumps(value) if isinstance(value, dict | list) else value


def emit_long_json(obj: list[Any] | dict[str, Any]) -> None:
    """JSON with each item of a long list on one line: ``ls``/``du`` on 10,000 entries.

    The same document ``emit_json`` writes, laid out so that json's C encoder does the work
    (it runs only without ``indent``: ten times faster), and each entry stays one grep-able line.
    """
    if isinstance(obj, list):
        emit(
            "[\n" + ",\n".join("  " + json.dumps(item, default=str) for item in obj) + "\n]" if obj else "[]"
        )
        return
    lines = []
    for name, value in obj.items():
        if isinstance(value, list) and value:
            inner = ",\n".join("    " + json.dumps(item, default=str) for item in value)
            text = f"[\n{inner}\n  ]"
        else:
            text = json.dumps(value, default=str)
        lines.append(f"  {json.dumps(name)}: {text}")
    emit("{\n" + ",\n".join(lines) + "\n}")


def entry_row(
    *, key: str, model: str, role: str, compiler: str, npu: str, size: str, **more: Any
) -> dict[str, Any]:
    """The leading cells of every table of entries (``ls``, ``ls --remote``): a 12-digit key, and
    ``?`` for what is not known; the table's own cells follow."""
    known = {"model": model, "role": role, "compiler": compiler, "npu": npu}
    return {"key": key[:12], **{name: value or "?" for name, value in known.items()}, "size": size, **more}


def tell(kind: str, lines: Iterable[str]) -> None:
    """Notes and warnings: to stderr, so that ``-o json`` output always parses."""
    for line in lines:
        print(f"{kind}: {line}", file=sys.stderr)


def kv(pairs: Sequence[tuple[str, Any]]) -> str:
    width = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k:<{width}}  {'-' if v is None else v}" for k, v in pairs)


def plural(count: int, noun: str) -> str:
    """``1 entry``, ``2 entries``."""
    if count == 1:
        return f"1 {noun}"
    return f"{count} {noun[:-1]}ies" if noun.endswith("y") else f"{count} {noun}s"


def section(title: str, body: str) -> str:
    return f"\n\n{title}\n{body}"
