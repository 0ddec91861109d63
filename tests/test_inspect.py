"""``ls``, ``show``, ``explain``, ``du``, ``verify``, ``prune``, ``locks`` on real cache trees.

The cache is built once per module by real ``cachemgr warm`` and ``run`` processes (two roles,
two compiler versions, three tensor-parallel sizes, one failed compile); each test works on its
own copy. Every command runs as a subprocess with its stdin closed, as in ``kubectl exec``
without ``-t``. "Cause mayhem" tests damage the copy the way disks and people do and check that
no command crashes and that damage shows.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import pty
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.podlib import DEADLINE, Cluster, cluster, free_port, npu_node, wait_for
from cachemgr_testkit.scenarios import MODEL, compile_cmd, entry_dirs, server_argv

from cachemgr.volume.manifest import read_manifest

LIST_FIELDS = {
    "key",
    "model",
    "role",
    "compiler",
    "npu",
    "size_bytes",
    "created_at",
    "last_used_at",
    "in_use",
    "status",
}


@dataclass(frozen=True)
class Built:
    """The module's cache, as built by real processes, and what is known of it."""

    root: Path
    work: Path
    env: dict[str, str]
    failed_key: str


def vllm(tp: int, *extra: str) -> list[str]:
    return ["vllm", "serve", MODEL, "--tensor-parallel-size", str(tp), "--port", str(free_port()), *extra]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    base = tmp_path_factory.mktemp("inspect")
    root = base / "volume"
    root.mkdir()
    with cluster(base / "work", STANDIN_COMPILE_SECONDS="0.1") as pods:
        # Warm Jobs on an NPU node: the optimum path (the stand-in's default) needs a device to compile.
        compile_only = {"VLLM_RBLN_COMPILE_ONLY": "1", **npu_node(pods.work)}
        jobs = [
            pods.start(f"warm-{role}-{tp}", vllm(tp), cache_root=root, command="warm", env={**compile_only, "CACHEMGR_ROLE": role})
            for role in ("prefill", "decode")
            for tp in (2, 4, 8)
        ]  # fmt: skip
        old = {**compile_only, "CACHEMGR_COMPILER_VERSION": "0.11.2"}
        jobs.append(pods.start("warm-old", vllm(4), cache_root=root, command="warm", env=old))
        record = pods.work / "compiler.jsonl"
        failing = ["--strategy", "command", "--compile-cmd", compile_cmd(record, extra="--fail-with 3")]
        jobs.append(pods.start("failing", server_argv(free_port()), cache_root=root, options=failing))
        codes = {job.name: job.wait_exit() for job in jobs}
        assert codes == {**{job.name: 0 for job in jobs}, "failing": 70}, [job.tail() for job in jobs]
        (failed,) = os.listdir(root / "failures")
        yield Built(root, pods.work, {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)}, failed)


@pytest.fixture
def cache(built: Built, tmp_path: Path) -> Built:
    """This test's own copy of the module's cache (modes and times kept)."""
    root = tmp_path / "volume"
    shutil.copytree(built.root, root, symlinks=True)
    return Built(root, built.work, {**built.env, "CACHEMGR_CACHE_ROOT": str(root)}, built.failed_key)


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[Cluster]:
    with cluster(tmp_path / "pods", STANDIN_COMPILE_SECONDS="0.1") as group:
        yield group


