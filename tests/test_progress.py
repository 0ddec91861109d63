"""Progress an operator can watch: compile_progress, waiting_for_compile, locks, bars, space figures.

Real pods (tests/podlib.py) compile with the stand-in for a few seconds under a short progress
interval; the holder's progress record is damaged in every way the volume allows while a real
pod waits on it; verify and prune run under a real pseudo-terminal.
"""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.podlib import Cluster, Pod, free_port, run_cli, wait_for
from cachemgr_testkit.scenarios import compile_cmd, compiles, server_argv, vllm_argv
from cachemgr_testkit.terminal import read_terminal

from cachemgr.core.units import human_bytes
from cachemgr.ops.meter import interval_from
from cachemgr.ops.progress import (
    DEFAULT_INTERVAL,
    RECORD_MAX,
    Every,
    Snapshot,
    read_record,
    record_path,
    write_record,
)
from cachemgr.runtime.options import RunOptions
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import CacheRoot, open_root
from cachemgr.volume.lease import KeyLease

MiB = 1 << 20


def _events(pod: Pod, name: str) -> list[dict[str, Any]]:
    return [e for e in pod.log_events() if e.get("event") == name]


def _options(record: Path, *, seconds: float, extra: str = "", size: str = "256k") -> list[str]:
    cmd = compile_cmd(record, seconds=seconds, extra=extra).replace("--bytes 256k", f"--bytes {size}")
    return ["--strategy", "command", "--compile-cmd", cmd]


def _warm(pods: Cluster, root: Path, name: str, options: list[str]) -> None:
    pod = pods.start(name, server_argv(free_port()), cache_root=root, command="warm", options=options)
    assert pod.wait_exit() == 0, pod.tail()


def _digest(pods: Cluster, root: Path, options: list[str]) -> str:
    env = {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)}
    result = run_cli("key", "-o", "json", *options, "--", *server_argv(8000), env=env)
    assert result.returncode == 0, result.stderr
    digest: str = json.loads(result.stdout)["key"]
    return digest


# --- the rate limit and its default -----------------------------------------------------------------


@pytest.mark.quick
def test_progress_lines_default_to_one_per_30_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CACHEMGR_PROGRESS_INTERVAL", raising=False)
    assert DEFAULT_INTERVAL == 30.0
    assert interval_from(None) == 30.0
    assert RunOptions(cache_root=Path("/x"), state_dir=Path("/y")).progress_interval == 30.0
    monkeypatch.setenv("CACHEMGR_PROGRESS_INTERVAL", "2m")
    assert interval_from(None) == 120.0
    assert interval_from(1.5) == 1.5


@pytest.mark.quick
def test_every_lets_one_through_per_interval() -> None:
    every = Every(30.0)
    seen = [t for t in (0.0, 1.0, 5.0, 29.9, 30.0, 31.0, 59.9, 60.0, 60.1) if every.due(t)]
    assert seen == [0.0, 30.0, 60.0]


# --- a compile of a few seconds, and a pod waiting on it ---------------------------------------------


def test_compiling_and_waiting_pods_log_progress_with_what_the_eta_rests_on(
    pods: Cluster, root: Path
) -> None:
    record = pods.work / "compiler.jsonl"
    # An earlier compile of the same model with the same compiler (another serving config).
    _warm(pods, root, "earlier", _options(record, seconds=2.0, extra="--tensor-parallel-size 8"))
    (earlier,) = (root / "entries").iterdir()
    summary = json.loads((earlier / "summary.json").read_text())
    env = {"CACHEMGR_PROGRESS_INTERVAL": "1s"}
    options = _options(record, seconds=4.0)
    holder = pods.start("a", server_argv(free_port()), cache_root=root, options=options, env=env)
    holder.wait_phase("compiling")
    waiter = pods.start("b", server_argv(free_port()), cache_root=root, options=options, env=env)
    holder.wait_phase("serving")
    waiter.wait_phase("serving")
    assert compiles(record) == 2, "the waiter did not compile"

    progress = _events(holder, "compile_progress")
    assert len(progress) >= 2, holder.tail()
    last = progress[-1]
    assert last["eta_source"].startswith(f"from entry {summary['key'][:12]} compiled in "), last
    assert last["expected_source"].startswith(f"learned from entry {summary['key'][:12]}"), last
    assert last["expected_bytes"] == summary["size_bytes"]
    assert last["elapsed_s"] >= 1
    assert last["cpu_seconds"] >= 0
    assert last["staged_bytes"] >= 0
    assert "ETA ~" in progress[0]["progress"] or "past the estimate" in progress[0]["progress"]

    waiting = _events(waiter, "waiting_for_compile")
    assert waiting, waiter.tail()
    assert all(w["holder"] == "a" for w in waiting)
    reported = [w for w in waiting if w["holder_progress"] != "not reported yet"]
    assert reported, f"the waiter never saw the holder's progress:\n{waiter.tail()}"
    assert reported[-1]["holder_eta_source"] == last["eta_source"]
    assert " CPU, " in reported[-1]["holder_progress"]
    assert not (root / "leases" / f"{summary['key']}.progress.json").exists()
    assert list((root / "leases").glob("*.progress.json")) == [], "the holder removes its record"


