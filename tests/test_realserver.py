"""cachemgr in front of the REAL ``vllm serve`` (vLLM 0.30.0, vllm-rbln 0.12.0, optimum-rbln 0.12.0):
nothing stood in but the NPU compiler and runtime (issue 38; cachemgr_testkit.realserver).

The compiles and loads counted here are the stand-in runtime's events inside the real server
processes: ``compile`` is optimum-rbln calling ``rebel.compile_from_torch``, ``load`` it loading a
saved ``.rbln``. What this tier proves and what it cannot: docs/design.md, "The real server".
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from cachemgr_testkit import realserver
from cachemgr_testkit.podlib import Cluster, Pod, free_port, wait_for
from cachemgr_testkit.realserver import Real
from cachemgr_testkit.scenarios import assert_clean_after_failure, entry_dirs

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


def test_the_warm_job_publishes_what_a_later_run_loads_without_compiling(
    pods: Cluster, real: Real, root: Path
) -> None:
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
    assert {e["pid"] for e in events.of("backend_compile")} == {compiler}, "the second pod compiled a graph"
    reads = [e for e in events.of("bundle_read") if e["pid"] != compiler]
    assert reads, events.all()
    assert all(e["ok"] for e in reads), events.all()
    writes = [e for e in events.of("bundle_write") if e["pid"] != compiler]
    assert writes, "vllm-rbln saves its bundle again after every warm-up"
    assert all(not str(e["path"]).startswith(str(entry)) for e in writes)
    assert _files(entry) == before, "the re-save never reaches the published entry"
    assert bundle.is_file()
    assert [e for e in warm.log_events() if e["event"] == "recompiled_on_hit"] == [], (
        "a false alarm on the re-save"
    )
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
