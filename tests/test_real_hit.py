"""A hit is a real hit (issue 13): against the stand-in, which behaves as vllm-rbln 0.12 does.

- nothing without loadable artifacts is ever published, for either strategy;
- ``warm`` on a node without an NPU refuses a model the optimum path would compile, up front;
- ``recompiled_on_hit`` fires when the server compiles after a hit (the stand-in made to drift
  from what cachemgr was told), and never on a true hit, whose bundle is saved again;
- the optimum path's $TMPDIR copy is checked before compiling.
"""

from __future__ import annotations

import json
import signal
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.podlib import Cluster, Pod, free_port, run_cli, wait_for
from cachemgr_testkit.scenarios import entry_dirs, vllm_argv
from prometheus_client.parser import text_string_to_metric_families

CPU_NODE = {"STANDIN_NPU_NAME": "none", "RBLN_FORCE_NPU_NAME": "RBLN-CA25", "VLLM_RBLN_COMPILE_ONLY": "1"}


def _events(pods: Cluster, name: str, event: str) -> list[dict[str, Any]]:
    (pod,) = [p for p in pods.pods if p.name == name]
    return [e for e in pod.log_events() if e["event"] == event]


def _compiles(pods: Cluster) -> int:
    """Server processes that compiled (the vLLM-model path records one compile per rank)."""
    return len({e["pid"] for e in pods.record if e["event"] == "compile"})


def _inspect(pods: Cluster, root: Path, *args: str) -> str:
    done = run_cli(*args, env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def _recompiled_total(port: int, name: str = "cachemgr_recompiled_on_hit_total") -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:  # loopback
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"no {name} in /metrics")


# --- warm on a CPU node -------------------------------------------------------------------------


def test_warm_without_an_npu_refuses_optimum_path_models_and_compiles_vllm_path_ones(
    pods: Cluster, root: Path
) -> None:
    for name, extra in (("auto", ()), ("optimum", ("--model-impl", "optimum"))):
        job = pods.start(
            f"warm-{name}", vllm_argv(free_port(), *extra), cache_root=root, command="warm", env=CPU_NODE
        )
        assert job.wait_exit() == 78
        message = (job.state_dir / "termination-log").read_text()
        assert "without an NPU" in message
        assert "Run the warm Job on an NPU node" in message
    assert _compiles(pods) == 0
    assert entry_dirs(root) == []
    vllm_path = ("--model-impl", "vllm")
    job = pods.start(
        "warm-vllm", vllm_argv(free_port(), *vllm_path), cache_root=root, command="warm", env=CPU_NODE
    )
    assert job.wait_exit() == 0
    (entry,) = entry_dirs(root)
    assert list((entry / "artifacts" / "rbln").rglob("mega_cache.bin")), "the vLLM-model path's bundles"
    # A serving pod on an NPU node (the stand-in's device answers RBLN-CA25): a true hit.
    pod = pods.start("serve", vllm_argv(free_port(), *vllm_path), cache_root=root)
    pod.wait_phase("serving")
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0
    assert _compiles(pods) == 1
    assert _events(pods, "serve", "recompiled_on_hit") == []


def test_the_stand_in_optimum_path_cannot_compile_without_a_device(pods: Cluster, root: Path) -> None:
    """As optimum-rbln checks the devices before compiling, compile-only or not."""
    pod = pods.start("cpu", vllm_argv(free_port()), cache_root=root, env=CPU_NODE)
    assert pod.wait_exit() == 70
    assert "not a valid NPU device" in pod.tail(80)
    assert entry_dirs(root) == []


# --- nothing loadable, nothing published --------------------------------------------------------


def test_a_server_that_saves_nothing_serves_on_and_publishes_nothing(pods: Cluster, root: Path) -> None:
    argv = vllm_argv(free_port(), "--model-impl", "vllm", "--enforce-eager")
    explained = run_cli("explain", "--", *argv, env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)})
    assert "cannot be cached: --enforce-eager" in explained.stdout
    pod = pods.start("eager", argv, cache_root=root)
    pod.wait_phase("serving")
    (warning,) = _events(pods, "eager", "not_published")
    assert "no rbln/**/rank*/mega_cache.bin" in str(warning["reason"])
    assert "--enforce-eager" in str(warning["cause"])
    assert entry_dirs(root) == []
    # The lease went with the decision: a second pod compiles for itself instead of waiting.
    other = pods.start(
        "eager-2", vllm_argv(free_port(), "--model-impl", "vllm", "--enforce-eager"), cache_root=root
    )
    other.wait_phase("serving")
    assert entry_dirs(root) == []


