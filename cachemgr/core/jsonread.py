"""The one reader of JSON that others wrote: every record on the volume and every object of the bucket.

Whoever can write the shared volume or the bucket chooses these bytes (docs/design.md, principle
6): a FIFO or a symlink where a record should be, a file of gigabytes, ``'[' * 200000`` (400 KB,
under any size cap) that drives ``json.loads`` into Python's recursion limit, ``1e400``, a
400-digit integer, bytes that are not UTF-8. Read here, each is a ``ValueError`` naming what is
wrong (never the bytes themselves), which every caller turns into its record's documented
meaning: damage (quarantine, compile again), absent, or untrusted. Never an exception of another
kind: one that reaches the CLI is exit 70, "a cachemgr bug".

The bounds, all checked before a Python object is made:

* size: at most ``limit`` bytes are read (:data:`JSON_LIMIT` unless the record's own is smaller);
* encoding: UTF-8 (what ``json.dumps`` writes; ``json.loads`` would also take UTF-16 and UTF-32);
* nesting: at most :data:`MAX_DEPTH` objects and arrays deep, measured by :func:`_shape` over the
  bytes, so the parser never recurses past it (the C parser recurses once per level);
* number of objects and arrays: at most :data:`MAX_CONTAINERS`, so that what a record becomes in
  memory stays within a small multiple of its size;
* numbers: finite, and integers of at most 20 digits (cachemgr writes none past 2**64).

Reading is :func:`read` (a file, opened by name without following a link or blocking on a FIFO),
:func:`parse` (bytes already read: a remote object, a record read with its ``stat``), and for the
few readers that need the descriptor, :func:`open_regular` and :func:`read_fd`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import operator
import os
import stat
from collections.abc import Iterator
from itertools import accumulate, count
from pathlib import Path
from typing import Any

from cachemgr.core import safefs

# Every JSON document cachemgr writes on a volume is far below this (a manifest of 100,000 files
# is ~20 MiB); a larger one is damage, and reading it whole would cost the reader its memory.
JSON_LIMIT = 64 << 20
# The deepest record cachemgr writes holds the key's inputs three levels down (manifest, inputs,
# serving), and a JSON flag value nests at most 64 levels (cachemgr.key.vllm_values.MAX_DEPTH,
# pinned against this by tests/test_jsonread.py); the C parser's own limit is the interpreter's
# recursion limit (1,000 frames, fewer with a deep caller).
MAX_DEPTH = 128
# A manifest has one object per file and a file record takes ~200 bytes: 64 MiB of manifest is
# ~330,000 objects. Empty arrays cost 56 bytes for each 3 of text: this keeps 64 MiB of them from
# becoming a gigabyte.
MAX_CONTAINERS = 1 << 20
_MAX_DIGITS = 20

# O_NOFOLLOW: a symlink planted as a record is never read through (ELOOP); O_NONBLOCK: a FIFO
# there does not block the reader (it is then refused as not a regular file).
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CHUNK = 1 << 20
_FEW_ESCAPES = 1 << 16

# What _shape keeps of a text: quotes and brackets, objects' braces read as arrays' brackets.
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_MARKS = bytes(c for c in range(256) if c not in b'"[]{}')
# '[' as 2 and ']' as 0: their running sum is twice the opens, so sum - position is the depth.
_OPEN_AS_TWO = bytes.maketrans(b"[]", b"\x02\x00")


class NotRegularError(ValueError):
    """What is there is a symlink, a FIFO, a socket or a directory: damage, not an I/O error."""


def human_limit(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 and not size % (1 << 20) else f"{size} bytes"


@contextlib.contextmanager
def open_regular(name: str | Path, *, dir_fd: int | None = None, follow: bool = False) -> Iterator[int]:
    """A descriptor of the regular file ``name`` (in ``dir_fd``, a folder reached safely, when given).

    ``FileNotFoundError`` if it is missing, :class:`NotRegularError` if it is anything but a
    regular file (a symlink is never followed, a FIFO never blocks), ``OSError`` otherwise.
    ``follow``: a symlink is followed in the same open (a pod-local file the server follows too,
    such as a ConfigMap's), and what it leads to must be a regular file.
    """
    try:
        fd = os.open(name, READ_FLAGS & ~os.O_NOFOLLOW if follow else READ_FLAGS, dir_fd=dir_fd)
    except OSError as error:
        if error.errno in {errno.ELOOP, errno.ENXIO, errno.EISDIR} and not (
            follow and error.errno == errno.ELOOP
        ):
            # a symlink (followed: a loop of links, unreadable as any); a socket; a folder
            raise NotRegularError(f"it is {_what(name, dir_fd)}, not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularError(f"it is {safefs.describe(st)}, not a regular file")
        yield fd
    finally:
        os.close(fd)


def _what(name: str | Path, dir_fd: int | None) -> str:
    try:
        return safefs.describe(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
    except OSError:
        return "not a regular file"


def read_fd(fd: int, *, limit: int) -> bytes:
    """At most ``limit`` bytes of the file open as ``fd``, from where it is; more is damage
    (``ValueError``), and no more than one byte past the limit is ever read."""
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = os.read(fd, min(_CHUNK, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > limit:
        raise ValueError(f"larger than {human_limit(limit)}, not read")
    return b"".join(chunks)


def read_bytes(
    name: str | Path, *, dir_fd: int | None = None, limit: int = JSON_LIMIT, follow: bool = False
) -> bytes:
    """The bytes of the regular file ``name``, bounded: :func:`open_regular`, then :func:`read_fd`."""
    with open_regular(name, dir_fd=dir_fd, follow=follow) as fd:
        return read_fd(fd, limit=limit)


def read(
    name: str | Path, *, dir_fd: int | None = None, limit: int = JSON_LIMIT, follow: bool = False
) -> Any:
    """The JSON document in the file ``name``: ``FileNotFoundError`` if absent, ``ValueError`` if
    damaged (not a regular file, too large, not JSON, out of bounds), ``OSError`` if unreadable."""
    return parse(read_bytes(name, dir_fd=dir_fd, limit=limit, follow=follow), limit=limit)


def read_object(name: str | Path, *, dir_fd: int | None = None, limit: int = JSON_LIMIT) -> dict[str, Any]:
    """:func:`read` of a record that must be a JSON object (``ValueError`` if it is another value)."""
    return as_object(read(name, dir_fd=dir_fd, limit=limit))


def as_object(doc: Any) -> dict[str, Any]:
    """``doc`` if it is a JSON object; else ``ValueError`` naming its kind (never its content)."""
    if not isinstance(doc, dict):
        # A ValueError, as every damage of a record: the readers catch that one kind.
        raise ValueError(f"a JSON {_KINDS.get(type(doc), 'value')}, not an object")  # noqa: TRY004
    return doc


_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def parse(data: bytes | str, *, limit: int = JSON_LIMIT) -> Any:
    """``json.loads`` within the bounds above; ``ValueError`` for anything else, never another error."""
    if len(data) > limit:
        raise ValueError(f"larger than {human_limit(limit)}, not read")
    if isinstance(data, str):
        text = data
        try:
            raw = data.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: no writer of records makes one
            raise ValueError("not UTF-8") from None
    else:
        raw = data
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("not UTF-8") from None
    _shape(raw)
    try:
        return json.loads(text, parse_float=_finite, parse_int=_bounded_int, parse_constant=_no_constant)
    except RecursionError:  # _shape bounds the depth; a caller already deep in its stack, still
        raise ValueError(f"nested deeper than this reader can parse here ({MAX_DEPTH} at most)") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error.msg}, at byte {error.pos})") from None


def _shape(raw: bytes) -> None:
    """Refuse a text nested deeper than :data:`MAX_DEPTH` or holding more than
    :data:`MAX_CONTAINERS` objects and arrays, in a few passes that run at memory speed.

    Only brackets outside strings count. In a JSON string every backslash begins a two-character
    escape, so once the quotes that backslashes escape are blanked (pairing escapes left to right,
    as the parser does), the quotes left open and close strings. Of the text, only those quotes
    and the brackets are kept; a pair of adjacent quotes encloses no bracket (an empty string,
    nearly every string once its letters are gone, or the seam between two such strings), so it
    goes too, and what is left between quotes is inside a string. The depth is then the largest
    running count of opens minus closes, summed in C by ``accumulate``.

    For a text json.loads accepts, this is its exact depth; for one it refuses, at least the
    depth its parser reaches before it refuses (the part before the error is valid JSON).
    """
    marks = bytes(_without_escapes(raw).translate(_BRACKETS, _NOT_MARKS)).replace(b'""', b"")
    if len(marks) > 4 * MAX_CONTAINERS:  # quotes of strings holding brackets count too: bounded work
        raise ValueError(f"more than {MAX_CONTAINERS:,} objects and arrays")
    if b'"' in marks:
        marks = b"".join(marks.split(b'"')[::2])
    opens = marks.count(b"[")
    if opens > MAX_CONTAINERS:
        raise ValueError(f"more than {MAX_CONTAINERS:,} objects and arrays")
    if opens <= MAX_DEPTH:  # no deeper than it has brackets: most records, without a pass
        return
    if b"[" * (MAX_DEPTH + 1) in marks:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    # Without its innermost pairs (a manifest's file records: nearly all of it) a text is at most
    # one level shallower; only when that does not settle it are all the brackets summed.
    inner = marks.replace(b"[]", b"")
    if _depth(inner) + (inner != marks) > MAX_DEPTH and _depth(marks) > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")


def _without_escapes(raw: bytes) -> bytes | bytearray:
    """``raw`` with the quotes that backslashes escape made blanks: escapes paired left to right,
    as the parser pairs them. The backslashes themselves and the other escaped characters are not
    marks and go with the rest of the letters. Most texts have no backslash; a text of few is
    changed in one copy; a text of many loses every escape in two passes of ``replace``."""
    quotes: list[int] = []
    at = raw.find(b"\\")
    for _ in range(_FEW_ESCAPES):
        if at < 0:
            break
        if raw[at + 1 : at + 2] == b'"':
            quotes.append(at + 1)
        at = raw.find(b"\\", at + 2)  # past the escaped character, a backslash too
    else:
        if at >= 0:
            return raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    if not quotes:
        return raw
    blanked = bytearray(raw)
    for quote in quotes:
        blanked[quote] = 0x20
    return blanked


def _depth(marks: bytes) -> int:
    """The deepest nesting of a text of brackets: the largest running count of opens minus closes."""
    return max(map(operator.sub, accumulate(marks.translate(_OPEN_AS_TWO)), count(1)), default=0)


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > _MAX_DIGITS and len(text.lstrip("-")) > _MAX_DIGITS:
        raise ValueError(f"number {text[:20]}... is out of range")
    return int(text)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")
