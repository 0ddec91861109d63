"""The output layer: tables and prose for people, JSON, YAML and names for machines. Stdout only.

Every command builds its result as blocks (:class:`Table`, :class:`Pairs`, :class:`Text`) and
:func:`show` lays them out for the ``-o`` form the operator asked for, as kubectl does:

* ``table`` (the default): the essential columns, fitted to the terminal (80 columns where it
  says nothing: a pipe, a pod's log): shrinkable columns are shortened to what identifies
  them (a model to its name without the organisation, a pod name to its tail), with ``…``;
* ``wide``: every column, nothing shortened;
* ``--no-headers``: the rows alone, without headers, titles or prose;
* ``json`` / ``yaml``, ``jsonpath=TEMPLATE``, ``custom-columns=SPEC``: the command's result
  document, in kubectl's envelope (cachemgr.cli.documents); ``name``: ``KIND/NAME`` lines;
* ``--sort-by JSONPATH``: a list's rows (and items) in that order.

Prose and ``name  value`` lines are wrapped to the width too, and so are the notes and warnings
:func:`tell` writes on stderr (a word longer than the room, a path, is never cut; a quoted line
of a program's output, ``| ...``, is shown as it was); ``-o wide`` wraps nothing, and nothing for
machines (the data forms, a JSON stderr) is ever wrapped. With ``--no-headers`` the rows of a command that prints several kinds
of table (``ls``: entries, attempts, failures, quarantine; ``du``) start with their kind, so that
a script tells them apart.

What the volume holds is written by every pod, Job and person with access to it (docs/design.md
principle 6), so no byte of it reaches a terminal as it is: :func:`safe` escapes every
non-printable character (an ANSI escape, a newline that would fake a table row) in each cell,
pair and name, and :func:`emit` escapes what is left but the layout's own newlines. Prose that
quotes the volume escapes what it quotes with :func:`safe` too.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from cachemgr.cli.documents import document, emit_document, emit_names, with_times
from cachemgr.core.printable import safe

Output = Literal["table", "wide", "json", "yaml", "name", "jsonpath", "custom-columns"]
Shrink = Literal["head", "tail", "model", "cause"]
ELLIPSIS = "…"
DEFAULT_WIDTH = 80


def _guard(text: str) -> str:
    """The last line of defence: nothing non-printable leaves but the layout's newlines."""
    return "\n".join(safe(line) for line in text.split("\n"))


