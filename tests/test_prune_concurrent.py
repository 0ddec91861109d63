"""``prune`` beside pods that keep starting: it never removes an entry a pod uses.

Real processes only: ``cachemgr run`` pods start one after another on three "replicas", each
hits (or, when prune removed the entry between two pods, recompiles) one key, serves, and is
stopped; meanwhile ``cachemgr prune --unused-for 0s --yes`` runs again and again, so every
entry that no pod uses at that instant is fair game. While each pod serves, its entry must
be there and intact, and its server must have loaded exactly the published bytes (the stand-in
server's ``load`` event carries a digest of what it read). Coordination is by pod phases and
files, never by sleeping.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cachemgr_standin.compiler import load_compiled_dir
from cachemgr_testkit.podlib import DEADLINE, Cluster, Pod, cluster, free_port, npu_node
from cachemgr_testkit.scenarios import MODEL, compile_cmd, entry_dirs, server_argv

from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.manifest import check_files, read_manifest
from cachemgr.volume.records import users

REPLICAS = 2
STARTS_PER_REPLICA = 7


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[Cluster]:
    with cluster(tmp_path / "work", STANDIN_COMPILE_SECONDS="0.1") as group:
        yield group


class PruneLoop(threading.Thread):
    """``cachemgr prune --unused-for 0s --yes`` again and again until stopped."""

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(name="prune-loop", daemon=True)
        self.env = env
        self.stop = threading.Event()
        self.results: list[dict[str, Any]] = []
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            done = subprocess.run(
                [sys.executable, "-m", "cachemgr", "prune", "--unused-for", "0s", "--yes", "-o", "json"],
                env=self.env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=DEADLINE, check=False,
            )  # fmt: skip
            if done.returncode != 0:
                self.errors.append(f"exit {done.returncode}: {done.stderr}")
                continue
            self.results.append(json.loads(done.stdout))

    def removed(self) -> list[str]:
        return [item["name"] for r in self.results if r["result"] for item in r["result"]["removed"]]


def test_prune_running_beside_starting_pods_never_removes_an_entry_in_use(pods: Cluster, root: Path) -> None:
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=0.2)]
    warm = pods.start("warm", server_argv(free_port()), cache_root=root, options=options, command="warm")
    assert warm.wait_exit() == 0
    (entry,) = entry_dirs(root)
    key = read_manifest(entry).key
    expected = load_compiled_dir(entry / "artifacts")[0]
    for tp in (2, 8):  # entries nobody uses: the first prune takes them
        other = ["vllm", "serve", MODEL, "--tensor-parallel-size", str(tp), "--port", str(free_port())]
        job = pods.start(
            f"warm-{tp}",
            other,
            cache_root=root,
            command="warm",
            env={"VLLM_RBLN_COMPILE_ONLY": "1", **npu_node(pods.work)},
        )
        assert job.wait_exit() == 0
    assert len(entry_dirs(root)) == 3

    pruner = PruneLoop({**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)})
    served: list[str] = []
    failures: list[str] = []

    def replica(index: int) -> None:
        # At least STARTS_PER_REPLICA starts, and on until prune has run three times beside them
        # (each prune waits a beat before it trusts an absence: issue 40), within the deadline.
        deadline = time.monotonic() + 240
        start = 0
        while start < STARTS_PER_REPLICA or (len(pruner.results) < 3 and time.monotonic() < deadline):
            start += 1
            pod = pods.start(f"r{index}-{start}", server_argv(free_port()), cache_root=root, options=options)
            try:
                check_while_serving(pod, root, key, expected)
                served.append(pod.name)
            except AssertionError as error:
                failures.append(f"{pod.name}: {error}")
            finally:
                pod.signal(15)
                pod.wait_exit()

    pruner.start()
    replicas = [threading.Thread(target=replica, args=(i,), name=f"replica-{i}") for i in range(REPLICAS)]
    for thread in replicas:
        thread.start()
    for thread in replicas:
        thread.join(timeout=300)
    pruner.stop.set()
    pruner.join(timeout=DEADLINE)

    assert failures == []
    assert len(served) >= REPLICAS * STARTS_PER_REPLICA
    assert pruner.errors == []
    assert len(pruner.results) >= 3, "prune ran again and again while pods started"
    removed = pruner.removed()
    assert {name for name in removed if "__c0.12__" in name and key[:16] not in name}, (
        "the unused entries went"
    )
    kept = [k for r in pruner.results for k in r["plan"]["kept"]]
    skipped = [s for r in pruner.results if r["result"] for s in r["result"]["skipped"]]
    assert kept or skipped, "some prune met a pod using the entry"


def check_while_serving(pod: Pod, root: Path, key: str, expected: str) -> None:
    """The pod serves: its entry is published and intact, and its server read exactly those bytes."""
    pod.wait_phase("serving", timeout=90)
    published = [p for p in entry_dirs(root) if p.name.endswith(key[:16])]
    assert published, "a serving pod's entry is published"
    entry = published[0]
    assert check_files(entry, read_manifest(entry), mode="full") == [], "the entry of a serving pod is intact"
    assert pod.name in {u.pod for u in users(CacheRoot(root), key)}
    view = str(pod.state_dir) + "/"
    loads = [
        e for e in read_events(pod) if e.get("event") == "load" and str(e.get("path", "")).startswith(view)
    ]
    assert [e["digest"] for e in loads] == [expected], "the server loaded the published bytes once"
    assert pod.proc.poll() is None


def read_events(pod: Pod) -> list[dict[str, Any]]:
    """The stand-ins' record; another server may be appending its line right now."""
    events = []
    for line in Path(pod.env["STANDIN_RECORD"]).read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events
