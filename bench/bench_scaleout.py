"""Cold scale-out: N pods of one key start at once on an empty cache, with and without cachemgr.

For N = 2, 4, 8 and each volume (a local directory; two mounts of one JuiceFS volume, pods
alternating between them as between two nodes), in one run:

All pods of a run start within ``--jitter`` seconds (0.5; the same start times for every setup).

* ``cachemgr``: N ``cachemgr run`` pods (tests/podlib.py; the stand-in compiler through
  ``--strategy command --compile-cmd``, the stand-in server loading ``{artifact_dir}``);
* ``each pod compiles``: vllm-rbln's node-local default, each pod its own output directory:
  N stand-in compilers in parallel, then each pod's server loads its own directory;
* ``shared dir, no lock``: N stand-in compilers writing into the same output directory at once,
  then each pod's server loads it;
* ``shared VLLM_CACHE_ROOT``: N stand-in vLLM servers with one ``VLLM_CACHE_ROOT`` on the volume,
  each compiling what it does not find and saving it as optimum-rbln does (copy to ``.tmp``, rename
  or merge): what pointing vllm-rbln's cache at a shared PVC does.

Reported: compiles run (from the compilers' own records), bytes the compilers wrote (every compile
here runs to its end and writes the whole output), bytes stored on the volume afterwards, wall time
from the start to the last pod answering /health, pods that never served, and whether what each
server loaded is intact: the digest it reports (``/standin/artifacts``) against a clean compile.

On this 2-core machine N parallel compiles also compete for CPU, so "each pod compiles" takes
longer here than it would on N nodes; its real cost is in the compiles and bytes columns.

    .venv/bin/python bench/bench_scaleout.py                 # N = 2, 4, 8; local and JuiceFS
    .venv/bin/python bench/bench_scaleout.py --quick         # N = 2, 4; 1 s compiles; 8 MiB
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from cachemgr_standin.compiler import load_compiled_dir  # noqa: E402
from mounts import juicefs_volume, mount_unavailable_reason, unmount_on_sigterm  # noqa: E402  # tests/ is on sys.path above
from podlib import STANDIN_COMPILER, Cluster, free_port, read_jsonl  # noqa: E402

MODEL = "rebellions/Bench-LLM"
MODES = {  # label -> directory name
    "cachemgr": "cachemgr",
    "each pod compiles": "per-pod",
    "shared dir, no lock": "shared-dir",
    "shared VLLM_CACHE_ROOT": "shared-vllm",
}


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


@dataclass(frozen=True)
class Spec:
    files: int
    size: int
    seconds: float

    def compiler(self, out_dir: str, record: Path) -> str:
        return (
            f"{STANDIN_COMPILER} --output-dir {out_dir} --model {MODEL} --files {self.files} "
            f"--bytes {self.size} --seconds {self.seconds} --record {record}"
        )

    def standin_env(self) -> dict[str, str]:
        """The stand-in server compiling by itself: the same files, bytes and time."""
        return {
            "STANDIN_COMPILE_SECONDS": str(self.seconds),
            "STANDIN_ARTIFACT_FILES": str(self.files),
            "STANDIN_ARTIFACT_BYTES": str(self.size),
            "STANDIN_LOAD_SECONDS": "0",
        }


@dataclass
class Outcome:
    mode: str
    pods: int
    compiles: int
    written: int
    stored: int
    wall: float | None  # to the last pod serving; None when some never served
    served: int
    intact: int  # servers whose loaded digest matches a clean compile
    note: str = ""


@dataclass
class PodProc:
    proc: subprocess.Popen[bytes]
    port: int
    ready_at: float | None = None


def health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def artifacts_digest(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/standin/artifacts", timeout=2) as reply:
            return str(json.loads(reply.read())["digest"])
    except (OSError, ValueError, KeyError):
        return None


def wait_all(pods: list[PodProc], started: float, timeout: float) -> None:
    """Until every pod serves or has exited: readiness as the kubelet would see it."""
    deadline = started + timeout
    while time.monotonic() < deadline:
        pending = [p for p in pods if p.ready_at is None and p.proc.poll() is None]
        if not pending:
            return
        for pod in pending:
            if health(pod.port):
                pod.ready_at = time.monotonic()
        time.sleep(0.05)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def reference_digests(spec: Spec, work: Path, env: dict[str, str]) -> dict[str, str]:
    """Clean compiles, one process each, in clean directories: what every server must load."""
    out = work / "reference"
    out.mkdir(parents=True)
    subprocess.run(
        [*spec.compiler(str(out / "compiled"), out / "record.jsonl").split(), "--seconds", "0"],
        check=True,
        capture_output=True,
    )
    compiled = load_compiled_dir(out / "compiled")[0]
    root = out / "vllm-cache"
    server_env = {
        **env,
        **spec.standin_env(),
        "STANDIN_COMPILE_SECONDS": "0",
        "VLLM_CACHE_ROOT": str(root),
        "VLLM_RBLN_COMPILE_ONLY": "1",
        "STANDIN_RECORD": str(out / "server.jsonl"),
    }
    done = subprocess.run(
        ["vllm", "serve", MODEL, "--port", str(free_port())], env=server_env, capture_output=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"reference compile failed: {done.stderr.decode()[-1000:]}")
    saves = [e for e in read_jsonl(out / "server.jsonl") if e["event"] == "save"]
    return {"compiled": compiled, "vllm": str(saves[-1]["digest"])}


@dataclass(frozen=True)
class Bench:
    spec: Spec
    cluster: Cluster
    refs: dict[str, str]
    timeout: float
    jitter: float
    rng: random.Random


def run_mode(bench: Bench, mode: str, n: int, roots: list[Path]) -> Outcome:
    spec, cluster, refs = bench.spec, bench.cluster, bench.refs
    run_dir = [root / f"{MODES[mode]}-{n}" for root in roots]
    run_dir[0].mkdir()
    record = cluster.work / f"record-{MODES[mode]}-{n}-{secrets.token_hex(3)}.jsonl"
    env = {**cluster.base_env, "STANDIN_RECORD": str(record), "STANDIN_LOAD_SECONDS": "0"}
    ports = [free_port() for _ in range(n)]
    procs: list[subprocess.Popen[bytes]] = []
    # The same spread of start times for every setup: a rollout starts its pods within a moment.
    delays = sorted(bench.rng.uniform(0, bench.jitter) for _ in range(n))
    started = time.monotonic()
    for i, (port, delay) in enumerate(zip(ports, delays, strict=True)):
        time.sleep(max(0.0, started + delay - time.monotonic()))
        here = run_dir[i % len(run_dir)]
        procs.append(_start(bench, mode, i, here, port=port, env=env, record=record))
    pods = [PodProc(proc, port) for proc, port in zip(procs, ports, strict=True)]
    try:
        wait_all(pods, started, bench.timeout)
        ready = [p for p in pods if p.ready_at is not None]
        reference = refs["vllm"] if mode == "shared VLLM_CACHE_ROOT" else refs["compiled"]
        digests = [artifacts_digest(p.port) for p in ready]
    finally:
        stop(procs)
    events = read_jsonl(record)
    compiles = sum(1 for e in events if e.get("event") == "compile")
    note = ""
    if mode == "shared dir, no lock":
        try:
            final = load_compiled_dir(run_dir[0] / "compiled")[0]
            note = (
                "final dir intact" if final == refs["compiled"] else "final dir differs from a clean compile"
            )
        except (OSError, ValueError, RuntimeError) as error:
            note = f"final dir damaged: {type(error).__name__}"
    failed = [e for e in events if e.get("event") == "save-failed"]
    if failed:
        note = f"{note}; {len(failed)} saves failed".strip("; ")
    crashes = Counter(
        f"{_why(cluster.work / 'logs' / f'{run_dir[i % len(run_dir)].name}-p{i}.log')} "
        f"(exit {pod.proc.returncode})"
        for i, pod in enumerate(pods)
        if pod.ready_at is None
    )
    if crashes:
        why = ", ".join(f"{count} {reason}" for reason, count in crashes.most_common())
        note = f"{note}; never served: {why}".strip("; ")
    wall = max(p.ready_at for p in ready) - started if len(ready) == n and ready else None  # type: ignore[type-var]
    return Outcome(
        mode=mode,
        pods=n,
        compiles=compiles,
        written=compiles * spec.size,
        stored=tree_bytes(run_dir[0]),
        wall=wall,
        served=len(ready),
        intact=sum(1 for d in digests if d == reference),
        note=note,
    )


_ERROR = re.compile(r"^((?:\w+\.)*\w*(?:Error|Exception))\b:?\s*(.*)$")


def _why(log: Path) -> str:
    """The exception that ended a pod that never served, from its log's last traceback line."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    for line in reversed(lines):
        match = _ERROR.match(line.strip())
        if match:
            name = match.group(1).rsplit(".", 1)[-1]
            name = match.group(1) if name == "Error" else name  # shutil.Error, not just Error
            return f"{name} (torn file)" if "truncated or damaged" in match.group(2) else name
    return "no traceback"


