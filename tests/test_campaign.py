"""The fault campaign: real pods, random faults at random moments, and the invariants after each trial.

Each trial makes a fresh cache volume (a local directory, two mounts of a fresh JuiceFS volume as
two nodes, or a small tmpfs that fills up), then runs two or three rounds of real ``cachemgr run``
pods (the stand-in compiler through ``--strategy command``, the stand-in server loading
``{artifact_dir}``) for one to three keys. Every other trial has a remote tier: a prefix of its
own on a real S3 server (``weed mini``) that pods reach through a trickling proxy
(cachemgr_testkit.trickle), with a short ``CACHEMGR_REMOTE_BUDGET`` (3 to 5 s), a 1 s timeout and a
2 s upload wait; a warm Job of "another cluster" has pushed some of the trial's keys there
first, so pods download them. While a round runs, faults fire at random moments:

* ``sigkill`` / ``sigstop`` (then ``SIGCONT`` up to 2.5 leases later) / ``sigterm`` of a whole pod,
  aimed at a lease holder (compiling or publishing), a waiter, or any other pod;
* ``prune-unused`` (``cachemgr prune --unused-for 0s --yes``) and ``prune-stale``
  (``--stale-staging``), run from a random node, and ``sigkill-prune`` (a prune killed mid-way);
* ``ballast`` (tmpfs trials): a file that takes all but a few KiB of the free space, removed later;
* ``symlink``: someone with write access to the volume plants a symlink to the *canary* (a
  directory outside the root) where cachemgr lists, moves or deletes: ``staging/<digest>`` of a key
  in use, a child of ``staging/<digest>``, ``quarantine/``, ``trash/``, ``usage/`` or ``leases/``;
* ``intruder``: a second ``cachemgr run`` or a ``cachemgr warm`` typed into a serving pod
  (``kubectl exec``: it inherits the pod's ``CACHEMGR_STATE_DIR``);
* ``sigterm-phase``: SIGTERM to a pod in a step of its life picked at random (``resolving`` its
  key, its ``lookup`` with ``--verify full``, ``waiting``, ``compiling``, ``publishing``,
  ``downloading``, ``launching``), seen in its state record (cachemgr_testkit.campaign.where); for
  the steps milliseconds long a fresh pod is started and watched every 5 ms. Counted by the step
  the pod was really in when the signal went;
* ``server-dies``: a pod whose stand-in server dies after loading the entry, before it is ready
  (``STANDIN_EXIT_ON_LOAD``: exit 1 or 3, SIGKILL, SIGABRT), mostly on a hit;
* ``remote-trickle`` / ``remote-stall`` (remote trials): the proxy sends a few bytes every 0.2 or
  0.5 s, or nothing, after 0 to 1 MiB of each connection, downstream or both ways; for a while, or
  to the end of the round's settle (the store stays degraded while the pods must get past it);
* ``fill-at-hit`` (tmpfs trials): the volume filled to its last block just as a fresh pod hits a
  published entry (before its use record), then the operator's answer to a full volume, ``prune
  --unused-for 0s --yes``, once the pod serves. The entry is one no other live pod uses, or a
  rollout first stops that key's pods: the new pod's use is all that keeps it.

Pods differ as a real fleet does: in a trial with mixed leases each pod takes one of two
``--lease-duration`` values (a Deployment and a warm Job, two rollouts), and with clock skew some
pods and prunes run with their wall clock minutes off (libfaketime, up to +-10 minutes).

Besides, every round has one of the kinds above new in issue 26 in turn (sigterm-phase,
server-dies, and where the trial has them the remote and fill-at-hit kinds), so the short form
runs them all.

Between rounds a published entry is damaged (``damage-truncate``, ``damage-flip``, or
``damage-symlink``: a file in it replaced by a symlink to the canary); the pods of the next round
that use that key run with ``--verify full`` when the damage keeps the size.

After every trial, once its faults stopped, these invariants must hold:

1. no entry is half-written: every directory in ``entries/`` has a valid manifest for its name;
2. every published entry verifies (``manifest.check_files`` with ``mode="full"``);
3. no lease blocks past its duration: a fresh pod per key acquires, hits or fails for space
   within the lease plus ``LEASE_SLACK``;
4. no server ever started on a wrong or damaged entry: every stand-in ``load`` event carries the
   digest of a clean compile of its pod's key (compiled once, outside cachemgr, in a clean dir),
   and no server died on its own integrity check;
5. every pod ended as the faults explain: serving, killed or stopped by the campaign, exit 73
   on a volume that filled up, exit 74 naming a layout directory the campaign replaced by a
   link (the documented refusal; an operator removes the link), or, its server dead before
   ready (server-dies), the server's code (128+N for signal N), with a termination message
   naming that code or signal (unless the campaign's SIGTERM reached that server while it ran,
   as the pod's state says: a stop, whatever the code). Anything else (a crash, a stuck pod) is
   reported with its log;
6. nothing outside the root was touched: the canary tree is byte for byte what it was;
7. an intruder never disturbed its pod: the pod still serves, its probes pass, its view is whole;
8. no pod outlives its budget plus the grace period: from its spawn, or from the end of the
   round's faults if that is later, to its first serving or its exit, a pod takes at most the
   longest lease + the confirm window + the remote budget (remote trials) + twice the slowest
   compile (3 s) + ``LIFE_SLACK`` (+ the 8 s watch of a silent attempt in a skewed trial); and a
   pod sent SIGTERM has exited within ``STOP_GRACE`` (+ the 2 s upload wait with a remote);
9. no server starts after SIGTERM: no stand-in server that a SIGTERMed pod forked after the signal
   (its ``start`` record's /proc spawn time, CLOCK_BOOTTIME, against the signal's) goes on to load;
10. no entry in use is removed: every link of a serving pod's view resolves, checked every 0.5 s
    until the campaign signals the pod (or damages its entry on purpose).

Short form (CI): ``CACHEMGR_CAMPAIGN_TRIALS`` (default 6: two of each volume kind, one of each
with a remote). Long form::

    CACHEMGR_CAMPAIGN_TRIALS=200 .venv/bin/pytest tests/test_campaign.py -m campaign

``CACHEMGR_CAMPAIGN_SEED`` fixes the plan (it is printed); a failing trial names the command that
replays it alone. ``CACHEMGR_CAMPAIGN_REPORT=FILE`` also writes the totals as JSON, and
``CACHEMGR_CAMPAIGN_VERBOSE=1`` prints every trial's timeline.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.campaign import (
    Life,
    PodWatch,
    RemoteTier,
    boot_clock,
    remote_tier,
    server_starts,
    started_after,
    where,
)
from cachemgr_testkit.podlib import (
    FAKETIME_LIB,
    STANDIN_COMPILER,
    Cluster,
    Pod,
    free_port,
    read_jsonl,
    skewed_env,
    wait_for,
)
from cachemgr_testkit.s3server import S3Server, require_s3, s3_server
from cachemgr_testkit.scenarios import MODEL, server_argv
from cachemgr_testkit.trickle import Stall, Trickle

from cachemgr.volume.manifest import ManifestError, check_files, read_manifest
from cachemgr.volume.records import OBSERVE_SECONDS
from cachemgr.volume.softlease import default_confirm

TRIALS = int(os.environ.get("CACHEMGR_CAMPAIGN_TRIALS") or 6)
SEED = int(os.environ.get("CACHEMGR_CAMPAIGN_SEED") or secrets.randbelow(1_000_000))
VERBOSE = os.environ.get("CACHEMGR_CAMPAIGN_VERBOSE") == "1"  # print every trial's timeline
KINDS = ("local", "juicefs", "tmpfs")
FILES = 6
ENTRY_BYTES = 384 << 10
LEASE_SLACK = 5.0  # process start, imports and the 0.2 s lease poll, on a busy 2-core machine
SETTLE_SECONDS = 60.0  # after the faults stop, every pod serves or has exited within this (+ 3 leases)
DISK_FULL = 73
VOLUME_UNUSABLE = 74
SIGTERM_EXIT = 128 + signal.SIGTERM
STOP_GRACE = 10.0  # a SIGTERMed pod is gone within this (plus its upload wait): cleanup, the server's exit
LIFE_SLACK = 10.0  # beyond the budget, lease, confirm and compile: starts, imports, the load, on 2 busy cores
SLOWEST_PACE = 3.0  # the slowest stand-in compile of a pod (STANDIN_COMPILE_SECONDS)
REMOTE_TIMEOUT = 1.0  # CACHEMGR_REMOTE_TIMEOUT of a remote trial's pods
UPLOAD_WAIT = 2.0  # CACHEMGR_REMOTE_UPLOAD_WAIT: how long a stopping pod waits for its upload
# The steps of a pod's life a sigterm-phase fault aims at (cachemgr_testkit.campaign.where).
PHASE_TARGETS = ("resolving", "lookup", "waiting", "compiling", "publishing", "downloading", "launching")
SHORT_STEPS = {"resolving", "lookup", "launching"}  # a fresh pod is started to catch it there
SERVER_DEATHS = (1, 3, -signal.SIGKILL, -signal.SIGABRT)  # STANDIN_EXIT_ON_LOAD: codes, or signals
# (kind, weight): what may fire during a round.
ROUND_FAULTS = (
    ("sigkill", 4),
    ("sigstop", 4),
    ("sigterm", 1),
    ("prune-unused", 3),
    ("prune-stale", 2),
    ("sigkill-prune", 1),
    ("symlink", 2),
    ("intruder", 2),
    ("sigterm-phase", 3),
    ("server-dies", 2),
)
REMOTE_FAULTS = (("remote-trickle", 3), ("remote-stall", 2))  # trials with a remote tier
TMPFS_FAULTS = (("fill-at-hit", 3),)  # trials on a tmpfs that really fills
SKEWS = (-600, -180, 180, 600)  # seconds a skewed pod's or prune's wall clock is off
INTRUDER_EXITS = {"run": {64}, "warm": {0}}  # a second run on a live state dir refuses (usage)
STANDIN_DAMAGE = ("truncated or damaged (stand-in check)", "missing the required")

pytestmark = [pytest.mark.campaign]


def _trial_params() -> list[Any]:
    params = []
    for i in range(TRIALS):
        kind = KINDS[i % len(KINDS)]
        remote = i % 2 == 1  # every other trial: each volume kind with and without a remote
        marks = [pytest.mark.timeout(300)]
        if kind != "local":
            marks.append(getattr(pytest.mark, kind))
        name = f"trial{i:03d}-{kind}{'-remote' if remote else ''}"
        params.append(pytest.param(i, kind, remote, marks=marks, id=name))
    return params


# --- the campaign's totals ------------------------------------------------------------------------


@dataclass
class Totals:
    trials: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    pods: int = 0
    loads_checked: int = 0
    compiles: int = 0
    quarantined: int = 0
    bounds_checked: int = 0
    starts_checked: int = 0
    views_checked: int = 0
    violations: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def lines(self) -> list[str]:
        faults = ", ".join(f"{k}={v}" for k, v in sorted(self.faults.items())) or "none"
        outcomes = ", ".join(f"{k}={v}" for k, v in sorted(self.outcomes.items())) or "none"
        return [
            f"fault campaign: seed {SEED}, {self.trials} trials in {time.monotonic() - self.started:.0f}s, "
            f"{sum(self.faults.values())} faults injected, {len(self.violations)} invariant violations",
            f"  faults by kind: {faults}",
            f"  pods: {self.pods} started; outcomes: {outcomes}",
            f"  server loads checked against clean compiles: {self.loads_checked}; compiles run: "
            f"{self.compiles}; damaged entries quarantined: {self.quarantined}",
            f"  pod lives held to their bounds: {self.bounds_checked}; SIGTERMed pods' server starts "
            f"checked: {self.starts_checked}; serving views checked whole: {self.views_checked}",
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": SEED,
            "trials": self.trials,
            "seconds": round(time.monotonic() - self.started, 1),
            "faults": dict(self.faults),
            "faults_total": sum(self.faults.values()),
            "outcomes": dict(self.outcomes),
            "pods": self.pods,
            "loads_checked": self.loads_checked,
            "compiles": self.compiles,
            "quarantined": self.quarantined,
            "bounds_checked": self.bounds_checked,
            "starts_checked": self.starts_checked,
            "views_checked": self.views_checked,
            "violations": self.violations,
        }


def _say(config: pytest.Config, *lines: str) -> None:
    """Straight to the terminal, past output capture: the campaign's figures belong in the CI log."""
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker's terminal is not the run's: conftest prints these
        workeroutput.setdefault("terminal_lines", []).extend(lines)
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:
        return
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        for line in lines:
            reporter.write_line(line)


