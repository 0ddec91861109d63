"""How a run's failures become what operators see: the documented error, the failure record,
the state record's exit code.

The flow (cachemgr.runtime.runner) and the strategies raise; this module turns what went wrong
into the :class:`~cachemgr.core.errors.CacheMgrError` with its remedy and exit code, and writes
the failure record beside the key (``cachemgr show KEY``) with the same one-line message the
log, stderr and the Kubernetes termination message carry (cachemgr.cli.errors writes those).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachemgr.core.errors import (
    CacheMgrError,
    CompileError,
    ConfigError,
    DiskFullError,
    Interrupted,
    ServerFailedError,
    StateDirInUseError,
    VolumeError,
    WaitTimeoutError,
)
from cachemgr.core.fsutil import is_disk_full
from cachemgr.core.units import plural
from cachemgr.runtime.output import SERVER_TAIL_LINES
from cachemgr.runtime.state import StateDirBusy, claim_state_dir

if TYPE_CHECKING:
    from cachemgr.key.cachekey import CacheKey
    from cachemgr.runtime import launcher
    from cachemgr.runtime.metrics import Metrics
    from cachemgr.runtime.options import RunOptions
    from cachemgr.runtime.state import StateWriter
    from cachemgr.volume.identity import PodIdentity
    from cachemgr.volume.layout import CacheRoot


class DiskFullSeenError(Exception):
    """The compiler reported a full volume; turned into the full report by :func:`as_reported`.

    ``str()`` is the short cause the one-line message names (``the server printed 'No space left
    on device'``); ``line`` is what it printed (a copytree ``shutil.Error`` lists every file), kept
    for the report in the log event and the failure record, never in the one line."""

    def __init__(self, cause: str, *, line: str = "") -> None:
        super().__init__(cause)
        self.line = line


def interrupted(relay: launcher.SignalRelay) -> Interrupted:
    """The signal that stopped the run (SIGTERM when it cannot tell)."""
    return Interrupted(relay.received or 15)


def count_failed_run(error: CacheMgrError, *, metrics: Metrics, state: StateWriter) -> None:
    """The run failed: count it by reason and put its line and exit code in the state record."""
    metrics.failure(error.reason)
    state.phase("failed", reason=error.one_line(), exit_code=error.code)


def as_reported(
    error: BaseException,
    root: CacheRoot,
    key: CacheKey,
    *,
    given: int | None,
    written: int = 0,
    free_at_start: int | None = None,
    hook: bool = False,
) -> CacheMgrError | None:
    """The documented error for a failed attempt; None for a signal (nothing to record).
    ``hook``: a warm Job run as the chart's pre-upgrade hook (its full volume's remedy differs)."""
    from cachemgr.ops.space import disk_report

    if isinstance(error, Interrupted):
        return None
    figures: dict[str, Any] = {
        "given": given,
        "written": written,
        "free_at_start": free_at_start,
        "hook": hook,
    }
    if isinstance(error, DiskFullSeenError):
        return disk_report(root, key, cause=str(error), printed=error.line, **figures).error()
    if isinstance(error, CacheMgrError):
        return error
    if isinstance(error, OSError) and is_disk_full(error):
        cause = f"writing {error.filename}: {error.strerror}" if error.filename else str(error.strerror)
        return disk_report(root, key, cause=cause, printed=str(error), **figures).error()
    if isinstance(error, OSError):
        return VolumeError(
            f"cache volume I/O failed: {error}", remedy="check the compile cache PVC and the node's mount"
        )
    return None


def record(
    root: CacheRoot,
    key: CacheKey,
    identity: PodIdentity,
    error: CacheMgrError,
    *,
    written: int = 0,
    elapsed: float = 0.0,
    tail: list[str] | None = None,
) -> None:
    """The failure record: the same one-line message as the log and the termination message."""
    from cachemgr.volume.failure_records import record_failure  # a failure only: not on a hit

    record_failure(
        root,
        key.digest,
        identity,
        {
            "key": key.digest,
            "entry": key.entry_name,
            "reason": error.reason,
            "message": error.one_line(),
            "exit_code": error.code,
            "exit_status": error.fields.get("exit_status"),
            "strategy": key.inputs["strategy"],
            "bytes_written": written,
            "elapsed_s": round(elapsed, 2),
            "output_tail": tail or [],
            # What a server raised (its root cause may lie above the tail): cachemgr.runtime.output.
            **({"raised": error.fields["raised"]} if error.fields.get("raised") else {}),
            "report": error.fields.get("report"),
        },
    )


def compile_ended(
    code: int | None,
    watch: launcher.OutputWatch,
    *,
    relay: launcher.SignalRelay,
    what: str,
    key: CacheKey,
    compile_only_ok: bool = False,
) -> None:
    """Turn how a compile ended into the right error, or return when it succeeded."""
    from cachemgr.runtime.launcher import exit_status

    if watch.disk_full_line is not None:
        line = watch.disk_full_line
        lowered = line.lower()
        phrase = (
            "Disk quota exceeded"
            if "quota" in lowered or "errno 122" in lowered
            else "No space left on device"
        )
        raise DiskFullSeenError(f"the {what} printed '{phrase}'", line=line)
    if relay.stop.is_set():
        raise Interrupted(relay.received or 15, server_compiling=what == "server")
    if code == 0:
        return  # what it left is judged next: publish only what the server will load (loadable)
    status = exit_status(code if code is not None else -9)
    ended = "before its health endpoint answered" if compile_only_ok else "while compiling"
    how, remedy = _how_it_ended(status, ended, signalled=code is None or code < 0)
    # A server that refused its flags or could not load its model says why in its last lines: they
    # go into the termination message, as for a server that fails on a hit (server_failed).
    # What it raised, too: a real vLLM's root cause lies above its last lines (runtime.output).
    tail = (
        {"last_lines": watch.tail_text()[-SERVER_TAIL_LINES:], "raised": watch.raised()}
        if what == "server"
        else {}
    )
    raise CompileError(
        f"the {what} {how}; nothing was published",
        remedy=remedy
        or f"read its output (in the pod's log; its last lines are kept: cachemgr show {key.short}); "
        "the next start retries",
        exit_status=status,
        **tail,
    )


def _how_it_ended(status: int, ended: str, *, signalled: bool) -> tuple[str, str | None]:
    """ "exited with code N ...", or the signal that killed it; a SIGKILL is most likely the OOM killer's."""
    import signal

    number = status - 128
    if number == signal.SIGKILL:
        # The kernel's OOM killer sends SIGKILL; a shell wrapper reports that as code 137.
        how = "was killed by SIGKILL (signal 9)" if signalled else "exited with code 137 (SIGKILL, signal 9)"
        return (
            f"{how} {ended}: likely the out-of-memory killer",
            "raise the pod's memory limit; the next start retries",
        )
    if signalled and 0 < number < signal.NSIG:
        name = next((s.name for s in signal.Signals if s.value == number), "a signal")  # SIGRTMIN+N: no name
        return f"was killed by {name} (signal {number}) {ended}", None
    return f"exited with code {status} {ended}", None


