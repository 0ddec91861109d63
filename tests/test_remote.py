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
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash
from podlib import Cluster, free_port, run_cli, wait_for
from s3server import BAD_KEYS, BUCKET, S3Server, s3_server, unavailable_reason
from scenarios import assert_entries_valid, compile_cmd, compiles, entry_dirs, server_argv

from cachemgr.volume.manifest import read_manifest

REQUIRE_ENV = "CACHEMGR_REQUIRE_MOUNTS"


def _require_s3() -> None:
    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but no S3 server can be started: {reason}", pytrace=False)
    pytest.skip(f"S3 server unavailable: {reason}")


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One S3 server for the module; each test uses its own prefix (see ``remote``)."""
    _require_s3()
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


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
    ],
)
def test_a_damaged_remote_entry_is_never_published_and_the_pod_compiles(
    pods: Cluster, tmp_path: Path, remote: dict[str, str], s3: S3Server, how: str
) -> None:
    root_a, root_b = _roots(tmp_path, "cluster-a", "cluster-b")
    record = tmp_path / "compiler.jsonl"
    _fill_remote(pods, root_a, remote, record)
    _tamper(s3, remote, how, tmp_path)

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
    if how != "content":
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
    _require_s3()
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
    (listed,) = json.loads(_cli("ls", "--remote", "-o", "json", env=env).stdout)
    key = listed["key"]
    assert listed["files"] > 0
    assert listed["size_bytes"] == read_manifest(entry_dirs(root_a)[0]).total_bytes

    assert "downloaded" in _cli("pull", key[:10], env=env_b).stdout
    (entry,) = [e for e in json.loads(_cli("ls", "-o", "json", env=env_b).stdout) if e["kind"] == "entry"]
    assert entry["origin"]["kind"] == "remote"
    assert "ok (remote)" in _cli("ls", env=env_b).stdout
    shown = _cli("show", key[:10], env=env_b).stdout
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
    missing = _cli("pull", key[:10], env=env_b, code=69)
    assert "the remote has no entry matching" in missing.stderr

    refused = _cli("push", "--force", env={**env_a, **BAD_KEYS}, code=74)
    assert "refused the credentials" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_prune_remote_keep_bytes_removes_the_oldest_uploads_first(
    pods: Cluster, tmp_path: Path, remote: dict[str, str]
) -> None:
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
    listed = json.loads(_cli("ls", "--remote", "-o", "json", env=env).stdout)
    oldest = min(listed, key=lambda e: e["uploaded_at"])
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


# --- counted, and off the hit path -----------------------------------------------------------


def test_a_remote_hit_is_counted_in_metrics(pods: Cluster, tmp_path: Path, remote: dict[str, str]) -> None:
    from test_probes import metrics, status_port

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
    _require_s3()
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
    (warning,) = _warnings([pod])
    assert warning["event"] == "remote_upload_unfinished"
    assert warning["waited_s"] == 2


# --- configuration and names, without a server --------------------------------------------------


@pytest.mark.parametrize(
    ("url", "bucket", "prefix"),
    [("s3://b", "b", ""), ("s3://b/", "b", ""), ("s3://b/p/q/", "b", "p/q/"), ("s3://b//p", "b", "p/")],
)
def test_remote_urls_parse(url: str, bucket: str, prefix: str) -> None:
    from cachemgr.remote.config import parse_url

    assert parse_url(url) == (bucket, prefix)


@pytest.mark.parametrize("url", ["gs://b/p", "s3://", "b/p", "s3://b/../p", "https://b/p"])
def test_a_bad_remote_url_is_a_usage_error_before_anything_runs(tmp_path: Path, url: str) -> None:
    env = {**os.environ, "CACHEMGR_CACHE_ROOT": str(tmp_path), "CACHEMGR_REMOTE": url}
    result = run_cli("warm", "--role", "prefill", "--compile-cmd", "c {output_dir}", "--", "x", env=env)
    assert result.returncode == 64, result.stderr
    assert "s3://" in result.stderr
    assert "Traceback" not in result.stderr


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
    ):
        assert unsafe_paths(manifest("key.json", bad)), bad
    assert unsafe_paths(manifest("artifacts/a", "artifacts/a")) == ["'artifacts/a': listed twice"]
    assert unsafe_paths(manifest("artifacts/a", "artifacts/a/b")) == [
        "'artifacts/a': both a file and a directory"
    ]


def test_prune_remote_plans_by_age_compat_size_and_dead_uploads() -> None:
    from cachemgr.ops.scan import Compat
    from cachemgr.remote.ops import RemoteEntry, RemoteListing, StaleUpload, plan_remote_prune

    def entry(name: str, *, compiler: str, uploaded_at: float, size: int) -> RemoteEntry:
        return RemoteEntry(
            entry=name, key=name * 4, model="m", role="prefill", compiler=compiler, npu="RBLN-CA25",
            size_bytes=size, files=1, uploaded_at=uploaded_at, uploaded_by="p", upload_id="u", inputs={},
        )  # fmt: skip

    now = 1_000_000.0
    listing = RemoteListing(
        entries=(
            entry("aaaa", compiler="0.12", uploaded_at=now - 40 * 86400, size=10),
            entry("bbbb", compiler="0.11", uploaded_at=now - 1, size=10),
            entry("cccc", compiler="0.12", uploaded_at=now - 2 * 86400, size=30),
            entry("dddd", compiler="0.12", uploaded_at=now - 86400, size=30),
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
    assert plan(keep_bytes=40) == [("aaaa", "", "over --keep-bytes"), ("cccc", "", "over --keep-bytes")]
    assert plan(stale_uploads=True) == [("cccc", "dead", "upload without a manifest")]
    assert plan(keys=("bbbb",)) == [("bbbb", "", "named")]
