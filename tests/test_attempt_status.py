"""``ls`` tells a dead pod's attempt from a running one (issue 12, defect 11).

With the vllm strategy a pod publishes a snapshot of its compile and its server goes on running
from its own staging copy: ``ls`` says so ("published"). Once that pod is SIGKILLed on another
node (no pid to probe from here), the copy is a leftover: it must not be labelled as a running
server's, nor as a compile in progress, however fresh its lease or published its key.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

from cachemgr_testkit.podlib import Cluster, free_port, run_cli, wait_for
from cachemgr_testkit.scenarios import compile_cmd, server_argv, vllm_argv

from cachemgr.ops.attempts import SILENT_ATTEMPT_AFTER


def ls(root: Path, env: dict[str, str], *args: str) -> str:
    done = run_cli("ls", *args, env={**env, "CACHEMGR_CACHE_ROOT": str(root)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def attempt_row(root: Path, env: dict[str, str]) -> dict[str, Any]:
    (row,) = [r for r in json.loads(ls(root, env, "-o", "json"))["items"] if r["kind"] == "staging"]
    result: dict[str, Any] = row
    return result


def wait_silent(root: Path) -> None:
    """Until the attempt's owner record has not beaten for longer than ``ls`` allows."""
    (owner,) = (root / "staging").glob("*/*.json")
    wait_for(
        lambda: time.time() - owner.stat().st_mtime > SILENT_ATTEMPT_AFTER + 0.5,
        timeout=SILENT_ATTEMPT_AFTER + 30,
        what="the killed pod's heartbeat to fall silent",
    )


def test_a_sigkilled_pods_published_attempt_is_not_a_running_server(pods: Cluster, root: Path) -> None:
    pod = pods.start("vllm-pod", vllm_argv(free_port()), cache_root=root, node="node-b")
    pod.wait_phase("serving", timeout=90)
    row = attempt_row(root, pods.base_env)
    assert (row["status"], row["in_use"]) == ("published", True), "alive: its server runs from its copy"

    pod.signal_pod(signal.SIGKILL)
    pod.wait_exit()
    wait_silent(root)
    row = attempt_row(root, pods.base_env)
    assert (row["status"], row["in_use"]) == ("silent", False)
    assert "its pod is gone" in row["problem"]
    text = ls(root, pods.base_env)
    assert "still runs from its own copy" not in text
    assert "silent" in text


def test_a_sigkilled_compile_is_not_shown_compiling_while_its_lease_lasts(pods: Cluster, root: Path) -> None:
    record = pods.work / "compiler.jsonl"
    options = [
        "--strategy",
        "command",
        "--compile-cmd",
        compile_cmd(record, seconds=60),
        "--lease-duration",
        "300",
    ]
    pod = pods.start(
        "compiler-pod", server_argv(free_port()), cache_root=root, options=options, node="node-b"
    )
    pod.wait_phase("compiling")
    wait_for(record.exists, what="the compiler to start")
    assert attempt_row(root, pods.base_env)["status"] == "compiling"

    pod.signal_pod(signal.SIGKILL)
    pod.wait_exit()
    wait_silent(root)
    row = attempt_row(root, pods.base_env)
    assert (row["status"], row["in_use"]) == ("silent", False), (
        "a 300 s lease is still fresh, but nothing compiles"
    )
