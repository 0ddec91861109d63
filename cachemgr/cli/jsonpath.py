"""kubectl's JSONPath templates, the subset ``-o jsonpath=``, ``-o custom-columns=`` and ``--sort-by``
take (docs/reference.md, "Output for scripts"), written here: it is small, and kubectl's template
language (text around ``{...}``, ``range``/``end``, ``"\\n"`` literals) is not the JSONPath of the
Python libraries that implement Goessner's.

What a template holds:

* text, printed as it is, and ``{EXPRESSION}`` blocks;
* ``{.a.b}``, ``{.items[0].key}``, ``{.items[-1]}``, ``{.items[*].key}``, ``{.items[1:3]}``,
  ``{.a['key.with.dots']}``, ``{.*}`` (every value of an object), ``{@}`` / ``{$}`` (the current
  element, the document);
* ``[?(@.status == "published")]``: a filter with ``==``, ``!=``, ``<``, ``<=``, ``>``, ``>=``
  against a string, number, ``true``, ``false`` or ``null``; ``[?(@.signer)]``: the field is
  there and not null, false, 0 or "";
* ``{range .items[*]}...{end}``: the inner template once per result, ``@`` that result;
* ``{"\\n"}``, ``{"\\t"}``, ``{'text'}``: literal text.

Several results of one expression are printed separated by a space, as kubectl does; a string as
it is, ``true``/``false``, a number, an object or a list as compact JSON, ``null`` and a missing
field as nothing. Recursive descent (``..``) and functions are not supported: they are a usage
error naming what is.

A template is the operator's input, and bad input is a usage error (exit 64) with the reason, never
a crash: the parser bounds what it takes before Python would choke on it or loop for ever. Filters
and ranges nest at most :data:`MAX_DEPTH` deep (a filter inside a filter recurses), a number (an
index, a slice's bound, a literal) has at most :data:`MAX_NUMBER` characters (past 4,300 digits
``int()`` refuses, and far sooner the number means nothing here), a slice's step is never 0, and
the work one template, set of columns or ``--sort-by`` does is bounded (:class:`Budget`).
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from cachemgr.core.errors import UsageError

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_SLICE = re.compile(r"(-?[0-9]*):(-?[0-9]*)(?::(-?[0-9]+))?")
_INDEX = re.compile(r"-?[0-9]+")
MAX_DEPTH = 32  # filters inside filters, ranges inside ranges: kubectl's templates use two or three
MAX_NUMBER = 64  # characters of a number: an index of a list on a volume needs 6
MAX_VALUES = 2_000_000  # values looked at: a range over 10,000 entries printing 20 fields looks at 400,000
MAX_OUTPUT = 32 << 20  # characters a template may print: ls -o json of 10,000 entries is ~12 Mi
_OPS = ("==", "!=", "<=", ">=", "<", ">")
_MISSING = object()


def _cut(text: str, limit: int) -> str:
    """``text`` as an error quotes it: at most ``limit`` characters, "..." where it was cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _part(inside: str) -> str:
    """A bracket of the operator's template as an error shows it: escaped (repr) and cut short,
    never raw (seed 7171's operator inputs: a bracket of nested filters printed whole, with the
    characters it held)."""
    return f"[{_cut(inside, 40)!r}]"


def _error(message: str, text: str) -> UsageError:
    return UsageError(
        f"JSONPath {_cut(text, 80)!r}: {message}",
        remedy="see 'Output for scripts' in docs/reference.md, e.g. -o jsonpath='{.items[*].key}'",
    )


# --- paths -------------------------------------------------------------------------------------


class Budget:
    """The work one template, one set of columns or one ``--sort-by`` may do (:data:`MAX_VALUES`
    values looked at, :data:`MAX_OUTPUT` characters printed): ranges over the document inside
    ranges over it multiply, as do filters over every item for every row; the product is the
    operator's to narrow, and a usage error says so instead of a command that never ends."""

    def __init__(self, text: str) -> None:
        self.text, self.values, self.chars = text, 0, 0

    def count(self, values: int) -> None:
        self.values += values
        if self.values > MAX_VALUES:
            raise _error(f"it looks at more than {MAX_VALUES:,} values: narrow it", self.text)

    def take(self, part: str) -> str:
        self.spend(len(part))
        return part

    def spend(self, chars: int) -> None:
        self.chars += chars
        if self.chars > MAX_OUTPUT:
            raise _error(f"its output passes {MAX_OUTPUT >> 20} Mi characters: narrow it", self.text)


