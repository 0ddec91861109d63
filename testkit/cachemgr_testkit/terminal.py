"""A command on a pseudo-terminal, as ``kubectl exec -it`` gives it one: what a person sees, in order."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time
from collections.abc import Sequence


def read_terminal(leader: int, proc: subprocess.Popen[bytes], *, deadline: float) -> bytes:
    """What ``proc`` wrote to the terminal whose leader side is ``leader``, until it closed the
    terminal or exited, or ``deadline`` seconds passed. Closes ``leader``."""
    shown = b""
    until = time.monotonic() + deadline
    try:
        while time.monotonic() < until:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                shown += chunk
            elif proc.poll() is not None:
                break
    finally:
        os.close(leader)
    return shown


def on_pty(argv: Sequence[str], env: dict[str, str], *, deadline: float) -> tuple[int, str]:
    """``argv`` with stdin, stdout and stderr on one pseudo-terminal: its exit code, and the text shown."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        list(argv), env=env, stdin=follower, stdout=follower, stderr=follower, close_fds=True
    )
    os.close(follower)
    shown = read_terminal(leader, proc, deadline=deadline)
    return proc.wait(timeout=deadline), shown.decode(errors="replace").replace("\r\n", "\n")
