"""Warm start: ``cachemgr run`` on a hit until the server starts, against starting the server directly.

The entry is published through the library's real publish path (``store.create_staging``, the
files, then ``store.publish``: manifest with the xxh3 of every file, fsync, one rename): 2,000
files, 4 GiB by default. The server is a tiny command that records its own start time and then
sleeps, the same command both ways::

    sh -c 'date +%s%N > "$BENCH_START_FILE"; exec sleep 600' <artifact dir>

Each run's figure is the server's recorded time minus the moment the bench spawned the process
(``cachemgr run ... -- sh -c ...`` through a ``cachemgr`` console script as in a pod, or ``sh``
itself), with a fresh state directory each time (a new pod's emptyDir). The two are taken in
turn and paired, so noise on the machine hits both: "added" is the median (and p95) of the
per-pair differences. Rows with dropped caches (``echo 3 > /proc/sys/vm/drop_caches`` before each
start, root only) show a node that has not touched the image or the entry yet.

cachemgr runs as the image installs it (``--install image``): from a throwaway venv that finds the
checkout on ``sys.path``, because a development venv's editable install (``pip install -e``) adds
an import hook that costs about 20 ms at every interpreter start. ``--install venv`` uses this
venv's own console script instead.

Volumes: a local directory; two JuiceFS mounts (the entry published through one, read through
the other) with no metadata caching, so every lookup and getattr goes to the metadata engine (a
node that never saw the entry); and the same with JuiceFS' default 1 s kernel caches.

Then where the time goes: the interpreter's start, the imports (``-X importtime``), and each step
of the hit path, timed inside a real ``cachemgr run`` by wrapping the library functions the runner
calls (key, open root, lookup with the fast check, use record, view, launching the server); and
the fast check done two other ways (a directory listing; threads), in this process.

    .venv/bin/python bench/bench_warm.py                    # local, JuiceFS, JuiceFS with caches
    .venv/bin/python bench/bench_warm.py --quick            # 200 files, 64 MiB, 5 runs
    .venv/bin/python bench/bench_warm.py --fs local --files 2000 --size 8G --runs 31
    git archive main | tar -x -C /tmp/main-tree && \
      .venv/bin/python bench/bench_warm.py --fs local --no-cold --against /tmp/main-tree   # A/B

Targets (issue 25 item 4): under 100 ms added on the local disk, under 200 ms on JuiceFS with its
default caches (the row without metadata caches is shown against the same 200 ms). Exits non-zero
only on errors, not on a missed target.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import venv
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachemgr_testkit.mounts import juicefs_volume, mount_unavailable_reason, unmount_on_sigterm

from cachemgr.key.cachekey import CacheKey, KeyRequest, compute_key
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import open_root
from cachemgr.volume.manifest import check_files, read_manifest
from cachemgr.volume.store import create_staging, publish

REPO = Path(__file__).resolve().parent.parent

TARGET_MS = {"local": 100.0}  # every other volume: JUICEFS_TARGET_MS
JUICEFS_TARGET_MS = 200.0
CONSOLE_SCRIPT = Path(sys.executable).parent / "cachemgr"
SERVER_SCRIPT = 'date +%s%N > "$BENCH_START_FILE"; exec sleep 600'
SERVER_ARGV = ["sh", "-c", SERVER_SCRIPT, "{artifact_dir}"]  # sh's $0: the artifact dir, unused
BASE_ENV = {
    "CACHEMGR_COMPILER_VERSION": "0.12.0",
    "CACHEMGR_NPU_TYPE": "RBLN-CA25",
    "CACHEMGR_ROLE": "prefill",
    "CACHEMGR_LOG_FORMAT": "json",
    "POD_NAME": "bench-pod",
    "NODE_NAME": "bench-node",
}
_IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+(\d+) \| (.*)$")
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)(?:i?b)?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    match = _SIZE.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4G, 512M)")
    return int(float(match.group(1)) * (1 << (10 * " kmgt".index(match.group(2).lower() or " "))))


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank: with few runs, p95 is the worst but one or so."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# --- the entry: published through the real path ----------------------------------------------


def compile_cmd(files: int, size: int) -> str:
    """Key material only: the entry is published ahead, so a hit never runs it."""
    return (
        f"{sys.executable} -m cachemgr_standin.compiler --output-dir {{output_dir}} --files {files} "
        f"--bytes {size}"
    )


def bench_key(files: int, size: int, server_argv: list[str] = SERVER_ARGV) -> CacheKey:
    return compute_key(
        KeyRequest(
            argv=server_argv,
            role=BASE_ENV["CACHEMGR_ROLE"],
            strategy="command",
            compile_cmd=compile_cmd(files, size),
            compiler_version=BASE_ENV["CACHEMGR_COMPILER_VERSION"],
            npu_type=BASE_ENV["CACHEMGR_NPU_TYPE"],
            environ={},
        )
    )


def artifact_paths(files: int) -> list[str]:
    """Compiled-model-like layout: a few top-level files, the rest in submodule directories."""
    return [f"graph_{i:04d}.rbln" if i < 16 else f"sub{i % 20:02d}/graph_{i:04d}.rbln" for i in range(files)]


def build_entry(root_dir: Path, key: CacheKey, *, files: int, size: int) -> Path:
    """Write ``files`` files totalling ``size`` bytes (incompressible) and publish them as ``key``."""
    root = open_root(root_dir, create=True)
    identity = PodIdentity(pod="bench-builder", node="bench-node", host="bench", pid=os.getpid())
    staging = create_staging(root, key, identity)
    block = random.Random(7).randbytes(64 << 20)
    base, extra = divmod(size, files)
    for index, rel in enumerate(artifact_paths(files)):
        path = staging.artifacts / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        remaining = base + (1 if index < extra else 0)
        offset = (index * 7919 * 4096) % len(block)
        with path.open("wb") as out:
            while remaining > 0:
                chunk = block[offset : offset + min(remaining, len(block) - offset)]
                out.write(chunk)
                remaining -= len(chunk)
                offset = 0
    outcome = publish(root, staging, key, identity=identity, compile_seconds=600.0, strategy="command")
    return outcome.path


@contextlib.contextmanager
def volumes(kinds: list[str], work: Path) -> Iterator[list[tuple[str, Path, Path]]]:
    """(label, root where the entry is built, root pods read from) for each filesystem asked for."""
    with contextlib.ExitStack() as stack:
        found = []
        for kind in kinds:
            if kind == "local":
                root = work / "local"
                root.mkdir(parents=True)
                found.append(("local", root, root))
                continue
            reason = mount_unavailable_reason("juicefs")
            if reason is not None:
                print(f"skipping {kind}: {reason}", file=sys.stderr)
                continue
            # "juicefs": every lookup and getattr goes to the metadata engine (what a node that
            # never saw the entry gets); "juicefs-cached": JuiceFS' default 1 s kernel caches.
            cache = 1.0 if kind == "juicefs-cached" else 0.0
            mounts = stack.enter_context(juicefs_volume(work / kind, mounts=2, metadata_cache_s=cache))
            (mounts[0] / "cache").mkdir()
            # Built through one mount, read through the other: a pod on another node.
            label = "juicefs, 1 s metadata cache" if cache else "juicefs, no metadata cache"
            found.append((label, mounts[0] / "cache", mounts[1] / "cache"))
        yield found


@contextlib.contextmanager
def pod_filesystem(kind: str, work: Path) -> Iterator[tuple[Path, str]]:
    """Where each start's state directory (the pod's emptyDir, which holds its view) lives.

    "ext4" (root only): a fresh journaled ext4, as a node's kubelet disk is formatted, on a loop
    device backed by memory (an image in /dev/shm): a quick local disk, so the figure is
    cachemgr's and not this VM's disk. "here": the work directory's own filesystem, this VM's
    disk as it is. They differ a lot here: the VM's root is an ext4 without a journal, where
    allocating an inode scans the block group's free inodes for recently deleted ones
    (``find_inode_bit`` -> ``recently_deleted`` under ``perf``; with a journal the kernel skips
    that check), so the view's 2,000 symlinks cost 20 to 700 ms there depending on the
    directory's history; and an ext4 image on that disk stalls in its journal commits.
    """
    reason = None
    if kind == "ext4":
        reason = "not root" if os.geteuid() != 0 else None
        tools = ("mkfs.ext4", "mount", "umount")
        reason = reason or next((f"no {tool}" for tool in tools if shutil.which(tool) is None), None)
        reason = reason or (None if os.access("/dev/shm", os.W_OK) else "no writable /dev/shm")
    if kind == "ext4" and reason is None:
        backing = Path(tempfile.mkdtemp(prefix="bench-warm-pod-", dir="/dev/shm"))
        image, mountpoint = backing / "pod-ext4.img", work / "pod-ext4"
        mountpoint.mkdir()
        try:
            with image.open("wb") as out:
                out.truncate(2 << 30)  # sparse: only what the views use takes memory
            # 600,000 inodes: ~290 views of 2,000 links (a default run with --against makes ~150;
            # at 200,000 it ran out, exit 73). Inode tables (150 MiB) and journal written now:
            # lazy init would zero them in the background, under the measured starts.
            init = "lazy_itable_init=0,lazy_journal_init=0"
            subprocess.run(["mkfs.ext4", "-q", "-F", "-N", "600000", "-E", init, str(image)], check=True)
            done = subprocess.run(
                ["mount", "-o", "loop", str(image), str(mountpoint)],
                check=False,
                capture_output=True,
                text=True,
            )
            if done.returncode == 0:
                try:
                    yield mountpoint, "a journaled ext4 on a memory-backed loop device"
                finally:
                    subprocess.run(["umount", str(mountpoint)], check=False)
                return
            reason = f"mount -o loop failed: {done.stderr.strip()}"
        finally:
            shutil.rmtree(backing, ignore_errors=True)
    if reason is not None:
        print(f"pod dir on the work directory's filesystem: no ext4 one ({reason})", file=sys.stderr)
    pods = work / "pods"
    pods.mkdir()
    yield pods, "the work directory's filesystem"


@dataclass(frozen=True)
class Install:
    """How cachemgr is started: its console script, and a Python that imports it the same way."""

    script: str
    python: str
    label: str


def image_like(work: Path, *, source: Path = REPO, name: str = "image-venv") -> Install:
    """A throwaway venv that finds cachemgr as a regular install does: on sys.path, no import hook.

    A development venv often holds an editable install (``pip install -e``), whose import hook
    (``__editable__..._finder``, loaded by a .pth file) costs about 20 ms at every interpreter
    start; the image installs cachemgr normally (scripts/install). This venv gets a copy of the
    checkout's package compiled to bytecode, as pip installs it (a checkout run with
    PYTHONDONTWRITEBYTECODE=1, as this machine sets, compiles every module from source at every
    start: about 40 ms more), sees the dependencies of the bench's venv through a .pth file, and
    gets a console script like pip's.
    """
    target = work / name
    venv.EnvBuilder(with_pip=False, symlinks=True).create(target)
    python = target / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    deps = sysconfig.get_paths()["purelib"]
    shutil.copytree(
        source / "cachemgr", Path(purelib, "cachemgr"), ignore=shutil.ignore_patterns("__pycache__")
    )
    subprocess.run([str(python), "-m", "compileall", "-q", str(Path(purelib, "cachemgr"))], check=True)
    Path(purelib, "bench-deps.pth").write_text(f"{deps}\n")
    script = target / "bin" / "cachemgr"
    script.write_text(
        f"#!{python}\nimport sys\nfrom cachemgr.cli.main import main\nif __name__ == '__main__':\n"
        "    sys.argv[0] = sys.argv[0].removesuffix('.exe')\n    sys.exit(main())\n"
    )
    script.chmod(0o755)
    label = "image-like install" if source == REPO else f"image-like install of {source}"
    return Install(str(script), str(python), label)


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


# --- one start, either way ----------------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    spawned_ns: int  # time.time_ns() just before the spawn
    server_ns: int  # what the server wrote as its first act (date +%s%N)
    log: str
    cpu_ms: float  # CPU time of the started process's main thread when the server had started

    @property
    def spawn_to_server_ms(self) -> float:
        return (self.server_ns - self.spawned_ns) / 1e6


def _read_start(path: Path, proc: subprocess.Popen[bytes], deadline: float) -> int:
    while True:
        with contextlib.suppress(FileNotFoundError, ValueError):
            text = path.read_text()
            if text.endswith("\n"):
                return int(text)
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode} before the server started")
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start within 60s")
        time.sleep(0.002)


def start_once(argv: list[str], env: dict[str, str], work: Path) -> Start:
    """Spawn ``argv``; the time until the server wrote its start time; then stop it."""
    work.mkdir(parents=True)
    stamp = work / "server-start"
    log = work / "stderr.log"
    env = {**env, "BENCH_START_FILE": str(stamp), "CACHEMGR_STATE_DIR": str(work / "state"),
           "CACHEMGR_TERMINATION_LOG": str(work / "termination-log")}  # fmt: skip
    with log.open("wb") as err:
        spawned = time.time_ns()
        # cwd: the run's own directory, not the checkout, which `python -c` would put first on
        # sys.path (the traced runs would then import the checkout, not the installed copy).
        proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, cwd=work
        )
    cpu = float("nan")
    try:
        server = _read_start(stamp, proc, time.monotonic() + 60)
        cpu = main_thread_cpu_ms(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)  # cachemgr forwards it to the server
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return Start(spawned, server, log.read_text(errors="replace"), cpu)


def main_thread_cpu_ms(pid: int) -> float:
    """CPU time of a process's main thread so far (``/proc/PID/schedstat``: ns on a CPU).

    cachemgr's hit path runs on its main thread, so this is its cost with the machine's load
    taken out (mostly: a busy machine still slows caches); the read-ahead thread started at the
    launch is not counted. Sampled when the server's start is seen (within the 2 ms poll).
    """
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e6
    except (OSError, ValueError, IndexError):
        return float("nan")


def cachemgr_argv(key: CacheKey, files: int, size: int, *, head: list[str]) -> list[str]:
    return [
        *head, "run", "--strategy", "command", "--compile-cmd", compile_cmd(files, size),
        "--verify", "fast", "--", *SERVER_ARGV,
    ]  # fmt: skip


def check_hit(start: Start, key: CacheKey) -> None:
    events = [json.loads(line).get("event") for line in start.log.splitlines() if line.startswith("{")]
    if "launching" not in events or "published" in events or "space_preflight" in events:
        raise RuntimeError(f"expected a hit on {key.short}, the log says otherwise:\n{start.log[-2000:]}")


# --- where the time goes ------------------------------------------------------------------------

# Runs as `python -c TRACE cachemgr run ...`: the real CLI, with the library functions the runner
# calls wrapped to time them. Modules are imported where the CLI imports them (cachemgr.runtime.runner when
# `run` starts), so the import order and cost are the real ones. Spans go to $BENCH_TRACE_FILE
# once the server has been spawned; a marker on stderr then splits -X importtime's report.
TRACE = r"""
import os, sys, time
T = {"python": time.time_ns()}
import cachemgr.cli.main as main
T["cli imported"] = time.time_ns()
spans = {}

