"""What an operator sees (issue 24, and issue 26 item 8): every word of every human output.

A real cache is built once by real ``cachemgr warm`` and ``run`` processes, with the names a
cluster really has (a MiniMax model, ReplicaSet pod names); each test works on its own copy.
Commands run as subprocesses, with no terminal unless a test gives them a pseudo-terminal:

* what the volume holds reaches the terminal escaped, in every human output, whatever field a
  hostile writer plants ANSI escapes and newlines in;
* every table fits 80 columns where there is no terminal (and COLUMNS says 80);
* an error is one line, with one prefix, once per stream: the JSON event in a pod's log, the
  plain line on a terminal; not-found has its own exit code (66);
* prune prints its plan, then its progress, then what it did; warm ends with a one-line summary.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit import terminal
from cachemgr_testkit.podlib import DEADLINE, Cluster, cluster, free_port, npu_node, wait_for
from cachemgr_testkit.scenarios import compile_cmd, entry_dirs, server_argv

MODEL = "MiniMaxAI/MiniMax-M2.7"
POD = "modelserver-prefill-7d9c6b5f48-x7kqp"
NODE = "npu-node-12.cluster.example.com"
ESC = "\x1b"


@dataclass(frozen=True)
class Built:
    root: Path
    work: Path
    env: dict[str, str]
    failed_key: str


def vllm(tp: int, *extra: str) -> list[str]:
    return ["vllm", "serve", MODEL, "--tensor-parallel-size", str(tp), "--port", str(free_port()), *extra]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    base = tmp_path_factory.mktemp("console")
    root = base / "volume"
    root.mkdir()
    with cluster(base / "work", STANDIN_COMPILE_SECONDS="0.1") as pods:
        compile_only = {"VLLM_RBLN_COMPILE_ONLY": "1", **npu_node(pods.work)}
        jobs = [
            pods.start(f"modelserver-warm-prefill-tp{tp}-5rj9w", vllm(tp), cache_root=root, command="warm", env=compile_only, node=NODE)
            for tp in (4, 8)
        ]  # fmt: skip
        old = {**compile_only, "CACHEMGR_COMPILER_VERSION": "0.11.2"}
        jobs.append(
            pods.start("modelserver-warm-old-8k2qz", vllm(8), cache_root=root, command="warm", env=old)
        )
        record = pods.work / "compiler.jsonl"
        failing = ["--strategy", "command", "--compile-cmd", compile_cmd(record, extra="--fail-with 3")]
        jobs.append(pods.start(POD, server_argv(free_port()), cache_root=root, options=failing, node=NODE))
        codes = {job.name: job.wait_exit() for job in jobs}
        assert sorted(codes.values()) == [0, 0, 0, 70], [job.tail() for job in jobs]
        (failed,) = os.listdir(root / "failures")
        yield Built(root, pods.work, {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)}, failed)


@pytest.fixture
def cache(built: Built, tmp_path: Path) -> Built:
    root = tmp_path / "volume"
    shutil.copytree(built.root, root, symlinks=True)
    env = {k: v for k, v in built.env.items() if k != "COLUMNS"}
    return Built(root, built.work, {**env, "CACHEMGR_CACHE_ROOT": str(root)}, built.failed_key)


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


def on_pty(*args: str, env: dict[str, str]) -> tuple[int, str]:
    """``cachemgr ARGS`` with stdin, stdout and stderr on one pseudo-terminal: what a person sees, in order."""
    return terminal.on_pty([sys.executable, "-m", "cachemgr", *args], env, deadline=DEADLINE)


def entries_by_tp(root: Path) -> dict[tuple[str, int], Path]:
    found = {}
    for entry in entry_dirs(root):
        inputs = json.loads((entry / "key.json").read_text())["inputs"]
        found[(inputs["compiler"], inputs["serving"]["tensor_parallel_size"])] = entry
    return found


# --- what the volume holds, escaped -----------------------------------------------------------------

EVIL = f"evil{ESC}[2J{ESC}]0;owned\x07\nFAKE ROW  {ESC}[31mred"


def _rewrite(path: Path, change: Any) -> None:
    """Rewrite a JSON file of the volume (published files are 0444 in 0555 folders: as root would)."""
    data = json.loads(path.read_text())
    change(data)
    folder_mode = path.parent.stat().st_mode
    path.parent.chmod(0o755)
    path.chmod(0o644)
    path.write_text(json.dumps(data))
    path.chmod(0o444)
    path.parent.chmod(folder_mode & 0o7777)


def plant(root: Path, failed_key: str) -> dict[str, str]:
    """ANSI escapes and newlines in every field a human output shows; returns the keys involved."""
    entries = entries_by_tp(root)
    victim, other = entries[("0.12", 4)], entries[("0.12", 8)]
    digest = json.loads((victim / "summary.json").read_text())["key"]

    def summary(data: dict[str, Any]) -> None:
        data.update(model=EVIL, npu=EVIL, role=EVIL, strategy=EVIL)

    _rewrite(victim / "summary.json", summary)
    _rewrite(
        victim / "key.json",
        lambda d: d["inputs"]["serving"].update(evil=EVIL) or d["sources"].update(serving=EVIL),
    )
    _rewrite(other / "key.json", lambda d: d["inputs"]["serving"].update(max_model_len=EVIL))
    manifest = victim / "manifest.json"
    _rewrite(manifest, lambda d: d["files"].append({**d["files"][0], "path": f"artifacts/{EVIL}.rbln"}))
    # A live user, a drift record and an ended start of the victim.
    usage = root / "usage" / digest
    usage.mkdir(parents=True, exist_ok=True)
    (usage / "evil.1.json").write_text(
        json.dumps({"pod": EVIL, "node": EVIL, "since": time.time(), "start": "hit"})
    )
    (usage / "recompiled-on-hit.evil.1").write_text(
        json.dumps({"pod": EVIL, "node": EVIL, "time": time.time(), "paths": [EVIL]})
    )
    # The failed compile's record.
    for record in (root / "failures" / failed_key).glob("*.json"):
        _rewrite(
            record,
            lambda d: d.update(
                pod=EVIL, node=EVIL, reason=EVIL, message=EVIL, output_tail=[EVIL, EVIL], exit_status=EVIL
            ),
        )
    # A compile attempt of another key, with its lease, holder and progress records.
    attempting = "c" * 32
    staging = root / "staging" / attempting
    (staging / "evil.1.abcd" / "artifacts").mkdir(parents=True)
    (staging / "evil.1.abcd" / "key.json").write_text(
        json.dumps(
            {
                "inputs": {"role": EVIL, "compiler": EVIL, "npu": EVIL},
                "details": {"model_name": EVIL},
                "entry": EVIL,
            }
        )
    )
    (staging / "evil.1.abcd.json").write_text(
        json.dumps({"pod": EVIL, "node": EVIL, "host": EVIL, "pid": 1, "since": time.time(), "entry": EVIL})
    )
    leases = root / "leases"
    leases.mkdir(exist_ok=True)
    (leases / f"{attempting}.lock").write_text(
        f"filelock/2\npid=1\nhost={ESC}x\nmode=lease\ntoken=t1\nduration=600\n"
    )
    (leases / f"{attempting}.holder.json").write_text(
        json.dumps(
            {
                "pod": EVIL,
                "node": EVIL,
                "host": EVIL,
                "pid": 1,
                "since": time.time(),
                "token": "t1",
                "entry": EVIL,
            }
        )
    )
    progress = {"format": 1, "key": attempting, "token": "t1", "pod": EVIL, "elapsed_s": 5.0, "cpu_seconds": 1.0,
                "staged_bytes": 10, "expected_bytes": 100, "expected_source": EVIL, "eta_s": 10.0, "eta_source": EVIL,
                "every_s": 2.0}  # fmt: skip
    (leases / f"{attempting}.progress.json").write_text(json.dumps(progress))
    # Something quarantined, with a reason.
    quarantine = root / "quarantine"
    quarantine.mkdir(exist_ok=True)
    moved = quarantine / f"{EVIL.replace('/', '_')}__{'d' * 16}.20260101T000000Z.abcd"
    moved.mkdir()
    (quarantine / f"{moved.name}.reason.json").write_text(json.dumps({"reason": EVIL, "at": time.time()}))
    return {"victim": digest, "attempting": attempting}


def attempt(root: Path, *, pod: str = POD, node: str = NODE) -> str:
    """A compile attempt of another pod (another node), with its lease and progress, as a cluster has them."""
    digest = "e" * 32
    entry = f"MiniMaxAI--MiniMax-M2.7__prefill__c0.12__RBLN-CA25__{digest[:16]}"
    folder = root / "staging" / digest / f"{pod}.1.abcd"
    (folder / "artifacts").mkdir(parents=True)
    inputs = {"role": "prefill", "compiler": "0.12", "npu": "RBLN-CA25"}
    (folder / "key.json").write_text(
        json.dumps({"inputs": inputs, "details": {"model_name": MODEL}, "entry": entry})
    )
    owner = {"pod": pod, "node": node, "host": node, "pid": 1, "since": time.time(), "entry": entry}
    (folder.parent / f"{folder.name}.json").write_text(json.dumps(owner))
    leases = root / "leases"
    leases.mkdir(exist_ok=True)
    (leases / f"{digest}.lock").write_text(
        f"filelock/2\npid=1\nhost={node}\nmode=lease\ntoken=t1\nduration=30\n"
    )
    (leases / f"{digest}.holder.json").write_text(json.dumps({**owner, "token": "t1"}))
    progress = {"format": 1, "key": digest, "token": "t1", "pod": pod, "elapsed_s": 252.0, "cpu_seconds": 310.0,
                "staged_bytes": 1 << 30, "expected_bytes": 8 << 30, "expected_source": "learned from entry 661096f83b76",
                "eta_s": 400.0, "eta_source": "from entry 661096f83b76 compiled in 10m52s", "every_s": 2.0}  # fmt: skip
    (leases / f"{digest}.progress.json").write_text(json.dumps(progress))
    return digest


def _assert_escaped(what: str, text: str) -> None:
    assert ESC not in text, f"{what}: a raw escape reached the terminal:\n{text!r}"
    assert "\x07" not in text, f"{what}: a raw bell reached the terminal:\n{text!r}"
    lines = text.splitlines()
    assert not [line for line in lines if line.startswith("FAKE ROW")], (
        f"{what}: a planted newline made a line:\n{text}"
    )


def test_what_the_volume_holds_reaches_every_human_output_escaped(cache: Built) -> None:
    keys = plant(cache.root, cache.failed_key)
    env = {**cache.env, "COLUMNS": "200"}
    outputs = {
        "ls": ["ls"], "ls wide": ["ls", "-o", "wide"], "ls name": ["ls", "-o", "name"], "du": ["du"],
        "du wide": ["du", "-o", "wide"], "show": ["show", keys["victim"][:12]],
        "show failed": ["show", cache.failed_key[:12]], "show attempt": ["show", keys["attempting"][:12]],
        "locks": ["locks"], "locks wide": ["locks", "-o", "wide"], "verify": ["verify"],
        "verify wide": ["verify", "-o", "wide"], "prune": ["prune", "--damaged", "--unused-for", "0s", "--dry-run"],
        "prune wide": ["prune", "--damaged", "--unused-for", "0s", "--dry-run", "-o", "wide"],
        "stats": ["stats"], "stats wide": ["stats", "-o", "wide"],
        "explain": ["explain", "--", *vllm(4)], "explain miss": ["explain", "--", *vllm(16)],
        "ls jsonpath": ["ls", "-o", "jsonpath={.items[*].model}{.items[*].users[*].pod}"],
        "ls custom-columns": ["ls", "-o", "custom-columns=MODEL:.model,POD:.users[*].pod,NPU:.npu"],
        "show jsonpath": ["show", keys["victim"][:12], "-o", "jsonpath={.users[*].pod} {.users}"],
    }  # fmt: skip
    shown = set()
    for what, args in outputs.items():
        done = cli(*args, env=env)
        allowed = (0, 1, 74) if args[0] == "explain" else (0, 74)  # explain's 1: not a hit
        assert done.returncode in allowed, (what, done.returncode, done.stderr)
        _assert_escaped(what, done.stdout + done.stderr)
        if "\\x1b" in done.stdout:
            shown.add(what)
    # Each output that shows a planted field shows it, escaped: the test looked at the fields.
    assert shown >= set(outputs) - {"ls name", "du"}, set(outputs) - shown


def test_the_probes_escape_a_holder_name_from_the_volume(tmp_path: Path) -> None:
    from cachemgr.runtime.state import StateWriter

    state = StateWriter(tmp_path, stall_timeout=None)
    state.phase("waiting", holder=EVIL, holder_node=EVIL, waited_s=3, held_for_s=4)
    done = cli("probe", "startup", "--state-dir", str(tmp_path), env=dict(os.environ))
    _assert_escaped("probe", done.stdout)
    assert "\\x1b" in done.stdout, done.stdout


# --- 80 columns -------------------------------------------------------------------------------------


def test_every_table_fits_80_columns_and_wide_shows_the_rest(cache: Built, tmp_path: Path) -> None:
    attempt(cache.root)
    env = {**cache.env, "COLUMNS": "80"}
    victim = entries_by_tp(cache.root)[("0.12", 8)]
    (victim / "artifacts").chmod(0o755)
    key = json.loads((victim / "summary.json").read_text())["key"]
    commands = [
        ["ls"], ["du"], ["locks"], ["stats"], ["verify"], ["show", key[:12]], ["show", cache.failed_key[:12]],
        ["prune", "--incompatible", "--unused-for", "0s", "--dry-run"], ["key", "--", *vllm(8)],
    ]  # fmt: skip
    for args in commands:
        cut = args.index("--") if "--" in args else len(args)
        rows = cli(*args[:cut], "--no-headers", *args[cut:], env=env)
        assert rows.returncode in (0, 74), (args, rows.stderr)
        too_wide = [line for line in rows.stdout.splitlines() if len(line) > 80]
        assert too_wide == [], (args, too_wide)
        full = cli(*args, env=env).stdout
        headers = [
            line for line in full.splitlines() if re.match(r"(KEY|KIND|INPUT|COMMAND|COMPILER|POD)  ", line)
        ]
        assert headers or args[:2] == ["show", cache.failed_key[:12]], (args, full)
        assert [h for h in headers if len(h) > 80] == [], (args, headers)
    wide = cli("ls", "-o", "wide", env=env).stdout
    assert "MiniMaxAI/MiniMax-M2.7" in wide
    assert "ROLE" in wide
    assert "HITS" in wide
    assert "LAST USED" in wide
    narrow = cli("ls", env=env).stdout
    assert "MiniMax-M2.7" in narrow, "a model is shortened to its name, never past it"


# --- errors: one line, one prefix, once per stream --------------------------------------------------


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["run", "--on-miss", "never"], "cachemgr run: argument --on-miss: invalid choice: 'never'"),
        (["key"], "cachemgr key: the server's argv must follow '--'"),
        (["ls", "--bogus"], "cachemgr ls: unrecognized arguments: --bogus. See 'cachemgr ls --help'."),
        (["bogus"], "cachemgr: argument COMMAND: invalid choice: 'bogus'"),
    ],
)
def test_a_usage_error_names_its_command_once(cache: Built, args: list[str], line: str) -> None:
    env = {**cache.env, "CACHEMGR_LOG_FORMAT": "console"}
    done = cli(*args, env=env)
    assert done.returncode == 64
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(line), lines[0]
    assert not lines[0].split(": ", 1)[1].startswith("cachemgr"), f"one prefix: {lines[0]}"


def test_each_stream_gets_an_error_once_in_its_format(cache: Built) -> None:
    env = {**cache.env, "CACHEMGR_LOG_FORMAT": "json"}  # the pod's format: a person's command ignores it
    # Asked for JSON (-o json): the JSON event alone, its message the one line.
    done = cli("show", "f" * 20, "-o", "json", env=env)
    assert done.returncode == 66, "not found has its own exit code"
    (line,) = done.stderr.strip().splitlines()
    event = json.loads(line)
    assert (event["event"], event["exit_code"], event["reason"]) == ("failed", 66, "not-found")
    assert event["message"].startswith(f"no entry, compile attempt or failure record under {cache.root}")
    # Not asked, with or without a terminal (kubectl exec -it, or without -t): the plain line alone.
    piped = cli("show", "f" * 20, env=env)
    for code, shown in (on_pty("show", "f" * 20, env=env), (piped.returncode, piped.stderr)):
        assert code == 66
        (line,) = shown.strip().splitlines()
        assert line.startswith("cachemgr show: no entry, compile attempt or failure record"), line
    assert cli("verify", "f" * 20, env=env).returncode == 66


# --- prune: plan, progress, summary; warm: one summary line ----------------------------------------


def test_prune_prints_its_plan_then_its_progress_then_what_it_did(cache: Built) -> None:
    env = {**cache.env, "CACHEMGR_LOG_FORMAT": "json"}
    code, shown = on_pty("prune", "--incompatible", "--yes", "--log-format", "json", env=env)
    assert code == 0, shown
    lines = shown.splitlines()
    plan = next(i for i, line in enumerate(lines) if line.startswith("plan: 1 item"))
    pruned = next(i for i, line in enumerate(lines) if '"event": "pruned"' in line)
    removed = next(i for i, line in enumerate(lines) if line.startswith("removed 1 item"))
    assert plan < pruned < removed, shown


def test_warm_ends_with_a_summary_of_what_it_did(cache: Built, tmp_path: Path) -> None:
    names = []
    with cluster(tmp_path / "pods", STANDIN_COMPILE_SECONDS="0.1") as pods:
        compile_only = {"VLLM_RBLN_COMPILE_ONLY": "1", **npu_node(pods.work)}
        for name, expected in (
            ("warm-a", "warm: compiled entry "),
            ("warm-b", "was already published: nothing compiled"),
        ):
            job = pods.start(name, vllm(16), cache_root=cache.root, command="warm", env=compile_only)
            assert job.wait_exit() == 0, job.tail()
            out = job.log.read_text().strip().splitlines()[-1]
            assert expected in out, out
            found = re.search(r"entry (\S+) \(", out)
            assert found is not None, out
            names.append(found[1])
    assert names[0] == names[1]
    assert names[0].startswith("MiniMaxAI--MiniMax-M2.7__prefill__c0.12__RBLN-CA25__")
    stats = json.loads(cli("stats", "-o", "json", env=cache.env).stdout)
    (tp16,) = [k for k in stats["items"] if k["entry"] == names[0]]
    assert (tp16["compiles"], tp16["hits"], tp16["misses"]) == (1, 1, 1), tp16
    assert tp16["starts"] == {"compiled": 1, "hit": 1}, "both Jobs' use records, kept when they ended"


def test_stats_counts_a_start_that_waited_for_its_peer_apart_from_hits_and_compiles(
    cache: Built, tmp_path: Path
) -> None:
    """Issue 34: a pod that waited for its peer's compile and loaded the entry was a "miss", so
    "50% hits" read as half the starts compiled. Hits, waits and compiles are counted apart."""
    with cluster(tmp_path / "pods", STANDIN_COMPILE_SECONDS="0.1") as pods:
        record = pods.work / "compiler.jsonl"
        options = ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=2)]
        first = pods.start(
            "modelserver-prefill-a", server_argv(free_port()), cache_root=cache.root, options=options
        )
        first.wait_phase("compiling")
        second = pods.start(
            "modelserver-prefill-b", server_argv(free_port()), cache_root=cache.root, options=options
        )
        second.wait_phase("waiting")
        for pod in (first, second):
            pod.wait_phase("serving")
        third = pods.start(
            "modelserver-prefill-c", server_argv(free_port()), cache_root=cache.root, options=options
        )
        third.wait_phase("serving")
        digest = json.loads((first.state_dir / "state.json").read_text())["key"]
        stats = json.loads(cli("stats", "-o", "json", env=cache.env).stdout)
        (key,) = [k for k in stats["items"] if k["key"].startswith(digest)]
        assert (key["pod_starts"], key["hits"], key["waits"], key["compiles"], key["misses"]) == (
            3,
            1,
            1,
            1,
            2,
        ), key
        shown = cli("stats", env=cache.env).stdout
        (row,) = [line for line in shown.splitlines() if line.startswith(digest[:12])]
        assert row.split()[2:5] == ["1", "1", "1"], f"HITS WAITS COMPILES: {row}"
        assert "WAITS" in shown
        volume = " ".join(line for line in shown.splitlines() if line.startswith(("volume:", " ")))
        assert "% hits" not in shown, "no ratio that reads a wait as a compile"
        assert re.search(r"\d+ pod starts: \d+ hits?, \d+ waits?, \d+ compiles?", volume), volume


# --- ls and show say only what they checked ------------------------------------------------------------


def test_ls_claims_no_check_it_did_not_make_and_show_says_what_its_check_found(cache: Built) -> None:
    victim = entries_by_tp(cache.root)[("0.12", 8)]
    artifact = next(p for p in sorted((victim / "artifacts").rglob("*")) if p.is_file())
    artifact.parent.chmod(0o755)
    artifact.chmod(0o644)
    with artifact.open("r+b") as handle:  # its size no longer matches the manifest
        handle.truncate(1)
    key = json.loads((victim / "summary.json").read_text())["key"]
    (row,) = [
        r for r in json.loads(cli("ls", "-o", "json", env=cache.env).stdout)["items"] if r.get("key") == key
    ]
    assert row["status"] == "published", "ls reads the summary and sees the manifest: it says no more"
    # ... and says so where STATUS is read (issue 34: "published" read as "its files are fine").
    listed = cli("ls", env=cache.env).stdout
    (line,) = [line for line in listed.splitlines() if line.startswith(key[:12])]
    assert line.split()[-1] == "published", line
    said = " ".join(listed.split())
    assert "STATUS is what each entry's summary and manifest say: ls reads none of their files" in said
    assert "'cachemgr show KEY' checks their sizes" in said
    shown = cli("show", key[:12], env=cache.env).stdout
    status = next(line for line in shown.splitlines() if line.startswith("status"))
    assert "damaged: 1 of the manifest's " in status, status
    assert "files fails the size and mtime check" in status, status
    assert "ok" not in status
    detail = json.loads(cli("show", key[:12], "-o", "json", env=cache.env).stdout)
    assert detail["status"] == "damaged"
    assert f"{row['files']} files" in shown, "show counts files as ls does"
    failed = cli("show", cache.failed_key[:12], env=cache.env).stdout
    assert "compiler status 3" in failed
    assert "None" not in failed


def test_the_key_inputs_say_each_versions_variable_once(cache: Built) -> None:
    victim = entries_by_tp(cache.root)[("0.12", 8)]
    key = json.loads((victim / "summary.json").read_text())["key"]
    rows = [line.split() for line in cli("show", key[:12], "-o", "wide", env=cache.env).stdout.splitlines()]
    versions = {row[0]: row[2:] for row in rows if row and row[0].startswith("versions.")}
    assert versions == {
        "versions.optimum_rbln": ["CACHEMGR_OPTIMUM_RBLN_VERSION"],
        "versions.transformers": ["CACHEMGR_TRANSFORMERS_VERSION"],
        "versions.vllm": ["CACHEMGR_VLLM_VERSION"],
        "versions.vllm_rbln": ["CACHEMGR_VLLM_RBLN_VERSION"],
    }, versions


# --- du: what the pod can use -------------------------------------------------------------------------------


def test_du_reports_the_volume_as_df_and_the_pod_see_it(cache: Built) -> None:
    usage = json.loads(cli("du", "-o", "json", env=cache.env).stdout)
    st = os.statvfs(cache.root)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    avail = st.f_bavail * st.f_frsize
    # The machine's disk is shared: other writers move it between two looks.
    assert usage["used_bytes"] == pytest.approx(used, abs=256 << 20)
    assert usage["used_percent"] == pytest.approx(100 * used / (used + avail), abs=0.5), "as df's Use%"
    assert usage["usable_bytes"] == pytest.approx(used + avail, abs=256 << 20)
    text = " ".join(cli("du", env=cache.env).stdout.split())  # a long value goes on under itself
    assert "for root only" not in text
    if st.f_bfree > st.f_bavail:
        assert "usable by the pod (of " in text, text
        assert "reserved for root)" in text, text
    # Without this image's compiler, du offers no 'prune --incompatible' (it would exit 78).
    env = {k: v for k, v in cache.env.items() if k != "CACHEMGR_COMPILER_VERSION"}
    text = cli("du", env=env).stdout
    assert "cachemgr prune --incompatible  " not in text
    assert "'cachemgr prune --incompatible' needs this image's RBLN Compiler version" in " ".join(
        text.split()
    )
    assert "incompatible" not in json.loads(cli("du", "-o", "json", env=env).stdout)["prunable"]


# --- one rule for staleness: a SIGKILLed holder, a hung compile -------------------------------------------


def _holder(pods: Cluster, root: Path, *, stall: str | None = None, node: str | None = None) -> Any:
    record = pods.work / "compiler.jsonl"
    extra = "--hang" if stall else ""
    # A hung compile hangs at once (a slow one would make progress between its files).
    seconds = 0.3 if stall else 60
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=seconds, extra=extra)]
    options += ["--stall-timeout", stall] if stall else []
    pod = pods.start(POD, server_argv(free_port()), cache_root=root, options=options, node=node)
    pod.wait_phase("compiling")
    return pod


def test_a_killed_holder_is_dead_for_locks_ls_and_prune_at_once(cache: Built, tmp_path: Path) -> None:
    with cluster(tmp_path / "pods", STANDIN_COMPILE_SECONDS="0.1") as pods:
        pod = _holder(pods, cache.root)
        wait_for(
            lambda: cli("locks", "-o", "json", env=cache.env).stdout.count('"state": "live"'),
            what="the lease",
        )
        pod.signal_pod(signal.SIGKILL)
        pod.wait_exit()
        (lock,) = json.loads(cli("locks", "-o", "json", env=cache.env).stdout)["items"]
        assert (lock["state"], lock["stale"]) == ("dead", True), lock
        assert " dead" in cli("locks", env=cache.env).stdout
        (attempt,) = [
            r
            for r in json.loads(cli("ls", "-o", "json", env=cache.env).stdout)["items"]
            if r["kind"] == "staging"
        ]
        # One rule (cachemgr.volume.liveness), one word: locks, ls and prune all say "dead" (issue
        # 34: ls said "stale" and prune "attempt silent for 2s" of a process gone a second ago).
        assert attempt["status"] == "dead", attempt
        assert "gone from this host" in attempt["problem"], attempt
        shown = cli("ls", env=cache.env).stdout
        assert re.search(r"\bdead\n", shown), shown
        assert "dead: its pod's process is gone from this host" in shown, shown
        planned = cli("prune", "--stale-staging", "--dry-run", env=cache.env).stdout
        assert "dead: its pod's process is gone from this host" in planned, planned
        assert "silent" not in planned, planned
        done = cli("prune", "--stale-staging", "--yes", "-o", "json", env=cache.env)
        assert [i["kind"] for i in json.loads(done.stdout)["result"]["removed"]] == ["staging"]
        assert list((cache.root / "leases").iterdir()) == [], (
            "its marker, holder and progress records went too"
        )
        assert json.loads(cli("locks", "-o", "json", env=cache.env).stdout)["items"] == []


def test_an_owner_in_another_pid_namespace_of_this_host_is_not_judged_by_its_pid(
    cache: Built, tmp_path: Path
) -> None:
    """A sidecar or a debug container has the pod's host name but its own pid namespace: a pid
    there says nothing here. The owner record names its namespace, as a lease marker does, so
    ls and prune go by silence (one rule for both records, cachemgr.volume.liveness)."""
    with cluster(tmp_path / "pods", STANDIN_COMPILE_SECONDS="0.1") as pods:
        pod = _holder(pods, cache.root)
        (owner,) = (cache.root / "staging").glob("*/*.json")
        record = json.loads(owner.read_text())
        assert {"started", "boot", "pidns"} <= set(record), record
        pod.signal_pod(signal.SIGKILL)
        pod.wait_exit()
        beat = owner.stat().st_mtime  # its last heartbeat, kept: the rewrite is no beat
        owner.write_text(json.dumps({**record, "pidns": "pid:[1]"}))  # another namespace
        os.utime(owner, (beat, beat))
        wait_for(
            lambda: [r for r in cli_json_rows(cache) if r["status"] == "silent"],
            what="the attempt to fall silent (its pid says nothing here)",
            timeout=60,
        )
        (attempt,) = [r for r in cli_json_rows(cache) if r["kind"] == "staging"]
        assert attempt["status"] == "silent", attempt
        owner.write_text(json.dumps(record))  # its own again: known dead here
        os.utime(owner, (beat, beat))
        (attempt,) = [r for r in cli_json_rows(cache) if r["kind"] == "staging"]
        assert attempt["status"] == "dead", attempt


def cli_json_rows(cache: Built) -> list[dict[str, Any]]:
    done = cli("ls", "-o", "json", env=cache.env)
    assert done.returncode == 0, done.stderr
    rows: list[dict[str, Any]] = json.loads(done.stdout)["items"]
    return rows


def test_a_hung_compile_is_shown_stalled_by_locks_and_ls(cache: Built, tmp_path: Path) -> None:
    with cluster(tmp_path / "pods", STANDIN_COMPILE_SECONDS="0.1") as pods:
        _holder(pods, cache.root, stall="2s", node=NODE)

        def stalled() -> Any:
            locks = json.loads(cli("locks", "-o", "json", env=cache.env).stdout)["items"]
            return locks if locks and locks[0]["state"] == "stalled" else None

        (lock,) = wait_for(stalled, what="locks to say stalled")
        assert lock["progress"]["stalled"] is True
        assert "STALLED: no CPU, writes or output for" in " ".join(cli("locks", env=cache.env).stdout.split())
        (attempt,) = [
            r
            for r in json.loads(cli("ls", "-o", "json", env=cache.env).stdout)["items"]
            if r["kind"] == "staging"
        ]
        assert attempt["status"] == "stalled"


# --- the demo's last words ------------------------------------------------------------------------------------


def test_the_demos_inspect_command_works_as_printed(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cachemgr", "demo", "--dir", str(tmp_path / "demo"), "--compile-seconds", "0.5"],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path, stdin=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if not k.startswith("CACHEMGR_")},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (inspect,) = [line for line in done.stdout.splitlines() if line.startswith("inspect:")]
    command = inspect.removeprefix("inspect:").strip()
    # In a fresh shell (none of the demo pods' variables): the command says all it needs (issue 34:
    # it printed two notes, this image's compiler and NPU unknown, the pods' settings not passed on).
    fresh = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEMGR_", "RBLN_"))}
    shown = subprocess.run(
        ["sh", "-c", command],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
        env=fresh,
    )
    assert shown.returncode == 0, (command, shown.stderr)
    assert shown.stderr == "", (command, shown.stderr)
    # Nor a paragraph on the entries' generation that cannot be told (the server's versions).
    assert "cannot be told" not in shown.stdout, shown.stdout
    assert "rebellions/Demo-LLM-8B"[-11:] in shown.stdout
    assert " published" in shown.stdout, shown.stdout
    assert [line.split()[2] for line in done.stdout.splitlines() if " publishing" in line], (
        "every phase is shown"
    )
    # Every kind of line the README's sample timeline shows, the demo prints (phase and note).
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    sample = readme.split("cold start (empty caches):", 1)[1].split("```", 1)[0]
    shape = re.compile(r"\s+[\d.]+s\s+(\S+)-\d\s+(\S+)\s*(.*)")

    def kinds(text: str) -> set[tuple[str, str, str]]:
        found = set()
        for line in text.splitlines():
            match = shape.fullmatch(line)
            if match:  # the note without pod and node names
                found.add((match[1], match[2], re.sub(r"(prefill|decode)-\d on node-\w", "POD", match[3])))
        return found

    assert kinds(sample) <= kinds(done.stdout), kinds(sample) - kinds(done.stdout)
    for line in (
        "compiles: cold prefill=1 decode=1; warm prefill=0 decode=0",
        "demo: OK, each role compiled once, then never again",
    ):
        assert line in sample, line
        assert line in done.stdout, line


def test_the_demos_timeline_stays_in_time_order_when_a_pod_logs_its_first_events_late(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pod holds its first events until it launches: on a loaded machine they reach its log
    seconds after another pod's later ones were due. The timeline waits for them rather than
    print a line out of order (the warm round printed 0.64s, then 0.51s)."""
    import threading
    from datetime import UTC, datetime

    from cachemgr.cli import demo

    monkeypatch.setattr(demo, "_SETTLE", 0.1)

    def stamp(at: float) -> str:
        return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")

    def phase(at: float, was: str, to: str, seconds_in_previous: float) -> str:
        event = {"event": "phase", "timestamp": stamp(at), "from": was, "to": to}
        return json.dumps({**event, "seconds_in_previous": seconds_in_previous, "detail": {}}) + "\n"

    started = time.monotonic()
    now = time.time()
    pods = []
    for name in ("early", "late"):
        pod = demo.Pod(name, "prefill", "node-a", 0, tmp_path / name, tmp_path / f"{name}.log")
        pod.log_path.write_text("")
        pod.started_at = now
        pod.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        pods.append(pod)
    early, late = pods
    try:
        # "early" logs at once: resolving from +0.2s, launching at +0.4s, serving at +0.5s.
        early.log_path.write_text(
            phase(now + 0.4, "resolving", "launching", 0.2) + phase(now + 0.5, "launching", "serving", 0.1)
        )

        def late_pod() -> None:
            # "late" began resolving at +0.1s, launched at +0.3s: both before "early"'s lines,
            # but its log gets them only now, long after those were settled.
            time.sleep(max(0.0, now + 1.5 - time.time()))  # the lateness itself, not a wait on anything
            with late.log_path.open("a") as log:
                log.write(
                    phase(now + 0.3, "resolving", "launching", 0.2)
                    + phase(now + 0.6, "launching", "serving", 0.3)
                )

        writer = threading.Thread(target=late_pod)
        writer.start()
        assert demo._watch(pods, started, until="serving")
        writer.join()
    finally:
        for pod in pods:
            assert pod.proc is not None
            pod.proc.kill()
            pod.proc.wait()
    out = capsys.readouterr().out
    times = [float(line.split()[0].removesuffix("s")) for line in out.splitlines() if line.strip()]
    assert len(times) == 6, out
    assert times == sorted(times), out