# --- a waiter never breaks on the record ---------------------------------------------------------------


@pytest.fixture
def held(pods: Cluster, root: Path) -> Iterator[tuple[CacheRoot, str, KeyLease, list[str]]]:
    """This test process holds the key's lease, as a compiling pod would."""
    record = pods.work / "compiler.jsonl"
    options = _options(record, seconds=0.2)
    digest = _digest(pods, root, options)
    cache = open_root(root, create=True)
    lease = KeyLease(cache, digest, PodIdentity.current({"POD_NAME": "holder"}), duration=30.0)

    class _Never:
        def is_set(self) -> bool:
            return False

    assert lease.wait_or_acquire(published=lambda: False, stop=_Never(), wait_timeout=5.0) == "acquired"
    try:
        yield cache, digest, lease, options
    finally:
        lease.release()


def _snapshot(digest: str, token: str | None, **changes: Any) -> Snapshot:
    fields: dict[str, Any] = {
        "key": digest, "token": token, "pod": "holder", "elapsed_s": 65.0, "cpu_seconds": 61.0,
        "staged_bytes": 3 * MiB, "expected_bytes": 8 * MiB, "expected_source": "learned from entry x",
        "eta_s": 600.0, "eta_source": "from entry 8f6aaebd05f3 compiled in 10m52s", "every_s": 1.0,
    }  # fmt: skip
    return Snapshot(**{**fields, **changes})


def _damage(kind: str, path: Path, tmp_path: Path, digest: str) -> None:
    """Put something that is not a usable record where the record goes."""
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    path.unlink(missing_ok=True)
    if kind == "missing":
        return
    if kind == "garbage":
        path.write_bytes(b"\x00{not json")
    elif kind == "huge":
        path.write_text(json.dumps({"key": digest, "pad": "x" * (RECORD_MAX + 10)}))
    elif kind == "wrong-types":
        path.write_text(
            json.dumps({"key": digest, "elapsed_s": "soon", "cpu_seconds": [], "staged_bytes": {}})
        )
    elif kind == "not-finite":
        path.write_text(f'{{"key": "{digest}", "elapsed_s": 1e999, "cpu_seconds": 1, "staged_bytes": 1}}')
    elif kind == "list":
        path.write_text("[1, 2, 3]")
    elif kind == "symlink":
        target = tmp_path / "elsewhere.json"
        target.write_text(json.dumps(_snapshot(digest, None).to_json()))
        path.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "earlier-holder":
        write_record(CacheRoot(path.parent.parent), _snapshot(digest, "an-earlier-token"))


DAMAGE = [
    "missing", "garbage", "huge", "wrong-types", "not-finite", "list", "symlink", "fifo", "directory",
    "earlier-holder",
]  # fmt: skip


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_reader_takes_a_bad_record_for_none(
    kind: str, held: tuple[CacheRoot, str, KeyLease, list[str]], tmp_path: Path
) -> None:
    cache, digest, lease, _ = held
    _damage(kind, record_path(cache, digest), tmp_path, digest)
    assert read_record(cache, digest, token=lease.token) is None


