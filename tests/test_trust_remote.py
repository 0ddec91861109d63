"""Trust through the remote tier: a trusting pod publishes (and serves) a downloaded entry only if a
trusted key signed it as it is, checked in private staging before the rename.

Against a real S3 server (SeaweedFS ``weed mini``); the bucket is written as anyone with write
access to it can: an open-mode or other-key upload, or an object rewritten with its manifest's
xxh3 and size made to match (the download's own checks then pass; only the signature can tell).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import xxhash
from cachemgr_testkit.podlib import Cluster, Pod, free_port, run_cli, wait_for
from cachemgr_testkit.s3server import BUCKET, S3Server
from cachemgr_testkit.scenarios import compile_cmd, compiles, entry_dirs, server_argv
from cachemgr_testkit.trusted import new_key

from cachemgr.core.signing import SecretKey


@pytest.fixture
def remote(s3: S3Server, request: pytest.FixtureRequest) -> dict[str, str]:
    tag = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]
    return s3.env(prefix=f"trust/{request.node.name[:40]}-{tag}")


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, tuple[SecretKey, Path]]:
    return {name: new_key(tmp_path / "keys", name) for name in ("builder-1", "other-1")}


def _root(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    return path


def _options(record: Path) -> list[str]:
    return ["--strategy", "command", "--compile-cmd", compile_cmd(record)]


def _events(pod: Pod, name: str) -> list[dict[str, Any]]:
    return [e for e in pod.log_events() if e.get("event") == name]


def _upload(pods: Cluster, root: Path, record: Path, remote: dict[str, str], key_file: Path | None) -> None:
    """A cluster's warm Job compiles and uploads (signed with ``key_file``, or in the open mode)."""
    env = {**remote, **({"CACHEMGR_SIGNING_KEY_FILE": str(key_file)} if key_file else {})}
    job = pods.start(
        "uploader",
        server_argv(free_port()),
        cache_root=root,
        command="warm",
        options=_options(record),
        env=env,
    )
    assert job.wait_exit() == 0, job.tail()
    assert _events(job, "remote_uploaded"), job.tail()


def _remote_manifest(s3: S3Server, env: dict[str, str]) -> tuple[str, dict[str, Any]]:
    prefix = env["CACHEMGR_REMOTE"].removeprefix(f"s3://{BUCKET}/") + "/"
    client: Any = s3.client()
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    (key,) = [o["Key"] for o in listed if o["Key"].endswith("/manifest.json")]
    return key, json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())


def _rewrite_an_artifact(s3: S3Server, env: dict[str, str]) -> None:
    """Other bytes of the same size in the bucket, and the remote manifest's xxh3 made to match."""
    client: Any = s3.client()
    key, doc = _remote_manifest(s3, env)
    base = key.rpartition("/")[0] + f"/objects/{doc['remote']['objects']}/"
    record = next(f for f in doc["files"] if f["path"].endswith(".rbln") and f["size"] > 0)
    data = bytearray(client.get_object(Bucket=BUCKET, Key=base + record["path"])["Body"].read())
    data[0] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=base + record["path"], Body=bytes(data))
    record["xxh3"] = xxhash.xxh3_128_hexdigest(bytes(data))
    client.put_object(Bucket=BUCKET, Key=key, Body=json.dumps(doc).encode())


def test_a_trusting_pod_without_the_key_takes_a_signed_entry_from_the_remote(
    pods: Cluster, tmp_path: Path, remote: dict[str, str], keys: dict[str, tuple[SecretKey, Path]]
) -> None:
    secret, key_file = keys["builder-1"]
    record = tmp_path / "compiler.jsonl"
    _upload(pods, _root(tmp_path, "cluster-a"), record, remote, key_file)
    root_b = _root(tmp_path, "cluster-b")
    env = {**remote, "CACHEMGR_TRUSTED_KEYS": str(secret.public)}
    pod = pods.start("b0", server_argv(free_port()), cache_root=root_b, options=_options(record), env=env)
    pod.wait_phase("serving")
    assert len(_events(pod, "remote_hit")) == 1, "a pod that cannot compile still takes a trusted copy"
    assert compiles(record) == 1
    (entry,) = entry_dirs(root_b)
    assert (entry / "signature.json").is_file(), "the signature came with it"
    assert _events(pod, "launching")[0]["signer"] == "builder-1"


