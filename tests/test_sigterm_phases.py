"""SIGTERM in every phase before the server starts, and a server that dies at launch.

Issue 26 item 3: a termination signal received during key resolution, a lookup, the view's
build, a wait on a peer (even as the peer publishes), or a publish ends the run with 128+N and
the documented message, staging removed, lease released, and no server is started after it.
Issue 24 item 3: a server that exits before it is ready on a hit is an error (the ``failed``
event, reason ``server-failed``) whose termination message carries its exit code and last lines.

Each test waits on a condition that puts the pod in the phase (its state record, its open
files, a stopped process), never on a sleep; the stand-in server prints its banner first
thing, so "no server" is checked on the pod's own log as well as on its events.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from cachemgr_testkit import manifest
from cachemgr_testkit.podlib import STANDIN_COMPILER, Cluster, Pod, free_port, npu_node, read_jsonl, wait_for
from cachemgr_testkit.scenarios import (
    assert_clean_after_failure,
    compile_cmd,
    entry_dirs,
    server_argv,
    vllm_argv,
)

from cachemgr.core.errors import Interrupted
from cachemgr.runtime.launcher import STOP_GRACE, SignalRelay
from cachemgr.runtime.output import CUT_MARK, LineKeeper, Tail
from cachemgr.runtime.output import SERVER_TAIL_LINE_BYTES as TAIL_LINE_BYTES
from cachemgr.runtime.output import SERVER_TAIL_LINES as TAIL_LINES
from cachemgr.volume.manifest import ARTIFACTS

SERVER_BANNER = "STAND-IN vllm server"
TERM = 128 + signal.SIGTERM


def _compile(*, files: int, size: str, seconds: float = 0.2) -> list[str]:
    command = (
        f"{STANDIN_COMPILER} --output-dir {{output_dir}} --model m --files {files} --bytes {size} "
        f"--seconds {seconds}"
    )
    return ["--strategy", "command", "--compile-cmd", command]


def _warm(pods: Cluster, root: Path, options: list[str]) -> None:
    warm = pods.start(
        f"warm-{len(pods.pods)}", server_argv(free_port()), cache_root=root, command="warm", options=options
    )
    assert warm.wait_exit(timeout=120) == 0, warm.tail()


def _events(pod: Pod, event: str) -> list[dict[str, Any]]:
    return [e for e in pod.log_events() if e.get("event") == event]


def _assert_stopped_before_any_server(pod: Pod, *, within: float = 30) -> None:
    """Exit 143 with the documented line, and no server: no launch event, no server banner."""
    code = pod.wait_exit(timeout=within)
    assert code == TERM, pod.tail()
    assert not _events(pod, "launching"), pod.tail()
    assert SERVER_BANNER not in pod.log.read_text(errors="replace"), "a server started after SIGTERM"
    state = pod.state()
    assert state["phase"] == "failed", state
    assert state["detail"]["exit_code"] == TERM, state
    expected = Interrupted(signal.SIGTERM).one_line()
    assert (pod.state_dir / "termination-log").read_text() == expected
    (failed,) = _events(pod, "failed")
    assert failed["reason"] == "interrupted"
    assert failed["message"] == expected


def _open_in(pid: int, folder: Path) -> bool:
    """``pid`` has a file under ``folder`` open now (its /proc fd links)."""
    prefix = str(folder.resolve()) + os.sep
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith(prefix):
                return True
        except OSError:
            continue
    return False


# --- the lookup ---------------------------------------------------------------------------------


def test_sigterm_during_a_full_verify_of_a_large_entry_ends_the_check(
    pods: Cluster, juicefs_volume_factory: Any
) -> None:
    """``--verify full`` reads every byte: 16 MiB over a volume that delivers 1 MB/s takes 16 s.
    SIGTERM while it reads ends the check after the file at hand (1 MiB), not after the entry."""
    mounts = juicefs_volume_factory(mounts=2, extra_mount_args=["--download-limit=8"])  # Mbps
    options = _compile(files=16, size="16M")
    _warm(pods, mounts[0], options)  # written through one node: the other reads it cold
    (entry,) = entry_dirs(mounts[1])
    pod = pods.start(
        "full", server_argv(free_port()), cache_root=mounts[1], options=[*options, "--verify", "full"]
    )
    wait_for(lambda: _open_in(pod.proc.pid, entry / ARTIFACTS), what="the full check to read the entry")
    sent = time.monotonic()
    pod.signal(signal.SIGTERM)
    _assert_stopped_before_any_server(pod)
    took = time.monotonic() - sent
    assert took < 8, f"{took:.1f}s: the check went on after SIGTERM"


# --- the view -----------------------------------------------------------------------------------


def test_sigterm_while_the_view_is_built_removes_it_and_starts_no_server(
    pods: Cluster, tmpfs_small: Any
) -> None:
    """A view takes a link per file: 12,000 files take about a second to link."""
    root = tmpfs_small(256 << 20)  # fsync is free there: publishing 12,000 files takes no minute
    options = _compile(files=12000, size="12000")
    _warm(pods, root, options)
    pod = pods.start("view", server_argv(free_port()), cache_root=root, options=options)
    views = pod.state_dir / "views"
    wait_for(lambda: views.is_dir() and any(views.iterdir()), what="the view's build to begin", every=0.01)
    pod.signal(signal.SIGTERM)
    _assert_stopped_before_any_server(pod)
    assert list(views.iterdir()) == [], "the half-built view is removed"
    assert list((root / "usage").rglob("view.*")) == [], "its use record is released"


# --- waiting on a peer --------------------------------------------------------------------------


def test_sigterm_as_the_peer_publishes_starts_no_server(pods: Cluster, root: Path) -> None:
    """The waiter is frozen (SIGSTOP) while its peer publishes and SIGTERM arrives: when it runs
    again it sees both, the entry and the signal, and the signal wins."""
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(pods.work / "c.jsonl", seconds=2.0)]
    holder = pods.start("holder", server_argv(free_port()), cache_root=root, options=options)
    holder.wait_phase("compiling")
    waiter = pods.start("waiter", server_argv(free_port()), cache_root=root, options=options)
    waiter.wait_phase("waiting")
    waiter.signal(signal.SIGSTOP)
    try:
        holder.wait_phase("serving")  # published
        waiter.signal(signal.SIGTERM)  # pending until it runs again
    finally:
        waiter.signal(signal.SIGCONT)
    _assert_stopped_before_any_server(waiter)
    assert list((root / "usage").rglob("waiter.*")) == []
    assert list((root / "staging").rglob("waiter.*")) == []
    assert holder.phase == "serving", "the publisher is unaffected"


def test_on_miss_fail_waiting_for_a_warm_job_stops_on_sigterm_as_it_publishes(
    pods: Cluster, root: Path
) -> None:
    """The same race in the wait of ``--on-miss fail`` (a pod that waits for a warm Job)."""
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(pods.work / "c.jsonl", seconds=2.0)]
    job = pods.start("job", server_argv(free_port()), cache_root=root, options=options, command="warm")
    # A warm Job keeps no state record: its compile is seen in the stand-in compiler's record.
    wait_for(lambda: read_jsonl(pods.work / "c.jsonl"), what="the warm Job's compile")
    waiter = pods.start(
        "waiter", server_argv(free_port()), cache_root=root, options=[*options, "--on-miss", "fail"]
    )
    waiter.wait_phase("waiting")
    waiter.signal(signal.SIGSTOP)
    try:
        assert job.wait_exit() == 0, job.tail()
        waiter.signal(signal.SIGTERM)
    finally:
        waiter.signal(signal.SIGCONT)
    _assert_stopped_before_any_server(waiter)


# --- publishing ---------------------------------------------------------------------------------


def test_sigterm_while_publishing_keeps_the_entry_and_starts_no_server(pods: Cluster, root: Path) -> None:
    """``--strategy command`` hashes and fsyncs every file as it publishes: 5,000 files take a
    while. A publish under way completes (the compile is kept for the peers), then the run stops."""
    options = _compile(files=5000, size="5000")
    pod = pods.start("pub", server_argv(free_port()), cache_root=root, options=options)
    seen = pod.wait_phase("publishing", "launching", "serving")
    assert seen == "publishing", "the publish was over before it could be seen"
    pod.signal(signal.SIGTERM)
    _assert_stopped_before_any_server(pod)
    assert len(entry_dirs(root)) == 1, "the published entry stays"
    assert_clean_after_failure(root)  # no staging, the lease released, no use record


# --- key resolution -----------------------------------------------------------------------------


def test_sigterm_while_the_key_is_resolved_starts_no_server(pods: Cluster, root: Path) -> None:
    """The key asks the NPU its name (a slow driver: seconds) before anything else."""
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(pods.work / "c.jsonl")]
    _warm(pods, root, options)
    asked = pods.work / "npu-asked"
    node = _npu_node(pods.work, asked=asked, seconds=3)
    pod = pods.start("key", server_argv(free_port()), cache_root=root, options=options, env=node)
    wait_for(asked.exists, what="the NPU query")
    pod.signal(signal.SIGTERM)
    _assert_stopped_before_any_server(pod, within=45)


def _npu_node(work: Path, *, asked: Path, seconds: float) -> dict[str, str]:
    return {**npu_node(work), "STANDIN_NPU_QUERY_SECONDS": str(seconds), "STANDIN_NPU_QUERY_MARK": str(asked)}


# --- a server that dies at launch ---------------------------------------------------------------


def test_sigterm_while_the_server_compiles_says_the_server_was_stopped(pods: Cluster, root: Path) -> None:
    """The vllm strategy: the server itself compiles, so the line cannot say no server started."""
    pod = pods.start(
        "compiling", vllm_argv(free_port()), cache_root=root, env={"STANDIN_COMPILE_SECONDS": "30"}
    )
    pod.wait_phase("compiling")
    wait_for(
        lambda: SERVER_BANNER in pod.log.read_text(errors="replace"), timeout=60, what="the server compiling"
    )
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit(timeout=60) == TERM, pod.tail()
    line = (pod.state_dir / "termination-log").read_text()
    assert line == Interrupted(signal.SIGTERM, server_compiling=True).one_line()
    assert "while the server compiled" in line
    assert "no server was started" not in line
    assert not entry_dirs(root), "nothing published"


def _proc_field(pid: int, name: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return ""


def _sigterm_pending(pid: int) -> bool:
    return bool(int(_proc_field(pid, "ShdPnd") or "0", 16) & (1 << (signal.SIGTERM - 1)))


def test_sigterm_to_a_frozen_pod_stops_its_server_once_it_thaws(pods: Cluster, root: Path) -> None:
    """A node freezes the pod (SIGSTOP), the kubelet sends SIGTERM, the pod thaws: the kernel may
    hand the signal to any thread of cachemgr's, and the server must still be told to stop."""
    first = pods.start("first", vllm_argv(free_port()), cache_root=root)
    first.wait_phase("serving")
    first.signal(signal.SIGTERM)
    assert first.wait_exit() == 0
    for attempt in range(4):  # before the fix, 3 of 4 hung: which thread takes the signal varies
        pod = pods.start(f"frozen-{attempt}", vllm_argv(free_port()), cache_root=root)
        pod.wait_phase("serving")
        pid = pod.proc.pid
        pod.signal_pod(signal.SIGSTOP)
        wait_for(lambda p=pid: _proc_field(p, "State").startswith("T"), timeout=10, what="the pod stopped")
        pod.signal(signal.SIGTERM)
        wait_for(lambda p=pid: _sigterm_pending(p), timeout=10, what="SIGTERM pending")
        pod.signal_pod(signal.SIGCONT)
        assert pod.wait_exit(timeout=20) == 0, (attempt, pod.tail())


