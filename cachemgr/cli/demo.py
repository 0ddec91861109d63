"""``cachemgr demo``: two prefill and two decode pods, cold then warm, on this machine.

Each "pod" is a real ``cachemgr run`` process with its own state directory, pod and node
name; each role has its own cache volume (a directory standing in for the role's PVC). The
server is the STAND-IN vLLM server (``cachemgr_standin``, put on PATH as ``vllm``), because
there is no NPU here; cachemgr itself runs exactly as in a pod. The demo prints a timeline
of phase changes, then checks the promise: one compile per role when cold, none when warm.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO

from cachemgr_standin import DECLARED_VERSIONS
from cachemgr_standin.shim import write_vllm_shim

from cachemgr.core.errors import CacheMgrError

MODEL = "rebellions/Demo-LLM-8B"
_COMPILER, _NPU = "0.12.0", "RBLN-CA25"  # the demo image's compiler and its pods' NPU
_DEADLINE = 120.0
_SETTLE = 1.5  # seconds a phase event may arrive late (held until the pod launches or misses)


@dataclass
class Pod:
    name: str
    role: str
    node: str
    port: int
    state_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    phase: str = "-"
    log_file: IO[bytes] | None = field(default=None, repr=False)
    read: int = 0  # how far its log has been read for phase events
    started_at: float = 0.0  # wall clock at its start: no event of this start can be earlier


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _read_phase(pod: Pod) -> tuple[str, dict[str, object]]:
    try:
        data = json.loads((pod.state_dir / "state.json").read_bytes())
    except (OSError, ValueError):
        return "-", {}
    return str(data.get("phase", "-")), dict(data.get("detail") or {})


def _env(
    base: Mapping[str, str], pod: Pod, work: Path, bin_dir: Path, compile_seconds: float
) -> dict[str, str]:
    return {
        **base,
        "PATH": f"{bin_dir}{os.pathsep}{base.get('PATH', '')}",
        "CACHEMGR_ROLE": pod.role,
        "CACHEMGR_CACHE_ROOT": str(work / f"{pod.role}-volume"),
        "CACHEMGR_STATE_DIR": str(pod.state_dir),
        "CACHEMGR_COMPILER_VERSION": _COMPILER,
        **DECLARED_VERSIONS,
        "CACHEMGR_NPU_TYPE": _NPU,
        "CACHEMGR_LOG_FORMAT": "json",
        "CACHEMGR_TERMINATION_LOG": str(pod.state_dir / "termination-log"),
        "POD_NAME": pod.name,
        "NODE_NAME": pod.node,
        "STANDIN_COMPILE_SECONDS": str(compile_seconds),
        "STANDIN_RECORD": str(work / "standin-record.jsonl"),
        "PYTHONUNBUFFERED": "1",
    }


def _start(pod: Pod, env: dict[str, str]) -> None:
    pod.state_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("state.json", "heartbeat"):
        (pod.state_dir / stale).unlink(missing_ok=True)
    pod.log_file = pod.log_path.open("ab")
    pod.read = pod.log_file.tell()  # this start's events only (the log is appended to)
    pod.started_at = time.time()
    argv = [sys.executable, "-m", "cachemgr", "run", "--lease-duration", "10", "--", "vllm", "serve", MODEL,
            "--tensor-parallel-size", "4", "--max-model-len", "8192", "--port", str(pod.port)]  # fmt: skip
    pod.proc = subprocess.Popen(argv, env=env, stdout=pod.log_file, stderr=pod.log_file)
    pod.phase = "-"


def _watch(pods: list[Pod], started: float, *, until: str) -> bool:
    """Print every phase change, from the pods' own ``phase`` log events (however short a phase
    was: polling the state record missed the few milliseconds of ``publishing``); True once every
    pod reached ``until``."""
    deadline = time.monotonic() + _DEADLINE
    wall = time.time() - (time.monotonic() - started)
    pending: list[tuple[float, str, str, str]] = []

    def show(*, settled_before: float) -> None:
        # A pod holds its first events until it launches or misses (cachemgr.core.log): lines are
        # printed in time order once no earlier one can still arrive.
        pending.sort()
        while pending and pending[0][0] <= settled_before:
            at, name, phase, note = pending.pop(0)
            print(f"  {max(0.0, at - wall):6.2f}s  {name:<10} {phase:<11} {note}".rstrip(), flush=True)

    while time.monotonic() < deadline:
        pending.extend(change for pod in pods for change in _phase_events(pod))
        show(settled_before=_settled(pods, time.time() - _SETTLE))
        for pod in pods:
            if pod.proc is not None and pod.proc.poll() is not None and pod.phase != until:
                show(settled_before=float("inf"))
                print(f"  {pod.name} exited with code {pod.proc.returncode}: see {pod.log_path}", flush=True)
                return False
        if all(pod.phase == until for pod in pods):
            show(settled_before=float("inf"))
            return True
        time.sleep(0.05)
    show(settled_before=float("inf"))
    print(f"  timed out after {_DEADLINE:.0f}s waiting for every pod to reach {until}", flush=True)
    return False


def _settled(pods: list[Pod], before: float) -> float:
    """Lines before this time can no longer be preceded by one still to come. A pod that has not
    logged its first event yet holds it (back-dated to when it began resolving, which may be
    seconds ago on a loaded machine): nothing after its start is settled until it does."""
    unread = [
        pod.started_at
        for pod in pods
        if pod.phase == "-" and pod.proc is not None and pod.proc.poll() is None
    ]
    return min([before, *unread])


def _phase_events(pod: Pod) -> list[tuple[float, str, str, str]]:
    """The pod's new ``phase`` events as (time, pod, phase, note); its first also says where it began."""
    try:
        with pod.log_path.open("rb") as log:
            log.seek(pod.read)
            data = log.read()
    except OSError:
        return []
    complete = data[: data.rfind(b"\n") + 1]
    pod.read += len(complete)
    found = []
    for line in complete.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the server's own output
        if not isinstance(event, dict) or event.get("event") != "phase":
            continue
        at = _epoch(str(event.get("timestamp", "")))
        if pod.phase == "-":
            began = at - float(event.get("seconds_in_previous") or 0.0)
            found.append((began, pod.name, str(event.get("from")), ""))
        pod.phase = str(event.get("to"))
        found.append((at, pod.name, pod.phase, _note(pod.phase, dict(event.get("detail") or {}))))
    return found


