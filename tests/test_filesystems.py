"""The filesystem semantics cachemgr relies on, pinned on real filesystems.

Each cross-node test runs on "views": two paths to one directory, as seen from node 1 and node 2.
    local    the same local directory twice (the baseline: one kernel, one page cache)
    juicefs  the two mounts of one JuiceFS volume (two FUSE clients sharing a SQLite metadata engine)
    tmpfs    the same small tmpfs twice
Quota and disk-full behaviour is pinned separately for JuiceFS (directory quota) and tmpfs (size=).

Observed on juicefs 1.4.2 with tests/mounts.py's options (metadata caches 0, heartbeat 1 s):
* A rename, a new file, an fsynced write and an mtime change on one mount are visible on the other at
  once: the tests below read right after the change, without retrying. With juicefs' default 1 s
  attribute/entry caches (the usual production mount) an mtime change reached the other mount about
  1 s later; new names and renames showed at once.
* rename(2) of a directory onto a non-empty directory fails with ENOTEMPTY (local ext4, tmpfs and
  JuiceFS alike); onto an empty directory it succeeds and replaces it.
* flock(2) excludes across mounts (juicefs keeps BSD locks in the metadata engine) and is released when
  the holder dies. A mount that dies with a lock held keeps it until another mount cleans up the dead
  session: about 5 s with heartbeat 1 s, about 70 s with juicefs' default 12 s.
* A directory quota (juicefs quota set --capacity) shows in statvfs of the quota directory, exactly
  (f_blocks * f_frsize == quota for a multiple of 4096), on every mount at once. Writes past it fail with
  EDQUOT (not ENOSPC). Writes are buffered, so the error usually comes from fsync() or close() (or a
  later write()), not from the write() that crossed the line; creating a file in a full directory fails
  with EDQUOT too. The writing mount's statvfs shows its own usage only after ~2 s, the other mount's
  after ~1-3 s (heartbeat 1 s; ~12 s with the default), and only then does the other mount refuse writes.
* tmpfs: statvfs shows the size= exactly (rounded up to 4096-byte pages); writes past it fail with
  ENOSPC from write() itself.
"""

from __future__ import annotations

import errno
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

Views = tuple[Path, Path]

DEADLINE_S = 30.0  # for any one step that involves another process


@pytest.fixture(
    params=[
        "local",
        pytest.param("juicefs", marks=pytest.mark.juicefs),
        pytest.param("tmpfs", marks=pytest.mark.tmpfs),
    ]
)
def views(request: pytest.FixtureRequest, tmp_path: Path) -> Views:
    """(node 1's path, node 2's path) to one fresh, empty directory."""
    kind: str = request.param
    if kind == "juicefs":
        first, second = request.getfixturevalue("juicefs_mounts")
        return first, second
    if kind == "tmpfs":
        mount = request.getfixturevalue("tmpfs_small")(64 << 20)
        return mount, mount
    local = tmp_path / "local"
    local.mkdir()
    return local, local


# --------------------------------------------------------------------------------------------------
# Helpers: writing whole buffers, child processes with deadlines


def _strerror(*codes: int) -> str:
    """A pytest.raises(match=...) pattern for OSErrors with any of these errnos (then assert .errno)."""
    return "|".join(re.escape(os.strerror(code)) for code in codes)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fill(path: Path, total: int, chunk: int = 1 << 20) -> int:
    """Write total bytes to a new file at path, then fsync and close it; returns total.

    Raises the first OSError of the open/write/fsync/close steps (the file is closed either way).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        buf = os.urandom(chunk)
        written = 0
        while written < total:
            written += os.write(fd, buf[: min(chunk, total - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return total


HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.readline()
fcntl.flock(fd, fcntl.LOCK_UN)
print("released", flush=True)
sys.stdin.readline()
"""

TRY_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    print("busy", flush=True)
else:
    print("acquired", flush=True)
