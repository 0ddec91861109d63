"""Full verify throughput: cachemgr's xxh3-128 of every file against ``cat`` reading the same files.

One entry is published through the real publish path (2,000 files, the same layout as
bench_warm.py; 2 GiB on the local disk, 512 MiB on JuiceFS, whose reads run at ~100 MiB/s
here). Each run reads every file the manifest lists, three ways, taken in turn:

* ``cat FILE... > /dev/null``: one ``cat`` over every file (GNU cat: 128 KiB read/write);
* ``cachemgr verify KEY``: the CLI, as an operator runs it (interpreter, imports, manifest,
  hashing, the extra-file walk);
* ``check_files(mode="full")``: the library call ``lookup --verify full`` makes, in this process.

Unless ``--no-cold`` (and where it works: root), the page cache is dropped before every run
(``echo 3 > /proc/sys/vm/drop_caches``), so each reads from the disk or, on JuiceFS, from its
object storage through the FUSE client; the warm rows read the page cache and show the hashing
cost alone. Throughput is the entry's bytes over wall time; the ratio to ``cat`` is the median
of per-run ratios, so noise on the machine hits both sides alike.

    .venv/bin/python bench/bench_verify.py                  # local dir and JuiceFS, cold and warm
    .venv/bin/python bench/bench_verify.py --quick          # 200 files, 256 MiB, 2 runs

Then the hashing loop alone with other read sizes (``--sweep-fs``, local by default):
fsutil.hash_fd reads 256 KiB at a time with ``posix_fadvise(SEQUENTIAL)`` (it read 8 MiB until
this sweep showed the buffer falling out of the CPU cache), cat 128 KiB with the same advice.

Target: at least 85% of cat's throughput. Exits non-zero only on errors, not on a missed target.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import xxhash
from bench_warm import (
    BASE_ENV,
    CONSOLE_SCRIPT,
    bench_key,
    build_entry,
    drop_caches,
    human,
    parse_size,
    volumes,
)
from mounts import unmount_on_sigterm

from cachemgr.volume.manifest import check_files, read_manifest

TARGET = 0.85


@dataclass
class Row:
    label: str
    cold: bool
    size: int  # bytes read per run: every file the manifest lists
    seconds: dict[str, list[float]] = field(default_factory=dict)


def timed(action: Callable[[], None]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def methods(entry: Path, read_root: Path) -> dict[str, Callable[[], None]]:
    manifest = read_manifest(entry)
    paths = [str(entry / record.path) for record in manifest.files]
    env = {**os.environ, **BASE_ENV, "CACHEMGR_CACHE_ROOT": str(read_root)}

    def cat() -> None:
        subprocess.run(["cat", *paths], stdout=subprocess.DEVNULL, check=True)

    def cli() -> None:
        done = subprocess.run(
            [str(CONSOLE_SCRIPT), "verify", manifest.key[:16]], env=env, capture_output=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"cachemgr verify exited {done.returncode}: {done.stderr.decode()[-1000:]}")

    def library() -> None:
        problems = check_files(entry, manifest, mode="full")
        if problems:
            raise RuntimeError(f"the entry does not verify: {problems[:3]}")

    return {"cat": cat, "cachemgr verify": cli, "check_files(full)": library}


def hash_with(chunk: int, *, sequential: bool = False) -> Callable[[str], str]:
    """fsutil.hash_fd with another read size (it reads 256 KiB at a time into one buffer), and
    optionally ``posix_fadvise(SEQUENTIAL)`` as GNU cat does (it doubles the kernel's readahead)."""

    def digest_of(path: str) -> str:
        digest = xxhash.xxh3_128()
        buffer = bytearray(chunk)
        view = memoryview(buffer)
        with open(path, "rb", buffering=0) as handle:
            if sequential:
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while count := handle.readinto(buffer):
                digest.update(view[:count])
        return digest.hexdigest()

    return digest_of


def sweep_methods(entry: Path) -> dict[str, Callable[[], None]]:
    """cat, and the full check's hashing loop with other read sizes, with and without fadvise."""
    manifest = read_manifest(entry)
    paths = [str(entry / record.path) for record in manifest.files]
    ways: dict[str, Callable[[], None]] = {
        "cat": lambda: subprocess.run(["cat", *paths], stdout=subprocess.DEVNULL, check=True) and None
    }
    variants = (
        ("8 MiB (before)", 8 << 20, False),
        ("1 MiB", 1 << 20, False),
        ("256 KiB", 256 << 10, False),
        ("128 KiB", 128 << 10, False),
        ("256 KiB + SEQUENTIAL (now)", 256 << 10, True),
    )
    for label, chunk, sequential in variants:
        digest_of = hash_with(chunk, sequential=sequential)

        def hash_all(digest_of: Callable[[str], str] = digest_of) -> None:
            for path, record in zip(paths, manifest.files, strict=True):
                if digest_of(path) != record.xxh3:
                    raise RuntimeError(f"{path} does not match its manifest")

        ways[label] = hash_all
    return ways


def measure(label: str, entry: Path, read_root: Path, *, runs: int, cold: bool, sweep: bool = False) -> Row:
    row = Row(label, cold, read_manifest(entry).total_bytes)
    ways = sweep_methods(entry) if sweep else methods(entry, read_root)
    for action in ways.values():
        action()  # bytecode and imports; with warm caches, the page cache
    for i in range(runs):
        order = list(ways.items())
        order = order[i % len(order) :] + order[: i % len(order)]  # rotate: no method always goes first
        for name, action in order:
            if cold:
                drop_caches()
            row.seconds.setdefault(name, []).append(timed(action))
    return row


def print_rows(rows: list[Row], *, files: int, runs: int) -> None:
    print(f"\n### Full verify throughput: {files} files per entry, {runs} runs per row\n")
    print(
        "| volume | entry | caches | cat | cachemgr verify (CLI) | ratio | check_files(full) | ratio "
        f"| target >= {TARGET:.0%} of cat |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---|")
    for row in rows:
        cat = row.seconds["cat"]

        def rate(seconds: list[float], size: int = row.size) -> str:
            return f"{size / statistics.median(seconds) / (1 << 20):,.0f} MiB/s"

        def ratio(name: str, row: Row = row, cat: list[float] = cat) -> float:
            return statistics.median(c / s for c, s in zip(cat, row.seconds[name], strict=True))

        cli, lib = ratio("cachemgr verify"), ratio("check_files(full)")
        verdict = "met" if cli >= TARGET else f"missed by {100 * (TARGET - cli):.0f} points"
        print(
            f"| {row.label} | {human(row.size)} | {'dropped' if row.cold else 'warm'} | {rate(cat)} "
            f"| {rate(row.seconds['cachemgr verify'])} | **{cli:.0%}** "
            f"| {rate(row.seconds['check_files(full)'])} | {lib:.0%} | {verdict} |"
        )


def print_sweep(rows: list[Row]) -> None:
    print("\n### The hashing loop with other read sizes (in-process; share of cat's throughput)\n")
    names = [name for name in rows[0].seconds if name != "cat"] if rows else []
    print("| volume | caches | cat | " + " | ".join(names) + " |")
    print("|---|---|---:|" + "---:|" * len(names))
    for row in rows:
        cat = row.seconds["cat"]
        cells = []
        for name in names:
            ratio = statistics.median(c / s for c, s in zip(cat, row.seconds[name], strict=True))
            cells.append(
                f"{row.size / statistics.median(row.seconds[name]) / (1 << 20):,.0f} MiB/s ({ratio:.0%})"
            )
        rate = row.size / statistics.median(cat) / (1 << 20)
        print(
            f"| {row.label} | {'dropped' if row.cold else 'warm'} | {rate:,.0f} MiB/s | "
            + " | ".join(cells)
            + " |"
        )


def main() -> int:
    unmount_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--size", type=parse_size, default=parse_size("2G"), help="entry size (default 2G)")
    parser.add_argument(
        "--juicefs-size",
        type=parse_size,
        default=parse_size("512M"),
        help="entry size on JuiceFS, where reads run at ~100 MiB/s (default 512M)",
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per row (default 3)")
    parser.add_argument("--fs", default="local,juicefs", help="comma-separated: local, juicefs")
    parser.add_argument("--no-cold", action="store_true", help="skip the rows with dropped caches")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir)")
    parser.add_argument(
        "--sweep-fs", default="local", help="volumes for the read-size sweep (default local; '' for none)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 200 files, 256 MiB (64 MiB on JuiceFS), 2 runs"
    )
    args = parser.parse_args()
    if args.quick:
        args.files, args.size, args.juicefs_size, args.runs = 200, 256 << 20, 64 << 20, 2
    cold = not args.no_cold and drop_caches()
    if not args.no_cold and not cold:
        print("cannot drop caches here (not root?): warm-cache rows only", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="bench-verify-", dir=args.dir))
    rows: list[Row] = []
    sweeps: list[Row] = []
    try:
        with volumes(args.fs.split(","), work) as found:
            for label, build_root, read_root in found:
                size = args.size if label == "local" else args.juicefs_size
                key = bench_key(args.files, size)
                entry = build_entry(build_root, key, files=args.files, size=size)
                read_entry = read_root / "entries" / entry.name
                print(f"{label}: published {entry.name} ({human(size)})", file=sys.stderr)
                for dropped in (True, False) if cold else (False,):
                    rows.append(measure(label, read_entry, read_root, runs=args.runs, cold=dropped))
                    if label.split(",")[0] in args.sweep_fs.split(","):
                        sweeps.append(
                            measure(label, read_entry, read_root, runs=args.runs, cold=dropped, sweep=True)
                        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_rows(rows, files=args.files, runs=args.runs)
    if sweeps:
        print_sweep(sweeps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
