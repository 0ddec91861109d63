"""The fault campaign: real pods, random faults at random moments, and the invariants after each trial.

Each trial makes a fresh cache volume (a local directory, two mounts of a fresh JuiceFS volume as
two nodes, or a small tmpfs that fills up), then runs two or three rounds of real ``cachemgr run``
pods (the stand-in compiler through ``--strategy command``, the stand-in server loading
``{artifact_dir}``) for one to three keys. While a round runs, faults fire at random moments:

* ``sigkill`` / ``sigstop`` (then ``SIGCONT`` up to 2.5 leases later) / ``sigterm`` of a whole pod,
  aimed at a lease holder (compiling or publishing), a waiter, or any other pod;
* ``prune-unused`` (``cachemgr prune --unused-for 0s --yes``) and ``prune-stale``
  (``--stale-staging``), run from a random node, and ``sigkill-prune`` (a prune killed mid-way);
* ``ballast`` (tmpfs trials): a file that takes all but a few KiB of the free space, removed later;
* ``symlink``: someone with write access to the volume plants a symlink to the *canary* (a
  directory outside the root) where cachemgr lists, moves or deletes: ``staging/<digest>`` of a key
  in use, a child of ``staging/<digest>``, ``quarantine/``, ``trash/``, ``usage/`` or ``leases/``;
* ``intruder``: a second ``cachemgr run`` or a ``cachemgr warm`` typed into a serving pod
  (``kubectl exec``: it inherits the pod's ``CACHEMGR_STATE_DIR``).

Pods differ as a real fleet does: in a trial with mixed leases each pod takes one of two
``--lease-duration`` values (a Deployment and a warm Job, two rollouts), and with clock skew some
pods and prunes run with their wall clock minutes off (libfaketime, up to +-10 minutes).

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
   on a volume that filled up, or exit 74 naming a layout directory the campaign replaced by a
   link (the documented refusal; an operator removes the link). Anything else (a crash, a stuck pod) is reported with its log;
6. nothing outside the root was touched: the canary tree is byte for byte what it was;
7. an intruder never disturbed its pod: the pod still serves, its probes pass, its view is whole.

Short form (CI): ``CACHEMGR_CAMPAIGN_TRIALS`` (default 6: two of each volume kind). Long form::

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
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.podlib import (
    FAKETIME_LIB,
    STANDIN_COMPILER,
    Cluster,
    Pod,
    free_port,
    read_jsonl,
    skewed_env,
)
from cachemgr_testkit.scenarios import MODEL, server_argv

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
)
SKEWS = (-600, -180, 180, 600)  # seconds a skewed pod's or prune's wall clock is off
INTRUDER_EXITS = {"run": {64}, "warm": {0}}  # a second run on a live state dir refuses (usage)
STANDIN_DAMAGE = ("truncated or damaged (stand-in check)", "missing the required")

pytestmark = [pytest.mark.campaign]


def _trial_params() -> list[Any]:
    params = []
    for i in range(TRIALS):
        kind = KINDS[i % len(KINDS)]
        marks = [pytest.mark.timeout(300)]
        if kind != "local":
            marks.append(getattr(pytest.mark, kind))
        params.append(pytest.param(i, kind, marks=marks, id=f"trial{i:03d}-{kind}"))
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

    @property
    def alive(self) -> bool:
        return self.pod.proc.poll() is None


@dataclass(order=True)
class Event:
    at: float
    order: int
    action: Callable[[], None] = field(compare=False)


class Trial:
    """One trial: a volume, its pods, the faults, and what the invariants found."""

    def __init__(
        self, index: int, kind: str, work: Path, roots: list[Path], references: dict[int, str]
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
        self.ballast: Path | None = None
        # variant -> (damage kind, entry, inode): until that entry is gone (quarantined, pruned)
        self.damaged: dict[int, tuple[str, Path, int]] = {}
        self.started = time.monotonic()
        self._counter = 0
        self.cluster = Cluster.create(work / "pods", STANDIN_COMPILE_SECONDS="1")

    # --- bookkeeping

    def note(self, text: str) -> None:
        self.log.append(f"{time.monotonic() - self.started:7.2f}s {text}")

    def violate(self, text: str) -> None:
        self.violations.append(text)
        self.note(f"VIOLATION {text}")

    def node(self) -> int:
        return self.rng.randrange(len(self.roots))

    # --- pods

    def start_pod(self, variant: int, round_: int, *, verify: str, check: bool = False) -> PodInfo:
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
        pace = f"{self.rng.uniform(0.3, 3.0):.2f}"
        skew, skewed = self.skew()
        pod = self.cluster.start(
            name,
            server_argv(free_port()),
            cache_root=self.roots[node],
            options=options,
            node=f"node-{node}",
            env={"STANDIN_COMPILE_SECONDS": pace, **skew},
        )
        info = PodInfo(pod, variant, round_, check=check, options=options)
        self.pods.append(info)
        self.note(f"start {name} on node-{node} (compile {pace}s, verify {verify}, lease {lease}s{skewed})")
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
            info.signals.append("SIGTERM")
            info.pod.signal(signal.SIGTERM)
        else:
            info.signals.append("SIGSTOP")
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

    def fault_ballast(self) -> None:
        root = self.roots[0]
        st = os.statvfs(root)
        free = st.f_bavail * st.f_frsize
        keep = self.rng.choice([0, 4096, 64 << 10, 256 << 10])
        size = max(0, free - keep)
        self.faults["ballast"] += 1
        self.ballast = root / f"ballast.{self._counter}"
        self.note(f"ballast {size} bytes (leaves {keep})")
        with contextlib.suppress(OSError), self.ballast.open("wb") as out:
            chunk = bytes(1 << 16)
            while size > 0:
                size -= out.write(chunk[: min(len(chunk), size)])

    def remove_ballast(self) -> None:
        if self.ballast is not None:
            self.ballast.unlink(missing_ok=True)
            self.note("ballast removed")
            self.ballast = None

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

    # --- rounds

    def run_round(self, round_: int) -> None:
        queue: list[Event] = []

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
        kinds, weights = zip(*ROUND_FAULTS, strict=True)
        for _ in range(self.rng.randint(1, 3)):
            kind = self.rng.choices(kinds, weights)[0]
            # Mostly while pods start, wait and compile; sometimes later, when they serve.
            at = self.rng.uniform(0.3, 2.5) if self.rng.random() < 0.7 else self.rng.uniform(2.5, window)
            schedule(at, lambda k=kind: self.fire(k, schedule))
        if self.kind == "tmpfs" and self.rng.random() < 0.6:
            at = self.rng.uniform(0.0, window)
            schedule(at, self.fault_ballast)
            schedule(at + self.rng.uniform(0.5, 2 * self.lease), self.remove_ballast)
        while queue:
            event = heapq.heappop(queue)
            delay = event.at - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # a random moment of the plan, not a wait for a condition
            event.action()
        self.faults_stop()
        self.settle([p for p in self.pods if p.round == round_])

    def fire(self, kind: str, schedule: Callable[[float, Callable[[], None]], None]) -> None:
        if kind.startswith("prune-"):
            self.fault_prune(kind)
        elif kind == "sigkill-prune":
            self.fault_kill_prune()
        elif kind == "symlink":
            self.fault_symlink()
        elif kind == "intruder":
            self.fault_intruder(time.monotonic() + 2 * self.lease + 4.0, schedule)
        else:
            wanted = self.rng.choice(["holder", "holder", "waiter", "other"])
            self.fault_signal(kind, wanted, time.monotonic() + 1.5, schedule)

    def faults_stop(self) -> None:
        for info in self.pods:
            self.resume(info)
        self.remove_ballast()
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

    def settle(self, pods: list[PodInfo]) -> None:
        """Every pod serves or has exited, within a deadline: a pod stuck waiting is a violation."""
        deadline = time.monotonic() + SETTLE_SECONDS + 3 * self.longest_lease
        for info in pods:
            while info.alive and info.pod.phase != "serving" and time.monotonic() < deadline:
                time.sleep(0.05)
            if info.alive and info.pod.phase != "serving":
                self.violate(
                    f"{info.pod.name} neither serves nor exits {SETTLE_SECONDS:.0f}s after the faults stopped "
                    f"(phase {info.pod.phase}):\n{info.pod.tail(15)}"
                )

    def end_round(self) -> None:
        """Stop some serving pods (their use records go); the rest keep serving into later rounds."""
        for info in self.pods:
            if info.alive and not info.check and self.rng.random() < 0.6:
                info.signals.append("SIGTERM(end of round)")
                info.pod.signal(signal.SIGTERM)
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
                if not info.alive or info.pod.phase in {"compiling", "publishing", "launching", "serving"}:
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
            else:
                outcomes[f"unexpected-{code}"] += 1
                self.violate(
                    f"{info.pod.name} exited {code} (signals sent: {info.signals or 'none'}):\n{info.pod.tail(20)}"
                )
        return outcomes

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
        totals.loads_checked += loads
        totals.compiles += sum(1 for e in read_jsonl(self.compile_record) if e.get("event") == "compile")
        quarantine = self.roots[0] / "quarantine"
        totals.quarantined += sum(1 for p in quarantine.iterdir() if p.is_dir()) if quarantine.is_dir() else 0
        totals.violations += [f"trial {self.index} ({self.kind}): {v}" for v in self.violations]


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


@pytest.mark.parametrize(("index", "kind"), _trial_params())
def test_trial(  # noqa: PLR0917  # pytest passes fixtures and parameters positionally
    index: int,
    kind: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    totals: Totals,
    references: dict[int, str],
) -> None:
    if FAKETIME_LIB is None and os.environ.get("CACHEMGR_REQUIRE_MOUNTS") == "1":
        pytest.fail("the campaign skews clocks with libfaketime: apt-get install faketime", pytrace=False)
    rng = random.Random(f"{SEED}:{index}:volume")
    roots = _roots(kind, request, tmp_path, rng)
    trial = Trial(index, kind, tmp_path / "work", roots, references)
    try:
        rounds = trial.rng.randint(2, 3)
        for round_ in range(rounds):
            trial.run_round(round_)
            if round_ < rounds - 1:
                trial.end_round()
                if trial.rng.random() < 0.6:
                    trial.damage()
        trial.finish(totals)
    finally:
        trial.cluster.stop_all()
        for proc in trial.prunes:
            proc.kill()
            proc.communicate()
    replay = (
        f"replay: CACHEMGR_CAMPAIGN_SEED={SEED} CACHEMGR_CAMPAIGN_TRIALS={TRIALS} "
        f".venv/bin/pytest tests/test_campaign.py -k 'trial{index:03d}-'"
    )
    if VERBOSE:
        _say(
            request.config, "", f"trial {index} ({kind}): {time.monotonic() - trial.started:.1f}s", *trial.log
        )
    assert not trial.violations, "\n".join([*trial.violations, "timeline:", *trial.log, replay])
