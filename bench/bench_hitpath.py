"""The hit path: ``cachemgr run`` on a published 2,000-file entry, from process start to the server's.

Issue 34 item 5. Two parts, in one run:

1. **The figure**: paired starts, the server directly and through ``cachemgr run --verify fast``
   (``bench_warm.measure``: the server records its own start; "added" is the median of the
   per-pair differences), from an image-like install (no editable-install finder; bytecode
   compiled, as pip installs it), each start with a fresh state directory on a journaled ext4 as
   a node's ``emptyDir`` (root; else the work directory's filesystem, said so). With
   ``--against CHECKOUT`` a second checkout's cachemgr runs in the same rotation: this minus that,
   paired, and the ratio of their medians (wall clock and the main thread's CPU time to the
   launch, which the machine's load inflates far less).
2. **The breakdown**: traced starts (``python -X importtime`` running the real CLI with the
   library's steps wrapped to time them): the interpreter's start, the imports before the launch
   grouped by package (self time from ``-X importtime``: stdlib, third-party, each cachemgr
   layer), the dataclasses created on the way (their count and what creating them took: the
   decorator's work, not the import of ``dataclasses`` itself), and each step of the flow (arguments
   and options, key, open root, lookup with its fast check, use record, view, spawn, the server's
   exec). Medians of the traced runs; the importtime runs are slower than the untraced ones, so
   the table's total is theirs, and the figure is part 1's.

    .venv/bin/python bench/bench_hitpath.py                 # 2,000 files, 15 paired runs, 9 traces
    .venv/bin/python bench/bench_hitpath.py --quick         # 2,000 files, 5 paired runs, 3 traces
    git archive main | tar -x -C /tmp/main-tree && \
      .venv/bin/python bench/bench_hitpath.py --against /tmp/main-tree   # before/after, paired

Target (issue 34 item 5): under 100 ms added on the local disk (under 60 ms is in reach). Exits
non-zero only on errors, not on a missed target.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from bench_warm import (
    BASE_ENV,
    Install,
    Result,
    bench_key,
    build_entry,
    cachemgr_argv,
    check_hit,
    image_like,
    measure,
    parse_size,
    pct,
    pod_filesystem,
    start_once,
)
from cachemgr_testkit.mounts import unmount_on_sigterm

TARGET_MS = 100.0
_IMPORT_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \| (.*)$")

# Runs as `python -X importtime -c TRACE run ...`: the real CLI, with the library functions the
# runner calls wrapped to time them, where the CLI imports them. Marks on stderr split
# -X importtime's report: what the interpreter imported before this script, and what came before
# the launch. Dataclass creations are timed by wrapping dataclasses._process_class when (if) the
# module is first imported: this script imports nothing the hit path does not.
TRACE = r"""
import os, sys, time
T = {"python": time.time_ns()}
sys.stderr.write("BENCH-SCRIPT\n")
import importlib.machinery as _machinery
DC = [0, 0]

class _DataclassTimer:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "dataclasses":
            return None
        spec = _machinery.PathFinder.find_spec(name, path)
        exec_module = spec.loader.exec_module
        def timed_exec(module):
            exec_module(module)
            original = module._process_class
            def process(*args, **kwargs):
                began = time.perf_counter_ns()
                try:
                    return original(*args, **kwargs)
                finally:
                    DC[0] += 1
                    DC[1] += time.perf_counter_ns() - began
            module._process_class = process
        spec.loader.exec_module = timed_exec
        return spec

sys.meta_path.insert(0, _DataclassTimer)
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
                    json.dump({"marks": T, "spans": spans, "cpu_ns": time.thread_time_ns(),
                               "dataclasses": DC, "modules": len(sys.modules)}, out)
    setattr(owner, name, timed)