Step = Callable[[Any, Budget], list[Any]]


@dataclass(frozen=True)
class Path:
    """A parsed ``.a[0].b``: each step maps one value to the values it selects."""

    text: str
    steps: tuple[Step, ...]
    root: bool = False  # starts at the document ($), not the current element (@, or a bare .)

    def find(self, current: Any, document: Any | None = None, *, budget: Budget | None = None) -> list[Any]:
        budget = budget or Budget(self.text)
        values = [document if self.root and document is not None else current]
        for step in self.steps:
            values = [found for value in values for found in step(value, budget) if found is not _MISSING]
            budget.count(len(values))
        return values


def parse_path(text: str, *, depth: int = 0, whole: str | None = None) -> Path:
    """``.items[*].key`` (braces around it allowed, as kubectl allows them in custom-columns);
    inside a filter, ``depth`` filters deep in the path ``whole`` (which errors name)."""
    body = text.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1].strip()
    return _Parser(body, whole or text, depth).path()


class _Parser:
    def __init__(self, body: str, text: str, depth: int) -> None:
        self.body, self.text, self.at, self.depth = body, text, 0, depth

    def path(self) -> Path:
        root = False
        if self.peek("$"):
            self.at, root = self.at + 1, True
        elif self.peek("@"):
            self.at += 1
        steps: list[Step] = []
        if self.at < len(self.body) and self.body[self.at] not in ".[":
            steps.append(self.name())  # kubectl takes "items[0]" for ".items[0]" too
        while self.at < len(self.body):
            if self.peek(".."):
                raise _error("recursive descent (..) is not supported", self.text)
            if self.peek("."):
                self.at += 1
                if self.peek("*"):
                    self.at += 1
                    steps.append(_every)
                elif self.at < len(self.body):
                    steps.append(self.name())
            elif self.peek("["):
                steps.append(self.bracket())
            else:
                raise _error(f"unexpected {self.body[self.at : self.at + 10]!r}", self.text)
        return Path(self.text, tuple(steps), root)

    def peek(self, token: str) -> bool:
        return self.body.startswith(token, self.at)

    def name(self) -> Step:
        found = _NAME.match(self.body, self.at)
        if found is None:
            raise _error(f"a field name expected at {self.body[self.at : self.at + 10]!r}", self.text)
        self.at = found.end()
        return _field(found[0])

    def bracket(self) -> Step:
        end = self._closing()
        inside, self.at = self.body[self.at + 1 : end].strip(), end + 1
        if inside == "*":
            return _every
        if inside.startswith("?(") and inside.endswith(")"):
            if self.depth >= MAX_DEPTH:
                raise _error(f"filters nested more than {MAX_DEPTH} deep", self.text)
            return _filter(inside[2:-1].strip(), self.text, self.depth + 1)
        if inside[:1] in "'\"" and inside[-1:] == inside[:1] and len(inside) >= 2:
            return _field(inside[1:-1])
        found = _SLICE.fullmatch(inside)
        if found:
            start, stop, step = (_integer(p, self.text) if p else None for p in found.groups())
            if step == 0:
                raise _error(f"[{inside}]: a slice's step cannot be 0", self.text)
            return _slice(slice(start, stop, step))
        if _INDEX.fullmatch(inside):
            return _index(_integer(inside, self.text))
        raise _error(f"{_part(inside)} is not an index, a slice, [*], a quoted name or a filter", self.text)

    def _closing(self) -> int:
        depth, quote = 0, ""
        for i in range(self.at, len(self.body)):
            char = self.body[i]
            if quote:
                quote = "" if char == quote else quote
            elif char in "'\"":
                quote = char
            elif char in "[(":
                depth += 1
            elif char in ")]":
                depth -= 1
                if depth == 0 and char == "]":
                    return i
        raise _error("a [ without its ]", self.text)