# --- blocks ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """One column: its header, the row key it shows, and how it behaves in a narrow table.

    ``wide``: shown only with ``-o wide``. ``shrink``: how its cells are shortened when the table
    is wider than the terminal (``head`` keeps the start, ``tail`` the end, ``model`` drops the
    organisation first, ``cause`` shortens the path before ``PATH: cause`` and keeps the cause);
    ``least`` is the narrowest it gets.
    """

    header: str
    key: str
    align: Literal["<", ">"] = "<"
    wide: bool = False
    shrink: Shrink | None = None
    least: int = 8
    give: int = 0  # among shrinkable columns, those that give more shrink first (then the widest)


@dataclass(frozen=True)
class Table:
    rows: Sequence[Mapping[str, Any]]
    columns: Sequence[Column]
    title: str | None = None  # a section heading above the table (dropped with --no-headers)
    empty: str | None = None  # prose shown instead of a table without rows
    # What its rows are, where a command prints several kinds of table (ls, du): with
    # --no-headers each row starts with it, so that the rows of one table are told from another's.
    kind: str | None = None
    # The -o json item of each row, in the rows' order (built only for --sort-by).
    items: Callable[[], Sequence[Mapping[str, Any]]] | None = None


@dataclass(frozen=True)
class Pairs:
    """``name  value`` lines (``show``, ``du``): values escaped; no headers to drop."""

    pairs: Sequence[tuple[str, Any]]
    title: str | None = None


@dataclass(frozen=True)
class Text:
    """Prose: summaries, notes, what to do. Quoted volume text must go through :func:`safe`."""

    text: str


Block = Table | Pairs | Text


@dataclass(frozen=True)
class Style:
    output: Output = "table"
    headers: bool = True
    width: int = DEFAULT_WIDTH
    template: str | None = None  # jsonpath=TEMPLATE, custom-columns=SPEC
    sort_by: str | None = None

    @classmethod
    def of(cls, args: Any) -> Style:
        form, _, template = str(getattr(args, "output", "table") or "table").partition("=")
        return cls(
            output=cast(Output, form),
            headers=not getattr(args, "no_headers", False),
            width=terminal_width(),
            template=template or None,
            sort_by=getattr(args, "sort_by", None) or None,
        )

    @property
    def data(self) -> bool:
        """The result document is printed (json, yaml, jsonpath, custom-columns), not blocks."""
        return self.output in ("json", "yaml", "jsonpath", "custom-columns")


def terminal_width() -> int:
    """COLUMNS, else the terminal's width, else 80 (a pipe, a pod's log)."""
    import shutil  # not for cachemgr probe, which imports this module for safe()

    return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns or DEFAULT_WIDTH


# --- laying blocks out -----------------------------------------------------------------------------


def layout(blocks: Iterable[Block], style: Style) -> str:
    """The blocks as text for ``table`` or ``wide`` output."""
    parts: list[str] = []
    for block in blocks:
        text = _layout_block(block, style)
        if text:
            parts.append(text)
    return ("\n\n" if style.headers else "\n").join(parts)  # --no-headers: rows, no blank lines


def _layout_block(block: Block, style: Style) -> str:
    wrap = style.output != "wide"
    if isinstance(block, Text):
        if not style.headers:
            return ""
        return fit_text(block.text, style.width) if wrap else block.text
    if isinstance(block, Pairs):
        if not style.headers:
            return ""  # --no-headers: table rows only
        body = pairs_text(block.pairs, width=style.width if wrap else None)
        return body if not block.title else f"{block.title}\n{body}"
    if not block.rows:
        return fit_text(block.empty or "", style.width) if style.headers else ""
    rows, columns = _sorted_rows(block, style), list(block.columns)
    if block.kind is not None and not style.headers:
        rows = [{**row, "\0kind": block.kind} for row in rows]
        columns.insert(0, Column("kind", "\0kind"))
    body = table(rows, columns, wide=style.output == "wide", headers=style.headers, width=style.width)
    return body if not block.title or not style.headers else f"{block.title}\n{body}"


def _sorted_rows(block: Table, style: Style) -> Sequence[Mapping[str, Any]]:
    """``--sort-by``: the rows in the order of their items' values (cachemgr.cli.jsonpath)."""
    if not style.sort_by or block.items is None:
        return block.rows
    from cachemgr.cli.jsonpath import parse_path, sort_key

    key = sort_key(parse_path(style.sort_by))
    items = [with_times(item) for item in block.items()]
    order = sorted(range(len(block.rows)), key=lambda i: key(items[i]))
    return [block.rows[i] for i in order]


def fit_text(text: str, width: int, *, hang: int = 2) -> str:
    """Prose wrapped to ``width``: each line on its own, continued under itself indented by two
    (under the text of a ``- `` item); a word longer than the room is never cut (a ``note:`` or
    ``warning:`` keeps it beside it, as a bullet does), and a quoted line of a program's output
    (``| ...``) is left as it was written."""
    import textwrap  # only where a line is too long

    out = []
    for line in text.split("\n"):
        if len(line) <= width or line.lstrip().startswith("| "):
            out.append(line)
            continue
        indent = line[: len(line) - len(line.lstrip())]
        bullet = re.match(r"- |\d+\. |(note|warning): ", line[len(indent) :])
        mark = bullet[0] if bullet else ""  # a bullet or a label keeps its first word beside it
        under = len(mark) if bullet and not bullet[1] else hang  # a label's text continues two in
        out.append(
            textwrap.fill(
                line.strip()[len(mark) :],
                width,
                initial_indent=indent + mark,
                subsequent_indent=indent + " " * under,
                break_long_words=False,
                break_on_hyphens=False,
            )
        )
    return "\n".join(out)


def fit_command(line: str, width: int) -> str:
    """A shell command line wrapped to ``width`` so that it still copies and runs whole: broken
    only at spaces outside quotes, each line but the last ending in `` \\`` (the shell joins
    them), continued four columns further in; a word longer than the room stays whole."""
    if len(line) <= width:
        return line
    lead = line[: len(line) - len(line.lstrip())]
    words = _shell_words(line.strip())
    lines, current = [], lead
    for i, word in enumerate(words):
        room = width if i == len(words) - 1 else width - 2  # room for the " \\" of a continued line
        if current.strip() and len(current) + 1 + len(word) > room:
            lines.append(current + " \\")
            current = lead + "    " + word
        else:
            current = f"{current} {word}" if current.strip() else current + word
    return "\n".join([*lines, current])


def _shell_words(text: str) -> list[str]:
    """``text`` split at the spaces a shell splits at (not inside quotes, not escaped), each word
    kept as written (its quotes too)."""
    words, word, quote, escaped = [], "", "", False
    for char in text:
        if escaped:
            word, escaped = word + char, False
        elif char == "\\" and quote != "'":
            word, escaped = word + char, True
        elif quote:
            word, quote = word + char, "" if char == quote else quote
        elif char in "'\"":
            word, quote = word + char, char
        elif char == " ":
            if word:
                words.append(word)
            word = ""
        else:
            word += char
    return [*words, word] if word else words


