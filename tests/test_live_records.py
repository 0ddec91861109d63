"""What a live pod owns comes back when someone removes it, and nobody acts on its absence (issue 40).

Every serving or compiling pod keeps records on the volume that its peers and prune read to tell
it alive: its use record (``usage/<key>/<pod>.<pid>.json``), its attempt's owner record
(``staging/<key>/<attempt>.json``), its lease (``leases/<key>.lock`` and ``.holder.json``). Anyone
who can write the volume can remove them (``usage/`` is writable to every serving pod that records
its use; a stray cleanup). Real pods, real removals, real prunes and peers: the record is back at
the pod's next beat, and nothing a live pod uses goes meanwhile.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.podlib import Cluster, Pod, free_port, run_cli, wait_for
from cachemgr_testkit.scenarios import compile_cmd, entry_dirs, server_argv


def _options(record: Path, seconds: float = 0.1) -> list[str]:
    return ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=seconds)]


def _use_records(root: Path, pod: str) -> list[Path]:
    usage = root / "usage"
    if not usage.is_dir():
        return []
    return sorted(p for p in usage.glob(f"*/{pod}.*.json") if p.is_file())


def _read(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    assert isinstance(data, dict), data
    return data


def _attempt(root: Path) -> tuple[Path, Path]:
    """The one staging attempt under ``root`` and its owner record."""
    [attempt] = [p for p in (root / "staging").glob("*/*") if p.is_dir()]
    return attempt, attempt.with_name(attempt.name + ".json")


def _compiling(pods: Cluster, root: Path, name: str = "compiler", *extra: str) -> Pod:
    """A pod compiling for a minute (the stand-in compiler sleeps), its attempt on the volume."""
    options = [*_options(pods.work / "compiler.jsonl", seconds=60), *extra]
    pod = pods.start(name, server_argv(free_port()), cache_root=root, options=options)
    pod.wait_phase("compiling")
    wait_for(lambda: list((root / "staging").glob("*/*.json")), timeout=10, what="the owner record")
    return pod


@pytest.mark.parametrize("removed", ["record", "folder"])
def test_a_use_record_removed_under_a_serving_pod_comes_back_and_prune_keeps_its_entry(
    pods: Cluster, root: Path, removed: str
) -> None:
    """The adversary's run: the record (or its whole usage folder) removed, then at once
    ``prune --unused-for 0s --yes``: the entry stays, and the record is back at the next beat."""
    pod = pods.start(
        "serving", server_argv(free_port()), cache_root=root, options=_options(pods.work / "c.jsonl")
    )
    pod.wait_phase("serving")
    [entry] = entry_dirs(root)
    [mine] = _use_records(root, "serving")
    written = _read(mine)
    if removed == "record":
        mine.unlink()
    else:
        shutil.rmtree(mine.parent)
    pruned = run_cli(
        "prune", "--unused-for", "0s", "--yes", "-o", "json", "--cache-root", str(root), env=pod.env
    )
    assert pruned.returncode == 0, pruned.stderr
    assert entry.is_dir(), f"the entry a serving pod uses was removed:\n{pruned.stdout}"
    assert pod.phase == "serving"
    wait_for(lambda: _use_records(root, "serving"), timeout=10, what="the use record, written again")
    [back] = _use_records(root, "serving")
    again = _read(back)
    assert (again["pod"], again["start"], again["since"]) == (
        written["pod"],
        written["start"],
        written["since"],
    )
    # Once back, an age-based prune sees the pod as it did before the removal.
    listed = run_cli("ls", "-o", "json", "--cache-root", str(root), env=pod.env)
    assert [u["pod"] for u in json.loads(listed.stdout)["items"][0]["users"]] == ["serving"]


def test_an_owner_record_removed_under_a_compiling_pod_comes_back_and_prune_keeps_the_attempt(
    pods: Cluster, root: Path
) -> None:
    """``prune --stale-staging`` right after the owner record went: a live attempt is not stale."""
    pod = _compiling(pods, root)
    attempt, owner = _attempt(root)
    written = _read(owner)
    owner.unlink()
    pruned = run_cli(
        "prune", "--stale-staging", "--yes", "-o", "json", "--cache-root", str(root), env=pod.env
    )
    assert pruned.returncode == 0, pruned.stderr
    assert attempt.is_dir(), f"a live compile's staging was removed:\n{pruned.stdout}"
    wait_for(owner.is_file, timeout=10, what="the owner record, written again")
    assert _read(owner) == written, "the same record: host, pid and start time name the live process"
    assert pod.phase == "compiling"


def test_a_peer_does_not_take_over_a_live_compile_whose_lease_and_owner_record_vanished(
    pods: Cluster, root: Path
) -> None:
    """The lease's marker, its holder record and the attempt's owner record all removed: the holder
    writes them again at its next beats; a peer that starts meanwhile waits for it (no second
    compile) and never removes its staging."""
    holder = _compiling(pods, root, "holder", "--lease-duration", "6")
    attempt, owner = _attempt(root)
    [marker] = (root / "leases").glob("*.lock")
    token = next(line for line in marker.read_text().splitlines() if line.startswith("token="))
    record = marker.with_name(marker.name.removesuffix(".lock") + ".holder.json")
    assert record.is_file()
    for path in (marker, owner):
        path.unlink()
    peer = pods.start(
        "peer",
        server_argv(free_port()),
        cache_root=root,
        options=[*_options(pods.work / "compiler.jsonl", seconds=60), "--lease-duration", "6"],
    )
    wait_for(marker.is_file, timeout=15, what="the lease marker, written again by its holder")
    assert token in marker.read_text().splitlines(), "the holder's own marker, not the peer's"
    wait_for(owner.is_file, timeout=10, what="the owner record, written again")
    peer.wait_phase("waiting")
    assert attempt.is_dir()
    assert [a for a in (root / "staging").glob("*/*") if a.is_dir()] == [attempt], "one compile"
    assert not [e for e in holder.log_events() if e.get("event") == "lease_lost"], holder.tail()
    holder.signal(signal.SIGTERM)
    holder.wait_exit()


def test_a_lease_holder_record_removed_under_a_compiling_pod_comes_back(pods: Cluster, root: Path) -> None:
    """``locks`` and waiting peers say who compiles from the holder record: written again at the
    holder's next lease beat, as it was."""
    holder = _compiling(pods, root, "holder", "--lease-duration", "3")
    [record] = (root / "leases").glob("*.holder.json")
    written = _read(record)
    record.unlink()
    wait_for(record.is_file, timeout=10, what="the holder record, written again")
    assert _read(record) == written
    locks = run_cli("locks", "-o", "json", "--cache-root", str(root), env=holder.env)
    assert locks.returncode == 0, locks.stderr
    assert "holder" in locks.stdout, locks.stdout