def _integer(text: str, whole: str) -> int:
    return int(_bounded(text, whole))


def _bounded(number: str, whole: str) -> str:
    if len(number) > MAX_NUMBER:
        raise _error(f"a number of {len(number):,} characters (at most {MAX_NUMBER})", whole)
    return number


def _field(name: str) -> Step:
    def step(value: Any, _budget: Budget) -> list[Any]:
        return [value.get(name, _MISSING)] if isinstance(value, dict) else []

    return step


def _every(value: Any, _budget: Budget) -> list[Any]:
    if isinstance(value, dict):
        return list(value.values())
    return list(value) if isinstance(value, list) else []


def _index(number: int) -> Step:
    def step(value: Any, _budget: Budget) -> list[Any]:
        if isinstance(value, list) and -len(value) <= number < len(value):
            return [value[number]]
        return []

    return step


def _slice(part: slice) -> Step:
    def step(value: Any, _budget: Budget) -> list[Any]:
        return value[part] if isinstance(value, list) else []

    return step


def _filter(condition: str, text: str, depth: int) -> Step:
    op, at = _operator(condition)
    left, right = (condition[:at], condition[at + len(op) :]) if op else (condition, "")
    if not left.strip().startswith("@"):
        raise _error(f"a filter compares @ or a field of it, not {left.strip()!r}", text)
    field = parse_path(left.strip(), depth=depth, whole=text)
    literal = _literal(right.strip(), text) if op else None

    def keep(item: Any, budget: Budget) -> bool:
        found = field.find(item, budget=budget)
        if op is None:
            return bool(found) and found[0] not in (None, False, 0, "", [], {})
        return any(_compare(value, op, literal) for value in found)

    def step(value: Any, budget: Budget) -> list[Any]:
        items = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else []
        budget.count(len(items))
        return [item for item in items if keep(item, budget)]

    return step


