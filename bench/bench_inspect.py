"""``cachemgr ls`` and ``du`` on a 10,000-entry cache: wall time of the real CLI, median of runs.

Run by hand (not in CI)::

    .venv/bin/python bench/bench_inspect.py                  # 10,000 entries in a temp dir
    .venv/bin/python bench/bench_inspect.py --dir /mnt/nfs/bench --keep --runs 7

The cache is built through the library's real publish path (``store.create_staging`` then
``store.publish``: key.json, summary, manifest with xxh3 of every file, atomic rename), with
two small artifacts per entry, spread over models, roles, compiler versions and TP sizes, with
use records and last-use times like a long-lived volume. By default the build skips fsync
(``--fsync`` keeps it): fsync makes the build minutes slower and changes nothing that is read.
Then each command runs as a subprocess (``python -m cachemgr ...``, imports included), as an
operator's ``kubectl exec`` would.

Last, what ``ls`` would pay to check file sizes (issue 34: an entry whose sizes no longer match is
listed ``published``): the check ``show`` makes of one entry (its manifest read, every file's
size and mtime against it: ``check_files(mode="fast")``), timed on every entry here, and on one
entry of ``--files-per-entry`` files, as many as a large compiled model has.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cachemgr_standin import DECLARED_VERSIONS

from cachemgr.key.cachekey import KeyRequest, compute_key
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import open_root
from cachemgr.volume.manifest import check_files, read_manifest
from cachemgr.volume.records import register_use, release_use
from cachemgr.volume.store import create_staging, publish

TARGET_SECONDS = {"local": 1.0, "juicefs": 2.0, "juicefs-cached": 2.0}  # issue 25: JuiceFS under 2 s
# completion --keys: what a shell runs on each TAB after `cachemgr show ` (the listing alone).
COMMANDS = (["ls"], ["ls", "-o", "json"], ["du"], ["du", "-o", "json"], ["completion", "--keys", "0"])
COMPILERS = ("0.11.2", "0.12.0", "0.12.3", "0.13.0")
ROLES = ("prefill", "decode")
TP = ("2", "4", "8", "16")
# The vllm strategy keys on the server's versions; this machine has no vLLM: declare them, as the
# stand-in does (transformers too, since the key took it in).
SERVER_VERSIONS = dict(DECLARED_VERSIONS)


def _build_chunk(args: tuple[str, int, int, bool]) -> int:
    root_dir, start, stop, fsync = args
    if not fsync:
        # Build speed only: the bytes and names written are the same with or without it.
        os.fsync = lambda _fd: None
    root = open_root(Path(root_dir), create=False)
    rng = random.Random(start)
    now = time.time()
    for i in range(start, stop):
        key = _key(i)
        identity = PodIdentity(pod=f"bench-{i % 97}", node=f"node-{i % 7}", host="bench", pid=os.getpid())
        staging = create_staging(root, key, identity)
        for n in range(2):
            (staging.artifacts / f"graph_{n}.rbln").write_bytes(rng.randbytes(512 + (i * 37 + n) % 4096))
        publish(root, staging, key, identity=identity, compile_seconds=600.0 + i % 60, strategy="vllm")
        record = register_use(root, key.digest, identity, entry=key.entry_name)
        if i % 500 != 0:  # one in 500 stays in use
            release_use(record)
        age = rng.uniform(0, 30 * 86400)
        os.utime(root.usage / key.digest / "last-used", (now - age, now - age))
    return stop - start


def _key(i: int) -> object:
    argv = [
        "vllm", "serve", f"bench-org/model-{i % 50}",
        "--tensor-parallel-size", TP[(i // 50) % len(TP)],
        "--max-model-len", str(1024 * (1 + i // 200)),
    ]  # fmt: skip
    return compute_key(
        KeyRequest(
            argv=argv,
            role=ROLES[(i // 7) % 2],
            compiler_version=COMPILERS[(i // 13) % len(COMPILERS)],
            npu_type="RBLN-CA25",
            environ=SERVER_VERSIONS,
        )
    )


def build(root_dir: Path, entries: int, *, fsync: bool) -> float:
    started = time.monotonic()
    root_dir.mkdir(parents=True, exist_ok=True)
    open_root(root_dir, create=True)
    workers = max(1, os.cpu_count() or 1)
    step = 250
    chunks = [(str(root_dir), s, min(entries, s + step), fsync) for s in range(0, entries, step)]
    done = 0
    with multiprocessing.Pool(workers) as pool:
        for count in pool.imap_unordered(_build_chunk, chunks):
            done += count
            if done % 2000 < step:
                print(f"building: {done}/{entries} entries", file=sys.stderr, flush=True)
    return time.monotonic() - started


def measure(root_dir: Path, command: list[str], runs: int) -> list[tuple[float, float]]:
    """(wall, cpu) seconds of each run; CPU time (user + sys) shows what a busy node hides."""
    env = {**os.environ, "CACHEMGR_CACHE_ROOT": str(root_dir), "CACHEMGR_COMPILER_VERSION": "0.12.0",
           "CACHEMGR_NPU_TYPE": "RBLN-CA25", "CACHEMGR_LOG_FORMAT": "json"}  # fmt: skip
    times = []
    for _ in range(runs):
        before = os.times()
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "cachemgr", *command], env=env, capture_output=True, check=False
        )
        after = os.times()
        cpu = after.children_user - before.children_user + after.children_system - before.children_system
        times.append((time.monotonic() - started, cpu))
        if done.returncode != 0:
            raise SystemExit(f"cachemgr {' '.join(command)} exited {done.returncode}: {done.stderr.decode()}")
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to build (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the cache (and reuse it if --dir has one)")
    parser.add_argument("--fsync", action="store_true", help="fsync while building, as pods do")
    parser.add_argument(
        "--files-per-entry",
        type=int,
        default=2000,
        help="the size check's large entry: this many files (a large compiled model's)",
    )
    parser.add_argument(
        "--fs",
        choices=("local", "juicefs", "juicefs-cached"),
        default="local",
        help="juicefs: built through one mount of a fresh JuiceFS volume, listed through the other "
        "(juicefs-cached: with JuiceFS' default 1 s metadata caches)",
    )
    args = parser.parse_args()
    if args.fs != "local":
        return _on_juicefs(args)
    root_dir = args.dir or Path(tempfile.mkdtemp(prefix="cachemgr-bench-")) / "volume"
    return _bench(root_dir, args)


def _on_juicefs(args: argparse.Namespace) -> int:
    from cachemgr_testkit.mounts import (  # test support: only for --fs juicefs
        juicefs_volume,
        unmount_on_sigterm,
    )

    unmount_on_sigterm()
    work = Path(tempfile.mkdtemp(prefix="cachemgr-bench-"))
    cache = 1.0 if args.fs == "juicefs-cached" else 0.0
    try:
        with juicefs_volume(work / "juicefs", mounts=2, metadata_cache_s=cache) as mounts:
            seconds = build(mounts[0] / "cache", args.entries, fsync=args.fsync)
            print(f"built {args.entries} entries through {mounts[0]} in {seconds:.1f}s", file=sys.stderr)
            print(f"{args.fs}: listed through the other mount, {mounts[1]}")
            args.keep = True  # the volume goes with its mounts
            return _bench(mounts[1] / "cache", args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _bench(root_dir: Path, args: argparse.Namespace) -> int:
    try:
        existing = len(os.listdir(root_dir / "entries")) if (root_dir / "entries").is_dir() else 0
        if existing >= args.entries:
            print(f"reusing {existing} entries under {root_dir}", file=sys.stderr)
        else:
            seconds = build(root_dir, args.entries, fsync=args.fsync)
            print(f"built {args.entries} entries under {root_dir} in {seconds:.1f}s", file=sys.stderr)
        subprocess.run(["sync"], check=False)
        rows = []
        hints = root_dir / "scan-hints.json"
        hints.unlink(missing_ok=True)
        first = measure(root_dir, ["ls"], 1)[0][0]  # no hints yet: reads every entry, writes them
        for command in COMMANDS:
            measure(root_dir, command, 1)  # warm the page cache and bytecode once
            times = measure(root_dir, command, args.runs)
            walls = [wall for wall, _ in times]
            cpu = statistics.median(c for _, c in times)
            rows.append((" ".join(command), statistics.median(walls), min(walls), max(walls), cpu))
        print(f"first ls, before any hints (reads every entry, writes {hints.name}): {first:.3f}s")
        baseline = statistics.median(wall for wall, _ in measure(root_dir, ["--version"], args.runs))
        _print_table(
            rows,
            baseline,
            entries=len(os.listdir(root_dir / "entries")),
            runs=args.runs,
            target=TARGET_SECONDS[args.fs],
        )
        _print_size_check(root_dir, args.files_per_entry)
        return 0 if all(row[1] < TARGET_SECONDS[args.fs] for row in rows) else 1
    finally:
        if not args.keep:
            shutil.rmtree(root_dir.parent if args.dir is None else root_dir, ignore_errors=True)


def _print_table(
    rows: list[tuple[str, float, float, float, float]],
    baseline: float,
    *,
    entries: int,
    runs: int,
    target: float,
) -> None:
    print(f"cachemgr on {entries} entries: wall time of the CLI, {runs} runs (target < {target:.0f}s)")
    print(f"{'COMMAND':<14}  {'MEDIAN':>8}  {'MIN':>8}  {'MAX':>8}  {'CPU':>8}  TARGET")
    for name, median, low, high, cpu in rows:
        verdict = "ok" if median < target else "SLOW"
        print(f"{name:<14}  {median:>7.3f}s  {low:>7.3f}s  {high:>7.3f}s  {cpu:>7.3f}s  {verdict}")
    print(f"{'--version':<14}  {baseline:>7.3f}s  (interpreter start and CLI parse, included above)")
    print("CPU: median user+sys of the process; wall beyond it is I/O wait or a busy machine")


def size_check_seconds(entries: list[Path]) -> tuple[float, int]:
    """The check ``show`` makes of an entry, on each of ``entries``: seconds, and files checked."""
    started, files = time.monotonic(), 0
    for entry in entries:
        manifest = read_manifest(entry)
        check_files(entry, manifest, mode="fast")
        files += len(manifest.files)
    return time.monotonic() - started, files


def _large_entry(volume: Path, files: int) -> Path:
    """One entry of ``files`` small files, published through the real path on a volume of its own."""
    volume.mkdir(parents=True, exist_ok=True)
    root = open_root(volume, create=True)
    key = _key(10_000_019)
    found = root.entries / key.entry_name  # type: ignore[attr-defined]
    identity = PodIdentity(pod="bench-large", node="node-0", host="bench", pid=os.getpid())
    staging = create_staging(root, key, identity)
    for n in range(files):
        folder = staging.artifacts / f"rank{n % 16}"
        folder.mkdir(exist_ok=True)
        (folder / f"graph_{n}.rbln").write_bytes(b"x" * 512)
    publish(root, staging, key, identity=identity, compile_seconds=600.0, strategy="vllm")
    return found


def _print_size_check(root_dir: Path, files_per_entry: int) -> None:
    entries = sorted(p for p in (root_dir / "entries").iterdir() if p.is_dir())
    subprocess.run(["sync"], check=False)
    size_check_seconds(entries)  # the page cache warm, as for the commands above
    every, files = size_check_seconds(entries)
    beside = root_dir.with_name(root_dir.name + "-large")
    try:
        large = _large_entry(beside, files_per_entry)
        subprocess.run(["sync"], check=False)
        size_check_seconds([large])
        one, big = size_check_seconds([large])
    finally:
        shutil.rmtree(beside, ignore_errors=True)
    print(
        f"size check (what show does for one entry: its manifest read, each file's size and mtime), in "
        f"process: all {len(entries)} entries here ({files // max(1, len(entries))} files each in their "
        f"manifests): {every:.3f}s; one entry of {big} files: {1000 * one:.1f} ms"
    )
    print(
        f"ls with that check on {len(entries)} entries of {big} files each: about {one * len(entries):.0f}s "
        "more (every file stat'ed each time: no hint can skip it, a truncation changes no folder's mtime)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