def record(label, began):
    spans.setdefault(label, [began, 0, 0])
    spans[label][1] = time.time_ns()
    spans[label][2] += spans[label][1] - began

def wrap(owner, name, label):
    original = getattr(owner, name)
    def timed(*args, **kwargs):
        began = time.time_ns()
        try:
            return original(*args, **kwargs)
        finally:
            record(label, began)
            if label == "spawn server":
                sys.stderr.write("BENCH-LAUNCHED\n")
                sys.stderr.flush()
                import json
                with open(os.environ["BENCH_TRACE_FILE"], "w") as out:
                    json.dump({"marks": T, "spans": spans, "cpu_ns": time.thread_time_ns()}, out)
    setattr(owner, name, timed)

find_handler = main._handler
def handler(command, *rest):
    T["args parsed"] = time.time_ns()
    began = time.time_ns()
    run = find_handler(command, *rest)
    record("import cachemgr.cli.cmd_run", began)
    def traced_run(args, server_argv, environ):
        began = time.time_ns()
        import cachemgr.runtime.runner as r, cachemgr.runtime.launch as l, cachemgr.runtime.launcher, cachemgr.runtime.heartbeats as h  # what cmd_run.run imports first
        record("import cachemgr.runtime.runner", began)
        wrap(r.Runner, "__init__", "runner setup (state, heartbeats)")
        wrap(r, "compute_key", "key")
        wrap(r, "open_root", "open root")
        wrap(r, "lookup", "lookup + fast check")
        wrap(h, "register_use", "use record")
        wrap(l, "build_view", "view")  # the launch step builds it (cachemgr.runtime.launch)
        wrap(cachemgr.runtime.launcher, "start", "spawn server")
        return run(args, server_argv, environ)
    return traced_run
