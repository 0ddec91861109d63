"""The remote tier against a real S3 server (SeaweedFS ``weed mini``, tests/s3server.py).

Two "clusters" are two cache roots sharing one bucket prefix; pods are real ``cachemgr run``
processes (podlib). Faults are real: objects overwritten in the bucket, an uploader killed
with SIGKILL, the server killed, credentials the server does not know.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash
from cachemgr_testkit.podlib import (
    Cluster,
    Pod,
    error_lines,
    free_port,
    metrics,
    run_cli,
    status_port,
    wait_for,
)
from cachemgr_testkit.s3server import BAD_KEYS, BUCKET, S3Server, require_s3, s3_server, s3fault
from cachemgr_testkit.scenarios import (
    assert_entries_valid,
    command_key,
    compile_cmd,
    compiles,
    entry_dirs,
    server_argv,
)

from cachemgr.core.safefs import UnsafePathError
from cachemgr.remote.client import RemoteDamageError
from cachemgr.remote.config import remote_config
from cachemgr.remote.hooks import Upload
from cachemgr.remote.localfiles import DIR_CACHE, HashedReader, LocalChangedError, LocalDir
from cachemgr.remote.ops import key_of, list_remote
from cachemgr.remote.transfer import Remote
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import open_root
from cachemgr.volume.manifest import read_manifest
from cachemgr.volume.store import create_staging, publish

IDENTITY = PodIdentity(pod="pod-a", node="node-a", host="host-a", pid=os.getpid())


@pytest.fixture
def remote(s3: S3Server, request: pytest.FixtureRequest) -> dict[str, str]:
    """The environment of pods using the shared server, under a prefix of this test's own."""
    tag = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]
    return s3.env(prefix=f"t/{request.node.name[:40]}-{tag}")


def _roots(tmp_path: Path, *names: str) -> list[Path]:
    roots = []
    for name in names:
        path = tmp_path / name
        path.mkdir()
        roots.append(path)
    return roots


def _options(record: Path, *, seconds: float = 1.0) -> list[str]:
    return ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=seconds)]


def _events(pods: list[Any], name: str) -> list[dict[str, Any]]:
    return [e for pod in pods for e in pod.log_events() if e.get("event") == name]


def _warnings(pods: list[Any]) -> list[dict[str, Any]]:
    return [e for pod in pods for e in pod.log_events() if e.get("level") == "warning"]


def _objects(s3: S3Server, env: dict[str, str]) -> dict[str, int]:
    prefix = env["CACHEMGR_REMOTE"].removeprefix(f"s3://{BUCKET}/") + "/"
    client: Any = s3.client()
    found: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for item in page.get("Contents", []):
            found[item["Key"].removeprefix(prefix)] = item["Size"]
    return found


def _remote_manifest(s3: S3Server, env: dict[str, str]) -> tuple[str, dict[str, Any]]:
    names = [k for k in _objects(s3, env) if k.endswith("/manifest.json")]
    assert len(names) == 1, names
    prefix = env["CACHEMGR_REMOTE"].removeprefix(f"s3://{BUCKET}/") + "/"
    client: Any = s3.client()
    body = client.get_object(Bucket=BUCKET, Key=prefix + names[0])["Body"].read()
    return prefix + names[0], json.loads(body)


def _start_download_attempt(pods: Cluster, root: Path, env: dict[str, str], record: Path) -> tuple[Pod, Path]:
    """A pod on ``root`` whose download (held by a stopped S3 server) has made its staging."""
    pod = pods.start("b0", server_argv(free_port()), cache_root=root, options=_options(record), env=env)

    def attempt() -> Path | None:
        found = list((root / "staging").glob("*/*/key.json"))
        return found[0].parent if found else None

    wait_for(attempt, what="the download's staging")
    staging = attempt()
    assert staging is not None
    return pod, staging


def _fill_remote(pods: Cluster, root: Path, env: dict[str, str], record: Path, name: str = "a0") -> None:
    """One pod compiles on ``root`` and uploads; returns once the remote has the manifest."""
    pod = pods.start(name, server_argv(free_port()), cache_root=root, options=_options(record), env=env)
    pod.wait_phase("serving")
    wait_for(lambda: _events([pod], "remote_uploaded"), what="the upload", timeout=60)
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0


# --- compile once per fleet ------------------------------------------------------------------


def test_two_clusters_eight_pods_compile_once_and_the_second_cluster_downloads(
    pods: Cluster, tmp_path: Path, remote: dict[str, str], s3: S3Server
) -> None:
    root_a, root_b = _roots(tmp_path, "cluster-a", "cluster-b")
    record = tmp_path / "compiler.jsonl"
    first = [
        pods.start(f"a{i}", server_argv(free_port()), cache_root=root_a, options=_options(record), env=remote)
        for i in range(4)
    ]
    for pod in first:
        pod.wait_phase("serving")
    wait_for(lambda: _events(first, "remote_uploaded"), what="the upload", timeout=60)
    assert compiles(record) == 1
    assert len(_events(first, "remote_miss")) == 1, "the lease holder looked in the remote first"

    second = [
        pods.start(f"b{i}", server_argv(free_port()), cache_root=root_b, options=_options(record), env=remote)
        for i in range(4)
    ]
    for pod in second:
        pod.wait_phase("serving")
    assert compiles(record) == 1, "the key compiled once in all eight pods"
    hits = _events(second, "remote_hit")
    assert len(hits) == 1, "one pod of the second cluster downloads; its peers wait and reuse"
    assert hits[0]["bytes"] > 0
    assert _warnings(first + second) == []
    assert_entries_valid(root_b)
    (entry,) = entry_dirs(root_b)
    summary = json.loads((entry / "summary.json").read_text())
    assert summary["origin"]["kind"] == "remote"
    assert summary["origin"]["remote"] == remote["CACHEMGR_REMOTE"]
    loads = [e for e in pods.record if e["event"] == "load"]
    assert len({e["digest"] for e in loads}) == 1, "all eight servers read the same bytes"


# --- the remote is never trusted more than the volume ---------------------------------------


def _tamper(s3: S3Server, env: dict[str, str], how: str, tmp_path: Path) -> None:
    client: Any = s3.client()
    key, doc = _remote_manifest(s3, env)
    base = key.rpartition("/")[0] + f"/objects/{doc['remote']['objects']}/"
    artifact = next(f for f in doc["files"] if f["path"].startswith("artifacts/") and f["size"] > 0)
    if how == "content":  # same size, other bytes: only the hash tells
        client.put_object(Bucket=BUCKET, Key=base + artifact["path"], Body=b"\0" * artifact["size"])
        return
    if how == "missing":
        client.delete_object(Bucket=BUCKET, Key=base + artifact["path"])
        return
    if how == "no-summary":  # the file ls and show read, left out of the manifest
        doc["files"] = [f for f in doc["files"] if f["path"] != "summary.json"]
    elif how == "summary-a-list":  # listed and hashed right, but not what cachemgr writes
        body = b"[]"
        client.put_object(Bucket=BUCKET, Key=base + "summary.json", Body=body)
        summary = next(f for f in doc["files"] if f["path"] == "summary.json")
        summary.update(size=len(body), xxh3=xxhash.xxh3_128_hexdigest(body))
    elif how == "other-key":
        doc["key"] = "0" * 32
    elif how == "other-inputs":
        doc["inputs"] = {**doc["inputs"], "role": "decode"}
    else:
        # A name that would write outside staging (or somewhere a publish never writes), with a
        # real object behind it so only the name is wrong.
        name = {
            "dotdot": "artifacts/../../../escape",
            "absolute": str(tmp_path / "escape"),
            "dot-part": "artifacts/./escape",
            "outside-artifacts": "escape",
            "empty-part": "artifacts//escape",
            # Paths no volume can create (a name past NAME_MAX, 1,000 levels), or no object key can
            # name (a lone surrogate is not UTF-8): damage all the same, replaced by the compiler.
            "long-name": "artifacts/" + "n" * 300,
            "deep-path": "artifacts/" + "d/" * 1000 + "escape",
            "surrogate": "artifacts/\udcff",
        }[how]
        with contextlib.suppress(Exception):  # SeaweedFS refuses some of these keys itself
            client.put_object(Bucket=BUCKET, Key=base + name.lstrip("/"), Body=b"x")
        # The right size and hash: only the name gives it away.
        doc["files"].append({"path": name, "size": 1, "xxh3": xxhash.xxh3_128_hexdigest(b"x")})
    client.put_object(Bucket=BUCKET, Key=key, Body=json.dumps(doc).encode())