def _processes_using(directory: Path) -> list[int]:
    """The pids whose environment names ``directory`` (the demo's pods and their servers)."""
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if str(directory).encode() in environ and pid != os.getpid():
            found.append(pid)
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_demo_stopped_mid_compile_stops_its_pods_with_it(tmp_path: Path, signum: int) -> None:
    """SIGTERM (or SIGINT not from a terminal: kill, timeout, a CI runner) used to end the demo
    and leave its four pods compiling and serving on their ports, for good."""
    work = tmp_path / "demo"
    log = tmp_path / "demo.log"
    # A pytest-xdist worker ignores SIGINT, and an ignored signal stays ignored across exec (Python
    # then installs no KeyboardInterrupt handler): give the demo the SIGINT a shell's child has.
    interruptible = (
        "import signal, sys, runpy; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv[0] = 'cachemgr'; runpy.run_module('cachemgr', run_name='__main__')"
    )
    with log.open("wb") as out:
        demo = subprocess.Popen(
            [sys.executable, "-c", interruptible, "demo", "--dir", str(work), "--compile-seconds", "60",
             "--log-format", "console" if signum == signal.SIGTERM else "json"],
            stdout=out, stderr=out, stdin=subprocess.DEVNULL, cwd=tmp_path,
            env={k: v for k, v in os.environ.items() if not k.startswith("CACHEMGR_")},
        )  # fmt: skip
    try:
        wait_for(lambda: log.read_text().count(" compiling ") >= 2, what="both roles compiling")
        assert len(_processes_using(work)) >= 4, "the pods run"
        demo.send_signal(signum)
        code = demo.wait(timeout=DEADLINE)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    leftovers = _processes_using(work)
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    assert leftovers == [], "the demo's pods outlived it"
    text = log.read_text()
    if signum == signal.SIGTERM:
        assert code == 143, text
        (line,) = [line for line in text.splitlines() if line.startswith("cachemgr demo:")]
        assert line.startswith(
            "cachemgr demo: stopped by signal 15 (SIGTERM); the demo's pods were stopped"
        ), line
    else:  # was {"reason": "internal", "message": "interrupted"}: no bug, and nothing to do
        assert code == 130, text
        (event,) = [json.loads(line) for line in text.splitlines() if '"event": "failed"' in line]
        assert event["reason"] == "interrupted", event
        assert (
            event["message"]
            == "interrupted by SIGINT (Ctrl-C) before it finished. Run the command again to finish it."
        )
    assert "all four serving" not in text


