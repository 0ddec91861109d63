"""Another NPU type's entries are another hardware's, not dead (issue 12, defect 12).

A role's Deployment may run on nodes of two NPU types sharing one volume. If a CA25 pod's
``--auto-prune incompatible`` (or an operator's ``prune --incompatible`` from it) removed the
CA12 entries, the CA12 pods would recompile and remove the CA25 ones in turn: a ping-pong of
11-minute compiles. Only entries no pod of this image can use (another compiler major.minor)
are incompatible; another NPU's go when named (``prune --for-npu``), or by age or LRU.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from cachemgr_testkit.podlib import Cluster, free_port, run_cli
from cachemgr_testkit.scenarios import compile_cmd, entry_dirs, server_argv


def warm(pods: Cluster, root: Path, name: str, **env: str) -> None:
    options = [
        "--strategy",
        "command",
        "--compile-cmd",
        compile_cmd(pods.work / "compiler.jsonl", seconds=0.1),
    ]
    job = pods.start(
        name, server_argv(free_port()), cache_root=root, command="warm", options=options, env=env
    )
    assert job.wait_exit() == 0, job.tail()


def cachemgr(root: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env={**env, "CACHEMGR_CACHE_ROOT": str(root)})


def prune_json(root: Path, env: dict[str, str], *args: str) -> dict[str, Any]:
    done = cachemgr(root, env, "prune", *args, "-o", "json")
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def npus(root: Path) -> list[tuple[str, str]]:
    """(compiler, NPU) of each entry, from its name: model__role__c<compiler>__<npu>__digest."""
    return sorted((p.name.split("__")[2], p.name.split("__")[3]) for p in entry_dirs(root))


def test_incompatible_keeps_another_npus_entries_and_npu_names_them(pods: Cluster, root: Path) -> None:
    warm(pods, root, "ca12", CACHEMGR_NPU_TYPE="RBLN-CA12")
    warm(pods, root, "ca25-old-sdk", CACHEMGR_COMPILER_VERSION="0.11.0")
    assert npus(root) == [("c0.11", "RBLN-CA25"), ("c0.12", "RBLN-CA12")]

    # A CA25 pod on a miss, with --auto-prune incompatible: only the old SDK's entry goes.
    options = [
        "--strategy", "command", "--compile-cmd", compile_cmd(pods.work / "compiler.jsonl", seconds=0.1),
        "--auto-prune", "incompatible",
    ]  # fmt: skip
    pod = pods.start("ca25", server_argv(free_port()), cache_root=root, options=options)
    pod.wait_phase("serving")
    assert npus(root) == [("c0.12", "RBLN-CA12"), ("c0.12", "RBLN-CA25")]

    env = pods.base_env  # this image: compiler 0.12, NPU RBLN-CA25
    done = prune_json(root, env, "--incompatible", "--yes")
    assert done["plan"]["items"] == []
    assert npus(root) == [("c0.12", "RBLN-CA12"), ("c0.12", "RBLN-CA25")]

    listing = cachemgr(root, env, "ls")
    assert listing.returncode == 0, listing.stderr
    assert "1 entry for other NPU types (RBLN-CA12; this pod has RBLN-CA25)" in " ".join(
        listing.stdout.split()
    )
    assert "'cachemgr prune --for-npu RBLN-CA12' removes them" in " ".join(listing.stdout.split())
    rows = json.loads(cachemgr(root, env, "ls", "-o", "json").stdout)["items"]
    assert {r["npu"]: r["status"] for r in rows if r["kind"] == "entry"} == {
        "RBLN-CA12": "published",
        "RBLN-CA25": "published",
    }

    # Named, in any case, they go; the pod's own entry (in use, and this NPU's) stays.
    done = prune_json(root, env, "--for-npu", "rbln-ca12", "--yes")
    assert [i["reason"] for i in done["result"]["removed"]] == ["for NPU RBLN-CA12 (--for-npu)"]
    assert npus(root) == [("c0.12", "RBLN-CA25")]
    # The old spelling still works, with a deprecation note on stderr.
    old = cachemgr(root, env, "prune", "--npu", "RBLN-CA25", "--yes", "-o", "json")
    assert "--npu is deprecated" in old.stderr
    done = json.loads(old.stdout)
    assert done["plan"]["items"] == []
    assert [k["reason"] for k in done["plan"]["kept"]] == ["in use by ca25"]
    assert pod.proc.poll() is None


def test_npu_needs_a_plausible_name(root: Path, pods: Cluster) -> None:
    done = cachemgr(root, pods.base_env, "prune", "--for-npu", "x" * 100_000, "--yes")
    assert done.returncode == 64
    assert len(done.stderr) < 1000
    assert len(done.stderr.strip().splitlines()) == 1, "the one line, once"
    assert "Traceback" not in done.stderr


def test_incompatible_no_longer_needs_the_npu(root: Path, pods: Cluster) -> None:
    warm(pods, root, "ca25-old-sdk", CACHEMGR_COMPILER_VERSION="0.11.0")
    env = {k: v for k, v in pods.base_env.items() if k != "CACHEMGR_NPU_TYPE"}
    done = prune_json(root, env, "--incompatible", "--yes")
    assert [i["reason"] for i in done["result"]["removed"]] == [
        "incompatible: compiler 0.11, this image has 0.12"
    ]


def test_explain_names_the_other_npus_entries_by_the_flag_prune_takes_now(root: Path, pods: Cluster) -> None:
    """Issue 34: explain's advice named ``prune --npu TYPE``, the deprecated spelling, and no type."""
    warm(pods, root, "ca12", CACHEMGR_NPU_TYPE="RBLN-CA12")
    options = [
        "--strategy",
        "command",
        "--compile-cmd",
        compile_cmd(pods.work / "compiler.jsonl", seconds=0.1),
    ]
    done = cachemgr(root, pods.base_env, "explain", *options, "--", *server_argv(8000))
    assert done.returncode == 1, done.stderr  # a miss: this pod is an RBLN-CA25
    assert "'cachemgr prune --for-npu RBLN-CA12' removes them" in " ".join(done.stdout.split()), done.stdout
    assert "--npu " not in done.stdout, done.stdout
