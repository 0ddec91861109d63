"""A pod runs as the chart's ``runAsUser`` (10001), not root: what another user left on the volume
(a root shell, a Job with another ``runAsUser``) is there to read, never to remove or change.

Root ignores every mode bit, so these pods run as uid 10001 for real (``podlib.as_user``), on a
volume that uid owns, with what root planted in it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from cachemgr_testkit.fuzz_kinds import POD_UID, give_to_pods
from cachemgr_testkit.podlib import cluster, free_port, wait_for
from cachemgr_testkit.scenarios import compile_cmd, server_argv

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs pods as another user: needs root")


@pytest.fixture
def base() -> Iterator[Path]:
    """A folder any user can reach (pytest's own is root's, 0700), as a pod's mount is."""
    made = Path(tempfile.mkdtemp(prefix="cachemgr-foreign-"))
    made.chmod(0o711)
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


def test_a_dead_attempt_holding_another_users_folder_is_left_and_the_compile_goes_on(base: Path) -> None:
    root = base / "volume"
    root.mkdir()
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(base / "compiler.jsonl", seconds=None)]
    with cluster(base / "work") as pods:
        killed = pods.start(
            "killed", server_argv(free_port()), cache_root=root, options=options,
            env={"STANDIN_COMPILE_SECONDS": "60"},
        )  # fmt: skip
        killed.wait_phase("compiling")
        attempt = next(root.glob("staging/*/killed.*/artifacts")).parent
        killed.signal_pod(signal.SIGKILL)
        killed.wait_exit(timeout=30)
        give_to_pods(root)
        (base / "compiler.jsonl").touch()
        os.chown(base / "compiler.jsonl", POD_UID, POD_UID)
        theirs = attempt / "artifacts" / "root-owned"  # root's: uid 10001 cannot empty it
        theirs.mkdir()
        (theirs / "graph.rbln").write_bytes(b"x")
        pod = pods.start(
            "taker", server_argv(free_port()), cache_root=root, options=options, user=POD_UID,
            env={"STANDIN_COMPILE_SECONDS": "0.5"},
        )  # fmt: skip
        wait_for(lambda: pod.proc.poll() is not None or pod.phase == "serving", what="the taker to settle")
        log = pod.log.read_text()
        assert pod.phase == "serving", log[-3000:]
        pod.signal(signal.SIGTERM)
        assert pod.wait_exit(timeout=60) == 0, log[-3000:]
    kept = [json.loads(line) for line in log.splitlines() if '"stale_staging_kept"' in line]
    assert [record["attempt"] for record in kept] == [attempt.name], log[-3000:]
    assert (theirs / "graph.rbln").read_bytes() == b"x"  # another user's bytes are left as they were


def test_entries_another_user_owns_stop_the_publish_with_a_line_naming_the_folder(base: Path) -> None:
    """``entries/`` left to root (a restore run as root, a Job of another ``runAsUser``): the pod
    compiles, cannot publish, and says where (it named only two bare folder names before)."""
    root = base / "volume"
    root.mkdir()
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(base / "compiler.jsonl", seconds=0.2)]
    (base / "compiler.jsonl").touch()
    with cluster(base / "work") as pods:
        other = [
            "--strategy",
            "command",
            "--compile-cmd",
            compile_cmd(base / "compiler.jsonl", extra="--files 1"),
        ]
        first = pods.start("first", server_argv(free_port()), cache_root=root, options=other)
        first.wait_phase("serving")  # the layout, made by a pod of the user
        first.signal(signal.SIGTERM)
        first.wait_exit(timeout=60)
        give_to_pods(root)
        os.chown(base / "compiler.jsonl", POD_UID, POD_UID)
        os.chown(root / "entries", 0, 0)  # root's now: uid 10001 cannot rename into it
        pod = pods.start("second", server_argv(free_port()), cache_root=root, options=options, user=POD_UID)
        code = pod.wait_exit(timeout=60)
    failed = [json.loads(line) for line in pod.log.read_text().splitlines() if '"event": "failed"' in line]
    assert code == 74, pod.log.read_text()[-3000:]
    assert str(root / "entries") in failed[-1]["message"]


