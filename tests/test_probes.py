"""The probes (``cachemgr probe``) and ``run --status-port`` against real ``cachemgr run`` pods.

Each pod is a real process with the stand-in compiler and server. To look at a phase that
would otherwise pass in a blink, the test freezes the process doing that phase's work (the
compiler, or the loading server) with SIGSTOP and thaws it after: the pod is held there by
a real process state, not by a sleep that hopes.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from cachemgr_testkit.podlib import (
    LOOPBACK,
    Cluster,
    Pod,
    free_port,
    metrics,
    npu_node,
    run_cli,
    status_get,
    status_port,
    wait_for,
)
from cachemgr_testkit.scenarios import compile_cmd, server_argv, vllm_argv

from cachemgr.core.errors import ConfigError
from cachemgr.runtime.metrics import Metrics
from cachemgr.runtime.state import StateWriter, read_status_port
from cachemgr.runtime.status_server import start_status_server

STATUS = ["--status-port", "0"]


# --- helpers -----------------------------------------------------------------------------------


def probe(state_dir: Path, kind: str, *, env: dict[str, str] | None = None) -> tuple[bool, str]:
    """``cachemgr probe KIND``: (passed, its one line). Exit 0 is pass, 1 is fail, nothing else."""
    result = run_cli("probe", kind, "--state-dir", str(state_dir), "--timeout", "0.5", env=env or {})
    assert result.returncode in {0, 1}, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    assert lines[0].startswith(f"{kind} {'ok' if result.returncode == 0 else 'failed'}: ")
    return result.returncode == 0, lines[0]


def expect(pod: Pod, *, startup: bool, live: bool, ready: bool, says: str) -> None:
    """Each exec probe and its HTTP twin agree, and every line says ``says``."""
    port = status_port(pod)
    for kind, wanted, path in (
        ("startup", startup, "/startupz"),
        ("live", live, "/livez"),
        ("ready", ready, "/readyz"),
    ):
        passed, line = probe(pod.state_dir, kind, env=pod.env)
        assert passed is wanted, f"{pod.name}: {line}"
        assert says in line, line
        code, body = status_get(port, path)
        assert code == (200 if wanted else 503), f"{pod.name} {path}: {code} {body}"
        assert body.startswith(f"{kind} {'ok' if wanted else 'failed'}: "), body
        assert says in body, body


def child(pod: Pod, module: str) -> psutil.Process:
    """The pod's process running ``python -m module`` (the compiler, or the server)."""

    def find() -> psutil.Process | None:
        with contextlib.suppress(psutil.NoSuchProcess):
            for proc in psutil.Process(pod.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
                    if module in proc.cmdline():
                        return proc
        return None

    found: psutil.Process = wait_for(find, what=f"{pod.name}'s {module}")
    return found


@contextlib.contextmanager
def frozen(proc: psutil.Process) -> Iterator[None]:
    proc.suspend()
    try:
        yield
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.resume()


def phase_events(pod: Pod) -> list[dict[str, Any]]:
    return [e for e in pod.log_events() if e["event"] == "phase"]


# --- a cold start, a waiter, and what each probe says at each phase ----------------------------


def test_probes_follow_a_cold_start_and_a_waiting_peer_through_every_phase(pods: Cluster, root: Path) -> None:
    record = pods.work / "compiler.jsonl"
    options = [*STATUS, "--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=1.0)]
    slow_load = {"STANDIN_LOAD_SECONDS": "1.5"}
    first = pods.start("first", server_argv(free_port()), cache_root=root, options=options, env=slow_load)

    first.wait_phase("compiling")
    with frozen(child(first, "cachemgr_standin.compiler")):
        # The start budget does not have to cover the compile: startup passes while it runs.
        expect(first, startup=True, live=True, ready=False, says="compiling key ")
        peer = pods.start("peer", server_argv(free_port()), cache_root=root, options=options)
        peer.wait_phase("waiting")
        expect(peer, startup=True, live=True, ready=False, says="waiting")
        _, line = probe(peer.state_dir, "startup")
        assert "pod first" in line, "the waiter names whose compile it waits for"

    first.wait_phase("launching")
    with frozen(child(first, "cachemgr_standin.server")):
        expect(first, startup=True, live=True, ready=False, says="launching the server on ")

    first.wait_phase("serving")
    expect(first, startup=True, live=True, ready=True, says="serving ")
    _, line = probe(first.state_dir, "ready")
    assert "/health answered 200" in line
    peer.wait_phase("serving")
    expect(peer, startup=True, live=True, ready=True, says="serving ")

    # Ready means the server answers now, not that it once did.
    with frozen(child(first, "cachemgr_standin.server")):
        passed, line = probe(first.state_dir, "ready")
        assert not passed
        assert "did not answer" in line
        code, body = status_get(status_port(first), "/readyz")
        assert code == 503, body
        assert probe(first.state_dir, "live")[0], "a slow server is not a dead pod"
    assert probe(first.state_dir, "ready")[0]

    status = json.loads(status_get(status_port(first), "/status")[1])
    assert status["phase"] == "serving"
    assert status["probes"]["ready"]["ok"] is True
    assert status["metrics"]["compiles"] == 1

    transitions = [(e["from"], e["to"]) for e in phase_events(first)]
    assert transitions == [
        ("resolving", "compiling"),
        ("compiling", "publishing"),
        ("publishing", "launching"),
        ("launching", "serving"),
    ]
    compiled = phase_events(first)[1]
    assert compiled["key"]
    assert compiled["seconds_in_previous"] >= 1.0, "the compile took at least 1s"
    assert [(e["from"], e["to"]) for e in phase_events(peer)][:1] == [("resolving", "waiting")]

    first.signal(signal.SIGTERM)
    assert first.wait_exit() == 0
    for kind in ("startup", "live", "ready"):
        passed, line = probe(first.state_dir, kind)
        assert not passed
        assert "stopped: the server exited with code 0" in line


# --- liveness: stalls, frozen and dead processes -----------------------------------------------


@pytest.mark.parametrize("strategy", ["command", "vllm"])
def test_live_fails_on_a_stalled_compile(pods: Cluster, root: Path, strategy: str) -> None:
    record = pods.work / "compiler.jsonl"
    options = [*STATUS, "--stall-timeout", "2s"]
    if strategy == "command":
        options += [
            "--strategy",
            "command",
            "--compile-cmd",
            compile_cmd(record, seconds=0.6, extra="--hang"),
        ]
        pod = pods.start("a", server_argv(free_port()), cache_root=root, options=options)
    else:
        pod = pods.start(
            "a", vllm_argv(free_port()), cache_root=root, options=options, env={"STANDIN_HANG": "1"}
        )
    pod.wait_phase("compiling")
    port = status_port(pod)
    assert probe(pod.state_dir, "live")[0], "progressing at first"

    def live_failed() -> str | None:
        passed, line = probe(pod.state_dir, "live")
        return None if passed else line

    line = wait_for(live_failed, timeout=30, what="live to fail on the stalled compile")
    assert "compile stalled" in line
    assert "--stall-timeout 2s" in line
    passed, line = probe(pod.state_dir, "startup")
    assert not passed
    assert "compile stalled" in line
    code, body = status_get(port, "/livez")
    assert code == 503
    assert "compile stalled" in body
    assert metrics(port)["cachemgr_compile_stalled"] == 1.0
    assert pod.phase == "compiling", "a stall is reported; the kubelet's restart ends it"


def test_live_fails_on_a_model_load_that_hangs_after_a_hit(pods: Cluster, root: Path) -> None:
    warm = pods.start(
        "warm", vllm_argv(free_port()), cache_root=root, command="warm", env=npu_node(pods.work)
    )
    assert warm.wait_exit() == 0
    # The stand-in sleeps through its load: no CPU, no I/O, no answer, like a hung device load.
    pod = pods.start(
        "a", vllm_argv(free_port()), cache_root=root, options=[*STATUS, "--stall-timeout", "2s"],
        env={"STANDIN_LOAD_SECONDS": "600"},
    )  # fmt: skip
    pod.wait_phase("launching")

    def live_failed() -> str | None:
        passed, line = probe(pod.state_dir, "live")
        return None if passed else line

    line = wait_for(live_failed, timeout=30, what="live to fail on the hung model load")
    assert "launching stalled" in line
    assert not probe(pod.state_dir, "ready")[0]


def test_live_fails_on_a_frozen_process_and_recovers_when_thawed(pods: Cluster, root: Path) -> None:
    pod = pods.start("a", vllm_argv(free_port()), cache_root=root, options=STATUS)
    pod.wait_phase("serving")
    port = status_port(pod)
    assert probe(pod.state_dir, "live")[0]

    pod.signal(signal.SIGSTOP)  # cachemgr alone: its heartbeat thread stops, the server runs on
    try:

        def live_failed() -> str | None:
            passed, line = probe(pod.state_dir, "live")
            return None if passed else line

        line = wait_for(live_failed, timeout=30, what="the heartbeat to go stale")
        assert "heartbeat is" in line
        assert "frozen or starved" in line
        assert not probe(pod.state_dir, "startup")[0]
        assert probe(pod.state_dir, "ready")[0], "the server still answers; liveness restarts the pod"
        with pytest.raises(TimeoutError):
            status_get(port, "/livez", timeout=0.5)  # what the kubelet's httpGet sees: no answer at all
    finally:
        pod.signal(signal.SIGCONT)
    wait_for(lambda: probe(pod.state_dir, "live")[0], timeout=20, what="live to pass after SIGCONT")
    assert status_get(port, "/livez")[0] == 200

    pod.signal_pod(
        signal.SIGKILL
    )  # the node dies: pid gone (a zombie until reaped) long before the heartbeat ages

    def dead() -> str | None:
        passed, line = probe(pod.state_dir, "live")
        return None if passed else line

    line = wait_for(dead, timeout=10, what="live to fail on the dead pid")
    assert "is not running" in line
    assert "last phase was serving" in line
    assert "is not running" in probe(pod.state_dir, "ready")[1]


# --- failures ----------------------------------------------------------------------------------


def test_failed_phase_fails_every_probe_with_the_reason(pods: Cluster, root: Path) -> None:
    record = pods.work / "compiler.jsonl"
    options = [*STATUS, "--strategy", "command", "--compile-cmd", compile_cmd(record, extra="--fail-with 3")]
    pod = pods.start("a", server_argv(free_port()), cache_root=root, options=options)
    assert pod.wait_exit() == 70
    for kind in ("startup", "live", "ready"):
        passed, line = probe(pod.state_dir, kind)
        assert not passed
        assert "failed: the compile command exited with code 3" in line
    assert [e["to"] for e in phase_events(pod)][-1] == "failed"

    # The failing run exits before anyone scrapes it; the next container of this pod (same
    # state dir) still reports the failure, and serves the same verdicts over HTTP.
    server = start_status_server(port=0, state_dir=pod.state_dir, metrics=Metrics(), cache_root=root)
    try:
        port = read_status_port(pod.state_dir)
        assert port is not None
        samples = metrics(port)
        assert samples["cachemgr_failures_total{reason=compile-failed}"] == 1.0
        assert samples["cachemgr_failures_total{reason=disk-full}"] == 0.0
        for path in ("/startupz", "/livez", "/readyz"):
            code, body = status_get(port, path)
            assert code == 503
            assert "failed: the compile command exited with code 3" in body
    finally:
        server.close()


def test_every_phase_gives_the_documented_verdicts(tmp_path: Path, root: Path) -> None:
    """The table of verdicts, phase by phase, on a real state record and status server."""
    writer = StateWriter(tmp_path / "state", stall_timeout=60.0)
    server = start_status_server(port=0, state_dir=writer.dir, metrics=Metrics(), cache_root=root)
    port = server.port
    closed = free_port()  # nothing listens here
    writer.update(key="ab" * 16, entry="model__prefill__entry")
    table: list[tuple[str, dict[str, Any], dict[str, Any], tuple[bool, bool, bool], str]] = [
        ("resolving", {}, {}, (True, True, False), "resolving the cache key"),
        ("waiting", {"holder": "pod-b", "holder_node": "n2", "held_for_s": 40}, {}, (True, True, False), "pod pod-b on node n2"),
        ("compiling", {"no_progress_s": 1.0, "cpu_seconds": 9.0, "staging_bytes": 2048, "output_lines": 3}, {}, (True, True, False), "last progress 1s ago"),
        ("compiling", {"no_progress_s": 61.0, "stalled": True}, {}, (False, False, False), "compile stalled"),
        ("publishing", {}, {}, (True, True, False), "publishing key abababababab"),
        ("launching", {}, {}, (True, True, False), "launching the server on model__prefill__entry"),
        ("serving", {}, {"health_url": f"http://127.0.0.1:{closed}/health"}, (True, True, False), "serving model__prefill__entry"),
        ("serving", {}, {"health_url": None}, (True, True, True), "serving model__prefill__entry"),
        ("failed", {"reason": "the volume is full. Raise it."}, {}, (False, False, False), "failed: the volume is full"),
        ("stopped", {"exit_code": 3}, {}, (False, False, False), "exited with code 3"),
    ]  # fmt: skip
    try:
        for phase, detail, fields, wanted, says in table:
            writer.update(**fields)
            writer.phase(phase, **detail)  # type: ignore[arg-type]  # each a Phase literal
            writer.beat()
            for kind, ok, path in zip(
                ("startup", "live", "ready"), wanted, ("/startupz", "/livez", "/readyz"), strict=True
            ):
                passed, line = probe(writer.dir, kind)
                assert (passed, says in line) == (ok, True), f"{phase}: {line}"
                if kind == "ready" and phase == "serving":
                    because = "no health URL is known" if ok else f"127.0.0.1:{closed}/health did not answer"
                    assert because in line
                assert status_get(port, path)[0] == (200 if ok else 503), f"{phase} {path}"
            samples = metrics(port)
            assert samples[f"cachemgr_phase{{phase={phase}}}"] == 1.0
            assert sum(v for k, v in samples.items() if k.startswith("cachemgr_phase{")) == 1.0
    finally:
        server.close()


def test_probes_without_a_state_record_fail_and_say_why(tmp_path: Path) -> None:
    for kind in ("startup", "live", "ready"):
        passed, line = probe(tmp_path, kind)
        assert not passed
        assert "no state record" in line
        assert "CACHEMGR_STATE_DIR" in line


def test_probes_of_a_state_dir_that_is_a_file_or_unreadable_say_which_variable_to_fix(tmp_path: Path) -> None:
    a_file = tmp_path / "state-file"
    a_file.write_text("")
    passed, line = probe(a_file, "startup")
    assert not passed
    assert "is not a directory" in line, line
    assert "CACHEMGR_STATE_DIR" in line, line
    assert "[Errno" not in line, line
    record = tmp_path / "dir" / "state.json"
    record.parent.mkdir()
    record.mkdir()  # a folder where the record should be: EISDIR
    passed, line = probe(record.parent, "live")
    assert not passed
    assert "CACHEMGR_STATE_DIR" in line, line
    assert "[Errno" not in line, line


def test_status_port_in_use_is_a_config_error(tmp_path: Path, root: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))  # as the status server binds
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--status-port {port} is already in use"):
            start_status_server(port=port, state_dir=tmp_path, metrics=Metrics(), cache_root=root)


# --- /metrics ----------------------------------------------------------------------------------


def test_metrics_parse_and_count_what_happened(pods: Cluster, root: Path) -> None:
    cold = pods.start("cold", vllm_argv(free_port()), cache_root=root, options=STATUS)
    cold.wait_phase("serving")
    port = status_port(cold)
    samples = wait_for(
        lambda: (s := metrics(port)).get("cachemgr_cache_bytes", 0) > 0 and s,
        what="the volume figures after the publish",
    )
    assert samples["cachemgr_compiles_total"] == 1
    assert samples["cachemgr_cache_misses_total"] == 1
    assert samples["cachemgr_cache_hits_total"] == 0
    assert samples["cachemgr_compile_seconds_total"] > 0
    cold_compile = samples["cachemgr_compile_seconds_total"]
    assert samples["cachemgr_saved_seconds_total"] == 0, "the compiling pod saved nothing"
    assert samples["cachemgr_cache_entries"] == 1
    # The room the next compile and the next generation need (the PrometheusRule's volume alerts).
    listed = json.loads(
        run_cli("ls", "-o", "json", env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)}).stdout
    )["items"]
    (entry,) = [item for item in listed if item["kind"] == "entry"]
    assert (
        samples["cachemgr_cache_largest_entry_bytes"]
        == entry["size_bytes"]
        == samples["cachemgr_cache_bytes"]
    )
    generation = f"compiler {entry['compiler']}, vllm-rbln {entry['generation']['versions']['vllm_rbln']}"
    assert samples[f"cachemgr_generation_bytes{{generation={generation}}}"] == entry["size_bytes"]
    assert samples[f"cachemgr_generation_entries{{generation={generation}}}"] == 1
    assert samples["cachemgr_volume_free_bytes"] > 0
    assert samples["cachemgr_volume_size_bytes"] >= samples["cachemgr_volume_free_bytes"]
    assert samples["cachemgr_phase{phase=serving}"] == 1
    assert samples["cachemgr_phase{phase=compiling}"] == 0
    assert samples["cachemgr_phase_seconds_total{phase=compiling}"] > 0
    assert all(v == 0 for k, v in samples.items() if k.startswith("cachemgr_failures_total{"))

    warm = pods.start("warm", vllm_argv(free_port()), cache_root=root, options=STATUS)
    warm.wait_phase("serving")
    samples = metrics(status_port(warm))
    assert samples["cachemgr_cache_hits_total"] == 1
    assert samples["cachemgr_cache_misses_total"] == 0
    assert samples["cachemgr_compiles_total"] == 0
    assert samples["cachemgr_lease_wait_seconds_total"] == 0
    assert samples["cachemgr_phase_seconds_total{phase=launching}"] > 0
    assert samples["cachemgr_saved_seconds_total"] > 0, "a hit saves the entry's compile time"

    # cachemgr stats counts the same from the volume: the two pods' use records, the entry's summary.
    stats = json.loads(
        run_cli("stats", "-o", "json", env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)}).stdout
    )
    assert {k: stats["volume"][k] for k in ("hits", "misses", "compiles")} == {
        "hits": 1,
        "misses": 1,
        "compiles": 1,
    }
    (key,) = stats["items"]
    assert key["saved_seconds"] == pytest.approx(samples["cachemgr_saved_seconds_total"], abs=0.01)
    assert key["compile_seconds"] == pytest.approx(cold_compile, abs=0.5)
    listing = json.loads(
        run_cli("ls", "-o", "json", env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)}).stdout
    )["items"]
    assert [(r["kind"], r["hits"]) for r in listing if r["kind"] == "entry"] == [("entry", 1)]

    openmetrics = LOOPBACK.open(
        urllib.request.Request(
            f"http://127.0.0.1:{status_port(warm)}/metrics",
            headers={"Accept": "application/openmetrics-text; version=1.0.0"},
        ),
        timeout=5,
    )
    with openmetrics:
        assert openmetrics.headers["Content-Type"].startswith("application/openmetrics-text")
        assert openmetrics.read().decode().endswith("# EOF\n")


