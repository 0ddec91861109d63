"""What passing a server's output through cachemgr costs (the tail kept for a failed launch).

A child prints as fast as it can: short log lines, then lines of 64 KiB, then one line of
64 MiB without a newline (a server that dumps a blob). Each case runs with the child's stdout
inherited (the kernel writes straight to the file, as before) and piped through
:class:`cachemgr.runtime.output.ServerOutput` to the same kind of file, in turn, RUNS times;
the table shows the medians, the ratio, and how much this process's peak RSS grew while it
passed everything through (the tail is bounded: 20 lines of 400 bytes).

Any pass-through costs a copy through user space that the inherited descriptor does not (most
of the difference is the pipe; the tail skips all but the last lines of each read);
what matters is that no server is held back at the rates servers print. The target: at least
100 MiB/s through cachemgr for every kind of output (a million 100-byte log lines a second, far
above what vLLM logs), and no RSS growth with the output's size.

    .venv/bin/python bench/bench_server_output.py [--runs 5] [--mib 256]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cachemgr.runtime.output import ServerOutput

TARGET_MIB_S = 100.0

CASES = {
    "log lines (100 B)": "line = b'x' * 99 + b'\\n'\nblock = line * 10000\nfor _ in range(N // len(block)): out.write(block)\n",
    "long lines (64 KiB)": "line = b'x' * 65535 + b'\\n'\nfor _ in range(N // len(line)): out.write(line)\n",
    "one line, no newline": "chunk = b'x' * (1 << 20)\nfor _ in range(N // len(chunk)): out.write(chunk)\n",
}


def child_argv(body: str, total: int) -> list[str]:
    script = f"import sys\nN = {total}\nout = sys.stdout.buffer\n{body}out.flush()\n"
    return [sys.executable, "-c", script]


def run_inherited(argv: list[str], sink: Path) -> float:
    with sink.open("wb") as out:
        started = time.perf_counter()
        subprocess.run(argv, stdout=out, check=True)
        return time.perf_counter() - started


def run_piped(argv: list[str], sink: Path) -> float:
    """Our fd 1 pointed at ``sink`` while the pump writes there, as a pod's stdout is its log."""
    saved = os.dup(1)
    fd = os.open(sink, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.dup2(fd, 1)
        started = time.perf_counter()
        child = subprocess.Popen(argv, stdout=subprocess.PIPE)
        output = ServerOutput(child)
        child.wait()
        output.join(timeout=60)
        return time.perf_counter() - started
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mib", type=int, default=256, help="bytes each case prints, in MiB")
    args = parser.parse_args()
    total = args.mib << 20
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-output-") as tmp:
        sink = Path(tmp) / "log"
        for name, body in CASES.items():
            argv = child_argv(body, total)
            direct, piped = [], []
            for _ in range(args.runs):  # in turn: the machine's noise falls on both alike
                direct.append(run_inherited(argv, sink))
                printed = sink.stat().st_size
                piped.append(run_piped(argv, sink))
                assert sink.stat().st_size == printed, "every byte passed through"
            d, p = statistics.median(direct), statistics.median(piped)
            rows.append((name, total / d / 2**20, total / p / 2**20, d / p))
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    print(f"{args.mib} MiB printed per run, {args.runs} runs each, medians\n")
    print(f"| output | inherited MiB/s | through cachemgr MiB/s | ratio | target {TARGET_MIB_S:.0f} MiB/s |")
    print("|---|---|---|---|---|")
    for name, direct_rate, piped_rate, ratio in rows:
        met = "met" if piped_rate >= TARGET_MIB_S else f"missed by {1 - piped_rate / TARGET_MIB_S:.0%}"
        print(f"| {name} | {direct_rate:,.0f} | {piped_rate:,.0f} | {ratio:.2f} | {met} |")
    print(f"\npeak RSS of the supervising process grew {grown:.1f} MiB over all runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
