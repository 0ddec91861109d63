"""Disk quota exceeded: caught before compiling, reported the same way when it happens anyway.

Real small volumes: tmpfs fills up with ENOSPC, a JuiceFS directory quota with EDQUOT
("Disk quota exceeded", what the chart page says a too-small PVC gives).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.podlib import Cluster, Pod, free_port, run_cli
from cachemgr_testkit.scenarios import (
    assert_clean_after_failure,
    assert_entries_valid,
    compile_cmd,
    compiles,
    entry_dirs,
    server_argv,
)
from cachemgr_testkit.trusted import writable

from cachemgr.core.fsutil import tree_bytes

MiB = 1 << 20


def _command(record: Path, *, size: str, extra: str = "") -> list[str]:
    cmd = compile_cmd(record, seconds=0.2, extra=extra).replace("--bytes 256k", f"--bytes {size}")
    return ["--strategy", "command", "--compile-cmd", cmd]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _report(pod: Pod, root: Path) -> dict[str, Any]:
    """The disk report from the failure record (the same text is in the termination message)."""
    records = [json.loads(p.read_text()) for p in (root / "failures").rglob("*.json")]
    full = [r for r in records if r.get("reason") == "disk-full"]
    assert full, f"no disk-full failure record:\n{pod.tail()}"
    report: dict[str, Any] = full[-1]["report"]
    message = (pod.state_dir / "termination-log").read_text()
    assert message == full[-1]["message"], "the log, the record and the termination message say the same"
    return report


def _assert_report_matches_volume(report: dict[str, Any], root: Path) -> None:
    st = os.statvfs(root)
    assert report["volume"] == str(root)
    assert report["total_bytes"] == st.f_blocks * st.f_frsize
    # The failure record itself was written after the report measured the volume.
    assert abs(report["free_bytes"] - st.f_bavail * st.f_frsize) <= 64 * 1024
    assert report["chart_key"] == "storage.compileCache.size"


def _warm_earlier_entries(pods: Cluster, root: Path, record: Path) -> dict[str, bytes]:
    """An entry for this image and one for an older compiler, both small."""
    for name, version in (("old", "0.11.2"), ("cur", "0.12.0")):
        pod = pods.start(
            f"warm-{name}", server_argv(free_port()), cache_root=root, command="warm",
            options=_command(record, size="512k"), env={"CACHEMGR_COMPILER_VERSION": version},
        )  # fmt: skip
        assert pod.wait_exit() == 0, pod.tail()
    return _tree(root / "entries")


def test_preflight_stops_before_compiling_with_the_full_report(
    pods: Cluster, tmpfs_small: Callable[[int], Path]
) -> None:
    root = tmpfs_small(8 * MiB)
    record = pods.work / "compiler.jsonl"
    earlier = _warm_earlier_entries(pods, root, record)
    options = [*_command(record, size="1M", extra="--tensor-parallel-size 8"), "--expected-size", "64Mi"]
    pod = pods.start("a", server_argv(free_port()), cache_root=root, options=options)
    assert pod.wait_exit() == 73
    assert compiles(record) == 2, "the compiler never started"
    report = _report(pod, root)
    _assert_report_matches_volume(report, root)
    assert report["expected_bytes"] == 64 * MiB
    assert report["expected_source"] == "--expected-size"
    assert report["cause"] == "checked before compiling"
    assert len(report["prunable_incompatible"]) == 1, "the 0.11 entry can never be used by this image"
    message = (pod.state_dir / "termination-log").read_text()
    assert f"compile cache volume {root} is out of space" in message
    assert "cachemgr prune --incompatible --yes" in message
    assert "storage.compileCache.size" in message
    assert "only where the StorageClass allows volume expansion" in message
    assert_clean_after_failure(root)
    assert _tree(root / "entries") == earlier


def test_full_volume_mid_compile_is_reported_and_the_next_start_with_room_compiles(
    pods: Cluster, tmpfs_small: Callable[[int], Path]
) -> None:
    root = tmpfs_small(6 * MiB)
    record = pods.work / "compiler.jsonl"
    earlier = _warm_earlier_entries(pods, root, record)
    options = [*_command(record, size="16M", extra="--tensor-parallel-size 8"), "--space-check", "warn"]
    pod = pods.start("a", server_argv(free_port()), cache_root=root, options=options)
    assert pod.wait_exit() == 73
    report = _report(pod, root)
    _assert_report_matches_volume(report, root)
    assert "No space left on device" in report["cause"]
    assert report["expected_source"].startswith("learned from entry"), report["expected_source"]
    assert_clean_after_failure(root)
    assert _tree(root / "entries") == earlier, "earlier entries are byte-for-byte intact"

    subprocess.run(["mount", "-o", "remount,size=64m", str(root)], check=True)
    pod = pods.start("b", server_argv(free_port()), cache_root=root, options=options)
    pod.wait_phase("serving")
    assert len(entry_dirs(root)) == 3
    assert_entries_valid(root)


def test_compiler_printing_disk_quota_exceeded_is_reported_the_same_way(
    pods: Cluster, tmpfs_small: Callable[[int], Path]
) -> None:
    root = tmpfs_small(32 * MiB)
    record = pods.work / "compiler.jsonl"
    pod = pods.start(
        "a",
        server_argv(free_port()),
        cache_root=root,
        options=_command(record, size="1M", extra="--quota-exceeded"),
    )
    assert pod.wait_exit() == 73
    report = _report(pod, root)
    _assert_report_matches_volume(report, root)
    assert "Disk quota exceeded" in report["cause"]
    assert_clean_after_failure(root)
    assert entry_dirs(root) == []


def test_our_own_write_hitting_enospc_ends_the_attempt_cleanly(
    pods: Cluster, tmpfs_small: Callable[[int], Path]
) -> None:
    """The compiler succeeds, then the volume fills up (another writer): the manifest write fails."""
    root = tmpfs_small(8 * MiB)
    record = pods.work / "compiler.jsonl"
    ballast = root / "ballast"
    fill = f"{sys.executable} -c {shlex.quote(_FILL.format(path=str(ballast)))}"
    cmd = f"sh -c {shlex.quote(compile_cmd(record, seconds=0.1) + ' && ' + fill)}"
    options = ["--strategy", "command", "--compile-cmd", cmd]
    pod = pods.start("a", server_argv(free_port()), cache_root=root, options=options)
    assert pod.wait_exit() == 73, pod.tail()
    report = _report(pod, root)
    assert "No space left on device" in report["cause"]
    ballast.unlink()
    assert_clean_after_failure(root)
    assert entry_dirs(root) == []


def test_a_full_state_dir_on_a_hit_is_a_disk_full_error_naming_it(
    pods: Cluster, root: Path, tmpfs_small: Callable[..., Path]
) -> None:
    """The view of a hit takes an inode per file in the pod's state dir (an emptyDir): when it runs
    out, the pod says so (73) instead of reporting a cachemgr bug, leaves no half view behind,
    and the published entry is untouched."""
    record = pods.work / "compiler.jsonl"
    cmd = compile_cmd(record, seconds=0.1).replace("--files 6", "--files 120")
    options = ["--strategy", "command", "--compile-cmd", cmd]
    warm = pods.start("warm", server_argv(free_port()), cache_root=root, command="warm", options=options)
    assert warm.wait_exit() == 0, warm.tail()
    published = _tree(root / "entries")
    state = tmpfs_small(4 * MiB, inodes=60)  # room for the state records, not for 120 links
    env = {"CACHEMGR_STATE_DIR": str(state)}
    pod = pods.start("a", server_argv(free_port()), cache_root=root, options=options, env=env)
    assert pod.wait_exit() == 73, pod.tail()
    message = (pod.state_dir / "termination-log").read_text()
    assert "the pod's state dir is full" in message, message
    assert "CACHEMGR_STATE_DIR" in message, message
    assert "bug" not in message
    assert list((state / "views").iterdir()) == [], "the half-built view is removed"
    assert _tree(root / "entries") == published
    assert compiles(record) == 1, "a full state dir is not a reason to compile"


_FILL = """
import os
fd = os.open({path!r}, os.O_WRONLY | os.O_CREAT)
try:
    while True:
        os.write(fd, b"x" * 65536)