@pytest.mark.parametrize(
    "how",
    [
        "content",
        "missing",
        "other-key",
        "other-inputs",
        "no-summary",
        "summary-a-list",
        "dotdot",
        "absolute",
        "dot-part",
        "outside-artifacts",
        "empty-part",
        "long-name",
        "deep-path",
        "surrogate",
    ],
)
def test_a_damaged_remote_entry_is_never_published_and_the_pod_compiles(
    pods: Cluster, tmp_path: Path, remote: dict[str, str], s3: S3Server, how: str
) -> None:
    root_a, root_b = _roots(tmp_path, "cluster-a", "cluster-b")
    record = tmp_path / "compiler.jsonl"
    _fill_remote(pods, root_a, remote, record)
    _tamper(s3, remote, how, tmp_path)
    if how in {"long-name", "deep-path", "surrogate"}:  # ls --remote calls it what a reader does
        listed = _cli("ls", "--remote", "-o", "json", env={**pods.base_env, **remote})
        assert not [e for e in json.loads(listed.stdout)["items"] if e["kind"] == "remote-entry"]
        assert "prune --remote --key" in listed.stderr, listed.stderr

    pod = pods.start("b0", server_argv(free_port()), cache_root=root_b, options=_options(record), env=remote)
    pod.wait_phase("serving")
    assert compiles(record) == 2, "the damaged remote entry was refused: a local compile"
    (warning,) = _warnings([pod])
    assert warning["event"] == "remote_unusable_compiling_locally"
    assert warning["problem"] == "damaged"
    assert _events([pod], "remote_hit") == []
    assert_entries_valid(root_b)
    (entry,) = entry_dirs(root_b)
    assert "origin" not in json.loads((entry / "summary.json").read_text()), "ours, compiled here"
    assert not list(tmp_path.rglob("escape")), "nothing written outside staging"
    assert not list((root_b / "staging").rglob("*")), "the download's staging is gone"
    if how not in {"content", "long-name", "deep-path", "surrogate"}:
        return
    # The pod replaces the damaged remote entry with its own: the next cluster downloads a good one.
    wait_for(lambda: _events([pod], "remote_uploaded"), what="the replacing upload", timeout=60)
    (root_c,) = _roots(tmp_path, "cluster-c")
    third = pods.start(
        "c0", server_argv(free_port()), cache_root=root_c, options=_options(record), env=remote
    )
    third.wait_phase("serving")
    assert compiles(record) == 2
    assert len(_events([third], "remote_hit")) == 1
    assert _warnings([third]) == []


# --- an unusable remote never stops a pod ---------------------------------------------------


@pytest.fixture
def own_s3(tmp_path: Path) -> Iterator[S3Server]:
    """A server of this test alone: it gets stopped, frozen or killed."""
    require_s3()
    with s3_server(tmp_path / "s3") as server:
        yield server


def _compiles_alone_with_one_warning(pods: Cluster, root: Path, env: dict[str, str], record: Path) -> Any:
    pod = pods.start("p0", server_argv(free_port()), cache_root=root, options=_options(record), env=env)
    pod.wait_phase("serving", timeout=90)
    assert compiles(record) == 1
    (warning,) = _warnings([pod])
    assert warning["event"] == "remote_unusable_compiling_locally", warning
    assert _events([pod], "remote_upload_failed") == [], "no upload to a remote known to be unusable"
    assert_entries_valid(root)
    return warning


def test_a_stopped_s3_server_costs_a_warning_and_a_local_compile(
    pods: Cluster, tmp_path: Path, own_s3: S3Server
) -> None:
    (root,) = _roots(tmp_path, "volume")
    env = {**own_s3.env(), "CACHEMGR_REMOTE_TIMEOUT": "2s"}
    own_s3.stop()
    warning = _compiles_alone_with_one_warning(pods, root, env, tmp_path / "compiler.jsonl")
    assert warning["problem"] == "unreachable"
    assert own_s3.endpoint in warning["message"]


def test_a_frozen_s3_server_costs_the_timeout_then_a_local_compile(
    pods: Cluster, tmp_path: Path, own_s3: S3Server
) -> None:
    (root,) = _roots(tmp_path, "volume")
    env = {**own_s3.env(), "CACHEMGR_REMOTE_TIMEOUT": "1s"}
    os.killpg(own_s3.proc.pid, signal.SIGSTOP)  # accepts connections (the kernel does), never answers
    try:
        warning = _compiles_alone_with_one_warning(pods, root, env, tmp_path / "compiler.jsonl")
    finally:
        os.killpg(own_s3.proc.pid, signal.SIGCONT)
    assert warning["problem"] == "timeout"
    assert "did not answer within 1s" in warning["message"]


def test_wrong_credentials_cost_a_warning_and_a_local_compile(
    pods: Cluster, tmp_path: Path, remote: dict[str, str]
) -> None:
    (root,) = _roots(tmp_path, "volume")
    warning = _compiles_alone_with_one_warning(
        pods, root, {**remote, **BAD_KEYS}, tmp_path / "compiler.jsonl"
    )
    assert warning["problem"] == "credentials"
    assert "refused the credentials" in warning["message"]


def test_a_killed_uploader_leaves_nothing_a_reader_takes(
    pods: Cluster, tmp_path: Path, own_s3: S3Server
) -> None:
    root_a, root_b = _roots(tmp_path, "cluster-a", "cluster-b")
    record = tmp_path / "compiler.jsonl"
    env = {**own_s3.env(), "CACHEMGR_REMOTE_TIMEOUT": "60s"}
    pod = pods.start("a0", server_argv(free_port()), cache_root=root_a, options=_options(record), env=env)
    wait_for(lambda: _events([pod], "remote_miss"), what="the lease holder to look in the remote")
    # Freeze the store while the pod compiles: its upload after the publish hangs mid-way...
    os.killpg(own_s3.proc.pid, signal.SIGSTOP)
    try:
        pod.wait_phase("serving")
        # ...and the pod dies with it (a node lost, OOM): SIGKILL, no shutdown wait.
        pod.signal_pod(signal.SIGKILL)
        pod.wait_exit()
    finally:
        os.killpg(own_s3.proc.pid, signal.SIGCONT)
    assert not [k for k in _objects(own_s3, env) if k.endswith("manifest.json")], "no manifest: not an entry"

    reader = pods.start("b0", server_argv(free_port()), cache_root=root_b, options=_options(record), env=env)
    reader.wait_phase("serving")
    assert compiles(record) == 2, "nothing to download: the reader compiles"
    assert len(_events([reader], "remote_miss")) == 1
    assert _warnings([reader]) == []
    assert_entries_valid(root_b)


# --- push, pull, ls --remote, prune --remote --------------------------------------------------


def _cli(*args: str, env: dict[str, str], code: int = 0) -> Any:
    result = run_cli(*args, env=env)
    assert result.returncode == code, f"{args} -> {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


