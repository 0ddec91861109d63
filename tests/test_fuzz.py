"""The fuzzer (issue 33): generated content in everything cachemgr reads, then a pod start, the
builder and every inspection command against it.

A golden volume is built once by real pods (cachemgr_testkit.podlib): a signed entry from the
builder (a ``warm`` with the signing key, uploaded to the golden prefix of a real S3 server,
``weed mini``), an unsigned one from an open pod killed while it served (its use record left),
the failure record of a compile that failed, the attempt, lease marker, holder and progress
records of a compile killed midway, a server's pre-ready exit on a hit, and an entry quarantined
after damage. Each trial copies it and the golden bucket prefix, then plants one to four things
on the volume and up to two in the bucket (cachemgr_testkit.fuzz: deep, huge, wrong types,
links, FIFOs, 1,100 folders deep, not UTF-8, escape sequences, in records, manifests, artifacts,
markers, layout folders, and under new names where cachemgr lists); beyond bytes (issue 40,
cachemgr_testkit.fuzz_kinds): a self-consistent forged entry of another generation or lineage
(its key.json hashes to its name, its manifest matches), names in the records' grammar with
hostile fields, hard links to the canary, file times far off. A trial in three runs its pods and
commands as the chart's ``runAsUser`` (10001) on a volume that user owns, with root's plants in
it (files and folders it can read but not change or remove); a trial in three runs them while a
swapper trades folders of the volume for links to the canary and back, every few milliseconds
(what was checked is not what is used). Then it runs, each process under a container's usual
limit of 1,024 open files (``setrlimit`` in the child):

* every inspection command (``ls`` in three forms, ``show``, ``explain``, ``du``, ``verify``,
  ``prune --dry-run`` with every local selector, ``locks``, ``stats``, ``ls --remote``,
  ``prune --remote --dry-run``), some with trusted keys;
* four pods at once, each with the remote tier: an open ``run`` and the signing builder's
  ``warm`` of the signed key, a signing, trusting ``run`` of the unsigned key, and an open ``run``
  of the key whose compile a golden pod left half done (its lease, holder, progress and attempt);
* while the pods serve, a fifth compiles a key of its own; what the live pods own is removed
  (their use records or whole usage folders, the attempt's owner record, the lease marker and
  holder record: cachemgr_testkit.fuzz.remove_live), and at once a peer of the compiling pod
  starts and a real ``prune --unused-for 0s --stale-staging --yes`` runs;
* ``ls`` and ``verify`` again, on what the pods left;
* an operator's input (issue 40): a generated ``-o jsonpath=`` template for ``ls`` and ``show``,
  ``-o custom-columns=`` with ``--sort-by``, and ``--sort-by`` on ``ls``, ``locks``, ``stats`` or
  ``verify`` (cachemgr_testkit.fuzz.operator_*: nested past the bound and 400 deep, numbers of
  5,000 digits, slice steps of 0, odd unicode, quotes and escapes), on the planted volume; and,
  in bulk and in this process, ``OPERATOR_INPUTS`` of them per trial against the documents real
  ``ls``, ``show``, ``locks``, ``stats`` and ``verify`` print of the golden volume.

After each trial these must hold:

1. no traceback, and no exit 70 (and no "internal" failure in a pod's log);
2. no command and no pod past its deadline (60 s a command, 90 s a pod to serve or exit);
3. every exit code is the command's own (``verify`` 0 or 74, ``explain`` 0 or 1, ``show`` 0 or
   66, the rest 0), or 74 with an error line naming a path the trial planted (the documented
   refusal of a layout folder replaced); with an operator's input also 64, with one error line;
4. the pods serve (``run``) or finish (``warm``, exit 0), or exit 74 as in 3;
5. nothing a command prints to a terminal holds a character that is not printable (the volume's
   text is escaped: core/printable.py);
6. nothing outside the root was touched: the canary (files, a folder, the target of the planted
   links and hard links, and of the swapper's) has its names, bytes, modes and mtimes.
7. nothing a live pod uses goes for what was removed under it (issue 40): no serving pod's entry
   pruned, the compiling pod's attempt not removed, its key compiled once (twice only where both
   its lease marker and holder record went: the lease's documented worst; or where the swapper
   traded the entry it published for a link, which a peer set aside as damage), no lease lost, and
   every removed record of a pod still running back within ``LIVE_BACK_S``.
8. in the bucket (issue 40): damage planted on key A's remote entry (a path no volume or object
   key can hold, a size the store does not hold, a manifest encrypted SSE-C that the store will
   not serve: ``fuzz.BUCKET_DAMAGE``) is called ``damaged`` by a pod of A on a fresh volume, which
   compiles and replaces it (or a pod of the trial replaced it first), and ``pull`` then takes
   it; with a PiB claimed, ``prune --remote --keep-bytes 1Gi`` removes nothing; through a proxy
   whose listings loop (tests/s3fault.py), ``ls --remote`` and ``prune --remote`` exit 74 saying
   so; with a malformed credential variable the remote commands exit 78 and no output or pod log
   shows its value.

Short form (CI): ``CACHEMGR_FUZZ_TRIALS`` (default 3). Long form::

    CACHEMGR_FUZZ_TRIALS=200 CACHEMGR_FUZZ_SEED=... .venv/bin/pytest tests/test_fuzz.py -q

``CACHEMGR_FUZZ_SEED`` fixes the plants (it is printed); a failing trial names the command that
replays it. ``CACHEMGR_FUZZ_REPORT=FILE`` writes the totals as JSON (and each failing trial's violations
to ``FILE.violations`` as it ends). ``CACHEMGR_FUZZ_KEEP=DIR`` keeps a failing trial's pod logs and
commands' output in ``DIR/trialNNN/``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.fuzz import (
    BUCKET_DAMAGE,
    CONTENTS,
    NODES,
    Plant,
    content,
    copy_tree,
    damaged_manifest,
    hostile_name,
    live_records,
    malformed_credentials,
    operator_columns,
    operator_path,
    operator_template,
    pick_target,
    plant_node,
    remove_live,
    volume_targets,
)
from cachemgr_testkit.fuzz_kinds import (
    POD_UID,
    Swapper,
    foreign,
    forge_entry,
    give_to_pods,
    hardlink,
    plant_imitation,
    reachable,
    skew_times,
)
from cachemgr_testkit.hostile import remove_deep
from cachemgr_testkit.podlib import Cluster, Pod, as_user, cluster, free_port, wait_for, with_open_files
from cachemgr_testkit.s3server import BUCKET, S3Server, require_s3, s3_server, s3fault
from cachemgr_testkit.scenarios import compile_cmd, compiles, entry_dirs, server_argv
from cachemgr_testkit.trusted import new_key, writable

from cachemgr.core.signing import SecretKey
from cachemgr.ops import scanhints
from cachemgr.ops.scan import scan
from cachemgr.volume.layout import open_root

TRIALS = int(os.environ.get("CACHEMGR_FUZZ_TRIALS") or 3)
SEED = int(os.environ.get("CACHEMGR_FUZZ_SEED") or secrets.randbelow(1_000_000))
COMMAND_DEADLINE = 60.0
POD_DEADLINE = 90.0
# Each pod's remote: short, so that a planted object the store serves slowly costs seconds.
REMOTE_LIMITS = {
    "CACHEMGR_REMOTE_BUDGET": "20s",
    "CACHEMGR_REMOTE_TIMEOUT": "5s",
    "CACHEMGR_REMOTE_UPLOAD_WAIT": "5s",
}
POD_OPTIONS = ["--wait-timeout", "60s", "--lease-duration", "3"]
LIVE_COMPILE_S = 20  # the live phase's compile: longer than its prune (8 s) and the records' return
LIVE_BACK_S = 10.0  # a removed record is back within this: a beat (2 s; the lease's 1 s), and a margin
USE_KINDS = {"live:use-record", "live:usage-folder"}  # a use record's plants, exempt while it is refused
OPEN_FILES = 1_024  # every pod and command runs under a container's usual limit (ulimit -n)
PRUNE_SELECTORS = [
    "--damaged", "--stale-staging", "--failures", "--unused-for", "0s", "--incompatible", "--superseded"
]  # fmt: skip

pytestmark = [pytest.mark.fuzz]


# --- the totals ------------------------------------------------------------------------------------


@dataclass
class Totals:
    trials: int = 0
    plants: Counter[str] = field(default_factory=Counter)
    commands: int = 0
    pods: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def lines(self) -> list[str]:
        plants = ", ".join(f"{k}={v}" for k, v in sorted(self.plants.items())) or "none"
        outcomes = ", ".join(f"{k}={v}" for k, v in sorted(self.outcomes.items())) or "none"
        return [
            f"fuzzer: seed {SEED}, {self.trials} trials in {time.monotonic() - self.started:.0f}s, "
            f"{sum(self.plants.values())} plants, {len(self.violations)} violations",
            f"  plants by kind: {plants}",
            f"  commands run: {self.commands}; pods: {self.pods}; outcomes: {outcomes}",
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": SEED,
            "trials": self.trials,
            "seconds": round(time.monotonic() - self.started, 1),
            "plants": dict(self.plants),
            "plants_total": sum(self.plants.values()),
            "commands": self.commands,
            "pods": self.pods,
            "outcomes": dict(self.outcomes),
            "violations": self.violations,
        }


def _say(config: pytest.Config, *lines: str) -> None:
    """Past output capture (and through xdist's controller): the seed and totals go in the log."""
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
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
    _say(request.config, "", f"fuzzer: seed {SEED} (CACHEMGR_FUZZ_SEED), {TRIALS} trials")
    yield found
    _say(request.config, "", *found.lines())
    report = os.environ.get("CACHEMGR_FUZZ_REPORT")
    if report:
        Path(report).write_text(json.dumps(found.to_json(), indent=2) + "\n")


@pytest.fixture(scope="module")
def fuzz_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    require_s3()
    with s3_server(tmp_path_factory.mktemp("fuzz-s3")) as server:
        yield server


# --- the golden volume -----------------------------------------------------------------------------


@dataclass
class Golden:
    root: Path
    prefix: str
    work: Path
    secret: SecretKey
    key_file: Path
    options: dict[str, list[str]]
    keys: dict[str, str]


def _finish(pod: Pod, *, code: int | None = 0) -> None:
    got = pod.wait_exit(timeout=POD_DEADLINE)
    assert code is None or got == code, pod.tail()


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory, fuzz_s3: S3Server) -> Golden:
    """A volume and a bucket prefix holding every kind of record cachemgr reads (module doc)."""
    base = tmp_path_factory.mktemp("golden")
    root = base / "volume"
    root.mkdir()
    secret, key_file = new_key(base / "keys", "builder-1")
    record = base / "compiler.jsonl"
    record.touch(mode=0o666)  # the compile command appends to it, as root or as the pods' user
    record.chmod(0o666)
    options = {
        "A": ["--strategy", "command", "--compile-cmd", compile_cmd(record)],
        "B": ["--strategy", "command", "--compile-cmd", compile_cmd(record, extra="--files 5")],
        "C": ["--strategy", "command", "--compile-cmd", compile_cmd(record, extra="--fail-with 3")],
        "D": ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=None, extra="--files 3")],
        "E": ["--strategy", "command", "--compile-cmd", compile_cmd(record, extra="--files 4")],
    }
    prefix = f"golden/{secrets.token_hex(4)}"
    remote = {**fuzz_s3.env(prefix=prefix), **REMOTE_LIMITS}
    signer = {"CACHEMGR_SIGNING_KEY_FILE": str(key_file), "CACHEMGR_TRUSTED_KEYS": str(secret.public)}
    with cluster(base / "work") as pods:

        def start(name: str, key: str, **kwargs: Any) -> Pod:
            return pods.start(name, server_argv(free_port()), cache_root=root, options=options[key], **kwargs)

        _finish(start("builder", "A", command="warm", env={**signer, **remote}))  # signed, uploaded
        open_pod = start("open", "B")
        open_pod.wait_phase("serving")
        open_pod.signal_pod(signal.SIGKILL)  # its use record stays: a pod gone without a word
        _finish(open_pod, code=None)
        _finish(start("failing", "C"), code=70)  # a compile failure: its record under failures/
        killed = pods.start(
            "killed", server_argv(free_port()), cache_root=root, options=[*POD_OPTIONS, *options["D"]],
            env={"STANDIN_COMPILE_SECONDS": "60"},
        )  # fmt: skip
        killed.wait_phase("compiling")
        wait_for(lambda: list((root / "leases").glob("*.progress.json")), what="the progress record")
        killed.signal_pod(signal.SIGKILL)  # its attempt, lease marker, holder and progress stay
        _finish(killed, code=None)
        _finish(start("dies", "A", env={"STANDIN_EXIT_ON_LOAD": "1"}), code=1)  # a server-failed record
        damaged = start("first", "E")
        damaged.wait_phase("serving")
        damaged.signal(signal.SIGTERM)
        _finish(damaged)
        entry = next(e for e in entry_dirs(root) if e.name.endswith(_digest(root, "E", options)))
        writable(entry)
        next(p for p in (entry / "artifacts").rglob("*.rbln")).write_bytes(b"truncated")
        again = start("again", "E")  # quarantines the damaged copy, compiles a fresh one
        again.wait_phase("serving")
        again.signal(signal.SIGTERM)
        _finish(again)
    keys = {name: _digest(root, name, options) for name in ("A", "B")}
    with pytest.MonkeyPatch.context() as patch:  # the scan hints ls writes past 64 entries, written here
        patch.setattr(scanhints, "REWRITE_AFTER", 0)
        scan(open_root(root, create=False), hints=True)
    assert (root / scanhints.HINTS_NAME).is_file()
    assert (root / "quarantine").is_dir()
    assert list((root / "failures").iterdir())
    return Golden(root, prefix, base, secret, key_file, options, keys)