main._handler = handler
sys.argv = ["cachemgr", *sys.argv[1:]]
sys.exit(main.main())
"""

STEPS = (
    "import cachemgr.cli.cmd_run",
    "import cachemgr.runtime.runner",
    "runner setup (state, heartbeats)",
    "key",
    "open root",
    "lookup + fast check",
    "use record",
    "view",
    "spawn server",
)


def trace_once(
    key: CacheKey, files: int, size: int, env: dict[str, str], work: Path, *, install: Install
) -> dict[str, float]:
    """One traced hit: milliseconds per step, from the spawn to the server's first line."""
    trace = work / "trace.json"
    argv = cachemgr_argv(key, files, size, head=[install.python, "-c", TRACE])
    start = start_once(argv, {**env, "BENCH_TRACE_FILE": str(trace)}, work)
    check_hit(start, key)
    data = json.loads(trace.read_text())
    marks, spans = data["marks"], data["spans"]
    total = start.spawn_to_server_ms
    steps = {
        "interpreter start": (marks["python"] - start.spawned_ns) / 1e6,
        "import cachemgr.cli.main": (marks["cli imported"] - marks["python"]) / 1e6,
        "parse args, logging setup": (marks["args parsed"] - marks["cli imported"]) / 1e6,
    }
    for label in STEPS:
        steps[label] = spans.get(label, [0, 0, 0])[2] / 1e6
    steps["server exec to its first line"] = (start.server_ns - spans["spawn server"][1]) / 1e6
    steps["other (between the steps)"] = total - sum(steps.values())
    steps["total"] = total
    # The main thread's CPU time from the interpreter's start to the launch: the hit path's own
    # cost, which a loaded machine inflates far less than the wall-clock steps above.
    steps["CPU time of the main thread, to the launch"] = data["cpu_ns"] / 1e6
    return steps


