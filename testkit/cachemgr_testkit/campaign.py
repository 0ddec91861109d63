"""What the fault campaign (tests/test_campaign.py) needs beside its trials: where a pod is in its
life, a watch on every pod's life and view, and the remote tier behind a trickling proxy.

* :func:`where` names the step a pod is in from its ``state.json``, finer than the phase: a pod
  ``resolving`` its key, in its ``lookup`` (key known, nothing else yet), ``downloading`` from the
  remote (the state's ``downloading`` detail), ``waiting``, ``compiling``, ``publishing``,
  ``launching``, ``serving``.
* :class:`PodWatch` is a thread that notes when each pod first serves and when it exits (the
  bounds on a pod's life are checked against these), and holds every serving pod's view to its
  links: a link that stops resolving while the campaign leaves the pod alone is an entry removed
  while in use.
* :class:`RemoteTier` is one trial's remote: a prefix of its own on a real S3 server, reached
  through a :mod:`cachemgr_testkit.trickle` proxy the campaign turns slow or silent.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachemgr_testkit.podlib import Pod, read_jsonl
from cachemgr_testkit.s3server import S3Server
from cachemgr_testkit.trickle import PASS, Mode, TrickleProxy, trickle_proxy

WATCH_EVERY = 0.05  # how often the watch looks at each pod's state and process
VIEW_EVERY = 0.5  # how often it checks the links of the serving pods' views


def where(state: dict[str, Any]) -> str:
    """The step of a pod's life its state record shows (``starting`` before it wrote one)."""
    phase = state.get("phase")
    if not isinstance(phase, str):
        return "starting"
    detail = state.get("detail") if isinstance(state.get("detail"), dict) else {}
    if phase in {"resolving", "waiting"} and detail.get("downloading"):
        return "downloading"
    if phase == "resolving":
        return "lookup" if state.get("key") else "resolving"
    return phase


def boot_clock() -> float:
    """CLOCK_BOOTTIME: the clock of /proc's process start times (the stand-in's ``spawned_boot``)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def view_links(state_dir: Path) -> list[str]:
    """Every link of the pod's views: each must resolve while the pod serves."""
    views = state_dir / "views"
    return [
        os.path.join(d, n)
        for d, dirs, files in os.walk(views)
        for n in dirs + files
        if os.path.islink(os.path.join(d, n))
    ]


@dataclass
class Life:
    """What the watch saw of one pod (monotonic seconds)."""

    spawned: float
    served: float | None = None
    exited: float | None = None
    links: list[str] = field(default_factory=list)  # its view, taken when it first served
    entry_inode: int | None = None  # the entry it serves from, as it was then
    broken: bool = False  # a broken view was reported once

    @property
    def settled(self) -> float | None:
        """When it first served or exited, whichever came first."""
        times = [t for t in (self.served, self.exited) if t is not None]
        return min(times) if times else None


