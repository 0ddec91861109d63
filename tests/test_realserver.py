"""cachemgr in front of the REAL ``vllm serve`` (vLLM 0.30.0, vllm-rbln 0.12.0, optimum-rbln 0.12.0):
nothing stood in but the NPU compiler and runtime (issue 38; cachemgr_testkit.realserver).

The compiles and loads counted here are the stand-in runtime's events inside the real server
processes: ``compile`` is optimum-rbln calling ``rebel.compile_from_torch``, ``load`` it loading a
saved ``.rbln``. What this tier proves and what it cannot: docs/design.md, "The real server".
"""

from __future__ import annotations

import json
import re
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit import realserver
from cachemgr_testkit.podlib import (
    Cluster,
    Pod,
    free_port,
    metrics,
    run_cli,
    status_port,
    wait_for,
)
from cachemgr_testkit.realserver import Real
from cachemgr_testkit.scenarios import assert_clean_after_failure, entry_dirs, tree_state
from cachemgr_testkit.trusted import new_key, rebuild_manifest, writable

# The first test of a worker may also wait for scripts/test's background build of the environment.
pytestmark = [pytest.mark.realserver, pytest.mark.timeout(1800)]

# A real server starts in 20-120 s on this machine's 2 shared cores (importing vLLM is most of it).
START = 420.0


