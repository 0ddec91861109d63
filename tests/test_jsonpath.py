"""An operator's template is bad input, never a crash (issue 40, "kubectl habits").

``-o jsonpath=``, ``-o custom-columns=`` and ``--sort-by`` share one parser (cachemgr.cli.jsonpath).
A zero slice step, a 5,000-digit index or literal, or filters nested 400 deep ended ``ls`` with
exit 70 (ValueError, RecursionError); ranges inside ranges over the document ran without end. Each
is a :class:`UsageError` (exit 64) naming the reason, in one line; ``tests/test_fuzz.py`` runs
generated templates against real ``ls`` and ``show`` output.
"""

from __future__ import annotations

import pytest

from cachemgr.cli import jsonpath
from cachemgr.cli.documents import emit_custom_columns
from cachemgr.core.errors import UsageError
from cachemgr.core.printable import safe

pytestmark = pytest.mark.quick

DOC = {
    "apiVersion": "cachemgr/v1",
    "kind": "EntryList",
    "items": [{"key": f"k{i}", "size_bytes": i * 10, "users": [{"pod": f"p{i}"}]} for i in range(8)],
}
HUGE = "9" * 5000


def refused(template: str) -> str:
    with pytest.raises(UsageError) as caught:
        jsonpath.render(template, DOC, escape=safe)
    line = caught.value.one_line()
    assert "\n" not in line, line
    assert len(line) < 400, line
    assert safe(line) == line, f"not printable as it is: {line!r}"
    return line


@pytest.mark.parametrize(
    "inside",
    ["\x1b7red\x1b8", "a\tb", "\u200b", "x" * 500, "?(@.a == 1)" + "\x07" * 3, "\udcff"],
    ids=["escape", "tab", "zero-width", "long", "filter-and-bells", "surrogate"],
)
def test_a_bracket_that_is_nothing_jsonpath_knows_is_shown_escaped_and_short(inside: str) -> None:
    """The bracket was printed raw and whole in the error (seed 7171's operator inputs: a bracket
    of nested filters holding characters a terminal acts on)."""
    line = refused(f"{{.items[{inside}]}}")
    assert "is not an index, a slice" in line


@pytest.mark.parametrize("template", ["{.items[::0]}", "{.items[1:5:0]}", "{.items[-3::-0]}"])
def test_a_zero_slice_step_is_a_usage_error(template: str) -> None:
    assert "a slice's step cannot be 0" in refused(template)


@pytest.mark.parametrize(
    "template",
    [
        f"{{.items[{HUGE}]}}",
        f"{{.items[-{HUGE}]}}",
        f"{{.items[{HUGE}:]}}",
        f"{{.items[::{HUGE}]}}",
        f"{{.items[?(@.size_bytes == {HUGE})]}}",
        f"{{.items[?(@.size_bytes < -{HUGE}.5e{HUGE})]}}",
    ],
)
def test_a_number_of_5000_digits_is_a_usage_error(template: str) -> None:
    assert f"(at most {jsonpath.MAX_NUMBER})" in refused(template)


def test_numbers_up_to_the_bound_still_work() -> None:
    big = "9" * jsonpath.MAX_NUMBER
    assert jsonpath.render(f"{{.items[{big}]}}", DOC, escape=safe) == ""
    assert jsonpath.render(f"{{.items[-{big[1:]}:2].key}}", DOC, escape=safe) == "k0 k1"
    assert jsonpath.render("{.items[::-3].key}", DOC, escape=safe) == "k7 k4 k1"
    assert jsonpath.render(f"{{.items[?(@.size_bytes < {big})].key}}", DOC, escape=safe).count("k") == 8


def test_filters_nested_400_deep_are_a_usage_error() -> None:
    deep = "{.items" + "[?(@.users" * 400 + ")]" * 400 + "}"
    line = refused(deep)
    assert f"filters nested more than {jsonpath.MAX_DEPTH} deep" in line
    assert line.startswith("JSONPath '.items[?(@.users"), "the error quotes the operator's template"


def test_filters_nested_to_the_bound_still_work() -> None:
    depth = jsonpath.MAX_DEPTH
    nested = "{.items" + "[?(@.users" * depth + ")]" * depth + ".key}"
    assert jsonpath.render(nested, DOC, escape=safe) == ""  # users hold no users: nothing, no error
    two = '{.items[?(@.users[?(@.pod == "p3")])].key}'
    assert jsonpath.render(two, DOC, escape=safe) == "k3"


def test_ranges_nested_400_deep_are_a_usage_error() -> None:
    deep = "{range .items[*]}" * 400 + "{.key}" + "{end}" * 400
    assert f"ranges nested more than {jsonpath.MAX_DEPTH} deep" in refused(deep)


def test_ranges_that_multiply_stop_with_a_usage_error() -> None:
    """Eight items, ranges over the whole document eight deep: 8**8 = 16.8 million rows."""
    many = "{range $.items[*]}" * 8 + "{.key}" + "{end}" * 8
    assert "narrow it" in refused(many)
    big = {"items": [{"blob": "x" * 100_000}] * 8}  # 800 KB
    wide = "{range $.items[*]}" * 3 + "{$}" + "{end}" * 3  # 512 copies of it: 400 MB
    with pytest.raises(UsageError, match="output passes 32 Mi characters"):
        jsonpath.render(wide, big, escape=safe)


def test_custom_columns_and_sort_by_share_the_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    for spec in ("KEY:.items[::0]", f"KEY:.items[{HUGE}]", "KEY:.a" + "[?(@.b" * 400 + ")]" * 400):
        with pytest.raises(UsageError):
            emit_custom_columns(DOC, spec, headers=True)
    for path in (".size_bytes[::0]", f".users[{HUGE}]", ".users" + "[?(@.b" * 400 + ")]" * 400):
        with pytest.raises(UsageError):
            jsonpath.parse_path(path)
    emit_custom_columns(DOC, "KEY:.key,POD:.users[0].pod", headers=True)
    assert capsys.readouterr().out.splitlines()[1].split() == ["k0", "p0"]