class PodWatch:
    """Watches pods in a thread: serving and exit times, and serving views kept whole.

    ``may_check(pod)`` says whether the campaign leaves that pod alone now (no signal of its own,
    its entry not damaged on purpose); ``report(text)`` is called once per broken view.
    """

    def __init__(
        self,
        *,
        may_check: Callable[[Any], bool],
        report: Callable[[str], None],
        root_of: Callable[[Any], Path],
    ) -> None:
        self._lives: dict[int, tuple[Any, Pod, Life]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._may_check = may_check
        self._report = report
        self._root_of = root_of
        self.views_checked = 0
        self._thread = threading.Thread(target=self._run, name="campaign-watch", daemon=True)

    def start(self) -> PodWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def add(self, owner: Any, pod: Pod) -> Life:
        life = Life(spawned=time.monotonic())
        with self._lock:
            self._lives[id(owner)] = (owner, pod, life)
        return life

    def _entries(self) -> list[tuple[Any, Pod, Life]]:
        with self._lock:
            return list(self._lives.values())

    def _run(self) -> None:
        next_view = 0.0
        while not self._stop.wait(WATCH_EVERY):
            for owner, pod, life in self._entries():
                self._look(owner, pod, life)
            if time.monotonic() >= next_view:
                next_view = time.monotonic() + VIEW_EVERY
                for owner, pod, life in self._entries():
                    self._check_view(owner, pod, life)

    def _look(self, owner: Any, pod: Pod, life: Life) -> None:
        now = time.monotonic()
        if life.exited is None and pod.proc.poll() is not None:
            life.exited = now
        if life.served is None and life.exited is None and pod.phase == "serving":
            life.served = now
            life.links = view_links(pod.state_dir)
            entry = pod.state().get("entry")
            if isinstance(entry, str) and entry:
                with contextlib.suppress(OSError):
                    life.entry_inode = (self._root_of(owner) / "entries" / entry).stat().st_ino

    def _check_view(self, owner: Any, pod: Pod, life: Life) -> None:
        if life.served is None or life.broken or life.exited is not None or not self._may_check(owner):
            return
        broken = [link for link in life.links if not os.path.exists(link)]
        # Only if nothing changed meanwhile: the pod still alive and left alone after the look.
        if pod.proc.poll() is not None or not self._may_check(owner):
            return
        self.views_checked += 1
        if broken:
            life.broken = True
            self._report(
                f"{pod.name} serves on, but {len(broken)} of the {len(life.links)} links of its view no "
                f"longer resolve (the entry it serves from was removed while in use): {broken[0]}"
            )


def server_starts(path: Path) -> list[dict[str, Any]]:
    """The stand-in servers' ``start`` events (STANDIN_START_RECORD)."""
    return [event for event in read_jsonl(path) if event.get("event") == "start"]


def started_after(
    starts: Iterable[dict[str, Any]], loads: Iterable[dict[str, Any]], *, parent: int, signalled_boot: float
) -> list[tuple[dict[str, Any], bool]]:
    """The servers ``parent`` spawned after ``signalled_boot`` (CLOCK_BOOTTIME), each with whether it
    went on to load its model. The spawn time is /proc's, to the clock tick (truncated), so a
    server listed here was surely forked after the signal was sent."""
    loaded = {event.get("pid") for event in loads}
    found = []
    for event in starts:
        spawned = event.get("spawned_boot")
        if event.get("ppid") == parent and isinstance(spawned, float | int) and spawned > signalled_boot:
            found.append((event, event.get("pid") in loaded))
    return found


@dataclass
class RemoteTier:
    """One trial's remote: its own prefix on a real S3 server, reached through a trickling proxy."""

    s3: S3Server
    proxy: TrickleProxy
    prefix: str
    budget: float
    timeout: float
    upload_wait: float
    modes: list[str] = field(default_factory=list)

    def env(self, *, direct: bool = False) -> dict[str, str]:
        """What a pod needs (through the proxy; ``direct``: straight to the store, for seeding)."""
        return {
            **self.s3.env(prefix=self.prefix),
            "CACHEMGR_REMOTE_ENDPOINT": self.s3.endpoint if direct else self.proxy.endpoint,
            "CACHEMGR_REMOTE_BUDGET": f"{self.budget}s",
            "CACHEMGR_REMOTE_TIMEOUT": f"{self.timeout}s",
            "CACHEMGR_REMOTE_UPLOAD_WAIT": f"{self.upload_wait}s",
        }

    def set_mode(self, mode: Mode) -> None:
        self.proxy.set_mode(mode)
        self.modes.append(repr(mode))

    def restore(self) -> None:
        if self.proxy.mode is not PASS:
            self.set_mode(PASS)


@contextlib.contextmanager
def remote_tier(
    s3: S3Server, prefix: str, *, budget: float, timeout: float, upload_wait: float
) -> Iterator[RemoteTier]:
    with trickle_proxy(s3.endpoint) as proxy:
        yield RemoteTier(s3, proxy, prefix, budget=budget, timeout=timeout, upload_wait=upload_wait)