find_handler = main._handler
def handler(command, *rest):
    T["args parsed"] = time.time_ns()
    began = time.time_ns()
    run = find_handler(command, *rest)
    record("import cachemgr.cli.cmd_run", began)
    def traced_run(args, server_argv, environ):
        import cachemgr.cli.cmd_run as c
        wrap(c, "run_options", "options (trust, remote, state dir)")
        began = time.time_ns()
        import cachemgr.runtime.runner as r, cachemgr.runtime.launch as l, cachemgr.runtime.launcher, cachemgr.runtime.heartbeats as h
        record("import cachemgr.runtime.runner", began)
        wrap(r.Runner, "__init__", "runner setup (state, heartbeats)")
        wrap(r, "compute_key", "key")
        wrap(r, "open_root", "open root")
        wrap(r, "lookup", "lookup + fast check")
        wrap(h, "register_use", "use record")
        wrap(l, "build_view", "view")
        wrap(cachemgr.runtime.launcher, "start", "spawn server")
        return run(args, server_argv, environ)
    return traced_run
main._handler = handler
sys.argv = ["cachemgr", *sys.argv[1:]]
sys.exit(main.main())
"""

STEPS = (
    "import cachemgr.cli.cmd_run",
    "options (trust, remote, state dir)",
    "import cachemgr.runtime.runner",
    "runner setup (state, heartbeats)",
    "key",
    "open root",
    "lookup + fast check",
    "use record",
    "view",
    "spawn server",
)


def group(module: str) -> str:
    """An import's row: a cachemgr layer, the standard library, or a third-party package."""
    parts = module.split(".")
    if parts[0] == "cachemgr":
        return ".".join(parts[:2]) if len(parts) > 1 else "cachemgr"
    # org.python.core: copy's look for Jython, a failed import the standard library makes
    if parts[0] in sys.stdlib_module_names or parts[0].startswith("_") or parts[0] in ("encodings", "org"):
        return "stdlib"
    return f"third-party ({parts[0]})"


def imports_by_group(stderr: str) -> tuple[float, dict[str, float], dict[str, float]]:
    """From -X importtime: ms the interpreter imported before the script; self ms by group before
    the launch; self ms of each module before the launch."""
    before = 0.0
    groups: dict[str, float] = {}
    modules: dict[str, float] = {}
    phase = "interpreter"
    for line in stderr.splitlines():
        if line == "BENCH-SCRIPT":
            phase = "hit path"
            continue
        if line == "BENCH-LAUNCHED":
            break
        match = _IMPORT_LINE.match(line)
        if match is None:
            continue
        ms, name = int(match.group(1)) / 1000, match.group(3).strip()
        if phase == "interpreter":
            before += ms
        else:
            groups[group(name)] = groups.get(group(name), 0.0) + ms
            modules[name] = modules.get(name, 0.0) + ms
    return before, groups, modules


class Trace(NamedTuple):
    """One traced hit: ms per step, self ms per import group and module, and counts."""

    steps: dict[str, float]
    groups: dict[str, float]
    modules: dict[str, float]
    at_startup: float  # ms of imports the interpreter made before the script
    cpu: float  # ms of the main thread's CPU time at the spawn
    dataclasses: float  # how many were created before the launch
    dataclass_ms: float
    module_count: float


def trace_once(cmd: list[str], env: dict[str, str], work: Path, *, install: Install) -> Trace:
    """One traced hit: ms per step and per import group, from the spawn to the server's first act."""
    trace = work / "trace.json"
    argv = [install.python, "-X", "importtime", "-c", TRACE, *cmd]
    start = start_once(argv, {**env, "BENCH_TRACE_FILE": str(trace)}, work)
    data = json.loads(trace.read_text())
    marks, spans = data["marks"], data["spans"]
    at_startup, groups, modules = imports_by_group(start.log)
    steps = {
        "interpreter start (its own imports: site, encodings)": (marks["python"] - start.spawned_ns) / 1e6,
        "import cachemgr.cli.main": (marks["cli imported"] - marks["python"]) / 1e6,
        "parse args, logging setup": (marks["args parsed"] - marks["cli imported"]) / 1e6,
    }
    for label in STEPS:
        steps[label] = spans.get(label, [0, 0, 0])[2] / 1e6
    steps["server exec to its first act"] = (start.server_ns - spans["spawn server"][1]) / 1e6
    steps["other (between the steps)"] = start.spawn_to_server_ms - sum(steps.values())
    steps["total (traced: -X importtime slows it)"] = start.spawn_to_server_ms
    return Trace(
        steps=steps,
        groups=groups,
        modules=modules,
        at_startup=at_startup,
        cpu=data["cpu_ns"] / 1e6,
        dataclasses=data["dataclasses"][0],
        dataclass_ms=data["dataclasses"][1] / 1e6,
        module_count=data["modules"],
    )