def _operator(condition: str) -> tuple[str | None, int]:
    """The comparison in a filter and where it is: the first outside quotes and outside the
    brackets of a filter inside it (``@.users[?(@.pod == "p")] ``: that one is the inner's)."""
    quote, depth = "", 0
    for i, char in enumerate(condition):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[(":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif depth == 0:
            for op in _OPS:
                if condition.startswith(op, i):
                    return op, i
    return None, -1


def _literal(text: str, whole: str) -> Any:
    if text[:1] in "'\"" and text[-1:] == text[:1] and len(text) >= 2:
        return text[1:-1]
    if _NUMBER.fullmatch(text):
        _bounded(text, whole)
        return float(text) if any(c in text for c in ".eE") else int(text)
    if text in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[text]
    raise _error(f"{text!r} is not a string, a number, true, false or null", whole)


def _compare(value: Any, op: str, literal: Any) -> bool:
    if op == "==":
        return bool(value == literal)
    if op == "!=":
        return bool(value != literal)
    numbers = isinstance(value, int | float) and isinstance(literal, int | float)
    texts = isinstance(value, str) and isinstance(literal, str)
    if not (numbers or texts) or isinstance(value, bool) or isinstance(literal, bool):
        return False  # an order between a number and a text: none, as kubectl's filter has none
    compare: dict[str, Callable[[Any, Any], bool]] = {
        "<": operator.lt,
        "<=": operator.le,
        ">": operator.gt,
        ">=": operator.ge,
    }
    return compare[op](value, literal)


# --- templates ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Node:
    kind: str  # text | path | range
    text: str = ""
    path: Path | None = None
    body: tuple[_Node, ...] = ()


def render(template: str, document: Any, *, escape: Callable[[str], str]) -> str:
    """``template`` applied to ``document``; every value taken from it goes through ``escape``."""
    nodes = _parse_template(template)
    budget = Budget(template)
    return "".join(budget.take(part) for part in _render(nodes, document, document, escape, budget))


def _render(
    nodes: Sequence[_Node], current: Any, document: Any, escape: Callable[[str], str], budget: Budget
) -> Iterator[str]:
    for node in nodes:
        budget.count(1)
        if node.kind == "text":
            yield node.text
        elif node.kind == "path" and node.path is not None:
            yield " ".join(show(value, escape) for value in node.path.find(current, document, budget=budget))
        elif node.path is not None:
            for item in node.path.find(current, document, budget=budget):
                yield from _render(node.body, item, document, escape, budget)


def show(value: Any, escape: Callable[[str], str]) -> str:
    """One value as a template prints it (kubectl's forms: a string as it is, JSON for the rest)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return json.dumps(value)
    return escape(json.dumps(value, separators=(",", ":"), default=str))


def _parse_template(template: str) -> tuple[_Node, ...]:
    stack: list[tuple[list[_Node], Path | None]] = [([], None)]
    at = 0
    while at < len(template):
        start = template.find("{", at)
        if start < 0:
            stack[-1][0].append(_Node("text", template[at:]))
            break
        if start > at:
            stack[-1][0].append(_Node("text", template[at:start]))
        end = _block_end(template, start)
        expression = template[start + 1 : end].strip()
        at = end + 1
        if expression.startswith("range "):
            if len(stack) > MAX_DEPTH:
                raise _error(f"ranges nested more than {MAX_DEPTH} deep", template)
            stack.append(([], parse_path(expression[6:].strip())))
        elif expression == "end":
            if len(stack) == 1:
                raise _error("{end} without {range}", template)
            body, path = stack.pop()
            stack[-1][0].append(_Node("range", path=path, body=tuple(body)))
        elif expression[:1] in "'\"":
            stack[-1][0].append(_Node("text", _unquote(expression, template)))
        elif expression:
            stack[-1][0].append(_Node("path", path=parse_path(expression)))
    if len(stack) > 1:
        raise _error("{range} without its {end}", template)
    return tuple(stack[0][0])


def _block_end(template: str, start: int) -> int:
    quote = ""
    for i in range(start + 1, len(template)):
        char = template[i]
        if quote:
            quote = "" if char == quote and template[i - 1] != "\\" else quote
        elif char in "'\"":
            quote = char
        elif char == "}":
            return i
    raise _error("a { without its }", template)


def _unquote(expression: str, template: str) -> str:
    if len(expression) < 2 or expression[-1] != expression[0]:
        raise _error(f"{expression!r} is not a quoted text", template)
    body = expression[1:-1]
    escapes = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'"}
    return re.sub(r"\\(.)", lambda m: escapes.get(m[1], m[0]), body)


# --- custom columns ----------------------------------------------------------------------------


def parse_columns(spec: str) -> list[tuple[str, Path]]:
    """``KEY:.key,STATUS:{.status}`` -> headers and paths (kubectl's custom-columns form)."""
    columns = []
    for part in _split_columns(spec):
        header, colon, expression = part.partition(":")
        if not colon or not header.strip() or not expression.strip():
            raise _error(f"column {part!r} is not HEADER:JSONPATH", spec)
        columns.append((header.strip(), parse_path(expression.strip())))
    if not columns:
        raise _error("no columns", spec)
    return columns


def _split_columns(spec: str) -> list[str]:
    """On the commas between columns, not those inside [...] or quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(spec):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[({":
            depth += 1
        elif char in "])}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    parts.append(spec[start:])
    return [p for p in parts if p.strip()]


def sort_key(path: Path) -> Callable[[Any], tuple[int, Any]]:
    """``--sort-by``: items by the first value ``path`` finds in each; numbers by value, everything
    else by its text; items without one first (as kubectl puts empty values)."""

    budget = Budget(path.text)

    def key(item: Any) -> tuple[int, Any]:
        found = [v for v in path.find(item, item, budget=budget) if v is not None]
        if not found:
            return (0, 0)
        value = found[0]
        if isinstance(value, int | float) and not isinstance(value, bool):
            return (1, value)
        return (2, value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str))

    return key