@pytest.fixture(scope="module")
def totals(request: pytest.FixtureRequest) -> Iterator[Totals]:
    found = Totals()
    _say(request.config, "", f"fault campaign: seed {SEED} (CACHEMGR_CAMPAIGN_SEED), {TRIALS} trials")
    yield found
    _say(request.config, "", *found.lines())
    report = os.environ.get("CACHEMGR_CAMPAIGN_REPORT")
    if report:
        Path(report).write_text(json.dumps(found.to_json(), indent=2) + "\n")


@pytest.fixture(scope="module")
def campaign_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One real S3 server (weed mini) for the remote trials; each trial has a prefix of its own."""
    require_s3()
    with s3_server(tmp_path_factory.mktemp("campaign-s3")) as server:
        yield server


# --- clean compiles: what every server must load ---------------------------------------------------


def _compile_cmd(record: Path, variant: int) -> str:
    """One key per variant; each pod's pace comes from its STANDIN_COMPILE_SECONDS (not in the key)."""
    return (
        f"{STANDIN_COMPILER} --output-dir {{output_dir}} --model {MODEL} --files {FILES} "
        f"--bytes {ENTRY_BYTES} --record {record} --variant v{variant}"
    )


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The digest of a clean compile of each variant, in a clean directory, without cachemgr."""
    work = tmp_path_factory.mktemp("reference")
    digests = {}
    for variant in range(3):
        record = work / f"v{variant}.jsonl"
        argv = _compile_cmd(record, variant).replace("{output_dir}", str(work / f"v{variant}")).split()
        subprocess.run([*argv, "--seconds", "0"], check=True, capture_output=True, timeout=60)
        (event,) = [e for e in read_jsonl(record) if e["event"] == "compiled"]
        digests[variant] = str(event["digest"])
    assert len(set(digests.values())) == 3, "each variant is another key with other bytes"
    return digests


# --- one trial ------------------------------------------------------------------------------------


@dataclass
class PodInfo:
    pod: Pod
    variant: int
    round: int
    signals: list[str] = field(default_factory=list)  # what the campaign did to it
    check: bool = False  # a fresh pod of the lease check
    options: list[str] = field(default_factory=list)
    root: Path = Path()  # the cache root as its node mounts it
    life: Life = field(default_factory=lambda: Life(spawned=time.monotonic()))
    server_exit: int | None = None  # server-dies: its server dies with this after the load
    term_at: float | None = None  # when the campaign first sent it SIGTERM (monotonic)
    term_boot: float | None = None  # the same moment on CLOCK_BOOTTIME (the stand-in's spawn clock)
    stopped_ever: bool = False  # SIGSTOPped at some point: its use record may have gone stale

    @property
    def alive(self) -> bool:
        return self.pod.proc.poll() is None

    def terminate(self, why: str) -> None:
        """SIGTERM to cachemgr, as the kubelet sends it; the first one starts the grace period."""
        self.signals.append(why)
        if self.term_at is None:
            self.term_at, self.term_boot = time.monotonic(), boot_clock()
        self.pod.signal(signal.SIGTERM)


@dataclass(order=True)
class Event:
    at: float
    order: int
    action: Callable[[], None] = field(compare=False)


class Trial:
    """One trial: a volume, its pods, the faults, and what the invariants found."""

    def __init__(  # noqa: PLR0917  # the trial's parts, each made by the test
        self,
        index: int,
        kind: str,
        work: Path,
        roots: list[Path],
        references: dict[int, str],
        remote: RemoteTier | None = None,
    ) -> None:
        self.index = index
        self.kind = kind
        self.rng = random.Random(f"{SEED}:{index}")
        self.work = work
        self.roots = roots
        self.references = references
        self.lease = round(self.rng.uniform(2.0, 3.5), 1)
        self.other_lease = round(self.rng.uniform(1.0, 6.0), 1)
        self.longest_lease = max(self.lease, self.other_lease)
        self.skewed = FAKETIME_LIB is not None and self.rng.random() < 0.5
        self.canary = _make_canary(work / "canary")
        self.canary_digest = _tree_digest(self.canary)
        self.intruders: list[tuple[PodInfo, str, subprocess.Popen[bytes], set[str]]] = []
        self.planted_dirs: list[str] = []  # layout directories replaced by a link (relative to the root)
        self.variants = list(range(self.rng.randint(1, 3)))
        self.compile_record = work / "compiler.jsonl"
        self.pods: list[PodInfo] = []
        self.faults: Counter[str] = Counter()
        self.violations: list[str] = []
        self.log: list[str] = []
        self.stopped: set[int] = set()
        self.prunes: list[subprocess.Popen[bytes]] = []
        self.prune_results: list[tuple[list[str], int, str]] = []
        self.ballasts: list[Path] = []
        # variant -> (damage kind, entry, inode): until that entry is gone (quarantined, pruned)
        self.damaged: dict[int, tuple[str, Path, int]] = {}
        self.damaged_inodes: set[int] = set()  # entries damaged on purpose: set aside while in use
        self.remote = remote
        self.round = 0
        self.faults_end = time.monotonic()  # when the current round's faults stopped
        self.bounds_checked = 0
        self.starts_checked = 0
        self.started = time.monotonic()
        self._counter = 0
        self.cluster = Cluster.create(
            work / "pods", STANDIN_COMPILE_SECONDS="1", STANDIN_START_RECORD=str(work / "starts.jsonl")
        )
        self.starts_record = work / "starts.jsonl"
        self._lock = threading.Lock()  # the watch thread reports violations too
        self.watch = PodWatch(may_check=self.left_alone, report=self.violate, root_of=lambda i: i.root)
        self.watch.start()

    # --- bookkeeping

    def note(self, text: str) -> None:
        with self._lock:
            self.log.append(f"{time.monotonic() - self.started:7.2f}s {text}")

    def violate(self, text: str) -> None:
        with self._lock:
            self.violations.append(text)
        self.note(f"VIOLATION {text}")

    def left_alone(self, info: PodInfo) -> bool:
        """The campaign never signalled this pod nor damaged its entry: what it serves must stay."""
        return not info.signals and not info.stopped_ever and info.life.entry_inode not in self.damaged_inodes

    def node(self) -> int:
        return self.rng.randrange(len(self.roots))

    # --- pods

    def start_pod(
        self, variant: int, round_: int, *, verify: str, check: bool = False, server_exit: int | None = None
    ) -> PodInfo:
        self._counter += 1
        name = f"{'check' if check else 'r' + str(round_)}-{self._counter}-v{variant}"
        node = self.node()
        lease = self.rng.choice([self.lease, self.other_lease])
        options = [
            "--strategy", "command",
            "--compile-cmd", _compile_cmd(self.compile_record, variant),
            "--lease-duration", str(lease),
            "--verify", verify,
        ]  # fmt: skip
        pace = f"{self.rng.uniform(0.3, SLOWEST_PACE):.2f}"
        skew, skewed = self.skew()
        env = {"STANDIN_COMPILE_SECONDS": pace, **skew, **(self.remote.env() if self.remote else {})}
        if server_exit is not None:
            env["STANDIN_EXIT_ON_LOAD"] = str(server_exit)
        pod = self.cluster.start(
            name,
            server_argv(free_port()),
            cache_root=self.roots[node],
            options=options,
            node=f"node-{node}",
            env=env,
        )
        info = PodInfo(pod, variant, round_, check=check, options=options, root=self.roots[node])
        info.server_exit = server_exit
        info.life = self.watch.add(info, pod)
        self.pods.append(info)
        dies = f", its server dies with {server_exit} after the load" if server_exit is not None else ""
        self.note(
            f"start {name} on node-{node} (compile {pace}s, verify {verify}, lease {lease}s{skewed}{dies})"
        )
        return info

    def skew(self) -> tuple[dict[str, str], str]:
        """In a skewed trial, half the processes run with their wall clock minutes off."""
        if not self.skewed or FAKETIME_LIB is None or self.rng.random() < 0.5:
            return {}, ""
        offset = self.rng.choice(SKEWS)
        self.faults["clock-skew"] += 1
        return skewed_env(offset), f", clock {offset:+d}s"

    def role(self, info: PodInfo) -> str:
        phase = info.pod.phase
        if phase in {"compiling", "publishing"}:
            return "holder"
        if phase == "waiting":
            return "waiter"
        return "other"

    def live_pods(self) -> list[PodInfo]:
        return [p for p in self.pods if p.alive and not p.check and id(p) not in self.stopped]

    def fault_signal(
        self, kind: str, wanted: str, deadline: float, schedule: Callable[[float, Callable[[], None]], None]
    ) -> None:
        """Signal a pod in the ``wanted`` role; none yet: look again shortly, then take any live pod."""
        live = self.live_pods()
        if kind == "sigstop":  # a pod in its grace period is not frozen: the stop bound is its own
            live = [p for p in live if p.term_at is None]
        aimed = [p for p in live if self.role(p) == wanted]
        if not aimed and time.monotonic() < deadline:
            schedule(0.1, lambda: self.fault_signal(kind, wanted, deadline, schedule))
            return
        if not live:
            self.note(f"{kind}: no live pod")
            return
        info = self.rng.choice(aimed or live)
        role = self.role(info)
        self.faults[f"{kind}:{role}"] += 1
        self.note(f"{kind} {info.pod.name} ({role}, phase {info.pod.phase})")
        if kind == "sigkill":
            info.signals.append("SIGKILL")
            info.pod.signal_pod(signal.SIGCONT)
            info.pod.signal_pod(signal.SIGKILL)
        elif kind == "sigterm":
            info.terminate("SIGTERM")
        else:
            info.signals.append("SIGSTOP")
            info.stopped_ever = True
            self.stopped.add(id(info))
            info.pod.signal_pod(signal.SIGSTOP)
            pause = self.rng.uniform(0.5, 2.5 * self.lease)
            schedule(pause, lambda: self.resume(info))

    def resume(self, info: PodInfo) -> None:
        if id(info) in self.stopped:
            self.stopped.discard(id(info))
            info.pod.signal_pod(signal.SIGCONT)
            self.note(f"SIGCONT {info.pod.name}")

    def fault_prune(self, kind: str) -> None:
        self.faults[kind] += 1
        node = self.node()
        what = ["--unused-for", "0s"] if kind == "prune-unused" else ["--stale-staging"]
        argv = [sys.executable, "-m", "cachemgr", "prune", *what, "--yes", "-o", "json"]
        # On the node it pretends to run on: dead attempts of that node are seen as dead at once.
        argv = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', f"node-{node}", *argv]
        skew, skewed = self.skew()
        env = {**self.cluster.base_env, "CACHEMGR_CACHE_ROOT": str(self.roots[node]), **skew}
        self.note(f"{kind} on node-{node}{skewed}")
        self.prunes.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))

    def fault_kill_prune(self) -> None:
        running = [p for p in self.prunes if p.poll() is None]
        if not running:
            self.fault_prune("prune-unused")
            return
        self.faults["sigkill-prune"] += 1
        victim = self.rng.choice(running)
        self.note(f"sigkill-prune pid {victim.pid}")
        with contextlib.suppress(ProcessLookupError):
            victim.kill()

    def fault_symlink(self) -> None:
        """Someone with write access plants a symlink to the canary where cachemgr lists or deletes."""
        root = self.roots[self.node()]
        keys = [k for k in (p.pod.state().get("key") for p in self.pods) if isinstance(k, str) and k]
        digest = self.rng.choice(keys) if keys else secrets.token_hex(16)
        old = time.time() - 3600  # an owner record an hour old: a stale attempt to clean up
        place = self.rng.choice(["staging", "attempt", "quarantine", "trash", "usage", "lease"])
        target: Path = self.canary
        if place == "staging" and not (root / "staging" / digest).is_dir():
            link = root / "staging" / digest
            # A layout directory that is a link: commands that need it refuse with exit 74 naming it.
            self.planted_dirs.append(f"staging/{digest}")  # as every node's mount names it
        elif place in {"staging", "attempt"}:
            link = root / "staging" / digest / f"intruder.1.{secrets.token_hex(2)}"
            owner = link.with_name(link.name + ".json")
            try:
                owner.parent.mkdir(parents=True, exist_ok=True)
                owner.write_text(json.dumps({"pod": "intruder", "host": "elsewhere", "pid": 1, "since": old}))
                os.utime(owner, (old, old))
            except OSError as error:  # a full tmpfs refuses the attacker too: no fault this time
                self.note(f"symlink {place}: {error.strerror} ({owner})")
                return
        elif place in {"quarantine", "trash"}:
            link = root / place / f"{digest[:8]}.planted"
        elif place == "usage":
            link = root / "usage" / digest / "intruder.json"
            target = self.canary / "file.bin"
        else:
            link = root / "leases" / f"{digest}.holder.json"
            target = self.canary / "file.bin"
        self.faults[f"symlink:{place}"] += 1
        try:
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.is_file():  # a record in the way is replaced, as an attacker would
                link.unlink()
            link.symlink_to(target)
        except OSError as error:  # the place is taken (a real attempt, a live lease): plant elsewhere
            self.note(f"symlink {place}: {error.strerror} ({link})")
            return
        self.note(f"symlink {link.relative_to(root)} -> canary")

    def fault_intruder(self, deadline: float, schedule: Callable[[float, Callable[[], None]], None]) -> None:
        """A second run or a warm typed into a serving pod: same environment, same state dir."""
        serving = [p for p in self.live_pods() if p.pod.phase == "serving" and not p.signals]
        if not serving:
            if time.monotonic() < deadline:
                schedule(0.2, lambda: self.fault_intruder(deadline, schedule))
            else:
                self.note("intruder: no serving pod")
            return
        victim = self.rng.choice(serving)
        command = self.rng.choice(["run", "warm"])
        self.faults[f"intruder:{command}"] += 1
        view = _view_paths(victim.pod.state_dir)
        argv = [sys.executable, "-m", "cachemgr", command, *victim.options, "--", *server_argv(free_port())]
        # Its own session: if the pod is gone by the time it starts, the intruder becomes the pod
        # (the state dir is free) and starts a server that must be stopped with it.
        proc = subprocess.Popen(
            argv, env=victim.pod.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.intruders.append((victim, command, proc, view))
        self.note(f"intruder: cachemgr {command} in {victim.pod.name} ({len(view)} view paths)")

    def check_intruders(self) -> None:
        """Invariant 7: the intruder ended as documented; its pod serves on, probes pass, view whole."""
        for victim, command, proc, view in self.intruders:
            try:
                out, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate(timeout=30)
            text = out.decode(errors="replace")[-800:]
            if victim.signals or not victim.alive:
                # Another fault ended the pod meanwhile: the intruder may have found the state dir
                # free and become the pod itself. Nothing was left to disturb.
                continue
            if command == "warm" and proc.returncode == DISK_FULL and self.kind == "tmpfs":
                # The entry was gone (pruned, quarantined), so warm compiled on a volume the trial
                # fills: exit 73, as a pod's compile there. Its pod is still checked below.
                self.note(f"intruder warm in {victim.pod.name}: disk full (exit 73)")
            elif proc.returncode not in INTRUDER_EXITS[command]:
                self.violate(f"intruder {command} in {victim.pod.name} exited {proc.returncode}: {text}")
            missing = sorted(p for p in view if not os.path.lexists(p))
            if missing:
                self.violate(f"intruder {command} removed {len(missing)} paths of {victim.pod.name}'s view")
            if victim.pod.state().get("pid") != victim.pod.proc.pid:
                self.violate(
                    f"intruder {command} replaced {victim.pod.name}'s state record: {victim.pod.state()}"
                )
            for kind in ("live", "ready"):
                probe = subprocess.run(
                    [sys.executable, "-m", "cachemgr", "probe", kind, "--timeout", "10"],
                    env={**victim.pod.env},
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=False,
                )
                if probe.returncode != 0:
                    self.violate(
                        f"after intruder {command}, {victim.pod.name} fails probe {kind}: {probe.stdout}"
                    )
        self.intruders.clear()

    def fault_ballast(self, hold: float, schedule: Callable[[float, Callable[[], None]], None]) -> None:
        root = self.roots[0]
        st = os.statvfs(root)
        free = st.f_bavail * st.f_frsize
        keep = self.rng.choice([0, 4096, 64 << 10, 256 << 10])
        size = max(0, free - keep)
        self.faults["ballast"] += 1
        self.note(f"ballast {size} bytes (leaves {keep})")
        ballast = self.fill(size)
        schedule(hold, lambda: self.remove_ballast(ballast))

    def fill(self, size: int | None = None) -> Path:
        """A ballast file of ``size`` bytes, or up to the last block the volume has."""
        self._counter += 1
        path = self.roots[0] / f"ballast.{self._counter}"
        self.ballasts.append(path)
        left = (1 << 62) if size is None else size
        with contextlib.suppress(OSError), path.open("wb") as out:
            chunk = bytes(1 << 16)
            while left > 0:
                left -= out.write(chunk[: min(len(chunk), left)])
        return path

    def remove_ballast(self, path: Path | None = None) -> None:
        for ballast in [path] if path is not None else list(self.ballasts):
            if ballast in self.ballasts:
                ballast.unlink(missing_ok=True)
                self.ballasts.remove(ballast)
                self.note(f"{ballast.name} removed")

    def damage(self) -> None:
        """Between rounds: truncate or flip bytes in a published file."""
        entries = _entry_dirs(self.roots[0])
        if not entries:
            return
        entry = self.rng.choice(entries)
        try:
            manifest = read_manifest(entry)
        except ManifestError:
            return
        record = self.rng.choice([f for f in manifest.files if f.path.startswith("artifacts/")])
        kind = self.rng.choice(["damage-truncate", "damage-flip", "damage-symlink"])
        path = entry / record.path
        if kind == "damage-symlink":  # root may unlink in the read-only directory, as in a pod
            path.unlink()
            path.symlink_to(self.canary / "file.bin")
            self._damaged(kind, entry, manifest.key, f"{record.path} -> canary")
            return
        os.chmod(path, 0o644)
        with path.open("r+b") as handle:
            if kind == "damage-truncate":
                handle.truncate(self.rng.randrange(record.size))
            else:
                offset = self.rng.randrange(record.size)
                handle.seek(offset)
                byte = handle.read(1)
                handle.seek(offset)
                handle.write(bytes([byte[0] ^ (1 << self.rng.randrange(8))]))
        os.chmod(path, 0o444)
        self._damaged(kind, entry, manifest.key, record.path)

    def _damaged(self, kind: str, entry: Path, key: str, what: str) -> None:
        variant = self._variant_of(key)
        self.faults[kind] += 1
        self.note(f"{kind} {entry.name}/{what} (variant {variant})")
        self.damaged_inodes.add(entry.stat().st_ino)
        if variant is not None:
            self.damaged[variant] = (kind, entry, entry.stat().st_ino)

    def still_damaged(self) -> dict[int, str]:
        """Damaged entries still in place: their keys are looked up next, with --verify full for a flip."""
        for variant, (_kind, entry, inode) in list(self.damaged.items()):
            try:
                same = entry.stat().st_ino == inode
            except FileNotFoundError:
                same = False
            if not same:
                del self.damaged[variant]
        return {variant: kind for variant, (kind, _, _) in self.damaged.items()}

    def _variant_of(self, digest: str) -> int | None:
        for info in self.pods:
            if info.pod.state().get("key") == digest:
                return info.variant
        return None

    # --- the remote tier

    def seed_remote(self) -> None:
        """Some keys already in the remote (a warm Job of another cluster pushed them), so pods of
        this trial download them, through the proxy the faults slow down."""
        assert self.remote is not None
        seeded = [v for v in self.variants if self.rng.random() < 0.6]
        scratch = self.work / "seed-volume"
        scratch.mkdir(parents=True)
        warms = []
        for variant in seeded:
            options = ["--strategy", "command", "--compile-cmd", _compile_cmd(self.compile_record, variant)]
            env = {**self.remote.env(direct=True), "STANDIN_COMPILE_SECONDS": "0"}
            warms.append(
                self.cluster.start(
                    f"seed-v{variant}", server_argv(free_port()), cache_root=scratch, command="warm",
                    options=options, env=env,
                )
            )  # fmt: skip
        for warm in warms:
            code = warm.wait_exit(timeout=120)
            assert code == 0, f"seeding the remote: {warm.name} exited {code}:\n{warm.tail(20)}"
        self.note(
            f"remote {self.remote.prefix} (budget {self.remote.budget}s) holds variants {seeded or 'none'}"
        )

    # --- rounds

    def fault_kinds(self) -> tuple[list[str], list[int], list[str]]:
        """What may fire in this trial, with weights, and the kinds new in issue 26 among them."""
        table = list(ROUND_FAULTS)
        if self.remote is not None:
            table += REMOTE_FAULTS
        if self.kind == "tmpfs":
            table += TMPFS_FAULTS
        kinds, weights = (list(column) for column in zip(*table, strict=True))
        # The remote kinds first: the store is reached on a miss, mostly in the first round.
        remote = [k for k, _ in REMOTE_FAULTS if k in kinds]
        new = [*remote, "sigterm-phase", "server-dies", *(k for k, _ in TMPFS_FAULTS if k in kinds)]
        return kinds, weights, new

    def run_round(self, round_: int) -> None:
        queue: list[Event] = []
        self.round = round_

        def schedule(delay: float, action: Callable[[], None]) -> None:
            self._counter += 1
            heapq.heappush(queue, Event(time.monotonic() + delay, self._counter, action))

        damaged = self.still_damaged()
        count = self.rng.randint(2, 4)
        # The first key more often than the others: several pods of one key make waiters.
        keys = [self.rng.choice([self.variants[0], *self.variants]) for _ in range(count)]
        keys[: len(damaged)] = list(damaged)  # the damaged keys are looked up this round
        for variant in keys:
            verify = (
                "full" if damaged.get(variant) == "damage-flip" else self.rng.choice(["fast", "fast", "full"])
            )
            schedule(
                self.rng.uniform(0.0, 1.0), lambda v=variant, m=verify: self.start_pod(v, round_, verify=m)
            )
        window = 1.5 + 2.0 + self.lease
        kinds, weights, new = self.fault_kinds()
        planned = [self.rng.choices(kinds, weights)[0] for _ in range(self.rng.randint(1, 3))]
        # One of the kinds new in issue 26 every round, in turn: the short form (CI) runs them all.
        planned.append(new[(self.index // 2 + round_) % len(new)])
        for kind in planned:
            # Mostly while pods start, wait and compile; sometimes later, when they serve. The
            # store turns slow mostly before the pods reach it (a lookup or a download is brief).
            early = (0.0, 1.0) if kind.startswith("remote-") else (0.3, 2.5)
            at = self.rng.uniform(*early) if self.rng.random() < 0.7 else self.rng.uniform(2.5, window)
            schedule(at, lambda k=kind: self.fire(k, schedule))
        if self.kind == "tmpfs" and self.rng.random() < 0.6:
            at = self.rng.uniform(0.0, window)
            hold = self.rng.uniform(0.5, 2 * self.lease)
            schedule(at, lambda: self.fault_ballast(hold, schedule))
        while queue:
            event = heapq.heappop(queue)
            delay = event.at - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # a random moment of the plan, not a wait for a condition
            event.action()
        self.faults_stop()
        self.settle([p for p in self.pods if p.round == round_])
        if self.remote is not None:
            self.remote.restore()  # the store degraded through the settle: the budget had to hold
            self.note("remote: the proxy passes again")

    def fire(self, kind: str, schedule: Callable[[float, Callable[[], None]], None]) -> None:
        if kind.startswith("prune-"):
            self.fault_prune(kind)
        elif kind == "sigkill-prune":
            self.fault_kill_prune()
        elif kind == "symlink":
            self.fault_symlink()
        elif kind == "intruder":
            self.fault_intruder(time.monotonic() + 2 * self.lease + 4.0, schedule)
        elif kind == "sigterm-phase":
            self.fault_sigterm_phase(schedule)
        elif kind == "server-dies":
            self.fault_server_dies()
        elif kind.startswith("remote-"):
            self.fault_remote(kind, schedule)
        elif kind == "fill-at-hit":
            self.fault_fill_at_hit(schedule)
        else:
            wanted = self.rng.choice(["holder", "holder", "waiter", "other"])
            self.fault_signal(kind, wanted, time.monotonic() + 1.5, schedule)

    def fault_sigterm_phase(self, schedule: Callable[[float, Callable[[], None]], None]) -> None:
        """SIGTERM a pod in a step of its life picked at random, seen in its state record."""
        targets = [t for t in PHASE_TARGETS if t != "downloading" or self.remote is not None]
        target = self.rng.choice(targets)
        fresh = None
        if target in SHORT_STEPS:
            # Milliseconds long: a fresh pod is watched closely from its start. Its key is one
            # already published, if any, so it looks up (with --verify full) and launches.
            published = self.published_variants()
            variant = self.rng.choice(published or self.variants)
            fresh = self.start_pod(variant, self.round, verify="full" if target == "lookup" else "fast")
        self.aim_sigterm(target, fresh, time.monotonic() + 4.0, schedule)

    def aim_sigterm(
        self,
        target: str,
        fresh: PodInfo | None,
        deadline: float,
        schedule: Callable[[float, Callable[[], None]], None],
    ) -> None:
        candidates = [fresh] if fresh is not None else self.live_pods()
        for info in candidates:
            if info.alive and info.term_at is None and where(info.pod.state()) == target:
                self.sigterm_in_phase(info, target)
                return
        if time.monotonic() < deadline and (fresh is None or fresh.alive):
            schedule(
                0.005 if fresh is not None else 0.02,
                lambda: self.aim_sigterm(target, fresh, deadline, schedule),
            )
            return
        # Not seen there in time: a pod not serving yet, else any live one.
        live = [
            p for p in ([fresh] if fresh is not None else self.live_pods()) if p.alive and p.term_at is None
        ]
        starting = [p for p in live if p.pod.phase != "serving"]
        if not live:
            self.note(f"sigterm-phase {target}: no live pod")
            return
        self.sigterm_in_phase(self.rng.choice(starting or live), target)

    def sigterm_in_phase(self, info: PodInfo, target: str) -> None:
        seen = where(info.pod.state())
        info.terminate(f"SIGTERM(phase {seen})")
        self.faults[f"sigterm-phase:{seen}"] += 1
        self.note(f"sigterm-phase {info.pod.name} in {seen} (aimed at {target})")

    def fault_server_dies(self) -> None:
        """A pod whose server dies after the load, before it is ready (mostly on a hit)."""
        published = self.published_variants()
        variant = self.rng.choice(published if published and self.rng.random() < 0.8 else self.variants)
        code = self.rng.choice(SERVER_DEATHS)
        self.faults["server-dies"] += 1
        self.start_pod(variant, self.round, verify="fast", server_exit=code)

    def fault_remote(self, kind: str, schedule: Callable[[float, Callable[[], None]], None]) -> None:
        """The store turns slow (a trickle) or silent (a stall), for a while or the rest of the round."""
        assert self.remote is not None
        downloading = [p.pod.name for p in self.live_pods() if where(p.pod.state()) == "downloading"]
        direction = self.rng.choice(["down", "down", "both"])
        after = self.rng.choice([0, 4096, 64 << 10, 1 << 20])
        if kind == "remote-trickle":
            mode: Trickle | Stall = Trickle(
                nbytes=self.rng.choice([1, 64, 4096]), interval=self.rng.choice([0.2, 0.5]), after=after,
                direction=direction,
            )  # fmt: skip
        else:
            mode = Stall(after=after, direction=direction)
        self.faults[kind] += 1
        self.remote.set_mode(mode)
        self.note(f"{kind}: {mode} (downloading: {', '.join(downloading) or 'none'})")
        if self.rng.random() < 0.5:
            schedule(self.rng.uniform(0.5, 2 * self.remote.budget), self.remote_restored)

    def remote_restored(self) -> None:
        assert self.remote is not None
        self.remote.restore()
        self.note("remote: the proxy passes again")

    def fault_fill_at_hit(
        self, schedule: Callable[[float, Callable[[], None]], None], deadline: float | None = None
    ) -> None:
        """The volume full to the last block as a pod hits (before its use record), then the
        operator's answer to a full volume: a prune of what is unused. The entry is in use."""
        published = self.published_variants()
        deadline = time.monotonic() + 8.0 if deadline is None else deadline
        if not published and time.monotonic() < deadline:  # a hit needs an entry: once one is there
            schedule(0.2, lambda: self.fault_fill_at_hit(schedule, deadline))
            return
        if not published:
            self.note("fill-at-hit: nothing published")
            return
        # An entry no other live pod uses, so the hit's use is all that keeps it; if every one is in
        # use, a rollout: the pods of one key are stopped as the new one starts.
        used = {p.variant for p in self.pods if p.alive}
        unused = [v for v in published if v not in used]
        variant = self.rng.choice(unused or published)
        if not unused:
            self.rollout(variant)
        self.faults["fill-at-hit"] += 1
        ballast = self.fill()
        info = self.start_pod(variant, self.round, verify="fast")
        self.note(f"fill-at-hit: the volume full as {info.pod.name} hits")
        hold = self.rng.uniform(2.0, 4.0) * self.lease
        schedule(0.1, lambda: self.prune_when_serving(info, ballast, time.monotonic() + 15.0, hold, schedule))

    def rollout(self, variant: int) -> None:
        old = [p for p in self.pods if p.alive and p.variant == variant and p.term_at is None]
        self.note(f"fill-at-hit: a rollout stops {', '.join(p.pod.name for p in old)}")
        for info in old:
            self.resume(info)
            info.terminate("SIGTERM(rollout)")
        for info in old:
            with contextlib.suppress(subprocess.TimeoutExpired):
                info.pod.proc.wait(timeout=self.stop_bound())

    def prune_when_serving(
        self,
        info: PodInfo,
        ballast: Path,
        deadline: float,
        hold: float,
        schedule: Callable[[float, Callable[[], None]], None],
    ) -> None:
        if info.alive and info.pod.phase != "serving" and time.monotonic() < deadline:
            schedule(0.1, lambda: self.prune_when_serving(info, ballast, deadline, hold, schedule))
            return
        self.note(f"fill-at-hit: {info.pod.name} is {info.pod.phase}; prune the full volume")
        self.fault_prune("prune-unused")
        schedule(hold, lambda: self.remove_ballast(ballast))

    def published_variants(self) -> list[int]:
        variants = set()
        for entry in _entry_dirs(self.roots[0]):
            with contextlib.suppress(ManifestError, OSError):
                variant = self._variant_of(read_manifest(entry).key)
                if variant is not None:
                    variants.add(variant)
        return sorted(variants)

    def faults_stop(self) -> None:
        for info in self.pods:
            self.resume(info)
        self.remove_ballast()
        self.faults_end = time.monotonic()
        for proc in self.prunes:
            try:
                out, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                self.violate(f"a prune did not finish within 60s: {out.decode(errors='replace')[-500:]}")
            self.prune_results.append(
                (list(map(str, proc.args)), proc.returncode, out.decode(errors="replace"))
            )  # type: ignore[arg-type]
        self.prunes.clear()
        self.check_intruders()

    def life_bound(self) -> float:
        """Once the faults stop, a pod serves or exits within this: a dead holder's lease and the
        confirm window, one remote attempt (its budget), the slowest compile twice over (2 busy
        cores), and slack; a skewed clock adds the watch of a silent attempt."""
        bound = self.longest_lease + default_confirm(self.roots[0]) + 2 * SLOWEST_PACE + LIFE_SLACK
        if self.skewed:
            bound += OBSERVE_SECONDS
        return bound + (self.remote.budget if self.remote is not None else 0.0)

    def stop_bound(self) -> float:
        """A SIGTERMed pod exits within this: the grace and, with a remote, its upload wait."""
        return STOP_GRACE + (UPLOAD_WAIT if self.remote is not None else 0.0)

    def settle(self, pods: list[PodInfo]) -> None:
        """Every pod serves or has exited, within a deadline: a pod stuck waiting is a violation;
        one that took longer than the life bound outlived its budget."""
        deadline = time.monotonic() + SETTLE_SECONDS + 3 * self.longest_lease
        for info in pods:
            while info.alive and info.pod.phase != "serving" and time.monotonic() < deadline:
                time.sleep(0.05)
            if info.alive and info.pod.phase != "serving":
                self.violate(
                    f"{info.pod.name} neither serves nor exits {SETTLE_SECONDS:.0f}s after the faults stopped "
                    f"(phase {info.pod.phase}):\n{info.pod.tail(15)}"
                )
        with contextlib.suppress(AssertionError):  # the watch thread notes each within its 50 ms
            wait_for(
                lambda: all(p.life.settled is not None or p.pod.phase not in {"serving", None} for p in pods),
                what="the watch to see the pods settle",
                timeout=5,
            )
        self.check_lives(pods)

    def check_lives(self, pods: list[PodInfo]) -> None:
        """No pod outlives its bound: from its spawn, or from the end of the faults if later, to
        its first serving or its exit. A pod the campaign SIGTERMed is judged by the stop bound
        instead, one it SIGKILLed by nothing; a SIGSTOPped one was resumed when the faults ended."""
        bound = self.life_bound()
        for info in pods:
            settled = info.life.settled
            if settled is None or info.term_at is not None or "SIGKILL" in info.signals:
                continue
            self.bounds_checked += 1
            took = settled - max(info.life.spawned, self.faults_end)
            if took > bound:
                self.violate(
                    f"{info.pod.name} took {took:.1f}s after the faults stopped to serve or exit (bound "
                    f"{bound:.1f}s: lease {self.longest_lease}s, confirm, "
                    f"remote budget {self.remote.budget if self.remote else 0}s, compile, slack):\n"
                    f"{info.pod.tail(15)}"
                )

    def end_round(self) -> None:
        """Stop some serving pods (their use records go); the rest keep serving into later rounds."""
        for info in self.pods:
            if info.alive and not info.check and self.rng.random() < 0.6:
                info.terminate("SIGTERM(end of round)")
                with contextlib.suppress(AssertionError):
                    info.pod.wait_exit(timeout=30)

    # --- the lease check and the invariants

    def lease_check(self) -> None:
        """With the faults over, a fresh pod per key gets past the lease within lease + slack.

        The lease is the longest of the trial's (a dead holder is judged by its own), and a new
        holder compiles only after its confirm window (softlease.py; none on a local disk).
        """
        for variant in self.variants:
            info = self.start_pod(variant, -1, verify="full", check=True)
            started = time.monotonic()
            limit = self.longest_lease + default_confirm(self.roots[0]) + LEASE_SLACK
            if "FAKETIME" in info.pod.env:
                # Its clock ahead, a dead attempt looks long silent: it is watched before removal.
                limit += OBSERVE_SECONDS
            while time.monotonic() - started < limit + 30:
                # Downloading from the remote, it holds the lease (the remote is fetched under it).
                past = {"compiling", "publishing", "launching", "serving", "downloading"}
                if not info.alive or where(info.pod.state()) in past:
                    break
                time.sleep(0.02)
            took = time.monotonic() - started
            self.note(
                f"lease check v{variant}: {took:.2f}s (phase {info.pod.phase}, exit {info.pod.proc.poll()})"
            )
            if took > limit:
                self.violate(
                    f"lease check: a fresh pod for variant {variant} took {took:.1f}s to get past the lease "
                    f"(limit {limit:.1f}s: lease {self.longest_lease}s, confirm, slack {LEASE_SLACK}s):\n"
                    f"{info.pod.tail(15)}"
                )
            self.settle([info])

    def check_outcomes(self) -> Counter[str]:
        outcomes: Counter[str] = Counter()
        for info in self.pods:
            code = info.pod.proc.poll()
            log = _read(info.pod.log)
            if any(text in log for text in STANDIN_DAMAGE):
                self.violate(f"{info.pod.name}: its server started on a damaged entry:\n{info.pod.tail(15)}")
            if code is None:
                outcomes["serving"] += 1
            elif code == -signal.SIGKILL and "SIGKILL" in info.signals:
                outcomes["killed"] += 1
            elif code in {SIGTERM_EXIT, 0, -signal.SIGTERM} and any(
                s.startswith("SIGTERM") for s in info.signals
            ):
                # -15: the signal came before cachemgr's handlers (interpreter start), as in a pod.
                outcomes["stopped"] += 1
            elif code == DISK_FULL and self.kind == "tmpfs":
                outcomes["disk-full"] += 1
            elif code == VOLUME_UNUSABLE and self.names_planted_dir(log):
                outcomes["refused-planted-link"] += 1
            elif info.server_exit is not None and code == _exit_of(info.server_exit):
                outcomes["server-died"] += 1
                self.check_server_death_said(info)
            else:
                outcomes[f"unexpected-{code}"] += 1
                self.violate(
                    f"{info.pod.name} exited {code} (signals sent: {info.signals or 'none'}):\n{info.pod.tail(20)}"
                )
        return outcomes

    def check_server_death_said(self, info: PodInfo) -> None:
        """A server that died before it was ready is said in the pod's termination message.

        Unless the pod's SIGTERM reached the server while it still ran, as its state says
        (``stopped_by``): a server already on its way out on its own (its exit under way) then
        ends with its own code, and neither the pod nor anyone can tell which ended it; the pod
        calls it a stop rather than blame the entry. A SIGTERM that comes after the death (the
        rollout's, as the server dies: issue 40, seed 838032) does not make it a stop: the pod
        says the death (tests/test_server_failures.py pins both sides).
        """
        code = info.server_exit
        assert code is not None
        said = _read(info.pod.state_dir / "termination-log")
        named = signal.Signals(-code).name if code < 0 else f"code {code}"
        detail = info.pod.state().get("detail")
        stopped_by = detail.get("stopped_by") if isinstance(detail, dict) else None
        if named not in said and stopped_by and any(s.startswith(stopped_by) for s in info.signals):
            self.note(
                f"{info.pod.name}: its server ended ({code}) as the pod's {stopped_by} reached it: a stop"
            )
        elif named not in said:
            self.violate(
                f"{info.pod.name}: its server died before ready ({code}) and the termination message "
                f"does not say so: {said.strip()[:300]!r}"
            )

    def check_stops(self) -> None:
        """No pod outlives its grace period: each SIGTERMed pod exited within the stop bound."""
        bound = self.stop_bound()
        for info in self.pods:
            if info.term_at is None:
                continue
            if info.alive:  # give it the rest of its grace period
                with contextlib.suppress(subprocess.TimeoutExpired):
                    info.pod.proc.wait(timeout=max(0.0, info.term_at + bound + 0.5 - time.monotonic()))
            ended = info.life.exited if info.life.exited is not None else time.monotonic()
            if "SIGKILL" in info.signals and not info.alive:
                continue  # killed meanwhile: its end says nothing of the grace period
            self.bounds_checked += 1
            if ended - info.term_at > bound:
                state = "still running" if info.alive else f"exited {info.pod.proc.returncode}"
                self.violate(
                    f"{info.pod.name} was sent SIGTERM ({info.signals}) and is {state} "
                    f"{ended - info.term_at:.1f}s later (grace {bound:.0f}s):\n{info.pod.tail(15)}"
                )

    def check_server_starts(self) -> None:
        """No server starts after SIGTERM: no server its pod spawned after the signal went on to load."""
        starts = server_starts(self.starts_record)
        loads = [e for e in self.cluster.record if e.get("event") == "load"]
        for info in self.pods:
            if info.term_boot is None:
                continue
            self.starts_checked += 1
            for event, loaded in started_after(
                starts, loads, parent=info.pod.proc.pid, signalled_boot=info.term_boot
            ):
                late = event["spawned_boot"] - info.term_boot
                if loaded:
                    self.violate(
                        f"{info.pod.name} started its server {late:.2f}s after SIGTERM ({info.signals}), "
                        f"and the server loaded the entry:\n{info.pod.tail(15)}"
                    )
                else:
                    self.note(
                        f"{info.pod.name}: a server spawned {late:.2f}s after SIGTERM was stopped at once"
                    )

    def check_loads(self) -> int:
        by_dir = {str(info.pod.state_dir): info for info in self.pods}
        checked = 0
        for event in self.cluster.record:
            if event.get("event") != "load":
                continue
            owner = next((info for d, info in by_dir.items() if str(event["path"]).startswith(d + "/")), None)
            if owner is None:
                self.violate(f"a server loaded {event['path']}, outside any pod's view")
                continue
            checked += 1
            if event["digest"] != self.references[owner.variant]:
                self.violate(
                    f"{owner.pod.name} (variant {owner.variant}) loaded digest {event['digest'][:16]}, "
                    f"a clean compile gives {self.references[owner.variant][:16]}"
                )
        return checked

    def check_entries(self) -> None:
        for entry in _entry_dirs(self.roots[0]):
            try:
                manifest = read_manifest(entry)
            except ManifestError as error:
                self.violate(f"half-written entry {entry.name}: {error}")
                continue
            if not entry.name.endswith("__" + manifest.key[:16]):
                self.violate(f"entry {entry.name} holds a manifest for key {manifest.key[:16]}")
            problems = check_files(entry, manifest, mode="full")
            if problems:
                self.violate(f"entry {entry.name} does not verify: {'; '.join(map(str, problems))}")

    def names_planted_dir(self, output: str) -> bool:
        """The documented refusal (exit 74) of a layout directory replaced by a link, naming it."""
        return any(f"/{rel} is a symbolic link" in output for rel in self.planted_dirs)

    def check_prunes(self) -> None:
        for argv, code, out in self.prune_results:
            if code == VOLUME_UNUSABLE and self.names_planted_dir(out):
                continue
            if code not in {0, -signal.SIGKILL}:
                self.violate(f"{' '.join(argv[-5:])} exited {code}: {out[-800:]}")

    def finish(self, totals: Totals) -> None:
        self.lease_check()
        self.check_stops()
        self.check_server_starts()
        outcomes = self.check_outcomes()
        loads = self.check_loads()
        self.check_entries()
        self.check_prunes()
        if _tree_digest(self.canary) != self.canary_digest:
            self.violate(f"the canary outside the root was changed: {sorted(_listing(self.canary))}")
        totals.trials += 1
        totals.faults.update(self.faults)
        totals.outcomes.update(outcomes)
        totals.pods += len(self.pods)
        totals.bounds_checked += self.bounds_checked
        totals.starts_checked += self.starts_checked
        totals.views_checked += self.watch.views_checked
        totals.loads_checked += loads
        totals.compiles += sum(1 for e in read_jsonl(self.compile_record) if e.get("event") == "compile")
        quarantine = self.roots[0] / "quarantine"
        totals.quarantined += sum(1 for p in quarantine.iterdir() if p.is_dir()) if quarantine.is_dir() else 0
        totals.violations += [f"trial {self.index} ({self.kind}): {v}" for v in self.violations]


