"""Is a process alive? Standard library only: the probes import this too."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an exited child nobody reaped yet).

    Only meaningful on the host that owns the pid: pids of other nodes (or pod PID
    namespaces) say nothing here, so callers compare hosts first.
    """
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