def _epoch(stamp: str) -> float:
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return time.time()


def _note(phase: str, detail: dict[str, object]) -> str:
    if phase == "waiting":
        holder = (
            f"{detail['holder']} on {detail.get('holder_node') or '?'}" if detail.get("holder") else "a peer"
        )
        return f"({holder} is compiling; watching for its entry)"
    if phase == "compiling":
        return "(holds the lease; the stand-in compiler runs)"
    if phase == "launching":
        return "(cache hit: model load only)"
    if detail.get("downloading"):
        return f"(looking in the remote tier {detail.get('remote')})"
    return ""


def _stop(pods: list[Pod]) -> list[int]:
    codes = []
    for pod in pods:
        if pod.proc is not None and pod.proc.poll() is None:
            pod.proc.send_signal(signal.SIGTERM)
    for pod in pods:
        if pod.proc is not None:
            try:
                codes.append(pod.proc.wait(timeout=30))
            except subprocess.TimeoutExpired:
                pod.proc.kill()
                codes.append(pod.proc.wait())
        if pod.log_file is not None:
            pod.log_file.close()
    return codes


def compiles(work: Path) -> dict[str, int]:
    counts = {"prefill": 0, "decode": 0}
    record = work / "standin-record.jsonl"
    if not record.exists():
        return counts
    for line in record.read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "compile":
            role = "prefill" if "prefill-volume" in str(event.get("cache_root", "")) else "decode"
            counts[role] += 1
    return counts


class Stopped(CacheMgrError):  # noqa: N818  # a clean stop, reported by its exit code
    """The demo was sent SIGTERM or SIGHUP: its pods are stopped with it, never left running."""

    reason = "interrupted"

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(
            f"stopped by signal {signum} ({signal.Signals(signum).name}); the demo's pods were stopped with it",
            remedy="run cachemgr demo again: it starts over in a fresh directory",
            signum=signum,
        )

    @property
    def code(self) -> int:
        return 128 + self.signum


def _stop_on_signal(signum: int, _frame: object) -> None:
    raise Stopped(signum)


