"""The one bounded reader (cachemgr.core.jsonread) against a bare ``json.loads``, on manifests.

1. Legit manifests of 2,000 files (a hit of bench_warm.py's layout), 20,000, 100,000 and as many
   as fit in the 64 MiB cap (signed: each file record carries a BLAKE3): ``json.loads`` alone,
   the reader's ``parse`` (its depth and count measure, then ``json.loads`` with the number
   hooks), the measure alone, and ``parse_manifest`` (the reader and the manifest's checks, what
   a pod runs on a hit). Target: ``parse`` within 2x ``json.loads``, every size.
2. What a writer of the volume can plant at the cap: nested 200,000 deep, 32 M levels, 64 MiB of
   empty arrays, of blocks 127 deep (a bare ``json.loads`` meets the recursion limit on the deep
   ones, or builds a list of 22 million lists), and a valid string of 30 M escaped quotes (the
   reader's escape pass at its worst). The time the reader takes to refuse (or read) each.
   Target: under 1 s each.

    .venv/bin/python bench/bench_reader.py            # 5 runs, the median
    .venv/bin/python bench/bench_reader.py --quick    # 1 run, no 64 MiB manifest

Exits non-zero only on errors, not on a missed target.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachemgr.core import jsonread
from cachemgr.volume.manifest import parse_manifest

PARSE_TARGET = 2.0
REFUSE_TARGET_S = 1.0
_PATH = Path("manifest.json")


def manifest(files: int, *, seed: int = 7) -> bytes:
    """A signed entry's manifest of ``files`` files, as cachemgr writes it (indented, sorted)."""
    rng = random.Random(seed)
    records = [
        {
            "path": f"artifacts/compiled_models/rank{i % 8}/submodule_{i // 8}/graph_{i}.rbln",
            "size": rng.randrange(1 << 31),
            "xxh3": f"{rng.getrandbits(128):032x}",
            "mtime_ns": 1_760_000_000_000_000_000 + i,
            "blake3": f"{rng.getrandbits(256):064x}",
        }
        for i in range(files)
    ]
    doc = {
        "key": f"{rng.getrandbits(128):032x}",
        "inputs": {"serving": {"compilation_config": {"level": 3, "cudagraph_capture_sizes": [1, 2, 4]}}},
        "files": records,
        "created_at": 1_760_000_000.5,
        "created_by": {"pod": "builder-0", "cachemgr": "0.1"},
        "compile_seconds": 660.0,
        "strategy": "vllm",
        "model_name": "MiniMax-M2.7",
        "format": 1,
        "extra": {},
    }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def at_cap() -> bytes:
    """As many files as fit under the 64 MiB cap."""
    per_file = len(manifest(1000)) / 1000
    return manifest(int(jsonread.JSON_LIMIT / per_file * 0.98))


def median_seconds(func: Callable[[], Any], runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        func()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def read(data: bytes) -> Callable[[], None]:
    def run() -> None:
        with contextlib.suppress(ValueError):
            jsonread.parse(data)

    return run


def legit_table(runs: int, *, quick: bool) -> list[str]:
    sizes: list[tuple[str, bytes]] = [(f"{n:,} files", manifest(n)) for n in (2_000, 20_000, 100_000)]
    if not quick:
        sizes.append(("at the 64 MiB cap", at_cap()))
    lines = [
        "| manifest | size | json.loads | jsonread.parse | ratio | the measure alone | parse_manifest | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, data in sizes:
        bare = median_seconds(lambda data=data: json.loads(data), runs)
        ours = median_seconds(lambda data=data: jsonread.parse(data), runs)
        shape = median_seconds(lambda data=data: jsonread._shape(data), runs)  # its cost alone
        whole = median_seconds(lambda data=data: parse_manifest(data, path=_PATH), runs)
        ratio = ours / bare
        met = "met" if ratio <= PARSE_TARGET else f"missed by {ratio / PARSE_TARGET:.2f}x"
        lines.append(
            f"| {name} | {len(data) / (1 << 20):.1f} MiB | {bare * 1e3:.1f} ms | {ours * 1e3:.1f} ms | "
            f"{ratio:.2f}x | {shape * 1e3:.1f} ms | {whole * 1e3:.1f} ms | {met} |"
        )
    return lines


def hostile_table(runs: int) -> list[str]:
    cap = jsonread.JSON_LIMIT
    docs = [
        ("'[' * 200,000 + ']' * 200,000", b"[" * 200_000 + b"]" * 200_000),
        ("32 M levels of '['", b"[" * (cap // 2) + b"]" * (cap // 2)),
        ("64 MiB of '[]'", b"[" + b"[]," * (cap // 3 - 1) + b"[]]"),
        ("blocks 127 deep, 64 MiB", (b"[" * 127 + b"]" * 127) * (cap // 254)),
        # Valid JSON, accepted: the reader's escape pass at its worst (every escape a quote).
        ("a string of 30 M escaped quotes", b'["' + b'\\"' * (30 << 20) + b'"]'),
    ]
    lines = ["| planted document | size | read in | outcome | target |", "|---|---|---|---|---|"]
    for name, data in docs:
        try:
            jsonread.parse(data)
            why = "accepted (valid, within the bounds)"
        except ValueError as error:
            why = f"refused: {error}"
        took = median_seconds(read(data), runs)
        met = "met" if took <= REFUSE_TARGET_S else f"missed by {took / REFUSE_TARGET_S:.2f}x"
        lines.append(f"| {name} | {len(data) / (1 << 20):.1f} MiB | {took * 1e3:.0f} ms | {why} | {met} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    print(f"## Legit manifests (median of {runs})\n")
    print("\n".join(legit_table(runs, quick=args.quick)))
    print(f"\n## Planted documents (median of {runs})\n")
    print("\n".join(hostile_table(runs)))


if __name__ == "__main__":
    main()