@pytest.mark.parametrize("how", ["unsigned", "other-key", "rewritten"])
def test_an_untrusted_remote_entry_is_never_published_and_a_signing_pod_replaces_it(  # noqa: PLR0917  # pytest passes fixtures and parameters positionally
    pods: Cluster,
    tmp_path: Path,
    remote: dict[str, str],
    s3: S3Server,
    keys: dict[str, tuple[SecretKey, Path]],
    how: str,
) -> None:
    secret, key_file = keys["builder-1"]
    record = tmp_path / "compiler.jsonl"
    uploader_key = {"unsigned": None, "other-key": keys["other-1"][1], "rewritten": key_file}[how]
    _upload(pods, _root(tmp_path, "cluster-a"), record, remote, uploader_key)
    if how == "rewritten":
        _rewrite_an_artifact(s3, remote)
    trusting = {**remote, "CACHEMGR_TRUSTED_KEYS": str(secret.public)}

    root_b = _root(tmp_path, "cluster-b")
    options = [*_options(record), "--on-miss", "fail"]
    pod = pods.start("b0", server_argv(free_port()), cache_root=root_b, options=options, env=trusting)
    assert pod.wait_exit() == 69
    (warning,) = _events(pod, "remote_unusable_waiting_for_publisher")
    assert warning["problem"] == "untrusted"
    reason = {
        "unsigned": "untrusted: unsigned",
        "other-key": "untrusted: key other-1",
        "rewritten": "changed after signing",
    }
    assert reason[how] in warning["message"]
    assert entry_dirs(root_b) == [], "nothing untrusted is published here"
    assert not list((root_b / "staging").rglob("*")), "the download's staging is gone"
    assert compiles(record) == 1
    # `cachemgr pull` with the same keys refuses it the same way, with one line.
    remote_key = _remote_manifest(s3, remote)[1]["key"][:12]
    pulled = run_cli(
        "pull", remote_key, env={**pods.base_env, **trusting, "CACHEMGR_CACHE_ROOT": str(root_b)}
    )
    assert pulled.returncode == 74, pulled.stderr
    assert reason[how] in pulled.stderr
    assert entry_dirs(root_b) == []

    # A pod with the signing key compiles its own, and its upload replaces the remote's.
    builder = pods.start(
        "b1", server_argv(free_port()), cache_root=root_b, options=_options(record),
        env={**trusting, "CACHEMGR_SIGNING_KEY_FILE": str(key_file)},
    )  # fmt: skip
    builder.wait_phase("serving")
    assert compiles(record) == 2
    assert _events(builder, "remote_unusable_compiling_locally")[0]["problem"] == "untrusted"
    wait_for(lambda: _events(builder, "remote_uploaded"), what="the replacing upload", timeout=60)
    root_c = _root(tmp_path, "cluster-c")
    third = pods.start("c0", server_argv(free_port()), cache_root=root_c, options=options, env=trusting)
    third.wait_phase("serving")
    assert len(_events(third, "remote_hit")) == 1
    assert compiles(record) == 2


def test_an_untrusted_local_entry_does_not_block_a_trusted_remote_copy(
    pods: Cluster, tmp_path: Path, remote: dict[str, str], keys: dict[str, tuple[SecretKey, Path]]
) -> None:
    """With no signing key in this cluster (the bucket filled by another's builder), an entry
    planted on the volume under the key's name must not keep the pods from the bucket's signed
    copy: a planted entry would otherwise be a denial of service stronger than deleting one."""
    secret, key_file = keys["builder-1"]
    record = tmp_path / "compiler.jsonl"
    _upload(pods, _root(tmp_path, "cluster-a"), record, remote, key_file)
    root_b = _root(tmp_path, "cluster-b")
    planter = pods.start(
        "planter", server_argv(free_port()), cache_root=root_b, command="warm", options=_options(record)
    )  # an open-mode warm Job: the right name, a self-consistent manifest, no signature
    assert planter.wait_exit() == 0, planter.tail()
    (planted,) = entry_dirs(root_b)
    trusting = {**remote, "CACHEMGR_TRUSTED_KEYS": str(secret.public)}
    options = [*_options(record), "--on-miss", "fail"]
    pod = pods.start("b0", server_argv(free_port()), cache_root=root_b, options=options, env=trusting)
    pod.wait_phase("serving")
    assert _events(pod, "entry_untrusted")[0]["reason"] == "untrusted: unsigned"
    assert len(_events(pod, "remote_hit")) == 1
    assert _events(pod, "launching")[0]["signer"] == "builder-1"
    (entry,) = entry_dirs(root_b)
    assert (entry / "signature.json").is_file(), "the trusted copy took the name"
    (aside,) = (root_b / "quarantine").glob(f"{planted.name}.*[!n]")  # not the .reason.json
    reason = json.loads(aside.with_name(aside.name + ".reason.json").read_text())["reason"]
    assert reason.startswith("untrusted: unsigned"), "set aside with its reason, never deleted"
    assert compiles(record) == 2, "the other cluster's compile and the planter's; none here since"
