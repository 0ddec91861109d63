"""A folder 1,100 levels deep inside an entry, under the usual container limit of 1,024 open files
(issue 33, case 4).

A walk that holds a descriptor per level ran out of them on one planted chain: trusting pods and
the builder exited 74 "Too many open files", ``verify --fix`` reported it and moved nothing,
``prune --damaged`` found nothing, and ``prune --key`` moved the entry to ``trash/`` and then
failed to delete it. The walk now holds a few descriptors whatever the depth
(``cachemgr.core.safewalk``), so every command gets through such a chain, and what a pod refuses
``verify --fix``, ``prune --damaged`` and ``prune --key`` remove, wherever it went.

Real pods and the real CLI, each with a real ``ulimit -n 1024`` (``setrlimit`` in the child), a
real chain of 1,100 folders, and a canary outside the root that a link at the bottom points to.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.hostile import deep_folder, depth_of, file_leaf, link_leaf, remove_deep
from cachemgr_testkit.podlib import Cluster, free_port, run_cli
from cachemgr_testkit.scenarios import compile_cmd, compiles, entry_dirs, server_argv
from cachemgr_testkit.trusted import new_key, writable

DEPTH = 1_100
OPEN_FILES = 1_024


@pytest.fixture
def deep_root(tmp_path: Path) -> Iterator[Path]:
    """The volume, removed at the end however deep it got (pytest's own cleanup recurses)."""
    path = tmp_path / "volume"
    path.mkdir()
    yield path
    remove_deep(path)


def _cli(pods: Cluster, root: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    done = run_cli(
        *args,
        env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root), **(env or {})},
        open_files=OPEN_FILES,
    )
    assert "Traceback" not in done.stderr, f"{args}:\n{done.stderr[-1500:]}"
    assert "Too many open files" not in done.stdout + done.stderr, f"{args}:\n{done.stderr[-1500:]}"
    return done


def _plant_chain(entry: Path, *, leaf: Any) -> Path:
    writable(entry)
    first = deep_folder(entry / "artifacts", DEPTH, leaf=leaf)
    assert depth_of(first) == DEPTH
    return first


def _quarantined(root: Path) -> list[Path]:
    return sorted(p for p in (root / "quarantine").iterdir() if p.is_dir())


def test_a_chain_of_1100_folders_is_walked_refused_and_removed_within_1024_open_files(
    pods: Cluster, deep_root: Path, tmp_path: Path
) -> None:
    root = deep_root
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "weights.bin").write_bytes(b"the pod's model weights")
    secret, key_file = new_key(tmp_path / "keys", "builder-1")
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record)]
    builder = {"CACHEMGR_SIGNING_KEY_FILE": str(key_file), "CACHEMGR_TRUSTED_KEYS": str(secret.public)}

    def warm(name: str) -> None:
        job = pods.start(
            name, server_argv(free_port()), cache_root=root, command="warm", options=options,
            env=builder, open_files=OPEN_FILES,
        )  # fmt: skip
        assert job.wait_exit() == 0, job.tail()

    warm("builder")
    (entry,) = entry_dirs(root)
    # A link at the bottom of the chain: damage (an entry holds only files and folders).
    _plant_chain(entry, leaf=link_leaf(canary))
    warm("builder-again")  # sets it aside, compiles, publishes
    assert compiles(record) == 2
    assert len(_quarantined(root)) == 1

    (entry,) = entry_dirs(root)
    _plant_chain(entry, leaf=link_leaf(canary / "weights.bin"))
    checked = _cli(pods, root, "verify")
    assert checked.returncode == 74, checked.stderr
    assert "symbolic link" in checked.stdout + checked.stderr
    fixed = _cli(pods, root, "verify", "--fix")
    assert fixed.returncode == 74, fixed.stderr
    assert "moved 1 to quarantine" in fixed.stderr
    assert entry_dirs(root) == []
    assert len(_quarantined(root)) == 2

    pruned = _cli(pods, root, "prune", "--damaged", "--yes")
    assert pruned.returncode == 0, pruned.stderr
    assert _quarantined(root) == []
    assert list((root / "trash").iterdir()) == [], "nothing left half-deleted"

    # A chain of plain folders with a file at the bottom, not in the manifest: not damage. A
    # trusting pod and an open pod walk it (the survey, the trust check) and serve.
    warm("builder-third")
    (entry,) = entry_dirs(root)
    key = json.loads((entry / "summary.json").read_text())["key"]
    _plant_chain(entry, leaf=file_leaf(b"not in the manifest"))
    trusting = {"CACHEMGR_TRUSTED_KEYS": str(secret.public)}
    served = [
        pods.start(
            name, server_argv(free_port()), cache_root=root, options=options, env=env, open_files=OPEN_FILES
        )
        for name, env in (("trusting", trusting), ("open", {}))
    ]
    for pod in served:
        pod.wait_phase("serving")
    assert compiles(record) == 3, "both were hits"
    for pod in served:
        pod.signal(signal.SIGTERM)
        assert pod.wait_exit() == 0
    # And `prune --key` takes the entry, chain and all, through trash/ to nothing.
    removed = _cli(pods, root, "prune", "--key", key[:12], "--yes")
    assert removed.returncode == 0, removed.stderr
    assert entry_dirs(root) == []
    assert list((root / "trash").iterdir()) == []
    assert sorted(p.name for p in canary.iterdir()) == ["weights.bin"]
    assert (canary / "weights.bin").read_bytes() == b"the pod's model weights"