def test_a_waiter_never_breaks_on_a_missing_or_bad_record(
    pods: Cluster, held: tuple[CacheRoot, str, KeyLease, list[str]], tmp_path: Path
) -> None:
    cache, digest, lease, options = held
    path = record_path(cache, digest)
    waiter = pods.start(
        "w", server_argv(free_port()), cache_root=cache.path, options=options,
        env={"CACHEMGR_PROGRESS_INTERVAL": "0.5s"},
    )  # fmt: skip
    waiter.wait_phase("waiting")
    for kind in DAMAGE:
        _damage(kind, path, tmp_path, digest)
        seen = len(_events(waiter, "waiting_for_compile"))
        wait_for(
            lambda s=seen: len(_events(waiter, "waiting_for_compile")) > s + 1, what=f"lines after {kind}"
        )  # type: ignore[misc]
        assert _events(waiter, "waiting_for_compile")[-1]["holder_progress"] == "not reported yet", kind
        assert waiter.proc.poll() is None, f"the waiter died on a {kind} record:\n{waiter.tail()}"
    _damage("missing", path, tmp_path, digest)
    write_record(cache, _snapshot(digest, lease.token))
    line = wait_for(
        lambda: [e for e in _events(waiter, "waiting_for_compile") if "ETA" in e["holder_progress"]],
        what="the good record in a waiting line",
    )[-1]
    assert "1m05s in, 1m01s CPU, 3.0 MiB staged of ~8.0 MiB, ETA ~10m" in line["holder_progress"]
    assert line["holder_eta_source"] == "from entry 8f6aaebd05f3 compiled in 10m52s"

    locks = run_cli("locks", "-o", "json", env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(cache.path)})
    assert locks.returncode == 0, locks.stderr
    (lock,) = json.loads(locks.stdout)["items"]
    assert lock["progress"]["eta_source"] == line["holder_eta_source"]
    text = run_cli("locks", env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(cache.path)}).stdout
    assert f"{digest[:12]}  1m05s in, 1m01s CPU, 3.0 MiB staged of ~8.0 MiB, ETA ~10m" in text

    lease.release()  # the holder goes away without publishing: the waiter compiles, as it should
    waiter.wait_phase("serving")


def test_a_waiter_logs_once_per_30_seconds_by_default(
    pods: Cluster, held: tuple[CacheRoot, str, KeyLease, list[str]]
) -> None:
    cache, _, _, options = held
    waiter = pods.start("w", server_argv(free_port()), cache_root=cache.path, options=options)
    waiter.wait_phase("waiting")
    # The state is refreshed every 5 s while waiting: once it says 5 s, two notices have passed.
    wait_for(lambda: (waiter.state().get("detail") or {}).get("waited_s", 0) >= 5, what="a second notice")
    assert len(_events(waiter, "waiting_for_compile")) == 1, waiter.tail()


# --- terminals and pipes ------------------------------------------------------------------------------


def _run_on_pty(argv: list[str], env: dict[str, str], *, stdout_pipe: bool = False) -> tuple[int, str, str]:
    """Run with stderr (and stdout unless piped) on a pseudo-terminal; what each showed."""
    master, slave = pty.openpty()
    out = subprocess.PIPE if stdout_pipe else slave
    proc = subprocess.Popen(argv, env=env, stdin=slave, stdout=out, stderr=slave, close_fds=True)
    os.close(slave)
    shown = read_terminal(master, proc, deadline=60)
    stdout = proc.communicate(timeout=30)[0] if stdout_pipe else b""
    return proc.wait(timeout=30), shown.decode(errors="replace"), (stdout or b"").decode()


_BAR = re.compile(r"\d+%\|")


@pytest.fixture
def entries(pods: Cluster, root: Path) -> dict[str, str]:
    record = pods.work / "compiler.jsonl"
    for extra in ("", "--tensor-parallel-size 8"):
        _warm(pods, root, f"warm{len(extra)}", _options(record, seconds=0.1, size="2M", extra=extra))
    return {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root), "COLUMNS": "100"}


def test_verify_shows_a_bar_on_a_terminal_and_none_when_piped(entries: dict[str, str]) -> None:
    argv = [sys.executable, "-m", "cachemgr", "verify"]
    code, shown, _ = _run_on_pty(argv, entries)
    assert code == 0, shown
    assert _BAR.search(shown), shown
    assert "verify: 100%|" in shown, shown
    assert re.search(r"[0-9.]+[KMG]?i?B/s", shown), "the bar shows a rate"

    piped = run_cli("verify", env=entries)
    assert piped.returncode == 0, piped.stderr
    assert not _BAR.search(piped.stdout + piped.stderr), piped.stderr
    assert "\r" not in piped.stderr
    assert "verified 2 entries" in piped.stdout

    # -o json asks for JSON on stderr too (docs/reference.md): no bar, however the terminal looks.
    code, shown, stdout = _run_on_pty([*argv, "-o", "json"], entries, stdout_pipe=True)
    assert code == 0
    assert json.loads(stdout)["checked"] == 2
    assert not _BAR.search(shown), shown
    assert all(json.loads(line) for line in shown.splitlines() if line.strip()), shown


