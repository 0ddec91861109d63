"""A harness for real ``cachemgr run`` processes ("pods") in tests and benchmarks.

Each pod is a real process with its own state directory, pod and node name, started in its
own session so a test can SIGKILL or SIGSTOP the whole pod (cachemgr, compiler, server) the
way a node failure would. A pod on another "node" runs in its own UTS namespace with that
hostname, so lease takeover follows the cross-node rules (no shortcut through local pids).

Waiting is always on a condition with a deadline: a phase in ``state.json``, a file, a
process exit. Nothing here sleeps in the hope that something happened.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cachemgr_standin as standin
import psutil
from cachemgr_standin import DECLARED_VERSIONS
from cachemgr_standin.shim import write_vllm_shim
from prometheus_client.parser import text_string_to_metric_families

from cachemgr.runtime.state import read_status_port

DEADLINE = 60.0
STANDIN_SERVER = [sys.executable, "-m", "cachemgr_standin.server", "serve"]
STANDIN_COMPILER = f"{sys.executable} -m cachemgr_standin.compiler"
# Straight to 127.0.0.1, whatever http_proxy the environment has.
LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# libfaketime (Debian package faketime): LD_PRELOAD it to skew one process's wall clock.
FAKETIME_LIB = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))), None)
FAKETIME_SHIM = Path(__file__).resolve().parent / "faketime_shim"


def skewed_env(offset_seconds: int) -> dict[str, str]:
    """Environment that puts a process (and its children) on a node whose wall clock is
    ``offset_seconds`` off. Only the wall clock: a node's monotonic clock means nothing to
    another node. faketime_shim/sitecustomize.py says why Python needs the shim with it."""
    if FAKETIME_LIB is None:
        raise AssertionError("libfaketime is not installed: apt-get install faketime (.ci/run does)")
    path = os.pathsep.join(filter(None, [str(FAKETIME_SHIM), os.environ.get("PYTHONPATH")]))
    return {
        "LD_PRELOAD": FAKETIME_LIB,
        "FAKETIME": f"{offset_seconds:+d}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": path,
    }


# What libfaketime 0.9.10 makes for each process it is preloaded into (ft_shm_create: a semaphore
# and a shared-memory counter named after the pid) and removes in its destructor at a normal exit.
FAKETIME_SHM = Path("/dev/shm")
_FAKETIME_SHM_NAMES = re.compile(r"(?:faketime_shm|sem\.faketime_sem)_(\d+)")


def sweep_faketime_shm(shm: Path = FAKETIME_SHM) -> list[str]:
    """Remove the libfaketime objects of processes that are gone; the names removed.

    A process of :func:`skewed_env` that is killed (the clock-skew tests and the campaign
    SIGKILL pods) never runs the destructor, so its two files stay in /dev/shm for good. The pid
    is in the name: the files of a pid still alive are kept, whatever process it is (another
    test run's, another user's), and a pid reused since only keeps its files a little longer.
    """
    removed = []
    for path in sorted(shm.glob("*faketime_*")):
        found = _FAKETIME_SHM_NAMES.fullmatch(path.name)
        if found is None or psutil.pid_exists(int(found[1])):
            continue
        with contextlib.suppress(FileNotFoundError, PermissionError):
            path.unlink()
            removed.append(path.name)
    return removed


def wait_for(
    predicate: Callable[[], Any], *, timeout: float = DEADLINE, what: str, every: float = 0.05
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


# Ports handed to servers that bind them later (a pod's stand-in server, weed mini): never from
# the kernel's ephemeral range, where any outgoing connection (a health check, an S3 request) may
# take a port between our check and the server's bind; and never the same twice in a process, so
# two servers of one test run cannot be handed one port. A port handed out is not bound until its
# server starts (a pod compiles first), so a bind check cannot see it: each test process (a
# pytest-xdist worker, or a plain pytest of a campaign split by -k) claims a block of its own with
# an flock that the kernel drops when the process ends, and draws only from that block.
_PORT_LOW, _PORT_HIGH = 15000, 32000  # below ip_local_port_range's usual 32768
_PORT_BLOCK = 1000
_ports: Iterator[int] | None = None
_block_claim: int | None = None  # the descriptor that holds this process's block


def _claim_block(blocks: int) -> int:
    """The first block, from this worker's own, that no other live test process holds."""
    global _block_claim  # noqa: PLW0603  # held open for the process's life
    import fcntl
    import tempfile

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    first = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else os.getpid()
    claims = Path(tempfile.gettempdir()) / "cachemgr-testkit-ports"
    claims.mkdir(exist_ok=True)
    for step in range(blocks):
        block = (first + step) % blocks
        fd = os.open(claims / f"block-{block}", os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _block_claim = fd
        return block
    return first % blocks  # every block held: share one; the bind check below still applies


def _port_sequence() -> Iterator[int]:
    blocks = (_PORT_HIGH - _PORT_LOW) // _PORT_BLOCK
    low = _PORT_LOW + _claim_block(blocks) * _PORT_BLOCK
    start = int.from_bytes(os.urandom(2), "big") % _PORT_BLOCK
    while True:
        for offset in range(_PORT_BLOCK):
            yield low + (start + offset) % _PORT_BLOCK


_ports_lock = threading.Lock()  # tests draw ports from threads too (test_guide's pool)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a server that binds it later."""
    with _ports_lock:
        return _free_port()


def _free_port() -> int:
    global _ports  # noqa: PLW0603  # one sequence per process: no port is handed out twice
    if _ports is None:
        _ports = _port_sequence()
    for _ in range(_PORT_BLOCK):
        port = next(_ports)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken (another run's server): the next one
            return port
    raise OSError(f"no free port in this worker's block of {_PORT_BLOCK} from {_PORT_LOW}")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Pod:
    """One ``cachemgr run`` process and where to look at it."""

    name: str
    proc: subprocess.Popen[bytes]
    state_dir: Path
    log: Path
    env: dict[str, str] = field(repr=False)

    def state(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads((self.state_dir / "state.json").read_bytes())
        except (OSError, ValueError):
            return {}
        return data

    @property
    def phase(self) -> str | None:
        return self.state().get("phase")

    def wait_phase(self, *phases: str, timeout: float = DEADLINE) -> str:
        def reached() -> str | None:
            phase = self.phase
            if phase in phases:
                return phase
            if self.proc.poll() is not None and self.phase not in phases:
                raise AssertionError(
                    f"{self.name} exited with {self.proc.returncode} before reaching {phases}:\n{self.tail()}"
                )
            return None

        result: str = wait_for(reached, timeout=timeout, what=f"{self.name} to reach {'/'.join(phases)}")
        return result

    def wait_exit(self, timeout: float = DEADLINE) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout:.0f}s:\n{self.tail()}") from None

    def signal(self, signum: int) -> None:
        """To cachemgr alone, as the kubelet signals a container's PID 1."""
        self.proc.send_signal(signum)

    def signal_pod(self, signum: int) -> None:
        """To the whole pod (cachemgr, compiler, server): a node dying or freezing."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signum)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_events(self) -> list[dict[str, Any]]:
        events = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                data = json.loads(line)
                if isinstance(data, dict) and "event" in data:
                    events.append(data)
        return events


def npu_node(work: Path) -> dict[str, str]:
    """The environment of a pod on a node with an RBLN NPU, as cachemgr sees it: a ``rbln0`` device
    node, and the stand-in's fake ``rebel`` answering ``get_npu_name(0)`` (``STANDIN_NPU_NAME``,
    RBLN-CA25 by default). Without it cachemgr sees a CPU node, as on this machine."""
    dev = work / "dev"
    dev.mkdir(parents=True, exist_ok=True)
    (dev / "rbln0").touch()
    pymods = Path(standin.__file__).resolve().parent / "pymods"
    path = os.pathsep.join(p for p in (str(pymods), os.environ.get("PYTHONPATH", "")) if p)
    return {"CACHEMGR_RBLN_DEV_DIR": str(dev), "PYTHONPATH": path}


@dataclass
class Cluster:
    """Pods of one test: common environment, a stand-in ``vllm`` on PATH, and cleanup."""

    work: Path
    base_env: dict[str, str]
    pods: list[Pod] = field(default_factory=list)

    @classmethod
    def create(cls, work: Path, **env: str) -> Cluster:
        bin_dir = work / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        write_vllm_shim(bin_dir)
        base = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "CACHEMGR_COMPILER_VERSION": "0.12.0",
            "CACHEMGR_NPU_TYPE": "RBLN-CA25",
            **DECLARED_VERSIONS,
            "CACHEMGR_ROLE": "prefill",
            "CACHEMGR_LOG_FORMAT": "json",
            "STANDIN_COMPILE_SECONDS": "0.5",
            "STANDIN_RECORD": str(work / "record.jsonl"),
            "STANDIN_SIGNAL_LOG": str(work / "signals.log"),
            "PYTHONUNBUFFERED": "1",
            **env,
        }
        return cls(work=work, base_env=base)

    @property
    def record(self) -> list[dict[str, Any]]:
        return read_jsonl(self.work / "record.jsonl")

    def compiles(self) -> int:
        return sum(1 for event in self.record if event.get("event") == "compile")

    def start(
        self,
        name: str,
        server_argv: Sequence[str],
        *,
        cache_root: Path,
        command: str = "run",
        options: Sequence[str] = (),
        node: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        open_files: int | None = None,
        python: str = sys.executable,
        user: int | None = None,
    ) -> Pod:
        """Start ``cachemgr <command> [options] -- server_argv`` as pod ``name`` (in ``cwd``);
        ``open_files``: its limit of open files (``ulimit -n``, as a container's runtime sets it);
        ``python``: the interpreter of another install of cachemgr (a venv without an extra);
        ``user``: the uid (and gid) it runs as (:func:`as_user`), owning its state folder."""
        state_dir = self.work / "pods" / name
        shutil.rmtree(state_dir, ignore_errors=True)
        state_dir.mkdir(parents=True)
        if user is not None:
            for folder in (self.work, state_dir):
                os.chown(folder, user, user)
        log = self.work / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        pod_env = {
            **self.base_env,
            "CACHEMGR_CACHE_ROOT": str(cache_root),
            "CACHEMGR_STATE_DIR": str(state_dir),
            "CACHEMGR_TERMINATION_LOG": str(state_dir / "termination-log"),
            "POD_NAME": name,
            "NODE_NAME": node or "node-a",
            # Another user's pod has a home of its own (a server caches under ~/.cache), as a
            # container's user has: root's is not that user's to write.
            **({"HOME": str(state_dir)} if user is not None else {}),
            **(env or {}),
        }
        argv = [python, "-m", "cachemgr", command, *options, "--", *server_argv]
        if node is not None:
            # Another node: its own hostname, so the lease sees a peer it cannot probe by pid.
            argv = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', node, *argv]
        with log.open("ab") as out:
            proc = subprocess.Popen(
                as_user(with_open_files(argv, open_files), user),
                env=pod_env,
                stdout=out,
                stderr=out,
                start_new_session=True,
                cwd=cwd,
            )
        pod = Pod(name=name, proc=proc, state_dir=state_dir, log=log, env=pod_env)
        self.pods.append(pod)
        return pod

    def stop_all(self) -> None:
        for pod in self.pods:
            if pod.proc.poll() is None:
                pod.signal_pod(signal.SIGCONT)
                pod.signal_pod(signal.SIGKILL)
        for pod in self.pods:
            with contextlib.suppress(subprocess.TimeoutExpired):
                pod.proc.wait(timeout=10)


@contextlib.contextmanager
def cluster(work: Path, **env: str) -> Iterator[Cluster]:
    group = Cluster.create(work, **env)
    try:
        yield group
    finally:
        group.stop_all()


def run_cli(
    *args: str,
    env: Mapping[str, str],
    timeout: float = DEADLINE,
    open_files: int | None = None,
    python: str = sys.executable,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``cachemgr ARGS`` to completion, output captured (``open_files``: its ``ulimit -n``;
    ``python``: another install's interpreter, run in ``cwd``: ``-m`` imports from the current
    directory first, and a checkout's would shadow the install's own copy)."""
    return subprocess.run(
        with_open_files([python, "-m", "cachemgr", *args], open_files),
        cwd=cwd,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,  # no TTY: a command must never prompt
    )


# Sets the limit in the child, then becomes the command (preexec_fn would, but is unsafe in a test
# process with threads: the campaign's watch, test_guide's pool).
_SET_OPEN_FILES = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); os.execvp(sys.argv[2], sys.argv[2:])"
)


