"""cachemgr in front of the REAL ``vllm serve`` (vLLM 0.30.0, vllm-rbln 0.12.0, optimum-rbln 0.12.0):
nothing stood in but the NPU compiler and runtime (issue 38; cachemgr_testkit.realserver).

The compiles and loads counted here are the stand-in runtime's events inside the real server
processes: ``compile`` is optimum-rbln calling ``rebel.compile_from_torch``, ``load`` it loading a
saved ``.rbln``. What this tier proves and what it cannot: docs/design.md, "The real server".
"""

from __future__ import annotations

import json
import signal
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cachemgr_testkit import realserver
from cachemgr_testkit.podlib import LOOPBACK, Cluster, Pod, cluster, free_port
from cachemgr_testkit.scenarios import entry_dirs

pytestmark = [pytest.mark.realserver, pytest.mark.timeout(900)]

# A real server starts in 20-120 s on this machine's 2 shared cores (importing vLLM is most of it).
START = 420.0


@dataclass
class Real:
    venv: Path
    model: Path


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Real:
    try:
        venv = realserver.environment("0.12.0")
    except realserver.UnavailableError as exc:
        if realserver.os.environ.get(realserver.REQUIRE_ENV) == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    model = realserver.make_tiny_llama(venv, tmp_path_factory.mktemp("models") / "tiny-llama")
    return Real(venv=venv, model=model)


@pytest.fixture
def pods(real: Real, tmp_path: Path) -> Iterator[Cluster]:
    realserver.write_vllm(tmp_path / "realbin", real.venv)
    with cluster(tmp_path, **realserver.pod_env(tmp_path)) as group:
        yield group


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "volume"
    path.mkdir()
    return path


def _complete(port: int) -> dict[str, object]:
    """One completion from the real server's OpenAI API."""
    body = json.dumps({"prompt": "w1 w2 w3", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with LOOPBACK.open(request, timeout=60) as reply:
        answer: dict[str, object] = json.loads(reply.read())
    return answer


def _serve(pods: Cluster, name: str, real: Real, root: Path) -> tuple[Pod, int]:
    port = free_port()
    return pods.start(name, realserver.argv(real.model, port), cache_root=root), port


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
    assert list((entry / "artifacts" / "compiled_models").glob("*/rbln_config.json"))
    for port in (port_a, port_b):
        assert _complete(port)["usage"]
    for pod in (a, b):
        _stop(pod)
    c, port_c = _serve(pods, "c", real, root)
    c.wait_phase("serving", timeout=START)
    assert _complete(port_c)["usage"]
    _stop(c)
    assert len(events.compiling_processes()) == 1, "the third pod compiled"
    assert len(events.loading_processes()) == 2
    assert events.missing() == []