def test_the_status_port_answers_head_as_get_without_a_body(pods: Cluster, root: Path) -> None:
    """HTTP probes and load balancers may send HEAD (it was 501); on a kept-alive connection the
    next GET still gets its body."""
    import http.client

    pod = pods.start("a", vllm_argv(free_port()), cache_root=root, options=STATUS)
    pod.wait_phase("serving")
    conn = http.client.HTTPConnection("127.0.0.1", status_port(pod), timeout=5)
    try:
        for path in ("/livez", "/readyz", "/metrics", "/status"):
            conn.request("HEAD", path)
            head = conn.getresponse()
            assert head.status == 200, (path, head.status)
            assert int(head.headers["Content-Length"]) > 0
            assert head.read() == b""
            conn.request("GET", path)
            got = conn.getresponse()
            body = got.read()
            assert got.status == 200
            assert len(body) > 0
    finally:
        conn.close()


def test_a_command_strategy_compile_is_not_also_a_hit(pods: Cluster, root: Path) -> None:
    record = pods.work / "compiler.jsonl"
    options = [*STATUS, "--strategy", "command", "--compile-cmd", compile_cmd(record)]
    pod = pods.start("a", server_argv(free_port()), cache_root=root, options=options)
    pod.wait_phase("serving")
    samples = metrics(status_port(pod))
    assert samples["cachemgr_compiles_total"] == 1
    assert samples["cachemgr_cache_misses_total"] == 1
    assert samples["cachemgr_cache_hits_total"] == 0