def median_of(traces: list[Trace], field: str, name: str | None = None) -> float:
    """The median of a scalar field, or of one name of a dict field (0 where a trace lacks it)."""
    values = []
    for trace in traces:
        value = getattr(trace, field)
        values.append(float(value.get(name, 0.0)) if isinstance(value, dict) else float(value))
    return statistics.median(values)


def print_breakdown(this: list[Trace], that: list[Trace], label: str) -> None:
    both = bool(that)
    head = "| step | this, ms | share |" + (f" {label}, ms | this / that |" if both else "")
    rule = "|---|---:|---:|" + ("---:|---:|" if both else "")

    def row(name: str, mine: float, total: float, theirs: float | None) -> str:
        text = f"| {name} | {mine:.1f} | {100 * mine / total:.0f}% |"
        if theirs is not None:
            ratio = f"{mine / theirs:.2f}" if theirs > 0.05 else "-"
            text += f" {theirs:.1f} | {ratio} |"
        return text

    steps = list(this[0].steps)
    total = median_of(this, "steps", steps[-1])
    print(f"\n### Where the time goes: steps (median of {len(this)} traced runs each)\n")
    print(head)
    print(rule)
    for name in steps:
        print(
            row(name, median_of(this, "steps", name), total, median_of(that, "steps", name) if both else None)
        )
    cpu = median_of(this, "cpu")
    print(
        f"\nCPU time of the main thread to the launch: {cpu:.1f} ms"
        + (
            f" ({label}: {median_of(that, 'cpu'):.1f} ms, ratio {cpu / median_of(that, 'cpu'):.2f})"
            if both
            else ""
        )
    )
    print(f"\n### Imports before the launch, by group (self time, `-X importtime`; median of {len(this)})\n")
    names = sorted(
        {g for t in this + that for g in t.groups}, key=lambda g: -median_of(this + that, "groups", g)
    )
    imports = sum(median_of(this, "groups", g) for g in names)
    print(head.replace("| step |", "| group |"))
    print(rule)
    for name in names:
        print(
            row(
                name,
                median_of(this, "groups", name),
                imports,
                median_of(that, "groups", name) if both else None,
            )
        )
    print(
        row(
            "all imports before the launch",
            imports,
            imports,
            sum(median_of(that, "groups", g) for g in names) if both else None,
        )
    )
    extra = [
        ("modules loaded at the launch", "module_count", "{:.0f}"),
        ("dataclasses created before the launch", "dataclasses", "{:.0f}"),
        ("creating them (the decorator's work), ms", "dataclass_ms", "{:.1f}"),
        ("interpreter's own imports (in its start above), ms", "at_startup", "{:.1f}"),
    ]
    print("\n| count | this |" + (f" {label} |" if both else ""))
    print("|---|---:|" + ("---:|" if both else ""))
    for name, field, form in extra:
        print(
            f"| {name} | {form.format(median_of(this, field))} |"
            + (f" {form.format(median_of(that, field))} |" if both else "")
        )
    costly = Counter({m: median_of(this, "modules", m) for t in this for m in t.modules})
    print("\nThe costliest modules before the launch (self ms, median): " + ", ".join(
        f"{m} {ms:.1f}" for m, ms in costly.most_common(12)
    ))  # fmt: skip