def _start(
    bench: Bench, mode: str, i: int, here: Path, *, port: int, env: dict[str, str], record: Path
) -> subprocess.Popen[bytes]:
    spec, cluster = bench.spec, bench.cluster
    node = f"node-{i % 2}"
    if mode == "cachemgr":
        options = ["--strategy", "command", "--compile-cmd", spec.compiler("{output_dir}", record)]
        pod = cluster.start(
            f"{here.name}-p{i}", ["vllm", "serve", "{artifact_dir}", "--port", str(port)],
            cache_root=here, options=options, node=node, env={"STANDIN_RECORD": str(record),
                                                              "STANDIN_LOAD_SECONDS": "0"},
        )  # fmt: skip
        return pod.proc
    if mode == "shared VLLM_CACHE_ROOT":
        argv = ["vllm", "serve", MODEL, "--port", str(port)]
        pod_env = {**env, **spec.standin_env(), "VLLM_CACHE_ROOT": str(here / "vllm-cache")}
    else:
        out = here / ("compiled" if mode == "shared dir, no lock" else f"pod-{i}/compiled")
        script = f"{spec.compiler(str(out), record)} && exec vllm serve {out} --port {port}"
        argv, pod_env = ["sh", "-c", script], env
    log = cluster.work / "logs" / f"{here.name}-p{i}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out_log:
        return subprocess.Popen(argv, env=pod_env, stdout=out_log, stderr=out_log, start_new_session=True)


