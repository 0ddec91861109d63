"""The docs hold together: every relative link in the README and docs/ reaches a file and a heading.

The README links to the pages of docs/, which link to each other, to deploy files and to bench/; a
page moved or a heading renamed must not leave a link that lands nowhere. Anchors are checked the
way GitHub makes them from headings (lower case, punctuation dropped, spaces to dashes, repeats
numbered).
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def unfenced(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (a ``#`` or a link in code is not markdown)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in unfenced(page.read_text()):
        heading = re.match(r"#{1,6} (.+)", line)
        if not heading:
            continue
        base = slug(heading[1])
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    prose = (re.sub(r"`[^`]*`", "``", line) for line in unfenced(page.read_text()))
    return [m[1] for line in prose for m in LINK.finditer(line)]


def test_the_slugs_are_githubs() -> None:
    assert slug("Status and metrics (`--status-port`)") == "status-and-metrics---status-port"
    assert slug("128+N: stopped by signal N before the server started") == (
        "128n-stopped-by-signal-n-before-the-server-started"
    )
    assert slug("`ls` and `du` on 10,000 entries") == "ls-and-du-on-10000-entries"


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](#nowhere) `[code](#x)`\n\n```\n[fenced](#y)\n```\n")
    assert links(page) == ["#title", "#nowhere"]
    assert anchors(page) == {"title"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_a_heading(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check here
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_readme_stays_short_and_links_every_page() -> None:
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) < 200
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(readme) if not t.startswith("#")}
    assert set((ROOT / "docs").glob("*.md")) <= linked


def test_the_module_map_names_every_module_and_only_modules_that_exist() -> None:
    """docs/development.md's map, one row per module by its path under cachemgr/."""
    page = (ROOT / "docs" / "development.md").read_text()
    section = page.split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([a-z_]+/[a-z0-9_*]+\.py)` \|", section, re.M))
    package = ROOT / "cachemgr"
    modules = {str(p.relative_to(package)) for p in package.rglob("*.py") if p.name != "__init__.py"}
    modules.discard("__main__.py")
    # A row with a * names the generated modules of one kind (one per release: tools/gen_rules.py)
    globbed = {m for row in named if "*" in row for m in modules if fnmatch.fnmatch(m, row)}
    assert all(fnmatch.filter(modules, row) for row in named if "*" in row), "a * row that names nothing"
    named = {row for row in named if "*" not in row} | globbed
    assert named == modules, f"not in the map: {sorted(modules - named)}; gone: {sorted(named - modules)}"


def test_the_readme_names_each_fact_of_the_chart_page_that_cachemgr_takes_over() -> None:
    """Issue 34: the README said every fact of the compile cache page holds, while the page's start
    budget ("longer than the first compile") is what cachemgr's probes replace. Each sentence it
    quotes as taken over must be the page's own, word for word, so the list cannot drift from it."""
    readme = (ROOT / "README.md").read_text()
    page = " ".join((ROOT / "docs" / "compile-cache.en.md").read_text().split())
    quoted = [
        " ".join(q.split()) for q in re.findall(r'^- "(.+?)":', readme.replace("\n  ", " "), flags=re.M)
    ]
    assert quoted, "the README lists what cachemgr takes over from the page"
    for sentence in quoted:
        assert sentence in page, f"not the page's words: {sentence!r}"
    assert "The modelserver Pod's start budget must be longer than the first compile." in quoted


def test_the_readme_and_the_guide_say_where_helm_comes_from_and_which_one_is_tested() -> None:
    """Issue 34: neither said where the ``helm`` the guide runs comes from; the test set-up's is
    read out of a registry wheel, which an operator should not copy. Both name the official install
    and the version the tests use (testkit's, so a Helm upgrade there shows here)."""
    from cachemgr_testkit.helm import HELM_VERSION

    guide = (ROOT / "docs" / "operator-guide.md").read_text()
    first_helm = guide.index("\nhelm install ")  # the first one an operator types (a command line)
    for page, text in (
        ("README.md", (ROOT / "README.md").read_text()),
        ("operator guide", guide[:first_helm]),
    ):
        said = " ".join(text.split())
        assert "https://helm.sh/docs/intro/install/" in said, page
        assert f"tested with Helm {HELM_VERSION.removeprefix('v')}" in said, page
        assert ".venv/bin/helm" in said, f"{page}: what the project's scripts do"
