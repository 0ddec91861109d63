"""Nothing in use is removed, even on a full volume; odd pod names stay inside the volume (issue 26, items 2 and 9).

Real pods on a real tmpfs filled to its last page: writing the use record fails with ENOSPC,
yet the pod's empty record (a name needs no data page) is there and beating, so prune keeps
the entry; once room frees up the pod writes the whole record.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.podlib import Cluster, Pod, free_port, run_cli, wait_for
from cachemgr_testkit.scenarios import compile_cmd, entry_dirs, server_argv

MiB = 1 << 20
# What a cache root holds at its top (cachemgr.volume.layout), and nothing else.
_LAYOUT = {
    "entries",
    "staging",
    "leases",
    "usage",
    "failures",
    "quarantine",
    "trash",
    "cachemgr-layout.json",
    "CACHEDIR.TAG",
}


def _options(record: Path) -> list[str]:
    return ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=0.1)]


def _fill(path: Path) -> None:
    """Write ``path`` until the volume refuses another byte: every data page is taken."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for chunk in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    os.write(fd, b"x" * chunk)
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)


def _view_links(pod: Pod) -> list[Path]:
    views = pod.state_dir / "views"
    return [Path(d) / n for d, _dirs, files in os.walk(views) for n in files if (Path(d) / n).is_symlink()]


def _usage_files(root: Path) -> dict[str, Path]:
    return {p.name: p for p in (root / "usage").rglob("*") if p.is_file()}


def _newest_use(root: Path) -> float:
    """The latest mtime under usage/: what an entry's last use counts from (scan.EntryInfo)."""
    marks = [p.stat().st_mtime for p in (root / "usage").rglob("*")]
    return max([*marks, (root / "usage").stat().st_mtime])


def _record_of(root: Path, pod: str) -> dict[str, Any] | None:
    for name, path in _usage_files(root).items():
        if name.startswith(f"{pod}.") and name.endswith(".json"):
            try:
                data = json.loads(path.read_text())
            except ValueError:
                return None
            return data if isinstance(data, dict) else None
    return None


def test_a_hit_on_a_full_volume_is_kept_by_prune_and_recorded_once_room_frees(
    pods: Cluster, tmpfs_small: Callable[[int], Path]
) -> None:
    root = tmpfs_small(8 * MiB)
    record = pods.work / "compiler.jsonl"
    warm = pods.start(
        "warm", server_argv(free_port()), cache_root=root, command="warm", options=_options(record)
    )
    assert warm.wait_exit() == 0, warm.tail()
    [entry] = entry_dirs(root)
    ballast = root / "ballast"
    _fill(ballast)

    pod = pods.start("hit", server_argv(free_port()), cache_root=root, options=_options(record))
    pod.wait_phase("serving")
    events = [e for e in pod.log_events() if e.get("event") == "use_not_recorded"]
    assert events, pod.tail()
    assert events[0]["errno"] == "ENOSPC", events[0]
    assert "no space" in events[0]["cause"], events[0]
    assert events[0]["placeholder"] is True, "an empty file fits on a full tmpfs"
    [empty] = [
        p for name, p in _usage_files(root).items() if name.startswith("hit.") and name.endswith(".json")
    ]
    assert empty.stat().st_size == 0
    links = _view_links(pod)
    assert links
    assert all(link.exists() for link in links)

    # The pod's record is late (its process frozen: no heartbeat) and the entry looks unused for 1s.
    pod.signal(signal.SIGSTOP)
    try:
        wait_for(lambda: time.time() - _newest_use(root) > 1.5, timeout=10, what="the last use to age")
        pruned = run_cli(
            "prune", "--unused-for", "1s", "--yes", "-o", "json", "--cache-root", str(root), env=pod.env
        )
    finally:
        pod.signal(signal.SIGCONT)
    assert pruned.returncode == 0, pruned.stderr
    assert entry.is_dir(), f"the entry in use was removed:\n{pruned.stdout}"
    assert all(link.exists() for link in links), "a link of the serving pod's view dangles"
    assert "in use by" in pruned.stdout, pruned.stdout

    ballast.unlink()
    wait_for(lambda: _record_of(root, "hit"), timeout=10, what="the whole use record")
    data = _record_of(root, "hit")
    assert data is not None
    assert (data["pod"], data["start"]) == ("hit", "hit"), data


def test_a_use_record_the_volume_refuses_outright_is_retried_at_every_beat(
    pods: Cluster, tmpfs_small: Callable[..., Path]
) -> None:
    """No inode left: not even the empty record fits. The pod serves and keeps trying; once
    files go, its record appears without a restart."""
    root = tmpfs_small(8 * MiB, inodes=200)
    record = pods.work / "compiler.jsonl"
    warm = pods.start(
        "warm", server_argv(free_port()), cache_root=root, command="warm", options=_options(record)
    )
    assert warm.wait_exit() == 0, warm.tail()
    published = time.time()
    [entry] = entry_dirs(root)
    ballast = root / "ballast"
    ballast.mkdir()
    with contextlib.suppress(OSError):
        for number in range(1000):
            (ballast / str(number)).touch()
    pod = pods.start("hit", server_argv(free_port()), cache_root=root, options=_options(record))
    pod.wait_phase("serving")
    [event] = [e for e in pod.log_events() if e.get("event") == "use_not_recorded"]
    assert event["errno"] == "ENOSPC", event
    assert event["placeholder"] is False, event
    assert "prune cannot see this pod" in event["note"], event
    assert _record_of(root, "hit") is None
    # Each retry refreshes the usage folder's mtime, the entry's last use: an age-based prune leaves it.
    wait_for(lambda: time.time() - published > 6.5, timeout=15, what="the entry to be 6s old")
    pruned = run_cli("prune", "--unused-for", "6s", "--yes", "--cache-root", str(root), env=pod.env)
    assert pruned.returncode == 0, pruned.stderr
    assert entry.is_dir(), pruned.stdout
    shutil.rmtree(ballast)
    wait_for(lambda: _record_of(root, "hit"), timeout=10, what="the use record, written at a later beat")
    assert [e["event"] for e in pod.log_events()].count("use_not_recorded") == 1, (
        "one warning, not one per beat"
    )