except OSError:
    pass
"""


def test_auto_prune_incompatible_frees_room_before_compiling(
    pods: Cluster, tmpfs_small: Callable[[int], Path]
) -> None:
    root = tmpfs_small(8 * MiB)
    record = pods.work / "compiler.jsonl"
    for version in ("0.10.0", "0.11.0"):
        pod = pods.start(
            f"old-{version}", server_argv(free_port()), cache_root=root, command="warm",
            options=_command(record, size="3M"), env={"CACHEMGR_COMPILER_VERSION": version},
        )  # fmt: skip
        assert pod.wait_exit() == 0, pod.tail()
    options = [*_command(record, size="3M"), "--expected-size", "4Mi", "--auto-prune", "incompatible"]
    pod = pods.start("a", server_argv(free_port()), cache_root=root, options=options)
    pod.wait_phase("serving")
    names = [p.name for p in entry_dirs(root)]
    assert len(names) == 1
    assert "__c0.12__" in names[0]
    assert any(e["event"] == "auto_pruned_incompatible" for e in pod.log_events())


@pytest.mark.juicefs
def test_juicefs_quota_gives_disk_quota_exceeded_like_the_chart_page_says(
    pods: Cluster, juicefs_volume_factory: Callable[..., list[Path]]
) -> None:
    (mount,) = juicefs_volume_factory(mounts=1, quota_bytes=16 * MiB)
    root = mount / "cache"
    root.mkdir()
    record = pods.work / "compiler.jsonl"
    options = [*_command(record, size="48M"), "--space-check", "warn"]
    pod = pods.start("a", server_argv(free_port()), cache_root=root, options=options)
    assert pod.wait_exit(timeout=120) == 73
    message = (pod.state_dir / "termination-log").read_text()
    assert "Disk quota exceeded" in message, message
    assert "storage.compileCache.size" in message
    assert_clean_after_failure(root)
    result = run_cli("du", "-o", "json", env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["total_bytes"] == 16 * MiB, "du shows the quota as the volume size"


def test_a_start_that_set_its_damaged_entry_aside_learns_the_size_from_it(pods: Cluster, root: Path) -> None:
    """Issue 34: right after moving its key's damaged entry to quarantine/, the space check said
    "nothing compiled for this model yet": it had just held one, and its size is still there."""
    options = _command(pods.work / "compiler.jsonl", size="2M")
    warm = pods.start("warm-a", server_argv(free_port()), cache_root=root, command="warm", options=options)
    assert warm.wait_exit() == 0, warm.tail()
    (entry,) = entry_dirs(root)
    published = json.loads((entry / "summary.json").read_text())["size_bytes"]
    artifact = next(p for p in sorted((entry / "artifacts").rglob("*")) if p.is_file())
    os.chmod(artifact.parent, 0o755)
    artifact.unlink()
    again = pods.start(
        "warm-b",
        server_argv(free_port()),
        cache_root=root,
        command="warm",
        options=[*options, "--verify", "full"],
    )
    assert again.wait_exit() == 0, again.tail()
    events = again.log_events()
    assert [e for e in events if e["event"] == "entry_damaged"], "the entry was set aside first"
    (preflight,) = [e for e in events if e["event"] == "space_preflight"]
    assert preflight["expected_bytes"] == published, preflight
    assert preflight["expected_source"].startswith("learned from this key's entry set aside as damaged"), (
        preflight
    )
    assert "nothing compiled" not in preflight["expected_source"]


# --- a planted figure never makes a false "volume full" ------------------------------------------


def _rewrite(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """What a writer of the volume does to a record there (a published one is 0444/0555)."""
    writable(path.parent)
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _warm(pods: Cluster, name: str, root: Path, options: list[str]) -> Pod:
    pod = pods.start(name, server_argv(free_port()), cache_root=root, command="warm", options=options)
    pod.wait_exit()
    return pod


def _expected(pod: Pod) -> dict[str, Any]:
    (found,) = [e for e in pod.log_events() if e["event"] == "space_preflight"]
    return found


def _volume_bytes(root: Path) -> int:
    st = os.statvfs(root)
    return st.f_blocks * st.f_frsize


@pytest.mark.parametrize(
    "planted", ["1e300", "1e19", "one byte more than the volume", "just under the volume"]
)
def test_a_planted_entry_size_is_not_learned_and_the_compile_goes_on(
    pods: Cluster, tmpfs_small: Callable[[int], Path], planted: str
) -> None:
    """An entry of the model claiming more bytes than the volume holds (its summary.json rewritten
    by a writer of the volume) made every other configuration of the model refuse to compile
    (exit 73, "needs about 1e+300 B"). No entry on a volume is larger than the volume."""
    root = tmpfs_small(8 * MiB)
    record = pods.work / "compiler.jsonl"
    assert _warm(pods, "a", root, _command(record, size="512k")).proc.returncode == 0
    (entry,) = entry_dirs(root)
    held = tree_bytes(entry)
    volume = _volume_bytes(root)
    claim = {"1e300": 1e300, "1e19": 10**19, "just under the volume": volume - 1}.get(planted, volume + 1)
    _rewrite(entry / "summary.json", lambda summary: summary.update(size_bytes=claim))
    other = _warm(pods, "b", root, _command(record, size="512k", extra="--tensor-parallel-size 8"))
    assert other.proc.returncode == 0, other.tail()
    expected = _expected(other)
    learned = expected["expected_source"].startswith("learned")
    assert not learned or expected["expected_bytes"] <= held, expected  # what the entry holds, not its claim
    assert len(entry_dirs(root)) == 2


def test_a_real_entry_as_large_as_the_free_space_is_still_learned(
    pods: Cluster, tmpfs_small: Callable[[int], Path]
) -> None:
    """The other side of the bound: an entry's size that can be real still stops a compile that
    cannot fit, before it starts."""
    root = tmpfs_small(8 * MiB)
    record = pods.work / "compiler.jsonl"
    assert _warm(pods, "a", root, _command(record, size="3M")).proc.returncode == 0
    (entry,) = entry_dirs(root)
    size = json.loads((entry / "summary.json").read_text())["size_bytes"]
    ballast = root / "ballast"
    st = os.statvfs(root)
    ballast.write_bytes(b"\0" * (st.f_bavail * st.f_frsize - size // 2))  # half the entry's size left
    other = _warm(pods, "b", root, _command(record, size="3M", extra="--tensor-parallel-size 8"))
    assert other.proc.returncode == 73, other.tail()
    assert _expected(other)["expected_bytes"] == size
    assert _expected(other)["expected_source"].startswith("learned from entry"), _expected(other)
    assert compiles(record) == 1, "the compiler never started"


def test_a_planted_disk_full_record_proves_nothing_and_the_compile_goes_on(
    pods: Cluster, tmpfs_small: Callable[[int], Path]
) -> None:
    """A failure record of this key rewritten to say its attempt wrote 1e19 bytes and found 1e300
    free: each start took that as a lower bound and refused (exit 73), forever."""
    root = tmpfs_small(8 * MiB)
    record = pods.work / "compiler.jsonl"
    options = _command(record, size="512k")
    assert _warm(pods, "a", root, [*options, "--expected-size", "64Mi"]).proc.returncode == 73
    (failed,) = (root / "failures").rglob("*.json")

    def plant(data: dict[str, Any]) -> None:
        data["reason"] = "disk-full"
        data["bytes_written"] = 10**19
        data["report"] = {**(data.get("report") or {}), "free_at_start_bytes": 1e300}

    _rewrite(failed, plant)
    again = _warm(pods, "b", root, options)
    assert again.proc.returncode == 0, again.tail()
    assert "earlier attempt" not in _expected(again)["expected_source"], _expected(again)
    assert len(entry_dirs(root)) == 1


def test_a_planted_size_in_a_set_aside_entry_falls_back_to_what_is_left_of_it(
    pods: Cluster, root: Path
) -> None:
    """This key's damaged entry, its summary.json claiming 1e300 bytes, set aside by the next
    start: that start learned 1e300 from it and refused to compile its replacement."""
    options = _command(pods.work / "compiler.jsonl", size="2M")
    assert _warm(pods, "warm-a", root, options).proc.returncode == 0
    (entry,) = entry_dirs(root)
    _rewrite(entry / "summary.json", lambda summary: summary.update(size_bytes=1e300))
    artifact = next(p for p in sorted((entry / "artifacts").rglob("*")) if p.is_file())
    artifact.unlink()
    again = _warm(pods, "warm-b", root, [*options, "--verify", "full"])
    assert again.proc.returncode == 0, again.tail()
    found = _expected(again)
    assert found["expected_source"].startswith("learned from this key's entry set aside as damaged"), found
    assert "what is left of it" in found["expected_source"], found
    assert 0 < found["expected_bytes"] < 2 * MiB, found
