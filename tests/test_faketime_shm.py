"""The test session leaves nothing of libfaketime in /dev/shm for the processes it killed.

A process started with ``skewed_env`` gets ``faketime_shm_<pid>`` and ``sem.faketime_sem_<pid>``
from libfaketime, removed only at a normal exit: the clock-skew tests and the campaign SIGKILL
such pods, and /dev/shm filled up with thousands of pairs. ``conftest.pytest_sessionfinish``
sweeps the ones whose pid is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from cachemgr_testkit.podlib import DEADLINE, FAKETIME_LIB, FAKETIME_SHM, skewed_env, sweep_faketime_shm

pytestmark = pytest.mark.skipif(FAKETIME_LIB is None, reason="libfaketime is not installed")

# Prints its pid once libfaketime is set up (its constructor ran before Python did), then waits
# for its stdin to close: no sleep.
_CHILD = "import os, sys; print(os.getpid(), flush=True); sys.stdin.read()"


@contextmanager
def _skewed() -> Iterator[subprocess.Popen[str]]:
    with subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        env={**os.environ, **skewed_env(600)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            assert int(child.stdout.readline()) == child.pid
            yield child
        finally:
            child.kill()
            child.wait(DEADLINE)


def _objects(pid: int) -> list[str]:
    """The libfaketime objects of ``pid`` still in /dev/shm."""
    return [
        name for name in (f"faketime_shm_{pid}", f"sem.faketime_sem_{pid}") if (FAKETIME_SHM / name).exists()
    ]


def test_the_sweep_removes_a_killed_process_s_objects_and_keeps_a_live_one_s() -> None:
    with _skewed() as killed, _skewed() as live:
        expected = [f"faketime_shm_{killed.pid}", f"sem.faketime_sem_{killed.pid}"]
        assert _objects(killed.pid) == expected, "libfaketime no longer makes them: drop the sweep"
        killed.send_signal(signal.SIGKILL)
        killed.wait(DEADLINE)
        assert _objects(killed.pid) == expected, "left behind by the kill"

        removed = sweep_faketime_shm()

        assert set(expected) <= set(removed)
        assert _objects(killed.pid) == []
        assert _objects(live.pid) == [f"faketime_shm_{live.pid}", f"sem.faketime_sem_{live.pid}"]
        assert live.stdin is not None
        live.stdin.close()  # a normal exit: libfaketime removes its own
        assert live.wait(DEADLINE) == 0
        assert _objects(live.pid) == []
