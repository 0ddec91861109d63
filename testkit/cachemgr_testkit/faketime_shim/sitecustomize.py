"""Test-only: lets a Python process run under libfaketime 0.9.10 (Debian bookworm's faketime).

The fault campaign skews a pod's wall clock with libfaketime. With Python 3.11 and glibc 2.36,
libfaketime 0.9.10 breaks one of Python's two ways to wait, whichever way it is set up:

* faking the monotonic clock too (its default), ``sem_clockwait(CLOCK_MONOTONIC)`` never times
  out, so ``threading.Event.wait(timeout)`` and ``Lock.acquire(timeout=...)`` hang
  (wolfcw/libfaketime#390, #469);
* with ``FAKETIME_DONT_FAKE_MONOTONIC=1`` those work, but ``clock_nanosleep(CLOCK_MONOTONIC,
  TIMER_ABSTIME)``, which ``time.sleep`` uses, fails with EINVAL.

A real node with a skewed clock has neither problem: only its wall clock is off. So the campaign
sets ``FAKETIME_DONT_FAKE_MONOTONIC=1`` and puts this directory on ``PYTHONPATH``: ``time.sleep``
then waits on a lock, which works there and, like ``time.sleep``, runs signal handlers.
"""

import threading
import time


def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    _SLEEPER.acquire(timeout=seconds)


_SLEEPER = threading.Lock()
_SLEEPER.acquire()  # never released: every acquire(timeout=...) below waits its whole timeout
time.sleep = _sleep
