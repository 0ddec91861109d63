"""The chart's builder mode, toolbox and pre-upgrade warm Job, run as real processes.

As in tests/test_deploy.py, the chart is rendered by the real Helm and its containers run as the
manifests say (entrypoint scripts, environment, the stand-in ``vllm``). Here the pods' PVC mounts
are real bind mounts made as the kubelet makes them (cachemgr_testkit.kube.Node with ``bind``):
read-only where the manifest says, a ``subPath`` as the folder inside the volume, a mount inside
another over it. The signing key Secret is projected as the kubelet projects it (mode 0400).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from cachemgr_testkit.helm import TEST_IMAGE, template_text
from cachemgr_testkit.kube import ENTRYPOINT, Node, by_kind, merge, render, workload
from cachemgr_testkit.mounts import REQUIRE_MOUNTS_ENV
from cachemgr_testkit.podlib import DEADLINE, run_cli, wait_for
from cachemgr_testkit.trusted import new_key

WARM = {"prefill": {"warm": True}, "decode": {"warm": True}}
SECRET = "modelserver-signing-key"
Bind = Callable[[Path, Path, bool], Path]


def files_outside_usage(volume: Path) -> dict[str, tuple[int, int]]:
    """Every file of the volume but usage/, with its size and mtime: what a pod must not change."""
    found = {}
    for path in volume.rglob("*"):
        relative = path.relative_to(volume)
        if relative.parts[0] != "usage" and path.is_file() and not path.is_symlink():
            found[str(relative)] = (path.stat().st_size, path.stat().st_mtime_ns)
    return found


@pytest.fixture
def builder(tmp_path: Path, bind_mounts: Bind) -> Iterator[tuple[Node, list[dict[str, Any]]]]:
    """The builder mode as a trusting release installs it: trust.trustedKeys and the signing key
    Secret, both warm Jobs, a toolbox; trust.readOnlyServing left at auto. A node that mounts."""
    secret, key_file = new_key(tmp_path / "keys", "builder-1")
    values = merge(
        WARM,
        {
            "trust": {"trustedKeys": [str(secret.public)], "signingKeySecret": {"name": SECRET}},
            "toolbox": {"enabled": True},
        },
    )
    docs = render(tmp_path / "chart", values)
    node = Node(tmp_path / "node", bind=bind_mounts, secrets={SECRET: {"signing.key": key_file.read_bytes()}})
    try:
        yield node, docs
    finally:
        node.stop_all()


def test_a_read_only_serving_pod_sees_one_volume_read_only_with_usage_writable(
    builder: tuple[Node, list[dict[str, Any]]],
) -> None:
    """Issue 32, items 7 and 8: trusted keys make serving read-only by default; the claim is one
    volume mounted twice (read-only at the root, read-write at usage/). The warm Job builds and
    signs; the serving pod hits, writes its use record in usage/ and nothing else, and cannot write
    the rest of the volume."""
    node, docs = builder
    job, deployment = workload(docs, "Job", "prefill"), workload(docs, "Deployment", "prefill")
    warm = node.start(job)
    assert warm.wait_exit() == 0, warm.tail()
    volume = node.volumes["modelserver-prefill-compile-cache"]
    published = files_outside_usage(volume)
    assert any(name.endswith("signature.json") for name in published), "the builder signed its entry"

    served = node.start(deployment)
    served.wait_phase("serving")
    assert node.compiles() == 1, "the serving pod loaded the warm Job's entry"
    ready = node.probe("readinessProbe", served)
    assert ready.returncode == 0, ready.stdout
    root = Path(served.env["CACHEMGR_CACHE_ROOT"])
    with pytest.raises(OSError, match="Read-only file system") as refused:
        (root / "planted").write_bytes(b"")
    assert refused.value.errno == errno.EROFS
    assert list((volume / "usage").rglob(f"*{served.name}*")), "its use record, on the volume"
    (root / "usage" / "probe-write").write_bytes(b"")  # usage/ alone is writable to it
    served.proc.send_signal(signal.SIGTERM)
    assert served.wait_exit() == 0, served.tail()
    assert files_outside_usage(volume) == published, "the serving pod changed nothing outside usage/"


def test_the_toolbox_runs_cachemgr_on_the_roles_volume_and_stops_at_sigterm(
    builder: tuple[Node, list[dict[str, Any]]],
) -> None:
    """Issue 32, item 9: the toolbox waits; cachemgr's commands run in its environment on the
    role's volume, which it mounts read-write, judging entries by the release's trusted keys."""
    node, docs = builder
    job = workload(docs, "Job", "decode")
    assert node.start(job).wait_exit() == 0
    (toolbox,) = [
        d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "modelserver-toolbox-decode"
    ]
    box = node.start(toolbox)
    listed = run_cli("ls", "-o", "json", env=box.env)
    assert listed.returncode == 0, listed.stderr
    assert box.proc.poll() is None, box.tail()
    (entry,) = yaml.safe_load(listed.stdout)
    assert entry["role"] == "decode"
    assert entry["status"] == "published", entry  # trusted: the toolbox has the release's keys
    assert run_cli("du", env=box.env).returncode == 0
    pruned = run_cli("prune", "--stale-staging", "--yes", env=box.env)
    assert pruned.returncode == 0, pruned.stderr
    written = Path(box.env["CACHEMGR_CACHE_ROOT"]) / "toolbox-writes"
    written.write_bytes(b"")  # read-write, even in the builder mode (the NOTES say so)
    written.unlink()
    box.proc.send_signal(signal.SIGTERM)
    assert box.wait_exit() == 0, "its trap ends it cleanly (as PID 1 too: the next test)"


def test_the_toolbox_as_pid_1_reaps_what_an_exec_leaves_behind(tmp_path: Path) -> None:
    """cachemgr-toolbox as the PID 1 of a PID namespace, as in its pod: an orphan of an exec is
    reparented to it and reaped when it ends, and SIGTERM (which the kernel does not deliver to a
    PID 1 without a handler) stops it."""
    init = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", str(ENTRYPOINT / "cachemgr-toolbox")],
        start_new_session=True,
    )
    try:

        def first_child() -> int | None:
            if init.poll() is not None:
                no_namespaces(f"unshare --pid exited {init.returncode}")
            children = psutil.Process(init.pid).children()
            return children[0].pid if children else None

        pid1: int = wait_for(first_child, what="the toolbox as PID 1 of its namespace")

        def in_namespace(*argv: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                ["nsenter", "-t", str(pid1), "-p", "-m", "--", *argv],
                capture_output=True, text=True, timeout=DEADLINE, check=False,
            )  # fmt: skip

        # An exec's shell starts a child and exits: the child is now the namespace's init's.
        started = in_namespace("sh", "-c", "sleep 0.2 & exit 0")
        if started.returncode != 0:
            no_namespaces(f"nsenter: {started.stderr.strip()}")

        def orphan_left() -> bool:
            listed = in_namespace("ps", "-e", "-o", "stat=,args=").stdout.splitlines()
            return any("sleep 0.2" in line or line.lstrip().startswith("Z") for line in listed)

        wait_for(lambda: not orphan_left(), what="the orphan to end and be reaped (no zombie)")
        os.kill(pid1, signal.SIGTERM)
        assert init.wait(timeout=DEADLINE) == 0
    finally:
        if init.poll() is None:
            os.killpg(init.pid, signal.SIGKILL)
            init.wait(timeout=10)


def no_namespaces(reason: str) -> None:
    """Skip where PID namespaces cannot be made; fail where the run requires them (CI, as root)."""
    if os.environ.get(REQUIRE_MOUNTS_ENV) == "1":
        pytest.fail(f"{REQUIRE_MOUNTS_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def test_the_pre_upgrade_warm_job_compiles_what_the_new_pods_then_load(tmp_path: Path) -> None:
    """Issue 32, item 3: the hook Job (helm upgrade, warm.hook, the PVC there) is the warm Job's
    pod under a fixed name: run first, it compiles the new image's key; the new pods hit."""
    claims = {
        f"modelserver-{role}-compile-cache": {"spec": {"accessModes": ["ReadWriteMany"]}}
        for role in ("prefill", "decode")
    }
    values = merge(
        TEST_IMAGE,
        merge(
            WARM,
            {"warm": {"hook": True}, "image": {"tag": "sdk-0.13"}, "testing": {"existingClaims": claims}},
        ),
    )
    result = template_text(values, work=tmp_path / "chart", extra=("--is-upgrade",))
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    node = Node(tmp_path / "node")
    try:
        for role in ("prefill", "decode"):
            hook = workload(docs, "Job", role)
            assert hook["metadata"]["name"] == f"modelserver-{role}-warm"
            assert hook["metadata"]["annotations"]["helm.sh/hook"] == "pre-upgrade"
            before = node.compiles()
            assert node.start(hook).wait_exit() == 0
            assert node.compiles() == before + 1
            pod = node.start(workload(docs, "Deployment", role))
            pod.wait_phase("serving")
            assert node.compiles() == before + 1, "the rolled pod found the hook's entry"
            pod.proc.send_signal(signal.SIGTERM)
            assert pod.wait_exit() == 0
    finally:
        node.stop_all()