# 0.12.0 (CI); more with CACHEMGR_REALSERVER_RELEASES (the long form, docs/development.md).
@pytest.fixture(scope="module", params=realserver.releases_under_test())
def real(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Real:
    return realserver.real_for_tests(tmp_path_factory, request.param)


@pytest.fixture
def pods(real: Real, tmp_path: Path) -> Iterator[Cluster]:
    """Pods on RBLN-CA25 nodes (the optimum path)."""
    if not realserver.CACHES_LOCAL_MODEL[real.release]:
        pytest.skip(f"vllm-rbln {real.release}'s optimum path never caches a local model directory")
    with realserver.real_pods(real, tmp_path) as group:
        yield group


@pytest.fixture
def cr_pods(real: Real, tmp_path: Path) -> Iterator[Cluster]:
    """Pods on RBLN-CR13 nodes, where vllm-rbln takes the vLLM-model path."""
    with realserver.real_pods(real, tmp_path, path="vllm") as group:
        yield group


_complete = realserver.complete  # one completion from the real server's OpenAI API


def _serve(
    pods: Cluster, name: str, real: Real, root: Path, path: str = "optimum", **start: object
) -> tuple[Pod, int]:
    port = free_port()
    server = realserver.argv(real.model, port, path, release=real.release)
    return pods.start(name, server, cache_root=root, **start), port  # type: ignore[arg-type]


_files = realserver.entry_files


def _read_the_bundle_and_saved_it_again(events: realserver.Events, compiler: int) -> list[dict[str, Any]]:
    """On the vLLM-model path, the servers after the ``compiler``'s: they compiled no graph, read
    the bundle, and saved it again after their warm-up (those saves, returned)."""
    assert {e["pid"] for e in events.of("backend_compile")} == {compiler}, "a later pod compiled a graph"
    reads = [e for e in events.of("bundle_read") if e["pid"] != compiler]
    assert reads, events.all()
    assert all(e["ok"] for e in reads), events.all()
    writes = [e for e in events.of("bundle_write") if e["pid"] != compiler]
    assert writes, "vllm-rbln saves its bundle again after every warm-up"
    return writes


def _stop(pod: Pod) -> None:
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit(timeout=120) == 0, pod.tail()


def test_two_cold_pods_compile_once_the_other_waits_and_loads_a_third_loads_only(
    pods: Cluster, real: Real, root: Path
) -> None:
    events = realserver.Events(pods.work / "events.jsonl")
    (a, port_a), (b, port_b) = _serve(pods, "a", real, root), _serve(pods, "b", real, root)
    for pod in (a, b):
        pod.wait_phase("serving", timeout=START)
    assert len(events.compiling_processes()) == 1, events.all()
    assert len(events.loading_processes()) == 1, "the pod that waited loaded what the other published"
    (entry,) = entry_dirs(root)
    artifacts = entry / "artifacts"
    assert list((artifacts / "compiled_models").glob("*/rbln_config.json"))
    # optimum-rbln saved through a temporary directory (mode 0700); vLLM wrote modelinfos/ beside it.
    assert list((artifacts / "modelinfos").glob("*.json")), "vLLM's modelinfos/ is published with the compile"
    for item in [artifacts, *artifacts.rglob("*")]:
        assert item.stat().st_mode & 0o777 == (0o555 if item.is_dir() else 0o444), item
    for port in (port_a, port_b):
        assert _complete(port)["usage"]
    for pod in (a, b):
        _stop(pod)
    c, port_c = _serve(pods, "c", real, root)
    c.wait_phase("serving", timeout=START)
    assert _complete(port_c)["usage"]
    _stop(c)
    assert len(events.compiling_processes()) == 1, "the third pod compiled"
    assert [e for e in c.log_events() if e["event"] == "recompiled_on_hit"] == []
    assert len(events.loading_processes()) == 2
    assert events.missing() == []


def test_the_warm_job_publishes_what_a_later_run_loads_without_compiling_and_drift_is_the_alarm(
    pods: Cluster, real: Real, root: Path
) -> None:
    """The warm Job's entry is a true hit for the next pod: it loads without compiling, and no
    false alarm. Then the alarm for drift: a hit whose server compiles anyway, because its own key
    differs from the entry's. cachemgr keys every input vllm-rbln 0.12's optimum path hashes into
    its directory name (the oracle's table; no setting makes the key weaker), so the drift is
    PLANTED: a writer of the volume renames the entry's ``compiled_models/<name>_<hash>/`` to another hash and writes a
    consistent manifest (the open mode takes it). That is the entry an older vllm-rbln leaves: 0.11.2
    names the directory without the dtype in its hash (vllm_rbln/utils/optimum/converter/dispatch.py
    77-85; 0.12.0 adds it, 80-89). The real server's hit test is ``rbln_config.json`` under the name
    it computes (dispatch.py 115-126, utils/optimum/paths.py 19-22): not there, so it compiles and
    saves under that name (model_executor/models/optimum/model_base.py 190-195, 227-273), in the
    pod's view. cachemgr sees new compiled files there: the ``recompiled_on_hit`` warning, its
    counter on the status port and its record for ``ls``; the server keeps serving and nothing is
    written into the entry."""
    events = realserver.Events(pods.work / "events.jsonl")
    job, _ = _serve(pods, "warm", real, root, command="warm")
    assert job.wait_exit(timeout=START) == 0, job.tail()
    (compiler,) = events.compiling_processes()
    (entry,) = entry_dirs(root)
    before = _files(entry)
    pod, port = _serve(pods, "serve", real, root)
    pod.wait_phase("serving", timeout=START)
    assert _complete(port)["usage"]
    _stop(pod)
    assert events.compiling_processes() == {compiler}, "the serving pod compiled"
    assert events.loading_processes() - {compiler}, "the serving pod loaded the warm Job's entry"
    assert _files(entry) == before, "a published entry never changes"
    assert [e for e in pod.log_events() if e["event"] == "recompiled_on_hit"] == [], "a false alarm"

    # The drift, planted as a writer of the volume does it (docstring).
    writable(entry)
    (compiled,) = (entry / "artifacts" / "compiled_models").iterdir()
    name, _, digest = compiled.name.rpartition("_")
    compiled.rename(compiled.with_name(f"{name}_{digest[::-1]}"))
    rebuild_manifest(entry, with_blake3=False)
    before = _files(entry)
    pod, port = _serve(pods, "drifted", real, root, options=["--status-port", str(free_port())])
    (alarm,) = wait_for(
        lambda: [e for e in pod.log_events() if e["event"] == "recompiled_on_hit"],
        timeout=START,
        what="the recompiled_on_hit event",
    )
    assert alarm["entry"] == entry.name, alarm
    assert f"compiled_models/{compiled.name}/rbln_config.json" in alarm["new_paths"], alarm
    assert metrics(status_port(pod))["cachemgr_recompiled_on_hit_total"] == 1.0
    pod.wait_phase("serving", timeout=START)
    assert _complete(port)["usage"], "the server keeps serving"
    _stop(pod)
    assert events.compiling_processes() - {compiler}, "the server compiled on the hit"
    assert _files(entry) == before, "the server's compile stayed in the pod's view"
    listing = run_cli("ls", "-o", "json", env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)})
    (row,) = [r for r in json.loads(listing.stdout)["items"] if r["kind"] == "entry"]
    assert row["recompiled_on_hit"] == 1, row
    assert len([e for e in pod.log_events() if e["event"] == "recompiled_on_hit"]) == 1, "once"
    assert events.missing() == []


