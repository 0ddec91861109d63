"""The fuzzer's plants of issue 40 (tests/test_fuzz.py), beside those of :mod:`cachemgr_testkit.fuzz`:
what a writer of the volume can do besides putting bytes in a file.

* :func:`forge_entry`: a self-consistent forged entry. A published entry copied under another
  key: its ``key.json`` claims another generation (a compiler or key schema newer or older) or
  another lineage (another role, model or NPU), its inputs hash to the new entry's name and its
  manifest matches its files. No reader can call it damage: ``ls``, ``prune --superseded`` and
  ``--incompatible``, ``explain`` and the pods must judge it by what it claims.
* :func:`imitation_name`: a name in the grammar of a record cachemgr lists (``<pod>.<pid>.json``,
  ``server-failed.<n>.<pod>.<pid>.json``, an attempt's ``<pod>.<pid>.<start>``, an entry's
  ``model__role__cX__NPU__digits``) with hostile fields: pids past 2**64, 0, 1 (a live process
  on every node), negative, escapes, 16 digits of another entry.
* :func:`hardlink`: a hard link to the canary outside the root in place of a file (a writer with
  the volume can make one where both sit on one filesystem): a chmod, a write or an ``O_TRUNC``
  through it would show on the canary.
* :func:`skew_times`: a file's or folder's times set far off (the epoch, before it, 2100, the
  largest a filesystem takes): a node's clock or a writer lying in the one field the liveness
  rules read.
* :func:`foreign`: files and folders owned by another user (root, where pods run as the chart's
  ``runAsUser``), unreadable (0000) or read-only (0555): what a non-root pod meets on a volume a
  Job or a root shell wrote. The trial runs its pods and commands as :data:`POD_UID` then.
* :class:`Swapper`: a folder swapped for a link to the canary, and back, over and over while the
  commands and pods run: whatever was checked before is not what is used after.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cachemgr.key.digest import digest_of
from cachemgr.volume.manifest import KEY_NAME, MANIFEST_NAME, build_manifest, write_manifest
from cachemgr_testkit.fuzz import Plant, take_away
from cachemgr_testkit.trusted import writable

# The chart's securityContext (deploy/helm/modelserver/values.yaml: runAsUser, fsGroup 10001).
POD_UID = 10001
FORGERIES = ("newer-compiler", "older-compiler", "newer-schema", "other-role", "other-model", "other-npu")
IMITATION_PIDS = ("1", "0", "-1", "18446744073709551617", "9" * 400, "0x10", "1e3", " 1", "\x1b[2J")
SKEWS_NS = (0, -(10**18), 4_102_444_800 * 10**9, 2**63 - 1)


def published(root: Path) -> list[Path]:
    """The entries of the volume that have a key.json and a manifest (what a forger copies)."""
    entries = root / "entries"
    if not entries.is_dir() or entries.is_symlink():
        return []
    return sorted(
        p
        for p in entries.iterdir()
        if p.is_dir() and not p.is_symlink() and (p / KEY_NAME).is_file() and (p / MANIFEST_NAME).is_file()
    )


def forge_entry(rng: random.Random, root: Path) -> str | None:
    """A forged entry (module doc) beside one of the volume's; its folder's name, or None."""
    sources = published(root)
    if not sources:
        return None
    source = rng.choice(sources)
    try:
        doc = json.loads((source / KEY_NAME).read_bytes())
    except (OSError, ValueError, RecursionError):  # an earlier plant of the trial damaged it
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), dict):
        return None
    kind = rng.choice(FORGERIES)
    inputs = dict(doc["inputs"])
    details = dict(doc.get("details") or {}) if isinstance(doc.get("details"), dict) else {}
    if kind == "newer-compiler":
        inputs["compiler"] = "99.9"
    elif kind == "older-compiler":
        inputs["compiler"] = "0.1"
    elif kind == "newer-schema":
        inputs["schema"] = (inputs["schema"] if type(inputs.get("schema")) is int else 0) + 1000
    elif kind == "other-role":
        inputs["role"] = "decode" if inputs.get("role") != "decode" else "prefill"
    elif kind == "other-model":
        details["model_name"] = "\x1b[31mforged-model"
        inputs["model"] = {"kind": "hub", "id": "forged/model\nname", "revision": "0" * 40}
    else:
        inputs["npu"] = "RBLN-CR99"
    digest = digest_of(inputs)
    parts = source.name.split("__")
    name = "__".join([*parts[:-1], digest[:16]]) if len(parts) > 1 else f"forged__{digest[:16]}"
    target = root / "entries" / name
    if target.exists() or target.is_symlink():
        return None
    try:
        shutil.copytree(source, target, symlinks=True)
    except (shutil.Error, OSError, RecursionError):
        # An earlier plant of the trial in the source (a FIFO, a chain of 1,100 folders): no
        # forgery this trial (seed 7070 trials 96 and 100), and no half copy left behind.
        from cachemgr_testkit.hostile import remove_deep

        remove_deep(target)
        return None
    writable(target)
    (target / MANIFEST_NAME).unlink()
    # A forger has no signing key; an earlier plant may have made the signature a folder (seed
    # 7474 trial 145).
    take_away(target / "signature.json")
    (target / KEY_NAME).write_text(json.dumps({**doc, "inputs": inputs, "details": details}, sort_keys=True))
    manifest = build_manifest(
        target,
        key=digest,
        inputs=inputs,
        created_by={"pod": "forger", "node": "node-x", "pid": 1},
        compile_seconds=rng.choice([0.0, 1e9]),
        strategy=str(inputs.get("strategy") or "command"),
        model_name=str(details.get("model_name") or "model"),
    )
    write_manifest(target, manifest)
    return f"entries/{name} ({kind})"


def imitation_name(rng: random.Random, root: Path) -> Path:
    """A new name in the grammar of a record cachemgr lists, with hostile fields (module doc)."""
    digests = _digests(root)
    digest = rng.choice(digests) if digests else "0" * 32
    pid = rng.choice(IMITATION_PIDS)
    pod = rng.choice(["ro-1", "pod\x1b[31m", "a" * 240, "..", ".", "x.y.z", "\udcff"])
    entry_digits = rng.choice([digest[:16], "f" * 16, digest[:15] + "\n"])
    choices = [
        root / "usage" / digest / f"{pod}.{pid}.json",
        root / "usage" / digest / f"server-failed.{pid}.{pod}.{pid}.json",
        root / "usage" / digest / "last-used",
        root / "staging" / digest / f"{pod}.{pid}.{rng.choice(['0', '-5', '1e400', 'nan'])}",
        root / "failures" / digest / f"{rng.choice(['0', '99999999999999999999'])}.{pod}.{pid}.json",
        root / "leases" / f"{digest}.{rng.choice(['holder', 'progress', 'lock'])}.{pod}.json",
        root / "entries" / f"model__prefill__c0.12__RBLN-CA25__{entry_digits}",
        root / "quarantine" / f"model__prefill__c0.12__RBLN-CA25__{entry_digits}.{pid}",
    ]
    return rng.choice(choices)


def _digests(root: Path) -> list[str]:
    usage = root / "usage"
    if not usage.is_dir() or usage.is_symlink():
        return []
    return sorted(p.name for p in usage.iterdir() if p.is_dir() and not p.is_symlink())


def plant_imitation(rng: random.Random, root: Path, canary: Path) -> str:
    """A file (a plausible record, or hostile bytes) or a folder at an :func:`imitation_name`."""
    target = imitation_name(rng, root)
    if len(os.fsencode(target.name)) > 255:  # no filesystem takes a longer name: cut to one it does
        target = target.with_name(os.fsdecode(os.fsencode(target.name)[-255:]))
    if not reachable(root, target.parent):
        return "imitation-unreachable"
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        return "imitation-exists"
    record: dict[str, Any] = {
        "pod": rng.choice(["ro-1", "\x1b]0;pwned\x07"]),
        "node": rng.choice(["node-a", ""]),
        "pid": rng.choice([1, 0, -1, 2**70, "1"]),
        "started_at": rng.choice([0, -1e300, 4e9, "now"]),
        "key": rng.choice(["0" * 32, None, ["x"]]),
    }
    if rng.random() < 0.2:
        target.mkdir()
        (target / "manifest.json").write_text(json.dumps(record))
    elif rng.random() < 0.2:
        target.symlink_to(canary / "file.bin")
    else:
        target.write_text(json.dumps(record, ensure_ascii=False), errors="surrogateescape")
    return "imitation"


def hardlink(target: Path, canary: Path) -> str:
    """A hard link to the canary's file at ``target`` (what was there removed first)."""
    if target.is_dir() and not target.is_symlink():
        return "hardlink-skipped-folder"
    with contextlib.suppress(FileNotFoundError):
        os.chmod(target.parent, 0o755)
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    os.link(canary / "file.bin", target)
    return "hardlink"


