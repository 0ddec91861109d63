"""The real-server tier per release (issue 38): what every release the tier builds shows behind
cachemgr, and what differs between them (cachemgr_testkit.realserver; docs/development.md, "The real
server"). The long form only: it runs where ``$CACHEMGR_REALSERVER_RELEASES`` names the releases
(``0.12.0,0.11.2``), once per release; CI runs tests/test_realserver.py (0.12.0) alone.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from cachemgr_testkit import realserver
from cachemgr_testkit.podlib import Cluster, Pod, free_port
from cachemgr_testkit.realserver import Real
from cachemgr_testkit.scenarios import entry_dirs

pytestmark = [pytest.mark.realserver, pytest.mark.timeout(1800)]
if not realserver.os.environ.get("CACHEMGR_REALSERVER_RELEASES"):
    # CI's budget holds the short form only (tests/test_realserver.py, 0.12.0); this file is the long
    # form, run by hand with the releases named (docs/development.md, "The real server").
    pytest.skip(
        "the real-server tier's long form: CACHEMGR_REALSERVER_RELEASES=0.12.0,0.11.2 runs it",
        allow_module_level=True,
    )
START = 420.0  # a real server starts in 20-120 s on this machine's 2 shared cores


@pytest.fixture(scope="module", params=realserver.releases_under_test())
def real(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Real:
    return realserver.real_for_tests(tmp_path_factory, request.param)


@pytest.fixture
def release(real: Real) -> str:
    return real.release


@pytest.fixture
def cr_pods(real: Real, tmp_path: Path) -> Iterator[Cluster]:
    """Pods on RBLN-CR13 nodes: the vLLM-model path, host tensors."""
    with realserver.real_pods(real, tmp_path, path="vllm") as group:
        yield group


@pytest.fixture
def ca_pods(real: Real, tmp_path: Path) -> Iterator[Cluster]:
    """Pods on RBLN-CA25 nodes: the optimum path."""
    with realserver.real_pods(real, tmp_path, path="optimum") as group:
        yield group


def _serve(pods: Cluster, name: str, release: str, model: Path, root: Path, *, path: str) -> tuple[Pod, int]:
    port = free_port()
    return pods.start(name, realserver.argv(model, port, path, release=release), cache_root=root), port


def _stop(pod: Pod) -> None:
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit(timeout=120) == 0, pod.tail()


def _log(pod: Pod, event: str) -> list[dict[str, object]]:
    return [e for e in pod.log_events() if e["event"] == event]


def test_vllm_model_path_two_cold_pods_one_compiles_the_other_reads_its_bundle(
    cr_pods: Cluster, release: str, real: Real, root: Path
) -> None:
    """Two cold pods on one volume, the vLLM-model path: one server compiles the graphs and its pod
    publishes the bundle; the other pod waits for it and its server reads the bundle, compiling no
    graph. The key is the release's checked rules, not the strict key."""
    events = realserver.Events(cr_pods.work / "events.jsonl")
    (a, port_a), (b, port_b) = (
        _serve(cr_pods, n, release, real.model, root, path="vllm") for n in ("a", "b")
    )
    for pod in (a, b):
        pod.wait_phase("serving", timeout=START)
    for port in (port_a, port_b):
        assert realserver.complete(port)["usage"]
    for pod in (a, b):
        _stop(pod)
    (compiler,) = events.graph_compiling_processes()
    reads = [e for e in events.of("bundle_read") if e["pid"] != compiler]
    assert reads, events.all()
    assert all(e["ok"] for e in reads), events.all()
    (entry,) = entry_dirs(root)
    assert list((entry / "artifacts" / "rbln").glob("*/*/rank0/mega_cache.bin"))
    for pod in (a, b):
        assert _log(pod, "key_note") == [], "the key is strict: the pod's versions are not the release's"
        assert _log(pod, "recompiled_on_hit") == []
    assert events.missing() == []


def test_optimum_path_with_a_local_model_is_cached_where_the_release_saves_it(
    ca_pods: Cluster, release: str, real: Real, root: Path
) -> None:
    """A model given as a local directory on the optimum path. Where the release saves its compile
    under VLLM_CACHE_ROOT (0.12.0), the entry is published and the next pod loads it. Where it does
    not (0.11.2 compiles a local directory in place, in a temporary directory:
    realserver.CACHES_LOCAL_MODEL), cachemgr says it cannot cache it and starts the server without
    the cache (no lease: no pod waits for another's compile), and each server compiles: the release's
    own behaviour. (That in-place compile
    takes none of vLLM's settings, model_base.py:209-212 passes no batch size: compiled for one
    sequence, its KV cache is one block, which vLLM's scheduler never fits a request into with
    --max-num-seqs 2; so 0.11.2's server here is healthy but answers no completion.)"""
    events = realserver.Events(ca_pods.work / "events.jsonl")
    cached = realserver.CACHES_LOCAL_MODEL[release]
    pods = []
    for name in ("first", "second"):
        pod, port = _serve(ca_pods, name, release, real.model, root, path="optimum")
        pod.wait_phase("serving", timeout=START)
        if cached:
            assert realserver.complete(port)["usage"]
        _stop(pod)
        pods.append(pod)
    first = pods[0]
    if cached:
        assert len(events.compiling_processes()) == 1, events.all()
        assert len(entry_dirs(root)) == 1
        assert _log(first, "not_published") == []
    else:
        assert len(events.compiling_processes()) == 2, "each server compiled the local model in place"
        assert entry_dirs(root) == []
        saved = events.of("save")
        assert saved, events.all()
        assert all("compiled_models" not in str(e["path"]) for e in saved), saved
        for pod in pods:
            # said, and passed through: no lease, so no pod waits for another's compile for nothing
            (note,) = _log(pod, "not_cacheable")
            assert "compiles a model read from a local path in place" in str(note["reason"]), note
            assert "waiting" not in {e.get("to") for e in _log(pod, "phase")}
    assert events.missing() == []