def main() -> int:
    unmount_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument(
        "--size",
        type=parse_size,
        default=parse_size("256M"),
        help="entry size (default 256M): a hit's cost follows the file count",
    )
    parser.add_argument("--runs", type=int, default=15, help="paired runs (default 15)")
    parser.add_argument("--traces", type=int, default=9, help="traced runs for the breakdown (default 9)")
    parser.add_argument(
        "--against",
        type=Path,
        default=None,
        metavar="CHECKOUT",
        help="also start another checkout's cachemgr, in turn",
    )
    parser.add_argument(
        "--pod-fs",
        choices=["ext4", "here"],
        default="ext4",
        help="where each start's state dir lives (bench_warm.py)",
    )
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="5 paired runs, 3 traces")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.traces = 5, 3
    args.juicefs_runs = 0
    work = Path(tempfile.mkdtemp(prefix="bench-hitpath-", dir=args.dir))
    try:
        args.install = image_like(work)
        args.against_install = (
            image_like(work, source=args.against, name="against-venv") if args.against else None
        )
        with pod_filesystem(args.pod_fs, work) as (pods, pod_label):
            root = work / "volume"
            root.mkdir()
            key = bench_key(args.files, args.size)
            entry = build_entry(root, key, files=args.files, size=args.size)
            os.sync()  # a pod on a hit meets an entry published long before, not one being written back
            result = measure(
                "local", key, entry, root, args=args, work=pods / "paired", cold=False, size=args.size
            )
            env = {**os.environ, **BASE_ENV, "CACHEMGR_CACHE_ROOT": str(root)}
            cmd = cachemgr_argv(key, args.files, args.size, head=[])
            this: list[Trace] = []
            that: list[Trace] = []
            for i in range(args.traces):
                turn = [("this", args.install, this)]
                if args.against_install is not None:
                    turn.append(("that", args.against_install, that))
                for which, install, into in turn if i % 2 == 0 else turn[::-1]:
                    traced = trace_once(cmd, env, pods / f"trace-{i}-{which}", install=install)
                    into.append(traced)
            check_hit(start_once([args.install.script, *cmd], env, pods / "last"), key)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_figure(result, args, pod_label)
    print_breakdown(this, that, str(args.against) if args.against else "")
    return 0


def print_figure(result: Result, args: argparse.Namespace, pod_label: str) -> None:
    """The paired runs: what cachemgr adds to the server's start (and the other checkout's)."""
    load = os.getloadavg()
    print(
        f"\n### The hit path: {args.files} files, {args.runs} paired runs, {args.install.label}, "
        f"state dir on {pod_label}; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n"
    )
    added = result.added
    med = statistics.median(added)
    verdict = f"< {TARGET_MS:.0f} ms: " + (
        "met" if med < TARGET_MS else f"missed by {med - TARGET_MS:.0f} ms"
    )
    print(
        "| cachemgr | server directly (median) | cachemgr run (median) | added (median / p95) | main-thread CPU to the launch (median) | target |"
    )
    print("|---|---:|---:|---:|---:|---|")
    print(
        f"| this | {statistics.median(result.direct):.1f} ms | {statistics.median(result.managed):.1f} ms "
        f"| **{med:.1f}** / {pct(added, 0.95):.1f} ms | {statistics.median(result.managed_cpu):.1f} ms | {verdict} |"
    )
    if result.against:
        theirs = [a - d for a, d in zip(result.against, result.direct, strict=True)]
        print(
            f"| {args.against} | {statistics.median(result.direct):.1f} ms | {statistics.median(result.against):.1f} ms "
            f"| **{statistics.median(theirs):.1f}** / {pct(theirs, 0.95):.1f} ms | {statistics.median(result.against_cpu):.1f} ms | |"
        )
        diff = [m - a for m, a in zip(result.managed, result.against, strict=True)]
        cpu = [m - a for m, a in zip(result.managed_cpu, result.against_cpu, strict=True)]
        print(
            f"\nThis minus that, paired: wall clock **{statistics.median(diff):+.1f} ms** (p95 {pct(diff, 0.95):+.1f}), "
            f"added ratio {med / statistics.median(theirs):.2f}; main-thread CPU **{statistics.median(cpu):+.1f} ms** "
            f"(p95 {pct(cpu, 0.95):+.1f}), ratio {statistics.median(result.managed_cpu) / statistics.median(result.against_cpu):.2f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
