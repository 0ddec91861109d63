"""The weights' identity in the key: what reading a 100 GiB model directory costs at every pod start.

The key identifies a local model's weights by content (cachemgr/key/weights.py): a file's size and a
sample of its bytes (its first 256 KiB and 16 blocks of 4 KiB), or a hub blob's name. This bench
lays out a model directory of ``--size`` (default 100 GiB) in ``--files`` safetensors files and
times, in one run, with the page cache dropped before each (as at a pod's first start on a node):

- ``sizes``: what the key read before (each weight file's size, one stat);
- ``sampled``: cachemgr's content identity (what every start now pays);
- ``whole``: every byte through xxh3 (what exact content hashing would pay), on ``--whole-size`` of
  the files only (default 4 GiB), scaled to the directory by bytes.

The files are sparse where ``--sparse`` (the default: 100 GiB of real bytes does not fit this
machine's disk twice over), so a read of a hole costs no disk I/O: ``whole`` is then a lower bound
(memory speed, not disk speed), and the second table, on ``--real-size`` of real bytes (default 2 GiB),
shows the disk-bound ratio of ``sampled`` to ``whole``.

    .venv/bin/python bench/bench_fingerprint.py [--size 100G --files 50 --runs 5 --dir /var/tmp/fp]

Target: ``sampled`` adds under 50 ms to a start on the 100 GiB directory (local disk, cache dropped).
Exits non-zero only on errors.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import xxhash
from cachemgr_testkit.oracle import safetensors_bytes

from cachemgr.core.units import parse_size
from cachemgr.key.weights import content_ids

TARGET_MS = 50.0


def build(folder: Path, *, total: int, files: int, sparse: bool) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    each = total // files
    paths: dict[str, str] = {}
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        path = folder / name
        header = safetensors_bytes([(f"layer.{i}.weight", (64, 64))], seed=i)
        with open(path, "wb") as out:
            out.write(header)
            if sparse:
                out.truncate(each)  # a hole: no block on disk, reads as zeros
                out.seek(each // 2)
                out.write(os.urandom(4096))  # a few real blocks inside
            else:
                left = each - len(header)
                chunk = os.urandom(1 << 20)
                while left > 0:
                    left -= out.write(chunk[: min(len(chunk), left)])
        paths[name] = str(path)
    os.sync()
    return paths


def drop_caches(paths: dict[str, str]) -> None:
    for path in paths.values():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sizes(paths: dict[str, str]) -> dict[str, int]:
    return {name: os.stat(path).st_size for name, path in paths.items()}


def whole(paths: dict[str, str]) -> dict[str, str]:
    out = {}
    for name, path in paths.items():
        digest = xxhash.xxh3_128()
        with open(path, "rb") as src:
            while block := src.read(8 << 20):
                digest.update(block)
        out[name] = digest.hexdigest()
    return out


def timed(fn, paths: dict[str, str], runs: int) -> float:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(runs):
        drop_caches(paths)
        began = time.perf_counter()
        fn(paths)
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def table(title: str, rows: list[tuple[str, float]], base: float) -> None:
    print(f"\n### {title}\n")
    print("| method | median | vs sizes |")
    print("|---|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1000:,.1f} ms | {seconds / base:,.1f}x |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp/cachemgr-bench-fingerprint"))
    parser.add_argument("--size", default="100G")
    parser.add_argument("--files", type=int, default=50)
    parser.add_argument("--whole-size", default="4G")
    parser.add_argument("--real-size", default="2G")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="10 GiB, 3 runs")
    args = parser.parse_args()
    total = parse_size("10G" if args.quick else args.size)
    runs = 3 if args.quick else args.runs
    if args.dir.exists():
        shutil.rmtree(args.dir)
    try:
        big = build(args.dir / "sparse", total=total, files=args.files, sparse=True)
        part = dict(list(big.items())[: max(1, args.files * parse_size(args.whole_size) // total)])
        rows = [
            ("sizes (before)", timed(sizes, big, runs)),
            ("sampled (cachemgr)", timed(content_ids, big, runs)),
        ]
        part_bytes = sum(os.stat(p).st_size for p in part.values())
        rows.append(("whole xxh3 (scaled)", timed(whole, part, max(1, runs // 2)) * total / part_bytes))
        table(f"{total / 2**30:.0f} GiB in {args.files} sparse files, page cache dropped", rows, rows[0][1])
        added = (rows[1][1] - rows[0][1]) * 1000
        print(
            f"\nsampled adds {added:.1f} ms (target under {TARGET_MS:.0f} ms): {'met' if added < TARGET_MS else 'MISSED'}"
        )
        real = build(args.dir / "real", total=parse_size(args.real_size), files=8, sparse=False)
        rows = [("sizes (before)", timed(sizes, real, runs)), ("sampled (cachemgr)", timed(content_ids, real, runs)),
                ("whole xxh3", timed(whole, real, max(1, runs // 2)))]  # fmt: skip
        table(
            f"{parse_size(args.real_size) / 2**30:.0f} GiB of real bytes in 8 files, page cache dropped",
            rows,
            rows[0][1],
        )
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
