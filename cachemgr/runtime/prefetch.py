"""Read-ahead on a hit: the entry's files into the page cache while the server initialises.

A server on a hit spends its import and engine set-up (tens of seconds for vLLM) before it
reads the compiled model, file by file, from the shared volume; one sequential reader gets a
fraction of what a network filesystem delivers. cachemgr knows, the moment it launches the
server, which files it will read. So right after the launch (never before it: the launch is
not delayed) a thread reads them with parallel readers (:func:`cachemgr.volume.reader.read_entry`)
in the server's order, by the cheapest mechanism for the filesystem (``posix_fadvise`` on a
local disk, plain reads on FUSE and network filesystems), through the same symlink-refusing
descriptors as every read of the volume.

It stops when every file is read, when the server has read a file itself (its open
descriptors, from ``/proc``, say where it is: a part it has read is not read again), when the
server exits, on SIGTERM, and when the memory budget is spent
(:mod:`cachemgr.core.membudget`: a fraction of the room under the pod's cgroup limit and the
node's). It logs one ``prefetch_done`` event and counts its figures in the run's metrics
(``cachemgr_prefetch_*``). ``--prefetch off`` (``CACHEMGR_PREFETCH=off``) turns it off.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachemgr.core import membudget
from cachemgr.core.fsutil import filesystem_type
from cachemgr.core.log import get_logger
from cachemgr.core.procs import Flag
from cachemgr.runtime.metrics import Metrics
from cachemgr.volume.manifest import ARTIFACTS, FileRecord
from cachemgr.volume.reader import Mechanism, ReadResult, loader_order, mechanism_for, read_entry

if TYPE_CHECKING:
    from cachemgr.volume.store import Lookup

EVENT = "prefetch_done"
# Workers: advice only queues reads (a few keep a local disk's queue full); reads on FUSE and
# network filesystems each wait a round trip, so more of them overlap (bench/bench_prefetch.py).
WORKERS: dict[Mechanism, int] = {"advise": 4, "read": 16}
WATCH_INTERVAL = 0.2  # seconds between two looks at the server's open files
NICE = 10  # the readers' niceness (a thread's own, on Linux)
JOIN_SECONDS = 2.0  # a stopping run waits this long for the readers (one chunk each), then goes on

log = get_logger("cachemgr.run")


class _Any:
    """Set when any of the flags is."""

    def __init__(self, *flags: Flag) -> None:
        self.flags = flags

    def is_set(self) -> bool:
        return any(flag.is_set() for flag in self.flags)


class ServerReads:
    """How far the server's processes have read each of the entry's files, from ``/proc``.

    ``/proc/PID/fd/N`` names the file a descriptor is open on (the entry's real path: the view's
    links resolve into the entry) and ``/proc/PID/fdinfo/N`` its offset. A file the server
    has open at offset P has been read up to P: the read-ahead does not read that part again.
    A file the server reads between two looks is not seen; reading it again costs little, it is
    in the page cache.
    """

    def __init__(self, pid: int, entry: Path, files: Sequence[FileRecord]) -> None:
        self.pid = pid
        base = os.path.realpath(entry)
        self._index = {os.path.join(base, record.path): i for i, record in enumerate(files)}
        self.positions: dict[int, int] = {}

    def reached(self, index: int) -> int:
        return self.positions.get(index, 0)

    def look(self) -> None:
        for pid in _tree(self.pid):
            self._look_at(pid)

    def _look_at(self, pid: int) -> None:
        fds = f"/proc/{pid}/fd"
        try:
            names = os.listdir(fds)
        except OSError:
            return  # gone, or not ours to look at
        for name in names:
            try:
                index = self._index.get(os.readlink(f"{fds}/{name}"))
                if index is None:
                    continue
                with open(f"/proc/{pid}/fdinfo/{name}", encoding="ascii") as info:
                    pos = int(info.readline().split()[1])  # "pos:\t<offset>"
            except (OSError, ValueError, IndexError):
                continue
            if pos > self.positions.get(index, 0):
                self.positions[index] = pos


def _idle_io() -> None:
    """The I/O priority class IDLE for this thread: mq-deadline (a virtio or SATA disk's default)
    and bfq then serve every other read first, the server's among them; readahead the advice
    starts is submitted in this thread's name and carries it. Schedulers without priorities
    (``none``, NVMe's usual) ignore it; the readers' bounded queue is what remains there."""
    import ctypes
    import platform

    number = _IOPRIO_SET.get(platform.machine())
    if number is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(number, _IOPRIO_WHO_PROCESS, threading.get_native_id(), _IOPRIO_CLASS_IDLE << 13)


_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}  # the ioprio_set(2) syscall's number
_IOPRIO_WHO_PROCESS = 1  # with a thread id: that thread
_IOPRIO_CLASS_IDLE = 3


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (vLLM starts its engine and workers as child processes)."""
    found: list[int] = []
    queue = [pid]
    while queue and len(found) < 1024:
        current = queue.pop()
        found.append(current)
        try:
            with open(f"/proc/{current}/task/{current}/children", encoding="ascii") as kids:
                queue.extend(int(kid) for kid in kids.read().split())
        except (OSError, ValueError):
            continue
    return found


def checked_before_launch(found: Lookup) -> None:
    """A trusting pod's hit: its content check read every byte of the entry before the launch
    (cachemgr.volume.contentcheck, on the same reader), so that read was the read-ahead: one
    pass, not two. The one ``prefetch_done`` event says so."""
    assert found.manifest is not None  # a hit always has one
    order = loader_order(found.manifest.files, prefix=ARTIFACTS + "/")
    log.info(
        EVENT,
        entry=found.path.name,
        files=len(order),
        entry_bytes=sum(found.manifest.files[i].size for i in order),
        bytes=0,
        stopped="content_checked",
        note="the trust check read every byte before the launch: no second pass",
    )


class Prefetch:
    """The read-ahead thread of one hit; :meth:`close` stops it and waits a bounded time."""

    def __init__(
        self, found: Lookup, *, within: Path, server_pid: int, stops: Sequence[Flag], metrics: Metrics
    ) -> None:
        """``found``: the hit being launched; ``stops``: SIGTERM's flag, the server's exit."""
        assert found.manifest is not None  # a hit always has one
        entry, manifest = found.path, found.manifest
        self.entry = entry
        self.manifest = manifest
        self.within = within
        self.metrics = metrics
        self.server = ServerReads(server_pid, entry, manifest.files)
        self.done = threading.Event()
        self._closing = threading.Event()
        self._stop = _Any(*stops, self._closing)
        self.result: ReadResult | None = None
        # The event's figures so far (files, sizes; the read under way), for a close that cannot wait.
        self._base: dict[str, Any] = {}
        self._reading: ReadResult | None = None
        self._log_lock = threading.Lock()
        self._logged = False
        self._thread = threading.Thread(target=self._run, name="cachemgr-prefetch", daemon=True)

    def start(self) -> Prefetch:
        self._thread.start()
        return self

    def close(self, timeout: float = JOIN_SECONDS) -> None:
        """Stop the readers; if one is still blocked in a read of the volume, say so and go on."""
        self._closing.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            reading = self._reading
            self._log(
                {
                    "entry": self.entry.name,
                    **self._base,
                    "bytes": reading.bytes if reading is not None else 0,
                    "stopped": "stop",
                    "note": "a reader is still blocked on the volume",
                }
            )

    def _run(self) -> None:
        # Below the server for the CPU and the disk: its own start (its imports, from a local
        # disk the read-ahead may share) comes first. Threads made from this one inherit both.
        with contextlib.suppress(OSError, AttributeError):  # advice to the scheduler only
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
            _idle_io()
        started = time.monotonic()
        fields: dict[str, Any] = {"entry": self.entry.name}
        try:
            fields.update(self._prefetch())
        except Exception as error:  # noqa: BLE001  # the server runs on: a failed read-ahead only logs
            fields.update(stopped="error", error=f"{type(error).__name__}: {error}"[:300])
        finally:
            fields.setdefault("seconds", round(time.monotonic() - started, 3))
            self._log(fields)
            self.done.set()

    def _log(self, fields: dict[str, Any]) -> None:
        """The one ``prefetch_done`` event of this read-ahead."""
        with self._log_lock:
            if self._logged:
                return
            self._logged = True
        log.info(EVENT, **fields)

    def _prefetch(self) -> dict[str, Any]:
        order = loader_order(self.manifest.files, prefix=ARTIFACTS + "/")
        total = sum(self.manifest.files[i].size for i in order)
        fstype = filesystem_type(self.within)
        mechanism = mechanism_for(fstype)
        base: dict[str, Any] = {"files": len(order), "entry_bytes": total, "filesystem": fstype}
        if mechanism is None:
            return {**base, "bytes": 0, "stopped": "in_memory", "note": f"{fstype} holds its files in memory"}
        budget = membudget.budget()
        base.update(mechanism=mechanism, budget=budget.to_json())
        if budget.bytes <= 0:
            return {**base, "bytes": 0, "stopped": "memory", "note": f"no room under {budget.binding}"}
        watcher = threading.Thread(target=self._watch, name="cachemgr-prefetch-watch", daemon=True)
        watcher.start()
        self._base = base
        self._reading = ReadResult(mechanism=mechanism, workers=max(1, WORKERS[mechanism]))
        result = read_entry(
            self.entry,
            self.manifest.files,
            order,
            within=self.within,
            mechanism=mechanism,
            workers=WORKERS[mechanism],
            budget=budget,
            stop=self._stop,
            skip=self.server.reached,
            into=self._reading,
        )
        self.result = result
        self.metrics.prefetched(result, files=len(order))
        figures = _figures(result, order=order, files=self.manifest.files)
        if mechanism == "advise":
            figures["note"] = "advice: the kernel had every read queued after this long"
        return {**base, **figures}

    def _watch(self) -> None:
        while not self._stop.is_set() and not self.done.is_set():
            self.server.look()
            self._closing.wait(WATCH_INTERVAL)


def _figures(result: ReadResult, *, order: Sequence[int], files: Sequence[FileRecord]) -> dict[str, Any]:
    """The ``prefetch_done`` fields: bytes, seconds, throughput, and what was left and why."""
    left = [files[i].size for i in order if i not in result.files_done]
    return {
        "bytes": result.bytes,
        "seconds": round(result.seconds, 3),
        "mib_per_s": round(result.throughput / (1 << 20), 1),
        "workers": result.workers,
        "files_done": len(result.files_done),
        "skipped": dict(sorted(result.skipped.items())),
        "bytes_left": sum(left),
        "stopped": result.stopped or "done",
    }
