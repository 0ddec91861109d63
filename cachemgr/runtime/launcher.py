"""Child processes: start, watch, signal, reap.

cachemgr is the pod's entrypoint, often PID 1. It forwards SIGTERM, SIGINT, SIGHUP and
SIGQUIT to the server, returns the server's exit code (128+N when killed by signal N), and
reaps orphaned zombies: it registers as the child subreaper, so the server's own workers
come back to it when their parent dies. A server still running :data:`STOP_GRACE` seconds after
a termination signal was forwarded to it is killed with every process under cachemgr (SIGKILL):
the real vLLM, signalled while its engine core loads, may not exit at all (docs/design.md).

While something compiles, its output is pumped through in bounded chunks as it arrives (to
the same stream; cachemgr.runtime.output keeps a bounded tail) so cachemgr can spot ``Disk
quota exceeded`` / ``No space left on device`` and end the attempt cleanly, and a progress
monitor (CPU time, bytes written, output printed) tells a slow compile from a stalled one.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal, NamedTuple

from cachemgr.core.errors import ConfigError, Interrupted
from cachemgr.core.fsutil import tree_bytes
from cachemgr.core.procs import Flag, StopFlag, helpers
from cachemgr.runtime.output import LINE_BYTES, TAIL_LINES, ChildStreams

# What compilers and vllm-rbln print when a write fails for space (errno 28 ENOSPC, 122 EDQUOT),
# in lower case: the output pump looks for them in the lowered bytes (bytes.find, no regex: it
# reads everything a compiler prints).
DISK_FULL_PHRASES = (
    b"disk quota exceeded",
    b"no space left on device",
    b"[errno 28]",
    b"[errno 122]",
    b"out of disk space",
)
DISK_FULL_LINE = re.compile("|".join(re.escape(p.decode()) for p in DISK_FULL_PHRASES), re.IGNORECASE)
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# Seconds a server (or a compiler) has to exit after the pod's termination signal reached it;
# then it is killed. Well inside the chart's terminationGracePeriodSeconds (120), so the pod
# still ends with its own code and message rather than the kubelet's SIGKILL.
STOP_GRACE = 30.0
_TERMINATING = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGQUIT})
_PR_SET_CHILD_SUBREAPER = 36


def exit_status(returncode: int) -> int:
    """A shell's view of a child's status: 128+N when it was killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def signal_name(returncode: int | None) -> str | None:
    """``SIGKILL`` for a child killed by it (Popen's returncode -9); None for an exit code, even
    137: a process that calls ``exit(137)`` was not killed."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux), so their zombies are ours to reap."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


class SignalRelay:
    """Termination signals stop cachemgr's own work and reach the server once it runs.

    Handlers run in the main thread; they only forward the signal and set a lock-free flag,
    so waiting code notices it and cleans up in the normal flow (staging removed, lease
    released). Before the server runs, :meth:`check` is where the flow ends on a signal: every
    phase is entered through it (the runner's ``enter``), and :meth:`spawn` starts the server
    only through it, so no server is started after a termination signal.
    """

    def __init__(self) -> None:
        self.stop = StopFlag()
        self.received: int | None = None
        # A termination signal reached the attached child while it still ran: its exit is then
        # the stop's. One that came after the child died (a zombie, or reaped) did not cause its
        # exit: a server that died before ready on its own is a failure, whenever the signal
        # came (issue 40: a rollout's SIGTERM just after the server's death hid the failure).
        self.stopped_child: str | None = None  # that signal's name
        self._child: subprocess.Popen[bytes] | None = None
        self._starting = False  # inside spawn(): a signal now is kept for the child being started
        self._pending: list[int] = []
        self._previous: dict[int, Any] = {}

    def install(self) -> SignalRelay:
        for signum in FORWARDED_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def check(self) -> None:
        """Raise :class:`Interrupted` once a termination signal arrived while no server runs.

        With a server attached (a ``vllm`` compile serves as it compiles) the signal was forwarded
        to it, and the flow follows the server's exit instead.
        """
        child = self._child
        if self.stop.is_set() and (child is None or child.returncode is not None):
            raise Interrupted(self.received or signal.SIGTERM)

    def spawn(self, start: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        """Start the server with ``start()`` and attach it, unless a termination signal came first.

        A signal that arrives after the check, while the child is being started, is kept and
        forwarded as soon as the child is attached: it never runs unsignalled.
        """
        self._starting = True
        try:
            self.check()
            child = start()
            self._child = child  # from here on the handler forwards by itself
        finally:
            self._starting = False
        pending, self._pending = self._pending, []
        for signum in pending:
            self._forward(child, signum)
        return child

    def attach(self, child: subprocess.Popen[bytes] | None) -> None:
        self._child = child

    def _handle(self, signum: int, _frame: Any) -> None:
        if signum in _TERMINATING:
            self.received = signum
            self.stop.set()
        child = self._child
        if child is not None:
            self._forward(child, signum)
        elif self._starting:
            self._pending.append(signum)

    def _forward(self, child: subprocess.Popen[bytes], signum: int) -> None:
        if child.returncode is None and _running(child.pid):
            if signum in _TERMINATING:
                self.stopped_child = signal.Signals(signum).name
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)


def _running(pid: int) -> bool:
    """The child has not exited: ``waitid`` with ``WNOWAIT`` looks without reaping (a zombie
    stays for whoever waits for it; ``kill`` alone succeeds on a zombie too)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False  # reaped already


class OutputWatch(ChildStreams):
    """Pumps a child's stdout and stderr to ours in bounded chunks (cachemgr.runtime.output),
    keeps a bounded tail of its lines, and spots disk-full messages."""

    def __init__(self, child: subprocess.Popen[bytes], *, tail_lines: int = TAIL_LINES) -> None:
        self.disk_full = threading.Event()
        super().__init__(
            child,
            lines=tail_lines,
            line_bytes=LINE_BYTES,
            phrases=DISK_FULL_PHRASES,
            name="cachemgr-output",
            disk_full=self.disk_full,
        )

    @property
    def lines(self) -> int:
        """Lines printed so far (a \r frame is not one: see ``bytes``)."""
        return self._tail.count

    @property
    def bytes(self) -> int:
        """Bytes printed so far: a progress bar redrawn with \r moves this, not ``lines``."""
        return self._tail.bytes

    @property
    def disk_full_line(self) -> str | None:
        with self._tail.lock:
            return next((t for t in (p.keeper.disk_full_text() for p in self._pumps) if t), None)

    def join(self, timeout: float = 5.0) -> None:
        for thread in self._threads:
            thread.join(timeout=timeout)

    def tail_text(self) -> list[str]:
        with self._tail.lock:
            return list(self._tail.lines)


def start(
    argv: Sequence[str], *, env: Mapping[str, str], capture: bool | Literal["tail"], what: str
) -> subprocess.Popen[bytes]:
    """Start a child in our process group (a pod's death takes it too).

    ``capture``: True pipes both streams (a compile, read line by line: :class:`OutputWatch`);
    ``"tail"`` pipes each that is not a terminal (a server: :class:`ServerOutput`); False none.
    """
    stdout, stderr = (_pipe(capture, sys.stdout), _pipe(capture, sys.stderr))
    try:
        return subprocess.Popen(
            list(argv), env=dict(env), stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        raise ConfigError(
            f"{what} '{argv[0]}' was not found on PATH",
            remedy="run in the modelserver image, or fix the command after '--' / in --compile-cmd",
        ) from None
    except PermissionError:
        raise ConfigError(
            f"{what} '{argv[0]}' is not executable", remedy="fix its path or permissions"
        ) from None


def _pipe(capture: bool | Literal["tail"], stream: IO[str]) -> int | None:
    if capture == "tail":
        try:
            terminal = stream.isatty()
        except (AttributeError, ValueError):
            terminal = False
        return None if terminal else subprocess.PIPE
    return subprocess.PIPE if capture else None


def terminate_tree(child: subprocess.Popen[bytes], *, grace: float = 10.0) -> None:
    """SIGTERM the child and its descendants, SIGKILL what is left after ``grace`` seconds."""
    import psutil  # only when something must be stopped: the hit path never pays for it

    try:
        procs = [psutil.Process(child.pid), *psutil.Process(child.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _gone, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=grace)


def wait_reaping(
    child: subprocess.Popen[bytes], *, reaper: bool, stop: Flag | None = None, grace: float = STOP_GRACE
) -> int:
    """Wait for the server, reaping any orphan zombie meanwhile; its exit status (128+N on signal N).

    ``stop``: set once the pod's termination signal was forwarded. From then on the server and
    everything under cachemgr (the server's workers, orphans it adopted) have ``grace`` seconds;
    what is still running then is killed (SIGKILL), and so is what the server left behind when
    it exits sooner. A container's PID 1 that exits takes its processes with it; outside one (a
    test, a node's own process) nothing of the server may outlive the pod either.

    Never one blocking wait: the kernel may hand a termination signal to any of our threads (it
    does after a SIGSTOP of the pod: a stopped main thread does not "want" it, and the first thread
    to run takes it). Python runs the handler, which forwards it to the server, only when the main
    thread next executes; blocked in ``waitpid`` for a server that is not told to stop, it never
    would. So the main thread looks every :data:`_WAIT_EVERY` seconds.
    """
    deadline: float | None = None
    while child.returncode is None:
        if stop is not None and stop.is_set():
            if deadline is None:
                deadline = time.monotonic() + grace
            elif time.monotonic() >= deadline:
                kill_descendants(why="still running after the stop's grace", grace=grace)
                deadline = time.monotonic() + grace  # killed: what appears since gets as long
        if not reaper:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=_WAIT_EVERY)
            continue
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            # Reaped elsewhere (Popen.poll in another thread); it knows the code.
            return exit_status(child.wait())
        if pid == child.pid:
            child.returncode = os.waitstatus_to_exitcode(status)
        elif pid == 0:
            time.sleep(_WAIT_EVERY)
    if deadline is not None:
        _end_leftovers(deadline, reaper=reaper)
    return exit_status(child.returncode)


def kill_descendants(*, why: str, grace: float) -> int:
    """SIGKILL every process under cachemgr (the server's tree and the orphans cachemgr adopted
    as subreaper); how many. Said in the log, as the kubelet's own SIGKILL would not be."""
    import psutil  # only on a stop that overran its grace

    procs = _under_cachemgr()
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    if procs:
        from cachemgr.core.log import get_logger

        get_logger("cachemgr.run").warning("server_killed", processes=len(procs), grace_s=grace, reason=why)
    return len(procs)


def _under_cachemgr() -> list[Any]:
    """Every process under cachemgr (psutil), but its own helpers (the remote transfer's child)
    and theirs: a stopped server's tree and the orphans cachemgr adopted."""
    import psutil  # only on a stop

    mine = psutil.Process()
    own = helpers()
    skip: set[int] = set()
    for child in mine.children():
        if child.pid in own:
            skip.add(child.pid)
            with contextlib.suppress(psutil.NoSuchProcess):
                skip.update(p.pid for p in child.children(recursive=True))
    return [p for p in mine.children(recursive=True) if p.pid not in skip]


def _end_leftovers(deadline: float, *, reaper: bool) -> None:
    """After a stop, the server has exited: what it left running (an engine core it did not end)
    has until ``deadline``, then is killed; zombies are reaped meanwhile."""
    import psutil

    def alive() -> list[psutil.Process]:
        left = []
        for proc in _under_cachemgr():
            with contextlib.suppress(psutil.NoSuchProcess):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(proc)
        return left

    while alive():
        if time.monotonic() >= deadline:
            kill_descendants(why="left running by the stopped server", grace=STOP_GRACE)
            break
        if reaper:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(-1, os.WNOHANG)
        time.sleep(_WAIT_EVERY)
    if reaper:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass


_WAIT_EVERY = 0.2


class Progress(NamedTuple):
    """The last observed compile activity, for the state record and stall detection."""

    cpu_seconds: float = 0.0
    written_bytes: int = 0
    staging_bytes: int = 0
    output_lines: int = 0
    last_progress: float = 0.0  # monotonic


class ProgressMonitor:
    """Samples a process tree: any change in CPU time, bytes read or written, or output is progress.

    Used while compiling and while a server loads its model; reads count so a load that only
    streams weights in is not taken for a stall.
    """

    def __init__(
        self,
        child: subprocess.Popen[bytes],
        *,
        staging: Path | None,
        output: OutputWatch | None,
        within: Path | None = None,
    ):
        """``within``: the cache root ``staging`` lies under, reached from it one level at a time
        (a folder of the way swapped for a link is not followed to a tree outside the root)."""
        self._child = child
        self._staging, self._within = staging, within
        self._output = output
        self.progress = Progress(last_progress=time.monotonic())
        self._seen: tuple[float, int, int, int, int, int] | None = None

    def sample(self) -> Progress:
        cpu, written, read = _tree_usage(self._child.pid)
        staged = tree_bytes(self._staging, within=self._within) if self._staging is not None else 0
        lines = self._output.lines if self._output is not None else 0
        printed = self._output.bytes if self._output is not None else 0  # a \r bar prints no line
        now_seen = (round(cpu, 2), written, read, staged, lines, printed)
        changed = now_seen != self._seen
        self._seen = now_seen
        last = time.monotonic() if changed else self.progress.last_progress
        self.progress = Progress(cpu, written, staged, lines, last)
        return self.progress

    def stalled_for(self) -> float:
        return time.monotonic() - self.progress.last_progress


def _tree_usage(pid: int) -> tuple[float, int, int]:
    """CPU seconds, bytes written and bytes read by a process and its descendants."""
    import psutil  # compile and load watching only

    cpu, written, read = 0.0, 0, 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return cpu, written, read
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            times = proc.cpu_times()
            io = proc.io_counters()
            cpu += times.user + times.system
            written += getattr(io, "write_chars", 0)
            read += getattr(io, "read_chars", 0)
    return cpu, written, read


def run_until(
    child: subprocess.Popen[bytes],
    *,
    events: Sequence[Flag],
    every: Callable[[], None] | None = None,
    tick: float = 0.2,
) -> int | None:
    """Wait until the child exits (its return code) or one of ``events`` is set (None).

    ``every()`` runs once per tick while waiting: progress sampling, health checks.
    """
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return child.wait(timeout=tick)
        if any(event.is_set() for event in events):
            return None
        if every is not None:
            every()
