"""The key against the stand-in server, which keys its own cache as vllm-rbln 0.12 does (issue 23).

The stand-in's signatures follow the real code (cachemgr_standin.signature), not cachemgr's, so:

- a false hit shows as a pod that cachemgr sends to an entry and whose server compiles anyway
  (``recompiled_on_hit``); closed, the pod misses, compiles once and publishes its own entry;
- a needless miss shows as a compile for an entry that was there; stopped, the pod hits and its
  server loads without compiling;
- a server that finds graphs missing from the bundle it loaded compiles them into the same bundle:
  the grown re-save raises ``recompiled_on_hit`` too.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.podlib import Cluster, Pod, free_port, wait_for
from cachemgr_testkit.scenarios import entry_dirs, vllm_argv


def _events(pod: Pod, event: str) -> list[dict[str, Any]]:
    return [e for e in pod.log_events() if e["event"] == event]


def _phases(pod: Pod) -> list[str]:
    return [str(e.get("to")) for e in _events(pod, "phase")]


def _compile_pids(pods: Cluster) -> set[int]:
    return {e["pid"] for e in pods.record if e["event"] == "compile"}


def _serve(pods: Cluster, root: Path, name: str, *extra: str, env: dict[str, str] | None = None) -> Pod:
    pod = pods.start(
        name,
        vllm_argv(free_port(), *extra),
        cache_root=root,
        env={"HF_HOME": str(root.parent / "hf"), **(env or {})},
    )
    assert pod.wait_phase("serving", "failed", "stopped") == "serving", pod.tail()
    return pod


def _stop(pod: Pod) -> None:
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0, pod.tail()


def test_inputs_the_server_compiles_from_miss_instead_of_recompiling_on_a_hit(
    pods: Cluster, root: Path
) -> None:
    _stop(_serve(pods, root, "base-vllm", "--model-impl", "vllm"))
    _stop(_serve(pods, root, "base-auto"))  # auto: the stand-in takes the optimum path
    # The path a parent process resolved, under auto (envs.py 167-185, config.py 428-434): the server
    # compiles for the vLLM-model path, so the key is base-vllm's (a true hit), never base-auto's.
    inherited = _serve(pods, root, "inherited-path", env={"_VLLM_RBLN_RESOLVED_MODEL_IMPL": "vllm"})
    _stop(inherited)  # the drift check runs once more at exit: what it saw is in the log now
    assert _events(inherited, "recompiled_on_hit") == [], "a false hit on the optimum entry"
    assert "compiling" not in _phases(inherited)
    variants: list[tuple[str, dict[str, str]]] = [
        # the attention backend (vLLM config/model.py 1926-1927): no hash of the server covers it
        ("mla-off", {"VLLM_MLA_DISABLE": "1"}),
        # data parallelism from the environment (vLLM config/parallel.py 934-940): another rank<N>
        ("dp-rank-1", {"VLLM_DP_SIZE": "2", "VLLM_DP_RANK": "1"}),
        # an image with another transformers: the hashed hf_config carries its version
        (
            "transformers",
            {"CACHEMGR_TRANSFORMERS_VERSION": "5.16.0", "STANDIN_TRANSFORMERS_VERSION": "5.16.0"},
        ),
    ]
    for count, (name, env) in enumerate(variants, start=3):
        before = _compile_pids(pods)
        pod = _serve(pods, root, name, "--model-impl", "vllm", env=env)
        _stop(pod)
        assert _events(pod, "recompiled_on_hit") == [], f"{name}: a false hit on base-vllm's entry"
        assert "compiling" in _phases(pod), f"{name}: a miss"
        assert len(_compile_pids(pods) - before) == 1, f"{name}: one compile, its own"
        assert len(entry_dirs(root)) == count, f"{name}'s own entry"


def test_settings_the_server_reads_as_one_hit_and_load_without_compiling(pods: Cluster, root: Path) -> None:
    _stop(_serve(pods, root, "base", "--model-impl", "vllm", "--rbln-use-custom-kernel"))
    compiled = _compile_pids(pods)
    same = _serve(
        pods, root, "same-to-the-server",
        "--model-impl", "vllm", "--seed", "7", "--tokenizer-mode", "slow", "--gpu-memory-utilization", "0.92",
        "--max-num-seqs", "1", "--worker-cls", "vllm_rbln.worker.Worker",
        env={"RBLN_USE_CUSTOM_KERNEL": "TRUE", "VLLM_RBLN_USE_DEVICE_TENSOR": "1", "VLLM_RBLN_SAMPLER": "0"},
    )  # fmt: skip
    _stop(same)
    assert any(e["event"] == "load" and e["pid"] not in compiled for e in pods.record), "it loaded the entry"
    assert _compile_pids(pods) == compiled, "...and compiled nothing"
    assert _events(same, "recompiled_on_hit") == []
    assert "compiling" not in _phases(same), "a hit"
    assert len(entry_dirs(root)) == 1


def test_a_bundle_the_server_grows_on_a_hit_is_recompiled_on_hit(pods: Cluster, root: Path) -> None:
    _stop(_serve(pods, root, "first", "--model-impl", "vllm"))
    # A newer SDK's server needs a graph the bundle lacks: it compiles it and saves the bundle again,
    # at the same path, larger (mega_cache.save after warm-up).
    grown = _serve(pods, root, "grown", "--model-impl", "vllm", env={"STANDIN_EXTRA_GRAPHS": "1"})
    (event,) = wait_for(lambda: _events(grown, "recompiled_on_hit"), what="the recompiled_on_hit event")
    paths = event["new_paths"]
    assert len(paths) == 4, "one bundle per rank of -tp 4"
    for path in paths:
        assert path.startswith("rbln/"), path
        assert "/mega_cache.bin (re-saved larger than published: " in path, path
    _stop(grown)
    assert len(_events(grown, "recompiled_on_hit")) == 1, "once, though checked again at exit"


# --- nothing unloadable published, nothing recompiled unseen (unit) ---------------------------------


def _compiled(tmp_path: Path, files: int = 4) -> Path:
    """A compiled model directory as the stand-in's optimum path saves it, under compiled_models/."""
    from cachemgr_standin.compiler import CompileSpec, Faults, write_compiled_dir

    folder = tmp_path / "artifacts" / "compiled_models" / "org_m_0123456789abcdef"
    folder.mkdir(parents=True)
    write_compiled_dir(folder, CompileSpec("org/m", "0" * 16, files, 4096, 0.0, {}), Faults())
    return folder