def test_verify_off_a_terminal_logs_progress_events(entries: dict[str, str]) -> None:
    env = {**entries, "CACHEMGR_PROGRESS_INTERVAL": "0.001s", "CACHEMGR_LOG_FORMAT": "json"}
    piped = run_cli("verify", "-o", "json", env=env)
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout)["checked"] == 2
    events = [json.loads(line) for line in piped.stderr.splitlines() if line.startswith("{")]
    progress = [e for e in events if e["event"] == "verify_progress"]
    assert progress, piped.stderr
    total = json.loads(piped.stdout)["checked_bytes"]
    assert progress[-1]["total_bytes"] <= total
    assert progress[-1]["done_bytes"] <= total
    assert progress[-1]["total_bytes"] > total - 64 * 1024, (
        "the summaries' sizes: all but key.json and summary.json"
    )


def test_prune_yes_shows_a_bar_on_a_terminal(entries: dict[str, str]) -> None:
    env = {**entries, "CACHEMGR_COMPILER_VERSION": "0.13.0"}
    argv = [sys.executable, "-m", "cachemgr", "prune", "--incompatible", "--yes"]
    code, shown, _ = _run_on_pty(argv, env)
    assert code == 0, shown
    assert "prune: 100%|" in shown, shown
    assert "removed 2 items" in shown


# --- disk full: figures that agree -------------------------------------------------------------------


def test_disk_full_report_figures_agree_and_the_next_preflight_knows_the_size(
    pods: Cluster, tmpfs_small: Callable[[int], Path]
) -> None:
    root = tmpfs_small(6 * MiB)
    record = pods.work / "compiler.jsonl"
    _warm(pods, root, "earlier", _options(record, seconds=0.1, size="512k", extra="--tensor-parallel-size 8"))
    st = os.statvfs(root)
    free_before = st.f_bavail * st.f_frsize
    options = [*_options(record, seconds=0.2, size="16M"), "--space-check", "warn"]
    pod = pods.start("a", server_argv(free_port()), cache_root=root, options=options)
    assert pod.wait_exit() == 73, pod.tail()
    (failure,) = [json.loads(p.read_text()) for p in (root / "failures").rglob("*.json")]
    report = failure["report"]

    # Free at the start: what the volume had before the pod (less its lease and staging records).
    assert 0 <= free_before - report["free_at_start_bytes"] <= 64 * 1024, report
    # What the attempt wrote: no more than was free, and it filled the volume to the last pages.
    assert report["written_bytes"] == failure["bytes_written"]
    assert (
        report["free_at_start_bytes"] - 256 * 1024 <= report["written_bytes"] <= report["free_at_start_bytes"]
    )
    # The estimate (another configuration's entry) was lower: the advice uses the space filled.
    assert report["expected_bytes"] < report["written_bytes"]
    assert report["expected_source"].startswith("learned from entry")
    assert report["filled_bytes"] == max(report["written_bytes"], report["free_at_start_bytes"])
    assert report["needed_bytes"] == max(report["expected_bytes"], report["filled_bytes"])
    assert report["needed_source"].startswith("the space the attempt filled; the estimate was")
    # Free now: measured after the attempt was removed, so about what was free at the start.
    assert abs(report["free_bytes"] - report["free_at_start_bytes"]) <= 64 * 1024
    message = failure["message"]
    for figure in ("free_at_start_bytes", "written_bytes", "total_bytes", "expected_bytes"):
        assert human_bytes(report[figure]) in message, (figure, message)
    assert f"needs more than {human_bytes(report['needed_bytes'])}" in message
    assert (
        f"were free when the compile started, the attempt was seen writing {human_bytes(report['written_bytes'])}"
        in message
    )
    assert f"Give it more than {human_bytes(report['needed_bytes'])} of free space" in message

    # The next start learns the real size from the failed attempt and stops before compiling.
    before = compiles(record)
    pod = pods.start("b", server_argv(free_port()), cache_root=root, options=options[:-2])
    assert pod.wait_exit() == 73, pod.tail()
    assert compiles(record) == before, "the preflight stopped it"
    preflight = [e for e in pod.log_events() if e["event"] == "space_preflight"][-1]
    assert preflight["expected_bytes"] == max(report["written_bytes"], report["free_at_start_bytes"])
    assert preflight["expected_source"] == (
        f"an earlier attempt filled the {human_bytes(report['free_at_start_bytes'])} that were free when it started"
    )
    message = (pod.state_dir / "termination-log").read_text()
    assert f"needs more than {human_bytes(preflight['expected_bytes'])}" in message, message