def _shared(target: Path) -> bool:
    """A file with other names (the hard link :func:`hardlink` planted to the canary): its times
    and mode are the canary's too, which the trial itself must never change (seed 6363 trial 165)."""
    st = target.lstat()
    return not target.is_dir() and st.st_nlink > 1


def skew_times(rng: random.Random, target: Path) -> str:
    """``target``'s access and modification times set far off (module doc); not through a link."""
    if not target.is_symlink() and target.exists() and _shared(target):
        return "skew-skipped-hardlink"
    when = rng.choice(SKEWS_NS)
    try:
        os.utime(target, ns=(when, when), follow_symlinks=False)
    except (OSError, OverflowError):  # a filesystem that refuses the time: the nearest it takes
        os.utime(target, ns=(0, 0), follow_symlinks=False)
        return "skew-epoch"
    return "skew"


def foreign(rng: random.Random, target: Path) -> str:
    """``target`` owned by root (the trial's pods run as :data:`POD_UID`), unreadable or read-only."""
    if target.is_symlink() or not target.exists() or _shared(target):
        return "foreign-skipped"
    os.chown(target, 0, 0, follow_symlinks=False)
    # The pods keep reading any file (podlib.as_user): what they meet is what they cannot write,
    # make or remove: a root folder's names, a root file's bytes and mode.
    mode = rng.choice([0o555, 0o755, 0o700]) if target.is_dir() else rng.choice([0o600, 0o444, 0o644])
    os.chmod(target, mode)
    return f"foreign-{'dir' if target.is_dir() else 'file'}-{mode:o}"