@pytest.mark.quick
def test_a_compiled_directory_is_loadable_only_with_every_graph_it_names(tmp_path: Path) -> None:
    """optimum-rbln loads <compiled_model_name>.rbln for every _compile_cfgs entry, submodules' in their
    folder, and refuses a directory missing one (modeling_base.py 189-213, 308-309; submodule.py 150-181)."""
    from cachemgr.runtime.loadable import why_not_loadable

    folder = _compiled(tmp_path)
    artifacts = tmp_path / "artifacts"
    assert why_not_loadable(artifacts, strategy="vllm") is None
    (folder / "submodule" / "graph_003.rbln").unlink()
    why = why_not_loadable(artifacts, strategy="vllm")
    assert why is not None
    assert "submodule/graph_003.rbln" in why
    assert "optimum-rbln would refuse to load it" in why
    (folder / "submodule" / "graph_003.rbln").write_bytes(b"")  # there, but empty: no graph either
    assert why_not_loadable(artifacts, strategy="vllm") is not None
    config = json.loads((folder / "rbln_config.json").read_text())
    for broken in (
        {**config, "_compile_cfgs": [], "submodule": {}},
        {**config, "_compile_cfgs": [{"compiled_model_name": "../x"}]},
        {**config, "_compile_cfgs": 7},
        {**config, "_compile_cfgs": "graph_000"},
    ):
        (folder / "rbln_config.json").write_text(json.dumps(broken))
        assert why_not_loadable(artifacts, strategy="vllm") is not None, broken
    for text in ("not json", "[" * 100_000 + "]" * 100_000):  # garbage, and JSON nested past the parser
        (folder / "rbln_config.json").write_text(text)
        assert "not a JSON object" in str(why_not_loadable(artifacts, strategy="vllm"))