def test_the_pod_state_removed_under_a_serving_pod_comes_back_and_its_probes_pass(
    pods: Cluster, root: Path
) -> None:
    """The kubelet's probes read ``state.json`` and ``heartbeat``: a stray cleanup of the pod's
    state directory would fail them and restart a healthy server."""
    pod = pods.start(
        "serving", server_argv(free_port()), cache_root=root, options=_options(pods.work / "c.jsonl")
    )
    pod.wait_phase("serving")
    for name in ("state.json", "heartbeat"):
        (pod.state_dir / name).unlink()
    wait_for(lambda: pod.phase == "serving", timeout=10, what="the state record, written again")
    assert (pod.state_dir / "heartbeat").is_file()
    probe = run_cli("probe", "ready", env=pod.env)
    assert probe.returncode == 0, probe.stdout + probe.stderr


def test_an_attempt_published_while_its_owner_record_is_still_beaten_is_not_restored(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The publish takes the owner record with the attempt; the pod takes it off the beat only
    after (the beat keeps a long publish's attempt alive). A beat in between finds it missing:
    nothing is written again, and no ``record_restored`` says someone else removed it (CI: a pod
    stopped under load logged that warning for its own published attempt)."""
    import os

    from cachemgr_testkit.scenarios import command_key

    from cachemgr.core import log
    from cachemgr.volume.heartbeat import Heartbeat
    from cachemgr.volume.identity import PodIdentity
    from cachemgr.volume.layout import open_root
    from cachemgr.volume.store import create_staging, publish

    (tmp_path / "volume").mkdir()
    root = open_root(tmp_path / "volume", create=True)
    key = command_key("decode")
    identity = PodIdentity(pod="test", node="node-a", host="test", pid=os.getpid())
    staging = create_staging(root, key, identity)
    (staging.artifacts / "graph.rbln").write_bytes(b"x")
    beat = Heartbeat()
    beat.add(staging.owner_file, within=root.path, restore=staging.restore_owner)
    publish(root, staging, key, identity=identity, compile_seconds=1.0, strategy="command")
    assert not staging.owner_file.exists(), "the publish takes the owner record"

    log.configure("json")  # its writer binds the captured stderr: unbound again below
    try:
        beat.beat()  # before the pod discards it
        assert not staging.owner_file.exists(), "an owner record written again for an attempt that is gone"
        assert "record_restored" not in capfd.readouterr().err
        staging.owner_file.parent.mkdir(parents=True, exist_ok=True)
        staging.path.mkdir()  # a live attempt whose owner record someone removed: that one comes back
        beat.beat()
        assert staging.owner_file.is_file()
        assert "record_restored" in capfd.readouterr().err
    finally:
        log.configure("json")  # the next event binds the stderr of its own time, not this test's