def import_breakdown(
    key: CacheKey, files: int, size: int, env: dict[str, str], work: Path, *, install: Install
) -> list[tuple[str, float]]:
    """``-X importtime`` of a real hit, up to the server's launch: the import tree, pruned.

    Top-level imports of 2 ms or more, and under them what costs 2 ms or more, three levels
    deep; names are indented by depth. -X importtime reports a module after its children.
    """
    trace = work / "trace.json"
    argv = cachemgr_argv(key, files, size, head=[install.python, "-X", "importtime", "-c", TRACE])
    start = start_once(argv, {**env, "BENCH_TRACE_FILE": str(trace)}, work)
    pending: dict[int, list[tuple[str, float, list[Any]]]] = {}
    for line in start.log.splitlines():
        if line == "BENCH-LAUNCHED":
            break
        match = _IMPORT_LINE.match(line)
        if match is None:
            continue
        name = match.group(2)
        depth = (len(name) - len(name.lstrip(" "))) // 2
        children = pending.pop(depth + 1, [])
        pending.setdefault(depth, []).append((name.strip(), int(match.group(1)) / 1000, children))
    top = pending.get(0, [])
    rows: list[tuple[str, float]] = [("all imports before the launch", sum(ms for _, ms, _ in top))]

    def walk(nodes: list[tuple[str, float, list[Any]]], depth: int) -> None:
        for name, ms, children in sorted(nodes, key=lambda node: -node[1]):
            if ms >= 2.0 and depth <= 3:
                rows.append(("&nbsp;&nbsp;" * depth + name, ms))
                walk(children, depth + 1)

    walk(top, 0)
    return rows