def test_a_server_that_dies_before_it_is_ready_is_an_error_with_its_code_and_last_lines(
    pods: Cluster, root: Path
) -> None:
    """A byte of the entry changed, its size and mtime kept: cachemgr's fast check passes, the
    server refuses the file. The run ends with the server's code, said as an error."""
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(pods.work / "c.jsonl")]
    _warm(pods, root, options)
    (entry,) = entry_dirs(root)
    victim = sorted((entry / ARTIFACTS).rglob("*.rbln"))[0]
    before = victim.stat()
    os.chmod(victim, 0o644)
    with victim.open("r+b") as handle:
        handle.seek(before.st_size // 2)
        byte = handle.read(1)
        handle.seek(before.st_size // 2)
        handle.write(bytes([byte[0] ^ 0xFF]))
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.chmod(victim, before.st_mode)

    pod = pods.start("crash", server_argv(free_port()), cache_root=root, options=options)
    code = pod.wait_exit()
    assert code == 1, pod.tail()  # Python's code for an uncaught exception: the server's own
    log = pod.log.read_text(errors="replace")
    assert "truncated or damaged (stand-in check)" in log, "the server's output still reaches the pod log"
    (failed,) = _events(pod, "failed")
    assert failed["level"] == "error", failed
    assert failed["reason"] == "server-failed", failed
    assert failed["exit_status"] == 1
    assert failed["signal"] is None
    assert any("truncated or damaged" in line for line in failed["last_lines"]), failed
    assert len(failed["last_lines"]) <= TAIL_LINES
    termination = (pod.state_dir / "termination-log").read_text()
    first, *rest = termination.splitlines()
    assert first.startswith("the server exited with code 1 before it was ready"), first
    assert any("truncated or damaged" in line for line in rest), termination
    assert pod.state()["phase"] == "failed"


def test_a_server_killed_by_its_own_signal_is_named_and_a_stop_of_the_pod_is_no_failure(
    pods: Cluster, root: Path
) -> None:
    """SIGTERM forwarded to a loading server: the pod was stopped, the launch did not fail."""
    pod = _loading(pods, root, "loading", seconds=60)
    pod.signal(signal.SIGTERM)
    # The stand-in ends gracefully on SIGTERM (0); stopped before it served, the pod's code is the stop's.
    assert pod.wait_exit() == TERM, pod.tail()
    assert not _events(pod, "failed")
    assert pod.state()["phase"] == "stopped"
    assert pod.state()["detail"] == {"exit_code": TERM, "stopped_by": "SIGTERM", "server_exit_code": 0}


def _loading(pods: Cluster, root: Path, name: str, *, seconds: float) -> Pod:
    """A pod on a hit whose stand-in server has printed its banner and loads for ``seconds``."""
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(pods.work / "c.jsonl")]
    _warm(pods, root, options)
    pod = pods.start(
        name,
        server_argv(free_port()),
        cache_root=root,
        options=options,
        env={"STANDIN_LOAD_SECONDS": str(seconds)},
    )
    pod.wait_phase("launching")
    wait_for(lambda: SERVER_BANNER in pod.log.read_text(errors="replace"), what="the server's banner")
    return pod


def test_a_loading_server_deaf_to_the_pods_sigterm_is_killed_after_the_grace(
    pods: Cluster, root: Path
) -> None:
    """The real vLLM, signalled while its engine core loads, may never exit (docs/design.md, "The
    real server"): here the loading server is frozen (SIGSTOP), so the forwarded SIGTERM stays
    pending. After the stop's grace cachemgr kills it and every process under it, and ends 143."""
    pod = _loading(pods, root, "deaf", seconds=600)
    me = psutil.Process(pod.proc.pid)
    (server,) = me.children()
    server.send_signal(signal.SIGSTOP)
    wait_for(lambda: server.status() == psutil.STATUS_STOPPED, timeout=10, what="the server frozen")
    signalled = time.monotonic()
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit(timeout=STOP_GRACE + 60) == TERM, pod.tail()
    took = time.monotonic() - signalled
    assert took >= STOP_GRACE, f"killed only after the grace, not after {took:.1f} s"
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
    kills = _events(pod, "server_killed")
    assert len(kills) == 1, pod.tail()
    assert kills[0]["level"] == "warning"
    assert kills[0]["processes"] >= 1
    assert not _events(pod, "failed"), "a stop, not a failure of the entry"
    detail = pod.state()["detail"]
    assert detail == {"exit_code": TERM, "stopped_by": "SIGTERM", "server_exit_code": 137}, pod.tail()
    assert_clean_after_failure(root)


# --- the tail kept of the server's output -------------------------------------------------------


class _ServerTail:
    """The tail a server's output keeps (ServerOutput's keeper and sizes), fed by hand."""

    def __init__(self) -> None:
        self.tail = Tail(lines=TAIL_LINES)
        self.keeper = LineKeeper(self.tail, (), line_bytes=TAIL_LINE_BYTES)

    def feed(self, chunk: bytes) -> None:
        self.keeper.feed(chunk)

    def lines(self) -> list[str]:
        open_line = self.keeper.open_line()
        return [*self.tail.lines, *([open_line] if open_line else [])]


def _cut(text: str, total: int) -> str:
    return text + CUT_MARK.format(cut=total - len(text)) if total > len(text) else text


@pytest.mark.quick
def test_the_kept_tail_is_bounded_whatever_the_server_prints() -> None:
    tail = _ServerTail()
    tail.feed(b"x" * (8 << 20))  # 8 MiB without a newline
    tail.feed(b"y" * (8 << 20) + b"\n")
    for i in range(1000):
        tail.feed(f"line {i}\n".encode())
    tail.feed(b"loading 10%\rloading 55%\rloading 100%")
    lines = tail.lines()
    assert len(lines) <= TAIL_LINES + 1
    assert all(len(line.encode()) <= TAIL_LINE_BYTES + len(CUT_MARK) + 10 for line in lines)
    assert lines[-2:] == ["line 999", "loading 100%"]
    whole = _ServerTail()
    whole.feed(b"z" * (8 << 20) + b"\nok\n")
    assert whole.lines() == [_cut("z" * TAIL_LINE_BYTES, 8 << 20), "ok"]


@pytest.mark.quick
def test_the_kept_tail_is_the_same_however_the_output_is_cut_into_reads() -> None:
    """Reads end anywhere: mid-line, on a newline, with many lines or none in one read."""
    text = b"".join(f"{i} {'w' * (i * 37 % 900)}\n".encode() for i in range(300)) + b"last, unfinished"
    expected = [_cut(line[:TAIL_LINE_BYTES].decode(), len(line)) for line in text.split(b"\n")][
        -TAIL_LINES - 1 :
    ]
    for sizes in ((1,), (7, 4096), (len(text),), (65536,), (399, 400, 401)):
        tail, at, turn = _ServerTail(), 0, 0
        while at < len(text):
            size = sizes[turn % len(sizes)]
            tail.feed(text[at : at + size])
            at, turn = at + size, turn + 1
        assert tail.lines() == expected, sizes


def test_every_byte_the_server_prints_reaches_the_pod_log(pods: Cluster, root: Path) -> None:
    """The tail is kept beside the pass-through: many lines, a long line, no newline at the end.

    The "server" prints once cachemgr's own events before the spawn are in the log (they share
    the pod's log), then exits 3 before its (unanswered) health URL is ever ready."""
    options = [
        "--strategy",
        "command",
        "--compile-cmd",
        compile_cmd(pods.work / "c.jsonl"),
        "--prefetch",
        "off",
    ]
    script = (
        "import os, sys, time\n"
        "log = os.environ['TALK_LOG']\n"
        "while '\"launching\"' not in open(log).read():\n"
        "    time.sleep(0.01)\n"
        "sys.stdout.write(''.join(f'out {i}\\n' for i in range(20000)))\n"
        "sys.stdout.write('e' * 300000 + '\\n' + 'the end without a newline')\n"
        "sys.exit(3)\n"
    )
    argv = [sys.executable, "-c", script, "{artifact_dir}"]
    warm = pods.start("w", argv, cache_root=root, command="warm", options=options)
    assert warm.wait_exit() == 0, warm.tail()
    health = ["--health-url", f"http://127.0.0.1:{free_port()}/health"]
    env = {"TALK_LOG": str(pods.work / "logs" / "talk.log")}
    pod = pods.start("talk", argv, cache_root=root, options=[*options, *health], env=env)
    assert pod.wait_exit() == 3, pod.tail()
    log = pod.log.read_text(errors="replace")
    assert "".join(f"out {i}\n" for i in range(20000)) + "e" * 300000 + "\nthe end without a newline" in log
    (failed,) = _events(pod, "failed")
    cut = "e" * TAIL_LINE_BYTES + CUT_MARK.format(cut=300000 - TAIL_LINE_BYTES)
    assert failed["last_lines"][-2:] == [cut, "the end without a newline"], failed
    assert failed["last_lines"][-3] == "out 19999"


# --- the spawn under the relay ------------------------------------------------------------------


def test_a_signal_while_the_server_is_being_started_reaches_it_once_attached() -> None:
    """SIGTERM lands between the relay's check and the attach (inside ``start``): it is kept and
    forwarded to the child at once, never lost; after it, no second spawn happens at all."""
    relay = SignalRelay().install()
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        os.kill(os.getpid(), signal.SIGTERM)  # handled here, in the main thread, before the Popen
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        started.append(child)
        return child

    try:
        child = relay.spawn(start)
        assert child.wait(timeout=30) == -signal.SIGTERM
        assert relay.received == signal.SIGTERM
        with pytest.raises(Interrupted) as stopped:
            relay.spawn(start)
        assert stopped.value.code == TERM
        assert len(started) == 1, "no server is started after the signal"
    finally:
        relay.restore()
        for proc in started:
            proc.kill()
            proc.wait()


def test_a_server_started_without_the_cache_and_stopped_before_it_served_ends_143(
    pods: Cluster, root: Path, tmp_path: Path
) -> None:
    """vllm-rbln 0.11.1's vLLM-model path: cachemgr cannot hold its artifacts and starts the server
    as given (launch.pass_through). A stop before it serves ends as on a hit: 143, whatever the
    server's own code (the stand-in ends 0 on SIGTERM), its own code kept in the state."""
    release = manifest.release("0.11.1")
    env = {
        "CACHEMGR_VLLM_VERSION": release.vllm,
        "CACHEMGR_VLLM_RBLN_VERSION": "0.11.1",
        "CACHEMGR_OPTIMUM_RBLN_VERSION": release.optimum_rbln,
        "CACHEMGR_TRANSFORMERS_VERSION": release.transformers,
        "VLLM_RBLN_USE_VLLM_MODEL": "1",
        "STANDIN_COMPILE_SECONDS": "600",
        **npu_node(tmp_path),
    }
    pod = pods.start("through", vllm_argv(free_port()), cache_root=root, env=env)
    pod.wait_phase("launching")
    wait_for(lambda: SERVER_BANNER in pod.log.read_text(errors="replace"), what="the server's banner")
    assert "not_cacheable" in {e["event"] for e in pod.log_events()}
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == TERM, pod.tail()
    assert pod.state()["detail"] == {"exit_code": TERM, "stopped_by": "SIGTERM", "server_exit_code": 0}