def _exit_of(server_code: int) -> int:
    """The pod's exit for its server's: the code, or 128+N for a death by signal N (reference.md)."""
    return server_code if server_code >= 0 else 128 - server_code


def _entry_dirs(root: Path) -> list[Path]:
    entries = root / "entries"
    if not entries.is_dir():
        return []
    return sorted(p for p in entries.iterdir() if p.is_dir() and not p.name.startswith("."))


def _make_canary(path: Path) -> Path:
    """A directory outside the cache root that no command may touch (invariant 6)."""
    (path / "sub").mkdir(parents=True)
    (path / "file.bin").write_bytes(os.urandom(4096))
    (path / "sub" / "weights.safetensors").write_bytes(os.urandom(1024))
    return path


def _listing(path: Path) -> list[str]:
    return [str(p.relative_to(path)) for p in path.rglob("*")] if path.is_dir() else []


def _tree_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for name in sorted(_listing(path)):
        digest.update(name.encode())
        if (path / name).is_file():
            digest.update((path / name).read_bytes())
    return digest.hexdigest()


def _view_paths(state_dir: Path) -> set[str]:
    """Every path of the pod's current views (links included), as the server sees them."""
    views = state_dir / "views"
    return {os.path.join(d, n) for d, dirs, files in os.walk(views) for n in dirs + files}


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _roots(kind: str, request: pytest.FixtureRequest, tmp_path: Path, rng: random.Random) -> list[Path]:
    if kind == "local":
        root = tmp_path / "volume"
        root.mkdir()
        return [root, root]
    if kind == "juicefs":
        mounts: list[Path] = request.getfixturevalue("juicefs_volume_factory")(mounts=2)
        (mounts[0] / "cache").mkdir()
        return [mount / "cache" for mount in mounts]
    # Room for one to three entries (and a staging copy): full volumes come from compiling more keys.
    size = rng.choice([1, 2, 3]) * (ENTRY_BYTES + (64 << 10)) + (160 << 10)
    root = request.getfixturevalue("tmpfs_small")(size)
    return [root, root]