def test_a_compile_only_job_that_saves_nothing_fails_and_publishes_nothing(pods: Cluster, root: Path) -> None:
    env = {**CPU_NODE, "VLLM_RBLN_ENABLE_WARM_UP": "0"}
    job = pods.start(
        "warm", vllm_argv(free_port(), "--model-impl", "vllm"), cache_root=root, command="warm", env=env
    )
    assert job.wait_exit() == 70
    line = (job.state_dir / "termination-log").read_text()
    assert "saved no compiled model" in line
    assert "VLLM_RBLN_ENABLE_WARM_UP is off" in line
    assert entry_dirs(root) == []


def test_a_compile_command_that_writes_nothing_publishes_nothing(pods: Cluster, root: Path) -> None:
    options = ["--strategy", "command", "--compile-cmd", "sh -c 'mkdir -p \"$0/empty\"' {output_dir}"]
    pod = pods.start("cmd", ["vllm", "serve", "{artifact_dir}", "--port", str(free_port())], cache_root=root,
                     options=options)  # fmt: skip
    assert pod.wait_exit() == 70
    assert "wrote no file" in (pod.state_dir / "termination-log").read_text()
    assert entry_dirs(root) == []


# --- recompiled_on_hit ----------------------------------------------------------------------------


def test_a_bundle_re_saved_as_other_bytes_of_its_size_is_said_apart_not_the_alarm(
    pods: Cluster, root: Path
) -> None:
    """A server whose bundle is not byte-stable (each save stamped) re-saves the same graphs as other
    bytes of the same size on every hit: an info event counted apart, never recompiled_on_hit."""
    stamped = {"STANDIN_BUNDLE_STAMP": "1"}
    argv = vllm_argv(free_port(), "--model-impl", "vllm")
    first = pods.start("first", argv, cache_root=root, env=stamped)
    first.wait_phase("serving")
    first.signal(signal.SIGTERM)
    assert first.wait_exit() == 0
    status = free_port()
    argv = vllm_argv(free_port(), "--model-impl", "vllm")
    again = pods.start("again", argv, cache_root=root, options=["--status-port", str(status)], env=stamped)
    (event,) = wait_for(lambda: _events(pods, "again", "resaved_on_hit"), what="the resaved_on_hit event")
    assert event["level"] == "info", event
    assert len(event["paths"]) == 4, "one bundle per rank of -tp 4"
    assert all("re-saved with other content, same size" in p for p in event["paths"]), event["paths"]
    assert _recompiled_total(status, "cachemgr_resaved_on_hit_total") == 1.0
    assert _recompiled_total(status) == 0.0
    again.signal(signal.SIGTERM)
    assert again.wait_exit() == 0
    assert _events(pods, "again", "recompiled_on_hit") == [], "not the alarm"
    assert _compiles(pods) == 1, "it compiled nothing"
    assert "RECOMPILED ON HIT" not in _inspect(pods, root, "ls")