def as_user(argv: Sequence[str], uid: int | None) -> list[str]:
    """``argv`` run as ``uid`` (and gid ``uid``, no other groups), as a pod's ``runAsUser`` runs it:
    root ignores every mode bit, a pod does not. It keeps one capability, reading and listing any
    file (CAP_DAC_READ_SEARCH), so that it can reach the test's interpreter and files in a
    checkout of any mode; it writes only where the user may (setpriv, util-linux)."""
    if uid is None:
        return list(argv)
    caps = "+dac_read_search"
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", f"--inh-caps={caps}",
            f"--ambient-caps={caps}", *argv]  # fmt: skip


def with_open_files(argv: Sequence[str], limit: int | None) -> list[str]:
    """``argv`` run with a limit of ``limit`` open files, soft and hard (``ulimit -n``, as a
    container runtime sets it: containerd's default is 1,024), by ``setrlimit`` in the child."""
    if limit is None:
        return list(argv)
    return [sys.executable, "-c", _SET_OPEN_FILES, str(limit), *argv]


# --- a pod's status server ----------------------------------------------------------------------


def status_get(port: int, path: str, *, timeout: float = 5.0) -> tuple[int, str]:
    """GET ``path`` from a pod's status server: (HTTP status, body), errors included."""
    try:
        with LOOPBACK.open(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode()


def status_port(pod: Pod) -> int:
    port: int = wait_for(lambda: read_status_port(pod.state_dir), what=f"{pod.name}'s status port")
    return port


def metrics(port: int) -> dict[str, float]:
    """``/metrics`` through prometheus_client's own parser: {sample name{labels}: value}."""
    code, text = status_get(port, "/metrics")
    assert code == 200
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def error_lines(stderr: str) -> list[str]:
    """How a failure was said on stderr, once (docs/reference.md, "What a command writes on
    stderr"): the ``message`` of a JSON log's ``failed`` event, or of the plain ``cachemgr CMD:
    MESSAGE`` line, the same line either way (a person's command prints the plain one even in a
    pod whose log is JSON)."""
    found = []
    for line in stderr.splitlines():
        plain = re.match(r"cachemgr(?: [a-z]+)?: ", line)
        if plain:
            found.append(line[plain.end() :])
        elif line.startswith("{") and '"event": "failed"' in line:
            found.append(str(json.loads(line)["message"]))
    return found
