"""A compiler's output through cachemgr's pump (cachemgr.runtime.output) vs ``cat`` and vs the
readline pump cachemgr had before: throughput and the reader's peak RSS, in one run.

Three shapes of output, each SIZE bytes: short lines (a chatty compiler), one line without a
newline (a dumped tensor), and a ``\\r`` progress bar (frames, no newline). A producer process
writes them to a pipe; the reader passes every byte on to /dev/null:

* ``cat``: the floor, a pass-through that keeps nothing;
* ``readline``: the pump before issue 26 (``iter(stream.readline, b"")``, a 40-line tail);
* ``cachemgr``: ``OutputWatch`` as a compile runs it (64 KiB reads, a bounded tail, disk-full
  spotting).

Targets (ratios in one run: the machine is shared): on short lines, the one shape where readline
keeps its memory bounded too, at least 80% of its throughput; and the reader's peak RSS
independent of the shape (within 10 MB of its peak on short lines), where readline's grows with
the longest line (it is "fast" on a long line or a bar by holding all of it). ``cat`` is the
floor, for scale. Prints a markdown table.

    .venv/bin/python bench/bench_output.py           # --size 200M --runs 3; --quick: 50M, 1 run
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

PRODUCER = r"""
import os, sys
shape, size = sys.argv[1], int(sys.argv[2])
if shape == "lines":
    block = b"[compile] layer 123 fused kernel ok, 0.0012 s elapsed, mem 1234 MiB\n" * 1000
elif shape == "long":
    block = b"0.0000, " * 8192
else:
    block = b"".join(b"\r[compile] graph %6d/999999 [" % i + b"#" * 40 + b"]" for i in range(1000))
out = sys.stdout.buffer
left = size
while left > 0:
    out.write(block[:left])
    left -= min(left, len(block))
out.flush()
"""

READER = r"""
import collections, os, resource, subprocess, sys, time
kind, shape, size = sys.argv[1], sys.argv[2], sys.argv[3]
producer = [sys.executable, "-c", sys.argv[4], shape, size]
start = time.perf_counter()
child = subprocess.Popen(producer, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
if kind == "cachemgr":
    from cachemgr.runtime.launcher import OutputWatch
    watch = OutputWatch(child)
    child.wait()
    watch.join(timeout=600)
else:  # the readline pump cachemgr had before issue 26, as it was
    tail = collections.deque(maxlen=40)
    out = sys.stdout.buffer
    for raw in iter(child.stdout.readline, b""):
        out.write(raw)
        out.flush()
        tail.append(raw.decode(errors="replace").rstrip())
    child.wait()
seconds = time.perf_counter() - start
print(f"{seconds} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr)
"""


def _cat(shape: str, size: int) -> tuple[float, int]:
    script = (
        "import resource, subprocess, sys, time\n"
        "start = time.perf_counter()\n"
        "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE)\n"
        "c = subprocess.run(['cat'], stdin=p.stdout, stdout=subprocess.DEVNULL)\n"
        "p.wait()\n"
        "print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, sys.executable, "-c", PRODUCER, shape, str(size)],
        capture_output=True,
        text=True,
        check=True,
    )
    seconds, rss = done.stderr.split()
    return float(seconds), int(rss)


def _reader(kind: str, shape: str, size: int) -> tuple[float, int]:
    with open("/dev/null", "wb") as sink:
        done = subprocess.run(
            [sys.executable, "-c", READER, kind, shape, str(size), PRODUCER],
            stdout=sink,
            stderr=subprocess.PIPE,
            text=True,
            check=True,
        )
    seconds, rss = done.stderr.split()[-2:]
    return float(seconds), int(rss)


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="200M", help="bytes of output per run (k/M/G)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    size = int(args.size[:-1]) * {"k": 1 << 10, "M": 1 << 20, "G": 1 << 30}[args.size[-1]]
    runs = args.runs
    if args.quick:
        size, runs = 50 << 20, 1
    print(f"{size >> 20} MiB of output per run, median of {runs} run(s); RSS is the reader's peak\n")
    print("| shape | reader | MB/s | of cat | peak RSS |")
    print("|---|---|---:|---:|---:|")
    peaks: dict[str, int] = {}
    rates: dict[tuple[str, str], float] = {}
    for shape in ("lines", "long", "bar"):
        for kind in ("cat", "readline", "cachemgr"):
            read = _cat if kind == "cat" else (lambda s, n, k=kind: _reader(k, s, n))
            samples = [read(shape, size) for _ in range(runs)]
            rate = size / statistics.median(s for s, _ in samples) / 1e6
            rss = max(r for _, r in samples)
            rates[shape, kind] = rate
            if kind == "cachemgr":
                peaks[shape] = rss
            print(
                f"| {shape} | {kind} | {rate:.0f} | {rate / rates[shape, 'cat']:.0%} | {rss / 1024:.0f} MB |"
            )
    vs_readline = rates["lines", "cachemgr"] / rates["lines", "readline"]
    spread = (max(peaks.values()) - peaks["lines"]) / 1024
    print()
    print(
        f"- short lines, of the readline pump: {vs_readline:.2f}x (target 0.8x): {_verdict(vs_readline >= 0.8)}"
    )
    print(f"- peak RSS spread across shapes: {spread:+.0f} MB (target 10): {_verdict(spread <= 10)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
