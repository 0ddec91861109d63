"""``cachemgr run`` / ``warm`` with real processes on a local directory.

The cross-node cases (two JuiceFS mounts) are in test_run_juicefs.py; both share the
scenarios in scenarios.py.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from cachemgr_testkit.podlib import STANDIN_COMPILER, Cluster, free_port, read_jsonl, run_cli, wait_for
from cachemgr_testkit.scenarios import (
    assert_clean_after_failure,
    compile_cmd,
    entry_dirs,
    server_argv,
    vllm_argv,
)

from cachemgr.volume.manifest import read_manifest


def test_eight_concurrent_runs_compile_once_and_read_identical_artifacts(pods: Cluster, root: Path) -> None:
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=1.0)]
    started = [
        pods.start(f"p{i}", server_argv(port := free_port()), cache_root=root, options=options)
        for i in range(8)
    ]
    del port
    for pod in started:
        pod.wait_phase("serving")
    assert len([e for e in read_jsonl(record) if e["event"] == "compile"]) == 1
    loads = [e for e in pods.record if e["event"] == "load"]
    assert len(loads) == 8
    assert len({e["digest"] for e in loads}) == 1, "every server must read the same bytes"
    for pod in started:
        pod.signal(signal.SIGTERM)
        assert pod.wait_exit() == 0

    second = [
        pods.start(f"q{i}", server_argv(free_port()), cache_root=root, options=options) for i in range(8)
    ]
    for pod in second:
        pod.wait_phase("serving")
    assert len([e for e in read_jsonl(record) if e["event"] == "compile"]) == 1, (
        "a warm round compiles nothing"
    )
    assert len(entry_dirs(root)) == 1


def test_failed_compile_leaves_a_record_and_no_entry_then_the_next_start_compiles(
    pods: Cluster, root: Path
) -> None:
    record = pods.work / "compiler.jsonl"
    failing = ["--strategy", "command", "--compile-cmd", compile_cmd(record, extra="--fail-with 3")]
    pod = pods.start("a", server_argv(free_port()), cache_root=root, options=failing)
    assert pod.wait_exit() == 70
    assert entry_dirs(root) == []
    assert_clean_after_failure(root)
    failures = [read_jsonl_one(p) for p in (root / "failures").rglob("*.json")]
    assert len(failures) == 1
    assert failures[0]["reason"] == "compile-failed"
    assert failures[0]["exit_status"] == 3
    assert any("stand-in" in line.lower() or "fail" in line.lower() for line in failures[0]["output_tail"])
    assert "exited with code 3" in (pod.state_dir / "termination-log").read_text()

    good = ["--strategy", "command", "--compile-cmd", compile_cmd(record)]
    pod = pods.start("b", server_argv(free_port()), cache_root=root, options=good)
    pod.wait_phase("serving")
    assert len(entry_dirs(root)) == 1


def read_jsonl_one(path: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads(path.read_text())
    return data


def test_truncated_file_in_entry_is_quarantined_and_recompiled(pods: Cluster, root: Path) -> None:
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record)]
    first = pods.start("a", server_argv(free_port()), cache_root=root, options=options, command="warm")
    assert first.wait_exit() == 0
    (entry,) = entry_dirs(root)
    victim = next(p for p in (entry / "artifacts").rglob("*.rbln"))
    os.chmod(victim, 0o644)
    with victim.open("r+b") as handle:
        handle.truncate(victim.stat().st_size // 2)

    pod = pods.start("b", server_argv(free_port()), cache_root=root, options=options)
    pod.wait_phase("serving")
    assert len([e for e in read_jsonl(record) if e["event"] == "compile"]) == 2
    quarantined = [p for p in (root / "quarantine").iterdir() if p.is_dir()]
    assert len(quarantined) == 1
    (fresh,) = entry_dirs(root)
    manifest = read_manifest(fresh)
    assert all((fresh / f.path).stat().st_size == f.size for f in manifest.files)
    assert any(e["event"] == "entry_damaged" for e in pod.log_events())


def test_signals_reach_the_server_and_its_exit_code_comes_back(pods: Cluster, root: Path) -> None:
    pod = pods.start("a", vllm_argv(free_port()), cache_root=root, env={"STANDIN_EXIT_CODE": "7"})
    pod.wait_phase("serving")
    pod.signal(signal.SIGHUP)
    wait_for(lambda: "SIGHUP" in _signals(pods), what="the server to log SIGHUP")
    assert pod.proc.poll() is None, "SIGHUP is forwarded, not a reason to stop"
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 7
    assert "SIGTERM" in _signals(pods)

    pod = pods.start("b", vllm_argv(free_port()), cache_root=root)
    pod.wait_phase("serving")
    pod.signal(signal.SIGQUIT)
    assert pod.wait_exit() == 128 + signal.SIGQUIT


def _signals(pods: Cluster) -> str:
    path = pods.work / "signals.log"
    return path.read_text() if path.exists() else ""


def test_sigterm_while_waiting_leaves_nothing_behind(pods: Cluster, root: Path) -> None:
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=30.0)]
    holder = pods.start("holder", server_argv(free_port()), cache_root=root, options=options)
    holder.wait_phase("compiling")
    waiter = pods.start("waiter", server_argv(free_port()), cache_root=root, options=options)
    waiter.wait_phase("waiting")
    waiter.signal(signal.SIGTERM)
    assert waiter.wait_exit(timeout=5) == 128 + signal.SIGTERM
    usage = list((root / "usage").rglob("waiter.*"))
    assert usage == []
    staging = list((root / "staging").rglob("waiter.*"))
    assert staging == []
    assert holder.phase == "compiling", "the holder is unaffected"


def test_sigterm_while_compiling_removes_staging_and_releases_the_lease(pods: Cluster, root: Path) -> None:
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=30.0)]
    pod = pods.start("a", server_argv(free_port()), cache_root=root, options=options)
    pod.wait_phase("compiling")
    wait_for(lambda: read_jsonl(record), what="the compiler to start")
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit(timeout=15) == 128 + signal.SIGTERM
    assert_clean_after_failure(root)
    assert entry_dirs(root) == []
    assert list((root / "failures").rglob("*.json")) == [], "a stop by signal is not a failed compile"


def test_on_miss_fail_exits_69_and_warm_fills_the_cache(pods: Cluster, root: Path) -> None:
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record)]
    pod = pods.start("a", server_argv(free_port()), cache_root=root, options=[*options, "--on-miss", "fail"])
    assert pod.wait_exit() == 69
    assert "--on-miss fail" in (pod.state_dir / "termination-log").read_text()

    warm = pods.start("job", server_argv(free_port()), cache_root=root, options=options, command="warm")
    assert warm.wait_exit() == 0
    again = pods.start("job2", server_argv(free_port()), cache_root=root, options=options, command="warm")
    assert again.wait_exit() == 0
    assert len([e for e in read_jsonl(record) if e["event"] == "compile"]) == 1

    pod = pods.start("b", server_argv(free_port()), cache_root=root, options=[*options, "--on-miss", "fail"])
    pod.wait_phase("serving")


def test_wait_timeout_exits_75_naming_the_holder(pods: Cluster, root: Path) -> None:
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=30.0)]
    holder = pods.start("holder", server_argv(free_port()), cache_root=root, options=options)
    holder.wait_phase("compiling")
    waiter = pods.start(
        "waiter", server_argv(free_port()), cache_root=root, options=[*options, "--wait-timeout", "1"]
    )
    assert waiter.wait_exit() == 75
    message = (waiter.state_dir / "termination-log").read_text()
    assert "pod holder" in message
    assert "--wait-timeout" in message


def test_a_newer_layout_is_refused(pods: Cluster, root: Path) -> None:
    (root / "cachemgr-layout.json").write_text(json.dumps({"layout": 99}))
    result = run_cli("key", "--", *vllm_argv(8000), env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)})
    assert result.returncode == 0, "key does not touch the volume"
    pod = pods.start("a", vllm_argv(free_port()), cache_root=root)
    assert pod.wait_exit() == 74
    message = (pod.state_dir / "termination-log").read_text()
    assert "newer cachemgr" in message
    assert "cachemgr-layout.json" in message, "the record that says so is named"


def test_missing_cache_root_is_a_clear_error(pods: Cluster, tmp_path: Path) -> None:
    pod = pods.start("a", vllm_argv(free_port()), cache_root=tmp_path / "not-mounted")
    assert pod.wait_exit() == 74
    text = (pod.state_dir / "termination-log").read_text()
    assert "does not exist" in text
    assert "Mount the compile cache PVC" in text


def test_vllm_strategy_four_pods_one_compile_entry_stays_byte_identical(pods: Cluster, root: Path) -> None:
    started = [pods.start(f"p{i}", vllm_argv(free_port()), cache_root=root) for i in range(4)]
    for pod in started:
        pod.wait_phase("serving")
    assert pods.compiles() == 1
    (entry,) = entry_dirs(root)
    before = {p: p.read_bytes() for p in entry.rglob("*") if p.is_file()}
    for pod in started:
        pod.signal(signal.SIGTERM)
        assert pod.wait_exit() == 0
    for i in range(12):
        pod = pods.start(f"hit{i}", vllm_argv(free_port()), cache_root=root)
        pod.wait_phase("serving")
        pod.signal(signal.SIGTERM)
        assert pod.wait_exit() == 0
    assert pods.compiles() == 1
    saves = [e for e in pods.record if e["event"] == "save"]
    assert saves, "the stand-in saves its bundle again after each warm-up, as vllm-rbln does"
    after = {p: p.read_bytes() for p in entry.rglob("*") if p.is_file()}
    assert after == before, "a published entry never changes, whatever the server writes"
    assert run_cli("verify", env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)}).returncode == 0


def test_vllm_server_killed_before_healthy_publishes_nothing(pods: Cluster, root: Path) -> None:
    pod = pods.start("a", vllm_argv(free_port()), cache_root=root, env={"STANDIN_EXIT_BEFORE_HEALTHY": "-9"})
    assert pod.wait_exit() == 70
    assert entry_dirs(root) == []
    assert_clean_after_failure(root)
    pod = pods.start("b", vllm_argv(free_port()), cache_root=root)
    pod.wait_phase("serving")
    assert len(entry_dirs(root)) == 1


def test_vllm_compile_only_warm_job_publishes(pods: Cluster, root: Path) -> None:
    """A CPU node (no device: RBLN_FORCE_NPU_NAME) compiles the vLLM-model path only."""
    cpu_node = {"VLLM_RBLN_COMPILE_ONLY": "1", "STANDIN_NPU_NAME": "none", "RBLN_FORCE_NPU_NAME": "RBLN-CA25"}
    job = pods.start(
        "warm-job",
        vllm_argv(free_port(), "--model-impl", "vllm"),
        cache_root=root,
        command="warm",
        env=cpu_node,
    )
    assert job.wait_exit() == 0
    assert len(entry_dirs(root)) == 1
    pod = pods.start("a", vllm_argv(free_port(), "--model-impl", "vllm"), cache_root=root)
    pod.wait_phase("serving")
    assert len({e["pid"] for e in pods.record if e["event"] == "compile"}) == 1


def test_compile_cmd_must_name_output_dir(pods: Cluster, root: Path) -> None:
    result = run_cli(
        "run", "--strategy", "command", "--compile-cmd", STANDIN_COMPILER, "--", *server_argv(8000),
        env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)},
    )  # fmt: skip
    assert result.returncode == 64
    assert "{output_dir}" in result.stderr


def test_a_later_holder_cleans_the_staging_of_a_dead_attempt(pods: Cluster, root: Path) -> None:
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=None)]
    dead = pods.start(
        "dead",
        server_argv(free_port()),
        cache_root=root,
        options=options,
        env={"STANDIN_COMPILE_SECONDS": "120"},
    )
    dead.wait_phase("compiling")
    wait_for(lambda: list((root / "staging").rglob("dead.*")), what="the dead pod's staging")
    dead.signal_pod(signal.SIGKILL)
    dead.wait_exit()
    assert list((root / "staging").rglob("dead.*")), "a SIGKILLed pod leaves its attempt behind"

    pod = pods.start("next", server_argv(free_port()), cache_root=root, options=options)
    pod.wait_phase("serving")
    assert list((root / "staging").rglob("dead.*")) == [], "the next holder removed the dead attempt"
    assert any(e["event"] == "stale_staging_removed" for e in pod.log_events())