def test_a_damaged_entry_the_pods_user_may_not_move_is_left_with_a_warning(base: Path) -> None:
    """Damage found where ``entries/`` is root's: the quarantine's rename is refused, and the pod
    could not publish over it either. It stops with 74 saying so and what to do (it was exit 70, a
    PermissionError, before)."""
    root = base / "volume"
    root.mkdir()
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(base / "compiler.jsonl", seconds=0.2)]
    (base / "compiler.jsonl").touch()
    with cluster(base / "work") as pods:
        first = pods.start("first", server_argv(free_port()), cache_root=root, options=options)
        first.wait_phase("serving")
        first.signal(signal.SIGTERM)
        first.wait_exit(timeout=60)
        give_to_pods(root)
        os.chown(base / "compiler.jsonl", POD_UID, POD_UID)
        entry = next((root / "entries").iterdir())
        graph = next(p for p in (entry / "artifacts").rglob("*") if p.is_file())
        graph.chmod(0o644)
        graph.write_bytes(b"damaged")  # another size: the fast check finds it
        os.chown(root / "entries", 0, 0)
        pod = pods.start("second", server_argv(free_port()), cache_root=root, options=options, user=POD_UID)
        code = pod.wait_exit(timeout=60)
    log = pod.log.read_text()
    assert '"reason": "internal"' not in log, log[-3000:]
    failed = [json.loads(line) for line in log.splitlines() if '"event": "failed"' in line]
    assert code == 74, log[-3000:]
    assert f"cannot move the damaged entry {entry} aside" in failed[-1]["message"]
    assert f"cachemgr prune --key {entry.name[-16:]} --yes" in failed[-1]["message"]
    assert entry.is_dir()


def test_a_staging_folder_another_user_owns_is_named_in_the_pods_refusal(base: Path) -> None:
    """``staging/`` left to root: the miss cannot make its attempt there; the line names the folder
    that refused (it named only ``staging/`` with the errno before)."""
    root = base / "volume"
    root.mkdir()
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(base / "compiler.jsonl", seconds=0.2)]
    with cluster(base / "work") as pods:
        first = pods.start(
            "first", server_argv(free_port()), cache_root=root, options=[*options, "--role", "decode"]
        )
        first.wait_phase("serving")  # the layout, made by a pod of the user
        first.signal(signal.SIGTERM)
        first.wait_exit(timeout=60)
        give_to_pods(root)
        os.chown(root / "staging", 0, 0)
        os.chmod(root / "staging", 0o755)
        pod = pods.start("second", server_argv(free_port()), cache_root=root, options=options, user=POD_UID)
        code = pod.wait_exit(timeout=60)
    failed = [json.loads(line) for line in pod.log.read_text().splitlines() if '"event": "failed"' in line]
    assert code == 74, pod.log.read_text()[-3000:]
    assert "Permission denied" in failed[-1]["message"]
    assert f"({root / 'staging'}/" in failed[-1]["message"]