def show(blocks: Iterable[Block], style: Style) -> None:
    emit(layout(blocks, style))


def emit(text: str) -> None:
    sys.stdout.write(_guard(text.rstrip("\n")) + "\n")


def table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[Column],
    *,
    wide: bool = False,
    headers: bool = True,
    width: int | None = None,
) -> str:
    """Rows under upper-case headers, columns padded to their widest cell, fitted to ``width``."""
    shown = [c for c in columns if wide or not c.wide]
    cells = [[safe(_cell(row.get(c.key))) for c in shown] for row in rows]
    # Without headers a column is as wide as its cells: a header no one sees takes no room.
    heads = [c.header.upper() if headers else "" for c in shown]
    widths = [max([len(heads[i])] + [len(line[i]) for line in cells]) for i in range(len(shown))]
    if not wide:
        fitted = _fit(shown, heads, widths, width or terminal_width())
        cells = [
            [_shorten(text, w, c.shrink) for text, w, c in zip(line, fitted, shown, strict=True)]
            for line in cells
        ]
        widths = [max([len(heads[i])] + [len(line[i]) for line in cells]) for i in range(len(shown))]
    lines = ([heads] if headers else []) + cells
    out = []
    for line in lines:
        parts = [f"{text:{col.align}{w}}" for text, col, w in zip(line, shown, widths, strict=True)]
        out.append("  ".join(parts).rstrip())
    return "\n".join(out)


def _fit(columns: Sequence[Column], heads: list[str], widths: list[int], width: int) -> list[int]:
    """Narrow the shrinkable columns, widest first, until the table fits (or none can give more)."""
    excess = sum(widths) + 2 * (len(widths) - 1) - width
    order = sorted(
        (i for i, c in enumerate(columns) if c.shrink is not None),
        key=lambda i: (-columns[i].give, -widths[i]),
    )
    fitted = list(widths)
    for i in order:
        if excess <= 0:
            break
        floor = max(columns[i].least, len(heads[i]))
        cut = min(excess, max(0, fitted[i] - floor))
        fitted[i] -= cut
        excess -= cut
    return fitted


def _shorten(text: str, width: int, how: Shrink | None) -> str:
    if len(text) <= width or how is None:
        return text
    if how == "cause":
        # "artifacts/.../graph_000.rbln: content differs ...": the cause says what is wrong, the
        # path where; the path gives way first, from its start (its end names the file).
        where, colon, cause = text.partition(": ")
        room = width - len(colon) - len(cause) - 1
        if colon and "/" in where and room >= 8:
            return ELLIPSIS + where[len(where) - room :] + colon + cause
        if colon and "/" in where:
            text = ELLIPSIS + colon + cause
            return text if len(text) <= width else text[: width - 1] + ELLIPSIS
    if how == "model" and "/" in text:
        text = text.rsplit("/", 1)[-1]  # the organisation goes first: the name identifies the model
        if len(text) <= width:
            return text
    if how == "tail":
        # The end identifies a pod (its ReplicaSet hash and suffix): kept from a word boundary.
        kept = text[len(text) - width + 1 :]
        cut = kept.find("-")
        if 0 <= cut < len(kept) // 2:
            kept = kept[cut + 1 :]
        return ELLIPSIS + kept
    return text[: width - 1] + ELLIPSIS


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def pairs_text(pairs: Sequence[tuple[str, Any]], *, width: int | None = None) -> str:
    """``name  value`` lines; with ``width``, a long value continues under itself."""
    names = max(len(k) for k, _ in pairs)
    lines = []
    for name, value in pairs:
        text = "-" if value is None else safe(value)
        line = f"{name:<{names}}  {text}"
        if width is not None and len(line) > width:
            line = fit_text(" " * (names + 2) + text, width, hang=0)
            line = f"{name:<{names}}  " + line[names + 2 :]
        lines.append(line)
    return "\n".join(lines)


# Kept for the callers that lay out one block by hand.
kv = pairs_text


# --- the result, in the form asked for ----------------------------------------------------------


def result(
    args: Any,
    *,
    kind: str,
    data: Callable[[], Any],
    blocks: Callable[[], Iterable[Block]],
    names: Callable[[], Iterable[str]] | None = None,
    long: bool = False,
) -> None:
    """Print a command's result in the form ``-o`` asks for (each form is built only when asked):
    its document of kind ``kind`` (cachemgr.cli.documents), ``KIND/NAME`` lines, or its blocks."""
    style = Style.of(args)
    if style.data:
        emit_data(data(), style, kind=kind, long=long)
    elif style.output == "name":
        emit_names(names() if names is not None else ())
    else:
        show(blocks(), style)


