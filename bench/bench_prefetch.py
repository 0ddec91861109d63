"""The whole warm start: pod start to "the server has read every artifact byte" (issue 25).

bench_warm.py stops when the server process starts; a real server then initialises (tens of
seconds for vLLM) and only afterwards reads the compiled model from the volume. Here the server
is a stand-in loader (written below, not vLLM): it notes its start, initialises for ``--init``
seconds, then reads ``rbln_config.json`` and every file it lists, whole and in order, as a runtime
loading compiled graphs does, and notes when it is done. Each run drops the page cache first
(and, on JuiceFS, the mount's block cache: ``juicefs warmup --evict``), rows alternate within
each round, and the figures are medians of the rounds. Rows:

* ``no prefetch``: ``cachemgr run --prefetch off``;
* ``cachemgr prefetch``: ``cachemgr run`` (``--prefetch auto``, the default);
* ``juicefs warmup at launch`` (JuiceFS only, the anchor): ``--prefetch off`` and ``juicefs warmup``
  (50 workers) of the entry started when the server starts;
* ``tuned parallel read at launch``: ``--prefetch off`` and this script's own reader (``--threads``
  threads, 4 MiB reads) started when the server starts;
* and apart, ``entry alone``: that tuned read with no server: the volume's limit.

Volumes: the local disk (this VM's), and JuiceFS with its default caches (1 s metadata caches, a
100 GiB block cache, its read-ahead) over SeaweedFS S3 (``weed mini``) behind tests/s3fault.py,
which adds ``--latency-ms`` to every request and caps bandwidth per connection and in total. The
entry is written through one JuiceFS mount and served through the other (two nodes).

``--memory``: the local rows again with the pod (cachemgr and its server) in a memory cgroup
whose limit is below the entry's size; the pod's usage is sampled every 20 ms, and its peak
while the read-ahead runs (before the server's own read) is compared with the budget's ceiling.

Run by hand, as root (dropping caches, mounts, cgroups)::

    .venv/bin/python bench/bench_prefetch.py                        # local + juicefs + memory
    .venv/bin/python bench/bench_prefetch.py --quick                # a smoke run, a minute or two
    .venv/bin/python bench/bench_prefetch.py --fs juicefs --juicefs-size 1G --latency-ms 20
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
LOADER = textwrap.dedent(
    """
    # STAND-IN for a runtime loading compiled graphs (not vLLM): start, initialise, read all.
    import json, os, sys, time
    artifacts, out, init = sys.argv[1], sys.argv[2], float(sys.argv[3])
    started = time.time()
    open(out + ".started", "w").close()  # for the anchors started at launch
    time.sleep(init)  # the server's import and engine set-up
    read_start = time.time()
    buf = bytearray(1 << 20)
    total = 0
    config = os.path.join(artifacts, "rbln_config.json")
    with open(config, "rb") as f:
        listed = json.load(f)["files"]
    for item in listed:
        with open(os.path.join(artifacts, item["path"]), "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    with open(out, "w") as f:
        json.dump({"started": started, "read_start": read_start, "loaded": time.time(), "bytes": total}, f)
    """
)
TUNED_READER = textwrap.dedent(
    """
    # Every file of a directory with N threads, each a 4 MiB range at a time.
    import os, sys, time
    from concurrent.futures import ThreadPoolExecutor
    top, threads = sys.argv[1], int(sys.argv[2])
    jobs = []
    for folder, _, names in os.walk(top):
        for name in names:
            path = os.path.join(folder, name)
            size = os.path.getsize(path)
            jobs += [(path, start) for start in range(0, max(size, 1), 4 << 20)]
    def read(job):
        path, start = job
        with open(path, "rb", buffering=0) as f:
            return len(os.pread(f.fileno(), 4 << 20, start))
    started = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, jobs))
    print(total, time.monotonic() - started)
    """
)


@dataclass
class Volume:
    """Where the entry is: the root a pod uses, and how to drop its caches."""

    name: str
    root: Path
    evict: list[str] | None = None  # a command that drops the filesystem's own block cache
    warmup: list[str] | None = None  # juicefs warmup of the entry (the anchor), if there is one


@dataclass
class Run:
    row: str
    launch_ms: float  # the server's first act (a `date`)
    start_ms: float  # its interpreter up (the loader's first line)
    server_read_s: float
    loaded_s: float
    prefetch: dict[str, Any] = field(default_factory=dict)
    peak_before_read: int | None = None


def sh(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kw)


def drop_caches(volume: Volume, artifacts: Path) -> None:
    os.sync()
    if volume.evict is not None:
        sh([*volume.evict, str(artifacts)])
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def env_for(work: Path, root: Path) -> dict[str, str]:
    return {
        **os.environ,
        "CACHEMGR_CACHE_ROOT": str(root),
        "CACHEMGR_ROLE": "prefill",
        "CACHEMGR_COMPILER_VERSION": "0.12.0",
        "CACHEMGR_NPU_TYPE": "RBLN-CA25",
        "CACHEMGR_LOG_FORMAT": "json",
        "CACHEMGR_STATE_DIR": str(work / "state"),
        "BENCH_LAUNCH_FILE": str(work / "launched"),  # not in the key: only argv and VLLM_RBLN_* are
    }


def pod_argv(work: Path, args: argparse.Namespace, out: Path) -> list[str]:
    compile_cmd = (
        f"{sys.executable} -m cachemgr_standin.compiler --output-dir {{output_dir}} --files {args.files} "
        f"--bytes {args.size_now} --seconds 0 --model bench-model"
    )
    loader = work / "loader.py"
    loader.write_text(LOADER)
    # The server's first act is a `date`, as in bench_warm.py (its launch); then its interpreter.
    return ["--strategy", "command", "--compile-cmd", compile_cmd, "--",
            "sh", "-c", 'date +%s%N > "$BENCH_LAUNCH_FILE"; exec "$0" "$@"',
            sys.executable, str(loader), "{artifact_dir}", str(out), str(args.init)]  # fmt: skip


def publish_entry(work: Path, root: Path, args: argparse.Namespace) -> Path:
    out = work / "loaded.json"  # as in every run: the server's argv is part of the key
    done = subprocess.run(
        [sys.executable, "-m", "cachemgr", "warm", *pod_argv(work, args, out)],
        env=env_for(work, root), capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"cachemgr warm failed ({done.returncode}):\n{done.stderr[-3000:]}")
    (entry,) = (root / "entries").iterdir()
    return entry / "artifacts"


def one_run(
    work: Path,
    volume: Volume,
    artifacts: Path,
    args: argparse.Namespace,
    row: str,
    *,
    cgroup: Path | None = None,
) -> Run:
    drop_caches(volume, artifacts)
    out = work / "loaded.json"  # one path for every row: the server's argv is part of the key
    out.unlink(missing_ok=True)
    Path(f"{out}.started").unlink(missing_ok=True)
    state = work / "state"
    shutil.rmtree(state, ignore_errors=True)
    options = [] if row == "cachemgr prefetch" else ["--prefetch", "off"]
    argv = [sys.executable, "-m", "cachemgr", "run", *options, *pod_argv(work, args, out)]
    if cgroup is not None:
        argv = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup), *argv]
        (cgroup / "memory.max_usage_in_bytes").write_text("0\n")
    log = work / "pod.log"
    sampler = _Sampler(cgroup) if cgroup is not None else None
    spawned = time.time()
    with log.open("w") as sink:
        pod = subprocess.Popen(argv, env=env_for(work, volume.root), stdout=sink, stderr=sink)
    helper = None
    if row == "juicefs warmup at launch" and volume.warmup is not None:
        helper = _when_started(out, [*volume.warmup, str(artifacts)])
    elif row == "tuned parallel read at launch":
        helper = _when_started(out, [sys.executable, "-c", TUNED_READER, str(artifacts), str(args.threads)])
    code = pod.wait(timeout=600)
    if helper is not None:
        helper.join(timeout=600)
    if sampler is not None:
        sampler.stop()
    if code != 0:
        raise SystemExit(f"{row}: cachemgr run exited {code}:\n{log.read_text()[-3000:]}")
    got = json.loads(out.read_text())
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    if any(e.get("event") == "published" for e in events):
        raise SystemExit(f"{row}: the pod compiled instead of hitting the entry:\n{log.read_text()[-2000:]}")
    prefetch = next((e for e in events if e.get("event") == "prefetch_done"), {})
    launched = int((work / "launched").read_text()) / 1e9
    return Run(
        row=row,
        launch_ms=(launched - spawned) * 1000,
        start_ms=(got["started"] - spawned) * 1000,
        server_read_s=got["loaded"] - got["read_start"],
        loaded_s=got["loaded"] - spawned,
        prefetch=prefetch,
        peak_before_read=sampler.peak_before(got["read_start"]) if sampler is not None else None,
    )


class _when_started(threading.Thread):  # noqa: N801  # reads as what it does
    """Start ``argv`` the moment the loader has started (cachemgr's launch): an anchor at launch."""

    def __init__(self, out: Path, argv: list[str]) -> None:
        super().__init__(daemon=True)
        self.out, self.argv = out, argv
        self.start()

    def run(self) -> None:
        started = Path(f"{self.out}.started")  # the loader's first act
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not started.exists():
            time.sleep(0.002)
        subprocess.run(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


class _Sampler:
    """The pod cgroup's memory usage every 20 ms, with the time of each sample."""

    def __init__(self, cgroup: Path) -> None:
        self.file = cgroup / "memory.usage_in_bytes"
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                self.samples.append((time.time(), int(self.file.read_text())))
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peak_before(self, moment: float) -> int:
        return max((usage for when, usage in self.samples if when < moment), default=0)


def entry_alone(volume: Volume, artifacts: Path, threads: int) -> tuple[float, float]:
    drop_caches(volume, artifacts)
    done = sh([sys.executable, "-c", TUNED_READER, str(artifacts), str(threads)])
    total, seconds = done.stdout.split()
    return float(seconds), int(total) / float(seconds)


def rounds(
    work: Path, volume: Volume, artifacts: Path, args: argparse.Namespace, rows: list[str], **kw: Any
) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {row: [] for row in rows}
    one_run(work, volume, artifacts, args, rows[0], **kw)  # not counted: the first start after a publish
    for n in range(args.runs):
        for row in rows[n % len(rows) :] + rows[: n % len(rows)]:  # each round starts elsewhere
            result = one_run(work, volume, artifacts, args, row, **kw)
            runs[row].append(result)
            print(
                f"  {volume.name} round {n + 1}: {row}: loaded {result.loaded_s:.2f} s",
                file=sys.stderr,
                flush=True,
            )
    return runs


def med(values: list[float]) -> float:
    return statistics.median(values)


def print_table(
    title: str, runs: dict[str, list[Run]], alone: tuple[float, float], *, load: tuple[float, float]
) -> dict[str, float]:
    base = runs["no prefetch"]
    print(f"\n### {title}\n")
    print(f"load average {load[0]:.1f} at the start, {load[1]:.1f} at the end (2 cores, shared)\n")
    print("| row | launch (ms) | server's interpreter up (ms) | server's own read (s) | pod start to loaded (s) "
          "| vs no prefetch | read ahead |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---|")
    loaded: dict[str, float] = {}
    for row, items in runs.items():
        loaded[row] = med([r.loaded_s for r in items])
        ratio = med([b.loaded_s for b in base]) / loaded[row]
        pf = items[0].prefetch
        note = (f"{pf.get('bytes', 0) / MiB:.0f} MiB in {pf.get('seconds', 0):.2f} s, {pf.get('mechanism')}, "
                f"{pf.get('stopped')}") if pf else ""  # fmt: skip
        print(f"| {row} | {med([r.launch_ms for r in items]):.1f} | {med([r.start_ms for r in items]):.1f} | "
              f"{med([r.server_read_s for r in items]):.2f} | {loaded[row]:.2f} | {ratio:.2f}x | {note} |")  # fmt: skip
    print(f"| entry alone, tuned parallel read | | | {alone[0]:.2f} ({alone[1] / MiB:.0f} MiB/s) | | | "
          "the volume's limit |")  # fmt: skip
    return loaded


def verdict_local(runs: dict[str, list[Run]]) -> None:
    off, on = runs["no prefetch"], runs["cachemgr prefetch"]
    read_ratio = med([r.server_read_s for r in off]) / med([r.server_read_s for r in on])
    launch = med([b.launch_ms - a.launch_ms for a, b in zip(off, on, strict=True)])
    start = med([b.start_ms - a.start_ms for a, b in zip(off, on, strict=True)])
    slower = med([b.loaded_s - a.loaded_s for a, b in zip(off, on, strict=True)])
    print(f"\n- server's own read {read_ratio:.1f}x faster with prefetch (target >= 2x): "
          f"{'met' if read_ratio >= 2 else 'missed'}")  # fmt: skip
    print(f"- launch with prefetch minus without, median of pairs: {launch:+.1f} ms (target within 5 ms): "
          f"{'met' if launch <= 5 else 'missed'}")  # fmt: skip
    print(f"- the server's interpreter up, with prefetch minus without: {start:+.1f} ms (its own start from "
          "the same disk, caches dropped, beside the read-ahead)")  # fmt: skip
    print(f"- pod start to loaded with prefetch minus without: {slower:+.2f} s (target: never slower): "
          f"{'met' if slower <= 0 else 'missed'}")  # fmt: skip


def verdict_juicefs(loaded: dict[str, float]) -> None:
    ratio = loaded["no prefetch"] / loaded["cachemgr prefetch"]
    anchors = [
        loaded[r] for r in ("juicefs warmup at launch", "tuned parallel read at launch") if r in loaded
    ]
    best = min(anchors)
    print(
        f"\n- pod start to loaded {ratio:.1f}x faster with prefetch (target >= 3x): {'met' if ratio >= 3 else 'missed'}"
    )
    within = loaded["cachemgr prefetch"] / best
    print(
        f"- prefetch / best anchor = {within:.2f} (target <= 1.25): {'met' if within <= 1.25 else 'missed'}"
    )


def local(args: argparse.Namespace, work: Path) -> None:
    root = work / "local-volume"
    root.mkdir()
    args.size_now = args.size
    artifacts = publish_entry(work, root, args)
    os.sync()
    volume = Volume("local", root)
    load0 = os.getloadavg()[0]
    rows = ["no prefetch", "cachemgr prefetch", "tuned parallel read at launch"]
    runs = rounds(work, volume, artifacts, args, rows)
    alone = entry_alone(volume, artifacts, args.threads)
    title = (f"Whole warm start, local disk: {args.files} files, {args.size}, server init {args.init:g} s, "
             f"page cache dropped, {args.runs} rounds")  # fmt: skip
    print_table(title, runs, alone, load=(load0, os.getloadavg()[0]))
    verdict_local(runs)
    if args.memory:
        memory(args, work, volume, artifacts)


def memory(args: argparse.Namespace, work: Path, volume: Volume, artifacts: Path) -> None:
    total = sum(p.stat().st_size for p in artifacts.rglob("*") if p.is_file())
    limit = total // 2
    base = Path("/sys/fs/cgroup/memory")
    own = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                if "memory" in line.split(":")[1].split(",")), None)  # fmt: skip
    if own is None or not base.is_dir():
        print("\n(memory rows skipped: no cgroup v1 memory controller here; cgroup v2 needs its own set-up)")
        return
    cgroup = base / own.lstrip("/") / f"bench-prefetch-{os.getpid()}"
    cgroup.mkdir()
    try:
        (cgroup / "memory.limit_in_bytes").write_text(str(limit))
        load0 = os.getloadavg()[0]
        runs = rounds(work, volume, artifacts, args, ["no prefetch", "cachemgr prefetch"], cgroup=cgroup)
    finally:
        with contextlib.suppress(OSError):
            cgroup.rmdir()
    print(
        f"\n### Under a pod memory limit of {limit / MiB:.0f} MiB (the entry is {total / MiB:.0f} MiB), local disk\n"
    )
    print(f"load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end\n")
    print(
        "| row | pod start to loaded (s) | server's own read (s) | peak usage before the server's read | budget ceiling | read ahead |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for row, items in runs.items():
        pf = items[0].prefetch
        ceiling = (pf.get("budget") or {}).get("ceiling")
        peak = max(r.peak_before_read or 0 for r in items)
        shown = f"{ceiling / MiB:.0f} MiB" if ceiling else "-"
        ahead = f"{pf.get('bytes', 0) / MiB:.0f} MiB, {pf.get('stopped')}" if pf else ""
        print(f"| {row} | {med([r.loaded_s for r in items]):.2f} | {med([r.server_read_s for r in items]):.2f} | "
              f"{peak / MiB:.0f} MiB | {shown} | {ahead} |")  # fmt: skip


@contextlib.contextmanager
def juicefs_over_s3(work: Path, args: argparse.Namespace) -> Iterator[tuple[list[Path], str]]:
    from cachemgr_testkit.mounts import juicefs_binary, juicefs_volume, unmount_on_sigterm
    from cachemgr_testkit.s3server import ACCESS_KEY, BUCKET, SECRET_KEY, s3_server

    unmount_on_sigterm()
    with s3_server(work / "s3") as s3:
        proxy = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "s3fault.py"), "--upstream", s3.endpoint, "--writes", "pass",
             "--latency-ms", str(args.latency_ms), "--bandwidth", args.bandwidth,
             "--total-bandwidth", args.total_bandwidth],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert proxy.stdout is not None
            port = proxy.stdout.readline().split()[-1]
            storage = ["--storage=minio", f"--bucket=http://127.0.0.1:{port}/{BUCKET}",
                       f"--access-key={ACCESS_KEY}", f"--secret-key={SECRET_KEY}"]  # fmt: skip
            # JuiceFS' defaults: 1 s metadata caches, a 100 GiB block cache, its own read-ahead.
            with juicefs_volume(work / "jfs", mounts=2, metadata_cache_s=1.0, storage_args=storage,
                                extra_mount_args=["--cache-size=102400"]) as mounts:  # fmt: skip
                yield mounts, str(juicefs_binary())
        finally:
            proxy.kill()
            proxy.wait()