def test_a_demo_round_whose_pod_failed_does_not_say_all_four_served(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEMGR_")}
    done = subprocess.run(
        [sys.executable, "-m", "cachemgr", "demo", "--dir", str(tmp_path / "demo"), "--compile-seconds", "0.2"],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path, stdin=subprocess.DEVNULL,
        env={**env, "STANDIN_EXIT_BEFORE_HEALTHY": "1"},  # every compile fails: no pod serves
    )  # fmt: skip
    assert done.returncode != 0, done.stdout
    assert "exited with code 70" in done.stdout, done.stdout
    assert "all four serving" not in done.stdout, done.stdout
    assert "not every pod served (above); stopped the rest with SIGTERM" in done.stdout, done.stdout


def test_a_killed_holder_on_another_node_is_silent_for_locks_and_ls_alike(
    cache: Built, tmp_path: Path
) -> None:
    """Its pid cannot be probed from here: both say "silent" once its attempt stops beating, until
    the lease expires (then the next pod takes it over)."""
    with cluster(tmp_path / "pods", STANDIN_COMPILE_SECONDS="0.1") as pods:
        pod = _holder(pods, cache.root, node=NODE)
        pod.signal_pod(signal.SIGKILL)
        pod.wait_exit()

        def silent() -> Any:
            rows = json.loads(cli("ls", "-o", "json", env=cache.env).stdout)["items"]
            staging = [r for r in rows if r["kind"] == "staging"]
            return staging if staging and staging[0]["status"] == "silent" else None

        wait_for(silent, what="ls to call the attempt silent", timeout=30)
        (lock,) = json.loads(cli("locks", "-o", "json", env=cache.env).stdout)["items"]
        assert (lock["state"], lock["stale"]) == ("silent", False), lock