def run_round(
    title: str, pods: list[Pod], *, work: Path, bin_dir: Path, environ: Mapping[str, str], secs: float
) -> bool:
    print(f"\n{title}", flush=True)
    started = time.monotonic()
    previous = {signum: signal.signal(signum, _stop_on_signal) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for pod in pods:
            _start(pod, _env(environ, pod, work, bin_dir, secs))
        ok = _watch(pods, started, until="serving")
        elapsed = time.monotonic() - started
    finally:  # Ctrl-C, a signal, a bug: the pods (real processes serving on ports) stop with the demo
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        codes = _stop(pods)
    if ok:
        print(
            f"  all four serving after {elapsed:.2f}s; stopped with SIGTERM, exit codes {codes}", flush=True
        )
    else:
        print(
            f"  not every pod served (above); stopped the rest with SIGTERM, exit codes {codes}", flush=True
        )
    return ok and all(code == 0 for code in codes)


MARKER = ".cachemgr-demo"  # in every directory the demo makes: only such a directory is removed
_MADE = frozenset({"bin", "prefill-volume", "decode-volume", "pods", "logs", "standin-record.jsonl"})


def clear(work: Path, *, made: frozenset[str] = _MADE) -> None:
    """Remove an earlier demo's directory, and nothing else: ``--dir`` named by mistake (``.``,
    ``$HOME``, a cache volume) is refused, not emptied. A directory an older demo made (no marker,
    only the demo's own names) is its own too."""
    from cachemgr.core.errors import UsageError

    if not os.path.lexists(work):
        return
    names = set(os.listdir(work)) if work.is_dir() and not work.is_symlink() else None
    if names is None or (names and MARKER not in names and not names <= made):
        raise UsageError(
            f"--dir {work} is not a directory this demo made (no {MARKER} in it), and the demo "
            "removes its directory before it starts; nothing was removed",
            remedy="give a new or empty directory, e.g. cachemgr demo --dir /tmp/cachemgr-demo",
        )
    if names:
        shutil.rmtree(work)


def prepare(work: Path) -> tuple[Path, list[Pod]]:
    """A fresh demo "cluster" under ``work``: the stand-in on PATH, a volume per role, four pods."""
    clear(work)
    bin_dir = work / "bin"
    bin_dir.mkdir(parents=True)
    (work / MARKER).write_text("made by cachemgr demo: the next demo with this --dir removes it\n")
    write_vllm_shim(bin_dir)
    for role in ("prefill", "decode"):
        (work / f"{role}-volume").mkdir()
    pods = [
        Pod(name, role, node, _free_port(), work / "pods" / name, work / "logs" / f"{name}.log")
        for name, role, node in (
            ("prefill-0", "prefill", "node-a"), ("prefill-1", "prefill", "node-b"),
            ("decode-0", "decode", "node-a"), ("decode-1", "decode", "node-b"),
        )
    ]  # fmt: skip
    (work / "logs").mkdir()
    return bin_dir, pods


def cachemgr_command() -> list[str]:
    """How to run this cachemgr from a shell, as printed: ``cachemgr`` where PATH finds this one
    (scripts/demo installs into .venv, which is not on PATH), else its path, else ``python -m``."""
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    found = shutil.which("cachemgr")
    if script is not None and found is not None and Path(found).resolve() == script:
        return ["cachemgr"]
    if script is not None and script.name == "cachemgr" and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "cachemgr"]


def inspect_command(work: Path) -> list[str]:
    """``cachemgr ls`` of the prefill volume, as a shell without the demo pods' environment needs
    it: their volume, and this image's compiler, NPU and server versions as the pods were told them
    (without those, ``ls`` judges no entry by compiler, NPU or generation, and says so)."""
    return [
        "env", *(f"{name}={value}" for name, value in DECLARED_VERSIONS.items()),
        *cachemgr_command(), "ls", "--cache-root", str(work / "prefill-volume"),
        "--compiler-version", _COMPILER, "--npu-type", _NPU,
    ]  # fmt: skip


def run_demo(work: Path, *, compile_seconds: float, environ: Mapping[str, str]) -> int:
    """Cold start, then warm restart; 0 when each role compiled exactly once and then never."""
    work = work.resolve()
    bin_dir, pods = prepare(work)
    print(f"cachemgr demo in {work}: 2 prefill + 2 decode pods, one cache volume per role")
    print(f"server: STAND-IN vllm (cachemgr_standin, not vLLM), compile takes {compile_seconds:g}s")
    print(f"argv:   vllm serve {MODEL} --tensor-parallel-size 4 --max-model-len 8192 --port PORT")
    cold_ok = run_round(
        "cold start (empty caches):", pods, work=work, bin_dir=bin_dir, environ=environ, secs=compile_seconds
    )
    cold = compiles(work)
    warm_ok = run_round(
        "warm restart (same pods, caches filled):",
        pods,
        work=work,
        bin_dir=bin_dir,
        environ=environ,
        secs=compile_seconds,
    )
    warm = {role: total - cold[role] for role, total in compiles(work).items()}
    print(f"\ncompiles: cold prefill={cold['prefill']} decode={cold['decode']}; "
          f"warm prefill={warm['prefill']} decode={warm['decode']}")  # fmt: skip
    print(f"inspect:  {shlex.join(inspect_command(work))}")
    passed = (
        cold_ok and warm_ok and cold == {"prefill": 1, "decode": 1} and warm == {"prefill": 0, "decode": 0}
    )
    print(
        "demo: OK, each role compiled once, then never again"
        if passed
        else "demo: FAILED, see the logs above"
    )
    return 0 if passed else 70