def test_push_pull_ls_and_prune_remote_from_the_cli(
    pods: Cluster, tmp_path: Path, remote: dict[str, str]
) -> None:
    root_a, root_b = _roots(tmp_path, "cluster-a", "cluster-b")
    record = tmp_path / "compiler.jsonl"
    # A cluster without the remote compiles; an operator (or CI) pushes afterwards.
    pod = pods.start("a0", server_argv(free_port()), cache_root=root_a, options=_options(record))
    pod.wait_phase("serving")
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0
    env = {**pods.base_env, **remote}
    env_a, env_b = {**env, "CACHEMGR_CACHE_ROOT": str(root_a)}, {**env, "CACHEMGR_CACHE_ROOT": str(root_b)}
    assert "no entries in s3://" in _cli("ls", "--remote", env=env).stdout

    pushed = _cli("push", env=env_a).stdout
    assert "uploaded" in pushed, pushed
    assert "already in the remote" in _cli("push", env=env_a).stdout
    (listed,) = json.loads(_cli("ls", "--remote", "-o", "json", env=env).stdout)["items"]
    key = listed["key"]
    assert listed["files"] > 0
    assert listed["size_bytes"] == read_manifest(entry_dirs(root_a)[0]).total_bytes

    assert "downloaded" in _cli("pull", key[:10], env=env_b).stdout
    (entry,) = [
        e for e in json.loads(_cli("ls", "-o", "json", env=env_b).stdout)["items"] if e["kind"] == "entry"
    ]
    assert entry["origin"]["kind"] == "remote"
    wide = _cli("ls", "-o", "wide", env=env_b).stdout.splitlines()
    assert wide[0].split()[-2] == "ORIGIN"
    assert wide[1].split()[-2] == "remote", wide
    shown = " ".join(_cli("show", key[:10], env=env_b).stdout.split())  # a long value wraps
    assert f"from {remote['CACHEMGR_REMOTE']}" in shown
    assert_entries_valid(root_b)
    # The pulled entry is a hit for a pod of cluster B that knows nothing of the remote.
    hit = pods.start("b0", server_argv(free_port()), cache_root=root_b, options=_options(record))
    hit.wait_phase("serving")
    assert compiles(record) == 1

    _cli("prune", "--remote", "--key", key[:10], env=env, code=64)  # no TTY: asks for --yes
    assert "dry run" in _cli("prune", "--remote", "--key", key[:10], "--dry-run", env=env).stdout
    assert "removed 1 item" in _cli("prune", "--remote", "--key", key[:10], "--yes", env=env).stdout
    assert "no entries in s3://" in _cli("ls", "--remote", env=env).stdout
    missing = _cli("pull", key[:10], env=env_b, code=66)  # not found: its own code
    assert "the remote has no entry matching" in missing.stderr

    refused = _cli("push", "--force", env={**env_a, **BAD_KEYS}, code=74)
    assert "refused the credentials" in refused.stderr
    assert "Traceback" not in refused.stderr


def _two_pushed(
    pods: Cluster, tmp_path: Path, remote: dict[str, str]
) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """Two entries (prefill, decode) compiled on one volume and pushed one after the other: the
    CLI's environment and ``ls --remote``'s items, the older first."""
    (root,) = _roots(tmp_path, "volume")
    record = tmp_path / "compiler.jsonl"
    for role in ("prefill", "decode"):
        pod = pods.start(
            role,
            server_argv(free_port()),
            cache_root=root,
            options=_options(record),
            env={"CACHEMGR_ROLE": role},
        )
        pod.wait_phase("serving")
        pod.signal(signal.SIGTERM)
        assert pod.wait_exit() == 0
    env = {**pods.base_env, **remote, "CACHEMGR_CACHE_ROOT": str(root)}
    for entry in entry_dirs(root):  # one at a time: the upload order is the age order
        _cli("push", entry.name, env=env)
    listed = json.loads(_cli("ls", "--remote", "-o", "json", env=env).stdout)["items"]
    return env, sorted(listed, key=lambda e: e["uploaded_at"])


def test_prune_remote_keep_bytes_removes_the_oldest_uploads_first(
    pods: Cluster, tmp_path: Path, remote: dict[str, str]
) -> None:
    env, listed = _two_pushed(pods, tmp_path, remote)
    oldest = listed[0]
    plan = json.loads(
        _cli(
            "prune",
            "--remote",
            "--keep-bytes",
            str(max(e["size_bytes"] for e in listed)),
            "--dry-run",
            "-o",
            "json",
            env=env,
        ).stdout
    )["plan"]
    assert [row["entry"] for row in plan] == [oldest["entry"]]
    assert _cli("prune", "--remote", "-o", "json", env=env, code=64)


def _rewrite_manifest(s3: S3Server, env: dict[str, str], entry: str, change: Any) -> None:
    client: Any = s3.client()
    key = env["CACHEMGR_REMOTE"].removeprefix(f"s3://{BUCKET}/") + f"/entries/{entry}/manifest.json"
    doc = json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    change(doc)
    client.put_object(Bucket=BUCKET, Key=key, Body=json.dumps(doc).encode())


@pytest.mark.timeout(300)
def test_prune_remote_judges_entries_by_what_the_store_holds_not_what_manifests_claim(
    pods: Cluster, tmp_path: Path, remote: dict[str, str], s3: S3Server
) -> None:
    """A manifest rewritten to claim a PiB, or an upload in 1970, removes no other entry, nor itself."""
    env, (older, newer) = _two_pushed(pods, tmp_path, remote)

    def huge(doc: dict[str, Any]) -> None:
        doc["files"][-1]["size"] = 1 << 50

    def ancient(doc: dict[str, Any]) -> None:
        doc["remote"]["uploaded_at"] = 1.0

    _rewrite_manifest(s3, env, newer["entry"], huge)
    _rewrite_manifest(s3, env, older["entry"], ancient)
    listed = {
        e["entry"]: e for e in json.loads(_cli("ls", "--remote", "-o", "json", env=env).stdout)["items"]
    }
    assert listed[newer["entry"]]["size_bytes"] == newer["size_bytes"], "the bytes the store holds"
    assert not str(listed[older["entry"]]["uploaded_at"]).startswith("1970"), (
        "the store's time, not the claim"
    )
    for selector in (["--keep-bytes", "1Gi"], ["--unused-for", "1d"]):
        plan = _cli("prune", "--remote", *selector, "--yes", "-o", "json", env=env).stdout
        assert json.loads(plan)["plan"] == [], (selector, plan)
    assert len(json.loads(_cli("ls", "--remote", "-o", "json", env=env).stdout)["items"]) == 2


@pytest.mark.timeout(300)
def test_prune_remote_ends_a_listing_that_loops(
    pods: Cluster, tmp_path: Path, remote: dict[str, str], s3: S3Server
) -> None:
    env, (older, _) = _two_pushed(pods, tmp_path, remote)
    env = {**env, "CACHEMGR_REMOTE_BUDGET": "30s"}  # the child's listing: a loaded machine's seconds
    # Pagination that leads back to its first page (A, B, A, B...), in the listing of one entry's
    # objects that its removal walks (the listing of the bucket is a child's, killed at the budget).
    with _s3fault(
        s3, tmp_path / "loop.log", "--writes", "pass", "--loop-listings", older["entry"]
    ) as endpoint:
        # Before: pages without end, past any deadline (TimeoutExpired here).
        looped = run_cli(
            "prune", "--remote", "--key", older["entry"], "--yes",
            env={**env, "CACHEMGR_REMOTE_ENDPOINT": endpoint}, timeout=90,
        )  # fmt: skip
    assert looped.returncode == 74, looped.stderr
    (line,) = error_lines(looped.stderr)
    assert "in a loop" in line, line


@pytest.mark.timeout(300)
def test_prune_remote_says_what_the_store_refused_to_remove(
    pods: Cluster, tmp_path: Path, remote: dict[str, str], s3: S3Server
) -> None:
    env, (_, newer) = _two_pushed(pods, tmp_path, remote)
    # DeleteObjects that refuses every key in its per-key Errors (HTTP 200): never "removed".
    with _s3fault(s3, tmp_path / "refuse.log", "--writes", "pass", "--refuse-deletes") as endpoint:
        refused = _cli(
            "prune", "--remote", "--key", newer["entry"], "--yes",
            env={**env, "CACHEMGR_REMOTE_ENDPOINT": endpoint}, code=74,
        )  # fmt: skip
    assert "removed" not in refused.stdout, refused.stdout
    (line,) = error_lines(refused.stderr)
    assert "refused to remove" in line, line
    assert "AccessDenied" in line, line


# --- counted, and off the hit path -----------------------------------------------------------


def test_a_remote_hit_is_counted_in_metrics(pods: Cluster, tmp_path: Path, remote: dict[str, str]) -> None:
    root_a, root_b = _roots(tmp_path, "cluster-a", "cluster-b")
    record = tmp_path / "compiler.jsonl"
    _fill_remote(pods, root_a, remote, record)
    pod = pods.start(
        "b0",
        server_argv(free_port()),
        cache_root=root_b,
        options=[*_options(record), "--status-port", "0"],
        env=remote,
    )
    pod.wait_phase("serving")
    samples = metrics(status_port(pod))
    assert samples["cachemgr_remote_hits_total"] == 1
    assert samples["cachemgr_remote_bytes_total"] == read_manifest(entry_dirs(root_a)[0]).total_bytes
    assert samples["cachemgr_remote_seconds_total"] > 0
    assert samples["cachemgr_compiles_total"] == 0
    assert samples["cachemgr_cache_misses_total"] == 1