@contextlib.contextmanager
def filesystems(kinds: list[str], work: Path) -> Iterator[list[tuple[str, list[Path]]]]:
    with contextlib.ExitStack() as stack:
        found: list[tuple[str, list[Path]]] = []
        for kind in kinds:
            if kind == "local":
                (work / "local").mkdir()
                found.append(("local", [work / "local"]))
                continue
            reason = mount_unavailable_reason("juicefs")
            if reason is not None:
                print(f"skipping juicefs: {reason}", file=sys.stderr)
                continue
            mounts = stack.enter_context(juicefs_volume(work / "juicefs", mounts=2))
            found.append(("juicefs (2 mounts)", mounts))
        yield found


def print_table(label: str, outcomes: list[Outcome], spec: Spec) -> None:
    print(
        f"\n### Cold scale-out on {label}: one key, {spec.files} files / {human(spec.size)} per compile, "
        f"{spec.seconds:g} s stand-in compile\n"
    )
    print(
        "| N | setup | compiles | written | stored | all serving after | vs cachemgr | served | intact | note |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    base = {o.pods: o for o in outcomes if o.mode == "cachemgr"}
    for o in outcomes:
        wall = f"{o.wall:.1f} s" if o.wall is not None else "never"
        ref = base.get(o.pods)
        ratio = f"{o.wall / ref.wall:.2f}x" if o.wall is not None and ref and ref.wall else "-"
        print(
            f"| {o.pods} | {o.mode} | {o.compiles} | {human(o.written)} | {human(o.stored)} | {wall} | {ratio} "
            f"| {o.served}/{o.pods} | {o.intact}/{o.served} | {o.note or '-'} |"
        )


def main() -> int:
    unmount_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", default="2,4,8", help="comma-separated N (default 2,4,8)")
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--mib", type=int, default=64, help="MiB written per compile (default 64)")
    parser.add_argument("--compile-seconds", type=float, default=3.0)
    parser.add_argument("--fs", default="local,juicefs", help="comma-separated: local, juicefs")
    parser.add_argument("--timeout", type=float, default=180.0, help="per run, to all serving")
    parser.add_argument("--jitter", type=float, default=0.5, help="pods start within this many seconds")
    parser.add_argument("--seed", type=int, default=7, help="for the start times")
    parser.add_argument(
        "--keep", action="store_true", help="keep the pods' logs and records (path on stderr)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: N = 2, 4; 1 s compiles; 8 MiB")
    args = parser.parse_args()
    if args.quick:
        args.pods, args.mib, args.compile_seconds = "2,4", 8, 1.0
    spec = Spec(files=args.files, size=args.mib << 20, seconds=args.compile_seconds)
    work = Path(tempfile.mkdtemp(prefix="bench-scaleout-"))
    tables = []
    try:
        cluster = Cluster.create(work / "pods")
        refs = reference_digests(spec, work, cluster.base_env)
        bench = Bench(spec, cluster, refs, args.timeout, args.jitter, random.Random(args.seed))
        with filesystems(args.fs.split(","), work) as found:
            for label, roots in found:
                outcomes = []
                for n in (int(x) for x in args.pods.split(",")):
                    for mode in MODES:
                        outcome = run_mode(bench, mode, n, roots)
                        print(f"{label} N={n} {mode}: {outcome}", file=sys.stderr)
                        outcomes.append(outcome)
                    cluster.stop_all()
                tables.append((label, outcomes))
    finally:
        if args.keep:
            print(f"kept {work / 'pods'}", file=sys.stderr)
            for volume in ("local", "juicefs"):
                shutil.rmtree(work / volume, ignore_errors=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    for label, outcomes in tables:
        print_table(label, outcomes, spec)
    summary = [o for _, outs in tables for o in outs if o.mode == "cachemgr"]
    if summary:
        print(
            f"\ncachemgr: {statistics.mean(o.compiles for o in summary):.0f} compile per scale-out on average"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
