"""How long ``cachemgr probe`` takes, against a real serving pod.

Starts one ``cachemgr run`` pod (stand-in server, via tests/podlib.py), waits until it
serves, then times RUNS runs of each probe as the kubelet runs an exec probe: a fresh
process each time, wall clock from spawn to exit, the cases taken in turn. ``python -c pass`` is the floor (the
interpreter's own start); the machine is noisy, so the ratios to it say more than the
milliseconds. The target is a median under 100 ms for ``cachemgr probe ready``.

Bytecode is cached as in the image (pip compiles it at install), even where the caller set
PYTHONDONTWRITEBYTECODE; the last row runs a copy of cachemgr that has no bytecode, compiled
from source on every run (a checkout run with PYTHONDONTWRITEBYTECODE=1).

    .venv/bin/python bench/bench_probe.py [--runs 20]
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
from pathlib import Path

from cachemgr_testkit.podlib import cluster, free_port

REPO = Path(__file__).resolve().parent.parent

TARGET_MS = 100.0
CONSOLE_SCRIPT = Path(sys.executable).parent / "cachemgr"


Case = tuple[str, list[str], dict[str, str]]


def time_once(argv: list[str], env: dict[str, str]) -> float:
    """Wall-clock milliseconds of one run of ``argv``, which must exit 0."""
    started = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, check=False, env=env)
    elapsed = (time.perf_counter() - started) * 1000
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {result.returncode}: {result.stdout!r} {result.stderr!r}")
    return elapsed


def time_cases(cases: list[Case], *, runs: int) -> list[tuple[str, list[float]]]:
    """Round-robin over the cases, so a burst of noise on the machine hits them all alike."""
    for _, argv, env in cases:
        time_once(argv, env)  # page cache and bytecode
    times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for _ in range(runs):
        for name, argv, env in cases:
            times[name].append(time_once(argv, env))
    return list(times.items())


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-probe-"))
    try:
        return bench(work, runs=args.runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench(work: Path, *, runs: int) -> int:
    root = work / "volume"
    root.mkdir()
    # The console script, as an exec probe runs it; python -m as a fallback and for comparison.
    probe = [str(CONSOLE_SCRIPT)] if CONSOLE_SCRIPT.exists() else [sys.executable, "-m", "cachemgr"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    # cachemgr's own modules with no bytecode (a copy, never compiled), the standard library as usual.
    shutil.copytree(
        REPO / "cachemgr", work / "src" / "cachemgr", ignore=shutil.ignore_patterns("__pycache__")
    )
    no_bytecode = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(work / "src")}
    with cluster(work / "pods") as pods:
        argv = ["vllm", "serve", "rebellions/Test-LLM", "--port", str(free_port())]
        pod = pods.start("bench", argv, cache_root=root)
        pod.wait_phase("serving")
        state = ["--state-dir", str(pod.state_dir)]
        cases: list[Case] = [
            ("python -c pass (floor)", [sys.executable, "-c", "pass"], env),
            *(
                (f"cachemgr probe {kind}", [*probe, "probe", kind, *state], env)
                for kind in ("startup", "live", "ready")
            ),
            (
                "python -m cachemgr probe ready",
                [sys.executable, "-m", "cachemgr", "probe", "ready", *state],
                env,
            ),
            ("  ...ready, cachemgr not compiled", [*probe, "probe", "ready", *state], no_bytecode),
        ]
        results = time_cases(cases, runs=runs)
        if pod.phase != "serving":
            raise SystemExit(f"the pod left serving during the benchmark: {pod.tail()}")
    print_table(results, runs=runs)
    ready = next(times for name, times in results if name == "cachemgr probe ready")
    return 0 if statistics.median(ready) < TARGET_MS else 1


def print_table(results: list[tuple[str, list[float]]], *, runs: int) -> None:
    floor = statistics.median(results[0][1])
    print(
        f"{runs} runs each against a serving pod; target: cachemgr probe ready median < {TARGET_MS:.0f} ms\n"
    )
    header = f"{'command':<32} {'median ms':>9} {'p95 ms':>8} {'x floor':>8}  target"
    print(header)
    print("-" * len(header))
    for name, times in results:
        median = statistics.median(times)
        met = "" if "ready" not in name else ("met" if median < TARGET_MS else "MISSED")
        print(f"{name:<32} {median:>9.1f} {p95(times):>8.1f} {median / floor:>8.2f}  {met}")


if __name__ == "__main__":
    raise SystemExit(main())
