"""kubectl's habits (issue 34, item 3): what a person reads fits 80 columns, ``--no-headers``
rows say their kind, a reason keeps its cause, a key input names its source on every row, every
``-o json`` has one envelope with RFC 3339 times, and ``-o jsonpath=``, ``-o custom-columns=`` and
``--sort-by`` take kubectl's syntax.

A real cache, built once by real ``warm`` processes (two compiler versions, three TP sizes, one
failed compile, one entry moved aside as damaged), copied for each test; every command runs as a
subprocess with no terminal and COLUMNS=80, as ``kubectl exec`` without ``-t``.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.podlib import DEADLINE, cluster, free_port, npu_node
from cachemgr_testkit.scenarios import compile_cmd, entry_dirs, server_argv

MODEL = "MiniMaxAI/MiniMax-M2.7"
NODE = "npu-node-12.cluster.example.com"
RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


@dataclass(frozen=True)
class Built:
    root: Path
    env: dict[str, str]
    failed_key: str


def vllm(tp: int) -> list[str]:
    return ["vllm", "serve", MODEL, "--tensor-parallel-size", str(tp), "--port", str(free_port())]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    base = tmp_path_factory.mktemp("forms")
    root = base / "volume"
    root.mkdir()
    with cluster(base / "work", STANDIN_COMPILE_SECONDS="0.1") as pods:
        compile_only = {"VLLM_RBLN_COMPILE_ONLY": "1", **npu_node(pods.work)}
        jobs = [
            pods.start(f"modelserver-warm-prefill-tp{tp}-5rj9w", vllm(tp), cache_root=root, command="warm", env=compile_only, node=NODE)
            for tp in (2, 4, 8)
        ]  # fmt: skip
        old = {**compile_only, "CACHEMGR_COMPILER_VERSION": "0.11.2"}
        jobs.append(
            pods.start("modelserver-warm-old-8k2qz", vllm(8), cache_root=root, command="warm", env=old)
        )
        failing = [
            "--strategy",
            "command",
            "--compile-cmd",
            compile_cmd(pods.work / "c.jsonl", extra="--fail-with 3"),
        ]
        jobs.append(
            pods.start(
                "modelserver-prefill-canary-9f6d2", server_argv(free_port()), cache_root=root, options=failing
            )
        )
        assert sorted(job.wait_exit() for job in jobs) == [0, 0, 0, 0, 70], [job.tail() for job in jobs]
        (failed,) = os.listdir(root / "failures")
        env = {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root), "COLUMNS": "80"}
        # One entry damaged deep inside and moved aside by verify --fix: a quarantine with a reason.
        victim = entry_dirs(root)[0]
        deep = next(p for p in sorted(victim.rglob("*.rbln")))
        deep.parent.chmod(0o755)
        deep.unlink()
        assert cli("verify", "--fix", env=env).returncode == 74
        yield Built(root, env, failed)


@pytest.fixture
def cache(built: Built, tmp_path: Path) -> Built:
    root = tmp_path / "volume"
    shutil.copytree(built.root, root, symlinks=True)
    return Built(root, {**built.env, "CACHEMGR_CACHE_ROOT": str(root)}, built.failed_key)


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "cachemgr", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done


def with_output(args: list[str] | tuple[str, ...], *form: str) -> list[str]:
    """``-o FORM`` before the server argv's ``--``, as an operator types it."""
    cut = args.index("--") if "--" in args else len(args)
    return [*args[:cut], *form, *args[cut:]]


def doc(*args: str, env: dict[str, str], code: int = 0) -> Any:
    done = cli(*with_output(args, "-o", "json"), env=env)
    assert done.returncode == code, done.stderr
    return json.loads(done.stdout)


def short_keys(cache: Built) -> list[str]:
    return [i["short"] for i in doc("ls", env=cache.env)["items"] if i["kind"] == "entry"]


# --- 80 columns -------------------------------------------------------------------------------------