# --- odd pod names (issue 26 item 9) ---------------------------------------------------------

ODD_NAMES = {
    "escape": "../../escape",
    "longest": "p" * 253,  # Kubernetes allows 253 characters
    "hidden": ".hidden",  # a leading dot: what tmp files look like, which readers skip
    "hostile": "a/b\x1b[2J\nc\tZ\u00e9",  # any NUL-free bytes an env var may hold
    "undecodable": "pod-\udcff\udcfe",  # bytes 0xff 0xfe: not UTF-8 (os.environ's surrogateescape)
}


@pytest.mark.parametrize("kind", sorted(ODD_NAMES))
def test_an_odd_pod_name_serves_and_its_files_stay_where_they_belong(
    pods: Cluster, root: Path, kind: str
) -> None:
    name = ODD_NAMES[kind]
    record = pods.work / "compiler.jsonl"
    outside = sorted(p.name for p in root.parent.iterdir())
    pod = pods.start(
        "odd", server_argv(free_port()), cache_root=root, options=_options(record), env={"POD_NAME": name}
    )
    pod.wait_phase("serving")
    assert sorted(p.name for p in root.parent.iterdir()) == outside, "nothing is written beside the volume"
    [folder] = (root / "usage").iterdir()
    [mine] = [p for p in folder.iterdir() if p.name.endswith(".json")]
    assert not mine.name.startswith(".")
    assert mine.name.isascii(), "a file name every tool can show (no raw bytes, no escapes)"
    assert mine.name.isprintable()
    assert len(mine.name) <= 255
    assert json.loads(mine.read_text())["pod"] == name, "the record holds the whole name"
    listed = run_cli("ls", "-o", "json", "--cache-root", str(root), env=pod.env)
    assert listed.returncode == 0, listed.stderr
    [entry] = json.loads(listed.stdout)["items"]
    assert [u["pod"] for u in entry["users"]] == [name], "prune and ls see the pod"
    pod.signal(signal.SIGTERM)
    pod.wait_exit()
    stray = [p for p in root.rglob("*") if p.parent == root and p.name not in _LAYOUT]
    assert stray == [], "nothing lands at the volume's top"


def test_a_compile_killed_by_sigkill_names_the_signal_and_the_oom_killer(pods: Cluster, root: Path) -> None:
    """The OOM killer's SIGKILL, as the compiler sees it: one line naming the signal and the remedy."""
    die = f"{sys.executable} -c 'import os, signal; os.kill(os.getpid(), signal.SIGKILL)' {{output_dir}}"
    options = ["--strategy", "command", "--compile-cmd", die]
    pod = pods.start("oom", server_argv(free_port()), cache_root=root, options=options)
    assert pod.wait_exit() == 70, pod.tail()
    message = (pod.state_dir / "termination-log").read_text()
    assert "was killed by SIGKILL (signal 9) while compiling: likely the out-of-memory killer" in message, (
        message
    )
    assert "Raise the pod's memory limit" in message, message
    assert "exited with code 137" not in message
    assert len(message.strip().splitlines()) == 1
    assert entry_dirs(root) == []


def test_empty_and_oversized_use_records_count_as_users_without_being_read(pods: Cluster, root: Path) -> None:
    """Prune's side of a record that is not whole: an empty one (its pod's content did not fit
    yet) and a planted 2 GiB one (read whole, it would take the memory) both stand for a user."""
    record = pods.work / "compiler.jsonl"
    warm = pods.start(
        "warm", server_argv(free_port()), cache_root=root, command="warm", options=_options(record)
    )
    assert warm.wait_exit() == 0, warm.tail()
    [entry] = entry_dirs(root)
    [folder] = (root / "usage").iterdir()
    (folder / "late.2.json").touch()
    with (folder / "planted.3.json").open("wb") as huge:
        huge.truncate(2 << 30)  # sparse: no space taken, 2 GiB to read
    # Under a 1 GiB address space limit, reading the planted record whole is a MemoryError.
    limited = ["prlimit", f"--as={1 << 30}", sys.executable, "-m", "cachemgr"]
    base = ["--cache-root", str(root), "-o", "json"]
    listed = subprocess.run(
        [*limited, "ls", *base], env=warm.env, capture_output=True, text=True, check=False
    )
    assert listed.returncode == 0, listed.stderr
    [shown] = json.loads(listed.stdout)["items"]
    assert sorted(u["pod"] for u in shown["users"]) == ["late.2", "planted.3"]
    pruned = subprocess.run(
        [*limited, "prune", "--keep-bytes", "0", "--yes", *base],
        env=warm.env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert pruned.returncode == 0, pruned.stderr
    assert entry.is_dir(), pruned.stdout