"""


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """spawn(code, *args) -> a Python child with pipes; every child is killed and reaped afterwards."""
    children: list[subprocess.Popen[str]] = []

    def start(code: str, *args: str | Path) -> subprocess.Popen[str]:
        child = subprocess.Popen(
            [sys.executable, "-c", code, *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        children.append(child)
        return child

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=DEADLINE_S)
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()


def _read_line(child: subprocess.Popen[str], timeout: float = DEADLINE_S) -> str:
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"child {child.pid} said nothing within {timeout:g}s")
    return child.stdout.readline().strip()


def _tell(child: subprocess.Popen[str], line: str) -> None:
    assert child.stdin is not None
    child.stdin.write(line + "\n")
    child.stdin.flush()


def _try_lock(spawn: Callable[..., subprocess.Popen[str]], path: Path) -> str:
    child = spawn(TRY_LOCK, path)
    answer = _read_line(child)
    assert child.wait(timeout=DEADLINE_S) == 0
    return answer


# --------------------------------------------------------------------------------------------------
# Publishing: rename, exclusive create, hard links, fsync


def test_rename_dir_onto_nonempty_dir_fails_and_first_publisher_wins(views: Views) -> None:
    node1, node2 = views
    (node1 / "entries").mkdir()
    for stage, payload in (("stage1", b"first"), ("stage2", b"second")):
        (node1 / stage).mkdir()
        (node1 / stage / "artifact").write_bytes(payload)
    # Look the names up on node 2 first, so that a cached lookup there would show below.
    assert not (node2 / "entries" / "key").exists()
    assert (node2 / "stage1" / "artifact").read_bytes() == b"first"

    os.rename(node1 / "stage1", node1 / "entries" / "key")

    # Visible on node 2 at once: no retry, no sleep.
    assert (node2 / "entries" / "key" / "artifact").read_bytes() == b"first"
    assert not (node2 / "stage1").exists()
    assert os.listdir(node2 / "entries") == ["key"]

    # The second publisher, on the other node, loses and keeps its staging directory.
    with pytest.raises(OSError, match=_strerror(errno.ENOTEMPTY, errno.EEXIST)) as lost:
        os.rename(node2 / "stage2", node2 / "entries" / "key")
    assert lost.value.errno in (errno.ENOTEMPTY, errno.EEXIST)
    assert lost.value.errno == errno.ENOTEMPTY  # what Linux gives on ext4, tmpfs and JuiceFS
    assert (node1 / "entries" / "key" / "artifact").read_bytes() == b"first"
    assert (node2 / "stage2" / "artifact").read_bytes() == b"second"


def test_rename_dir_onto_empty_dir_replaces_it(views: Views) -> None:
    # The caveat of "first publisher wins": an EMPTY directory at the final name is no claim at all.
    node1, node2 = views
    (node1 / "final").mkdir()
    (node1 / "stage").mkdir()
    (node1 / "stage" / "artifact").write_bytes(b"x")
    os.rename(node2 / "stage", node2 / "final")
    assert (node1 / "final" / "artifact").read_bytes() == b"x"


def test_exclusive_create_has_one_winner_across_nodes(views: Views) -> None:
    # The compile lease (cachemgr/volume/softlease.py) is an O_CREAT|O_EXCL file. On JuiceFS the metadata
    # engine makes the create exclusive; on SeaweedFS it is not (test_lease.py).
    node1, node2 = views
    os.close(os.open(node1 / "key.lock", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    with pytest.raises(FileExistsError):
        os.open(node2 / "key.lock", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.unlink(node1 / "key.lock")
    os.close(os.open(node2 / "key.lock", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    assert (node1 / "key.lock").exists()


def test_fsynced_file_reads_back_identically_on_other_node(views: Views) -> None:
    node1, node2 = views
    data = os.urandom((5 << 20) + 12345)  # crosses JuiceFS' 4 MiB block boundary, ends mid-page
    fd = os.open(node1 / "artifact.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
        # fsync alone publishes the bytes: node 2 reads them while node 1 still has the file open.
        assert (node2 / "artifact.bin").read_bytes() == data
    finally:
        os.close(fd)
    assert os.stat(node2 / "artifact.bin").st_size == len(data)
    assert (node2 / "artifact.bin").read_bytes() == data


def test_hard_link_survives_removal_of_the_original(views: Views) -> None:
    node1, node2 = views
    (node1 / "original").write_bytes(b"payload")
    os.link(node1 / "original", node1 / "link")
    assert os.stat(node1 / "link").st_nlink == 2
    with pytest.raises(FileExistsError):  # link(2) never replaces: another no-clobber publish
        os.link(node1 / "original", node1 / "link")

    os.unlink(node1 / "original")

    assert (node1 / "link").read_bytes() == b"payload"
    assert (node2 / "link").read_bytes() == b"payload"
    assert os.stat(node2 / "link").st_nlink == 1
    if node1 != node2:  # two JuiceFS mounts are two filesystems to the kernel
        with pytest.raises(OSError, match=_strerror(errno.EXDEV)) as cross:
            os.link(node1 / "link", node2 / "link2")
        assert cross.value.errno == errno.EXDEV


# --------------------------------------------------------------------------------------------------
# Leases: flock and mtime heartbeats


def test_flock_excludes_across_nodes(views: Views, spawn: Callable[..., subprocess.Popen[str]]) -> None:
    node1, node2 = views
    (node1 / "key.lock").touch()
    holder = spawn(HOLD_LOCK, node1 / "key.lock")
    assert _read_line(holder) == "locked"

    assert _try_lock(spawn, node2 / "key.lock") == "busy"
    assert _try_lock(spawn, node1 / "key.lock") == "busy"

    _tell(holder, "release")
    assert _read_line(holder) == "released"
    assert _try_lock(spawn, node2 / "key.lock") == "acquired"


def test_flock_is_released_when_the_holder_is_killed(
    views: Views, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    node1, node2 = views
    holder = spawn(HOLD_LOCK, node1 / "key.lock")
    assert _read_line(holder) == "locked"
    assert _try_lock(spawn, node2 / "key.lock") == "busy"

    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=DEADLINE_S)

    # The kernel releases the lock as it closes the dead process's files; for FUSE that is one more
    # request to the daemon, so allow a moment, but no more than a few seconds.
    deadline = time.monotonic() + 5
    while (answer := _try_lock(spawn, node2 / "key.lock")) == "busy" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert answer == "acquired"


def test_utime_on_one_node_is_seen_at_once_on_the_other(views: Views) -> None:
    node1, node2 = views
    (node1 / "lease").write_bytes(b"")
    before = os.stat(node2 / "lease").st_mtime_ns  # also fills node 2's attribute cache, if it had one

    past = before - 3600 * 10**9 + 123_456_789  # nanoseconds survive the round trip
    os.utime(node1 / "lease", ns=(past, past))
    assert os.stat(node2 / "lease").st_mtime_ns == past

    os.utime(node1 / "lease")  # a heartbeat: "now"
    beat = os.stat(node2 / "lease").st_mtime_ns
    assert beat > past
    assert beat == os.stat(node1 / "lease").st_mtime_ns


# --------------------------------------------------------------------------------------------------
# Full volumes: JuiceFS directory quota, tmpfs size


def _statvfs_bytes(path: Path) -> tuple[int, int]:
    """(total, available to us) in bytes."""
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll predicate until true; returns the seconds it took. Fails the test after timeout."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        time.sleep(0.05)
    return time.monotonic() - start


QUOTA = 16 << 20


@pytest.mark.parametrize("quota_path", ["/", "/cache"])
def test_juicefs_quota_shows_in_statvfs_and_refuses_writes_with_edquot(
    juicefs_volume_factory: Callable[..., list[Path]], quota_path: str
) -> None:
    node1, node2 = juicefs_volume_factory(quota_bytes=QUOTA, quota_path=quota_path)
    dir1, dir2 = node1 / quota_path.strip("/"), node2 / quota_path.strip("/")

    # statvfs of the quota directory is the quota, exactly, on both mounts, from the start.
    assert _statvfs_bytes(dir1) == (QUOTA, QUOTA)
    assert _statvfs_bytes(dir2) == (QUOTA, QUOTA)
    if quota_path != "/":  # the volume itself is unlimited (juicefs shows 1 PiB)
        assert _statvfs_bytes(node1)[0] > 1 << 40

    # Fill it with 3 MiB artifacts through node 1: five fit, the sixth (15 -> 18 MiB) is refused with
    # EDQUOT, from a later step than the write() that crossed the line (writes are buffered).
    artifact = 3 << 20
    for i in range(QUOTA // artifact):
        _fill(dir1 / f"artifact{i}", artifact)
    written = (QUOTA // artifact) * artifact
    with pytest.raises(OSError, match=_strerror(errno.EDQUOT)) as full:
        _fill(dir1 / "one-too-many", artifact)
    assert full.value.errno == errno.EDQUOT

    # Node 1's statvfs shows its own usage after a moment; node 2's after about a heartbeat, and from
    # then on node 2 refuses writes too.
    _wait_for(lambda: _statvfs_bytes(dir1)[1] < QUOTA - written + (64 << 10), 15, "usage on node 1")
    _wait_for(lambda: _statvfs_bytes(dir2)[1] < QUOTA - written + (64 << 10), 15, "usage on node 2")
    with pytest.raises(OSError, match=_strerror(errno.EDQUOT)) as refused:
        _fill(dir2 / "late", 1 << 20)
    assert refused.value.errno == errno.EDQUOT

    # Removing artifacts (trash disabled) gives the space back, on both nodes.
    for i in range(3):
        os.unlink(dir1 / f"artifact{i}")
    _wait_for(lambda: _statvfs_bytes(dir2)[1] > 3 * artifact, 15, "freed space on node 2")
    (dir2 / "late").unlink(missing_ok=True)
    _fill(dir2 / "after-cleanup", 1 << 20)


def test_juicefs_quota_refuses_one_oversized_file(juicefs_volume_factory: Callable[..., list[Path]]) -> None:
    (node1, _) = juicefs_volume_factory(quota_bytes=QUOTA)
    with pytest.raises(OSError, match=_strerror(errno.EDQUOT)) as full:
        _fill(node1 / "huge", 8 * QUOTA)
    assert full.value.errno == errno.EDQUOT


@pytest.mark.parametrize("size", [1 << 20, 1_000_000])
def test_tmpfs_size_shows_in_statvfs_and_writes_past_it_fail_with_enospc(
    tmpfs_small: Callable[[int], Path], size: int
) -> None:
    mount = tmpfs_small(size)
    rounded = -(-size // 4096) * 4096
    assert _statvfs_bytes(mount) == (rounded, rounded)

    with pytest.raises(OSError, match=_strerror(errno.ENOSPC)) as full:
        _fill(mount / "fill", 2 * size, chunk=64 << 10)
    assert full.value.errno == errno.ENOSPC
    assert _statvfs_bytes(mount)[1] == 0

    (mount / "fill").unlink()
    assert _statvfs_bytes(mount) == (rounded, rounded)