def _digest(root: Path, key: str, options: dict[str, list[str]]) -> str:
    """The 16 hex digits ending the entry name of a key (from ``cachemgr key``)."""
    done = subprocess.run(
        [sys.executable, "-m", "cachemgr", "key", *options[key], "-o", "json", "--", *server_argv(8000)],
        env=_cli_env(root),
        capture_output=True,
        text=True,
        timeout=COMMAND_DEADLINE,
        check=True,
    )
    return str(json.loads(done.stdout)["key"])[:16]


def _cli_env(root: Path) -> dict[str, str]:
    return {**Cluster.create(root.parent / "cli").base_env, "CACHEMGR_CACHE_ROOT": str(root)}


# --- one trial -------------------------------------------------------------------------------------


@dataclass
class Trial:
    index: int
    rng: random.Random
    root: Path
    canary: Path
    prefix: str
    s3: S3Server
    golden: Golden
    cli_env: dict[str, str] = field(default_factory=dict)
    plants: list[Plant] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    commands: int = 0
    # Issue 40's kinds: the trial's pods and commands run as the chart's runAsUser (the volume
    # theirs, the plants root's), and a folder is swapped for a link while they run.
    user: int | None = None
    swapping: bool = False
    damage: str | None = None  # a BUCKET_DAMAGE kind planted on key A's remote entry
    credentials: dict[str, str] = field(default_factory=dict)  # malformed, in every remote env
    loop_endpoint: str | None = None  # a proxy whose listings loop (tests/s3fault.py)
    planted: bytes | None = None  # key A's remote manifest as the damage left it
    transcript: list[str] = field(default_factory=list)  # each command's output, kept on a violation
    swapper: Swapper | None = None  # a swapping trial's, paused for the fuzzer's own looks

    def steady(self) -> contextlib.AbstractContextManager[None]:
        """No swap while the block looks at the volume (Swapper.paused)."""
        return (
            self.swapper.paused() if self.swapper is not None and self.swapping else contextlib.nullcontext()
        )

    @property
    def remote(self) -> dict[str, str]:
        return {**self.s3.env(prefix=self.prefix), **REMOTE_LIMITS, **self.credentials}

    def plant(self) -> None:
        targets = volume_targets(self.root, self.rng)
        for _ in range(self.rng.randint(2, 6)):
            target = pick_target(self.rng, targets, self.root)
            if not reachable(self.root, target.parent):  # below an earlier plant: another place
                target = pick_target(
                    self.rng, [t for t in targets if reachable(self.root, t.parent)], self.root
                )
            node = self.rng.choice(NODES)
            kind = plant_node(self.rng, target, canary=self.canary, kind=node)
            self.plants.append(Plant(str(target.relative_to(self.root)), kind if node == "content" else node))
        for _ in range(self.rng.randint(0, 2)):
            self._plant_object()
        self._plant_bucket_damage()
        self._plant_beyond_bytes(targets)

    def _plant_beyond_bytes(self, targets: list[Path]) -> None:
        """Issue 40's blind spots: a self-consistent forgery, names in the records' grammar,
        hard links, times far off, and (as another user) what a pod may not write."""
        rng, root = self.rng, self.root
        if rng.random() < 0.4:
            forged = forge_entry(rng, root)
            if forged is not None:
                self.plants.append(Plant(forged, "forged-entry"))
        for _ in range(rng.randint(0, 2)):
            kind = plant_imitation(rng, root, self.canary)
            self.plants.append(Plant("(a record's grammar)", kind))
        there = [t for t in targets if reachable(root, t.parent) and (t.exists() or t.is_symlink())]
        files = [t for t in there if t.is_file() and not t.is_symlink()]
        if files and rng.random() < 0.3:
            target = rng.choice(files)
            self.plants.append(Plant(str(target.relative_to(root)), hardlink(target, self.canary)))
        for target in rng.sample(there, min(len(there), rng.randint(0, 3))):
            if target.exists() or target.is_symlink():
                self.plants.append(Plant(str(target.relative_to(root)), skew_times(rng, target)))
        if self.user is not None:
            for target in rng.sample(there, min(len(there), rng.randint(1, 4))):
                self.plants.append(Plant(str(target.relative_to(root)), foreign(rng, target)))

    def _plant_object(self) -> None:
        client: Any = self.s3.client()
        top = f"{self.prefix}/"
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=top)
        keys = [item["Key"] for page in pages for item in page.get("Contents", [])]
        manifests = [k for k in keys if k.endswith("/manifest.json")]
        choice = self.rng.random()
        if manifests and choice < 0.6:
            key = self.rng.choice(manifests)
        elif keys and choice < 0.8:
            key = self.rng.choice(keys)
        else:
            key = f"{top}entries/{hostile_name(self.rng, '', utf8=True)}/manifest.json"
        original = client.get_object(Bucket=BUCKET, Key=key)["Body"].read() if key in keys else None
        kind = self.rng.choice(CONTENTS)
        body = b"\0" * (70 << 20) if kind == "huge-sparse" else content(self.rng, kind, original)
        client.put_object(Bucket=BUCKET, Key=key, Body=body)
        self.plants.append(Plant(f"s3://{BUCKET}/{key}", f"object:{kind}"))

    def _plant_bucket_damage(self) -> None:
        """Damage a reader must call damage on key A's remote entry (fuzz.BUCKET_DAMAGE); now and
        then malformed credentials, or a listing that loops (issue 40)."""
        rng = self.rng
        if rng.random() < 0.5:
            client: Any = self.s3.client()
            key = f"{self.prefix}/entries/{self._entry_a()}/manifest.json"
            self.damage = rng.choice(BUCKET_DAMAGE)
            body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
            # An earlier plant may have made it no manifest: damage already, put back as it is.
            with contextlib.suppress(ValueError, RecursionError, TypeError, AttributeError):
                body = json.dumps(damaged_manifest(rng, self.damage, json.loads(body))).encode()
            extra = {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": os.urandom(32)}
            client.put_object(
                Bucket=BUCKET, Key=key, Body=body, **(extra if self.damage == "refused" else {})
            )
            self.planted = self._manifest_a()  # None for "refused": the store serves it to no one
            self.plants.append(Plant(f"s3://{BUCKET}/{key}", f"bucket:{self.damage}"))
        if rng.random() < 0.15:
            self.credentials = malformed_credentials(rng)
            self.plants.append(Plant(next(iter(self.credentials)), "bucket:malformed-credentials"))
        if rng.random() < 0.15:
            self.loop_endpoint = "planned"  # started around the commands (run_commands)
            self.plants.append(Plant(f"s3://{BUCKET}/{self.prefix}/", "bucket:listing-loop"))

    def _manifest_a(self) -> bytes | None:
        """Key A's remote manifest as a plain GET gets it; None when the store refuses it."""
        client: Any = self.s3.client()
        key = f"{self.prefix}/entries/{self._entry_a()}/manifest.json"
        try:
            return bytes(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        except Exception:  # botocore's ClientError: the SSE-C plant, refused to us too
            return None

    def _entry_a(self) -> str:
        return next(
            e.name for e in entry_dirs(self.golden.root) if e.name.endswith(self.golden.keys["A"][:16])
        )

    # --- commands ---------------------------------------------------------------------------------

    def commands_list(self, *, after: bool) -> list[tuple[str, list[str], dict[str, str]]]:
        trust = {"CACHEMGR_TRUSTED_KEYS": str(self.golden.secret.public)}
        key_a, key_b = self.golden.keys["A"], self.golden.keys["B"]
        if after:
            return [("ls", ["ls"], {}), ("verify", ["verify"], trust)]
        return [
            ("ls", ["ls"], {}),
            ("ls", ["ls", "-o", "json"], trust),
            ("ls", ["ls", "-o", "wide"], trust),
            ("show", ["show", key_a[:12]], trust),
            ("show", ["show", key_b[:12], "-o", "yaml"], {}),
            ("explain", ["explain", *self.golden.options["A"], "--", *server_argv(8000)], trust),
            ("du", ["du"], {}),
            ("du", ["du", "-o", "json"], {}),
            ("ls", ["ls", "-o", "custom-columns=KEY:.key,GEN:.generation", "--sort-by", ".size_bytes"], {}),
            ("verify", ["verify"], trust),
            ("verify", ["verify", key_b[:12]], {}),
            ("prune", ["prune", "--dry-run", *PRUNE_SELECTORS], {}),
            ("locks", ["locks"], {}),
            ("stats", ["stats"], {}),
            ("ls", ["ls", "--remote"], self.remote),
            (
                "prune",
                ["prune", "--remote", "--dry-run", "--stale-staging", "--unused-for", "0s"],
                self.remote,
            ),
            *self.operator_commands(key_a, trust),
        ]

    def operator_commands(
        self, key: str, trust: dict[str, str]
    ) -> list[tuple[str, list[str], dict[str, str]]]:
        """An operator's input against what the trial planted: a generated template, columns and
        ``--sort-by`` (cachemgr_testkit.fuzz.operator_*), as ``operator:COMMAND``: exit 64 with one
        line where the input is bad, the command's own exits where it is not."""
        rng = self.rng
        sorter = rng.choice(["ls", "locks", "stats", "verify"])
        return [
            ("operator:ls", ["ls", "-o", f"jsonpath={operator_template(rng)}"], {}),
            ("operator:show", ["show", key[:12], "-o", f"jsonpath={operator_template(rng)}"], trust),
            (
                "operator:ls",
                ["ls", "-o", f"custom-columns={operator_columns(rng)}", "--sort-by", operator_path(rng)],
                {},
            ),
            (f"operator:{sorter}", [sorter, "--sort-by", operator_path(rng)], {}),
        ]

    def bucket_commands(self) -> list[tuple[str, list[str], dict[str, str]]]:
        """The remote commands the bucket plants add: through a proxy whose listings loop; a keep
        of 1 GiB that a manifest claiming a PiB must not turn into a removal."""
        listed: list[tuple[str, list[str], dict[str, str]]] = []
        if self.loop_endpoint:
            looping = {**self.remote, "CACHEMGR_REMOTE_ENDPOINT": self.loop_endpoint}
            listed += [
                ("ls-loop", ["ls", "--remote"], looping),
                ("prune-loop", ["prune", "--remote", "--dry-run", "--unused-for", "0s"], looping),
            ]
        if self.damage == "lying-size":
            listed.append(
                (
                    "prune-keep",
                    ["prune", "--remote", "--dry-run", "--keep-bytes", "1Gi", "-o", "json"],
                    self.remote,
                )
            )
        return listed

    def run_commands(self, *, after: bool) -> None:
        listed = self.commands_list(after=after) + ([] if after else self.bucket_commands())
        with ThreadPoolExecutor(max_workers=3) as pool:
            for result in pool.map(lambda c: self._command(*c), listed):
                self.violations += result
        self.commands += len(listed)

    def _command(self, name: str, args: list[str], extra: dict[str, str]) -> list[str]:
        env = {**self.cli_env, **extra}
        started = time.monotonic()
        try:
            done = subprocess.run(
                as_user(with_open_files([sys.executable, "-m", "cachemgr", *args], OPEN_FILES), self.user),
                env=env,
                capture_output=True,
                timeout=COMMAND_DEADLINE,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return [f"`cachemgr {' '.join(args)}` ran past its {COMMAND_DEADLINE:.0f}s deadline"]
        out = done.stdout.decode("utf-8", "surrogateescape")
        err = done.stderr.decode("utf-8", "surrogateescape")
        self.outcomes[f"{name}:{done.returncode}"] += 1
        said = f"`cachemgr {' '.join(args)}` exited {done.returncode} in {time.monotonic() - started:.1f}s"
        self.transcript.append(f"$ {said}\n{out[-6000:]}{err[-6000:]}")
        found = self._failure(said, done.returncode, err, self._allowed(name, args))
        if name == "show":
            found += _ambiguity(said, done.returncode, err)
        if name.startswith("operator:"):
            found += _operator_failure(said, done.returncode, err)
        # The operator's own template text prints as written (a {"\t"}, a literal's characters);
        # stderr's echo of it, and everything taken from the volume, is escaped.
        template = "".join(args) if name.startswith("operator:") else ""
        shown = [line for line in out.splitlines() if _unprintable(line, template)]
        shown += [line for line in err.splitlines() if _unprintable(line, "")]
        if shown:
            found.append(f"{said} and printed a character that is not printable: {shown[0]!r}"[:600])
        found += self._bucket_failures(said, name, done.returncode, out, err)
        return found

    def _allowed(self, name: str, args: list[str]) -> set[int]:
        if "--remote" not in args:
            return _allowed(name)
        if self.credentials:  # bad configuration: exit 78 naming the variable
            return {78}
        return {74} if name.endswith("-loop") else _allowed(name)

    def _bucket_failures(self, said: str, name: str, code: int, out: str, err: str) -> list[str]:
        found = [
            f"{said} and showed the value of {variable}"
            for variable, value in self.credentials.items()
            if value.strip() in out + err
        ]
        if name.endswith("-loop") and not self.credentials and "in a loop" not in err:
            found.append(f"{said} through a listing that loops, and did not say so:\n{err[-800:]}")
        if name == "prune-keep" and code == 0 and "over --keep-bytes" in out:
            found.append(
                f"{said}: a manifest claiming {1 << 50} bytes made it remove an entry:\n{out[-800:]}"
            )
        return found

    def _failure(self, said: str, code: int, text: str, allowed: set[int]) -> list[str]:
        if "Traceback" in text or '"reason": "internal"' in text or code == 70:
            return [f"{said}:\n{text[-2500:]}"]
        if code in allowed:
            return []
        named = self._named_plant(text) if code == 74 else None
        if named is not None:
            self.outcomes[f"refused-planted:{Path(named.where).parts[0]}"] += 1
            return []
        if code == 74 and self._refused_as_another_user(text):
            self.outcomes["refused-another-users"] += 1
            return []
        return [f"{said}, not one of {sorted(allowed)}:\n{text[-1500:]}"]

    @staticmethod
    def _kept_breaking(log: str) -> bool:
        failed = [line for line in log.splitlines() if '"event": "failed"' in line]
        return (
            bool(failed)
            and "kept disappearing or breaking after" in failed[-1]
            and '"reason": "volume"' in failed[-1]
        )

    def _refused_as_another_user(self, text: str) -> bool:
        """A runAsUser trial's command or pod that had to write where root's plants are (a folder
        it may not change, a file it may not remove) and stopped with 74 and the volume's own
        refusal: what such a pod must do (a volume error naming the errno, nothing half done)."""
        foreign = any(plant.kind.startswith("foreign-") for plant in self.plants)
        lines = [
            line for line in text.splitlines() if '"event": "failed"' in line or line.startswith("cachemgr")
        ]
        return self.user is not None and foreign and any("Permission denied" in line for line in lines)

    def _named_plant(self, text: str) -> Plant | None:
        """The plant the error line names (a layout folder replaced, the marker): documented."""
        lines = [
            line for line in text.splitlines() if '"event": "failed"' in line or line.startswith("cachemgr")
        ]
        said = " ".join(lines)
        return next((plant for plant in self.plants if str(self.root / plant.where) in said), None)

    def check_damage_replaced(self, pods: Cluster, work: Path) -> None:
        """Damage planted on key A's remote entry is called damage by a pod of A on a volume of its
        own, which compiles and replaces it: a pull then takes the entry (issue 40)."""
        if self.damage is None or self.credentials:
            return
        # A pod of the trial whose local copy of A was damaged too fetched it first, and replaced it.
        untouched = self._manifest_a() == self.planted
        fresh, pulled_root = work / "fresh-volume", work / "pulled"
        fresh.mkdir(parents=True)
        pulled_root.mkdir()
        pod = pods.start("fresh", server_argv(free_port()), cache_root=fresh, open_files=OPEN_FILES,
                         options=[*POD_OPTIONS, *self.golden.options["A"]], env=self.remote)  # fmt: skip
        self.outcomes["fresh:started"] += 1
        said = f"a pod of key A over its remote entry planted {self.damage}"
        try:
            pod.wait_phase("serving", timeout=POD_DEADLINE)
            if untouched:
                wait_for(
                    lambda: _events(pod, "remote_uploaded", "remote_upload_failed"),
                    what="its upload",
                    timeout=60,
                )
        except AssertionError:
            self.violations.append(f"{said} did not serve and upload:\n{pod.tail()}")
            return
        problems = [e.get("problem") for e in _events(pod, "remote_unusable_compiling_locally")]
        self.outcomes[f"fresh:{problems[0] if problems else 'hit'}"] += 1
        if problems != ["damaged"] and (untouched or problems):
            self.violations.append(f"{said} reported {problems}, not ['damaged']:\n{pod.tail()}")
        if untouched and not _events(pod, "remote_uploaded"):
            self.violations.append(f"{said} did not replace it:\n{pod.tail()}")
            return
        pulled = self._command(
            "pull",
            ["pull", self.golden.keys["A"][:12]],
            # A healthy store now (the damage replaced): what is checked is what it serves, not the
            # budget (a short one, for planted slow objects, is spent by three Python starts on a
            # loaded machine: seed 6161 trial 72 at load 10).
            {
                **self.remote,
                "CACHEMGR_CACHE_ROOT": str(pulled_root),
                "CACHEMGR_REMOTE_BUDGET": f"{COMMAND_DEADLINE - 10:.0f}s",
            },
        )
        self.violations += [f"after the replacing upload, {line}" for line in pulled]
        self.commands += 1

    # --- pods -------------------------------------------------------------------------------------

    def run_pods(self, pods: Cluster) -> None:
        golden = self.golden
        signer = {"CACHEMGR_SIGNING_KEY_FILE": str(golden.key_file), "CACHEMGR_TRUSTED_KEYS": str(golden.secret.public)}  # fmt: skip
        started = [
            ("run", pods.start("open", server_argv(free_port()), cache_root=self.root, open_files=OPEN_FILES, user=self.user,
                               options=[*POD_OPTIONS, *golden.options["A"]], env=self.remote)),
            ("run", pods.start("signer", server_argv(free_port()), cache_root=self.root, open_files=OPEN_FILES, user=self.user,
                               options=[*POD_OPTIONS, *golden.options["B"]], env={**self.remote, **signer})),
            ("warm", pods.start("builder", server_argv(free_port()), cache_root=self.root, command="warm",
                                open_files=OPEN_FILES, user=self.user,
                                options=[*POD_OPTIONS, *golden.options["A"]], env={**self.remote, **signer})),
            # The key whose compile the golden pod left half done: its lease, holder, progress record
            # and attempt are what this pod reads, takes over and cleans up.
            ("run", pods.start("taker", server_argv(free_port()), cache_root=self.root, open_files=OPEN_FILES, user=self.user,
                               options=[*POD_OPTIONS, *golden.options["D"]], env=self.remote)),
        ]  # fmt: skip
        deadline = time.monotonic() + POD_DEADLINE
        for command, pod in started:
            self._settle(command, pod, deadline)
        started += self.live_phase(pods, [pod for command, pod in started if command == "run"])
        for _, pod in started:
            if pod.proc.poll() is None:
                pod.signal(signal.SIGTERM)
        for _, pod in started:
            with contextlib.suppress(AssertionError):
                pod.wait_exit(timeout=30)
            log = pod.log.read_text(errors="replace")
            if self._lost_to_the_swapper(log):
                continue
            if "Traceback" in log or '"reason": "internal"' in log:
                self.violations.append(f"pod {pod.name}: a traceback or an internal error:\n{log[-2500:]}")

    def _lost_to_the_swapper(self, log: str) -> bool:
        """A swapping trial's pod whose server died loading an entry the swapper had traded for a
        link: the view's links are read by path, and a writer who races the load wins it (a
        limit docs/design.md's threat model names). The pod reports a server failure, as it
        must; the traceback in its log is the server's own."""
        return self.swapping and '"reason": "server-failed"' in log and '"reason": "internal"' not in log

    def _settle(self, command: str, pod: Pod, deadline: float) -> None:
        def settled() -> bool:
            return pod.proc.poll() is not None or (command == "run" and pod.phase == "serving")

        try:
            wait_for(settled, timeout=max(1.0, deadline - time.monotonic()), what=f"{pod.name} to settle")
        except AssertionError:
            self.violations.append(
                f"pod {pod.name} neither served nor exited within {POD_DEADLINE:.0f}s:\n{pod.tail()}"
            )
            return
        code = pod.proc.poll()
        if code is None:
            self.outcomes[f"{command}:serving"] += 1
            return
        self.outcomes[f"{command}:{code}"] += 1
        if code == 1 and self._lost_to_the_swapper(pod.log.read_text(errors="replace")):
            self.outcomes["server-lost-to-the-swapper"] += 1
            return
        if code == 74 and self.swapping and self._kept_breaking(pod.log.read_text(errors="replace")):
            # The swapper broke the entry at each of the pod's lookups: the documented refusal
            # (reference.md, exit 74; seed 7474 trial 183 exited 70 there before).
            self.outcomes["entry-kept-breaking-under-the-swapper"] += 1
            return
        said = f"pod {pod.name} ({command}) exited {code}"
        self.violations += self._failure(
            said, code, pod.log.read_text(errors="replace"), {0} if command == "warm" else set()
        )

    # --- live plants: what a running pod owns, removed while it runs (issue 40) ------------------

    def live_phase(self, pods: Cluster, serving: list[Pod]) -> list[tuple[str, Pod]]:
        """A pod compiling a key of its own (for LIVE_COMPILE_S); then, while it and the serving
        pods run, what they own removed (cachemgr_testkit.fuzz.remove_live), a peer of the
        compiling pod started and a real ``prune --unused-for 0s --stale-staging --yes`` run at
        once. Then: no serving pod's entry removed, the compiling pod's attempt not removed and its
        key compiled once (twice only where both its lease marker and holder record went: nothing
        then says a holder is there, and a second compile is the lease's documented worst; or where
        the swapper traded its published entry for a link that a peer set aside as damage), every
        removed record of a pod still running back within LIVE_BACK_S. Its pods are returned, to be
        stopped as the others."""
        record = self.root.parent / "live-compiler.jsonl"
        record.touch()
        record.chmod(0o666)  # the compile command appends to it, as root or as the pods' user
        compile_ = compile_cmd(record, seconds=None, extra="--files 2")
        options = [*POD_OPTIONS, "--strategy", "command", "--compile-cmd", compile_]
        env = {"STANDIN_COMPILE_SECONDS": str(LIVE_COMPILE_S)}

        def start(name: str) -> Pod:
            return pods.start(
                name,
                server_argv(free_port()),
                cache_root=self.root,
                options=options,
                env=env,
                open_files=OPEN_FILES,
                user=self.user,
            )

        slow = start("slow")
        try:
            slow.wait_phase("compiling", timeout=POD_DEADLINE)
            wait_for(lambda: live_records(self.root, "slow", slow.proc.pid)["lease-holder"], timeout=30, what="its holder record")  # fmt: skip
        except AssertionError:
            self.outcomes["live:slow-not-compiling"] += 1  # an earlier plant stopped it: settled as any pod
            self._settle("run", slow, time.monotonic() + POD_DEADLINE)
            return [("run", slow)]
        live = [pod for pod in [*serving, slow] if pod.proc.poll() is None]
        entries = {pod.name: pod.state().get("entry") for pod in live if pod.phase == "serving"}
        with self.steady():
            # Only what is there now can prune remove: a peer that holds the signing key may have
            # set an unsigned entry aside before (seed 7070 trial 116: the builder, as designed).
            gone_before = {n for n, e in entries.items() if e and not (self.root / "entries" / e).is_dir()}
            aside = {n for n in gone_before if list((self.root / "quarantine").glob(f"{entries[n]}.*"))}
        self.outcomes.update("live:entry-set-aside-before" for _ in aside)
        self.violations += [
            f"the entry {entries[n]} of the serving pod {n} is gone, and not set aside"
            for n in gone_before - aside
        ]
        entries = {n: e for n, e in entries.items() if n not in gone_before}
        removed: dict[str, list[Plant]] = {}
        # The fuzzer's own look and removal: through no folder the swapper holds swapped for a
        # link (seed 7373 trial 67: a usage folder found through one, then removed as a folder).
        with self.steady():
            attempts = [
                p.with_suffix("") for p in live_records(self.root, "slow", slow.proc.pid)["owner-record"]
            ]
            for pod in live:
                removed[pod.name] = remove_live(self.rng, _owned(self.root, pod), self.root)
                self.plants += removed[pod.name]
        said = f"removed: {[str(p) for plants in removed.values() for p in plants]}"
        peer = start("peer")
        with ThreadPoolExecutor(max_workers=1) as pool:
            pruned = pool.submit(self._command, "prune", ["prune", "--unused-for", "0s", "--stale-staging", "--yes"], {})  # fmt: skip
            self._live_back(removed, {pod.name: pod for pod in live}, slow)
            self.violations += pruned.result()
        self.commands += 1
        unseen = {pod.name for pod in live if _use_unrecorded(pod)}
        with self.steady():
            there = {name: bool(entry) and (self.root / "entries" / entry).is_dir() for name, entry in entries.items()}  # fmt: skip
            gone = [a.name for a in attempts if not a.is_dir()]
        for name, entry in entries.items():
            if entry and not there[name]:
                if name in unseen:
                    # Its use record was refused (a usage folder the pod may not write, planted as
                    # another user's): serving, but unseen by prune until a retry writes it, as its
                    # use_not_recorded warning says (docs/design.md, the threat model).
                    self.outcomes["live:pruned-unrecorded-use"] += 1
                    continue
                self.violations.append(f"prune removed {entry}, in use by the serving pod {name}; {said}")
        if gone and slow.phase == "compiling":  # read after: the attempt went while it compiled
            self.violations.append(f"the compiling pod's attempt {gone} was removed; {said}")
        self._settle("run", slow, time.monotonic() + POD_DEADLINE)
        self._settle("run", peer, time.monotonic() + POD_DEADLINE)
        lease = {p.kind for p in removed.get("slow", [])} >= {"live:lease-marker", "live:lease-holder"}
        # A compiling pod that met a swapped folder stops (74, the documented refusal): its peer then
        # compiles the key as the lease's next holder (seed 6262 trial 142).
        refused = slow.proc.returncode == 74 and self._named_plant(slow.tail()) is not None
        # The swapper traded the entry it published for a link, and a peer that met the link set
        # it aside as damaged and compiled the key again: the documented answer to damage (seed
        # 7676 trial 49), as for any entry a writer of the volume breaks.
        broken = self._set_aside_swapped(slow, peer)
        if broken:
            self.outcomes["live:published-entry-swapped-and-set-aside"] += 1
        if compiles(record) > (2 if lease or refused or broken else 1):
            self.violations.append(f"the compiling pod's key was compiled {compiles(record)} times; {said}")
        lost = [e for e in slow.log_events() if e.get("event") == "lease_lost"]
        if lost and not lease:
            self.violations.append(f"the compiling pod lost its lease: {lost[0]}; {said}")
        return [("run", slow), ("run", peer)]

    def _set_aside_swapped(self, *pods: Pod) -> bool:
        """The compiling pod's entry, once published, swapped for a link by the swapper, and set
        aside as damaged by one of ``pods`` that met the link there."""
        named = {str(e.get("entry")) for e in pods[0].log_events() if e.get("event") == "key_resolved"}
        entry = named.pop() if len(named) == 1 else ""
        swapped = any(p.kind == "swapped" and p.where == f"entries/{entry}" for p in self.plants)
        damaged = [
            e
            for pod in pods
            for e in pod.log_events()
            if e.get("event") == "entry_damaged"
            and e.get("entry") == entry
            and "symbolic link" in str(e.get("problems"))
        ]
        return bool(entry) and self.swapping and swapped and bool(damaged)

    def _live_back(self, removed: dict[str, list[Plant]], pods: dict[str, Pod], slow: Pod) -> None:
        """Every removed record of a pod still running is back within LIVE_BACK_S (the compiling
        pod's attempt records only while it compiles: a publish ends them), but a use record the
        volume refuses to the pod, as its warning says (:func:`_use_unrecorded`)."""

        def missing() -> list[str]:
            compiling = slow.proc.poll() is None and slow.phase == "compiling"
            with self.steady():
                return [
                    plant.where
                    for name, plants in removed.items()
                    for plant in plants
                    if pods[name].proc.poll() is None
                    and (name != "slow" or compiling or plant.kind in USE_KINDS)
                    and not (plant.kind in USE_KINDS and _use_unrecorded(pods[name]))
                    and not (self.root / plant.where).exists()
                ]

        try:
            wait_for(
                lambda: not missing(), timeout=LIVE_BACK_S, what="the removed records to be written again"
            )
        except AssertionError:
            self.violations.append(f"not written again within {LIVE_BACK_S:.0f}s: {missing()}")


def _owned(root: Path, pod: Pod) -> dict[str, list[Path]]:
    """What the live pod owns (cachemgr_testkit.fuzz.live_records), its owner records only those
    of the attempt it compiles in (its log's ``compiling`` phase): one a failed download left
    (the swapper made its removal fail, seed 6262 trial 142) is no longer the pod's, and goes as
    any dead attempt does."""
    owned = live_records(root, pod.name, pod.proc.pid)
    compiling = {
        Path(str((e.get("detail") or {}).get("staging", ""))).name
        for e in _events(pod, "phase")
        if e.get("to") == "compiling"
    }
    owned["owner-record"] = [p for p in owned["owner-record"] if p.with_suffix("").name in compiling]
    return owned


def _use_unrecorded(pod: Pod) -> bool:
    """The pod's use record was refused and no retry has written it since: at its first write
    (seed 7070 trial 39: ``usage/<key>`` planted read-only and another user's, EACCES at every
    beat), or at the heartbeat's restore of a removed one (seed 7272 trial 91: ``usage/``
    planted another user's 0700, the removed ``usage/<key>`` cannot be made again). The pod says
    both with ``use_not_recorded``, the documented outcome: prune cannot see it meanwhile."""
    use = re.compile(rf"{re.escape(pod.name)}\.\d+\.json")
    said = [
        e.get("event")
        for e in _events(pod, "use_not_recorded", "use_recorded", "record_restored")
        if e.get("event") != "record_restored" or use.fullmatch(str(e.get("record", "")))
    ]
    return bool(said) and said[-1] == "use_not_recorded"


def _unprintable(line: str, template: str) -> bool:
    """``line`` holds a character that is not printable and not the operator's own: a tab where
    ``template`` asks for one (``{"\\t"}``), or a character its text or literals hold, prints as
    written, as kubectl prints it (seed 7373: a literal ``'\\u202egnp'`` of the template).
    Whatever comes from the volume is escaped."""
    own = set(template) | ({"\t"} if "\\t" in template else set())
    return any(not char.isprintable() and char not in own for char in line)


def _events(pod: Pod, *names: str) -> list[dict[str, Any]]:
    return [e for e in pod.log_events() if e.get("event") in names]


def _allowed(name: str) -> set[int]:
    # verify 66, show 66: the entry named is gone (a plant replaced entries/, or a pod set it aside);
    # operator:COMMAND: an operator's template, columns or --sort-by, bad input (64) or not.
    if name.startswith("operator:"):
        return _allowed(name.partition(":")[2]) | {64}
    # show 64: a name planted with the key's digits makes its prefix match two keys (_ambiguity).
    return {"verify": {0, 66, 74}, "explain": {0, 1}, "show": {0, 64, 66}}.get(name, {0})


def _ambiguity(said: str, code: int, err: str) -> list[str]:
    """An ambiguous key (64) lists candidates an operator can tell apart (seed 7171 trial 86:
    "matches 2 keys (b9657c6a7a85, b9657c6a7a85)")."""
    found = re.search(r"matches \d+ keys \((.*)\)", err)
    if code != 64 or found is None:
        return [f"{said}: a usage error that is not an ambiguous key:\n{err[-800:]}"] if code == 64 else []
    listed = found.group(1).removesuffix(", ...").split(", ")
    return [] if len(set(listed)) == len(listed) else [f"{said}: candidates alike: {found.group(0)}"]


def _operator_failure(said: str, code: int, err: str) -> list[str]:
    """Bad operator input is one line that says why (issue 40): the error, once, and no more."""
    if code != 64:
        return []
    errors = [
        line for line in err.splitlines() if line.startswith("cachemgr ") or '"event": "failed"' in line
    ]
    others = [
        line
        for line in err.splitlines()
        if not line.startswith(("cachemgr ", "note: ", "warning: ", "  ", "{"))
    ]
    if len(errors) != 1 or others:
        return [f"{said}: not one error line:\n{err[-1500:]}"]
    return []


def _keep(into: Path, work: Path, trial: Trial) -> None:
    """CACHEMGR_FUZZ_KEEP: a violating trial's pods' logs and commands' output, kept to read."""
    into.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        shutil.copytree(work / "logs", into / "logs", dirs_exist_ok=True)
    (into / "commands.txt").write_text("\n".join(trial.transcript), errors="replace")
    (into / "plants.txt").write_text("\n".join(str(plant) for plant in trial.plants), errors="replace")


def _make_canary(path: Path) -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "file.bin").write_bytes(os.urandom(4096))
    (path / "sub" / "weights.safetensors").write_bytes(os.urandom(1024))
    return path


def _tree_state(path: Path) -> dict[str, str]:
    """Names, kinds, modes, mtimes and bytes of everything under ``path``: any touch shows."""
    found: dict[str, str] = {}
    for folder, dirs, files in sorted(os.walk(path)):
        for name in sorted(dirs + files):
            full = Path(folder) / name
            st = full.lstat()
            state = f"mode {st.st_mode:o}, mtime {st.st_mtime_ns}, size {st.st_size}"
            if full.is_file() and not full.is_symlink():
                state += f", sha256 {hashlib.sha256(full.read_bytes()).hexdigest()[:16]}"
            found[str(full.relative_to(path))] = state
    st = path.lstat()
    found["."] = f"mode {st.st_mode:o}, mtime {st.st_mtime_ns}"
    return found


def _touched(before: dict[str, str], after: dict[str, str]) -> str:
    """What changed under the canary, one line a name."""
    names = sorted(set(before) | set(after))
    return "; ".join(
        f"{name}: {before.get(name, '(none)')} -> {after.get(name, '(none)')}"
        for name in names
        if before.get(name) != after.get(name)
    )


def _copy_prefix(s3: S3Server, source: str, target: str) -> None:
    client: Any = s3.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{source}/")
    for page in pages:
        for item in page.get("Contents", []):
            rest = item["Key"][len(source) :]
            client.copy_object(
                Bucket=BUCKET, Key=f"{target}{rest}", CopySource={"Bucket": BUCKET, "Key": item["Key"]}
            )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(TRIALS), ids=[f"trial{i:03d}" for i in range(TRIALS)])
def test_trial(index: int, golden: Golden, fuzz_s3: S3Server, tmp_path: Path, totals: Totals) -> None:
    mode = random.Random(f"{SEED}:{index}:mode")
    user = POD_UID if mode.random() < 0.3 else None
    swapping = mode.random() < 0.3
    # As another user, the trial's folders must be reachable without privileges, as a pod's
    # mount is: pytest's base is root's own (0700), so they go in a folder of their own.
    base = Path(tempfile.mkdtemp(prefix="cachemgr-fuzz-")) if user is not None else tmp_path
    base.chmod(0o711)
    root = base / "volume"
    copy_tree(golden.root, root)
    canary = _make_canary(base / "canary")
    before = _tree_state(canary)
    prefix = f"fuzz/{SEED}-{index}-{secrets.token_hex(3)}"
    _copy_prefix(fuzz_s3, golden.prefix, prefix)
    trial = Trial(
        index, random.Random(f"{SEED}:{index}"), root, canary, prefix, fuzz_s3, golden, _cli_env(root)
    )
    trial.user, trial.swapping = user, swapping
    swapper = Swapper(root, canary, mode, trial.plants)
    trial.swapper = swapper
    try:
        if user is not None:
            give_to_pods(root)
        trial.plant()
        with swapper.running() if swapping else contextlib.nullcontext(), contextlib.ExitStack() as proxies:
            if trial.loop_endpoint:
                script = Path(__file__).with_name("s3fault.py")
                trial.loop_endpoint = proxies.enter_context(
                    s3fault(
                        script,
                        fuzz_s3.endpoint,
                        tmp_path / "loop.log",
                        "--writes",
                        "pass",
                        "--loop-listings",
                        "",
                    )
                )
            trial.run_commands(after=False)
            with cluster(base / "work") as pods:
                trial.run_pods(pods)
                trial.check_damage_replaced(pods, base / "fresh")
        trial.run_commands(after=True)
        after = _tree_state(canary)
        if after != before:
            trial.violations.append(f"the canary outside the root was touched: {_touched(before, after)}")
    except BaseException as error:
        # A trial that stopped outside its checks (a wait of the fuzzer's own timed out, a crash):
        # reported and kept as a violation is, so a long run's report and logs tell it too.
        stopped = "".join(traceback.format_exception_only(error)).strip()
        trial.violations.append(f"the trial stopped outside its checks: {stopped}")
        _report(index, trial.violations)
        raise
    finally:
        if trial.violations and os.environ.get("CACHEMGR_FUZZ_KEEP"):
            _keep(Path(os.environ["CACHEMGR_FUZZ_KEEP"]) / f"trial{index:03d}", base / "work", trial)
        remove_deep(root)  # the planted chains of 1,100 folders: pytest's own cleanup recurses
        if base != tmp_path:
            shutil.rmtree(base, ignore_errors=True)
    totals.trials += 1
    totals.plants.update(plant.kind for plant in trial.plants)
    totals.plants.update({"as-pod-user": trial.user is not None, "swaps": swapper.swaps})
    totals.commands += trial.commands
    totals.pods += 6
    totals.outcomes.update(trial.outcomes)
    totals.violations += trial.violations
    _report(index, trial.violations)
    plants = "\n".join(f"  {plant}" for plant in trial.plants)
    assert not trial.violations, "\n".join([*trial.violations, f"plants:\n{plants}", _replay(index)])


def _replay(index: int) -> str:
    return f"replay: CACHEMGR_FUZZ_SEED={SEED} CACHEMGR_FUZZ_TRIALS={TRIALS} .venv/bin/pytest tests/test_fuzz.py -k 'trial{index:03d}'"


def _report(index: int, violations: list[str]) -> None:
    """A long run's violations, as they come (CACHEMGR_FUZZ_REPORT; the totals at its end)."""
    report = os.environ.get("CACHEMGR_FUZZ_REPORT")
    if report and violations:
        with open(f"{report}.violations", "a", encoding="utf-8") as out:
            out.write("\n".join([f"trial{index:03d}:", *violations, _replay(index), "", ""]))


# --- operator input, in bulk ----------------------------------------------------------------------

OPERATOR_INPUTS = 100  # generated inputs per trial's worth (CACHEMGR_FUZZ_TRIALS): in-process, ~0.1 s each


def test_operator_input_against_real_documents(golden: Golden, tmp_path: Path, totals: Totals) -> None:
    """Issue 40: generated templates, columns and ``--sort-by`` (cachemgr_testkit.fuzz.operator_*)
    against the documents real ``ls``, ``show``, ``locks`` and ``stats`` print of the golden volume,
    through the code ``-o jsonpath=``, ``-o custom-columns=`` and ``--sort-by`` run, in this process
    (the trials run a few through the CLI, on planted volumes). Each ends in output or a
    :class:`UsageError` of one line; never another exception; every line printed is printable
    (a tab only where the template asks for one)."""
    import io
    from contextlib import redirect_stdout

    from cachemgr.cli.documents import document, emit_custom_columns
    from cachemgr.cli.jsonpath import render
    from cachemgr.core.errors import UsageError
    from cachemgr.core.printable import safe

    root = tmp_path / "volume"
    copy_tree(golden.root, root)
    env = _cli_env(root)
    args = [["ls"], ["show", golden.keys["A"][:12]], ["locks"], ["stats"], ["verify"]]
    docs = [json.loads(_cli_json(a, env)) for a in args]
    rng = random.Random(f"{SEED}:operator")
    violations: list[str] = []
    for _ in range(OPERATOR_INPUTS * TRIALS):
        doc = rng.choice(docs)
        form = rng.choice(["jsonpath", "custom-columns", "sort-by"])
        text = (
            operator_template(rng)
            if form == "jsonpath"
            else operator_columns(rng)
            if form == "custom-columns"
            else operator_path(rng)
        )
        out = io.StringIO()
        try:
            with redirect_stdout(out):
                if form == "jsonpath":
                    out.write(render(text, doc, escape=safe))
                elif form == "custom-columns":
                    emit_custom_columns(doc, text, headers=True)
                else:
                    document(doc["kind"], doc.get("items", doc), sort_by=text)
        except UsageError as error:
            totals.outcomes[f"operator-{form}:64"] += 1
            if "\n" in error.one_line() or safe(error.one_line()) != error.one_line():
                violations.append(
                    f"{form} {text[:300]!r}: not one printable line: {error.one_line()[:300]!r}"
                )
            continue
        except Exception as error:  # the invariant: nothing but a usage error
            violations.append(f"{form} {text[:300]!r}: {type(error).__name__}: {str(error)[:300]}")
            continue
        totals.outcomes[f"operator-{form}:0"] += 1
        bad = [line for line in out.getvalue().splitlines() if _unprintable(line, text)]
        if bad:
            violations.append(f"{form} {text[:300]!r} printed {bad[0][:200]!r}")
    totals.plants.update({"operator-input": OPERATOR_INPUTS * TRIALS})
    totals.violations += violations
    assert not violations, "\n".join(
        [*violations[:20], f"replay: CACHEMGR_FUZZ_SEED={SEED} CACHEMGR_FUZZ_TRIALS={TRIALS}"]
    )


def _cli_json(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "cachemgr", *args, "-o", "json"],
        env=env, capture_output=True, text=True, timeout=COMMAND_DEADLINE, check=False,
    )  # fmt: skip
    assert done.returncode in (0, 74), done.stderr
    return done.stdout
