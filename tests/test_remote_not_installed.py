"""A remote tier configured where its client (boto3) is not installed (issue 33, case 6).

``run`` on a miss exited 70 with a traceback: the transfer's child died (-6), then describing its
failure imported botocore in the pod. Now a pod warns once, naming the extra to install, and
compiles locally (the tier is optional: every other way it can be unusable already costs a pod
just that; why, in ``Runner.remote``); the operator's remote commands, which are the tier, exit
78 with the same remedy.

A real install without boto3: ``scripts/install VENV demo`` (cachemgr from this checkout and the
stand-ins, no extra), made once for the module; real pods and the real CLI run from it.
"""

from __future__ import annotations

import fcntl
import signal
import subprocess
from pathlib import Path

import pytest
from cachemgr_testkit.podlib import Cluster, error_lines, free_port, run_cli
from cachemgr_testkit.scenarios import compile_cmd, compiles, entry_dirs, server_argv

ROOT = Path(__file__).resolve().parent.parent
INSTALL = "pip install 'cachemgr[remote]'"
# A remote nobody listens at: never reached, since the client is missing before any request.
REMOTE = {"CACHEMGR_REMOTE": "s3://fleet/compile-cache", "CACHEMGR_REMOTE_ENDPOINT": "http://127.0.0.1:9"}


@pytest.fixture(scope="module")
def without_boto3(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The Python of a fresh venv with cachemgr (this checkout) and the stand-ins, without boto3."""
    venv = tmp_path_factory.mktemp("no-remote") / "venv"
    # One install at a time across xdist workers: pip builds cachemgr and the stand-ins in their
    # source folders' build/, and two at once collide there (a clean-clone CI run: "File exists:
    # 'build/bdist.linux-x86_64/wheel/cachemgr_standin-0.1.0.dist-info'"). The workers share
    # the base temp folder's parent.
    lock = tmp_path_factory.getbasetemp().parent / "scripts-install.lock"
    with lock.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        done = subprocess.run(
            [str(ROOT / "scripts" / "install"), str(venv), "demo"],
            check=False,
            capture_output=True,
            text=True,
            timeout=600,
        )
    # What pip said, when it fails: a clean-clone CI run once failed here with nothing to read.
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    python = str(venv / "bin" / "python")
    found = subprocess.run(
        [python, "-c", "import cachemgr; import boto3"], capture_output=True, text=True, check=False, cwd=venv
    )
    assert found.returncode == 1
    assert "No module named 'boto3'" in found.stderr
    return python


def _options(record: Path) -> list[str]:
    return ["--strategy", "command", "--compile-cmd", compile_cmd(record)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("command", ["run", "warm"])
def test_a_pod_warns_once_naming_the_extra_and_compiles(
    pods: Cluster, root: Path, without_boto3: str, command: str
) -> None:
    record = pods.work / "compiler.jsonl"
    pod = pods.start(
        "p", server_argv(free_port()), cache_root=root, command=command, options=_options(record), env=REMOTE,
        python=without_boto3, cwd=pods.work,  # the install's own copy of cachemgr, not the checkout's
    )  # fmt: skip
    if command == "run":
        pod.wait_phase("serving")
        pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0, pod.tail()
    assert compiles(record) == 1
    assert len(entry_dirs(root)) == 1
    warnings = [e for e in pod.log_events() if e.get("level") == "warning"]
    assert [e["event"] for e in warnings] == ["remote_not_installed"], "one warning, the upload none"
    assert INSTALL in warnings[0]["message"]
    assert "boto3" in warnings[0]["message"]
    assert "Traceback" not in pod.log.read_text()


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "args",
    [
        ["ls", "--remote"],
        ["push"],
        ["pull", "0123456789ab"],
        ["prune", "--remote", "--key", "x", "--dry-run"],
    ],
)
def test_the_remote_commands_exit_78_naming_the_extra(
    pods: Cluster, root: Path, without_boto3: str, args: list[str]
) -> None:
    env = {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root), **REMOTE}
    done = run_cli(*args, env=env, python=without_boto3, cwd=pods.work)
    assert done.returncode == 78, done.stderr
    (line,) = error_lines(done.stderr)
    assert INSTALL in line
    assert "needs boto3, which this install of cachemgr lacks" in line
    assert "Traceback" not in done.stderr
