"""Clock skew between nodes never lets ``prune`` remove an entry in use (issue 12, defect 3).

A serving pod runs with a normal clock; ``prune`` runs under libfaketime (Debian package
``faketime``) 3 minutes ahead, 10 minutes ahead and 10 minutes behind, on a local directory and
on two JuiceFS mounts of one volume (two nodes, JuiceFS's default 1 s metadata caches). The
entry the pod serves must stay, its server must keep running, and a pod that died must still
lose its claim, so prune stays useful.

Only prune's clock is faked: the record's mtime comes from the kernel (local disk) or from the
JuiceFS client process (a Go binary, which libfaketime cannot fake). What cachemgr compares is
"prune's clock minus the record's mtime", so a skewed observer and a skewed writer are the same
case with the sign flipped: +10 min and -10 min cover both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.mounts import REQUIRE_MOUNTS_ENV
from cachemgr_testkit.podlib import DEADLINE, FAKETIME_LIB, Cluster, Pod, free_port, skewed_env
from cachemgr_testkit.scenarios import compile_cmd, entry_dirs, server_argv, vllm_argv

from cachemgr.ops.prune import execute
from cachemgr.ops.prune_plan import PruneRequest, plan_prune
from cachemgr.ops.scan import scan
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.manifest import check_files, read_manifest
from cachemgr.volume.records import OBSERVE_SECONDS, register_use

SKEWS = ("+3m", "+10m", "-10m")


@pytest.fixture
def faketime() -> str:
    """libfaketime itself, preloaded (not the ``faketime`` wrapper): the wrapper makes a /dev/shm
    semaphore named by its pid and exits with "sem_open: File exists" when a killed earlier wrapper
    left one under a pid now reused (pid_max is 32768 here), a name shared by every run on the machine."""
    found = FAKETIME_LIB
    if found is None:
        if os.environ.get(REQUIRE_MOUNTS_ENV) == "1":
            pytest.fail("faketime is not installed (Debian package faketime; .ci/run installs it)")
        pytest.skip("faketime is not installed (apt-get install faketime)")
    return found


@pytest.fixture(params=["local", "juicefs"])
def nodes(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Path]:
    """The cache root as the serving pod's node sees it, and as prune's node sees it."""
    if request.param == "local":
        root = tmp_path / "volume"
        root.mkdir()
        return root, root
    factory: Callable[..., list[Path]] = request.getfixturevalue("juicefs_volume_factory")
    mounts = factory(mounts=2, metadata_cache_s=1.0)  # juicefs' own default caches, as a cluster mounts it
    (mounts[0] / "cache").mkdir()
    return mounts[0] / "cache", mounts[1] / "cache"


def cachemgr_at(
    skew: str | None, faketime: str, root: Path, env: dict[str, str], *args: str
) -> dict[str, Any]:
    """``cachemgr ARGS -o json`` on ``root``, its clock shifted by ``skew`` (None: the real clock)."""
    argv = [sys.executable, "-m", "cachemgr", *args, "-o", "json"]
    # As `faketime -f SKEW`, which sets these two and fakes the monotonic clock too.
    clock = {} if skew is None else {"LD_PRELOAD": faketime, "FAKETIME": skew}
    done = subprocess.run(
        argv,
        env={**env, "CACHEMGR_CACHE_ROOT": str(root), **clock},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def removed(done: dict[str, Any]) -> list[str]:
    """Names a ``prune -o json`` removed (its result is null when the plan was empty)."""
    return [item["name"] for item in (done["result"] or {}).get("removed", [])]


def serve(pods: Cluster, root: Path, record: Path) -> tuple[Pod, Path]:
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=0.1)]
    pod = pods.start("serving", server_argv(free_port()), cache_root=root, options=options, node="node-a")
    pod.wait_phase("serving", timeout=90)
    (entry,) = entry_dirs(root)
    return pod, entry


def warm_unused(pods: Cluster, root: Path, record: Path) -> Path:
    """A second entry (another role) that nobody uses: prune must stay able to remove it."""
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=0.1)]
    job = pods.start(
        "warm-decode", server_argv(free_port()), cache_root=root, command="warm", options=options,
        env={"CACHEMGR_ROLE": "decode"},
    )  # fmt: skip
    assert job.wait_exit() == 0, job.tail()
    (entry,) = [p for p in entry_dirs(root) if "__decode__" in p.name]
    return entry


def test_prune_with_a_skewed_clock_never_removes_an_entry_in_use(
    pods: Cluster, nodes: tuple[Path, Path], faketime: str
) -> None:
    served_root, prune_root = nodes
    record = pods.work / "compiler.jsonl"
    pod, entry = serve(pods, served_root, record)
    unused = warm_unused(pods, served_root, record)
    env = pods.base_env
    for skew in SKEWS:
        done = cachemgr_at(skew, faketime, prune_root, env, "prune", "--keep-bytes", "0", "--yes")
        assert entry.name not in removed(done), f"skew {skew}"
        assert any(k["name"] == entry.name and "serving" in k["reason"] for k in done["plan"]["kept"]), done
        assert check_files(entry, read_manifest(entry), mode="full") == [], f"skew {skew}: entry intact"
        assert pod.proc.poll() is None, f"skew {skew}: the server was disturbed:\n{pod.tail()}"
    assert not unused.exists(), "an entry nobody uses still goes"

    # --auto-prune incompatible in a pod of a newer SDK runs the same plan: --incompatible.
    newer = {**env, "CACHEMGR_COMPILER_VERSION": "0.13.0"}
    done = cachemgr_at("+10m", faketime, prune_root, newer, "prune", "--incompatible", "--yes")
    assert removed(done) == []
    assert entry.exists()

    # ls never waits: from a node 10 minutes ahead, the record is shown as silent, not in use.
    rows = cachemgr_at("+10m", faketime, prune_root, env, "ls")["items"]
    (row,) = [r for r in rows if r["kind"] == "entry"]
    assert [u["pod"] for u in row["silent_users"]] == ["serving"]


@pytest.mark.parametrize("skew", ["+3m", "-10m"])
def test_a_dead_pods_use_still_expires_under_skew(
    pods: Cluster, nodes: tuple[Path, Path], faketime: str, skew: str
) -> None:
    served_root, prune_root = nodes
    pod, entry = serve(pods, served_root, pods.work / "compiler.jsonl")
    pod.signal_pod(signal.SIGKILL)
    pod.wait_exit()
    assert list((served_root / "usage").glob("*/*.json")), "a killed pod leaves its use record behind"
    shown = cachemgr_at(skew, faketime, prune_root, pods.base_env, "show", entry.name)
    assert (shown["in_use"], [u["pod"] for u in shown["silent_users"]]) == (False, ["serving"])
    started = time.monotonic()
    done = cachemgr_at(skew, faketime, prune_root, pods.base_env, "prune", "--keep-bytes", "0", "--yes")
    took = time.monotonic() - started
    assert removed(done) == [entry.name]
    # The cost of a silent record: one observation window, not one per entry or per record.
    assert took < OBSERVE_SECONDS + 15, f"prune took {took:.1f}s"


def test_a_pod_registering_after_the_plan_stops_the_removal_whatever_its_clock(
    pods: Cluster, root: Path
) -> None:
    """Between plan and removal, prune compares the usage folder with what it planned on.

    The pod's record is stamped 10 minutes in the past (a node whose clock is behind, or a
    prune whose clock is ahead): by the clock it is long dead, but it was not there at the
    plan, so the entry stays.
    """
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(pods.work / "c.jsonl", seconds=0.1)]
    job = pods.start("warm", server_argv(free_port()), cache_root=root, command="warm", options=options)
    assert job.wait_exit() == 0, job.tail()
    (entry,) = entry_dirs(root)
    cache = CacheRoot(root)
    identity = PodIdentity.current()
    plan = plan_prune(cache, scan(cache), PruneRequest(keep_bytes=0), identity=identity)
    assert [i.name for i in plan.items] == [entry.name]
    key = read_manifest(entry).key
    late = register_use(cache, key, PodIdentity("late-pod", "node-b", "node-b", 1), entry=entry.name)
    past = time.time() - 600
    os.utime(late, (past, past))
    result = execute(cache, plan, identity=identity)
    assert result.removed == ()
    assert [why for _, why in result.skipped] == ["in use now"]
    assert entry.exists()
    assert late.exists()


def test_prune_with_only_fresh_records_does_not_wait(pods: Cluster, root: Path) -> None:
    """The common case: every record fresh by this clock, so no observation at all."""
    pod, entry = serve(pods, root, pods.work / "compiler.jsonl")
    cache = CacheRoot(root)
    started = time.monotonic()
    plan = plan_prune(cache, scan(cache), PruneRequest(keep_bytes=0), identity=PodIdentity.current())
    assert time.monotonic() - started < 1.0
    assert plan.items == ()
    assert [name for name, _ in plan.kept] == [entry.name]
    assert pod.proc.poll() is None


def test_prune_stale_staging_with_a_skewed_clock_never_removes_a_live_compile(
    pods: Cluster, nodes: tuple[Path, Path], faketime: str
) -> None:
    served_root, prune_root = nodes
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=60)]
    pod = pods.start(
        "compiling", server_argv(free_port()), cache_root=served_root, options=options, node="node-b"
    )
    pod.wait_phase("compiling")
    done = cachemgr_at("+10m", faketime, prune_root, pods.base_env, "prune", "--stale-staging", "--yes")
    assert done["plan"]["items"] == [], "ten minutes silent by prune's clock, but its heartbeat beats"
    assert list((served_root / "staging").glob("*/*/")), "the attempt is still there"
    assert pod.phase == "compiling"

    pod.signal_pod(signal.SIGKILL)
    pod.wait_exit()
    done = cachemgr_at("+10m", faketime, prune_root, pods.base_env, "prune", "--stale-staging", "--yes")
    assert [i["kind"] for i in done["result"]["removed"]] == ["staging"], "a dead pod's attempt still goes"


def test_a_damaged_entry_of_unknown_key_in_use_survives_prune_damaged_under_skew(
    pods: Cluster, root: Path, faketime: str
) -> None:
    """With summary.json and key.json gone, the key is known only by the 16 digits in the name."""
    pod, entry = serve(pods, root, pods.work / "compiler.jsonl")
    entry.chmod(0o755)
    for name in ("summary.json", "key.json"):
        (entry / name).unlink()
    done = cachemgr_at("+10m", faketime, root, pods.base_env, "prune", "--damaged", "--yes")
    assert removed(done) == []
    assert [s["skipped_because"] for s in done["result"]["skipped"]] == ["in use now"]
    assert entry.is_dir()
    assert pod.proc.poll() is None


def test_a_holder_whose_clock_is_ahead_never_cleans_a_live_pods_staging(
    pods: Cluster, root: Path, faketime: str
) -> None:
    """A pod serving from its own staging (a configuration that cannot be cached publishes
    nothing) keeps beating its attempt's owner record. The next holder of that key, on a node
    whose clock is 10 minutes ahead, sees the record 10 minutes old: it must watch the record
    beat and leave the live server's files alone (stale.dead_attempts), yet still clean up an
    attempt whose pod is gone."""
    argv = vllm_argv(free_port(), "--model-impl", "vllm", "--enforce-eager")
    first = pods.start("eager", argv, cache_root=root, node="node-a")
    first.wait_phase("serving")
    (attempt,) = [p for p in (root / "staging").glob("*/*") if p.is_dir()]
    files = {str(p) for p in attempt.rglob("*")}
    assert files, "the serving pod's staging holds its server's files"

    again = vllm_argv(free_port(), "--model-impl", "vllm", "--enforce-eager")
    ahead = pods.start("ahead", again, cache_root=root, node="node-b", env=skewed_env(600))
    ahead.wait_phase("serving", timeout=90)
    assert files <= {str(p) for p in attempt.rglob("*")}, "the live pod's staging lost files"
    assert first.proc.poll() is None, first.tail()

    first.signal_pod(signal.SIGKILL)
    first.wait_exit()
    third = vllm_argv(free_port(), "--model-impl", "vllm", "--enforce-eager")
    later = pods.start("later", third, cache_root=root, node="node-c", env=skewed_env(600))
    later.wait_phase("serving", timeout=90 + OBSERVE_SECONDS)
    assert not attempt.exists(), "a dead pod's attempt is removed once seen not to beat"
    assert ahead.proc.poll() is None, ahead.tail()
