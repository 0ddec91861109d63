"""Is the process a record names gone? The one rule for lease holders and attempt owners.

A record on the volume (a lease marker, a staging attempt's owner record) names the process that
wrote it: host, pid, and where the writer knows them its boot, pid namespace and start time. Only
a reader on that host (the same boot and pid namespace, when the record says which) can probe
that pid; any other reader can tell nothing from it and goes by silence instead. Everything that
says "dead" says it by :func:`gone_here`: the lease's contenders (a holder gone is taken over at
once), ``locks`` and ``show``, ``ls``'s attempt status, and ``prune --stale-staging``.
"""

from __future__ import annotations

import functools
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from cachemgr.core.procs import pid_alive


@dataclass(frozen=True)
class Here:
    """This process as records name it, and how a record from this host is recognised."""

    pid: int
    host: str
    started: float
    boot: str | None
    pidns: str | None

    @classmethod
    def current(cls) -> Here:
        return _here(os.getpid())

    def knows(self, *, host: str | None, boot: str | None, pidns: str | None) -> bool:
        """The record's writer ran in this host's pid namespace, so its pid can be probed from here.

        A record that names its boot and pid namespace must match both (lease markers, and
        attempts' owner records since they name them); one that names neither (an owner record of
        an older cachemgr) is probed on a matching host name alone.
        """
        if host != self.host:
            return False
        if boot is None and pidns is None:
            return True
        return boot == self.boot and pidns == self.pidns


@functools.cache
def _here(pid: int) -> Here:
    return Here(pid, socket.gethostname(), psutil.Process(pid).create_time(), boot_id(), pidns())


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def pidns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_gone(pid: int, started: float | None) -> bool:
    """``pid`` no longer runs the process that started at ``started`` (psutil's create time)."""
    try:
        return started is not None and abs(psutil.Process(pid).create_time() - started) > 0.01
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def gone_here(
    *,
    host: str | None,
    pid: int | None,
    boot: str | None = None,
    pidns: str | None = None,
    started: float | None = None,
) -> bool:
    """The record's process is known gone: it ran here (:meth:`Here.knows`) and runs no more.

    False whenever this reader cannot tell (another host, no pid): silence decides then.
    """
    if pid is None or pid <= 0:
        return False
    me = Here.current()
    if not me.knows(host=host, boot=boot, pidns=pidns):
        return False
    if pid == me.pid and started in (None, me.started):
        return False  # this very process
    if started is not None:
        return process_gone(pid, started)
    return not pid_alive(pid)


def process_marks() -> dict[str, Any]:
    """What a record must name for this rule to tell this process gone, as a lease marker names it:
    its start time (a reused pid is not the writer), boot and pid namespace (a reader in another
    pid namespace with the same host name, a sidecar or a debug container, cannot probe the pid).
    Written into a staging attempt's owner record."""
    me = Here.current()
    marks: dict[str, Any] = {"started": me.started}
    marks.update({name: value for name, value in (("boot", me.boot), ("pidns", me.pidns)) if value})
    return marks


def owner_gone(owner: Mapping[str, Any]) -> bool:
    """An attempt's owner record (``host``, ``pid``, and where it names them ``started``, ``boot``,
    ``pidns``: :func:`process_marks`) names a process known gone here. Fields of the wrong type
    read as absent: anyone can write the record."""
    pid, host = owner.get("pid"), owner.get("host")
    if isinstance(pid, bool) or not isinstance(pid, int) or not isinstance(host, str):
        return False
    boot, pidns = owner.get("boot"), owner.get("pidns")
    return gone_here(
        host=host,
        pid=pid,
        boot=boot if isinstance(boot, str) else None,
        pidns=pidns if isinstance(pidns, str) else None,
        started=_when(owner.get("started")),
    )


def _when(value: Any) -> float | None:
    """A start time from a record: a finite, positive number, else unknown."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value) if value > 0 else None
