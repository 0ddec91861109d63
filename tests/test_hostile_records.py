"""A record nested 200,000 deep, on the volume or in the bucket, is damage, never a crash (issue 33).

``'[' * 200000 + ']' * 200000`` is 400 KB, under every size cap, and drove ``json.loads`` into
Python's recursion limit wherever a reader parsed it without the bound: as an entry's
``manifest.json`` every pod hitting the key, the signing builder, ``show`` and ``verify --fix``
exited 70 ("a cachemgr bug") and nothing set it aside; as an entry's ``summary.json`` every miss
on the volume (the space check scans every entry), ``ls``, ``du``, ``stats`` and ``show`` did;
as a manifest in the bucket, ``ls --remote``, ``prune --remote`` and ``pull`` failed and the
bucket could not be cleaned with cachemgr. Now every record is read by ``cachemgr.core.jsonread``.

Real entries compiled by real pods, the records rewritten as a writer of the volume (or the
bucket) would, real pods and the real CLI; the bucket is a real S3 server (``weed mini``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from cachemgr_testkit.podlib import Cluster, free_port, run_cli, wait_for
from cachemgr_testkit.s3server import BUCKET, S3Server
from cachemgr_testkit.scenarios import compile_cmd, compiles, entry_dirs, server_argv
from cachemgr_testkit.trusted import new_key, writable

from cachemgr.volume.records import OBSERVE_SECONDS

DEEP = b"[" * 200_000 + b"]" * 200_000


def _plant(path: Path, data: bytes) -> None:
    """What a writer of the volume does to a published (0444/0555) record: chmod, write."""
    writable(path.parent)
    path.write_bytes(data)


def _options(record: Path, *, files: int = 6) -> list[str]:
    extra = "" if files == 6 else f"--files {files}"  # another compile command: another key
    return ["--strategy", "command", "--compile-cmd", compile_cmd(record, extra=extra)]


def _cli(pods: Cluster, root: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    done = run_cli(*args, env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root), **(env or {})})
    assert done.returncode != 70, f"{args} exited 70:\n{done.stderr[-1500:]}"
    assert "Traceback" not in done.stderr, f"{args}:\n{done.stderr[-1500:]}"
    return done


def _serve_and_stop(pods: Cluster, name: str, root: Path, options: list[str], **env: str) -> None:
    pod = pods.start(name, server_argv(free_port()), cache_root=root, options=options, env=env)
    pod.wait_phase("serving")
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0


def _warm(pods: Cluster, name: str, root: Path, options: list[str], key_file: Path) -> None:
    job = pods.start(
        name, server_argv(free_port()), cache_root=root, command="warm", options=options,
        env={"CACHEMGR_SIGNING_KEY_FILE": str(key_file)},
    )  # fmt: skip
    assert job.wait_exit() == 0, job.tail()


def _quarantined(root: Path) -> list[Path]:
    folder = root / "quarantine"
    return sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


def test_a_deep_manifest_is_a_damaged_entry_for_pods_the_builder_and_the_cli(
    pods: Cluster, root: Path, tmp_path: Path
) -> None:
    secret, key_file = new_key(tmp_path / "keys", "builder-1")
    record = pods.work / "compiler.jsonl"
    options = _options(record)
    trusting = {"CACHEMGR_TRUSTED_KEYS": str(secret.public)}
    _warm(pods, "builder", root, options, key_file)
    (entry,) = entry_dirs(root)
    key = json.loads((entry / "summary.json").read_text())["key"]

    _plant(entry / "manifest.json", DEEP)
    shown = _cli(pods, root, "show", key[:12])
    assert "manifest.json" in shown.stdout + shown.stderr
    checked = _cli(pods, root, "verify")
    assert checked.returncode == 74, "damage found"
    assert entry.name in checked.stderr
    # A trusting pod without the key (it may not publish) is told it has nothing to serve.
    fail = [*options, "--on-miss", "fail"]
    waiter = pods.start("reader", server_argv(free_port()), cache_root=root, options=fail, env=trusting)
    assert waiter.wait_exit() == 69, waiter.tail()
    # The signing builder sets it aside and compiles; so does an open pod, and a trusting signer.
    _warm(pods, "builder-again", root, options, key_file)
    assert compiles(record) == 2
    assert len(_quarantined(root)) == 1
    (entry,) = entry_dirs(root)
    _plant(entry / "manifest.json", DEEP)
    _serve_and_stop(pods, "open", root, options)
    assert compiles(record) == 3
    (entry,) = entry_dirs(root)
    _plant(entry / "manifest.json", DEEP)
    _serve_and_stop(pods, "signer", root, options, CACHEMGR_SIGNING_KEY_FILE=str(key_file), **trusting)
    assert compiles(record) == 4
    # And `verify --fix` moves it aside, naming what is wrong.
    (entry,) = entry_dirs(root)
    _plant(entry / "manifest.json", DEEP)
    fixed = _cli(pods, root, "verify", "--fix")
    assert fixed.returncode == 74
    assert "moved 1 to quarantine" in fixed.stderr
    assert entry_dirs(root) == []
    assert len(_quarantined(root)) == 4


def test_a_deep_summary_leaves_every_miss_and_every_inspection_working(
    pods: Cluster, root: Path, tmp_path: Path
) -> None:
    _secret, key_file = new_key(tmp_path / "keys", "builder-1")
    record = pods.work / "compiler.jsonl"
    _serve_and_stop(pods, "first", root, _options(record))
    (entry,) = entry_dirs(root)
    key = json.loads((entry / "summary.json").read_text())["key"]
    _plant(entry / "summary.json", DEEP)

    # A miss of another key checks the space against every entry's summary; so does the builder.
    _serve_and_stop(pods, "other", root, _options(record, files=5))
    _warm(pods, "builder", root, _options(record, files=4), key_file)
    assert compiles(record) == 3
    for command in (("ls",), ("du",), ("stats",), ("show", key[:12]), ("ls", "-o", "json")):
        done = _cli(pods, root, *command)
        assert done.returncode == 0, f"{command}: {done.stderr[-800:]}"
    listed = _cli(pods, root, "ls", "-o", "json").stdout
    (row,) = [r for r in json.loads(listed)["items"] if r.get("entry") == entry.name]
    assert row["status"] == "damaged"
    assert "summary.json" in row["problem"]
    assert "nested deeper than" in row["problem"]
    assert "summary.json" in _cli(pods, root, "show", key[:12]).stdout


# --- the bucket --------------------------------------------------------------------------------


def _remote_env(s3: S3Server, tmp_path: Path) -> dict[str, str]:
    return s3.env(prefix=f"t/deep-{tmp_path.name[-24:]}")


def _put(s3: S3Server, env: dict[str, str], key: str, body: bytes) -> None:
    prefix = env["CACHEMGR_REMOTE"].removeprefix(f"s3://{BUCKET}/")
    client: Any = s3.client()
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=body)


def _names(s3: S3Server, env: dict[str, str]) -> list[str]:
    prefix = env["CACHEMGR_REMOTE"].removeprefix(f"s3://{BUCKET}/") + "/"
    client: Any = s3.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(item["Key"].removeprefix(prefix) for page in pages for item in page.get("Contents", []))


def test_a_deep_manifest_in_the_bucket_is_reported_skipped_and_removable(
    pods: Cluster, tmp_path: Path, s3: S3Server
) -> None:
    remote = _remote_env(s3, tmp_path)
    root_a, root_b = tmp_path / "cluster-a", tmp_path / "cluster-b"
    root_a.mkdir()
    root_b.mkdir()
    record = pods.work / "compiler.jsonl"
    # A good entry uploaded by a pod, and beside it a planted one (an entry's name, a deep manifest).
    pod = pods.start("a0", server_argv(free_port()), cache_root=root_a, options=_options(record), env=remote)
    pod.wait_phase("serving")
    wait_for(lambda: [e for e in pod.log_events() if e.get("event") == "remote_uploaded"], what="the upload")
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0
    (good,) = entry_dirs(root_a)
    assert f"entries/{good.name}/manifest.json" in _names(s3, remote)
    pods_env = {**remote, "CACHEMGR_CACHE_ROOT": str(root_b)}
    planted = good.name[:-16] + "0123456789abcdef"
    _put(s3, remote, f"entries/{planted}/manifest.json", DEEP)

    listed = _cli(pods, root_b, "ls", "--remote", env=pods_env)
    assert listed.returncode == 0, listed.stderr
    assert planted in listed.stderr
    assert "nested deeper than" in listed.stderr
    rows = json.loads(_cli(pods, root_b, "ls", "--remote", "-o", "json", env=pods_env).stdout)["items"]
    assert [r["entry"] for r in rows if r["kind"] == "remote-entry"] == [good.name]
    pulled = _cli(pods, root_b, "pull", good.name, env=pods_env)
    assert pulled.returncode == 0, pulled.stderr
    assert entry_dirs(root_b)[0].name == good.name
    # The good copy of the same key in the bucket, its manifest made deep: a pod compiles.
    _put(s3, remote, f"entries/{good.name}/manifest.json", DEEP)
    fresh = tmp_path / "cluster-c"
    fresh.mkdir()
    _serve_and_stop(pods, "c0", fresh, _options(record), **remote)
    assert compiles(record) == 2
    # And cachemgr cleans the bucket: a dry run names both, the prune removes them.
    dry = _cli(pods, root_b, "prune", "--remote", "--key", planted, "--dry-run", "-o", "json", env=pods_env)
    assert dry.returncode == 0, dry.stderr
    assert [item["entry"] for item in json.loads(dry.stdout)["plan"]] == [planted]
    removed = _cli(pods, root_b, "prune", "--remote", "--key", planted, "--yes", env=pods_env)
    assert removed.returncode == 0, removed.stderr
    assert not any(name.startswith(f"entries/{planted}/") for name in _names(s3, remote))


def test_a_summary_naming_another_full_key_never_hides_a_serving_pod_from_prune(
    pods: Cluster, root: Path
) -> None:
    """Pods record their use under the full key; an entry's name carries its first 16 digits. A
    summary.json rewritten to name a key with the same 16 digits and another tail showed the
    entry unused, and prune removed it under the serving pod."""
    options = _options(pods.work / "compiler.jsonl")
    pod = pods.start("serving", server_argv(free_port()), cache_root=root, options=options)
    pod.wait_phase("serving")
    (entry,) = entry_dirs(root)
    summary = json.loads((entry / "summary.json").read_text())
    key = summary["key"]
    forged = key[:16] + ("0" if key[16] != "0" else "1") + key[17:]
    _plant(entry / "summary.json", json.dumps({**summary, "key": forged}).encode())

    listed = _cli(pods, root, "ls", "-o", "json")
    (row,) = json.loads(listed.stdout)["items"]
    assert row["users"], row
    for selector in (["--key", key[:16]], ["--keep-bytes", "0"], ["--damaged"], ["--unused-for", "0s"]):
        done = _cli(pods, root, "prune", *selector, "--yes")
        assert done.returncode in {0, 1}, done.stderr
        assert entry.is_dir(), f"prune {selector} removed the entry a pod serves from"
    assert pod.phase == "serving"
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0


def test_a_warm_job_whose_publish_lost_to_a_planted_entry_checks_that_entry(
    pods: Cluster, root: Path, tmp_path: Path
) -> None:
    """A warm Job whose publish found an entry already there (a peer's, or one planted during its
    compile) keeps that one; it must then look it up as any other, not report its own publish."""
    record, saved, name_file, done = (tmp_path / n for n in ("compiler.jsonl", "saved", "name", "planted"))
    plant = tmp_path / "plant.sh"
    plant.write_text(
        "#!/bin/sh\n"
        f"if [ -d {saved} ] && [ ! -e {done} ]; then\n"
        f"  touch {done}; cp -a {saved} {root}/entries/$(cat {name_file})\n"
        "fi\n"
        'exec "$@"\n'
    )
    plant.chmod(0o755)
    options = ["--strategy", "command", "--compile-cmd", f"{plant} {compile_cmd(record)}"]
    job = pods.start("first", server_argv(free_port()), cache_root=root, command="warm", options=options)
    assert job.wait_exit() == 0, job.tail()
    (entry,) = entry_dirs(root)
    shutil.copytree(entry, saved, symlinks=True)
    writable(saved)
    artifact = max(
        (p for p in (saved / "artifacts").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    data = bytearray(artifact.read_bytes())
    data[0] ^= 0xFF  # the same size, other bytes: only a content check tells
    artifact.write_bytes(bytes(data))
    name_file.write_text(entry.name)
    writable(entry)
    shutil.rmtree(entry)

    job = pods.start("second", server_argv(free_port()), cache_root=root, command="warm", options=options)
    assert job.wait_exit() == 0, job.tail()
    assert done.exists(), "the planted entry was put in place during the compile"
    checked = _cli(pods, root, "verify")
    assert checked.returncode == 0, f"the warm Job left a damaged entry published:\n{checked.stderr}"
    assert compiles(record) == 3, "the damaged entry was set aside and the key compiled again"


def test_folders_planted_under_an_entrys_digits_cost_prune_one_watch_at_most(
    pods: Cluster, root: Path
) -> None:
    """Prune looks for users under every key with an entry's 16 digits. Folders planted there with
    old records are watched once, together (one OBSERVE_SECONDS window), and names that are no
    key's are not a pod's: not watched at all. Each planted folder cost two windows before."""
    options = _options(pods.work / "compiler.jsonl")
    job = pods.start("warm", server_argv(free_port()), cache_root=root, command="warm", options=options)
    assert job.wait_exit() == 0, job.tail()
    (entry,) = entry_dirs(root)
    digits = entry.name.rsplit("__", 1)[-1]
    old = time.time() - 3600
    for tail in ("0" * 16, "1" * 16, "2" * 16, "zz1", "zz2"):
        folder = root / "usage" / (digits + tail)
        folder.mkdir(parents=True)
        (folder / "ghost.json").write_text("{}")
        os.utime(folder / "ghost.json", (old, old))
    started = time.monotonic()
    done = _cli(pods, root, "prune", "--key", digits, "--yes")
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert entry_dirs(root) == []
    assert took < 2 * OBSERVE_SECONDS, f"prune took {took:.1f}s: a watch per planted folder"


def test_prune_that_cannot_remove_an_item_says_what_to_fix(pods: Cluster, root: Path) -> None:
    """A file planted where a key's usage folder would be (with the entry's 16 digits) is refused,
    never read through; prune removes what it can and its one error line names the item and why,
    not only "mount it read-write"."""
    options = _options(pods.work / "compiler.jsonl")
    job = pods.start("warm", server_argv(free_port()), cache_root=root, command="warm", options=options)
    assert job.wait_exit() == 0, job.tail()
    (entry,) = entry_dirs(root)
    digits = entry.name.rsplit("__", 1)[-1]
    (root / "usage" / (digits + "0" * 16)).write_text("{}")
    done = _cli(pods, root, "prune", "--key", digits, "--yes")
    assert done.returncode == 74, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "could not remove" in line]
    assert entry.name in line
    assert "regular file" in line
    assert "fix what it names" in line.lower()
    assert entry.is_dir(), "nothing is removed on a guess"


def test_an_attempt_whose_owner_record_name_no_volume_can_hold_is_stale_not_an_error(
    pods: Cluster, root: Path
) -> None:
    """An attempt folder under staging/<digest>/ named 251 characters or more (the fuzzer's
    imitation of an attempt's grammar): its owner record's name, ``<attempt>.json``, is past
    NAME_MAX, so no such record exists. A pod of that key and prune call it a dead attempt and
    remove it; both failed on it with 'File name too long' (the pod exit 70, prune 74)."""
    options = _options(pods.work / "compiler.jsonl")
    job = pods.start("warm", server_argv(free_port()), cache_root=root, command="warm", options=options)
    assert job.wait_exit() == 0, job.tail()
    (entry,) = entry_dirs(root)
    digest = json.loads((entry / "key.json").read_text())["key"]
    _cli(pods, root, "prune", "--key", digest[:12], "--yes")  # a miss next: the attempt is in its way
    assert entry_dirs(root) == []
    old = time.time() - 3600
    planted = root / "staging" / digest / ("9" * 251 + ".-5")
    planted.mkdir(parents=True)
    (planted / "graph.rbln").write_bytes(b"x")
    os.utime(planted, (old, old))
    pod = pods.start("again", server_argv(free_port()), cache_root=root, options=options)
    pod.wait_phase("serving")
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0, pod.tail()
    assert not planted.exists(), "the dead attempt was left"
    planted.mkdir(parents=True)
    os.utime(planted, (old, old))
    done = _cli(pods, root, "prune", "--stale-staging", "--yes")
    assert done.returncode == 0, done.stderr
    assert not planted.exists()
