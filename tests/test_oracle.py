"""The key held to the server's own identity, computed by the real server code (the key oracle).

tests/data/oracle/vllm-rbln-0.12.0.json is the real vLLM 0.30.0, vllm-rbln 0.12.0 and optimum-rbln
0.12.0 code's answer to every variant of its corpus: every ``vllm serve`` option at other values and
at its default, every variable of both servers' ``envs.py``, spellings, model directory edits,
images, pairs of options, each against the vLLM-model path and the optimum path. scripts/oracle
writes it (20 to 40 minutes: it runs the server's code, docs/development.md "The key oracle");
``scripts/oracle --check`` says whether the committed table is what the pinned releases answer today.
Here, cachemgr's key of each variant is held to those answers: no false hit (cachemgr's keys equal
where the server's identity, or what it compiles, differ) and needless misses under 5 %.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit import oracle, oracle_keys

from cachemgr.key import vllm_flags

REPO = Path(__file__).resolve().parent.parent
TABLE = REPO / "tests" / "data" / "oracle" / "vllm-rbln-0.12.0.json"
# The releases the table must have been made with (tools/oracle/env.sh pins the wheels).
PINNED = {"vllm": "0.30.0", "vllm-rbln": "0.12.0", "optimum-rbln": "0.12.0", "transformers": "5.15.1"}
# What cachemgr refuses (exit 78) though the server would start, and why that is right.
REFUSED_ON_PURPOSE = {
    # An NPU name written otherwise than RBLN writes it: vllm-rbln hashes it as written but tests its
    # family upper-cased, so such a pod compiles a CA25's graphs under a signature no other pod has.
    "vllm/npu/' RBLN-CR13'",
    "vllm/npu/'rbln-cr13'",
    "optimum/npu/' RBLN-CA25'",
    "optimum/npu/'rbln-ca25'",
}


@pytest.fixture(scope="module")
def table() -> dict[str, Any]:
    return oracle_keys.load(TABLE)


@pytest.fixture(scope="module")
def rows(table: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return oracle_keys.replay(table, tmp_path_factory.mktemp("oracle"))


def test_no_false_hits(rows: list[dict[str, Any]]) -> None:
    """Where the server's identity or what it compiles differ, cachemgr's key differs too."""
    report = oracle.report(rows)
    assert report["false_hits"] == [], oracle_keys.describe(rows)


def test_needless_misses_are_under_five_percent(rows: list[dict[str, Any]]) -> None:
    """Where the server's identity and what it compiles are the same, cachemgr's key mostly is too."""
    report = oracle.report(rows)
    assert report["needless_share"] < oracle_keys.NEEDLESS_LIMIT, oracle_keys.describe(rows)


def test_cachemgr_refuses_only_what_it_must(rows: list[dict[str, Any]]) -> None:
    refused = set(oracle.report(rows)["cachemgr_refuses"])
    assert refused == REFUSED_ON_PURPOSE, oracle_keys.describe(rows)


def test_the_table_is_of_the_pinned_releases(table: dict[str, Any]) -> None:
    """The answers were computed with the releases cachemgr's rules claim, in the locked environment."""
    assert {k: table["versions"][k] for k in PINNED} == PINNED
    assert table["lock_sha256"] == oracle.lock_digest("0.12.0"), (
        "tools/oracle/requirements-0.12.0.txt changed since the table was made: rerun scripts/oracle"
    )


def test_the_corpus_tries_every_option_of_the_parser_on_both_paths(table: dict[str, Any]) -> None:
    """Every option of the live parser (cachemgr/key/vllm_flags.py, generated from it) is in the corpus,
    on each model path; a new option makes this fail until the oracle has run again."""
    options = {(v["base"], v["dest"]) for v in table["variants"] if v["kind"] == "option"}
    for base in oracle.BASES:
        tried = {dest.replace("_", "-") for b, dest in options if b == base}
        assert tried == set(vllm_flags.FLAGS) - {"help"}, base


def test_the_derived_rules_are_what_the_table_gives() -> None:
    """cachemgr/key/vllm_identity.py is tools/oracle/derive.py's reading of the committed table."""
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "oracle" / "derive.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_variant_has_one_answer(table: dict[str, Any]) -> None:
    """Each variant once, each answered: refused by the server, or its identity and compile judged."""
    ids = [v["id"] for v in table["variants"]]
    assert len(ids) == len(set(ids))
    for variant in table["variants"]:
        answer = variant["answer"]
        assert set(answer) in ({"refused"}, {"path", "server_same", "compile_same", "differs"},
                               {"path", "server_same", "compile_same", "differs", "reads"}), variant["id"]  # fmt: skip
