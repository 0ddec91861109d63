"""The machine forms of a result: ``-o json``, ``-o yaml``, ``-o jsonpath=...``,
``-o custom-columns=...`` and ``-o name``; stdout only.

Every command's document has one envelope, as kubectl's: ``{"apiVersion": "cachemgr/v1",
"kind": KIND, ...}``, a list's items under ``items`` (``EntryList``, ``LeaseList``...), an
object's fields beside ``kind`` (``DiskUsage``, ``Explanation``...). Times are RFC 3339 in UTC
as kubectl prints them, to the microsecond as its ``MicroTime`` (``2026-12-01T18:08:52.299151Z``,
the form of the log's timestamps: two starts in one second keep their order, and the strings sort
as the times do): every field named ``*_at``, ``since`` or ``time`` that holds a number of seconds
since the epoch, at any depth. The epoch seconds are not kept beside them: every consumer this
project has reads the time or orders by it, which the string does.
Durations and ages stay numbers of seconds (``*_seconds``, ``*_s``, ``age``). ``--sort-by`` orders a
list's items (and its table's rows) by a JSONPath (cachemgr.cli.jsonpath).

What the volume holds reaches a terminal escaped: JSON and YAML escape by their encoding (ASCII
only); a template's and a custom column's values go through :func:`safe`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

from cachemgr.core.printable import safe

API_VERSION = "cachemgr/v1"
DATA_FORMS = frozenset({"json", "yaml", "jsonpath", "custom-columns"})
_TIME_KEYS = frozenset({"since", "time"})
_LAST_SECOND = 253402300799.0  # 9999-12-31T23:59:59Z: past it no RFC 3339 time exists


def envelope(kind: str, data: Any) -> dict[str, Any]:
    """``{"apiVersion", "kind", ...}``: a list's items under ``items``, an object's fields after."""
    head: dict[str, Any] = {"apiVersion": API_VERSION, "kind": kind}
    if isinstance(data, list):
        return {**head, "items": data}
    return {**head, **{k: v for k, v in dict(data).items() if k not in head}}


def rfc3339(seconds: float) -> str | None:
    """``2026-12-01T18:08:52.299151Z``; None for what is no time (not finite, before 1970, past
    9999). Always six digits of the second: the strings sort as the times do."""
    if not math.isfinite(seconds) or not 0 <= seconds <= _LAST_SECOND:
        return None
    whole = math.floor(seconds)
    micros = min(999_999, round((seconds - whole) * 1e6))
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{micros:06d}Z"


def with_times(value: Any) -> Any:
    """``value`` with every epoch-seconds field (``*_at``, ``since``, ``time``) as RFC 3339.

    Written for ``ls -o json`` of 10,000 entries (bench/bench_inspect.py): a call per container,
    not per value, and the name checked only for a number (a generic walk cost a quarter second)."""
    if isinstance(value, list | tuple):
        return [with_times(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for name, item in value.items():
        kind = type(item)
        if kind is dict or kind is list or kind is tuple:
            out[name] = with_times(item)
        elif (kind is float or kind is int) and (name in _TIME_KEYS or str(name).endswith("_at")):
            out[name] = rfc3339(float(item))
        else:
            out[name] = item
    return out


def document(kind: str, data: Any, *, sort_by: str | None = None) -> dict[str, Any]:
    """The command's result as scripts get it: enveloped, times in RFC 3339, items sorted."""
    doc: dict[str, Any] = with_times(envelope(kind, data))
    if sort_by and isinstance(doc.get("items"), list):
        from cachemgr.cli.jsonpath import parse_path, sort_key

        doc["items"] = sorted(doc["items"], key=sort_key(parse_path(sort_by)))
    return doc


def emit_document(
    doc: Mapping[str, Any], output: str, template: str | None, *, long: bool = False, headers: bool = True
) -> None:
    """``doc`` in one of the data forms (DATA_FORMS)."""
    if output == "yaml":
        emit_yaml(doc)
    elif output == "jsonpath":
        from cachemgr.cli.jsonpath import render

        sys.stdout.write(render(template or "", doc, escape=safe))
    elif output == "custom-columns":
        emit_custom_columns(doc, template or "", headers=headers)
    elif long:
        emit_long_json(doc)
    else:
        emit_json(doc)


def emit_custom_columns(doc: Mapping[str, Any], spec: str, *, headers: bool) -> None:
    """One row per item of a list (else one for the object), as kubectl: ``<none>`` where a column
    finds nothing, several values joined by commas, three spaces between columns."""
    from cachemgr.cli.jsonpath import Budget, parse_columns, show

    columns = parse_columns(spec)
    items = doc.get("items")
    rows = items if isinstance(items, list) else [doc]
    budget = Budget(spec)
    cells = [
        [
            budget.take(",".join(show(v, safe) for v in path.find(row, doc, budget=budget) if v is not None))
            or "<none>"
            for _, path in columns
        ]
        for row in rows
    ]
    lines = ([[safe(h) for h, _ in columns]] if headers else []) + cells
    if not lines:
        return
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    # Padded, every row is as wide as the widest: the cells were counted, the padding is counted now.
    budget.spend(max(0, len(lines) * (sum(widths) + 3 * len(widths)) - budget.chars))
    out = [
        "   ".join(f"{text:<{w}}" for text, w in zip(line, widths, strict=True)).rstrip() for line in lines
    ]
    sys.stdout.write("\n".join(out) + "\n")


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def emit_yaml(obj: Any) -> None:
    import yaml  # only for -o yaml

    # Through JSON first: the same document as -o json (numbers, nulls, strings), nothing Python-only.
    data = json.loads(json.dumps(obj, default=str))
    sys.stdout.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=False, width=1 << 16))


def emit_names(names: Iterable[str]) -> None:
    """``-o name``: one ``KIND/NAME`` per line, escaped (names come from the volume)."""
    lines = [safe(name) for name in names]
    if lines:
        sys.stdout.write("\n".join(lines) + "\n")


def emit_long_json(obj: Mapping[str, Any]) -> None:
    """JSON with each item of a long list on one line: ``ls``/``du`` on 10,000 entries.

    The same document ``emit_json`` writes, laid out so that json's C encoder does the work
    (it runs only without ``indent``: ten times faster), and each entry stays one grep-able line.
    """
    lines = []
    for name, value in obj.items():
        if isinstance(value, list) and value:
            inner = ",\n".join("    " + json.dumps(item, default=str) for item in value)
            text = f"[\n{inner}\n  ]"
        else:
            text = json.dumps(value, default=str)
        lines.append(f"  {json.dumps(name)}: {text}")
    sys.stdout.write("{\n" + ",\n".join(lines) + "\n}\n")