def test_a_removed_use_record_the_volume_will_not_take_again_is_said_as_prune_not_seeing_the_pod(
    base: Path,
) -> None:
    """A serving pod's usage folder removed, and ``usage/`` made root's 0700 (a cleanup run as
    root): the heartbeat cannot make the record again. The pod says so as at a refused first
    write, ``use_not_recorded`` with the errno, the cause and that prune cannot see it (it logged a
    bare ``record_not_restored`` with the errno's text; fuzzer seed 7272 trial 91). Given back,
    the record returns at a beat."""
    root = base / "volume"
    root.mkdir()
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(base / "compiler.jsonl", seconds=0.2)]
    with cluster(base / "work") as pods:
        first = pods.start("first", server_argv(free_port()), cache_root=root, options=options)
        first.wait_phase("serving")  # the entry, published by a pod of the user
        first.signal(signal.SIGTERM)
        first.wait_exit(timeout=60)
        give_to_pods(root)
        for record in (base / "compiler.jsonl", pods.work / "record.jsonl", pods.work / "signals.log"):
            record.touch()
            os.chown(record, POD_UID, POD_UID)
        pod = pods.start("serving", server_argv(free_port()), cache_root=root, options=options, user=POD_UID)
        pod.wait_phase("serving")
        [mine] = root.glob("usage/*/serving.*.json")
        shutil.rmtree(mine.parent)
        os.chown(root / "usage", 0, 0)
        os.chmod(root / "usage", 0o700)

        def said(event: str) -> list[dict[str, object]]:
            return [e for e in pod.log_events() if e.get("event") == event and e.get("removed")]

        wait_for(lambda: said("use_not_recorded"), timeout=20, what="the refusal, said")
        [refusal] = said("use_not_recorded")
        assert (refusal["errno"], refusal["level"]) == ("EACCES", "warning"), refusal
        assert "prune cannot see this pod" in str(refusal["note"]), refusal
        assert "make the volume readable and writable by the pod's user" in str(refusal["cause"]), refusal
        assert not [e for e in pod.log_events() if e.get("event") == "record_not_restored"]
        assert not mine.exists()
        os.chown(root / "usage", POD_UID, POD_UID)
        wait_for(mine.is_file, timeout=20, what="the use record, written again once the volume takes it")
        wait_for(
            lambda: [e for e in pod.log_events() if e.get("event") == "record_restored"],
            timeout=10,
            what="the restore, said",
        )
        assert pod.phase == "serving"
        pod.signal(signal.SIGTERM)
        code = pod.wait_exit(timeout=60)
        assert code == 0, (code, pod.log.read_text()[-4000:])


def test_a_removed_owner_record_the_volume_will_not_take_again_says_what_the_silence_means(
    base: Path,
) -> None:
    """A compiling pod's owner record removed, and its key's staging folder made root's (0755, a
    cleanup run as root): the heartbeat cannot write the record again. The pod said only the
    errno's text and "retried at every beat"; now ``record_not_restored`` names the errno, the
    cause with its remedy, and what the silence means (peers and prune may take the attempt for a
    dead pod's). Given back, the record returns at a beat and the compile goes on."""
    root = base / "volume"
    root.mkdir()
    give_to_pods(root)
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(base / "compiler.jsonl", seconds=60)]
    with cluster(base / "work") as pods:
        for record in (base / "compiler.jsonl", pods.work / "record.jsonl", pods.work / "signals.log"):
            record.touch()
            os.chown(record, POD_UID, POD_UID)
        pod = pods.start("compiler", server_argv(free_port()), cache_root=root, options=options, user=POD_UID)
        pod.wait_phase("compiling")
        [owner] = wait_for(
            lambda: list(root.glob("staging/*/compiler.*.json")), timeout=10, what="the owner record"
        )
        written = owner.read_bytes()
        owner.unlink()
        os.chown(owner.parent, 0, 0)
        os.chmod(owner.parent, 0o755)

        def said(event: str) -> list[dict[str, object]]:
            return [e for e in pod.log_events() if e.get("event") == event and e.get("record") == owner.name]

        wait_for(lambda: said("record_not_restored"), timeout=20, what="the refusal, said")
        [refusal] = said("record_not_restored")
        assert (refusal["errno"], refusal["level"]) == ("EACCES", "warning"), refusal
        assert "make the volume readable and writable by the pod's user" in str(refusal["cause"]), refusal
        assert str(refusal["path"]).startswith(str(owner.parent)), refusal
        assert "for a dead pod's" in str(refusal["note"]), refusal
        assert not owner.exists()
        # Put back by someone else, it beats again; removed again, the refusal is said again.
        owner.write_bytes(written)
        os.chown(owner, POD_UID, POD_UID)
        os.utime(owner, (1_000_000_000, 1_000_000_000))
        wait_for(lambda: owner.stat().st_mtime > 1_000_000_000, timeout=10, what="the record, beating again")
        owner.unlink()
        wait_for(lambda: len(said("record_not_restored")) == 2, timeout=20, what="the second refusal, said")
        os.chown(owner.parent, POD_UID, POD_UID)
        wait_for(owner.is_file, timeout=20, what="the owner record, written again once the volume takes it")
        assert owner.read_bytes() == written
        wait_for(lambda: said("record_restored"), timeout=10, what="the restore, said")
        assert pod.phase == "compiling"
        pod.signal(signal.SIGTERM)
        pod.wait_exit(timeout=60)