def emit_data(obj: Any, style: Style, *, kind: str, long: bool = False) -> None:
    """``obj`` as the document of kind ``kind``, in the data form ``style`` asks for."""
    doc = document(kind, obj, sort_by=style.sort_by)
    emit_document(doc, style.output, style.template, long=long, headers=style.headers)


# --- small helpers ---------------------------------------------------------------------------------

INPUT_COLUMNS = (
    # A nested input's name (serving.speculative_config.num_speculative_tokens) gives way last,
    # from its start: its end names the input.
    Column("input", "input", shrink="tail", least=20, give=-1),
    Column("value", "value", shrink="head", least=16),
    Column("source", "source", shrink="head", least=12, give=1),
)


def input_rows(inputs: Mapping[str, Any], sources: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A key's inputs as rows, each with where it came from: every row its own (a row stands on its
    own under grep and --sort-by, as kubectl's do), and for an input read from one of several
    variables (``versions``), that one's variable only. A note on a source (``argv (revision
    unpinned: ...)``) is left for :func:`input_notes`; no source at all is ``-``."""
    rows: list[dict[str, Any]] = []
    for top, value_ in inputs.items():
        for name, value in flatten(top, value_):
            source = _source_of(name, _plain(str(sources.get(top, ""))), value)
            rows.append({"input": name, "value": value, "source": source or None})
    return rows


def input_notes(sources: Mapping[str, Any]) -> list[str]:
    """``model: revision unpinned: the hub may change it``: the notes sources carry, once each."""
    notes = []
    for top, source in sources.items():
        text = str(source)
        if text.endswith(")") and " (" in text:
            notes.append(f"{top}: {text[text.index(' (') + 2 : -1]}")
    return notes


def _plain(source: str) -> str:
    return source[: source.index(" (")] if source.endswith(")") and " (" in source else source


def _source_of(name: str, source: str, value: Any) -> str:
    parts = source.split("; ")
    if len(parts) < 2 or "." not in name:
        return source
    leaf = name.rsplit(".", 1)[-1].upper().replace("-", "_")
    found = [p for p in parts if _variable(p) == leaf]
    if len(found) != 1:
        return source
    return found[0].removesuffix(f" {value}")  # the value is in its own column


def _variable(part: str) -> str:
    """``CACHEMGR_VLLM_RBLN_VERSION 0.12.0`` or ``installed vllm-rbln 0.12.0`` -> ``VLLM_RBLN``."""
    words = part.split()
    word = words[1] if len(words) > 1 and words[0] == "installed" else (words[0] if words else "")
    word = word.upper().replace("-", "_")
    return re.sub(r"^CACHEMGR_|_VERSION$", "", word)


def flatten(prefix: str, value: Any) -> Iterable[tuple[str, Any]]:
    """``{"serving": {"tp": 4}}`` -> ``("serving.tp", 4)``: nested inputs as table rows."""
    if isinstance(value, dict) and value:
        for key in sorted(value):
            yield from flatten(f"{prefix}.{key}" if prefix else str(key), value[key])
    else:
        yield prefix, json.dumps(value) if isinstance(value, dict | list) else value


def entry_row(
    *, key: str, model: str, role: str, compiler: str, npu: str, size: str, **more: Any
) -> dict[str, Any]:
    """The leading cells of every table of entries (``ls``, ``ls --remote``): a 12-digit key, and
    ``?`` for what is not known; the table's own cells follow."""
    known = {"model": model, "role": role, "compiler": compiler, "npu": npu}
    return {"key": key[:12], **{name: value or "?" for name, value in known.items()}, "size": size, **more}


def tell(kind: Literal["note", "warning"], lines: Iterable[str]) -> None:
    """Notes and warnings: to stderr, so that ``-o json`` output always parses. A person's
    ``note: ...`` line, escaped and wrapped to the terminal's width as tables are (80 columns
    without one); where stderr is JSON, an event of that name whose ``message`` is the line,
    never wrapped (every line on a JSON stderr is one: docs/reference.md)."""
    from cachemgr.core.log import configured_format, get_logger

    if configured_format() == "json":
        log = get_logger("cachemgr")
        for line in lines:
            (log.warning if kind == "warning" else log.info)(kind, message=line)
        return
    width = terminal_width()
    for line in lines:
        # Wrapped as prose is: continued two columns in, a path or a command never cut inside.
        print(fit_text(f"{kind}: {safe(line)}", width), file=sys.stderr)


def section(title: str, body: str) -> str:
    return f"\n\n{title}\n{body}"
