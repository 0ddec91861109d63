"""The docs' commands, flags, environment variables and metric names, held to the code (issue 24
item 18), as tests/test_guide.py holds the operator guide's outputs.

Every ``cachemgr COMMAND --flag`` the README and docs/ show (in code spans and code blocks, up to
a ``--`` that starts a server's argv) must be a command of the parser and a flag of that command;
every ``CACHEMGR_*`` variable must be one the code reads; every ``cachemgr_*`` metric must be one
``/metrics`` exports, and every family ``/metrics`` exports must be in docs/kubernetes.md's table.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from cachemgr.cli.main import build_parser
from cachemgr.runtime.metrics import Metrics
from cachemgr.runtime.status_metrics import VolumeWatch, build_registry

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = [
    *sorted((ROOT / "cachemgr").rglob("*.py")),
    *sorted((ROOT / "deploy").rglob("*.*")),
    *sorted((ROOT / "tests").rglob("*.py")),  # the test tiers' own knobs (CACHEMGR_CAMPAIGN_*...)
    *sorted((ROOT / "bench").rglob("*.py")),
    *sorted((ROOT / "scripts").glob("*")),
    ROOT / "Dockerfile",
]
# Written by others than cachemgr's code, documented for them: the stand-ins' and the tests' knobs.
NOT_READ_BY_CACHEMGR = {
    "CACHEMGR_GUIDE_WRITE",
    "CACHEMGR_CAMPAIGN_TRIALS",
    "CACHEMGR_REQUIRE_MOUNTS",
    "CACHEMGR_TEST_WORKERS",
}

pytestmark = pytest.mark.quick


def _code_spans(text: str) -> list[str]:
    """Where commands are shown: inline code, shell blocks, and the ``$`` lines of console blocks
    (not ``text`` or ``json`` blocks: those are output, which may name cachemgr in prose)."""
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    for lang, block in re.findall(r"```([a-z]*)\n(.*?)```", text, flags=re.S):
        if lang == "console":
            spans += [line[2:] for line in block.splitlines() if line.startswith("$ ")]
        elif lang in {"sh", "bash", "shell", "yaml", "dockerfile"}:
            spans += block.splitlines()
    return spans


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def _invocations() -> list[tuple[str, list[str]]]:
    """(page, words after `cachemgr`) for every cachemgr command line the pages show: where a
    command starts (a span's start, a prompt, a pipe, ``&&``, ``$(``, ``exec ... --``), not prose."""
    found = []
    for page in PAGES:
        for whole in _code_spans(page.read_text()):
            span = re.split(r"\s#\s", whole, maxsplit=1)[0]  # a shell comment
            for match in re.finditer(
                r"(?:^\s*|\$ |\| |; |&& |\$\(|<\(|-- |\.venv/bin/)cachemgr ([a-z][^|;&<>)]*)", span
            ):
                try:
                    words = shlex.split(match[1], comments=True)
                except ValueError:
                    words = match[1].split()
                found.append((page.name, words))
    return found


def test_every_command_and_flag_the_docs_show_is_the_parsers() -> None:
    commands = _commands()
    wrong = []
    for page, words in _invocations():
        name = words[0]
        if name in {"COMMAND", "CMD"} or not re.fullmatch(r"[a-z]+", name):
            continue  # a placeholder, or prose
        if name not in commands:
            wrong.append(f"{page}: cachemgr {name}: no such command")
            continue
        allowed = _flags(commands[name])
        for word in words[1:]:
            if word == "--":
                break  # the server's argv
            flag = word.split("=", 1)[0]
            if flag.startswith("-") and flag not in allowed and flag not in {"-h", "--help"}:
                wrong.append(f"{page}: cachemgr {name} {flag}: no such flag")
    assert wrong == [], "\n".join(sorted(set(wrong)))


def test_the_docs_show_every_command() -> None:
    shown = {words[0] for _, words in _invocations()}
    assert set(_commands()) - shown == set(), "commands no page shows"


def test_every_environment_variable_the_docs_name_is_read_by_the_code() -> None:
    code = "\n".join(p.read_text(errors="replace") for p in CODE if p.is_file())
    named = {v for page in PAGES for v in re.findall(r"\bCACHEMGR_[A-Z_]+[A-Z]\b", page.read_text())}
    unread = sorted(v for v in named - NOT_READ_BY_CACHEMGR if v not in code)
    assert unread == [], f"documented but read nowhere: {unread}"


def test_every_variable_the_chart_and_the_entrypoints_set_is_in_the_references_environment() -> None:
    """What an operator finds in ``kubectl describe pod`` (the chart's env) or in the image's
    entrypoints, the reference's Environment table explains (CACHEMGR_RUN_ARGS was missing)."""
    reference = (ROOT / "docs" / "reference.md").read_text()
    table = reference.split("## Environment", 1)[1].split("\n## ", 1)[0]
    templates = (ROOT / "deploy" / "helm" / "modelserver" / "templates").glob("*")
    chart = {
        v
        for t in templates
        for v in re.findall(r"name: (CACHEMGR_[A-Z_]+[A-Z]|POD_NAME|NODE_NAME)\b", t.read_text())
    }
    scripts = {
        v
        for s in (ROOT / "entrypoint").glob("*")
        for v in re.findall(r"\bCACHEMGR_[A-Z_]+[A-Z]\b", s.read_text())
    }
    assert "CACHEMGR_RUN_ARGS" in chart & scripts
    missing = sorted(v for v in chart | scripts if f"`{v}`" not in table)
    assert missing == [], (
        f"set by the chart or the entrypoints, not in docs/reference.md's Environment: {missing}"
    )


def _exported(tmp_path: Path) -> set[str]:
    """Every family, the conditional ones too: a run compiling, its volume measured."""
    from cachemgr.runtime.state import StateWriter
    from cachemgr.runtime.status_metrics import measure_volume

    state = StateWriter(tmp_path / "state", stall_timeout=60.0)
    state.phase(
        "compiling",
        no_progress_s=1.0,
        staging_bytes=10,
        stalled=False,
        expected_compile_s=60.0,
        expected_bytes=99,
    )
    metrics = Metrics()
    volume = VolumeWatch(tmp_path, metrics)
    (tmp_path / "entries").mkdir()
    volume.figures = measure_volume(tmp_path)
    registry = build_registry(metrics, tmp_path / "state", volume)
    text = generate_latest(registry).decode()
    types = re.findall(r"^# TYPE (cachemgr_\w+) (\w+)", text, re.M)
    return {name for name, _ in types}


def test_every_metric_is_documented_and_every_documented_metric_exists(tmp_path: Path) -> None:
    exported = _exported(tmp_path)
    table = (ROOT / "docs" / "kubernetes.md").read_text()
    documented = set(re.findall(r"`(cachemgr_\w+?)(?:\{[^}]*\})?`", table))
    missing = sorted(exported - documented)
    assert missing == [], f"exported by /metrics, missing from docs/kubernetes.md's table: {missing}"
    named = {m for page in PAGES for m in re.findall(r"\bcachemgr_[a-z_]+[a-z]\b", page.read_text())}
    named = {m for m in named if not m.startswith(("cachemgr_standin", "cachemgr_testkit"))}
    unknown = sorted(m for m in named if m not in exported)
    assert unknown == [], f"metric names the docs give that /metrics does not export: {unknown}"