def test_a_compiler_that_removes_its_partial_output_still_proves_the_volume_too_small(
    pods: Cluster, tmpfs_small: Callable[[int], Path]
) -> None:
    """optimum-rbln's save_pretrained deletes its .tmp copy when the copy fails for space
    (optimum/rbln/modeling_base.py:719-723): staging is empty when the attempt ends, yet the
    compile filled the volume. The report and the next preflight must not believe the estimate."""
    root = tmpfs_small(30 * MiB)
    earlier = pods.start(
        # A warm Job on a CPU node compiles only on vllm-rbln's vLLM-model path (cachemgr.key.vllm_rbln).
        "earlier", vllm_argv(free_port(), "--tensor-parallel-size", "8", "--model-impl", "vllm"),
        cache_root=root, command="warm",
        env={"STANDIN_ARTIFACT_BYTES": str(8 * MiB), "STANDIN_COMPILE_SECONDS": "0.2"},
    )  # fmt: skip
    assert earlier.wait_exit() == 0, earlier.tail()
    env = {"STANDIN_ARTIFACT_BYTES": str(64 * MiB), "STANDIN_COMPILE_SECONDS": "0.2"}
    pod = pods.start("a", vllm_argv(free_port()), cache_root=root, env=env)
    assert pod.wait_exit() == 73, pod.tail()
    (failure,) = [json.loads(p.read_text()) for p in (root / "failures").rglob("*.json")]
    report = failure["report"]
    assert report["expected_bytes"] < 9 * MiB, "the estimate came from the 8 MiB entry"
    assert report["needed_bytes"] == report["filled_bytes"] >= report["free_at_start_bytes"] > 20 * MiB
    message = failure["message"]
    assert f"needs more than {human_bytes(report['needed_bytes'])}" in message
    # One line a person reads: the figures and the remedy, not copytree's list of every file.
    assert "printed 'No space left on device'" in message, message
    assert "shutil" not in message, message
    assert "[(" not in message, message
    assert "seen writing 0 B" not in message, "a figure of nothing explains nothing"
    # ~525 characters; ~40 more when the volume's free space had not come back yet as it was
    # measured (", 21.8 MiB free now that it is removed"): a loaded machine, still one line.
    assert len(message.replace(str(root), "/var/cache/cachemgr")) < 600, (len(message), message)
    assert "shutil.Error" in report["printed"], "the details stay in the report (log event, failure record)"

    pod = pods.start("b", vllm_argv(free_port()), cache_root=root, env=env)
    assert pod.wait_exit() == 73, pod.tail()
    message = (pod.state_dir / "termination-log").read_text()
    assert "(checked before compiling)" in message, "the next start stops before compiling"
    assert f"needs more than {human_bytes(report['filled_bytes'])} (an earlier attempt filled" in message


def test_warm_shows_a_bar_of_the_compile_on_a_terminal(pods: Cluster, root: Path) -> None:
    record = pods.work / "compiler.jsonl"
    _warm(pods, root, "earlier", _options(record, seconds=0.1, size="2M", extra="--tensor-parallel-size 8"))
    env = {
        **{k: v for k, v in pods.base_env.items() if k != "CACHEMGR_LOG_FORMAT"},  # console on a terminal
        "CACHEMGR_CACHE_ROOT": str(root),
        "CACHEMGR_STATE_DIR": str(pods.work / "warm-state"),
    }
    argv = [sys.executable, "-m", "cachemgr", "warm", *_options(record, seconds=1.0, size="2M")]
    code, shown, _ = _run_on_pty([*argv, "--", *server_argv(8000)], env)
    assert code == 0, shown
    assert "compiling: " in shown, shown
    assert "100%|" in shown, "the bar reaches the expected size, learned from the earlier entry"
    assert "key_resolved" in shown, "log lines still reach the terminal"
    # The pod's JSON log on a terminal stays JSON: events, no bar (every line parses).
    code, shown, _ = _run_on_pty([*argv, "--log-format", "json", "--", *server_argv(8001)], env)
    assert code == 0, shown
    assert "100%|" not in shown, shown
    assert "compiling: " not in shown, shown


def test_a_record_not_refreshed_is_shown_as_of_when_it_was_written(
    held: tuple[CacheRoot, str, KeyLease, list[str]],
) -> None:
    cache, digest, lease, _ = held
    write_record(cache, _snapshot(digest, lease.token))
    fresh = read_record(cache, digest, token=lease.token)
    assert fresh is not None
    assert not fresh.stale
    past = time.time() - 120
    os.utime(record_path(cache, digest), (past, past))
    seen = read_record(cache, digest, token=lease.token)
    assert seen is not None
    assert seen.stale, "three of its 1 s periods (and 5 s of slack) went by without a rewrite"
    assert seen.describe().endswith("[as of 2m00s ago: not refreshed since]")
