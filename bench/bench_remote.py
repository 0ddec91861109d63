"""The remote tier: cachemgr's transfers against boto3 copying the same objects, and a remote hit vs a compile.

A real S3 server (SeaweedFS ``weed mini`` on loopback, tests/s3server.py) and a real entry: the
stand-in compiler's output of ``--files`` files and ``--size`` bytes, compiled and uploaded by
``cachemgr warm --remote`` (the CI path). Then, ``--runs`` times each, in turn so noise hits both:

* upload: ``Remote.upload`` of the published entry (every file under a fresh upload id, then
  the manifest) against boto3's transfer manager uploading the same files, same concurrency,
  nothing else;
* download: ``Remote.download`` into staging on a fresh volume (manifest, every file, an xxh3-128
  check of every file) against boto3 downloading the same objects into a directory; then the
  publish (fsync of every file and one rename, the same step as after a compile), timed apart;
* a remote hit: ``cachemgr warm --remote`` on a fresh volume (a new cluster's first pod)
  against the same command compiling with the stand-in compiler (``--compile-seconds``; a real
  compile takes about 11 minutes).

    .venv/bin/python bench/bench_remote.py                      # 2,000 files, 1 GiB, 3 runs
    .venv/bin/python bench/bench_remote.py --size 4G --runs 5   # the issue's "several GiB"
    .venv/bin/python bench/bench_remote.py --quick              # 200 files, 64 MiB, 1 run

Target: cachemgr moves at least 90% of boto3's throughput both ways. Exits non-zero only on errors.
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
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from s3server import BUCKET, S3Server, s3_server  # noqa: E402

from cachemgr.core.units import human_bytes, parse_size  # noqa: E402
from cachemgr.remote.config import remote_config  # noqa: E402
from cachemgr.remote.ops import key_of, list_remote  # noqa: E402
from cachemgr.remote.transfer import _CHUNK, _WORKERS, Remote  # noqa: E402
from cachemgr.volume.identity import PodIdentity  # noqa: E402
from cachemgr.volume.layout import open_root  # noqa: E402
from cachemgr.volume.manifest import read_manifest  # noqa: E402
from cachemgr.volume.store import commit, create_staging  # noqa: E402

STANDIN = f"{sys.executable} -m cachemgr_standin.compiler"


def main() -> int:
    args = _parse()
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp, s3_server(Path(tmp) / "s3") as s3:
        work = Path(tmp)
        env = _env(s3, work)
        os.environ.update(s3.env(prefix="bench"))  # the in-process client finds the store as a pod does
        compile_s, entry = _compile_and_upload(work, env, args)
        manifest = read_manifest(entry)
        print(
            f"\nentry: {len(manifest.files)} files, {human_bytes(manifest.total_bytes)}; "
            f"S3: SeaweedFS weed mini on loopback; {_WORKERS} transfer threads, {_CHUNK >> 20} MiB parts\n"
        )
        rows = _throughput(work, env, entry, runs=args.runs)
        hit_s = _remote_hits(work, env, args, runs=args.runs)
        _print(rows, manifest.total_bytes, compile_s=compile_s, hit_s=hit_s, seconds=args.compile_seconds)
    return 0


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--size", default="1G", help="entry size, e.g. 512M, 4G")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--compile-seconds", type=float, default=10.0, help="the stand-in compile's time")
    parser.add_argument("--quick", action="store_true", help="200 files, 64 MiB, 1 run")
    args = parser.parse_args()
    if args.quick:
        args.files, args.size, args.runs = 200, "64M", 1
    args.bytes = parse_size(args.size)
    return args


def _env(s3: S3Server, work: Path) -> dict[str, str]:
    return {
        **os.environ,
        **s3.env(prefix="bench"),
        "CACHEMGR_COMPILER_VERSION": "0.12.0",
        "CACHEMGR_NPU_TYPE": "RBLN-CA25",
        "CACHEMGR_ROLE": "prefill",
        "CACHEMGR_LOG_FORMAT": "json",
        "CACHEMGR_STATE_DIR": str(work / "state"),
        "CACHEMGR_REMOTE_BUDGET": "1h",
    }


def _warm(env: dict[str, str], root: Path, args: argparse.Namespace, *, remote: bool) -> float:
    root.mkdir(parents=True)
    cmd = (
        f"{STANDIN} --output-dir {{output_dir}} --model bench/Model --files {args.files} "
        f"--bytes {args.bytes} --seconds {args.compile_seconds}"
    )
    run_env = {**env, "CACHEMGR_CACHE_ROOT": str(root)}
    if not remote:
        run_env.pop("CACHEMGR_REMOTE")
    argv = [sys.executable, "-m", "cachemgr", "warm", "--strategy", "command", "--compile-cmd", cmd]
    started = time.monotonic()
    result = subprocess.run(
        [*argv, "--", "vllm", "serve", "{artifact_dir}"],
        env=run_env,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"cachemgr warm failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return time.monotonic() - started


def _compile_and_upload(work: Path, env: dict[str, str], args: argparse.Namespace) -> tuple[float, Path]:
    root = work / "ci"
    seconds = _warm(env, root, args, remote=True)  # compiles, then waits for its upload (a warm Job)
    (entry,) = (root / "entries").iterdir()
    return seconds, entry


def _boto3_upload(remote: Remote, entry: Path, prefix: str) -> None:
    manager = remote._manager()
    try:
        futures = [
            manager.upload(str(entry / r.path), BUCKET, prefix + r.path) for r in read_manifest(entry).files
        ]
        for future in futures:
            future.result()
    finally:
        manager.shutdown()


def _boto3_download(remote: Remote, keys: list[str], prefix: str, into: Path) -> None:
    manager = remote._manager()
    try:
        futures = []
        for key in keys:
            target = into / key[len(prefix) :]
            target.parent.mkdir(parents=True, exist_ok=True)
            futures.append(manager.download(BUCKET, key, str(target)))
        for future in futures:
            future.result()
    finally:
        manager.shutdown()


def _timed(func: Callable[[], Any]) -> float:
    started = time.monotonic()
    func()
    return time.monotonic() - started


def _throughput(work: Path, env: dict[str, str], entry: Path, *, runs: int) -> dict[str, list[float]]:
    config = remote_config(None, env)
    assert config is not None
    remote = Remote(config)
    identity = PodIdentity.current(env)
    (listed,) = list_remote(remote).entries
    key = key_of(listed)
    copy_prefix = f"bench-copy/{listed.upload_id}/"
    rows: dict[str, list[float]] = {
        "upload cachemgr": [],
        "upload boto3": [],
        "download cachemgr": [],
        "download boto3": [],
        "publish": [],
    }
    for run in range(runs):
        rows["upload boto3"].append(_timed(lambda: _boto3_upload(remote, entry, copy_prefix)))
        rows["upload cachemgr"].append(
            _timed(lambda: remote.upload(entry, uploaded_by=identity.to_json(), force=True))
        )
        objects = f"{config.entry_prefix(entry.name)}objects/{list_remote(remote).entries[0].upload_id}/"
        keys = [objects + r.path for r in read_manifest(entry).files]
        into = work / f"plain-{run}"
        rows["download boto3"].append(_timed(partial(_boto3_download, remote, keys, objects, into)))
        root = open_root(_fresh(work / f"pulled-{run}"), create=True)
        staging = create_staging(root, key, identity)
        started = time.monotonic()
        fetched = remote.download(key, staging.path)
        rows["download cachemgr"].append(time.monotonic() - started)
        assert fetched is not None
        rows["publish"].append(_timed(partial(commit, root, staging, key, fetched[0])))
        shutil.rmtree(into)
        _rmtree(root.path)
    return rows


def _remote_hits(
    work: Path, env: dict[str, str], args: argparse.Namespace, *, runs: int
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"compile": [], "remote hit": []}
    for run in range(runs):
        times["remote hit"].append(_warm(env, work / f"hit-{run}", args, remote=True))
        times["compile"].append(_warm(env, work / f"compile-{run}", args, remote=False))
        _rmtree(work / f"hit-{run}")
        _rmtree(work / f"compile-{run}")
    return times


def _fresh(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def _rmtree(path: Path) -> None:
    # Published entries are read-only: make them writable again to remove them.
    subprocess.run(["chmod", "-R", "u+w", str(path)], check=False)
    shutil.rmtree(path, ignore_errors=True)


def _print(
    rows: dict[str, list[float]],
    nbytes: int,
    *,
    compile_s: float,
    hit_s: dict[str, list[float]],
    seconds: float,
) -> None:
    print("| transfer | median s | MiB/s | vs boto3 | target >= 90% |")
    print("|---|---:|---:|---:|---|")
    for way in ("upload", "download"):
        ours, theirs = statistics.median(rows[f"{way} cachemgr"]), statistics.median(rows[f"{way} boto3"])
        for who, value in (("boto3 (same objects, no manifest, no check)", theirs), ("cachemgr", ours)):
            ratio = theirs / ours if who == "cachemgr" else 1.0
            met = ("met" if ratio >= 0.9 else f"missed by {0.9 - ratio:.0%}") if who == "cachemgr" else ""
            print(f"| {way}: {who} | {value:.2f} | {nbytes / (1 << 20) / value:.0f} | {ratio:.0%} | {met} |")
    publish = statistics.median(rows["publish"])
    print(
        f"| then publish the download: fsync every file, rename (as a compile's publish) | {publish:.2f} | | | |"
    )
    hit, comp = statistics.median(hit_s["remote hit"]), statistics.median(hit_s["compile"])
    print("\n| `cachemgr warm` on a fresh volume | median s |")
    print("|---|---:|")
    print(f"| remote hit (download, check every file, publish) | {hit:.2f} |")
    print(f"| stand-in compile ({seconds:g} s of compiling; a real one takes ~11 min) | {comp:.2f} |")
    print(f"| first compile + upload (warm waits for its upload) | {compile_s:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
