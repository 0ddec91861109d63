"""The key held to the server's own identity, computed by the real server code (the key oracle).

tests/data/oracle/vllm-rbln-RELEASE.json is, for each release of tools/releases/manifest.toml the
oracle has run, the real vLLM, vllm-rbln and optimum-rbln code's answer to every variant of its
corpus: every ``vllm serve`` option at other values and at its default, every variable of both
servers' ``envs.py``, spellings, model directory edits, images, pairs of options, every field of
every structured option (a JSON object filling a config class) alone, each against each model path
the manifest says the oracle checks (its corpus from the release's own parser and ``envs.py``).
scripts/oracle [RELEASE] writes them (10 to 40 minutes each: it runs the server's code,
docs/development.md "The key oracle"); ``scripts/oracle --check RELEASE`` says whether the
committed table is what the pinned releases answer today. Here, cachemgr's key of each variant is
held to those answers, for every release cachemgr's rules claim: no false hit (cachemgr's keys
equal where the server's identity, or what it compiles, differ) and needless misses under 5 %.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit import manifest, oracle, oracle_keys

from cachemgr.key import releases, vllm_flags
from cachemgr.key.serving import RUNTIME_ONLY

REPO = Path(__file__).resolve().parent.parent
# Every release the oracle has run (tools/releases/manifest.toml names them; each has its table).
RELEASES = tuple(r for r in manifest.oracle_releases() if (oracle.REPO / "tests" / "data" / "oracle" /
                                                            f"vllm-rbln-{r}.json").is_file())  # fmt: skip


def pinned(release: str) -> dict[str, str]:
    """The versions the release's table must have been made with (tools/oracle/env.sh pins the wheels)."""
    entry = manifest.release(release)
    wheels = {w.name: w.version for w in entry.wheels}
    return {**wheels, "transformers": entry.transformers}


# An NPU name written otherwise than RBLN writes it: vllm-rbln hashes it as written but tests its
# family upper-cased, so such a pod compiles a CA25's graphs under a signature no other pod has.
_NPU_AS_NOT_WRITTEN = {
    "vllm/npu/' RBLN-CR13'",
    "vllm/npu/'rbln-cr13'",
    "optimum/npu/' RBLN-CA25'",
    "optimum/npu/'rbln-ca25'",
}
# What cachemgr refuses (exit 78) though the server would start, and why that is right.
# (each base's own NPU: a release whose vLLM-model path the oracle does not check has no such variant)


def refused_on_purpose(release: str) -> set[str]:
    return {v for v in _NPU_AS_NOT_WRITTEN if v.split("/")[0] in manifest.release(release).checked}


def table_path(release: str) -> Path:
    return REPO / "tests" / "data" / "oracle" / f"vllm-rbln-{release}.json"


# Each release keyed by a table: its own, or that of the release whose code it is (same_code_as), keyed
# under its own versions.
KEYED = tuple(name for name in manifest.names() if manifest.release(name).oracle in RELEASES)


@pytest.fixture(scope="module", params=KEYED)
def table(request: pytest.FixtureRequest) -> dict[str, Any]:
    return {**oracle_keys.load(table_path(manifest.release(request.param).oracle)), "keyed_as": request.param}