def _remote(index: int, request: pytest.FixtureRequest, stack: contextlib.ExitStack[None]) -> RemoteTier:
    """The trial's remote: a prefix of its own on the campaign's S3 server, behind a proxy."""
    s3: S3Server = request.getfixturevalue("campaign_s3")
    rng = random.Random(f"{SEED}:{index}:remote")
    prefix = f"campaign/{SEED}-{index}-{secrets.token_hex(3)}"
    budget = round(rng.uniform(3.0, 5.0), 1)
    return stack.enter_context(
        remote_tier(s3, prefix, budget=budget, timeout=REMOTE_TIMEOUT, upload_wait=UPLOAD_WAIT)
    )


@pytest.mark.parametrize(("index", "kind", "remote"), _trial_params())
def test_trial(  # noqa: PLR0917  # pytest passes fixtures and parameters positionally
    index: int,
    kind: str,
    remote: bool,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    totals: Totals,
    references: dict[int, str],
) -> None:
    if FAKETIME_LIB is None and os.environ.get("CACHEMGR_REQUIRE_MOUNTS") == "1":
        pytest.fail("the campaign skews clocks with libfaketime: apt-get install faketime", pytrace=False)
    rng = random.Random(f"{SEED}:{index}:volume")
    roots = _roots(kind, request, tmp_path, rng)
    with contextlib.ExitStack() as stack:
        tier = _remote(index, request, stack) if remote else None
        trial = Trial(index, kind, tmp_path / "work", roots, references, tier)
        _run_trial(trial, totals)
    replay = (
        f"replay: CACHEMGR_CAMPAIGN_SEED={SEED} CACHEMGR_CAMPAIGN_TRIALS={TRIALS} "
        f".venv/bin/pytest tests/test_campaign.py -k 'trial{index:03d}-'"
    )
    if VERBOSE:
        _say(
            request.config, "", f"trial {index} ({kind}): {time.monotonic() - trial.started:.1f}s", *trial.log
        )
    assert not trial.violations, "\n".join([*trial.violations, "timeline:", *trial.log, replay])


def _run_trial(trial: Trial, totals: Totals) -> None:
    try:
        if trial.remote is not None:
            trial.seed_remote()
        rounds = trial.rng.randint(2, 3)
        for round_ in range(rounds):
            trial.run_round(round_)
            if round_ < rounds - 1:
                trial.end_round()
                if trial.rng.random() < 0.6:
                    trial.damage()
        trial.finish(totals)
    finally:
        trial.watch.stop()
        trial.cluster.stop_all()
        for proc in trial.prunes:
            proc.kill()
            proc.communicate()