def test_dead_attempts_are_removed_before_the_download(
    pods: Cluster, tmp_path: Path, remote: dict[str, str]
) -> None:
    """Their space may be what the download needs: the holder removes them first, then fetches."""
    root_a, root_b = _roots(tmp_path, "cluster-a", "cluster-b")
    record = tmp_path / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=None)]  # one key
    dead = pods.start(
        "dead",
        server_argv(free_port()),
        cache_root=root_b,
        options=options,
        env={**remote, "STANDIN_COMPILE_SECONDS": "120"},
    )
    dead.wait_phase("compiling")
    wait_for(lambda: list((root_b / "staging").rglob("dead.*")), what="the dead pod's staging")
    dead.signal_pod(signal.SIGKILL)
    dead.wait_exit()

    filler = pods.start("a0", server_argv(free_port()), cache_root=root_a, options=options, env=remote)
    filler.wait_phase("serving")
    wait_for(lambda: _events([filler], "remote_uploaded"), what="the upload", timeout=60)

    pod = pods.start("b0", server_argv(free_port()), cache_root=root_b, options=options, env=remote)
    pod.wait_phase("serving")
    names = [e["event"] for e in pod.log_events()]
    assert "stale_staging_removed" in names
    assert "remote_hit" in names
    assert names.index("stale_staging_removed") < names.index("remote_hit")
    assert list((root_b / "staging").rglob("dead.*")) == []


_REMOTE_LIBRARIES = ("boto3", "botocore", "s3transfer", "urllib3", "cachemgr.remote.transfer")


