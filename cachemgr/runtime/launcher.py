"""Child processes: start, watch, signal, reap.

cachemgr is the pod's entrypoint, often PID 1. It forwards SIGTERM, SIGINT, SIGHUP and
SIGQUIT to the server, returns the server's exit code (128+N when killed by signal N), and
reaps orphaned zombies: it registers as the child subreaper, so the server's own workers
come back to it when their parent dies.

While something compiles, its output is pumped through line by line (to the same stream)
so cachemgr can spot ``Disk quota exceeded`` / ``No space left on device`` and end the
attempt cleanly, and a progress monitor (CPU time, bytes written, output lines) tells a
slow compile from a stalled one.
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
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import IO, Any, Literal

from cachemgr.core.errors import ConfigError, Interrupted
from cachemgr.core.fsutil import tree_bytes
from cachemgr.core.log import terminal_guard
from cachemgr.core.procs import Flag, StopFlag

# What compilers and vllm-rbln print when a write fails for space (errno 28 ENOSPC, 122 EDQUOT).
DISK_FULL_LINE = re.compile(
    r"disk quota exceeded|no space left on device|\[errno (?:28|122)\]|out of disk space", re.IGNORECASE
)
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
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

    @staticmethod
    def _forward(child: subprocess.Popen[bytes], signum: int) -> None:
        if child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)


class OutputWatch:
    """Pumps a child's stdout and stderr to ours, keeps the tail, and spots disk-full lines."""

    def __init__(self, child: subprocess.Popen[bytes], *, tail_lines: int = 40) -> None:
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self.lines = 0
        self.disk_full_line: str | None = None
        self.disk_full = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._pump, args=(stream, sink), daemon=True, name="cachemgr-output")
            for stream, sink in ((child.stdout, sys.stdout), (child.stderr, sys.stderr))
            if stream is not None
        ]
        for thread in self._threads:
            thread.start()

    def _pump(self, stream: IO[bytes], sink: IO[str]) -> None:
        out = getattr(sink, "buffer", None)
        for raw in iter(stream.readline, b""):
            with contextlib.suppress(OSError, ValueError), terminal_guard():
                if out is not None:
                    out.write(raw)
                    out.flush()
                else:
                    sink.write(raw.decode(errors="replace"))
            line = raw.decode(errors="replace").rstrip()
            with self._lock:
                self.lines += 1
                self.tail.append(line)
                if self.disk_full_line is None and DISK_FULL_LINE.search(line):
                    self.disk_full_line = line.strip()
                    self.disk_full.set()
        stream.close()

    def join(self, timeout: float = 5.0) -> None:
        for thread in self._threads:
            thread.join(timeout=timeout)

    def tail_text(self) -> list[str]:
        with self._lock:
            return list(self.tail)


TAIL_LINES = 20  # a server's last lines kept for the failure it may end in
TAIL_LINE_BYTES = 400  # each cut here: a 60 MB line without a newline stays 400 bytes
_CHUNK = 65536


class OutputTail:
    """The last :data:`TAIL_LINES` lines of an output, each cut at :data:`TAIL_LINE_BYTES`.

    Memory is bounded whatever the output: a line longer than the cut is kept cut (the rest
    is passed on, never held), and of a ``\r`` progress bar only its last state is kept.
    """

    def __init__(self) -> None:
        self._lines: deque[bytes] = deque(maxlen=TAIL_LINES)  # raw: decoded only when asked for
        self._partial = bytearray()
        self._lock = threading.Lock()

    def feed(self, chunk: bytes) -> None:
        # Only the first piece (the end of the line under way) and the last lines matter: found
        # with find/rfind, not split, which would make an object per line of a chatty server.
        first = chunk.find(b"\n")
        with self._lock:
            if first < 0:
                self._add(chunk, 0, len(chunk))
                return
            self._add(chunk, 0, first)
            self._end_line()
            ends = [chunk.rfind(b"\n")]  # newlines from the last back, the first one included
            while ends[-1] > first and len(ends) <= TAIL_LINES:
                ends.append(chunk.rfind(b"\n", first, ends[-1]))
            ends.reverse()
            for start, end in pairwise(ends):
                self._add(chunk, start + 1, end)
                self._end_line()
            self._add(chunk, ends[-1] + 1, len(chunk))

    def lines(self) -> list[str]:
        """The kept lines, and the unfinished last one; raw (escape them to print: core.printable)."""
        with self._lock:
            lines = [_last_state(line) for line in self._lines]
            partial = _last_state(self._partial)
        return [*lines, partial] if partial else lines

    def _add(self, chunk: bytes, start: int, end: int) -> None:
        room = TAIL_LINE_BYTES - len(self._partial)
        if room > 0:
            self._partial += chunk[start : min(end, start + room)]

    def _end_line(self) -> None:
        self._lines.append(bytes(self._partial))
        self._partial.clear()


def _last_state(raw: bytes | bytearray) -> str:
    """What a terminal shows of a line: the part after its last carriage return."""
    states = [s for s in raw.decode(errors="replace").split("\r") if s.strip()]
    return states[-1].rstrip() if states else ""


class ServerOutput:
    """Passes a server's stdout and stderr on to ours byte for byte, keeping an :class:`OutputTail`.

    Each chunk is written on the moment it is read, with no line buffering (a progress bar still
    moves), from a thread per stream that waits in the kernel, not in Python. A stream that is a
    terminal is not piped at all (:func:`start` with ``capture="tail"``): a person reading it
    sees the server's own output, and the server still sees its terminal.
    """

    def __init__(self, child: subprocess.Popen[bytes]) -> None:
        self.tail = OutputTail()
        self._threads = [
            threading.Thread(target=self._pump, args=(stream, fd), daemon=True, name="cachemgr-server-output")
            for stream, fd in ((child.stdout, 1), (child.stderr, 2))
            if stream is not None
        ]
        for thread in self._threads:
            thread.start()

    def _pump(self, stream: IO[bytes], fd: int) -> None:
        source = stream.fileno()
        sink: int | None = fd
        with contextlib.suppress(OSError, ValueError):
            while chunk := os.read(source, _CHUNK):
                if sink is not None and not _write_all(sink, chunk):
                    sink = None  # our stream is gone: keep draining, or the server blocks on a full pipe
                self.tail.feed(chunk)
        with contextlib.suppress(OSError):
            stream.close()

    def join(self, timeout: float) -> None:
        """Until the streams end (the server's children may hold them open: bounded by ``timeout``)."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _write_all(fd: int, data: bytes) -> bool:
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        return False
    return True


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


def wait_reaping(child: subprocess.Popen[bytes], *, reaper: bool) -> int:
    """Wait for the server, reaping any orphan zombie meanwhile; its exit status (128+N on signal N)."""
    if not reaper:
        return exit_status(child.wait())
    while child.returncode is None:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            # Reaped elsewhere (Popen.poll in another thread); it knows the code.
            return exit_status(child.wait())
        if pid == child.pid:
            child.returncode = os.waitstatus_to_exitcode(status)
    return exit_status(child.returncode)


@dataclass
class Progress:
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

    def __init__(self, child: subprocess.Popen[bytes], *, staging: Path | None, output: OutputWatch | None):
        self._child = child
        self._staging = staging
        self._output = output
        self.progress = Progress(last_progress=time.monotonic())
        self._seen: tuple[float, int, int, int, int] | None = None

    def sample(self) -> Progress:
        cpu, written, read = _tree_usage(self._child.pid)
        staged = tree_bytes(self._staging) if self._staging is not None else 0
        lines = self._output.lines if self._output is not None else 0
        now_seen = (round(cpu, 2), written, read, staged, lines)
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