def test_a_signed_entry_is_served_by_a_trusting_pod_from_a_read_only_mount_and_nothing_is_written(
    pods: Cluster, real: Real, root: Path, readonly_bind: Any
) -> None:
    """The builder mode (docs/design.md, "Trust"): a warm Job with the signing key publishes a signed
    entry; a pod holding only the verify key serves it through a read-only bind mount of the volume.
    The real server loads without compiling, answers, and nothing on the volume changes: what vLLM
    writes under VLLM_CACHE_ROOT on a hit (modelinfos/) lands in the pod's own view."""
    events = realserver.Events(pods.work / "events.jsonl")
    secret, key_file = new_key(pods.work / "keys", "builder-1")
    job, _ = _serve(
        pods, "builder", real, root, command="warm", env={"CACHEMGR_SIGNING_KEY_FILE": str(key_file)}
    )
    assert job.wait_exit(timeout=START) == 0, job.tail()
    (compiler,) = events.compiling_processes()
    (entry,) = entry_dirs(root)
    assert json.loads((entry / "summary.json").read_text())["signer"] == "builder-1"
    before = tree_state(root)
    mounted = readonly_bind(root)
    pod, port = _serve(pods, "trusting", real, mounted, env={"CACHEMGR_TRUSTED_KEYS": str(secret.public)})
    pod.wait_phase("serving", timeout=START)
    assert _complete(port)["usage"]
    logged = pod.log_events()
    (launch,) = [e for e in logged if e["event"] == "launching"]
    assert launch["signer"] == "builder-1", launch
    assert [e["note"] for e in logged if e["event"] == "read_only_volume"] == ["a hit writes nothing there"]
    _stop(pod)
    assert events.compiling_processes() == {compiler}, "the trusting pod's server compiled"
    assert events.loading_processes() - {compiler}, "the trusting pod's server loaded the signed entry"
    assert tree_state(root) == before, "the read-only pod changed something on the volume"
    assert [e for e in pod.log_events() if e["event"] == "recompiled_on_hit"] == []
    assert events.missing() == []


def test_sigterm_during_the_real_servers_compile_publishes_nothing_and_starts_no_server(
    pods: Cluster, real: Real, root: Path
) -> None:
    events = realserver.Events(pods.work / "events.jsonl")
    mark = pods.work / "compiling"
    pod, port = _serve(
        pods,
        "a",
        real,
        root,
        env={"STANDIN_REBEL_COMPILE_SECONDS": "600", "STANDIN_REBEL_COMPILE_MARK": str(mark)},
    )
    wait_for(mark.exists, timeout=START, what="the real server to start compiling")
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit(timeout=120) == 128 + signal.SIGTERM, pod.tail()
    assert entry_dirs(root) == []
    assert_clean_after_failure(root)
    assert events.of("compile") == [], "the compile was cut short: nothing compiled"
    assert events.of("runtime") == [], "no runtime (no server) after the stop"
    with pytest.raises(OSError, match="refused"):
        _complete(port)


def test_vllm_model_path_cold_then_warm_reads_the_published_bundle(
    cr_pods: Cluster, real: Real, root: Path
) -> None:
    """RBLN-CR13, host tensors: the bundle under rbln/<model>-<sha>/<sig>/rank0/ is published; the next
    pod reads it and compiles no graph, and its re-save after warm-up lands in its own view."""
    events = realserver.Events(cr_pods.work / "events.jsonl")
    cold, port = _serve(cr_pods, "cold", real, root, "vllm")
    cold.wait_phase("serving", timeout=START)
    assert _complete(port)["usage"]
    _stop(cold)
    (compiler,) = {e["pid"] for e in events.of("backend_compile")}
    (entry,) = entry_dirs(root)
    (bundle,) = (entry / "artifacts" / "rbln").glob("*/*/rank0/mega_cache.bin")
    before = _files(entry)
    warm, port = _serve(cr_pods, "warm", real, root, "vllm")
    warm.wait_phase("serving", timeout=START)
    assert _complete(port)["usage"]
    _stop(warm)
    writes = _read_the_bundle_and_saved_it_again(events, compiler)
    assert all(not str(e["path"]).startswith(str(entry)) for e in writes)
    assert _files(entry) == before, "the re-save never reaches the published entry"
    assert bundle.is_file()
    assert [e for e in warm.log_events() if e["event"] == "recompiled_on_hit"] == [], (
        "a false alarm on the re-save"
    )
    assert events.missing() == []


