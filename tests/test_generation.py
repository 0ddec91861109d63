"""Generations (issue 32): which of two SDK generations is the older, proved from the parts both
know, and what a full volume's message says about them. The rollout itself runs for real in
tests/test_rollout.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from cachemgr.core.errors import MESSAGE_LIMIT
from cachemgr.core.versions import compare_versions
from cachemgr.key.digest import digest_of
from cachemgr.ops.entryinfo import EntryInfo
from cachemgr.ops.expected import Expectation
from cachemgr.ops.generation import Compat, Generation, KeyFacts, key_facts, lineage
from cachemgr.ops.lineage import superseded
from cachemgr.ops.rollout import prunable_now
from cachemgr.ops.space import DiskReport
from cachemgr.volume.records import User

pytestmark = pytest.mark.quick


@pytest.mark.parametrize(
    ("a", "b", "order"),
    [
        ("0.12.0", "0.12.1", -1),
        ("0.13.0", "0.12.9", 1),
        ("0.12", "0.12.0", 0),  # PEP 440 pads with zeros
        ("0.13.0rc1", "0.13.0", -1),  # a pre-release comes before its release
        ("0.12.0.post1", "0.12.0", 1),
        ("0.30.0+cpu", "0.30.1+cpu", -1),  # the releases differ: the labels do not matter
        ("0.30.0+cpu", "0.30.0", None),  # two builds of one release: neither is newer
        ("0.12.0+a", "0.12.0+b", None),
        ("0.13.0.dev4+gabc", "0.13.0.dev5+gdef", None),  # dev counts of two branches
        ("0.13.0.dev4", "0.13.0", -1),
        ("thirty", "0.30.0", None),
        ("9" * 5000, "0.30.0", None),  # planted in a key.json: past int()'s 4,300 digits
        ("0." + "1" * 200, "0.30.0", None),
    ],
)
def test_versions_are_ordered_only_where_the_release_process_orders_them(
    a: str, b: str, order: int | None
) -> None:
    assert compare_versions(a, b) == order
    assert compare_versions(b, a) == (None if order is None else -order)


def gen(compiler: str | None = "0.12", schema: int | None = 1, **versions: str) -> Generation:
    return Generation.of({"schema": schema, "compiler": compiler, **versions})


def test_an_older_compiler_is_older_and_the_newer_is_newer() -> None:
    old, new = gen("0.12", vllm_rbln="0.12.0"), gen("0.13", vllm_rbln="0.13.0")
    assert old.compare(new).order == "older"
    assert new.compare(old).order == "newer"
    # The words name what decides: the compiler (the SDK's server comes with it).
    assert new.compare(old).words() == "compiler 0.13, this image has 0.12"


def test_a_server_upgrade_alone_orders_by_the_server_and_says_so() -> None:
    old, new = gen(vllm_rbln="0.12.0", vllm="0.30.0+cpu"), gen(vllm_rbln="0.12.1", vllm="0.30.0+cpu")
    found = old.compare(new)
    assert found.order == "older"
    assert found.words() == "vllm-rbln 0.12.0, this image has 0.12.1"


@pytest.mark.parametrize(
    ("mine", "theirs"),
    [
        # An older compiler with a newer server: no proof either way.
        (gen("0.12", vllm_rbln="0.13.0"), gen("0.13", vllm_rbln="0.12.0")),
        # The same release built twice (a local label): no order.
        (gen(vllm_rbln="0.12.0+a"), gen(vllm_rbln="0.12.0+b")),
    ],
)
def test_mixed_or_unorderable_parts_are_unordered_never_older(mine: Generation, theirs: Generation) -> None:
    assert mine.compare(theirs).order == "unordered"
    assert theirs.compare(mine).order == "unordered"


def test_the_same_only_where_every_part_is_known_on_both_sides() -> None:
    entry = gen(vllm_rbln="0.12.0")
    assert entry.compare(gen(vllm_rbln="0.12.0")).order == "same"
    # An image that cannot tell its server's versions does not know whether the entry is its own.
    assert entry.compare(gen()).order is None
    # Nothing in common: nothing can be said.
    assert gen(None, None, vllm_rbln="1").compare(gen(schema=None, vllm="1")).order is None


def test_a_schema_that_is_not_a_plain_number_is_unordered_never_a_crash() -> None:
    # "²".isdigit() is True and int("²") raises; 5,000 digits are past int()'s limit.
    for odd in ("\u00b2", "9" * 5000, "\uff11"):
        planted = Generation.of({"schema": odd, "compiler": "0.12"})
        assert planted.compare(gen("0.12")).order in {None, "unordered"}
        assert planted.to_json()["schema"] == odd


def test_a_schema_of_true_is_no_schema() -> None:
    assert Generation.of_inputs({"schema": True, "compiler": "0.12"}).get("schema") is None
    assert Generation.of_inputs({"schema": 2, "compiler": "0.12"}).get("schema") == "2"


def test_a_newer_key_schema_is_newer_whatever_the_sdk() -> None:
    assert gen(schema=2).compare(gen(schema=1)).order == "newer"
    assert Compat("0.12", "RBLN-CA25").judge(_facts(gen(schema=0)))[0] == "incompatible"


def _facts(generation: Generation, model: str = "org/m") -> KeyFacts:
    return KeyFacts(generation, ("hub", model, "prefill", "RBLN-CA25", "vllm"))


def test_this_image_judges_older_incompatible_or_superseded_and_newer_never_dead() -> None:
    image = Compat("0.12", "RBLN-CA25", {"vllm_rbln": "0.12.1"})
    assert image.judge(_facts(gen("0.11", vllm_rbln="0.11.2")))[:2] == (
        "incompatible",
        "compiler 0.11, this image has 0.12",
    )
    assert image.judge(_facts(gen(vllm_rbln="0.12.0")))[:2] == (
        "superseded",
        "vllm-rbln 0.12.0, this image has 0.12.1",
    )
    assert image.judge(_facts(gen("0.13", vllm_rbln="0.13.0")))[:2] == (
        "newer",
        "compiler 0.13, this image has 0.12",
    )
    assert image.judge(_facts(gen(vllm_rbln="0.12.1+local")))[0] == "published"
    assert image.judge(None)[0] == "published", "an unknown generation is never judged"
    assert image.why_incompatible(_facts(gen("0.13"))) is None


def test_key_facts_come_only_from_inputs_that_hash_to_the_key() -> None:
    inputs = {"schema": 1, "compiler": "0.11", "role": "prefill", "npu": "RBLN-CA25", "strategy": "vllm",
              "model": {"kind": "hub", "id": "org/m"}, "versions": {"vllm_rbln": "0.11.2"}}  # fmt: skip
    found = key_facts({"inputs": inputs}, digest_of(inputs))
    assert isinstance(found, KeyFacts)
    assert found.generation.get("compiler") == "0.11"
    assert found.lineage == ("hub", "org/m", "prefill", "RBLN-CA25", "vllm")
    # A key.json rewritten to claim an older compiler no longer hashes to its entry's key.
    claimed = {**inputs, "compiler": "0.10"}
    assert (
        key_facts({"inputs": claimed}, digest_of(inputs))
        == "key.json's inputs do not hash to the entry's key"
    )
    assert isinstance(key_facts({"inputs": "x"}, digest_of(inputs)), str)
    assert isinstance(key_facts({"inputs": {"a": float("nan")}}, "0" * 32), str)


def test_a_local_model_is_one_lineage_by_its_path_whatever_its_fingerprint() -> None:
    """Issue 31 changes how a local directory is fingerprinted: the same weights under a newer
    cachemgr get another digest, and must still replace the old entry."""
    old = {"model": {"kind": "local", "fingerprint": "a" * 32, "path": "/models/m"}, "role": "prefill",
           "npu": "RBLN-CA25", "strategy": "vllm"}  # fmt: skip
    new = {**old, "model": {"kind": "local", "fingerprint": "b" * 32, "path": "/models/m"}}
    assert lineage(old, {}) == lineage(new, {})
    command = {**old, "model": {"kind": "local", "fingerprint": "c" * 32}, "strategy": "command"}
    assert lineage(command, {"model_path": "/models/m"})[1] == "/models/m"
    assert lineage({**old, "npu": "RBLN-CA12"}, {}) != lineage(old, {})


def entry(name: str, generation: Generation, **fields: Any) -> EntryInfo:
    compat = Compat("0.12", "RBLN-CA25", None)  # this image knows its compiler, not its server
    status, problem, order = compat.judge(_facts(generation))
    defaults: dict[str, Any] = {
        "name": name, "path": Path("/v/entries") / name, "key": name * 8, "model": "org/m", "model_id": "",
        "role": "prefill", "compiler": generation.get("compiler") or "", "npu": "RBLN-CA25", "strategy": "vllm",
        "size_bytes": 100, "files": 1, "pipeline_parallel_size": 1, "created_at": 1.0, "last_used_at": 1.0,
        "users": (), "status": status, "problem": problem, "facts": _facts(generation), "vs_image": order,
    }  # fmt: skip
    return EntryInfo(**{**defaults, **fields})


def test_an_entry_is_superseded_by_a_newer_one_of_its_model_not_newer_than_this_image() -> None:
    old = entry("aaaa", gen(vllm_rbln="0.12.0"))
    new = entry("bbbb", gen(vllm_rbln="0.12.1"), created_at=2.0)
    other_model = entry("cccc", gen(vllm_rbln="0.12.0"), facts=_facts(gen(vllm_rbln="0.12.0"), "org/other"))
    found = {e.name: e for e in superseded([old, new, other_model], Compat("0.12", "RBLN-CA25").generation)}
    assert found["aaaa"].status == "superseded"
    assert found["aaaa"].superseded_by == new.key
    assert found["aaaa"].problem == "newer entry bbbbbbbbbbbb: vllm-rbln 0.12.0, bbbbbbbbbbbb has 0.12.1"
    assert found["bbbb"].status == "published"
    assert found["cccc"].status == "published", "another model's entries are not its successors"
    # A shell that cannot tell its own compiler judges nothing by lineage either.
    assert {e.status for e in superseded([old, new], Compat(None, None).generation)} == {"published"}


def test_a_newer_images_entry_supersedes_nothing_in_an_older_images_eyes() -> None:
    """An operator in a 0.12 pod must not prune the 0.12 entries the old pods start on again
    because a 0.13 entry of the model is there."""
    mine = entry("aaaa", gen("0.12", vllm_rbln="0.12.0"), vs_image=None)
    newer = entry("bbbb", gen("0.13", vllm_rbln="0.13.0"))
    assert newer.status == "newer"
    found = superseded([mine, newer], Compat("0.12", "RBLN-CA25").generation)
    assert [e.status for e in found] == ["published", "newer"]


def _report(**prunable: Any) -> DiskReport:
    return DiskReport(
        volume="/var/cache/cachemgr",
        total_bytes=200 << 30,
        free_bytes=1 << 30,
        expected=Expectation(150 << 30, "learned from entry " + "e" * 12 + " (150.0 GiB)"),
        cause="checked before compiling",
        prunable=prunable_now(tuple(prunable["entries"])),
        written_bytes=prunable.get("written", 0),
        free_at_start=prunable.get("free_at_start"),
    )


POD = "modelserver-prefill-7d9c6b5f48-" + "x" * 20


def test_a_full_volume_mid_rollout_names_the_older_generation_its_pods_and_what_frees_it() -> None:
    users = tuple(User(pod=f"{POD}{n}", node="n", since=1.0, age=1.0) for n in range(5))
    kept = entry("aaaa", gen("0.11", vllm_rbln="0.11.2"), users=users, size_bytes=150 << 30)
    report = _report(entries=[kept])
    what, remedy = report.what(), report.remedy()
    assert (
        "nothing can be pruned now: the older generation (compiler 0.11, vllm-rbln 0.11.2) holds 150.0 GiB"
        in what
    )
    assert f"in use by {POD}0, {POD}1 and 3 more" in what
    assert "storage.compileCache.size" in remedy
    assert "rollingUpdate.maxUnavailable" in remedy
    assert "'cachemgr prune --incompatible --yes' in a pod that mounts this volume" in remedy
    assert "toolbox.enabled=true" in remedy
    line = report.error().one_line()
    assert " ... " not in line, "the message is never cut: it must fit the one line's limits"


def test_a_full_volume_names_one_prune_with_every_selector_that_frees_something_uncut() -> None:
    old = entry("aaaa", gen("0.11", vllm_rbln="0.11.2"), last_used_at=0.0, created_at=0.0)
    server = entry("bbbb", gen(vllm_rbln="0.12.0"), facts=_facts(gen(vllm_rbln="0.12.0")), last_used_at=0.0)
    server = EntryInfo(**{**server.__dict__, "status": "superseded", "problem": "newer entry"})
    stale = entry("cccc", gen(vllm_rbln="0.12.2"), status="published", last_used_at=0.0, created_at=0.0)
    report = _report(entries=[old, server, stale], written=10 << 30, free_at_start=11 << 30)
    remedy = report.remedy()
    assert "'cachemgr prune --incompatible --superseded --unused-for 14d --yes'" in remedy
    assert len(remedy) <= MESSAGE_LIMIT // 2, remedy
    assert len(report.what()) <= MESSAGE_LIMIT, report.what()
    assert " ... " not in report.error().one_line()


def test_a_compile_that_filled_the_volume_mid_rollout_keeps_its_whole_remedy_in_the_line() -> None:
    """Issue 40: mid-compile, the remedy (give it more than X; raise the size; or let every old pod
    go first, then prune) passed half the line's room and was cut in its middle, on what to do:
    "or let every old  ... Unavailable: replicas)". The what gives way instead."""
    users = tuple(User(pod=f"{POD}{n}", node="n", since=1.0, age=1.0) for n in range(5))
    kept = entry("aaaa", gen("0.11", vllm_rbln="0.11.2"), users=users, size_bytes=150 << 30)
    report = _report(entries=[kept], written=40 << 30, free_at_start=49 << 30)
    remedy = report.remedy()
    assert len(remedy) > MESSAGE_LIMIT // 2, "the long case: it needs more than half the line"
    line = report.error().one_line()
    assert remedy[:1].upper() + remedy[1:] in line, line
    assert "or let every old pod go first (rollingUpdate.maxUnavailable: replicas), then run" in line
    assert len(line) <= MESSAGE_LIMIT + MESSAGE_LIMIT // 2 + 4, len(line)


def test_a_full_volume_at_the_pre_upgrade_hook_says_what_works_before_any_pod_rolls() -> None:
    """Issue 40: Helm runs the hook before any Deployment changes, so "let every old pod go first"
    cannot work there. The hook's remedy: the size both generations need, as a number (what the
    volume holds now and this compile), a prune of what no pod uses, or warm.hook off."""
    users = (User(pod=f"{POD}0", node="n", since=1.0, age=1.0),)
    kept = entry("aaaa", gen("0.11", vllm_rbln="0.11.2"), users=users, size_bytes=150 << 30)
    report = dataclasses.replace(_report(entries=[kept]), hook=True)
    remedy = report.remedy()
    assert "maxUnavailable" not in remedy, remedy
    assert "let every old pod" not in remedy, remedy
    # 199 GiB used of 200 GiB, and 150 GiB to compile: 349 GiB.
    assert (
        "raise storage.compileCache.size to 349.0 GiB or more (what it holds now and this compile)" in remedy
    )
    assert "the pre-upgrade hook runs before any pod rolls" in remedy
    assert (
        "or set warm.hook=false (the Job then runs beside the rollout; once the old pods are gone " in remedy
    )
    assert "'cachemgr prune --incompatible --yes' frees theirs)" in remedy
    assert " ... " not in report.error().one_line()
    assert report.to_json()["hook"] is True
    # With something no pod uses, the prune that frees it now works at the hook too.
    unused = entry("bbbb", gen("0.10", vllm_rbln="0.10.0"), last_used_at=0.0, created_at=0.0)
    remedy = dataclasses.replace(_report(entries=[unused]), hook=True).remedy()
    assert "or run 'cachemgr prune --incompatible --yes' in a pod that mounts this volume" in remedy
    assert "or set warm.hook=false (the Job then runs beside the rollout)" in remedy


@pytest.mark.parametrize(
    "planted",
    ["[" * 100_000, "{" * 5000, '{"generation": [["compiler", 12]], "lineage": []}', '{"generation": 1}', 7, None,
     '{"generation": [["nonsense", "1"]], "lineage": ["a"]}', "x" * 100_000,
     '{"generation": [[["schema"], "1"]], "lineage": []}', '{"generation": [[{"a": 1}, "1"]], "lineage": []}'],
)  # fmt: skip
def test_a_planted_hint_of_what_key_json_says_is_refused_never_a_crash(planted: Any) -> None:
    assert KeyFacts.from_hint(planted) is None


def test_what_key_json_says_goes_to_the_hints_and_back() -> None:
    facts = _facts(gen("0.13", vllm_rbln="0.13.0", transformers="5.15.1"))
    assert KeyFacts.from_hint(facts.to_hint()) == facts


def test_explains_comparison_across_rules_is_linear_in_a_hostile_key_json() -> None:
    """A key.json is the volume's: any number of fields. Pairing the inputs two rules name
    differently (issue 40) must not be quadratic in them (explain would hang on a planted one)."""
    import time

    from cachemgr.ops.explain import _compare

    theirs = {"rules": "strict", **{f"serving.f{n}": n for n in range(20_000)}, "serving.model_impl": "vllm"}
    here = {"rules": "vllm-rbln 0.12.0", **{f"rbln.f{n}": n for n in range(20_000)}, "model_impl": "vllm"}
    started = time.monotonic()
    diffs, renamed = _compare(theirs, here)
    assert time.monotonic() - started < 60, "quadratic: 4e8 calls at this size, minutes at least"
    assert len(renamed) == 20_001
    assert [d.field for d in diffs] == ["rules"]