def give_to_pods(root: Path) -> None:
    """Everything under ``root`` owned by :data:`POD_UID`, as the chart's fsGroup leaves a volume."""
    for folder, dirs, files in os.walk(root):
        os.chown(folder, POD_UID, POD_UID)
        for name in (*dirs, *files):
            os.chown(Path(folder) / name, POD_UID, POD_UID, follow_symlinks=False)


def reachable(root: Path, folder: Path) -> bool:
    """Every level from the root down to ``folder`` is a real folder (or not there yet)."""
    for level in [folder, *folder.parents]:
        if level == root.parent:
            return True
        if level.is_symlink() or (level.exists() and not level.is_dir()):
            return False
    return True


class Swapper:
    """A folder under the root swapped for a link to the canary folder and back, over and over,
    until stopped: a check (a walk, a verification, a listing) and the use after it see two
    different things. What it did is counted in :attr:`swaps`."""

    def __init__(self, root: Path, canary: Path, rng: random.Random, plants: list[Plant]) -> None:
        self.root = root
        self.canary = canary
        self.rng = random.Random(rng.random())
        self.swaps = 0
        # Each folder swapped, once: a command or pod that meets the link refuses it with exit 74
        # naming it (the documented refusal of a folder replaced by a link).
        self.plants = plants
        self._named: set[Path] = set()
        self._turn = threading.Lock()  # held through each swap and its undoing (paused())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fuzz-swapper", daemon=True)

    def _candidates(self) -> list[Path]:
        found: list[Path] = []
        for name in ("entries", "usage", "staging", "failures"):
            folder = self.root / name
            if folder.is_dir() and not folder.is_symlink():
                with contextlib.suppress(OSError):
                    found += [p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()]
        return found

    def _loop(self) -> None:
        # An attacker's cadence, not a wait for a condition: every few milliseconds, a swap.
        while not self._stop.wait(self.rng.choice([0.002, 0.01, 0.05])):
            candidates = self._candidates()
            if not candidates:
                continue
            with self._turn:
                self._swap(self.rng.choice(candidates))

    def _swap(self, victim: Path) -> None:
        aside = victim.with_name(f".swapped-{self.swaps}")
        try:
            os.rename(victim, aside)
            os.symlink(self.canary, victim)
        except OSError:
            return
        if victim not in self._named:
            self._named.add(victim)
            self.plants.append(Plant(str(victim.relative_to(self.root)), "swapped"))
        self._stop.wait(self.rng.choice([0.001, 0.02]))
        with contextlib.suppress(OSError):
            os.unlink(victim)
        with contextlib.suppress(OSError):
            os.rename(aside, victim)
        self.swaps += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No folder swapped while the block runs: a check of the fuzzer's own (is a pod's entry
        or attempt still there?) sees the volume, not a swap in its 20 ms (seed 7070 trial 116: an
        attempt looked removed through a staging folder swapped that moment)."""
        with self._turn:
            yield

    @contextlib.contextmanager
    def running(self) -> Iterator[Swapper]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(timeout=30)
