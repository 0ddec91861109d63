"""Is a process alive, and a stop flag signal handlers may set. Standard library only: the
probes import this too."""

from __future__ import annotations

import os
import time
from typing import Protocol

_PID_MAX = 1 << 22  # the kernel's highest pid_max (PID_MAX_LIMIT on 64-bit)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an exited child nobody reaped yet).

    Only meaningful on the host that owns the pid: pids of other nodes (or pod PID
    namespaces) say nothing here, so callers compare hosts first.
    """
    if not 0 < pid <= _PID_MAX:
        return False  # 0 and negatives signal process groups; a huge one (a damaged record) overflows
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # "pid (comm) S ...": the state letter follows the last ')', comm may hold spaces.
            fields = stat.read().rpartition(b")")[2].split()
    except OSError:
        return True  # no procfs: existence is all we can tell
    return not fields or fields[0] not in {b"Z", b"X"}


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (/proc/PID/stat field 22); None if unknown.

    A pid with the same start time is the same process: a pod's emptyDir outlives its
    container, and the next container's ``run`` is pid 1 again, so a pid alone cannot tell
    the live owner of a state record or a view from a dead one.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
        return int(fields[19])  # field 22 overall; the first after "(comm)" is field 3
    except (OSError, ValueError, IndexError):
        return None


def same_process(pid: int, started: int | None) -> bool:
    """True while the process ``pid`` that started at ``started`` (see start_ticks) still runs."""
    if not pid_alive(pid):
        return False
    return started is None or start_ticks(pid) in (None, started)


class Flag(Protocol):
    def is_set(self) -> bool: ...


class StopFlag:
    """A flag a signal handler may set: no lock inside.

    ``threading.Event.set`` takes a lock; a handler that runs while the main thread holds
    it (a second SIGTERM arriving inside the first handler) deadlocks. This flag is a plain
    attribute, and :meth:`wait` polls it in short sleeps, which signals interrupt.
    """

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._set:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(0.05, remaining))
        return True


# cachemgr's own helper processes (the remote transfer's child, cachemgr.remote.bounded): they are
# under cachemgr as the server's workers are, but a stopped server's leftovers never include them
# (cachemgr.runtime.launcher: an upload under way after a stop has its own bound).
_HELPERS: set[int] = set()


def add_helper(pid: int) -> None:
    _HELPERS.add(pid)


def discard_helper(pid: int) -> None:
    _HELPERS.discard(pid)


def helpers() -> frozenset[int]:
    return frozenset(_HELPERS)
