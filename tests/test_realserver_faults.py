"""Faults in front of the REAL ``vllm serve`` (issue 38): a SIGTERM while the real server loads a
published entry, the real disk-full, and two JuiceFS mounts of one volume.

As in tests/test_realserver.py, only the NPU compiler and runtime are stood in; the moments a test
waits for are the stand-in runtime's (``STANDIN_REBEL_LOAD_MARK``: a load of a saved compiled model
begins; ``STANDIN_REBEL_LOAD_SECONDS``: it lasts that long, a stand-in delay).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from cachemgr_testkit import realserver
from cachemgr_testkit.podlib import Cluster, Pod, free_port, wait_for
from cachemgr_testkit.realserver import Real
from cachemgr_testkit.scenarios import assert_clean_after_failure, entry_dirs

from cachemgr.ops.expected import WEIGHTS_FACTOR

pytestmark = [pytest.mark.realserver, pytest.mark.timeout(1800)]

START = 420.0  # a real server start: 20-120 s on this machine's 2 shared cores
KiB = 1 << 10
CHART_GRACE = 120.0  # the chart's terminationGracePeriodSeconds: the kubelet's SIGKILL after it


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Real:
    return realserver.real_for_tests(tmp_path_factory)


@pytest.fixture
def pods(real: Real, tmp_path: Path) -> Iterator[Cluster]:
    """Pods on RBLN-CA25 nodes (the optimum path)."""
    with realserver.real_pods(real, tmp_path) as group:
        yield group


def _serve(pods: Cluster, name: str, real: Real, root: Path, **start: object) -> tuple[Pod, int]:
    port = free_port()
    return pods.start(name, realserver.argv(real.model, port), cache_root=root, **start), port  # type: ignore[arg-type]


def _left_in_session(pod: Pod) -> list[str]:
    """Processes still in the pod's session (the harness starts each pod as a session of its own, as
    a container is a PID namespace of its own): the server's engine core outliving the pod."""
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != pod.proc.pid and os.getsid(proc.pid) == pod.proc.pid:
                left.append(f"{proc.pid} {' '.join(proc.info['cmdline'] or [])[:200]}")
        except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
            continue
    return left


@pytest.mark.realserver_long  # a warm Job, a hit, and the stop's grace: about 3 minutes
def test_sigterm_during_the_real_servers_load_ends_the_pod_and_its_server_within_the_grace(
    pods: Cluster, real: Real, root: Path
) -> None:
    """The real vLLM, signalled while its engine core loads a published entry (before /health
    answers), may not exit (its start-up turns SIGTERM into a KeyboardInterrupt only when its main
    thread next runs Python; docs/design.md, "The real server"): the pod kills what is left after
    the stop's grace, and ends 143 well inside the chart's terminationGracePeriodSeconds (120)."""
    events = realserver.Events(pods.work / "events.jsonl")
    job, _ = _serve(pods, "warm", real, root, command="warm")
    assert job.wait_exit(timeout=START) == 0, job.tail()
    (entry,) = entry_dirs(root)
    before = realserver.entry_files(entry)
    mark = pods.work / "loading"
    pod, port = _serve(
        pods, "hit", real, root,
        env={"STANDIN_REBEL_LOAD_SECONDS": "600", "STANDIN_REBEL_LOAD_MARK": str(mark)},
    )  # fmt: skip
    wait_for(mark.exists, timeout=START, what="the real server to load the entry")
    assert pod.phase == "launching", "the server loads before /health answers"
    signalled = time.monotonic()
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit(timeout=CHART_GRACE) == 128 + signal.SIGTERM, pod.tail()
    assert time.monotonic() - signalled < CHART_GRACE
    assert _left_in_session(pod) == [], "the server's processes outlived the pod"
    assert pod.state()["detail"]["stopped_by"] == "SIGTERM"
    assert not [e for e in pod.log_events() if e["event"] == "failed"], "a stop, not a failed entry"
    loaded = {e["pid"] for e in events.of("load")} - {e["pid"] for e in events.of("compile")}
    assert loaded == set(), "the load was cut short"
    assert realserver.entry_files(entry) == before, "the entry is untouched"
    assert_clean_after_failure(root)
    with pytest.raises(OSError, match="refused"):
        realserver.complete(port)


def _disk_full(pod: Pod, root: Path) -> tuple[str, dict[str, Any]]:
    """The termination message (one line: the figures and the remedy) and the failure record's report."""
    message = (pod.state_dir / "termination-log").read_text()
    records = [json.loads(p.read_text()) for p in (root / "failures").rglob("*.json")]
    (record,) = [r for r in records if r.get("reason") == "disk-full"]
    assert record["message"] == message, "the record and the termination message say the same"
    report: dict[str, Any] = record["report"]
    return message, report