@pytest.mark.quick
def test_a_bundle_re_saved_grown_is_the_alarm_and_changed_is_said_apart(tmp_path: Path) -> None:
    """mega_cache.save replaces the view's link by a file of its own: the same bytes are the same
    graphs; larger means the server compiled more (the alarm); other bytes of the same size, or
    smaller, mean it only if rebel's bundle is byte-stable, which nothing here shows (said apart)."""
    from cachemgr.core.fsutil import hash_file
    from cachemgr.volume.drift import new_artifacts
    from cachemgr.volume.manifest import FileRecord, Manifest

    published = tmp_path / "entry" / "mega_cache.bin"
    published.parent.mkdir()
    published.write_bytes(b"g" * 100)
    bundle = "rbln/m-1/sig/rank0/mega_cache.bin"
    in_view = tmp_path / "view" / bundle
    in_view.parent.mkdir(parents=True)
    in_view.symlink_to(published)
    record = FileRecord(f"artifacts/{bundle}", 100, hash_file(published))
    manifest = Manifest("0" * 32, {}, (record,), 0.0, {}, 0.0, "vllm")
    assert new_artifacts(tmp_path / "view", manifest) == ([], []), "the view's link: untouched"
    for data, alarm, said in (
        (b"g" * 100, None, None),
        (b"g" * 120, "re-saved larger than published: 100 -> 120 bytes", None),
        (b"h" * 100, None, "re-saved with other content, same size (100 bytes)"),
        (b"g" * 80, None, "re-saved smaller than published: 100 -> 80 bytes"),
    ):
        in_view.unlink()
        in_view.write_bytes(data)
        found = new_artifacts(tmp_path / "view", manifest)
        assert found.compiled == ([f"{bundle} ({alarm})"] if alarm else []), alarm
        assert found.resaved == ([f"{bundle} ({said})"] if said else []), said


@pytest.mark.quick
def test_the_last_look_at_exit_does_not_read_gigabytes(tmp_path: Path) -> None:
    """After the server exited (SIGTERM's grace period), a re-saved file of the published size is not
    hashed for the first time; one hashed while it served keeps its answer."""
    import threading

    from cachemgr.core.fsutil import hash_file
    from cachemgr.volume.drift import DriftWatch
    from cachemgr.volume.manifest import FileRecord, Manifest

    bundle = "rbln/m-1/sig/rank0/mega_cache.bin"
    in_view = tmp_path / "view" / bundle
    in_view.parent.mkdir(parents=True)
    in_view.write_bytes(b"g" * 100)
    record = FileRecord(f"artifacts/{bundle}", 100, hash_file(in_view))
    in_view.write_bytes(b"h" * 100)  # other bytes, same size
    reported: list[list[str]] = []
    noted: list[list[str]] = []
    watch = DriftWatch(
        tmp_path / "view",
        Manifest("0" * 32, {}, (record,), 0.0, {}, 0.0, "vllm"),
        report=reported.append,
        note=noted.append,
    )
    exited = threading.Event()
    exited.set()
    watch.start(serving=lambda: False, exited=exited)
    watch.check()
    assert noted == [], "at exit: sizes only"
    exited.clear()
    assert watch.check() == [], "not the alarm"
    assert noted == [[f"{bundle} (re-saved with other content, same size (100 bytes))"]], "said apart, once"
    watch.check()
    assert len(noted) == 1
    assert reported == []


def test_explain_names_a_difference_in_unknown_flags_as_such(pods: Cluster, root: Path) -> None:
    """issue 24 item 4: no ``--unrecognized-argv`` (no such flag), and what differs is said as it is keyed."""
    from cachemgr_testkit.podlib import run_cli

    _stop(_serve(pods, root, "future", "--model-impl", "vllm", "--future-flag", "3"))
    env = {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root), "HF_HOME": str(root.parent / "hf")}
    argv = vllm_argv(free_port(), "--model-impl", "vllm", "--future-flag", "4")
    done = run_cli("explain", "--", *argv, env=env)
    assert done.returncode == 1, done.stderr
    assert "--unrecognized-argv" not in done.stdout
    assert "--unknown-flags" not in done.stdout
    assert re.search(r"^runtime-only +--port \(not in the key\)$", done.stdout, re.MULTILINE), done.stdout
    assert (
        "the server argv, keyed as given because vLLM 0.30 does not know some of its flags, differs"
        in done.stdout
    )
    assert '"--future-flag", "3"] -> [' in done.stdout, done.stdout
    hit = run_cli(
        "explain", "--", *vllm_argv(free_port(), "--model-impl", "vllm", "--future-flag", "3"), env=env
    )
    assert hit.returncode == 0, hit.stdout
