"""The one reader of JSON that others wrote (cachemgr.core.jsonread, issue 33).

Its bounds hold before a Python object is made: a text nested past MAX_DEPTH never reaches the
parser's recursion, and every refusal is a ValueError. Its depth measure is exact for any JSON
text (Hypothesis draws texts with brackets, quotes and backslashes inside strings, the cases a
count of brackets gets wrong), so a record cachemgr writes, of the deepest key inputs a pod
accepts, always reads back.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachemgr.core import jsonread
from cachemgr.core.jsonread import MAX_CONTAINERS, MAX_DEPTH, NotRegularError, parse
from cachemgr.key import vllm_values

pytestmark = pytest.mark.quick

DEEP = b"[" * 200_000 + b"]" * 200_000


def _depth(value: Any) -> int:
    """Objects and arrays deep (a scalar is 0), iteratively."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level + 1)
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _nested(levels: int, *, leaf: Any = "x", text: str = "") -> Any:
    value: Any = leaf
    for level in range(levels):
        value = [value, text] if level % 2 else {f"k{text}": value, "n": text}
    return value


# Strings that fool a reader counting brackets: brackets, quotes and backslashes inside them.
_TRICKY = st.text(alphabet='[]{}"\\,:ab \n\u00e9\u4e2d', max_size=8)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64),
    st.floats(allow_nan=False, allow_infinity=False),
    _TRICKY,
)


def _documents(max_leaves: int) -> st.SearchStrategy[Any]:
    return st.recursive(
        _SCALARS,
        lambda children: st.one_of(
            st.lists(children, max_size=4), st.dictionaries(_TRICKY, children, max_size=4)
        ),
        max_leaves=max_leaves,
    )


@settings(max_examples=300, deadline=None)
@given(doc=_documents(40), ascii_only=st.booleans())
def test_every_document_within_the_bounds_reads_back_as_written(doc: Any, ascii_only: bool) -> None:
    text = json.dumps(doc, ensure_ascii=ascii_only)
    assert parse(text.encode()) == doc
    assert parse(text) == doc


@settings(max_examples=200, deadline=None)
@given(
    inner=_documents(6), levels=st.integers(min_value=MAX_DEPTH - 8, max_value=MAX_DEPTH + 8), text=_TRICKY
)
def test_the_depth_is_measured_exactly_whatever_the_strings_hold(inner: Any, levels: int, text: str) -> None:
    doc = _nested(levels, leaf=inner, text=text)
    raw = json.dumps(doc).encode()
    if _depth(doc) <= MAX_DEPTH:
        assert parse(raw) == doc
    else:
        with pytest.raises(ValueError, match=f"nested deeper than {MAX_DEPTH} levels"):
            parse(raw)


def test_a_document_200000_deep_is_refused_before_the_parser_recurses() -> None:
    """Refused by the measure, not by a RecursionError caught from the parser: with a recursion
    limit the parser would hit at 50 levels, the same refusal, and a text 100 deep still parses."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(150)
    try:
        for text in (DEEP, b"[" * 200_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
            with pytest.raises(ValueError, match=f"^nested deeper than {MAX_DEPTH} levels$"):
                parse(text)
    finally:
        sys.setrecursionlimit(limit)
    assert _depth(parse(json.dumps(_nested(100)).encode())) == 100


def test_the_deepest_key_a_pod_accepts_reads_back_in_a_record() -> None:
    """A flag value nests at most vllm_values.MAX_DEPTH levels (scalars counted); a record holds it
    under its inputs (manifest, inputs, serving, the flag), within this reader's bound."""
    value = vllm_values.loads(json.dumps(_nested(vllm_values.MAX_DEPTH - 1)))  # and its scalar: 64
    record = {"inputs": {"serving": {"compilation_config": value}}, "files": []}
    assert _depth(record) <= MAX_DEPTH
    assert parse(json.dumps(record, indent=2).encode()) == record


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (b"1e400", "out of range"),
        (b"[" + b"1" * 21 + b"]", "out of range"),
        (b"NaN", "is not a JSON number"),
        (b'{"a": Infinity}', "is not a JSON number"),
        (b"\xff\xfe[\x00]\x00", "not UTF-8"),
        ('["a"]'.encode("utf-16"), "not UTF-8"),
        (b'"\xed\xa0\x80"', "not UTF-8"),  # an encoded lone surrogate
        (b"[1,", "not JSON"),
        (b"", "not JSON"),
        (b"\x1b[31m", "not JSON"),
        (b"[]" * (MAX_CONTAINERS + 1), f"more than {MAX_CONTAINERS:,} objects and arrays"),
        (b'["' + b"[" * (4 * MAX_CONTAINERS) + b'"]', "objects and arrays"),
    ],
)
def test_what_no_writer_of_records_makes_is_a_value_error_naming_it(text: bytes, why: str) -> None:
    with pytest.raises(ValueError, match="^" + why if why.startswith(("not", "more")) else why):
        parse(text)


def test_a_text_over_the_limit_is_refused_unread(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="larger than 16 bytes"):
        parse(b"[" + b" " * 20 + b"]", limit=16)
    path = tmp_path / "big.json"
    path.write_bytes(b"[" + b" " * (3 << 20) + b"]")
    with pytest.raises(ValueError, match="larger than 1 MiB, not read"):
        jsonread.read(path, limit=1 << 20)


def test_anything_but_a_regular_file_is_damage_never_followed_nor_waited_on(tmp_path: Path) -> None:
    (tmp_path / "elsewhere.json").write_text('{"a": 1}')
    (tmp_path / "link.json").symlink_to(tmp_path / "elsewhere.json")
    os.mkfifo(tmp_path / "fifo.json")  # a FIFO with no writer: an open without O_NONBLOCK would hang
    (tmp_path / "folder.json").mkdir()
    for name, what in (("link.json", "symbolic link"), ("fifo.json", "FIFO"), ("folder.json", "directory")):
        with pytest.raises(NotRegularError, match=f"it is a {what}, not a regular file"):
            jsonread.read(tmp_path / name)
    with pytest.raises(FileNotFoundError):
        jsonread.read(tmp_path / "absent.json")
    folder = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert jsonread.read_object("elsewhere.json", dir_fd=folder) == {"a": 1}
        with pytest.raises(NotRegularError):
            jsonread.read("link.json", dir_fd=folder)
    finally:
        os.close(folder)
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="a JSON array, not an object"):
        jsonread.read_object(tmp_path / "list.json")


def test_a_pod_local_file_is_followed_in_one_open_and_must_lead_to_a_regular_file(tmp_path: Path) -> None:
    """``follow``: a ConfigMap's file is a link into its ``..data`` folder, swapped whole on an
    update. One open follows it (no path resolved first and opened later, which an update between
    the two turns into "no such file"); a FIFO behind the link still never blocks."""
    data = tmp_path / "..2026_a"
    data.mkdir()
    (data / "config.json").write_text('{"a": 1}')
    (tmp_path / "..data").symlink_to(data.name)
    (tmp_path / "config.json").symlink_to("..data/config.json")
    assert jsonread.read(tmp_path / "config.json", follow=True) == {"a": 1}
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "to-fifo.json").symlink_to("fifo")
    with pytest.raises(NotRegularError, match="FIFO"):
        jsonread.read(tmp_path / "to-fifo.json", follow=True)
    (tmp_path / "loop.json").symlink_to("loop.json")
    with pytest.raises(OSError, match="symbolic links"):  # unreadable (ELOOP), not "not a regular file"
        jsonread.read(tmp_path / "loop.json", follow=True)