def server_failed(
    returncode: int, *, key: CacheKey, entry: str, last_lines: list[str], raised: list[str]
) -> ServerFailedError:
    """A server that exited before it was ready on a hit: its exit code or signal, its last lines
    and what it raised (its tracebacks' last lines: cachemgr.runtime.output)."""
    from cachemgr.runtime.launcher import exit_status, signal_name

    status = exit_status(returncode)
    killed = signal_name(returncode)
    how = f"was killed by {killed} (exit {status})" if killed else f"exited with code {status}"
    return ServerFailedError(
        f"the server {how} before it was ready, on entry {entry} of key {key.short}",
        remedy="read its last lines (below in the termination message, in the 'failed' event); if every "
        f"start fails so, the entry may be what it cannot load: cachemgr show {key.short}",
        exit_status=status,
        signal=killed,
        entry=entry,
        last_lines=last_lines,
        raised=raised,
    )


def unreadable_entry(error: OSError, root: CacheRoot, key: CacheKey) -> VolumeError:
    return VolumeError(
        f"cannot read the cache entry for key {key.short} under {root.entries}: {error.strerror}",
        remedy="check the compile cache PVC mount (kubectl describe pod; dmesg on the node)",
    )


def staging_failed(error: OSError, root: CacheRoot, key: CacheKey, options: RunOptions) -> CacheMgrError:
    """Creating a staging directory failed: the full space report on a full volume."""
    from cachemgr.ops.space import disk_report

    if is_disk_full(error):
        cause = f"creating staging: {error.strerror}"
        return disk_report(root, key, cause=cause, given=options.expected_size, hook=options.hook).error()
    if isinstance(error, CacheMgrError):  # a folder of the way there refused (a link): its own line
        return error
    return VolumeError(
        f"cannot create a staging directory under {root.staging}: {error.strerror}"
        + (f" ({error.filename})" if error.filename else ""),
        remedy="check that the compile cache PVC is mounted read-write",
    )


def view_failed(error: OSError, views: Path, *, files: int) -> CacheMgrError:
    """The pod-local view of a hit could not be built: its directory is full, or unusable."""
    if is_disk_full(error):
        return DiskFullError(
            f"the pod's state dir is full ({error.strerror}): the view of the entry under {views} "
            f"takes a link, so an inode, per file ({plural(files, 'file')}); the cache volume is unharmed",
            remedy="give the state dir's emptyDir more room (or inodes), or point --state-dir "
            "(CACHEMGR_STATE_DIR) at a larger pod-local directory",
        )
    return ConfigError(
        f"cannot build the view of the entry under {views}: {error.strerror or error}",
        remedy="point --state-dir (CACHEMGR_STATE_DIR) at a writable pod-local directory (an emptyDir)",
    )


def wait_timeout(
    root: CacheRoot, key: CacheKey, waited: float, *, publisher: bool = False
) -> WaitTimeoutError:
    """``publisher``: the pod waited for any publisher (it cannot compile), not for a lease holder."""
    from cachemgr.volume.lease import read_holder

    holder = read_holder(root, key.digest) if root.leases.is_dir() else None
    gone = "a publisher (the builder or a warm Job)" if publisher else "a peer that has since released it"
    who = holder.describe() if holder else gone
    return WaitTimeoutError(
        f"gave up after {waited:.0f}s (--wait-timeout) waiting for {who} to compile key {key.short}",
        remedy="raise --wait-timeout or unset it to wait; 'cachemgr locks' shows the holder, whose logs say "
        "how its compile is going",
    )


def own_state_dir(state_dir: Path) -> int:
    """Own the pod-local state dir, or refuse: another live run's record and views stay its own."""
    try:
        return claim_state_dir(state_dir)
    except StateDirBusy as busy:
        raise StateDirInUseError(
            f"another cachemgr run (pid {busy.pid}) owns the state dir {state_dir} and serves this pod",
            remedy="use 'cachemgr warm' to fill the cache, or give this run its own --state-dir "
            "(CACHEMGR_STATE_DIR); the running server is left alone",
            state_dir=str(state_dir),
            owner_pid=busy.pid,
        ) from None
    except OSError as error:
        raise ConfigError(
            f"cannot use the state dir {state_dir}: {error.strerror or error}",
            remedy="point --state-dir (CACHEMGR_STATE_DIR) at a writable pod-local directory (an emptyDir)",
            state_dir=str(state_dir),
        ) from None