@pytest.fixture(scope="module")
def rows(table: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return oracle_keys.replay(table, tmp_path_factory.mktemp("oracle"), as_release=table["keyed_as"])


def test_no_false_hits(rows: list[dict[str, Any]]) -> None:
    """Where the server's identity or what it compiles differ, cachemgr's key differs too."""
    report = oracle.report(rows)
    assert report["false_hits"] == [], oracle_keys.describe(rows)


def test_needless_misses_are_under_five_percent(rows: list[dict[str, Any]]) -> None:
    """Where the server's identity and what it compiles are the same, cachemgr's key mostly is too."""
    report = oracle.report(rows)
    assert report["needless_share"] < oracle_keys.NEEDLESS_LIMIT, oracle_keys.describe(rows)


def test_cachemgr_refuses_only_what_it_must(table: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    refused = set(oracle.report(rows)["cachemgr_refuses"])
    assert refused == refused_on_purpose(table["release"]), oracle_keys.describe(rows)


def test_every_release_cachemgr_checks_has_a_table() -> None:
    """Each release whose rules say a path was checked (cachemgr/key/releases.py) is held to an oracle
    table, its own or that of the release whose code it is; and a release without one is strict."""
    for release in releases.KNOWN:
        own = release.same_code_as or release.versions["vllm_rbln"]
        if release.checked:
            assert own in RELEASES, release.name
        assert (
            oracle_keys.VERSIONS[release.versions["vllm_rbln"]]["CACHEMGR_VLLM_VERSION"]
            == release.versions["vllm"]
        )


def test_the_table_is_of_the_pinned_releases(table: dict[str, Any]) -> None:
    """The answers were computed with the releases cachemgr's rules claim, in the locked environment."""
    release = table["release"]
    assert {k: table["versions"][k] for k in pinned(release)} == pinned(release)
    assert table["lock_sha256"] == oracle.lock_digest(release), (
        f"tools/oracle/requirements-{release}.txt changed since the table was made: rerun scripts/oracle {release}"
    )


def test_the_corpus_tries_every_option_of_the_parser_on_both_paths(table: dict[str, Any]) -> None:
    """Every option of the live parser is in the corpus, on each model path; a new option makes this
    fail until the oracle has run again. For the release whose vLLM cachemgr/key/vllm_flags.py is
    generated from, that is its parser; another release's is its own vLLM's, whose options the corpus
    took from the live parser too (held here to be the same set on both paths)."""
    options = {(v["base"], v["dest"]) for v in table["variants"] if v["kind"] == "option"}
    tried = {
        base: {dest.replace("_", "-") for b, dest in options if b == base}
        for base in oracle.bases(table["release"])
    }
    for base, flags in tried.items():
        if manifest.release(table["release"]).vllm.startswith(vllm_flags.VLLM_VERSION + "+"):
            assert flags == set(vllm_flags.FLAGS) - {"help"}, base
        assert flags == next(iter(tried.values())), base


# JSON options whose value is a list, not an object (vllm_flags.py's docstring): no fields to try.
_JSON_LISTS = {"allowed-origins", "allowed-methods", "allowed-headers"}


def test_every_field_of_every_structured_option_was_tried(table: dict[str, Any]) -> None:
    """Each JSON-object option of the live parser is listed with the config class it fills on each
    model path (tools/oracle/fields.py), and every field of that class was tried alone on that path;
    a free-form one (no class) stays keyed whole, so none of its values may leave the key. For the
    release cachemgr/key/vllm_flags.py was read from, the options are held to cachemgr/key/vllm_flags.py's JSON_FLAGS, read off the same parser apart."""
    structured = table.get("structured")
    assert structured, f"{table['release']}: the table lists no structured option; rerun scripts/oracle"
    if table["release"] == vllm_flags.VLLM_RBLN_VERSION:  # the release vllm_flags.py was read from
        assert {dest.replace("_", "-") for dest in structured} == set(vllm_flags.JSON_FLAGS) - _JSON_LISTS
    tried = {(v["base"], v["dest"], v["field"]) for v in table["variants"] if v["kind"] == "field"}
    bases = set(oracle.bases(table["release"]))
    for dest, spec in structured.items():
        if spec["free_form"]:
            assert not spec["bases"], dest
            continue
        assert set(spec["bases"]) == bases, dest
        for base, on in spec["bases"].items():
            assert on["fields"], (dest, base)
            missing = sorted(field for field in on["fields"] if (base, dest, field) not in tried)
            assert not missing, f"{dest} on the {base} path: fields never tried: {missing}"


@pytest.mark.parametrize("release", RELEASES)
def test_no_structured_option_leaves_the_key_without_every_field_proven(release: str) -> None:
    """A structured option is left out whole on a path only when every field of its class was tried
    there and none changed the path's identity; a free-form one never is (tools/oracle/derive.py)."""
    table = oracle_keys.load(table_path(release))
    rules = next(r for r in releases.KNOWN if r.versions["vllm_rbln"] == release)
    ignored = {"vllm": rules.runtime_flags | rules.runtime_flags_vllm_path,
               "optimum": rules.runtime_flags | rules.runtime_flags_optimum_path}  # fmt: skip
    for dest, spec in table["structured"].items():
        flag = dest.replace("_", "-")
        for base, flags in ignored.items():
            if flag not in flags or flag in RUNTIME_ONLY:
                continue
            assert not spec["free_form"], f"{flag} is free-form and left out on the {base} path"
            every = set(spec["bases"][base]["fields"])
            assert every <= rules.structured[dest]["ignored"][base], (flag, base)


@pytest.mark.parametrize("release", RELEASES)
def test_a_field_left_out_was_tried_at_every_value_its_type_has_few_of(release: str) -> None:
    """A bool, Literal or enum field leaves a path's key only when every value but its default was
    tried there: one value may be the one the server resolves an unset field to."""
    table = oracle_keys.load(table_path(release))
    rules = next(r for r in releases.KNOWN if r.versions["vllm_rbln"] == release)
    tried: dict[tuple[str, str, str], list[Any]] = {}
    for v in table["variants"]:
        if v["kind"] == "field":
            value = json.loads(v["argv"][1])  # the option's JSON document: the field's value in it
            for name in v["field"].split("."):
                value = value[name]
            tried.setdefault((v["base"], v["dest"], v["field"]), []).append(value)
    for dest, spec in rules.structured.items():
        for base, paths in spec["ignored"].items():
            for path in paths:
                field = table["structured"][dest]["bases"][base]["fields"][path]
                assert "values" in field, (dest, path)
                for value in field["values"] or ():
                    assert value == field["default"] or value in tried[(base, dest, path)], (dest, base, path)


@pytest.mark.parametrize("release", RELEASES)
def test_the_derived_rules_are_what_the_table_gives(release: str) -> None:
    """Each release's cachemgr/key/<identity>.py (the manifest names it) is
    tools/oracle/derive.py's reading of the committed tables."""
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "oracle" / "derive.py"), "--release", release, "--check"],
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
