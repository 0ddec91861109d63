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