def cli(*args: str, env: dict[str, str], stdin: Any = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    """``cachemgr ARGS`` with no terminal (stdin closed), as podlib.run_cli, never a prompt."""
    done = subprocess.run(
        [sys.executable, "-m", "cachemgr", *args],
        env=env,
        stdin=stdin,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    assert done.returncode != 70, f"cachemgr {' '.join(args)} crashed:\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    return done


def cli_json(*args: str, env: dict[str, str], code: int = 0) -> Any:
    """``-o json`` goes before the server argv's ``--``, as an operator types it."""
    cut = args.index("--") if "--" in args else len(args)
    done = cli(*args[:cut], "-o", "json", *args[cut:], env=env)
    assert done.returncode == code, done.stderr
    return json.loads(done.stdout)


def epoch(text: str) -> float:
    """An RFC 3339 time of -o json (``2026-12-01T18:08:52.299151Z``) in seconds since the epoch."""
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def keyed(root: Path) -> dict[tuple[str, str, int], Path]:
    """Entry directories keyed by (role, compiler, tensor_parallel_size), from their key.json."""
    found = {}
    for entry in entry_dirs(root):
        inputs = json.loads((entry / "key.json").read_text())["inputs"]
        found[(inputs["role"], inputs["compiler"], inputs["serving"]["tensor_parallel_size"])] = entry
    return found


def _shared(a: str, b: str) -> str:
    count = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return a[:count]


def tree_bytes(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def writable(path: Path) -> Path:
    path.chmod(0o644)
    return path


# --- ls -------------------------------------------------------------------------------------


def test_ls_lists_entries_with_the_contract_fields_and_marks_other_compilers_incompatible(
    cache: Built,
) -> None:
    listing = cli_json("ls", env=cache.env)
    # kubectl's envelope (docs/design.md, the interface contract): a list's items under "items".
    assert (listing["apiVersion"], listing["kind"]) == ("cachemgr/v1", "EntryList"), listing.keys()
    rows = listing["items"]
    entries = [r for r in rows if r["kind"] == "entry"]
    assert len(entries) == 7
    for row in entries:
        assert row.keys() >= LIST_FIELDS
        assert row["size_bytes"] > 0
        assert row["model"] == MODEL
        # RFC 3339 in UTC, as kubectl prints times, not epoch floats
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", row["created_at"]), row["created_at"]
        assert abs(epoch(row["created_at"]) - time.time()) < 3600
        assert row["in_use"] is False
    by_status = {(r["role"], r["compiler"]): r["status"] for r in entries}
    assert by_status[("prefill", "0.11")] == "incompatible"
    assert {s for (_, c), s in by_status.items() if c == "0.12"} == {"published"}, "ls checks no file"
    assert {r["role"] for r in entries} == {"prefill", "decode"}
    (failure,) = [r for r in rows if r["kind"] == "failure"]
    assert failure["key"] == cache.failed_key
    assert failure["status"] == "failed"
    assert failure["failures"] == 1
    assert failure.keys() >= LIST_FIELDS

    table = cli("ls", env=cache.env)
    assert table.returncode == 0
    header = table.stdout.splitlines()[0].split()
    assert header[:5] == ["KEY", "MODEL", "COMPILER", "NPU", "SIZE"]
    assert cli("ls", "-o", "wide", env=cache.env).stdout.split()[:4] == ["KEY", "MODEL", "ROLE", "COMPILER"]
    assert "incompatible" in table.stdout
    assert "cachemgr prune --incompatible" in table.stdout
    assert "FAILED COMPILES" in table.stdout


def test_ls_without_this_images_compiler_or_npu_judges_nothing_and_says_what_to_set(cache: Built) -> None:
    env = {k: v for k, v in cache.env.items() if k not in {"CACHEMGR_COMPILER_VERSION", "CACHEMGR_NPU_TYPE"}}
    env.pop("RBLN_FORCE_NPU_NAME", None)
    done = cli("ls", "-o", "json", env=env)
    assert done.returncode == 0
    assert {r["status"] for r in json.loads(done.stdout)["items"] if r["kind"] == "entry"} == {"published"}
    assert "CACHEMGR_COMPILER_VERSION" in done.stderr
    assert "CACHEMGR_NPU_TYPE" in done.stderr


def snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``root`` with its mtime, size and mode: any write changes one of them."""
    found = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        found[str(path.relative_to(root))] = (st.st_mtime_ns, st.st_size, st.st_mode)
    return found


def test_inspection_never_writes_to_the_volume(cache: Built) -> None:
    before = snapshot(cache.root)
    digest = read_manifest(keyed(cache.root)[("prefill", "0.12", 4)]).key
    for args in (
        ["ls"], ["ls", "-o", "json"], ["du"], ["du", "-o", "json"], ["locks"], ["verify"],
        ["show", digest[:8]], ["show", cache.failed_key[:8]],
        ["prune", "--unused-for", "0s", "--incompatible", "--stale-staging", "--damaged", "--dry-run"],
        ["explain", "--", *vllm(4)], miss := ["explain", "--", *vllm(16)],
    ):  # fmt: skip
        # explain exits 1 on a miss (docs/reference.md), as diff does
        assert cli(*args, env=cache.env).returncode == (1 if args is miss else 0), args
    assert snapshot(cache.root) == before, "inspection needs no write access: it writes nothing"


# --- show -----------------------------------------------------------------------------------


def test_show_by_prefix_or_name_gives_inputs_manifest_and_users(cache: Built) -> None:
    entry = keyed(cache.root)[("decode", "0.12", 8)]
    digest = read_manifest(entry).key
    by_prefix = cli_json("show", digest[:6], env=cache.env)
    by_name = cli_json("show", entry.name, env=cache.env)
    assert by_prefix == by_name
    assert by_prefix["key"] == digest
    assert by_prefix["inputs"]["serving"] == {"tensor_parallel_size": 8}
    assert by_prefix["inputs"]["role"] == "decode"
    assert by_prefix["sources"]["compiler"] == "CACHEMGR_COMPILER_VERSION"
    assert by_prefix["manifest"]["files"] >= 3
    assert by_prefix["check"] == []
    assert by_prefix["users"] == []
    text = cli("show", digest[:6], env=cache.env).stdout
    assert "serving.tensor_parallel_size  8" in text
    assert "status       ok: every file's size and mtime match the manifest" in text


def test_show_of_a_key_that_only_failed_gives_the_compilers_last_lines(cache: Built) -> None:
    detail = cli_json("show", cache.failed_key[:10], env=cache.env)
    assert detail["published"] is False
    (failure,) = detail["failures"]
    assert failure["exit_status"] == 3
    assert any("fail" in line for line in failure["output_tail"])
    text = cli("show", cache.failed_key[:10], env=cache.env).stdout
    assert "not published" in text
    assert "| [standin] error: compilation failed" in text


def test_show_refuses_unknown_and_ambiguous_keys(cache: Built) -> None:
    keys = sorted(read_manifest(e).key for e in entry_dirs(cache.root))
    # The longest prefix two keys share (maybe empty): it matches both, or everything.
    common = max((_shared(a, b) for a, b in itertools.pairwise(keys)), key=len)
    unknown = cli("show", "ffffffffffffffffff", env=cache.env)
    assert unknown.returncode == 66, "not found has its own code"
    assert "cachemgr ls" in unknown.stderr
    ambiguous = cli("show", common, env=cache.env)
    assert ambiguous.returncode == 64
    assert ("matches" in ambiguous.stderr) or ("empty" in ambiguous.stderr)


def test_an_ambiguous_key_lists_candidates_an_operator_can_tell_apart(cache: Built) -> None:
    """A folder planted with an entry's name but 15 of the key's digits and a newline (the records'
    grammar, hostile): ``show`` of the key's 12 digits is ambiguous (64), and the candidates were
    listed as "b9657c6a7a85, b9657c6a7a85" (seed 7171 trial 86). Each is now shown whole where
    their 12 digits agree, escaped, with its entry's name."""
    entry = entry_dirs(cache.root)[0]
    digest = read_manifest(entry).key
    planted = entry.with_name(entry.name.rsplit("__", 1)[0] + "__" + digest[:15] + "\n")
    planted.mkdir()
    done = cli("show", digest[:12], env=cache.env)
    assert done.returncode == 64, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "matches 2 keys" in line]
    assert digest in line, "the real key, whole: the planted one shares its first 12 digits"
    assert f"(entry {entry.name})" in line
    assert "\\n" in line, "the planted name's newline, escaped"
    assert cli("show", digest, env=cache.env).returncode == 0, (
        "the whole key, as the remedy says, is not ambiguous"
    )


def test_show_of_a_damaged_entry_says_what_to_do_and_then_where_the_entry_went(cache: Built) -> None:
    """An operator who deleted or truncated a file of an entry reads ``show``: it names the command
    that moves the entry aside, which works as printed; ``show`` of the key afterwards says where
    it went (quarantine/, which ``ls`` lists) rather than that nothing matches."""
    entry = keyed(cache.root)[("prefill", "0.12", 2)]
    digest = read_manifest(entry).key
    artifact = next(p for p in sorted((entry / "artifacts").rglob("*.rbln")))
    artifact.unlink()
    shown = cli("show", digest[:8], env=cache.env)
    assert shown.returncode == 0, shown.stderr
    assert "status       damaged: 1 of the manifest's " in shown.stdout
    (todo,) = [line for line in shown.stdout.splitlines() if line.startswith("what to do:")]
    command = todo.split("'")[1]
    assert command == f"cachemgr verify --fix {digest[:12]}"
    fixed = cli(*command.split()[1:], env=cache.env)
    assert fixed.returncode == 74, fixed.stderr
    assert not entry.exists()

    gone = cli("show", digest[:8], "-o", "json", env=cache.env)
    assert gone.returncode == 66
    (event,) = [json.loads(line) for line in gone.stderr.splitlines()]
    line = event["message"]
    (moved,) = [r for r in cli_json("ls", env=cache.env)["items"] if r["kind"] == "quarantine"]
    assert f"moved aside to quarantine/{moved['entry']}" in line
    assert "missing" in line, "the reason it was moved"
    assert "'cachemgr prune --damaged --yes'" in line
    by_name = json.loads(cli("show", entry.name, "-o", "json", env=cache.env).stderr)["message"]
    assert by_name == line.replace(repr(digest[:8]), repr(entry.name))
    assert cli("prune", "--damaged", "--yes", env=cache.env).returncode == 0
    assert "quarantine/" not in cli("show", digest[:8], env=cache.env).stderr


def test_show_of_a_half_copied_entry_claims_nothing_it_cannot_know(cache: Built) -> None:
    """Issue 34: an entry copied in part (no manifest, no summary) was "damaged: 1 of the manifest's
    files fail", "820.6 KiB in 0 files", "created 0s ago by pod ?": no manifest says any of that."""
    entry = keyed(cache.root)[("prefill", "0.12", 2)]
    digest = read_manifest(entry).key
    os.chmod(entry, 0o755)
    (entry / "manifest.json").unlink()
    (entry / "summary.json").unlink()
    shown = cli("show", digest[:8], env=cache.env)
    assert shown.returncode == 0, shown.stderr
    pairs: dict[str, str] = {}
    name = ""
    for line in shown.stdout.split("\n\n", 1)[0].splitlines():  # a long value goes on under itself
        if line[:1] == " ":
            pairs[name] += " " + line.strip()
        else:
            name = line[:12].strip()
            pairs[name] = line[13:]
    assert (
        pairs["status"]
        == "damaged: manifest.json is missing: the entry was never committed; no file of it can be checked"
    )
    assert "0 files" not in pairs["size"], pairs["size"]
    assert pairs["created"].startswith("unknown: its manifest, which records it, cannot be read"), pairs
    assert "?" not in pairs["created"] + pairs["compiled in"], pairs
    assert "FILES CHECK" not in shown.stdout, "there is no manifest to check files against"
    doc = cli_json("show", digest[:8], env=cache.env)
    assert (doc["status"], doc["created_at"], doc["manifest"]) == ("damaged", None, None)
    # One file of a committed entry gone: the count is of the manifest's files, in agreement.
    other = keyed(cache.root)[("prefill", "0.12", 4)]
    next(p for p in sorted((other / "artifacts").rglob("*.rbln"))).unlink()
    shown = cli("show", read_manifest(other).key[:8], env=cache.env)
    total = len(read_manifest(other).files)
    assert (
        f"status       damaged: 1 of the manifest's {total} files fails the size and mtime check"
        in shown.stdout
    )


def test_prune_key_of_a_key_that_only_failed_names_show_with_that_key(cache: Built) -> None:
    refused = cli("prune", "--key", cache.failed_key[:10], "--yes", "--log-format", "console", env=cache.env)
    assert refused.returncode == 66
    (line,) = refused.stderr.splitlines()
    command = f"cachemgr show {cache.failed_key[:12]}"
    assert f"'{command}' says what is recorded of this key" in line, line
    shown = cli(*command.split()[1:], env=cache.env)
    assert shown.returncode == 0
    assert "FAILED COMPILES (1)" in shown.stdout


def test_inspecting_a_directory_no_pod_used_says_it_may_be_the_wrong_path(
    cache: Built, tmp_path: Path
) -> None:
    """ "no entries" of a directory that is not the volume (the PVC mounted elsewhere) read as an
    empty cache: the inspection commands now say the layout marker is missing and what to set."""
    elsewhere = tmp_path / "not-the-volume"
    elsewhere.mkdir()
    env = {**cache.env, "CACHEMGR_CACHE_ROOT": str(elsewhere)}
    for command in (["ls"], ["du"], ["locks"], ["stats"], ["verify"]):
        done = cli(*command, env=env)
        assert done.returncode == 0, done.stderr
        said = re.sub(r"\n  ", " ", done.stderr)  # a note wider than 80 columns continues two in
        (note,) = [line for line in said.splitlines() if "cachemgr-layout.json" in line]
        assert note.startswith(f"note: {elsewhere} has no cachemgr-layout.json"), note
        assert "set CACHEMGR_CACHE_ROOT (or --cache-root) to where the PVC is mounted" in note
    assert os.listdir(elsewhere) == [], "inspection never creates the layout"
    assert "cachemgr-layout.json" not in cli("ls", env=cache.env).stderr, "a used volume: no note"


# --- explain --------------------------------------------------------------------------------


def test_explain_a_hit(cache: Built) -> None:
    result = cli_json("explain", "--", *vllm(8), env=cache.env)
    assert result["result"] == "hit"
    assert result["found"]["entry"] == keyed(cache.root)[("prefill", "0.12", 8)].name


def test_explain_a_new_tensor_parallel_size_names_the_field_and_both_values(cache: Built) -> None:
    result = cli_json("explain", "--", *vllm(16), env=cache.env, code=1)
    assert result["result"] == "miss"
    nearest = result["nearest"]
    assert [len(n["differences"]) for n in nearest] == [1, 1, 1]
    assert {n["role"] for n in nearest} == {"prefill"}
    assert {(d["field"], d["here"]) for n in nearest for d in n["differences"]} == {
        ("serving.tensor_parallel_size", 16)
    }
    text = cli("explain", "--", *vllm(16), env=cache.env).stdout
    assert "serving.tensor_parallel_size 8 -> 16" in text
    assert "--tensor-parallel-size" in text


def test_explain_an_image_upgrade_says_compiler_and_to_prune_the_old_entries(cache: Built) -> None:
    env = {**cache.env, "CACHEMGR_COMPILER_VERSION": "0.13.1"}
    result = cli_json("explain", "--", *vllm(4), env=env, code=1)
    assert result["result"] == "miss"
    first = result["nearest"][0]
    assert first["differences"] == [{"field": "compiler", "entry": first["compiler"], "here": "0.13"}]
    text = cli("explain", "--", *vllm(4), env=env).stdout
    assert f"compiler {first['compiler']} -> 0.13" in text
    assert "cachemgr prune --incompatible" in text


def test_explain_a_role_never_compiled_here_and_an_environment_change(cache: Built) -> None:
    embed = cli("explain", "--", *vllm(4), env={**cache.env, "CACHEMGR_ROLE": "embed"})
    assert "nothing compiled yet for role embed" in embed.stdout
    assert "decode, prefill" in embed.stdout
    result = cli_json(
        "explain", "--", *vllm(4), env={**cache.env, "VLLM_RBLN_NUM_HIDDEN_LAYERS": "2"}, code=1
    )
    assert result["nearest"][0]["differences"] == [
        {"field": "env.VLLM_RBLN_NUM_HIDDEN_LAYERS", "entry": None, "here": 2}
    ]
    # a variable vllm-rbln 0.12 never reads is not in the key: still a hit
    assert (
        cli_json("explain", "--", *vllm(4), env={**cache.env, "VLLM_RBLN_KVCACHE_DTYPE": "fp8"})["result"]
        == "hit"
    )


# --- du -------------------------------------------------------------------------------------


def test_du_adds_up(cache: Built) -> None:
    usage = cli_json("du", env=cache.env)
    rows = cli_json("ls", env=cache.env)["items"]
    sizes = [r["size_bytes"] for r in rows if r["kind"] == "entry"]
    assert usage["entries_bytes"] == sum(sizes)
    assert (
        usage["cache_bytes"]
        == usage["entries_bytes"]
        + usage["staging_bytes"]
        + usage["quarantine_bytes"]
        + usage["trash_bytes"]
        + usage["failures_bytes"]
    )
    assert usage["failures_bytes"] > 0, "the failed warm Job's record is counted"
    assert {c["compiler"]: c["entries"] for c in usage["by_compiler"]} == {"0.11": 1, "0.12": 6}
    (old,) = [r["size_bytes"] for r in rows if r["kind"] == "entry" and r["status"] == "incompatible"]
    assert usage["prunable"]["incompatible"] == {"flag": "--incompatible", "items": 1, "bytes": old}
    assert 0 < usage["free_bytes"] <= usage["total_bytes"]
    assert usage["used_bytes"] <= usage["total_bytes"]
    text = cli("du", env=cache.env).stdout
    for label in (
        "free",
        "BY GENERATION",
        "BY ENTRY",
        "PRUNE COULD FREE NOW",
        "cachemgr prune --incompatible",
    ):
        assert label in text


# --- verify ---------------------------------------------------------------------------------


def test_verify_finds_flipped_bytes_that_ls_cannot_see_and_fix_moves_only_that_entry(cache: Built) -> None:
    assert cli("verify", env=cache.env).returncode == 0
    victim = keyed(cache.root)[("decode", "0.12", 4)]
    healthy = {e.name: tree_bytes(e) for e in entry_dirs(cache.root) if e != victim}
    artifact = next(p for p in sorted((victim / "artifacts").rglob("*.rbln")))
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0xFF
    writable(artifact).write_bytes(bytes(data))

    assert {r["status"] for r in cli_json("ls", env=cache.env)["items"] if r["kind"] == "entry"} <= {
        "published",
        "incompatible",
    }
    found = cli("verify", env=cache.env)
    assert found.returncode == 74
    assert victim.name in found.stdout
    assert "xxh3" in found.stdout
    assert "verify --fix" in found.stderr

    fixed = cli("verify", "--fix", "-o", "json", env=cache.env)
    assert fixed.returncode == 74, "damage was found: worth an alert even once moved aside"
    report = json.loads(fixed.stdout)
    assert [i["entry"] for i in report["items"] if i["moved_to"]] == [victim.name]
    assert not victim.exists()
    assert {e.name: tree_bytes(e) for e in entry_dirs(cache.root)} == healthy
    assert cli("verify", env=cache.env).returncode == 0
    (moved,) = [r for r in cli_json("ls", env=cache.env)["items"] if r["kind"] == "quarantine"]
    assert moved["entry"].startswith(victim.name)


def test_verify_by_key_checks_only_those(cache: Built) -> None:
    entry = keyed(cache.root)[("prefill", "0.12", 2)]
    report = cli_json("verify", read_manifest(entry).key[:8], env=cache.env)
    assert [i["entry"] for i in report["items"]] == [entry.name]
    assert cli("verify", "0000000000000", env=cache.env).returncode == 66


def test_verify_of_one_damaged_entry_counts_it_in_the_singular(cache: Built) -> None:
    """Issue 34: "found damage in 1 of 1 entries checked"."""
    entry = keyed(cache.root)[("prefill", "0.12", 2)]
    artifact = next(p for p in sorted((entry / "artifacts").rglob("*.rbln")))
    writable(artifact).write_bytes(b"")
    found = cli("verify", read_manifest(entry).key[:8], env=cache.env)
    assert found.returncode == 74, found.stderr
    assert "found damage in 1 of 1 entry checked" in found.stderr, found.stderr


def test_verify_warns_of_files_written_into_a_published_entry_without_failing(cache: Built) -> None:
    entry = keyed(cache.root)[("prefill", "0.12", 2)]
    nested = entry / "artifacts" / "written-later"
    os.chmod(entry / "artifacts", 0o755)
    nested.mkdir()
    (nested / "server.log").write_text("a server wrote here")
    found = cli("verify", read_manifest(entry).key[:8], env=cache.env)
    assert found.returncode == 0, found.stderr
    assert "artifacts/written-later/server.log: not in the manifest" in found.stderr


def test_a_slow_volume_is_scanned_with_threads_to_the_same_result(
    cache: Built, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where reading entries one by one is slow (a network filesystem), the rest are read by threads."""
    from cachemgr.ops import scan as scanning
    from cachemgr.volume.layout import open_root

    root = open_root(cache.root, create=False)
    damage(cache.root)  # damaged entries too: they take the other path through _entry_info
    one_by_one = scanning.scan(root)
    monkeypatch.setattr(scanning, "_PROBE_ENTRIES", 1)
    monkeypatch.setattr(scanning, "_SLOW_ENTRY_SECONDS", 0.0)  # every volume counts as slow
    started = threading.active_count()
    threaded = scanning.scan(root)

    def comparable(found: scanning.Scan) -> list[dict[str, object]]:
        return [{**e.to_json(), "users": [u.pod for u in e.users]} for e in found.entries]

    assert len(one_by_one.entries) > 2
    assert comparable(threaded) == comparable(one_by_one)
    assert threaded.warnings == one_by_one.warnings
    assert threading.active_count() == started, "the pool's threads are gone"


# --- cause mayhem ---------------------------------------------------------------------------


def damage(root: Path) -> dict[str, str]:
    """Break six entries six ways and litter the other places; returns entry name -> what."""
    entries = keyed(root)
    healthy = entries.pop(("prefill", "0.12", 4))
    plan = dict(
        zip(
            sorted(entries),
            ["truncate", "flip", "no-manifest", "junk-manifest", "junk-summary", "junk-key"],
            strict=False,
        )
    )
    done = {}
    for spot, what in plan.items():
        entry = entries[spot]
        artifact = next(iter(sorted((entry / "artifacts").rglob("*.rbln"))))
        if what == "truncate":
            with writable(artifact).open("r+b") as handle:
                handle.truncate(artifact.stat().st_size // 3)
        elif what == "flip":
            data = bytearray(artifact.read_bytes())
            data[7] ^= 0x01
            writable(artifact).write_bytes(bytes(data))
        elif what == "no-manifest":
            (entry / "manifest.json").unlink()
        elif what == "junk-manifest":
            writable(entry / "manifest.json").write_bytes(
                b'{"format": 1, "files": [{"path": "../../etc/passwd"'
            )
        elif what == "junk-summary":
            writable(entry / "summary.json").write_bytes(b"\x00\xff not json")
        else:
            writable(entry / "key.json").write_text(
                '{"inputs": [1], "sources": [2], "dropped_runtime_flags": 3}'
            )
        done[entry.name] = what
    done[healthy.name] = "healthy"
    # Half-written staging: an attempt without its owner record, and one with junk everywhere.
    half = root / "staging" / ("a" * 32) / "gone-pod.1.abcd"
    (half / "artifacts").mkdir(parents=True)
    (half / "artifacts" / "graph_000.rbln").write_bytes(b"\0" * 1000)
    junk = root / "staging" / ("b" * 32) / "junk-pod.2.ef01"
    junk.mkdir(parents=True)
    (junk / "key.json").write_text("{not json")
    junk.with_name(junk.name + ".json").write_text("[]")
    old = time.time() - 3600
    os.utime(junk.with_name(junk.name + ".json"), (old, old))  # its pod stopped refreshing an hour ago
    # A stale lease marker with a junk holder record, a junk failure record, junk use records.
    (root / "leases" / ("c" * 32 + ".lock")).write_text(
        "filelock/2\npid=notanumber\nhost=node-x\nduration=abc\n"
    )
    (root / "leases" / ("c" * 32 + ".holder.json")).write_text('"just a string"')
    os.utime(root / "leases" / ("c" * 32 + ".lock"), (old, old))
    (root / "failures" / ("d" * 32)).mkdir()
    (root / "failures" / ("d" * 32) / "x.json").write_text("{")
    (root / "failures" / ("e" * 32)).mkdir()
    wrong = {"time": "yesterday", "output_tail": 5, "entry": 7, "pod": None, "exit_code": [1]}
    (root / "failures" / ("e" * 32) / "y.json").write_text(json.dumps(wrong))
    usage = root / "usage" / read_manifest(healthy).key
    (usage / "pod-x.1.json").write_text("garbage")
    (root / "entries" / "stray-file").write_text("not an entry")
    (root / "quarantine" / "odd.reason.json").write_text("][")
    return done


def test_mayhem_no_command_crashes_and_damage_shows(cache: Built) -> None:
    damaged = damage(cache.root)
    healthy = next(name for name, what in damaged.items() if what == "healthy")
    env = cache.env

    rows = cli("ls", "-o", "json", env=env)
    assert rows.returncode == 0
    status = {r["entry"]: r["status"] for r in json.loads(rows.stdout)["items"] if r["kind"] == "entry"}
    by_what = {what: status[name] for name, what in damaged.items()}
    assert by_what["no-manifest"] == "damaged"
    assert by_what["junk-summary"] == "damaged"
    assert by_what["healthy"] == "published"
    assert "summary.json" in rows.stderr
    assert "manifest.json" in rows.stderr
    staging = [r for r in json.loads(rows.stdout)["items"] if r["kind"] == "staging"]
    assert {r["status"] for r in staging} == {"stale"}

    for args in (["ls"], ["du"], ["du", "-o", "json"], ["locks"], ["locks", "-o", "json"]):
        assert cli(*args, env=env).returncode == 0, args
    for name in damaged:
        assert cli("show", name, env=env).returncode == 0, name
    assert cli("show", "c" * 12, env=env).returncode == 0
    assert cli("show", "d" * 12, env=env).returncode == 0
    assert cli("show", "e" * 12, env=env).returncode == 0
    assert cli("explain", "--", *vllm(4), env=env).returncode in {0, 1}
    assert cli("explain", "--", *vllm(32), env=env).returncode == 1
    locks = cli_json("locks", env=env)["items"]
    assert [(lock["key"], lock["stale"]) for lock in locks] == [("c" * 32, True)]

    report = cli("verify", "-o", "json", env=env)
    assert report.returncode == 74
    verdict = {i["entry"]: i["status"] for i in json.loads(report.stdout)["items"]}
    assert {name for name, s in verdict.items() if s == "damaged"} == set(damaged) - {healthy}
    assert verdict[healthy] == "ok"

    before = tree_bytes(cache.root / "entries" / healthy)
    plan = cli(
        "prune", "--damaged", "--stale-staging", "--incompatible", "--unused-for", "0s", "--dry-run", env=env
    )
    assert plan.returncode == 0
    assert cli("verify", "--fix", env=env).returncode == 74
    assert sorted(p.name for p in entry_dirs(cache.root)) == [healthy]
    assert tree_bytes(cache.root / "entries" / healthy) == before
    assert cli("verify", env=env).returncode == 0
    moved = {r["entry"].split(".")[0] for r in cli_json("ls", env=env)["items"] if r["kind"] == "quarantine"}
    assert moved >= {name.split(".")[0] for name in damaged if name != healthy}


# --- prune ----------------------------------------------------------------------------------


def test_prune_refuses_without_a_selector_or_a_terminal_and_dry_run_removes_nothing(cache: Built) -> None:
    before = sorted(p.name for p in entry_dirs(cache.root))
    assert cli("prune", env=cache.env).returncode == 64
    asked = cli("prune", "--unused-for", "0s", env=cache.env)
    assert asked.returncode == 64
    assert "--yes" in asked.stderr
    assert "--dry-run" in asked.stderr
    assert "plan: 7 items" in asked.stdout
    dry = cli("prune", "--unused-for", "0s", "--dry-run", "-o", "json", env=cache.env)
    assert dry.returncode == 0
    assert len(json.loads(dry.stdout)["plan"]["items"]) == 7
    assert sorted(p.name for p in entry_dirs(cache.root)) == before


def test_prune_incompatible_needs_this_images_compiler_and_npu(cache: Built) -> None:
    env = {k: v for k, v in cache.env.items() if k != "CACHEMGR_COMPILER_VERSION"}
    done = cli("prune", "--incompatible", "--yes", env=env)
    assert done.returncode == 78
    assert "CACHEMGR_COMPILER_VERSION" in done.stderr
    assert len(done.stderr.strip().splitlines()) <= 2  # the one line (and its JSON log twin)

    result = cli_json("prune", "--incompatible", "--yes", env=cache.env)
    assert [i["reason"].split(":")[0] for i in result["result"]["removed"]] == ["incompatible"]
    assert {k[1] for k in keyed(cache.root)} == {"0.12"}


def test_prune_never_removes_an_entry_in_use(cache: Built, pods: Cluster) -> None:
    pod = pods.start("serving", vllm(4), cache_root=cache.root)
    pod.wait_phase("serving")
    entry = keyed(cache.root)[("prefill", "0.12", 4)]
    result = cli_json("prune", "--unused-for", "0s", "--keep-bytes", "0", "--yes", env=cache.env)
    assert [p.name for p in entry_dirs(cache.root)] == [entry.name]
    assert any(k["name"] == entry.name and "serving" in k["reason"] for k in result["plan"]["kept"])
    rows = cli_json("ls", env=cache.env)["items"]
    (row,) = [r for r in rows if r["kind"] == "entry"]
    assert row["in_use"] is True
    assert [u["pod"] for u in row["users"]] == ["serving"]
    stopping = time.time()
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0
    (row,) = [r for r in cli_json("ls", env=cache.env)["items"] if r["kind"] == "entry"]
    assert row["in_use"] is False
    assert epoch(row["last_used_at"]) >= stopping - 1, (
        "last used is when its last pod stopped, not when it started"
    )


def test_prune_asks_on_a_terminal(cache: Built) -> None:
    def ask(answer: bytes) -> int:
        leader, follower = pty.openpty()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "cachemgr", "prune", "--incompatible"],
                env=cache.env, stdin=follower, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            os.write(leader, answer)
            proc.communicate(timeout=DEADLINE)
            return proc.returncode
        finally:
            os.close(leader)
            os.close(follower)

    assert ask(b"n\n") == 0
    assert ("prefill", "0.11", 4) in keyed(cache.root)
    assert ask(b"y\n") == 0
    assert ("prefill", "0.11", 4) not in keyed(cache.root)


# --- compiling and leases -------------------------------------------------------------------


def test_a_compile_in_progress_shows_in_ls_locks_show_and_explain_then_goes_stale(
    cache: Built, pods: Cluster
) -> None:
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=60)]
    pod = pods.start(
        "compiler-pod", server_argv(free_port()), cache_root=cache.root, options=options, node="node-b"
    )
    pod.wait_phase("compiling")
    wait_for(record.exists, what="the compiler to start")

    (attempt,) = [r for r in cli_json("ls", env=cache.env)["items"] if r["kind"] == "staging"]
    assert attempt["status"] == "compiling"
    assert attempt["pod"] == "compiler-pod"
    assert attempt["in_use"] is True
    (lock,) = cli_json("locks", env=cache.env)["items"]
    assert (lock["key"], lock["pod"], lock["node"], lock["stale"]) == (
        attempt["key"],
        "compiler-pod",
        "node-b",
        False,
    )
    shown = cli("show", attempt["key"][:8], env=cache.env).stdout
    assert "held by pod compiler-pod on node node-b" in shown
    explained = cli_json("explain", *options, "--", *server_argv(free_port()), env=cache.env, code=1)
    assert explained["result"] == "miss"
    assert explained["compiling"]["pod"] == "compiler-pod"
    planned = cli_json("prune", "--stale-staging", "--dry-run", env=cache.env)
    assert planned["plan"]["items"] == [], "a live attempt is never stale"

    pod.signal_pod(signal.SIGKILL)
    pod.wait_exit()
    marker = cache.root / "leases" / f"{attempt['key']}.lock"
    old = time.time() - 600
    os.utime(marker, (old, old))  # as a pod on another node that died ten minutes ago
    for owner in (cache.root / "staging").glob("*/*.json"):
        os.utime(owner, (old, old))
    (lock,) = cli_json("locks", env=cache.env)["items"]
    assert lock["stale"] is True
    assert "expired" in cli("locks", env=cache.env).stdout
    (attempt,) = [r for r in cli_json("ls", env=cache.env)["items"] if r["kind"] == "staging"]
    assert attempt["status"] == "stale", "another node's pid says nothing here: silent for 10m"
    pruned = cli_json("prune", "--stale-staging", "--yes", env=cache.env)
    assert [i["kind"] for i in pruned["result"]["removed"]] == ["staging"]
    leftovers = sorted(p.name for p in (cache.root / "leases").iterdir())
    assert leftovers == [], "the dead attempt's lease (marker, holder, progress records) goes with it"
    assert cli_json("locks", env=cache.env)["items"] == []
    assert not list((cache.root / "staging").rglob("*.rbln"))


def test_an_attempt_of_a_pod_that_died_on_this_host_is_dead_at_once(cache: Built, pods: Cluster) -> None:
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=60)]
    pod = pods.start("local-pod", server_argv(free_port()), cache_root=cache.root, options=options)
    pod.wait_phase("compiling")
    pod.signal_pod(signal.SIGKILL)
    pod.wait_exit()
    (attempt,) = [r for r in cli_json("ls", env=cache.env)["items"] if r["kind"] == "staging"]
    assert attempt["status"] == "dead", "same host, pid gone: dead, whatever its heartbeat says"
    pruned = cli_json("prune", "--stale-staging", "--yes", env=cache.env)
    assert [i["kind"] for i in pruned["result"]["removed"]] == ["staging"], pruned
    assert not any((cache.root / "staging").glob("*/*"))


def test_locks_with_no_lease(cache: Built) -> None:
    assert cli("locks", env=cache.env).stdout.strip() == "no leases held"
    assert cli_json("locks", env=cache.env)["items"] == []


def test_a_missing_volume_is_a_clear_error(cache: Built, tmp_path: Path) -> None:
    env = {**cache.env, "CACHEMGR_CACHE_ROOT": str(tmp_path / "not-mounted")}
    for args in (["ls"], ["du"], ["verify"], ["locks"]):
        done = cli(*args, env=env)
        assert done.returncode == 74
        assert "does not exist" in done.stderr