def test_every_line_a_person_reads_fits_80_columns(cache: Built) -> None:
    """Issue 34: du's lines were 91 to 108 columns, show's 128, stats' 178; issue 40: the notes and
    warnings on stderr 128 to 332. Prose, notes and ``name  value`` lines wrap; the one exception is
    a word longer than the room (a path, an entry name), never cut, and a quoted line of a
    compiler's output (``| ...``), shown as it was written."""
    key = short_keys(cache)[0]
    commands = [
        ["ls"], ["du"], ["locks"], ["stats"], ["verify"], ["show", key], ["show", cache.failed_key[:12]],
        ["explain", "--", *vllm(16)], ["key", "--", *vllm(16)], ["prune", "--incompatible", "--dry-run"],
        # Issue 40: a nested input's name of 49 columns made the key's inputs 81 wide.
        ["key", "--", *vllm(8), "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'],
    ]  # fmt: skip
    for args in commands:
        done = cli(*args, env=cache.env)
        assert done.returncode in (0, 1), (args, done.stderr)
        said = [line for line in done.stderr.splitlines() if line.startswith(("note: ", "warning: "))]
        assert said or args[0] not in ("explain", "key"), "the hub model's unpinned revision is warned of"
        for line in done.stdout.splitlines() + done.stderr.splitlines():
            if len(line) <= 80 or line.lstrip().startswith("| "):
                continue
            words = line.split()
            assert len(words) <= 2, f"cachemgr {' '.join(args)}: {len(line)} columns: {line}"
            assert max(len(w) for w in words) > 80 - 20, f"a short word could have wrapped: {line}"
    wide = cli("ls", "-o", "wide", env=cache.env).stdout
    assert max(len(line) for line in wide.splitlines()) > 80, "-o wide: every column, nothing wrapped"


# --- --no-headers ----------------------------------------------------------------------------------


def test_no_headers_rows_start_with_their_kind_where_a_command_prints_several_tables(cache: Built) -> None:
    """Issue 34: ``du --no-headers`` joined three tables' rows, ``ls --no-headers`` four."""
    listing = doc("ls", env=cache.env)["items"]
    rows = cli("ls", "--no-headers", env=cache.env).stdout.splitlines()
    assert rows, "rows"
    assert "" not in rows, "no blank lines between the tables' rows"
    kinds = [row.split()[0] for row in rows]
    assert sorted(kinds) == sorted(i["kind"] for i in listing), (kinds, rows)
    assert {"entry", "failure", "quarantine"} <= set(kinds)
    du = cli("du", "--no-headers", env=cache.env).stdout.splitlines()
    # BY GENERATION is name-value lines, as show's (no rows: -o json's by_generation has them).
    assert {row.split()[0] for row in du} == {"entry", "prune"}, du
    usage = doc("du", env=cache.env)
    assert sum(1 for row in du if row.startswith("entry ")) == len(usage["entries"])
    assert max(len(row) for row in rows + du) <= 80


# --- cells ------------------------------------------------------------------------------------------


def test_a_quarantine_reason_keeps_its_cause_and_shortens_its_path(cache: Built) -> None:
    """Issue 34: the REASON column cut off the cause ("missing") and kept the path."""
    (moved,) = [i for i in doc("ls", env=cache.env)["items"] if i["kind"] == "quarantine"]
    assert moved["problem"].endswith(": missing"), moved["problem"]
    shown = cli("ls", env=cache.env).stdout
    (row,) = [line for line in shown.split("QUARANTINE", 1)[1].splitlines() if line[:12] in moved["entry"]]
    assert row.endswith(": missing"), row
    assert len(row) <= 80, row
    if len(moved["problem"]) > 40:  # shortened: the path gave way, from its start
        assert "…" in row.split(": missing")[0], row


def test_every_key_input_row_names_its_source(cache: Built) -> None:
    """Issue 34: the SOURCE cell was blank for an input whose group's source the row above said."""
    key = short_keys(cache)[0]
    rows = [r.split() for r in cli("show", key, "--no-headers", env=cache.env).stdout.splitlines()]
    inputs = [r for r in rows if r[0] == "input"]
    assert len(inputs) > 10, rows
    assert [r for r in inputs if len(r) < 4] == [], "kind, input, value, source: a row with no source"
    by_name = {r[1]: r for r in inputs}
    assert by_name["model.kind"][-1] == "argv", by_name["model.kind"]
    assert by_name["serving.tensor_parallel_size"][-1] == "argv"


# --- documents ---------------------------------------------------------------------------------------


def test_every_json_document_has_one_envelope_and_rfc3339_times(cache: Built) -> None:
    """Issue 34: ``ls -o json`` was a bare list and ``stats -o json`` an object; times epoch floats."""
    key = short_keys(cache)[0]
    kinds = {
        "EntryList": ["ls"], "LeaseList": ["locks"], "Stats": ["stats"], "VerifyReport": ["verify"],
        "DiskUsage": ["du"], "KeyDetail": ["show", key], "Prune": ["prune", "--incompatible", "--dry-run"],
        "Key": ["key", "--", *vllm(2)], "Explanation": ["explain", "--", *vllm(2)],
    }  # fmt: skip
    for kind, args in kinds.items():
        found = doc(*args, env=cache.env)
        assert (found["apiVersion"], found["kind"]) == ("cachemgr/v1", kind), (args, list(found)[:3])
        yaml_doc = cli(*with_output(args, "-o", "yaml"), env=cache.env)
        assert yaml_doc.stdout.startswith(f"apiVersion: cachemgr/v1\nkind: {kind}\n"), yaml_doc.stdout[:80]
    for kind in ("EntryList", "LeaseList", "Stats", "VerifyReport"):
        assert isinstance(doc(*kinds[kind], env=cache.env)["items"], list), kind
    entry = next(i for i in doc("ls", env=cache.env)["items"] if i["kind"] == "entry")
    shown = doc("show", key, env=cache.env)
    for when in (
        entry["created_at"],
        entry["last_used_at"],
        shown["created_at"],
        shown["manifest"]["created_at"],
    ):
        assert RFC3339.fullmatch(when), when
    assert (
        abs(
            datetime.datetime.fromisoformat(entry["created_at"].replace("Z", "+00:00")).timestamp()
            - os.stat(cache.root).st_mtime
        )
        < 3600
    )


def test_jsonpath_custom_columns_and_sort_by_take_kubectls_syntax(cache: Built) -> None:
    items = doc("ls", env=cache.env)["items"]
    entries = [i for i in items if i["kind"] == "entry"]
    template = '{range .items[?(@.kind=="entry")]}{.short}{"\\t"}{.status}{"\\n"}{end}'
    done = cli("ls", "-o", f"jsonpath={template}", env=cache.env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{e['short']}\t{e['status']}" for e in entries]
    assert cli("stats", "-o", "jsonpath={.volume.compiles}", env=cache.env).stdout == str(
        doc("stats", env=cache.env)["volume"]["compiles"]
    )
    columns = cli(
        "ls", "-o", "custom-columns=KEY:.short,SIGNER:.signer,POD:{.users[*].pod}", env=cache.env
    ).stdout.splitlines()
    assert columns[0].split() == ["KEY", "SIGNER", "POD"]
    assert [line.split()[0] for line in columns[1:]] == [i["short"] or "<none>" for i in items]
    assert all(line.split()[1] == "<none>" for line in columns[1:]), "no signer: <none>, as kubectl prints"
    # --sort-by: the table's rows and the document's items, by the same field of each item.
    by_size = sorted(entries, key=lambda e: e["size_bytes"])
    table = [
        line.split()[1]
        for line in cli("ls", "--sort-by", "{.size_bytes}", "--no-headers", env=cache.env).stdout.splitlines()
        if line.startswith("entry ")
    ]
    assert table == [e["short"] for e in by_size], table
    sorted_doc = doc("ls", "--sort-by", ".model", env=cache.env)["items"]
    assert [i["model"] or "" for i in sorted_doc] == sorted(i["model"] or "" for i in items)
    # Not kubectl's: a usage error (64), one line, that says what is not supported. Issue 40: a
    # zero step, a 5,000-digit number, filters nested 400 deep ended ls with exit 70.
    huge, deep = "9" * 5000, "[?(@.users" * 400 + ")]" * 400
    hostile = [
        ("-o", "jsonpath={.items[::0]}"), ("-o", f"jsonpath={{.items[{huge}]}}"),
        ("-o", f"jsonpath={{.items[?(@.size_bytes=={huge})]}}"), ("-o", f"jsonpath={{.items{deep}}}"),
        ("-o", "jsonpath=" + "{range $.items[*]}" * 40 + "{end}" * 40),
        ("-o", "custom-columns=K:.items[::0]"), ("-o", f"custom-columns=K:.users{deep}"),
        ("--sort-by", ".users[::0]"), ("--sort-by", f".users[{huge}]"), ("--sort-by", f".users{deep}"),
    ]  # fmt: skip
    bad = [
        ("-o", b)
        for b in (
            "jsonpath={..key}",
            "jsonpath={.items[",
            "jsonpath=",
            "custom-columns=KEY",
            "jsonpaths={.a}",
        )
    ]
    for flag, value in [*bad, *hostile]:
        refused = cli("ls", flag, value, env=cache.env)
        assert refused.returncode == 64, (value[:200], refused.stdout, refused.stderr[-2000:])
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-2000:]
        assert len(refused.stderr) < 1000, refused.stderr
    assert (
        "recursive descent (..) is not supported" in cli("ls", "-o", "jsonpath={..key}", env=cache.env).stderr
    )