# --- the fast check, other ways --------------------------------------------------------------------


def fast_check_alternatives(entry: Path, *, runs: int, cold: bool) -> list[tuple[str, float]]:
    """The fast check's file sizes, three ways, in this process (median ms; caches dropped if ``cold``).

    On a FUSE volume each lstat is a round trip to the filesystem daemon; a directory listing
    (READDIRPLUS) brings the sizes of a whole directory at once, and threads overlap round trips.
    """
    manifest = read_manifest(entry)
    base = os.fspath(entry)
    paths = [os.path.join(base, record.path) for record in manifest.files]
    expected = {record.path: record.size for record in manifest.files}

    def current() -> None:
        if check_files(entry, manifest, mode="fast"):
            raise RuntimeError("the entry does not pass the fast check")

    def scandir() -> None:
        sizes: dict[str, int] = {}
        stack = [""]
        while stack:
            rel = stack.pop()
            with os.scandir(os.path.join(base, rel)) as found:
                for item in found:
                    name = f"{rel}/{item.name}" if rel else item.name
                    if item.is_dir(follow_symlinks=False):
                        stack.append(name)
                    else:
                        sizes[name] = item.stat(follow_symlinks=False).st_size
        if any(sizes.get(path) != size for path, size in expected.items()):
            raise RuntimeError("the entry does not pass the fast check")

    def threaded() -> None:
        with ThreadPoolExecutor(16) as pool:
            sizes = [st.st_size for st in pool.map(os.lstat, paths)]
        if sizes != list(expected.values()):
            raise RuntimeError("the entry does not pass the fast check")

    ways = {
        "lstat per file (now)": current,
        "scandir + DirEntry.stat": scandir,
        "lstat, 16 threads": threaded,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(runs):
        order = list(ways.items())
        for name, action in order[i % 3 :] + order[: i % 3]:
            if cold:
                drop_caches()
            began = time.perf_counter()
            action()
            times[name].append((time.perf_counter() - began) * 1000)
    return [(name, statistics.median(values)) for name, values in times.items()]


# --- the bench --------------------------------------------------------------------------------


@dataclass
class Result:
    label: str
    cold: bool
    direct: list[float]
    managed: list[float]
    against: list[float] = field(default_factory=list)  # --against: the other checkout's starts
    managed_cpu: list[float] = field(default_factory=list)  # main-thread CPU ms of each start
    against_cpu: list[float] = field(default_factory=list)

    @property
    def added(self) -> list[float]:
        return [m - d for m, d in zip(self.managed, self.direct, strict=True)]


def measure(
    label: str,
    key: CacheKey,
    entry: Path,
    read_root: Path,
    *,
    args: argparse.Namespace,
    work: Path,
    cold: bool,
    size: int,
) -> Result:
    env = {**os.environ, **BASE_ENV, "CACHEMGR_CACHE_ROOT": str(read_root)}
    direct_argv = [
        arg.replace("{artifact_dir}", str(read_root / "entries" / entry.name / "artifacts"))
        for arg in SERVER_ARGV
    ]
    managed_argv = cachemgr_argv(key, args.files, size, head=[args.install.script])
    result = Result(label, cold, [], [])
    check_hit(start_once(managed_argv, env, work / "warmup"), key)  # bytecode, page cache, a sanity check
    order = [("direct", direct_argv), ("managed", managed_argv)]
    if args.against_install is not None:
        against_argv = cachemgr_argv(key, args.files, size, head=[args.against_install.script])
        check_hit(start_once(against_argv, env, work / "warmup-against"), key)
        order.append(("against", against_argv))
    for i in range(args.runs if label == "local" else args.juicefs_runs):
        turn = order[i % len(order) :] + order[: i % len(order)]  # each run starts with another
        for which, argv in turn:
            if cold:
                drop_caches()
            start = start_once(argv, env, work / f"{'cold' if cold else 'warm'}-{i}-{which}")
            if which == "managed":
                check_hit(start, key)
                result.managed.append(start.spawn_to_server_ms)
                result.managed_cpu.append(start.cpu_ms)
            elif which == "against":
                check_hit(start, key)
                result.against.append(start.spawn_to_server_ms)
                result.against_cpu.append(start.cpu_ms)
            else:
                result.direct.append(start.spawn_to_server_ms)
    return result


def print_results(results: list[Result], args: argparse.Namespace) -> None:
    print(
        f"\n### Warm start on a hit: {args.files} files ({human(args.size)} local, "
        f"{human(args.juicefs_size)} on JuiceFS), --verify fast, "
        f"{args.runs} paired runs ({args.juicefs_runs} on JuiceFS), {args.install.label}, "
        f"pod state dir on {args.pod_label}\n"
    )
    print("| volume | caches | server directly (median / p95) | cachemgr run (median / p95) "
          "| added (median / p95) | target |")  # fmt: skip
    print("|---|---|---:|---:|---:|---|")
    for r in results:
        added = r.added
        med, p95 = statistics.median(added), pct(added, 0.95)
        target = TARGET_MS.get(r.label, JUICEFS_TARGET_MS)
        verdict = f"< {target:.0f} ms: " + ("met" if med < target else f"missed by {med - target:.0f} ms")
        print(
            f"| {r.label} | {'dropped' if r.cold else 'warm'} "
            f"| {statistics.median(r.direct):.1f} / {pct(r.direct, 0.95):.1f} ms "
            f"| {statistics.median(r.managed):.1f} / {pct(r.managed, 0.95):.1f} ms "
            f"| **{med:.1f}** / {p95:.1f} ms | {verdict} |"
        )
    if any(r.against for r in results):
        print(f"\n### This checkout against {args.against} (paired: this minus that, same run)\n")
        print(
            "| volume | caches | that checkout (median) | this one (median) | difference (median / p95) "
            "| added: that / this (median) | ratio |"
        )
        print("|---|---|---:|---:|---:|---:|---:|")
        for r in results:
            diff = [m - a for m, a in zip(r.managed, r.against, strict=True)]
            that = statistics.median(a - d for a, d in zip(r.against, r.direct, strict=True))
            this = statistics.median(r.added)
            print(
                f"| {r.label} | {'dropped' if r.cold else 'warm'} | {statistics.median(r.against):.1f} ms "
                f"| {statistics.median(r.managed):.1f} ms | **{statistics.median(diff):+.1f}** / "
                f"{pct(diff, 0.95):+.1f} ms | {that:.1f} / {this:.1f} ms | {this / that:.2f} |"
            )
        print(
            "\nCPU time of cachemgr's main thread from its start to the server's (the hit path without "
            "the machine's load; paired):\n"
        )
        print(
            "| volume | caches | that checkout (median) | this one (median) | difference (median / p95) | ratio |"
        )
        print("|---|---|---:|---:|---:|---:|")
        for r in results:
            cpu = [m - a for m, a in zip(r.managed_cpu, r.against_cpu, strict=True)]
            that, this = statistics.median(r.against_cpu), statistics.median(r.managed_cpu)
            print(
                f"| {r.label} | {'dropped' if r.cold else 'warm'} | {that:.1f} ms | {this:.1f} ms "
                f"| **{statistics.median(cpu):+.1f}** / {pct(cpu, 0.95):+.1f} ms | {this / that:.2f} |"
            )


def print_breakdown(
    label: str,
    traces: list[dict[str, float]],
    imports: list[tuple[str, float]],
    against: list[dict[str, float]],
    against_label: str,
) -> None:
    print(f"\n### Where the time goes ({label}, warm caches, median of {len(traces)} traced runs)\n")
    total = statistics.median(t["total"] for t in traces)
    if against:
        print(
            f"Traced in turn with {against_label}; the last column is the median of the paired differences.\n"
        )
        print("| step | ms | share | that checkout, ms | this minus that, ms |")
        print("|---|---:|---:|---:|---:|")
    else:
        print("| step | ms | share |")
        print("|---|---:|---:|")
    for name in traces[0]:
        value = statistics.median(t[name] for t in traces)
        share = f"{100 * value / total:.0f}%" if name != "total" else "100%"
        row = f"| {name} | {value:.1f} | {share} |"
        if against:
            that = statistics.median(t.get(name, 0.0) for t in against)
            diff = statistics.median(t[name] - a.get(name, 0.0) for t, a in zip(traces, against, strict=True))
            row += f" {that:.1f} | {diff:+.1f} |"
        print(row)
    print(
        "\nImports before the server is launched (`-X importtime`, one run, itself slower; "
        "cumulative ms; nested: what a module's import pulled in, of 2 ms or more):\n"
    )
    print("| module | ms |")
    print("|---|---:|")
    for name, ms in imports:
        print(f"| {name} | {ms:.1f} |")


@dataclass
class Findings:
    results: list[Result]
    breakdowns: list[tuple[str, list[dict[str, float]], list[tuple[str, float]], list[dict[str, float]]]]
    alternatives: list[tuple[str, list[tuple[str, float]]]]


def bench_volume(
    label: str, build_root: Path, read_root: Path, *, args: argparse.Namespace, pods: Path, found: Findings
) -> None:
    """Everything for one volume: publish the entry, paired runs (warm, dropped), traces, alternatives."""
    size = args.size if label == "local" else args.juicefs_size
    key = bench_key(args.files, size)
    started = time.monotonic()
    entry = build_entry(build_root, key, files=args.files, size=size)
    print(f"{label}: published {entry.name} in {time.monotonic() - started:.1f}s", file=sys.stderr)
    # The entry's pages on their way to the disk would slow every start measured next (and the
    # pod directory's own writes): a pod on a hit meets an entry published long before.
    os.sync()
    env = {**os.environ, **BASE_ENV, "CACHEMGR_CACHE_ROOT": str(read_root)}
    for cold in (False, True) if args.cold else (False,):
        where = pods / f"{label}-{'cold' if cold else 'warm'}"
        found.results.append(
            measure(label, key, entry, read_root, args=args, work=where, cold=cold, size=size)
        )
    traces, against = [], []
    for i in range(args.traces):  # with --against, in turn: each checkout first every other time
        installs = [("this", args.install)]
        if args.against_install is not None:
            installs.append(("that", args.against_install))
        for which, install in installs if i % 2 == 0 else installs[::-1]:
            steps = trace_once(
                key, args.files, size, env, pods / f"{label}-trace-{i}-{which}", install=install
            )
            (traces if which == "this" else against).append(steps)
    imports = import_breakdown(key, args.files, size, env, pods / f"{label}-imports", install=args.install)
    found.breakdowns.append((label, traces, imports, against))
    read_entry = read_root / "entries" / entry.name
    found.alternatives.append((label, fast_check_alternatives(read_entry, runs=5, cold=args.cold)))


def print_alternatives(
    alternatives: list[tuple[str, list[tuple[str, float]]]], args: argparse.Namespace
) -> None:
    print(
        f"\n### The fast check of {args.files} files, other ways (in-process, median of 5, "
        f"{'caches dropped before each' if args.cold else 'warm caches'})\n"
    )
    names = [name for name, _ in alternatives[0][1]] if alternatives else []
    print("| volume | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for label, values in alternatives:
        print(f"| {label} | " + " | ".join(f"{ms:.1f} ms" for _, ms in values) + " |")


def main() -> int:
    unmount_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--size", type=parse_size, default=parse_size("4G"), help="entry size (default 4G)")
    parser.add_argument(
        "--juicefs-size",
        type=parse_size,
        default=parse_size("1G"),
        help="entry size on JuiceFS (default 1G): a hit's cost follows the file count, not the bytes, "
        "and JuiceFS writes and reads here run at ~100 MiB/s",
    )
    parser.add_argument("--runs", type=int, default=15, help="paired runs per local row (default 15)")
    parser.add_argument("--juicefs-runs", type=int, default=7, help="paired runs per JuiceFS row (default 7)")
    parser.add_argument("--traces", type=int, default=7, help="traced runs for the breakdown (default 7)")
    parser.add_argument(
        "--fs", default="local,juicefs,juicefs-cached", help="comma-separated: local, juicefs, juicefs-cached"
    )
    parser.add_argument(
        "--install",
        choices=["image", "venv"],
        default="image",
        help="image: cachemgr found on sys.path as the image installs it (default); venv: this venv's "
        "console script (with an editable install's import hook, if it has one)",
    )
    parser.add_argument("--no-cold", action="store_true", help="skip the rows with dropped caches")
    parser.add_argument(
        "--against",
        type=Path,
        default=None,
        metavar="CHECKOUT",
        help="also start another checkout's cachemgr (e.g. git worktree add /tmp/main main) in the same "
        "paired runs, and print this minus that",
    )
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir)")
    parser.add_argument(
        "--pod-fs",
        choices=["ext4", "here"],
        default="ext4",
        help="where each start's state directory (its emptyDir, with the view) lives: ext4, a fresh "
        "journaled ext4 as on a node (root; default), or here, the work directory's filesystem",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 200 files, 64 MiB, 5 runs, warm only"
    )
    args = parser.parse_args()
    if args.quick:
        args.files, args.size, args.juicefs_size = 200, 64 << 20, 64 << 20
        args.runs, args.juicefs_runs, args.traces, args.no_cold = 5, 3, 3, True
    if not CONSOLE_SCRIPT.exists():
        raise SystemExit(f"no {CONSOLE_SCRIPT}: install cachemgr into this venv (scripts/install)")
    work = Path(tempfile.mkdtemp(prefix="bench-warm-", dir=args.dir))
    args.cold = not args.no_cold and drop_caches()
    if not args.no_cold and not args.cold:
        print("cannot drop caches here (not root?): warm-cache rows only", file=sys.stderr)
    found = Findings([], [], [])
    try:
        args.install = (
            image_like(work)
            if args.install == "image"
            else Install(str(CONSOLE_SCRIPT), sys.executable, "venv")
        )
        args.against_install = (
            image_like(work, source=args.against, name="against-venv") if args.against else None
        )
        with (
            pod_filesystem(args.pod_fs, work) as (pods, args.pod_label),
            volumes(args.fs.split(","), work) as roots,
        ):
            for label, build_root, read_root in roots:
                bench_volume(label, build_root, read_root, args=args, pods=pods, found=found)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_results(found.results, args)
    for label, traces, imports, against in found.breakdowns:
        print_breakdown(label, traces, imports, against, str(args.against))
    print_alternatives(found.alternatives, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
