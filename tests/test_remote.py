"""The remote tier against a real S3 server (SeaweedFS ``weed mini``, tests/s3server.py).

Two "clusters" are two cache roots sharing one bucket prefix; pods are real ``cachemgr run``
processes (podlib). Faults are real: objects overwritten in the bucket, an uploader killed
with SIGKILL, the server killed, credentials the server does not know.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from podlib import Cluster, free_port, wait_for
from s3server import BUCKET, S3Server, s3_server, unavailable_reason
from scenarios import assert_entries_valid, compile_cmd, compiles, entry_dirs, server_argv

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
    return s3.env(prefix=f"t/{request.node.name[:60]}")


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