@pytest.mark.realserver_long
def test_vllm_model_path_a_trusting_pod_on_a_read_only_mount_resaves_the_signed_bundle_in_its_view(
    cr_pods: Cluster, real: Real, root: Path, readonly_bind: Any
) -> None:
    """The builder mode on the vLLM-model path, where the server writes on a hit: vllm-rbln saves
    its bundle again after every warm-up (v1/worker/mega_cache.py 206-227). A trusting pod on a
    read-only mount reads the signed bundle, compiles no graph, and its re-save lands in its own
    view; nothing on the volume changes, and the re-save is no alarm. (Long form: two more real
    server starts than the CI tests, which show the re-save on a writable volume.)"""
    events = realserver.Events(cr_pods.work / "events.jsonl")
    secret, key_file = new_key(cr_pods.work / "keys", "builder-1")
    job, _ = _serve(
        cr_pods,
        "builder",
        real,
        root,
        "vllm",
        command="warm",
        env={"CACHEMGR_SIGNING_KEY_FILE": str(key_file)},
    )
    assert job.wait_exit(timeout=START) == 0, job.tail()
    (compiler,) = {e["pid"] for e in events.of("backend_compile")}
    (entry,) = entry_dirs(root)
    assert list((entry / "artifacts" / "rbln").glob("*/*/rank0/mega_cache.bin"))
    before = tree_state(root)
    mounted = readonly_bind(root)
    pod, port = _serve(
        cr_pods, "trusting", real, mounted, "vllm", env={"CACHEMGR_TRUSTED_KEYS": str(secret.public)}
    )
    pod.wait_phase("serving", timeout=START)
    assert _complete(port)["usage"]
    _stop(pod)
    (launch,) = [e for e in pod.log_events() if e["event"] == "launching"]
    assert launch["signer"] == "builder-1", launch
    writes = _read_the_bundle_and_saved_it_again(events, compiler)
    assert all(str(pod.state_dir) in str(e["path"]) for e in writes), writes
    assert tree_state(root) == before, "the read-only pod changed something on the volume"
    assert [e for e in pod.log_events() if e["event"] == "recompiled_on_hit"] == [], "a false alarm"
    assert events.missing() == []


def test_a_real_server_that_refuses_its_flags_is_named_in_the_termination_message(
    pods: Cluster, real: Real, root: Path
) -> None:
    """vLLM refuses a context longer than the model's (256 positions) when it builds its
    configuration, before anything compiles: the pod fails with the server's own words."""
    events = realserver.Events(pods.work / "events.jsonl")
    port = free_port()
    server = realserver.argv(real.model, port, release=real.release)
    server[server.index("--max-model-len") + 1] = "4096"
    pod = pods.start("a", server, cache_root=root)
    assert pod.wait_exit(timeout=START) == 70, pod.tail()  # the vllm strategy's compile is the server's start
    message = (pod.state_dir / "termination-log").read_text()
    assert "max_model_len" in message, message
    assert entry_dirs(root) == []
    assert_clean_after_failure(root)
    assert events.of("compile") == []


def test_a_real_server_that_cannot_load_its_model_says_why_and_publishes_nothing(
    pods: Cluster, real: Real, root: Path, tmp_path: Path
) -> None:
    """A model folder whose weights are not a safetensors file (a copy cut short, a disk error):
    the real server dies while it compiles, the pod exits 70 with the server's own error line in
    its termination message, nothing is published, the lease is released. The error lies ~60
    lines above the server's end (its API server's traceback follows the engine's): before, the
    termination message's last lines said only "Engine core initialization failed. See root
    cause above." (cachemgr.runtime.output keeps what a child raised apart from its tail)."""
    events = realserver.Events(pods.work / "events.jsonl")
    broken = tmp_path / "models" / "broken-llama"
    shutil.copytree(real.model, broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    pod = pods.start("a", realserver.argv(broken, free_port()), cache_root=root)
    assert pod.wait_exit(timeout=START) == 70, pod.tail()
    message = (pod.state_dir / "termination-log").read_text()
    head, _, raised = message.partition("\nthe server raised:\n")
    assert head.startswith(
        "the server exited with code 1 before its health endpoint answered; nothing was published"
    )
    assert "SafetensorError: Error while deserializing header: invalid header length" in raised, message
    assert len(message.encode()) <= 4096
    key = re.search(r"cachemgr show ([0-9a-f]{12})", message)
    assert key, message
    shown = run_cli("show", key[1], env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)})
    assert shown.returncode == 0, shown.stderr
    assert (
        "the server raised:\n    ! safetensors._safetensors_rust.SafetensorError: Error while deserializing"
        in (shown.stdout)
    ), shown.stdout
    assert entry_dirs(root) == []
    assert_clean_after_failure(root)
    assert events.of("compile") == []