def juicefs(args: argparse.Namespace, work: Path) -> None:
    with juicefs_over_s3(work, args) as (mounts, binary):
        args.size_now = args.juicefs_size
        writer = publish_entry(work, mounts[0], args)
        artifacts = mounts[1] / writer.relative_to(mounts[0])
        volume = Volume(
            "juicefs", mounts[1], evict=[binary, "warmup", "--evict"], warmup=[binary, "warmup", "-p", "50"]
        )
        load0 = os.getloadavg()[0]
        rows = [
            "no prefetch",
            "cachemgr prefetch",
            "juicefs warmup at launch",
            "tuned parallel read at launch",
        ]
        runs = rounds(work, volume, artifacts, args, rows)
        alone = entry_alone(volume, artifacts, args.threads)
        title = (f"Whole warm start, JuiceFS (default caches) over SeaweedFS S3 with {args.latency_ms:g} ms "
                 f"latency, {args.bandwidth}/s per connection, {args.total_bandwidth}/s in all: {args.files} files, "
                 f"{args.juicefs_size}, server init {args.init:g} s, caches dropped, {args.runs} rounds")  # fmt: skip
        loaded = print_table(title, runs, alone, load=(load0, os.getloadavg()[0]))
        verdict_juicefs(loaded)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--fs", default="local,juicefs")
    parser.add_argument("--size", default="2G", help="the entry on the local disk")
    parser.add_argument("--juicefs-size", default="512M")
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument(
        "--init", type=float, default=5.0, help="seconds the server initialises before it reads"
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=32, help="the tuned parallel read's threads")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--bandwidth", default="16M", help="per connection to the store, bytes/s")
    parser.add_argument("--total-bandwidth", default="128M", help="for all connections, bytes/s")
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    if args.quick:
        args.size, args.juicefs_size, args.runs, args.init, args.files = "512M", "128M", 1, 2.0, 8
    if os.geteuid() != 0:
        print(
            "bench_prefetch needs root: it drops the page cache, mounts JuiceFS and makes cgroups",
            file=sys.stderr,
        )
        return 2
    work = Path(tempfile.mkdtemp(prefix="cachemgr-bench-prefetch-", dir="/var/tmp"))
    try:
        for fs in args.fs.split(","):
            {"local": local, "juicefs": juicefs}[fs](args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