def test_a_volume_too_small_for_the_estimate_is_refused_before_the_real_server_starts(
    pods: Cluster, real: Real, tmpfs_small: Callable[[int], Path]
) -> None:
    """What cachemgr can know before launching: the weights (x 1.1) do not fit what is free. No
    server is started (the real one would spend its start-up only to fail at the save)."""
    root = tmpfs_small(128 * KiB)
    pod, _ = _serve(pods, "a", real, root)
    assert pod.wait_exit(timeout=START) == 73, pod.tail()
    message, report = _disk_full(pod, root)
    assert message.count("\n") <= 1, message
    assert report["cause"] == "checked before compiling"
    assert report["expected_source"].startswith("estimated from the weights"), report
    weights = sum(p.stat().st_size for p in real.model.glob("*.safetensors"))
    assert report["expected_bytes"] == int(weights * WEIGHTS_FACTOR) > report["free_bytes"], report
    assert "this compile needs about" in message, "it names the size needed"
    assert f"compile cache volume {root} is out of space" in message
    assert "free of" in message, "it names what is free"
    assert "storage.compileCache.size" in message, "it names the remedy"
    assert realserver.Events(pods.work / "events.jsonl").all() == [], "no server was started"
    assert "APIServer" not in pod.log.read_text(errors="replace"), "no server was started"
    assert entry_dirs(root) == []
    assert_clean_after_failure(root)


@pytest.mark.realserver_long  # one real start (1-2 minutes); the preflight's refusal is the CI's
def test_the_real_servers_save_filling_the_volume_is_exit_73_with_nothing_published(
    pods: Cluster, real: Real, tmpfs_small: Callable[[int], Path]
) -> None:
    """``--space-check warn`` lets the compile start on a volume smaller than its output: the real
    optimum-rbln copies what it compiled into ``compiled_models/<name>.tmp`` on the volume and
    that copy fails with ENOSPC. The pod ends 73 with the one-line report, nothing published,
    the attempt removed, no server left serving."""
    root = tmpfs_small(256 * KiB)
    events = realserver.Events(pods.work / "events.jsonl")
    pod, port = _serve(pods, "a", real, root, options=["--space-check", "warn"])
    assert pod.wait_exit(timeout=START) == 73, pod.tail()
    message, report = _disk_full(pod, root)
    assert "No space left on device" in report["cause"], report
    assert "this compile needs more than" in message, "it names the size needed: more than it filled"
    assert f"compile cache volume {root} is out of space" in message, message
    assert "storage.compileCache.size" in message, message
    assert events.of("compile"), "the real server compiled before its save filled the volume"
    assert entry_dirs(root) == [], "nothing half-published"
    assert_clean_after_failure(root)
    assert _left_in_session(pod) == [], "no server keeps running"
    with pytest.raises(OSError, match="refused"):
        realserver.complete(port)


@pytest.mark.realserver_long  # two real starts at once on two FUSE mounts: 2-4 minutes here
def test_two_cold_pods_on_two_juicefs_mounts_of_one_volume_compile_once(
    pods: Cluster, real: Real, juicefs_mounts: list[Path]
) -> None:
    """Two nodes, each with its own JuiceFS client of one volume: one real server compiles (the
    runtime's events), the other pod waits for its lease, then loads what it published."""
    events = realserver.Events(pods.work / "events.jsonl")
    started = []
    for name, mount in zip(("a", "b"), juicefs_mounts, strict=True):
        port = free_port()
        pod = pods.start(name, realserver.argv(real.model, port), cache_root=mount, node=f"node-{name}")
        started.append((pod, port))
    for pod, _ in started:
        pod.wait_phase("serving", timeout=START)
    assert len(events.compiling_processes()) == 1, events.all()
    assert len(events.loading_processes()) == 1, "the other node loaded what the first published"
    waited = [p for p, _ in started if any(e["event"] == "peer_published" for e in p.log_events())]
    assert len(waited) == 1, "one pod waited on the other node's lease until it published"
    seen = [sorted(e.name for e in entry_dirs(mount)) for mount in juicefs_mounts]
    assert len(seen[0]) == 1, seen
    assert seen[0] == seen[1], "both nodes see the one entry"
    for pod, port in started:
        assert realserver.complete(port)["usage"]
        pod.signal(signal.SIGTERM)
        assert pod.wait_exit(timeout=CHART_GRACE) == 0, pod.tail()
        assert _left_in_session(pod) == []
    assert events.missing() == []