def test_recompiled_on_hit_fires_on_drift_and_never_on_a_true_hit(pods: Cluster, root: Path) -> None:
    def start(name: str, **env: str) -> tuple[Pod, int]:
        status = free_port()
        argv = vllm_argv(free_port(), "--model-impl", "vllm")
        pod = pods.start(name, argv, cache_root=root, options=["--status-port", str(status)], env=env)
        pod.wait_phase("serving")
        return pod, status

    first, _ = start("first")
    first.signal(signal.SIGTERM)
    assert first.wait_exit() == 0
    # A true hit: the server loads the bundle and saves it again (tmp file + rename) after warm-up.
    saved = sum(1 for e in pods.record if e["event"] == "save")
    true_hit, status = start("true-hit")
    wait_for(lambda: sum(1 for e in pods.record if e["event"] == "save") > saved, what="the re-save")
    true_hit.signal(signal.SIGTERM)
    assert true_hit.wait_exit() == 0
    assert _events(pods, "true-hit", "recompiled_on_hit") == []
    assert _compiles(pods) == 1
    # Drift: the server runs vLLM 0.30.1 while cachemgr was told 0.30.0+cpu, so the key matches an
    # entry whose bundle signature is not the server's; it compiles a new bundle beside it.
    drifted, status = start("drifted", STANDIN_VLLM_VERSION="0.30.1")
    (event,) = wait_for(
        lambda: _events(pods, "drifted", "recompiled_on_hit"), what="the recompiled_on_hit event"
    )
    assert _compiles(pods) == 2
    paths = [str(p) for p in event["new_paths"]]
    assert paths
    assert all(p.startswith("rbln/") and p.endswith("/mega_cache.bin") for p in paths), paths
    assert event["entry"] == entry_dirs(root)[0].name
    assert _recompiled_total(status) == 1.0
    assert drifted.phase == "serving", "the server keeps running"
    listing = json.loads(_inspect(pods, root, "ls", "-o", "json"))
    (row,) = [r for r in listing if r["kind"] == "entry"]
    assert row["recompiled_on_hit"] == 1
    assert "RECOMPILED ON HIT" in _inspect(pods, root, "ls")
    shown = _inspect(pods, root, "show", row["short"])
    assert "RECOMPILED ON HIT (1)" in shown
    assert paths[0] in shown
    explained = _inspect(pods, root, "explain", "--", *vllm_argv(free_port(), "--model-impl", "vllm"))
    assert "recompiled_on_hit: 1 pod start(s)" in explained
    drifted.signal(signal.SIGTERM)
    assert drifted.wait_exit() == 0
    assert len(_events(pods, "drifted", "recompiled_on_hit")) == 1, "once per new path"


@pytest.mark.quick
def test_recompiled_on_hit_ignores_tmp_files_and_modelinfos(tmp_path: Path) -> None:
    """Unit: what the watcher counts, on a real view built from a real manifest."""
    from cachemgr.core.fsutil import hash_file
    from cachemgr.volume.drift import new_artifacts
    from cachemgr.volume.manifest import FileRecord, Manifest

    view = tmp_path / "view"
    bundle = "rbln/m-1/sig/rank0/mega_cache.bin"
    for rel in (bundle, "modelinfos/x.json", f"{bundle}.123.tmp", "compiled_models/m_a.tmp/graph.rbln"):
        (view / rel).parent.mkdir(parents=True, exist_ok=True)
        (view / rel).write_bytes(b"x")
    # the bundle re-saved at its own path with the bytes it was published with: the same graphs
    record = FileRecord(f"artifacts/{bundle}", 1, hash_file(view / bundle))
    manifest = Manifest("0" * 32, {}, (record,), 0.0, {}, 0.0, "vllm")
    assert new_artifacts(view, manifest).compiled == []
    for rel in ("rbln/m-1/other/rank0/mega_cache.bin", "compiled_models/m_b/rbln_config.json"):
        (view / rel).parent.mkdir(parents=True, exist_ok=True)
        (view / rel).write_bytes(b"x")
    assert new_artifacts(view, manifest).compiled == [
        "compiled_models/m_b/rbln_config.json",
        "rbln/m-1/other/rank0/mega_cache.bin",
    ]


# --- the $TMPDIR copy -------------------------------------------------------------------------------


def test_the_optimum_compile_needs_room_in_tmpdir(
    pods: Cluster, root: Path, tmpfs_small: Callable[[int], Path]
) -> None:
    tmp = tmpfs_small(1 << 20)
    argv = vllm_argv(free_port(), "--model-impl", "optimum")
    pod = pods.start(
        "tmp", argv, cache_root=root, options=["--expected-size", "8M"], env={"TMPDIR": str(tmp)}
    )
    assert pod.wait_exit() == 73
    line = (pod.state_dir / "termination-log").read_text()
    assert f"temporary directory {tmp}" in line
    assert "emptyDir" in line
    assert _compiles(pods) == 0
    # With room in $TMPDIR the same pod compiles and publishes.
    roomy = tmpfs_small(64 << 20)
    pod = pods.start(
        "roomy", argv, cache_root=root, options=["--expected-size", "8M"], env={"TMPDIR": str(roomy)}
    )
    pod.wait_phase("serving")
    assert len(entry_dirs(root)) == 1