def test_a_local_hit_with_the_remote_on_never_imports_boto3(
    pods: Cluster, tmp_path: Path, remote: dict[str, str]
) -> None:
    (root,) = _roots(tmp_path, "volume")
    record = tmp_path / "compiler.jsonl"
    _fill_remote(pods, root, remote, record)  # published here, uploaded there
    options = _options(record)
    code = (
        "import sys\n"
        "from cachemgr.cli.main import main\n"
        "code = main(sys.argv[1:])\n"
        "print(' '.join(sorted(sys.modules)), file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    env = {
        **pods.base_env,
        **remote,
        "CACHEMGR_CACHE_ROOT": str(root),
        "CACHEMGR_STATE_DIR": str(tmp_path / "st"),
    }
    result = subprocess.run(
        [sys.executable, "-c", code, "warm", *options, "--", *server_argv(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    loaded = set(result.stderr.split()[-1000:])
    assert "cachemgr.remote.config" in loaded, "the remote was configured"
    heavy = sorted(m for m in loaded if m.split(".")[0] in _REMOTE_LIBRARIES or m in _REMOTE_LIBRARIES)
    assert heavy == [], f"a local hit must not import the S3 client, but loaded {heavy}"


def test_demo_remote_compiles_once_for_two_clusters(tmp_path: Path) -> None:
    require_s3()
    result = run_cli(
        "demo",
        "--remote",
        "--dir",
        str(tmp_path / "demo"),
        "--compile-seconds",
        "1",
        env=dict(os.environ),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compiles: cluster A prefill=1 decode=1; cluster B prefill=0 decode=0" in result.stdout


# --- uploads and shutdown --------------------------------------------------------------------


def test_warm_exits_once_its_upload_is_in_the_remote(
    pods: Cluster, tmp_path: Path, remote: dict[str, str], s3: S3Server
) -> None:
    (root,) = _roots(tmp_path, "ci-volume")
    record = tmp_path / "compiler.jsonl"
    job = pods.start(
        "ci", server_argv(free_port()), cache_root=root, command="warm", options=_options(record), env=remote
    )
    assert job.wait_exit() == 0
    assert _events([job], "remote_uploaded"), job.tail()
    _key, doc = _remote_manifest(s3, remote)  # there when warm returns: a CI step can rely on it
    assert doc["key"] == read_manifest(entry_dirs(root)[0]).key


def test_a_stopping_pod_waits_for_its_upload_only_so_long(
    pods: Cluster, tmp_path: Path, own_s3: S3Server
) -> None:
    (root,) = _roots(tmp_path, "volume")
    record = tmp_path / "compiler.jsonl"
    env = {**own_s3.env(), "CACHEMGR_REMOTE_TIMEOUT": "60s", "CACHEMGR_REMOTE_UPLOAD_WAIT": "2s"}
    pod = pods.start("a0", server_argv(free_port()), cache_root=root, options=_options(record), env=env)
    wait_for(lambda: _events([pod], "remote_miss"), what="the lease holder to look in the remote")
    os.killpg(own_s3.proc.pid, signal.SIGSTOP)  # the upload after the publish hangs
    try:
        pod.wait_phase("serving")
        pod.signal(signal.SIGTERM)
        assert pod.wait_exit(timeout=20) == 0, "the server's exit code, after a bounded wait for the upload"
    finally:
        os.killpg(own_s3.proc.pid, signal.SIGCONT)
    warnings = _warnings([pod])
    assert [w["event"] for w in warnings] == ["remote_upload_unfinished"], warnings
    assert warnings[0]["waited_s"] == 2


# --- configuration and names, without a server --------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize(
    ("url", "bucket", "prefix"),
    [("s3://b", "b", ""), ("s3://b/", "b", ""), ("s3://b/p/q/", "b", "p/q/"), ("s3://b//p", "b", "p/")],
)
def test_remote_urls_parse(url: str, bucket: str, prefix: str) -> None:
    from cachemgr.remote.config import parse_url

    assert parse_url(url) == (bucket, prefix)


@pytest.mark.parametrize("url", ["gs://b/p", "s3://", "b/p", "s3://b/../p", "https://b/p"])
def test_a_bad_remote_url_is_refused_before_anything_runs(tmp_path: Path, url: str) -> None:
    """From ``--remote``: a usage error (64); from CACHEMGR_REMOTE: configuration (78), named."""
    env = {**os.environ, "CACHEMGR_CACHE_ROOT": str(tmp_path)}
    argv = ("warm", "--role", "prefill", "--compile-cmd", "c {output_dir}")
    flagged = run_cli(*argv, "--remote", url, "--", "x", env=env)
    assert flagged.returncode == 64, flagged.stderr
    assert "s3://" in flagged.stderr
    configured = run_cli(*argv, "--", "x", env={**env, "CACHEMGR_REMOTE": url})
    assert configured.returncode == 78, configured.stderr
    assert f"CACHEMGR_REMOTE={url!r}" in configured.stderr
    assert "Traceback" not in flagged.stderr + configured.stderr


def test_unsafe_manifest_paths_are_named() -> None:
    from cachemgr.remote.layout import unsafe_paths
    from cachemgr.volume.manifest import FileRecord, Manifest

    def manifest(*paths: str) -> Manifest:
        files = tuple(FileRecord(p, 1, "0" * 32) for p in paths)
        return Manifest(
            key="k", inputs={}, files=files, created_at=0, created_by={}, compile_seconds=0, strategy=""
        )

    assert unsafe_paths(manifest("key.json", "summary.json", "artifacts/a/b.rbln", "artifacts/c")) == []
    for bad in (
        "artifacts/./x",
        "artifacts//x",
        "x",
        "artifacts",
        "artifacts/a\\..\\x",
        "artifacts/\nx",
        "/abs",
        "artifacts/" + "n" * 256,  # past NAME_MAX
        "artifacts/" + "d/" * 600 + "x",  # past an object key's 1,024 bytes
        "artifacts/\udcff",  # not UTF-8: no object key names it
    ):
        assert unsafe_paths(manifest("key.json", bad)), bad
    assert unsafe_paths(manifest("artifacts/" + "n" * 255)) == []
    assert unsafe_paths(manifest("artifacts/x" * 40), prefix="p/" * 300), "the key with its prefix"
    (long,) = unsafe_paths(manifest("artifacts/" + "n" * 300))
    assert len(long) < 300, long
    assert "longer than 255 bytes" in long, long
    assert unsafe_paths(manifest("artifacts/a", "artifacts/a")) == ["'artifacts/a': listed twice"]
    assert unsafe_paths(manifest("artifacts/a", "artifacts/a/b")) == [
        "'artifacts/a': both a file and a directory"
    ]


@pytest.mark.quick
def test_prune_remote_plans_by_age_compat_size_and_dead_uploads() -> None:
    from cachemgr.key.digest import digest_of
    from cachemgr.ops.scan import Compat
    from cachemgr.remote.ops import RemoteEntry, RemoteListing, StaleUpload, plan_remote_prune

    names: dict[str, str] = {}

    def entry(name: str, *, compiler: str, uploaded_at: float, size: int) -> RemoteEntry:
        # Judged by the manifest's inputs, as they hash to the key (cachemgr.ops.generation.key_facts).
        inputs = {
            "schema": 1,
            "compiler": compiler,
            "npu": "RBLN-CA25",
            "role": "prefill",
            "model": {"id": name},
        }
        names[digest_of(inputs)] = name
        return RemoteEntry(
            entry=name, key=digest_of(inputs), model="m", role="prefill", compiler=compiler, npu="RBLN-CA25",
            size_bytes=size, files=1, uploaded_at=uploaded_at, uploaded_by="p", upload_id="u", inputs=inputs,
        )  # fmt: skip

    now = 1_000_000.0
    listing = RemoteListing(
        entries=(
            entry("aaaa", compiler="0.12", uploaded_at=now - 40 * 86400, size=10),
            entry("bbbb", compiler="0.11", uploaded_at=now - 1, size=10),
            entry("cccc", compiler="0.12", uploaded_at=now - 2 * 86400, size=30),
            entry("dddd", compiler="0.12", uploaded_at=now - 86400, size=30),
            # A newer SDK's, uploaded by another cluster: never this image's to call incompatible.
            entry("eeee", compiler="0.13", uploaded_at=now - 3600, size=5),
        ),
        uploads=(
            StaleUpload("cccc", "dead", 3, 5, now - 3 * 86400),
            StaleUpload("dddd", "fresh", 3, 5, now - 60),  # may be under way: kept
        ),
        warnings=(),
    )

    def plan(**options: Any) -> list[tuple[str, str, str]]:
        return [(i.entry, i.upload_id, i.why) for i in plan_remote_prune(listing, now=now, **options)]

    assert plan(older_than=30 * 86400) == [("aaaa", "", "old")]
    assert plan(compat=Compat(compiler="0.12", npu="RBLN-CA25")) == [
        ("bbbb", "", "compiler 0.11, this image has 0.12")
    ]
    assert plan(keep_bytes=45) == [("aaaa", "", "over --keep-bytes"), ("cccc", "", "over --keep-bytes")]
    assert plan(stale_uploads=True) == [("cccc", "dead", "upload without a manifest")]
    assert plan(keys=("bbbb",)) == [("bbbb", "", "named")]


@pytest.mark.quick
def test_prune_remote_incompatible_never_judges_inputs_that_are_not_the_keys() -> None:
    """A manifest whose inputs do not hash to its key says nothing of its generation: kept."""
    from cachemgr.ops.scan import Compat
    from cachemgr.remote.ops import RemoteEntry, RemoteListing, plan_remote_prune

    forged = RemoteEntry(
        entry="ffff", key="f" * 32, model="m", role="prefill", compiler="0.11", npu="RBLN-CA25", size_bytes=1,
        files=1, uploaded_at=0.0, uploaded_by="p", upload_id="u", inputs={"schema": 1, "compiler": "0.11"},
    )  # fmt: skip
    listing = RemoteListing(entries=(forged,), uploads=(), warnings=())
    assert plan_remote_prune(listing, compat=Compat(compiler="0.12", npu="RBLN-CA25")) == []


# --- nothing outside the root is read or written through a planted link ---------------------

CANARY = b"CANARY-outside-the-cache-root-" * 64  # distinctive bytes: found in the bucket means leaked


def _canary(path: Path, size: int) -> bytes:
    """A file outside the root, ``size`` bytes of the canary pattern."""
    data = (CANARY * (size // len(CANARY) + 1))[:size]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _plant_in_entry(entry: Path, where: str, outside: Path) -> Path:
    """Replace an artifact file (``file``) or the ``artifacts/`` folder (``directory``) of a
    published entry by a link to canary bytes of the same sizes outside the root; the planted path."""
    manifest = read_manifest(entry)
    os.chmod(entry, 0o755)  # published entries are read-only; their owner (or root) plants anyway
    os.chmod(entry / "artifacts", 0o755)
    if where == "file":
        record = next(r for r in manifest.files if r.path.startswith("artifacts/") and r.size > 0)
        _canary(outside / "weights.bin", record.size)
        planted = entry / record.path
        os.chmod(planted.parent, 0o755)
        planted.unlink()
        planted.symlink_to(outside / "weights.bin")
        return planted
    for record in manifest.files:
        if record.path.startswith("artifacts/"):
            _canary(outside / record.path.removeprefix("artifacts/"), record.size)
    subprocess.run(["chmod", "-R", "u+w", str(entry / "artifacts")], check=True)
    shutil.rmtree(entry / "artifacts")
    (entry / "artifacts").symlink_to(outside)
    return entry / "artifacts"


def _bucket_holds(s3: S3Server, needle: bytes) -> list[str]:
    client: Any = s3.client()
    found = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for item in page.get("Contents", []):
            if needle in client.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read():
                found.append(item["Key"])
    return found


def _connected(pid: int, port: int) -> bool:
    """Process ``pid`` or a child of it (push's transfer runs in one) holds an established TCP
    connection to 127.0.0.1:``port`` (from /proc)."""
    return any(_connected_one(p, port) for p in [pid, *_children(pid)])


def _children(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{name}/stat").read_text() if name.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat.rpartition(")")[2].split()[1]) == pid:
            found.append(int(name))
    return found


def _connected_one(pid: int, port: int) -> bool:
    try:
        sockets = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        remote_port, state, inode = int(fields[2].split(":")[1], 16), fields[3], fields[9]
        if remote_port == port and state == "01" and f"socket:[{inode}]" in sockets:
            return True
    return False


@pytest.mark.parametrize("where", ["file", "directory"])
def test_push_never_reads_through_a_link_planted_in_the_entry(
    pods: Cluster, tmp_path: Path, own_s3: S3Server, where: str
) -> None:
    (root,) = _roots(tmp_path, "volume")
    record = tmp_path / "compiler.jsonl"
    pod = pods.start("a0", server_argv(free_port()), cache_root=root, options=_options(record))
    pod.wait_phase("serving")
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0
    (entry,) = entry_dirs(root)
    env = {
        **pods.base_env,
        **own_s3.env(),
        "CACHEMGR_CACHE_ROOT": str(root),
        "CACHEMGR_REMOTE_TIMEOUT": "60s",
    }
    # The link goes in after push checked the entry, while its first request waits on a frozen
    # store: only the upload itself can refuse it.
    os.killpg(own_s3.proc.pid, signal.SIGSTOP)
    try:
        push = subprocess.Popen(
            [sys.executable, "-m", "cachemgr", "push"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        port = int(own_s3.endpoint.rpartition(":")[2])
        wait_for(lambda: _connected(push.pid, port), what="push to ask the store for the entry")
        planted = _plant_in_entry(entry, where, tmp_path / "outside")
    finally:
        os.killpg(own_s3.proc.pid, signal.SIGCONT)
    out, err = push.communicate(timeout=120)
    assert push.returncode == 74, out + err
    assert str(planted) in err, err
    assert "symbolic link" in err, err
    assert "Traceback" not in err
    assert _bucket_holds(own_s3, CANARY[:64]) == [], "bytes from outside the root reached the bucket"
    assert not [k for k in _objects(own_s3, own_s3.env()) if k.endswith("manifest.json")]


def test_a_pods_upload_never_reads_through_a_link_planted_after_its_publish(
    pods: Cluster, tmp_path: Path, own_s3: S3Server
) -> None:
    (root,) = _roots(tmp_path, "volume")
    env = {**own_s3.env(), "CACHEMGR_REMOTE_TIMEOUT": "60s"}
    pod = pods.start(
        "a0", server_argv(free_port()), cache_root=root, options=_options(tmp_path / "c.jsonl"), env=env
    )
    wait_for(lambda: _events([pod], "remote_miss"), what="the lease holder to look in the remote")
    os.killpg(own_s3.proc.pid, signal.SIGSTOP)  # the upload after the publish waits on the store
    try:
        pod.wait_phase("serving")
        (entry,) = entry_dirs(root)
        planted = _plant_in_entry(entry, "file", tmp_path / "outside")
    finally:
        os.killpg(own_s3.proc.pid, signal.SIGCONT)
    wait_for(lambda: _events([pod], "remote_upload_failed"), what="the refused upload", timeout=90)
    (warning,) = _warnings([pod])
    assert str(planted) in warning["message"], warning
    assert "symbolic link" in warning["message"], warning
    assert pod.proc.poll() is None, "a refused upload never stops the pod"
    assert _bucket_holds(own_s3, CANARY[:64]) == [], "bytes from outside the root reached the bucket"


@pytest.mark.parametrize("where", ["artifacts", "manifest.json"])
def test_a_download_never_writes_through_a_link_planted_in_its_staging(
    pods: Cluster, tmp_path: Path, own_s3: S3Server, where: str
) -> None:
    root_a, root_b = _roots(tmp_path, "cluster-a", "cluster-b")
    record = tmp_path / "compiler.jsonl"
    env = {**own_s3.env(), "CACHEMGR_REMOTE_TIMEOUT": "60s"}
    _fill_remote(pods, root_a, env, record)
    outside = tmp_path / "outside"
    for rec in read_manifest(entry_dirs(root_a)[0]).files:  # every name the download would write
        _canary(outside / rec.path.removeprefix("artifacts/"), 100)
    before = _snapshot(outside)

    os.killpg(own_s3.proc.pid, signal.SIGSTOP)  # the download waits for the remote manifest...
    try:
        pod, staging = _start_download_attempt(pods, root_b, env, record)
        # ...while a link replaces a folder of its staging, or takes a name it is about to write.
        if where == "artifacts":
            (staging / "artifacts").rmdir()
            (staging / "artifacts").symlink_to(outside)
        else:
            (staging / "manifest.json").symlink_to(outside / "summary.json")
    finally:
        os.killpg(own_s3.proc.pid, signal.SIGCONT)
    pod.wait_phase("serving", timeout=90)
    assert _snapshot(outside) == before, "the download wrote outside the cache root"
    assert compiles(record) == 2, "the download was refused: a local compile"
    (warning,) = _warnings([pod])
    assert warning["event"] == "remote_unusable_compiling_locally", warning
    assert str(staging / where) in warning["message"], warning
    assert_entries_valid(root_b)
    assert "origin" not in json.loads((entry_dirs(root_b)[0] / "summary.json").read_text())


# --- a full bucket never stops a pod -----------------------------------------------------------


def _s3fault(s3: S3Server, log_path: Path, *options: str) -> contextlib.AbstractContextManager[str]:
    """tests/s3fault.py in front of ``s3`` with ``options``: its endpoint while it runs."""
    return s3fault(Path(__file__).with_name("s3fault.py"), s3.endpoint, log_path, *options)


@pytest.fixture(params=[(507, "InsufficientStorage"), (403, "QuotaExceeded")], ids=["507", "403-quota"])
def full_s3(s3: S3Server, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The endpoint of a bucket that refuses every write for space (tests/s3fault.py: SeaweedFS's
    own enforced quota answers 500 InternalError, indistinguishable from a crash)."""
    status, code = request.param
    with _s3fault(s3, tmp_path / "s3fault.log", "--status", str(status), "--code", code) as endpoint:
        yield endpoint


def test_a_full_bucket_costs_a_warning_after_the_compile_and_push_exits_73(
    pods: Cluster, tmp_path: Path, remote: dict[str, str], full_s3: str
) -> None:
    (root,) = _roots(tmp_path, "volume")
    record = tmp_path / "compiler.jsonl"
    env = {**remote, "CACHEMGR_REMOTE_ENDPOINT": full_s3}
    pod = pods.start("a0", server_argv(free_port()), cache_root=root, options=_options(record), env=env)
    pod.wait_phase("serving")
    wait_for(lambda: _events([pod], "remote_upload_failed"), what="the refused upload", timeout=90)
    assert compiles(record) == 1
    (warning,) = _warnings([pod])
    assert warning["message"].startswith("remote is full or over quota: "), warning
    assert warning["problem"] == "full", warning
    assert "free space in the bucket" in warning["message"].lower()
    assert "unset CACHEMGR_REMOTE" in warning["message"]
    assert pod.proc.poll() is None, "a full bucket never stops a pod"
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0

    refused = _cli("push", env={**pods.base_env, **env, "CACHEMGR_CACHE_ROOT": str(root)}, code=73)
    (line,) = error_lines(refused.stderr)  # once: the JSON log's failed event
    assert line.startswith("remote is full or over quota: "), refused.stderr
    assert "raise its quota" in line, line


@pytest.mark.quick
def test_a_transfer_of_many_folders_keeps_few_directories_open(tmp_path: Path) -> None:
    """An entry of thousands of folders (a remote manifest, or a compile's) must not run the
    process out of descriptors: the directory descriptors a transfer keeps are bounded."""
    root = tmp_path / "root"
    folders = 3 * DIR_CACHE
    for i in range(folders):
        (root / "entry" / "artifacts" / f"d{i:04d}").mkdir(parents=True)
        (root / "entry" / "artifacts" / f"d{i:04d}" / "f.bin").write_bytes(b"x" * i)
    before = len(os.listdir("/proc/self/fd"))
    with LocalDir.open(root, root / "entry") as local:
        for i in range(folders):
            handle, st = local.open_file(f"artifacts/d{i:04d}/f.bin")
            with handle:
                assert handle.read() == b"x" * i
            assert st.st_size == i
            assert len(os.listdir("/proc/self/fd")) - before <= DIR_CACHE + 2  # + the entry's own
        with local.create_file("artifacts/d0000/new.bin") as handle:  # an evicted folder, opened again
            handle.write(b"new")
    assert len(os.listdir("/proc/self/fd")) == before
    assert (root / "entry" / "artifacts" / "d0000" / "new.bin").read_bytes() == b"new"


@pytest.mark.quick
def test_a_transfer_reaches_a_file_thousands_of_folders_deep(tmp_path: Path) -> None:
    """A path deeper than Python's recursion limit is reached (and made) level by level."""
    (root := tmp_path / "root").mkdir()
    (root / "entry").mkdir()
    deep = "/".join(["d"] * 3000) + "/f.bin"
    with LocalDir.open(root, root / "entry") as local:
        local.write_new(deep, b"deep")
        handle, _ = local.open_file(deep)
        with handle:
            assert handle.read() == b"deep"
        local.write_new("d/d/g.bin", b"near")  # after the walk down: its parents are reached again
        assert local.read_bytes("d/d/g.bin", limit=10) == b"near"


# --- the last gaps: the download's check, a file rewritten while it uploads, the cleanup -------


def _in_process(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Remote:
    """A client in this process reaching the store as a pod does (boto3 reads os.environ)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = remote_config(None, env)
    assert config is not None
    return Remote(config)


def test_the_downloads_hash_check_never_reads_through_a_folder_swapped_for_a_link(
    pods: Cluster, tmp_path: Path, remote: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root_a, root_b = _roots(tmp_path, "cluster-a", "cluster-b")
    _fill_remote(pods, root_a, remote, tmp_path / "compiler.jsonl")
    client = _in_process(monkeypatch, remote)
    key = key_of(list_remote(client).entries[0])
    staging = root_b / "staging" / key.digest / "attempt"
    staging.mkdir(parents=True)
    # The same bytes outside the root: a check that read through the link would find them right.
    outside = tmp_path / "outside"
    shutil.copytree(entry_dirs(root_a)[0] / "artifacts", outside)
    real_open = os.open
    opened: list[str] = []
    swapped: list[Path] = []

    def watched_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        """os.open as it is, but the moment the check reads its first file (the download wrote
        every one by then), a peer swaps the staging's ``artifacts/`` for a link: a real rename and
        a real link; only the moment is arranged (a real race hits it now and then)."""
        where = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else os.fspath(path)
        reading = not flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_DIRECTORY)
        if reading and not swapped and where.startswith(str(staging)):
            os.rename(staging / "artifacts", root_b / "moved-aside")
            os.symlink(outside, staging / "artifacts")
            swapped.append(staging / "artifacts")
        fd = real_open(path, flags, mode, dir_fd=dir_fd)
        opened.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fd

    monkeypatch.setattr(os, "open", watched_open)
    refused: Exception | None = None
    try:
        client.download(key, staging, within=root_b)
    except (RemoteDamageError, UnsafePathError) as error:
        refused = error
    finally:
        monkeypatch.setattr(os, "open", real_open)
    assert swapped, "the check read no file"
    assert [p for p in opened if p.startswith(str(outside))] == [], "the check read outside the root"
    assert refused is not None, "a staging with a link in it passed the check"
    assert "artifacts" in str(refused), refused


def test_the_downloads_hash_check_still_catches_other_bytes(
    pods: Cluster, tmp_path: Path, remote: dict[str, str], s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hashing through descriptors still compares every byte: same size, other bytes is damage."""
    root_a, root_b = _roots(tmp_path, "cluster-a", "cluster-b")
    _fill_remote(pods, root_a, remote, tmp_path / "compiler.jsonl")
    _tamper(s3, remote, "content", tmp_path)
    client = _in_process(monkeypatch, remote)
    key = key_of(list_remote(client).entries[0])
    staging = root_b / "staging" / key.digest / "attempt"
    staging.mkdir(parents=True)
    with pytest.raises(RemoteDamageError, match="content differs from the manifest's xxh3-128"):
        client.download(key, staging, within=root_b)


class _Counters:
    """The pod's remote counters (RemoteCounters), recorded."""

    def __init__(self) -> None:
        self.remote_misses = 0
        self.uploads: list[int] = []
        self.failures: list[str] = []

    def remote_hit(self, nbytes: int, seconds: float) -> None:
        raise AssertionError("no download here")

    def remote_upload(self, nbytes: int, seconds: float) -> None:
        self.uploads.append(nbytes)

    def remote_failure(self, problem: str) -> None:
        self.failures.append(problem)


def _published_with(root: Path, files: dict[str, int]) -> Path:
    """An entry published by library call, with artifacts of the given sizes (random bytes)."""
    volume = open_root(root, create=True)
    key = command_key()
    staging = create_staging(volume, key, IDENTITY)
    for name, size in files.items():
        (staging.artifacts / name).write_bytes(os.urandom(size))
    return publish(volume, staging, key, identity=IDENTITY, compile_seconds=1.0, strategy="command").path


def _rewrite_in_place(path: Path) -> None:
    """Other bytes of the same size into the same inode, as an in-place writer leaves a file."""
    os.chmod(path, 0o644)  # published read-only; its owner (or root) writes anyway
    data = path.read_bytes()
    with path.open("r+b") as handle:
        handle.write(bytes(b ^ 0xFF for b in data[:4096]) + data[4096:])


# A sitecustomize for push and the transfer's child it runs the upload in (both read PYTHONPATH):
# the real open and fstat, then the file named by CACHEMGR_TEST_REWRITE is rewritten in place.
REWRITE_AFTER_OPEN = """
import os
from cachemgr.remote.localfiles import LocalDir

target = os.environ["CACHEMGR_TEST_REWRITE"]
opened = LocalDir.open_file
def open_file(self, rel):
    handle, st = opened(self, rel)  # the upload's open and fstat: the size it checks next is right
    if rel == target:
        path = self.shown / rel
        path.chmod(0o644)
        data = path.read_bytes()
        with path.open("r+b") as out:
            out.write(bytes(b ^ 0xFF for b in data[:4096]) + data[4096:])
    return handle, st
LocalDir.open_file = open_file
"""


MULTIPART = (16 << 20) + 12345  # past the transfer's 16 MiB threshold: parts, read in order


@pytest.mark.parametrize(
    "case",
    [(256 << 10, True), (MULTIPART, True), (256 << 10, False), (MULTIPART, False)],
    ids=["put-object", "multipart", "put-object-untouched", "multipart-untouched"],
)
def test_a_file_rewritten_in_place_while_it_uploads_never_gets_a_manifest(
    tmp_path: Path,
    remote: dict[str, str],
    s3: S3Server,
    monkeypatch: pytest.MonkeyPatch,
    case: tuple[int, bool],
) -> None:
    size, rewritten = case
    root = tmp_path / "volume"
    root.mkdir()
    entry = _published_with(root, {"graph_0.rbln": 4096, "graph_1.rbln": size})
    target = "artifacts/graph_1.rbln"
    opened = LocalDir.open_file

    def open_file(self: LocalDir, rel: str) -> tuple[Any, os.stat_result]:
        """The real open; then, after its size is taken, the file is rewritten in place (a real
        write; only its moment is arranged: after the check, before the bytes stream)."""
        handle, st = opened(self, rel)
        if rel == target and rewritten:
            _rewrite_in_place(self.shown / rel)
        return handle, st

    monkeypatch.setattr(LocalDir, "open_file", open_file)
    _in_process(monkeypatch, remote)
    config = remote_config(None, remote)
    assert config is not None
    counters = _Counters()
    # In this process (transfers=Remote): the rewrite's moment is arranged here, by open_file.
    upload = Upload(
        entry, within=root, config=config, identity=IDENTITY, metrics=counters, transfers=Remote
    ).start()
    assert upload.done.wait(120), "the upload never ended"
    manifests = [k for k in _objects(s3, remote) if k.endswith("manifest.json")]
    if not rewritten:  # the streamed hash refuses nothing that matches, in either kind of transfer
        assert counters.failures == []
        assert counters.uploads == [read_manifest(entry).total_bytes]
        assert len(manifests) == 1
        return
    assert counters.failures == ["local-changed"], "counted as the other upload failures are"
    assert counters.uploads == []
    assert manifests == [], "the entry appeared in the remote"


def test_push_of_a_file_rewritten_while_it_uploads_exits_74_with_one_line(
    pods: Cluster, tmp_path: Path, remote: dict[str, str], s3: S3Server
) -> None:
    root = tmp_path / "volume"
    root.mkdir()
    entry = _published_with(root, {"graph_0.rbln": 4096, "graph_1.rbln": 256 << 10})
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(REWRITE_AFTER_OPEN)
    env = {
        **pods.base_env,
        **remote,
        "CACHEMGR_CACHE_ROOT": str(root),
        "CACHEMGR_TEST_REWRITE": "artifacts/graph_1.rbln",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(inject), pods.base_env.get("PYTHONPATH")])),
    }
    push = subprocess.run(
        [sys.executable, "-m", "cachemgr", "push"],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert push.returncode == 74, push.stdout + push.stderr
    assert "Traceback" not in push.stderr
    (line,) = error_lines(push.stderr)
    assert line.startswith(f"{entry}/artifacts/graph_1.rbln changed while it was uploading "), line
    assert "its bytes no longer match the manifest's xxh3-128" in line, line
    assert "'cachemgr verify --fix'" in line, line
    assert not [k for k in _objects(s3, remote) if k.endswith("manifest.json")], "the entry appeared"


def test_a_link_planted_as_the_download_attempt_is_cleaned_up_without_following_it(
    pods: Cluster, tmp_path: Path, own_s3: S3Server
) -> None:
    root_a, root_b = _roots(tmp_path, "cluster-a", "cluster-b")
    record = tmp_path / "compiler.jsonl"
    env = {**own_s3.env(), "CACHEMGR_REMOTE_TIMEOUT": "60s"}
    _fill_remote(pods, root_a, env, record)
    os.killpg(own_s3.proc.pid, signal.SIGSTOP)  # the download waits for the remote manifest...
    try:
        pod, staging = _start_download_attempt(pods, root_b, env, record)
        # ...while its attempt directory is replaced by a link to nothing (outside the root).
        shutil.rmtree(staging)
        staging.symlink_to(tmp_path / "outside" / "nothing")
    finally:
        os.killpg(own_s3.proc.pid, signal.SIGCONT)
    pod.wait_phase("serving", timeout=90)
    assert compiles(record) == 2, "the download was refused: a local compile"
    assert not os.path.lexists(staging), "the link at the attempt's name was left behind"
    assert not os.path.lexists(f"{staging}.json"), "the attempt's owner record was left behind"
    assert not (tmp_path / "outside").exists()


@pytest.mark.quick
def test_an_uploads_reader_refuses_a_second_pass_that_reads_other_bytes_or_a_shrunk_file(
    tmp_path: Path,
) -> None:
    """botocore may read a PutObject body twice from the start (a checksum, then the send): each
    pass is held to the manifest, so a rewrite between them is caught too; so is a file that
    ends before its recorded size (the send would hang on the missing bytes)."""
    data = os.urandom(100_000)
    (tmp_path / "root" / "entry").mkdir(parents=True)
    path = tmp_path / "root" / "entry" / "f.bin"
    path.write_bytes(data)
    digest = xxhash.xxh3_128_hexdigest(data)
    with LocalDir.open(tmp_path / "root", tmp_path / "root" / "entry") as local:
        handle, _ = local.open_file("f.bin")
        reader = HashedReader(handle, size=len(data), xxh3=digest, shown=path)
        assert reader.read(60_000) + reader.read(60_000) == data  # the checksum's pass
        reader.seek(0)
        _rewrite_in_place(path)
        reader.read(60_000)
        with pytest.raises(LocalChangedError, match="no longer match the manifest's xxh3-128"):
            reader.read(60_000)  # the send's pass: refused before its last bytes go
        with pytest.raises(LocalChangedError):
            reader.verify()
        reader.close()

        path.write_bytes(data[:50_000])  # shrunk in place (same inode)
        handle, _ = local.open_file("f.bin")
        reader = HashedReader(handle, size=len(data), xxh3=digest, shown=path)
        with pytest.raises(LocalChangedError, match="ended at 50000 of the 100000 bytes"):
            reader.read(60_000)
        reader.close()


# --- one object the store will not serve costs its entry only (issue 40) ---------------------


def _encrypt_manifest(s3: S3Server, env: dict[str, str], entry: str) -> None:
    """Rewrite ``entry``'s manifest SSE-C encrypted (a real store refusal: SeaweedFS answers a GET
    without the customer key 400 InvalidArgument), as AWS refuses another account's object or one
    archived by a lifecycle rule."""
    client: Any = s3.client()
    prefix = env["CACHEMGR_REMOTE"].removeprefix(f"s3://{BUCKET}/") + "/"
    key = f"{prefix}entries/{entry}/manifest.json"
    body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    client.put_object(
        Bucket=BUCKET, Key=key, Body=body, SSECustomerAlgorithm="AES256", SSECustomerKey=os.urandom(32)
    )
    with pytest.raises(Exception, match="InvalidArgument"):
        client.get_object(Bucket=BUCKET, Key=key)


def test_a_manifest_the_store_refuses_costs_its_entry_only_and_is_replaced(
    pods: Cluster, tmp_path: Path, remote: dict[str, str], s3: S3Server
) -> None:
    root_a, root_b, root_c = _roots(tmp_path, "cluster-a", "cluster-b", "cluster-c")
    record = tmp_path / "compiler.jsonl"
    _fill_remote(pods, root_a, remote, record)
    (refused,) = [e.name for e in entry_dirs(root_a)]
    _fill_remote(pods, root_a, {**remote, "CACHEMGR_ROLE": "decode"}, record, name="a1")
    (served,) = [e.name for e in entry_dirs(root_a) if e.name != refused]
    _encrypt_manifest(s3, remote, refused)
    env = {**pods.base_env, **remote, "CACHEMGR_CACHE_ROOT": str(root_b)}

    listed = _cli("ls", "--remote", "-o", "json", env=env)
    items = json.loads(listed.stdout)["items"]
    assert [e["entry"] for e in items if e["kind"] == "remote-entry"] == [served]
    assert f"{refused}: " in listed.stderr, listed.stderr
    assert f"prune --remote --key {refused}" in listed.stderr
    assert "Traceback" not in listed.stderr
    planned = _cli("prune", "--remote", "--key", refused, "--dry-run", "-o", "json", env=env).stdout
    assert [row["entry"] for row in json.loads(planned)["plan"]] == [refused]
    assert "downloaded" in _cli("pull", served, env=env).stdout, "every other entry is served"
    said = _cli("pull", refused, env=env, code=74).stderr
    assert "refuses to serve" in said, said

    # A pod of that key calls it damage, compiles, and replaces it: the next cluster downloads it.
    pod = pods.start("b0", server_argv(free_port()), cache_root=root_b, options=_options(record), env=remote)
    pod.wait_phase("serving")
    (warning,) = _warnings([pod])
    assert warning["problem"] == "damaged", warning
    wait_for(lambda: _events([pod], "remote_uploaded"), what="the replacing upload", timeout=60)
    third = pods.start(
        "c0", server_argv(free_port()), cache_root=root_c, options=_options(record), env=remote
    )
    third.wait_phase("serving")
    assert len(_events([third], "remote_hit")) == 1
    assert _warnings([third]) == []
    assert compiles(record) == 3, "cluster a twice, cluster b once; cluster c downloaded"


@pytest.mark.parametrize("how", ["garbage", "other-key", "refused"])
def test_push_replaces_a_damaged_remote_manifest_and_says_so(
    pods: Cluster, tmp_path: Path, remote: dict[str, str], s3: S3Server, how: str
) -> None:
    root_a, root_b = _roots(tmp_path, "cluster-a", "cluster-b")
    record = tmp_path / "compiler.jsonl"
    _fill_remote(pods, root_a, remote, record)
    (entry,) = entry_dirs(root_a)
    key, _ = _remote_manifest(s3, remote)
    client: Any = s3.client()
    if how == "garbage":
        client.put_object(Bucket=BUCKET, Key=key, Body=b"\x00not a manifest")
    elif how == "other-key":
        _rewrite_manifest(s3, remote, entry.name, lambda doc: doc.update(key="0" * 32))
    else:
        _encrypt_manifest(s3, remote, entry.name)
    env = {**pods.base_env, **remote}
    pushed = _cli("push", "--cache-root", str(root_a), env=env)
    assert pushed.stdout.splitlines()[1].split()[-1] == "replaced", pushed.stdout
    said = " ".join(pushed.stderr.split())  # a note is wrapped to the terminal's width
    assert f"note: the remote's {entry.name} was damaged" in said, pushed.stderr
    assert "already in the remote" in _cli("push", "--cache-root", str(root_a), env=env).stdout
    assert "downloaded" in _cli("pull", entry.name, "--cache-root", str(root_b), env=env).stdout
    assert_entries_valid(root_b)


# --- a credential's value never reaches a message ----------------------------------------------


@pytest.mark.parametrize("name", ["AWS_SESSION_TOKEN", "AWS_SECRET_ACCESS_KEY"])
def test_a_credential_with_a_trailing_newline_is_bad_configuration_and_never_shown(
    pods: Cluster, tmp_path: Path, remote: dict[str, str], name: str
) -> None:
    """As 'kubectl create secret --from-file' makes it: exit 78 naming the variable, no value."""
    secret = f"Secret{os.urandom(8).hex()}"
    env = {**pods.base_env, **remote, name: secret + "\n"}
    refused = _cli("ls", "--remote", env=env, code=78)
    (line,) = error_lines(refused.stderr)
    assert f"{name} holds a trailing newline" in line, line
    assert secret not in refused.stdout + refused.stderr
    (root,) = _roots(tmp_path, "volume")
    record = tmp_path / "compiler.jsonl"
    pod = pods.start(
        "p0",
        server_argv(free_port()),
        cache_root=root,
        options=_options(record),
        env={**remote, name: secret + "\n"},
    )
    pod.wait_phase("serving")
    (warning,) = _warnings([pod])
    assert warning["problem"] == "credentials", warning
    assert name in warning["message"], warning
    assert secret not in pod.log.read_text(), "the value never reaches the pod's log"
    assert compiles(record) == 1


@pytest.mark.quick
def test_no_credential_value_reaches_a_description_whatever_botocore_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from botocore.exceptions import HTTPClientError

    from cachemgr.remote.client import describe

    secret = "TokenValue-7f3a9c"
    monkeypatch.setenv("AWS_SESSION_TOKEN", secret + "\n")
    config = remote_config("s3://b/p", {})
    assert config is not None
    raised = HTTPClientError(error=ValueError(f"Invalid header value b'{secret}\\n'"))
    said = describe(raised, config, doing="listing").one_line()
    assert secret not in said, said
    assert "<AWS_SESSION_TOKEN>" in said, said