# --- the probe stays light ---------------------------------------------------------------------

_HEAVY = (
    "structlog",
    "psutil",
    "prometheus_client",
    "xxhash",
    "yaml",
    "filelock",
    "packaging",
    "tqdm",
    "cachemgr.runtime.runner",
    "boto3",  # the remote tier's client: loaded on a remote path only
    "botocore",
    "s3transfer",
    "cachemgr.remote",
)


def test_the_probe_imports_only_the_standard_library(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from cachemgr.cli.main import main\n"
        f"main(['probe', 'ready', '--state-dir', {str(tmp_path)!r}])\n"
        "print(' '.join(sorted(sys.modules)), file=sys.stderr)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
    )
    loaded = set(result.stderr.split())
    assert "cachemgr.runtime.probes" in loaded
    heavy = sorted(m for m in loaded if m.split(".")[0] in _HEAVY or m in _HEAVY)
    assert heavy == [], f"cachemgr probe must stay stdlib-only, but loaded {heavy}"


@pytest.mark.quick
def test_generation_series_are_bounded_and_escaped_whatever_key_json_says() -> None:
    """A generation's label is key.json's text, anyone's to write: a planted one cannot add series
    without bound, nor carry control characters or a megabyte into Prometheus."""
    from types import SimpleNamespace

    from cachemgr.ops.generation import Generation
    from cachemgr.runtime.status_metrics import GENERATION_LABEL_MAX, GENERATION_SERIES, generation_figures

    def entry(compiler: str, size: int) -> Any:
        return SimpleNamespace(
            generation=Generation.of({"compiler": compiler, "vllm_rbln": "0.12.0"}), size_bytes=size
        )

    planted = [entry(f"9.{n}\x1b[2J" + "x" * 5000, 10 + n) for n in range(50)]
    found = generation_figures(
        [entry("0.12", 1000), entry("0.12", 500), *planted, SimpleNamespace(generation=None, size_bytes=7)]
    )
    assert len(found) == GENERATION_SERIES
    assert found[0] == ("compiler 0.12, vllm-rbln 0.12.0", 1500, 2)
    assert found[-1][0] == "other generations"
    assert sum(size for _, size, _ in found) == 1500 + sum(10 + n for n in range(50)) + 7
    assert sum(count for _, _, count in found) == 53
    for name, _, _ in found:
        assert len(name) <= GENERATION_LABEL_MAX, name
        assert name.isprintable(), name
