"""A scan of the cache volume: entries, their status, users, and what could be pruned.

The scan reads each entry's small ``summary.json`` and checks that its manifest exists; it
never hashes (that is ``verify``) and never reads a manifest's file list, so ``ls`` and
``du`` stay well under a second on 10,000 entries. It survives damage: a broken entry
becomes a status and a warning, never an abort. The hit path does not scan; inspection,
space reports and ``prune`` do.

Speed notes (a volume may be NFS, where every syscall is a round trip): one directory read
of ``entries/`` and one of ``usage/``, then per entry one read of ``summary.json`` and one stat
of ``manifest.json`` (both relative to an open ``entries/``), one directory read and one stat
of its usage folder. No ``Path`` object is made per file, only per entry.

Attempts in ``staging/``, failure histories and quarantined entries are few by nature (one per
compile running or dead, per key that failed, per damage found): those read more per item.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cachemgr.core import safefs
from cachemgr.core.fsutil import read_json, tree_bytes
from cachemgr.core.units import human_age, human_bytes, human_duration
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.manifest import KEY_NAME, MANIFEST_NAME, SUMMARY_NAME
from cachemgr.volume.records import OBSERVE_SECONDS, Mark, Usage, User, read_usage
from cachemgr.volume.store import StagingInfo, list_staging

if TYPE_CHECKING:
    from cachemgr.volume.lease import Holder

EntryStatus = Literal["ok", "damaged", "incompatible"]
AttemptStatus = Literal["compiling", "published", "active", "silent", "stale"]

# An attempt whose owner record has not been refreshed for this long (by this node's clock) is
# a candidate for --stale-staging; prune then watches it for a beat before removing it (skew).
# Its heartbeat beats every 2 s; the runner itself cleans attempts silent for max(300 s, 10 x lease).
STALE_STAGING_AFTER = 300.0
# An attempt whose owner record has not beaten for this long runs nothing that ``ls`` should
# vouch for: its pod was killed (or its node's clock is off: only a label depends on this).
SILENT_ATTEMPT_AFTER = OBSERVE_SECONDS
_DIGEST = re.compile(r"[0-9a-f]{32}")
_SUMMARY_MAX = 1 << 20
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class Compat:
    """What this image can use.

    An entry is incompatible when no pod of this image can ever use it: another compiler
    major.minor (the key's ``compiler``). An entry for another NPU type is not: a role's
    Deployment may land on nodes of two NPU types sharing one volume, and those pods use it;
    treating it as dead made each type prune the other's entries and recompile in turn (11
    minutes each). Such entries go only when named (``prune --npu``) or by age or LRU.
    ``None`` means unknown: nothing is judged on that input.
    """

    compiler: str | None
    npu: str | None

    def why_incompatible(self, compiler: str, npu: str) -> str | None:
        del npu  # another NPU's entries are another hardware's, not dead (see above)
        if self.compiler and compiler and compiler != self.compiler:
            return f"compiler {compiler}, this image has {self.compiler}"
        return None

    def other_npu(self, npu: str) -> bool:
        """For another NPU type than this pod's: kept by ``--incompatible``, named by ``--npu``."""
        return bool(self.npu and npu and npu != self.npu)


@dataclass(frozen=True)
class EntryInfo:
    """One published entry as the scan sees it."""

    name: str
    path: Path
    key: str
    model: str
    model_id: str
    role: str
    compiler: str
    npu: str
    strategy: str
    size_bytes: int
    files: int
    pipeline_parallel_size: int
    created_at: float | None
    # When a pod last started or stopped using it: the usage folder's mtime changes when a pod
    # registers and when it leaves (the ``last-used`` mark alone is touched only at start, so an
    # entry served for a month would look unused for a month the minute its pods stopped).
    last_used_at: float | None
    users: tuple[User, ...]  # live: fresh by this node's clock, or seen to beat
    status: EntryStatus
    problem: str | None = None
    compile_seconds: float | None = None  # how long its compile took: what an ETA learns from
    # Pod starts that hit this entry and saw the server compile anyway (cachemgr.volume.drift).
    recompiled_on_hit: int = 0
    # Records silent by this node's clock: a dead pod's, or a live one on a node whose clock
    # differs from ours. Not "in use" for ``ls``; ``prune`` observes them before removing.
    silent_users: tuple[User, ...] = ()
    # The usage folder as this scan read it (None: not read): prune removes the entry only
    # while the folder still looks exactly like this (records.Usage.seen).
    usage_seen: frozenset[tuple[str, Mark]] | None = None
    # Where the entry came from: compiled on this volume, or downloaded from the remote tier
    # (summary.json's "origin", written by cachemgr.remote.hooks).
    origin: Mapping[str, Any] = field(default_factory=dict)

    @property
    def origin_kind(self) -> str:
        return str(self.origin.get("kind") or "local")

    @property
    def in_use(self) -> bool:
        return bool(self.users)

    @property
    def short(self) -> str:
        return (self.key or self.name.rsplit("__", 1)[-1])[:12]

    @property
    def size_str(self) -> str:
        return human_bytes(self.size_bytes)

    @property
    def created_str(self) -> str:
        return human_age(self.created_at)

    @property
    def last_used_str(self) -> str:
        return human_age(self.last_used_at)

    @property
    def users_str(self) -> str:
        return ", ".join(user.pod for user in self.users) or "-"

    def unused_for(self, now: float | None = None) -> float:
        # The usage folder may predate a republished entry (same key): count from the later.
        ref = max(self.last_used_at or 0.0, self.created_at or 0.0)
        return max(0.0, (time.time() if now is None else now) - ref)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "entry",
            "key": self.key,
            "short": self.short,
            "entry": self.name,
            "model": self.model,
            "role": self.role,
            "compiler": self.compiler,
            "npu": self.npu,
            "strategy": self.strategy,
            "size_bytes": self.size_bytes,
            "files": self.files,
            "created_at": self.created_at,
            "last_used_at": self.last_used_at,
            "in_use": self.in_use,
            "users": [user.to_json() for user in self.users],
            "silent_users": [user.to_json() for user in self.silent_users],
            "status": self.status,
            "problem": self.problem,
            "recompiled_on_hit": self.recompiled_on_hit,
            "origin": {"kind": self.origin_kind, **self.origin},
        }


@dataclass(frozen=True)
class Scan:
    """Everything on the volume, with warnings instead of aborts."""

    entries: tuple[EntryInfo, ...]
    staging: tuple[StagingInfo, ...]
    warnings: tuple[str, ...] = field(default_factory=tuple)


def scan(root: CacheRoot, *, compat: Compat | None = None, with_staging: bool = True) -> Scan:
    """Read every entry's summary; damaged ones are reported, not fatal."""
    names = entry_names(root)
    with _directory(root, root.entries) as entries_fd, _directory(root, root.usage) as usage_fd:
        used = frozenset(os.listdir(usage_fd)) if usage_fd is not None else frozenset()
        ctx = _Context(root, compat, used, time.time(), [], entries_fd, usage_fd)
        entries = tuple(info for info in _entry_infos(ctx, names) if info is not None)
    staging = tuple(list_staging(root)) if with_staging and root.staging.is_dir() else ()
    # Sorted: entries read by threads (a slow volume) add theirs in no set order.
    return Scan(entries=entries, staging=staging, warnings=tuple(sorted(ctx.warnings)))


# Entries are read one by one first. Where that is slow, a network filesystem's round trips are
# the cost (JuiceFS here: 2 to 6 ms an entry, against 0.05 ms on a local disk), and threads
# overlap them (3x with 16 on JuiceFS); on a local disk threads only fight over the GIL (3x slower).
_PROBE_ENTRIES = 64
_SLOW_ENTRY_SECONDS = 0.0005
_THREADS = 16


def _entry_infos(ctx: _Context, names: list[str]) -> list[EntryInfo | None]:
    head, rest = names[:_PROBE_ENTRIES], names[_PROBE_ENTRIES:]
    started = time.monotonic()
    infos = [_entry_info(ctx, name) for name in head]
    if not rest:
        return infos
    if (time.monotonic() - started) / len(head) < _SLOW_ENTRY_SECONDS:
        return infos + [_entry_info(ctx, name) for name in rest]
    from concurrent.futures import ThreadPoolExecutor  # network filesystems only

    with ThreadPoolExecutor(_THREADS, thread_name_prefix="cachemgr-scan") as pool:
        return infos + list(pool.map(lambda name: _entry_info(ctx, name), rest))


def scan_entry(root: CacheRoot, name: str, *, compat: Compat | None = None) -> EntryInfo | None:
    """One entry as ``scan`` sees it (None if it is not there), without scanning the rest."""
    with _directory(root, root.entries) as entries_fd:
        if entries_fd is None or not _is_dir_at(entries_fd, name):
            return None  # gone, or a link or file in place of an entry: never read through
        return _entry_info(_Context(root, compat, None, time.time(), [], entries_fd, None), name)


def _is_dir_at(fd: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


@dataclass(frozen=True)
class _Context:
    """What every entry of one scan shares."""

    root: CacheRoot
    compat: Compat | None
    used: frozenset[str] | None  # the listing of usage/ (None: just look)
    now: float
    warnings: list[str]
    # Opened entries/ and usage/ (reached without following a link): names resolve from them,
    # one path walk less per file on the hot path.
    entries_fd: int | None
    usage_fd: int | None = None
    prefix: str = field(init=False)  # what to put before "<name>/file" (nothing with the fd)
    entries: Path = field(init=False)  # CacheRoot.entries makes a new Path on each access

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", self.root.entries)
        prefix = "" if self.entries_fd is not None else os.fspath(self.entries) + "/"
        object.__setattr__(self, "prefix", prefix)


@contextlib.contextmanager
def _directory(root: CacheRoot, path: Path) -> Iterator[int | None]:
    """A layout directory opened from the root without following a link; None if missing."""
    with contextlib.ExitStack() as stack:
        try:
            fd: int | None = stack.enter_context(safefs.open_dir(root.path, path))
        except FileNotFoundError:
            fd = None
        yield fd


def entry_names(root: CacheRoot) -> list[str]:
    """Names of published entry directories, sorted; temporary dot names are skipped.

    Real directories only: a symlink in ``entries/`` is not an entry and is never read through
    (a pod that looks its key up moves it aside).
    """
    return [name for name in safefs.subdirs(root.path, root.entries) if not name.startswith(".")]


def _entry_info(ctx: _Context, name: str) -> EntryInfo | None:
    summary, problem = _read_summary(ctx, name)
    if problem is not None:
        path = ctx.entries / name
        if ctx.entries_fd is None or not _is_dir_at(ctx.entries_fd, name):
            return None  # pruned or quarantined while we looked: not damage
        ctx.warnings.append(f"{name}: {problem}")
        return _damaged(ctx, path, problem, summary)
    key = summary["key"]
    compiler, npu = _text(summary.get("compiler")), _text(summary.get("npu"))
    why = ctx.compat.why_incompatible(compiler, npu) if ctx.compat else None
    usage = _usage(ctx, key)
    return EntryInfo(
        name=name,
        path=ctx.entries / name,
        key=key,
        model=_text(summary.get("model")),
        model_id=_text(summary.get("model_id")),
        role=_text(summary.get("role")),
        compiler=compiler,
        npu=npu,
        strategy=_text(summary.get("strategy")),
        size_bytes=summary["size_bytes"],
        files=summary["files"],
        pipeline_parallel_size=summary["pipeline_parallel_size"],
        created_at=number(summary.get("created_at")),
        last_used_at=usage.last,
        users=usage.live,
        status="incompatible" if why else "ok",
        problem=why,
        compile_seconds=number(summary.get("compile_seconds")),
        recompiled_on_hit=usage.recompiled_on_hit,
        silent_users=usage.silent,
        usage_seen=usage.seen,
        origin=as_dict(summary.get("origin")),
    )


def _read_summary(ctx: _Context, name: str) -> tuple[dict[str, Any], str | None]:
    """The entry's summary, checked for shape, or what can be told of it and the problem."""
    where = f"{ctx.prefix}{name}/"
    try:
        # O_NONBLOCK: a FIFO planted as summary.json must not hang ls; O_NOFOLLOW: nor a link lead out.
        fd = os.open(where + SUMMARY_NAME, _READ_FLAGS, dir_fd=ctx.entries_fd)
        try:
            # One read: a summary is a few hundred bytes; one of a MiB is damage, and fails to parse.
            data = json.loads(os.read(fd, _SUMMARY_MAX).decode())
        finally:
            os.close(fd)
    except FileNotFoundError:
        problem = "summary.json is missing (cachemgr verify tells whether the files are intact)"
        return _key_json(ctx, name), problem
    except (OSError, ValueError) as error:
        return _key_json(ctx, name), f"summary.json is unreadable ({_short_error(error)})"
    checked = _checked_summary(data, name)
    if isinstance(checked, str):
        return _key_json(ctx, name), checked
    try:
        st: os.stat_result | None = os.stat(
            where + MANIFEST_NAME, dir_fd=ctx.entries_fd, follow_symlinks=False
        )
    except FileNotFoundError:
        st = None
    if st is None:
        problem = "no manifest.json: never committed or damaged (cachemgr verify --fix moves it aside)"
        return checked, problem
    if not stat.S_ISREG(st.st_mode):
        problem = f"manifest.json is {safefs.describe(st)}: damaged (cachemgr verify --fix moves it aside)"
        return checked, problem
    return checked, None


def _checked_summary(data: Any, name: str) -> dict[str, Any] | str:
    """The summary with its numbers as numbers, or why it is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("key"), str):
        return "summary.json is not a cachemgr summary"
    key = data["key"]
    if not _DIGEST.fullmatch(key) or not name.endswith(key[:16]):
        return f"summary.json names key {key[:16]!r}, not this entry's"
    try:  # in place: the dict was just parsed and is ours
        data["size_bytes"] = int(data.get("size_bytes") or 0)
        data["files"] = int(data.get("files") or 0)
        data["pipeline_parallel_size"] = int(data.get("pipeline_parallel_size") or 1)
    except (TypeError, ValueError):
        return "summary.json has fields of the wrong type"
    return data


def _key_json(ctx: _Context, name: str) -> dict[str, Any]:
    """What can still be told of a damaged entry from its key.json."""
    try:
        data = read_json(ctx.entries / name / KEY_NAME)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    raw_inputs = data.get("inputs")
    inputs: dict[str, Any] = raw_inputs if isinstance(raw_inputs, dict) else {}
    details = data.get("details")
    key = data.get("key")
    return {
        "key": key if isinstance(key, str) and _DIGEST.fullmatch(key) else "",
        "role": inputs.get("role", ""),
        "compiler": inputs.get("compiler", ""),
        "npu": inputs.get("npu", ""),
        "model": details.get("model_name", "") if isinstance(details, dict) else "",
    }


def _damaged(ctx: _Context, path: Path, problem: str, known: dict[str, Any]) -> EntryInfo:
    key = str(known.get("key") or "")
    if key and not path.name.endswith(key[:16]):
        key = ""  # key.json of another entry: trust only the name
    usage = _usage(ctx, key) if key else None
    return EntryInfo(
        name=path.name,
        path=path,
        key=key,
        model=str(known.get("model", "")),
        model_id="",
        role=str(known.get("role", "")),
        compiler=str(known.get("compiler", "")),
        npu=str(known.get("npu", "")),
        strategy="",
        size_bytes=tree_bytes(path, within=ctx.root.path),
        files=0,
        pipeline_parallel_size=1,
        created_at=_mtime(path),
        last_used_at=usage.last if usage else None,
        users=usage.live if usage else (),
        status="damaged",
        problem=problem,
        silent_users=usage.silent if usage else (),
        usage_seen=usage.seen if usage else None,
    )


def _usage(ctx: _Context, key: str) -> Usage:
    """Last use and current users, from one directory read and a stat per file of ``usage/<key>``."""
    if ctx.used is not None and key not in ctx.used:
        return Usage()
    return read_usage(ctx.root, key, usage_fd=ctx.usage_fd, now=ctx.now)


def last_use(root: CacheRoot, key: str) -> float | None:
    """When a pod last started or stopped using the entry (see ``EntryInfo.last_used_at``)."""
    return read_usage(root, key).last


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _short_error(error: BaseException) -> str:
    if isinstance(error, OSError):
        return error.strerror or str(error)
    return str(error).split("\n", 1)[0][:120]


def _mtime(path: Path) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def total_bytes(entries: Iterable[EntryInfo]) -> int:
    return sum(entry.size_bytes for entry in entries)


# --- attempts, failures, quarantine ---------------------------------------------------------
# Fewer than entries by far (one attempt per compile running or dead, one failure history per
# key that failed), so these read more per item: key.json, owner, lease, a walk for sizes.


def row(kind: str, **fields: Any) -> dict[str, Any]:
    """One item of ``ls -o json``: every kind carries the entry fields (null when unknown)."""
    base: dict[str, Any] = dict.fromkeys(
        ("key", "short", "entry", "model", "role", "compiler", "npu", "created_at", "last_used_at", "problem")
    )
    return {"kind": kind, **base, "size_bytes": 0, "in_use": False, **fields}


@dataclass(frozen=True)
class Attempt:
    """A compile attempt in ``staging/``, with what its owner and the lease say of it."""

    key: str
    name: str
    path: Path
    entry: str
    model: str
    role: str
    compiler: str
    npu: str
    pod: str
    node: str
    started_at: float | None
    heartbeat_age: float | None
    size_bytes: int
    shared_bytes: int  # hard-linked with the published entry (the vllm strategy's copy)
    status: AttemptStatus
    holder: Holder | None = None

    @property
    def size_str(self) -> str:
        return human_bytes(self.size_bytes)

    @property
    def detail(self) -> str:
        if self.status == "compiling":
            refreshed = self.holder.refreshed_age if self.holder else None
            return f"holds the lease, refreshed {human_duration(refreshed)} ago"
        if self.status == "published":
            return "entry published; the pod's server still runs from its own copy"
        if self.status == "active":
            return "owner alive, lease not held (publishing, or its lease lapsed)"
        silent = (
            "no owner record"
            if self.heartbeat_age is None
            else f"silent for {human_duration(self.heartbeat_age)}"
        )
        if self.status == "silent":
            return (
                f"owner {silent}: its pod is gone (or its node's clock is off) and runs nothing here; "
                f"'cachemgr prune --stale-staging' removes it once silent for {human_duration(STALE_STAGING_AFTER)}"
            )
        return f"{silent}: 'cachemgr prune --stale-staging' removes it"

    def to_json(self) -> dict[str, Any]:
        return row(
            "staging",
            key=self.key,
            short=self.key[:12],
            entry=self.entry,
            attempt=self.name,
            model=self.model,
            role=self.role,
            compiler=self.compiler,
            npu=self.npu,
            size_bytes=self.size_bytes,
            shared_bytes=self.shared_bytes,
            created_at=self.started_at,
            in_use=self.status not in ("silent", "stale"),
            pod=self.pod,
            node=self.node,
            heartbeat_age_seconds=self.heartbeat_age,
            status=self.status,
            problem=self.detail if self.status in ("silent", "stale") else None,
        )


@dataclass(frozen=True)
class FailureHistory:
    """Failed compiles of one key (records are kept for inspection, never replayed)."""

    key: str
    records: tuple[Mapping[str, Any], ...]  # oldest first; only the last one for ``ls``
    count: int

    @property
    def last(self) -> Mapping[str, Any]:
        return self.records[-1]

    @property
    def entry(self) -> str:
        return str(self.last.get("entry", ""))

    def to_json(self) -> dict[str, Any]:
        last = self.last
        # The record names the entry it would have been: model__role__c<compiler>__npu__digest.
        parts = self.entry.split("__") if self.entry.count("__") == 4 else ["", "", "", "", ""]
        return row(
            "failure",
            key=self.key,
            short=self.key[:12],
            entry=self.entry,
            model=parts[0].replace("--", "/"),  # the entry name writes a hub id's "/" as "--"
            role=parts[1],
            compiler=parts[2].removeprefix("c"),
            npu=parts[3],
            created_at=number(last.get("time")),
            status="failed",
            failures=self.count,
            reason=last.get("reason"),
            pod=last.get("pod"),
            node=last.get("node"),
            problem=last.get("message"),
        )


@dataclass(frozen=True)
class Quarantined:
    """An entry moved aside as damaged (by a pod's lookup or ``verify --fix``)."""

    name: str
    path: Path
    size_bytes: int
    reason: str
    moved_at: float | None

    def to_json(self) -> dict[str, Any]:
        return row(
            "quarantine",
            entry=self.name,
            size_bytes=self.size_bytes,
            created_at=self.moved_at,
            status="quarantined",
            problem=self.reason,
        )


def attempt_of(root: CacheRoot, info: StagingInfo, *, published: set[str]) -> Attempt:
    from cachemgr.volume.lease import read_holder  # lazy: listing entries needs no lease

    digest = info.path.parent.name
    doc = read_dict(info.path / KEY_NAME)
    inputs = as_dict(doc.get("inputs"))
    own, shared = tree_usage(info.path)
    holder = read_holder(root, digest)
    owner = info.owner
    status: AttemptStatus
    if info.is_stale(stale_after=STALE_STAGING_AFTER, identity=PodIdentity.current()):
        status = "stale"
    elif info.heartbeat_age is None or info.heartbeat_age > SILENT_ATTEMPT_AFTER:
        # Checked before the lease and the entry: a killed pod's lease stays fresh for its
        # duration, and its key may be published (by it, or by the pod that took over), but a
        # pod whose heartbeat stopped is compiling nothing and serving nothing from here.
        status = "silent"
    elif holder is not None and not lease_stale(holder) and holder.pod == owner.get("pod"):
        status = "compiling"
    elif digest in published:
        status = "published"
    else:
        status = "active"
    return Attempt(
        key=digest,
        name=info.path.name,
        path=info.path,
        entry=str(owner.get("entry") or doc.get("entry") or ""),
        model=str(as_dict(doc.get("details")).get("model_name", "")),
        role=str(inputs.get("role", "")),
        compiler=str(inputs.get("compiler", "")),
        npu=str(inputs.get("npu", "")),
        pod=str(owner.get("pod", "")),
        node=str(owner.get("node", "")),
        started_at=number(owner.get("since")),
        heartbeat_age=info.heartbeat_age,
        size_bytes=own,
        shared_bytes=shared,
        status=status,
        holder=holder if status == "compiling" else None,
    )


def lease_stale(holder: Holder) -> bool:
    """Not refreshed for its lease duration (the marker's; the default when the marker does not
    say), so the next contender takes it over. Ages are by this node's clock."""
    from cachemgr.volume.lease_defaults import DEFAULT_DURATION

    duration = holder.duration if holder.duration is not None else DEFAULT_DURATION
    return holder.refreshed_age is not None and holder.refreshed_age > duration


def failure_histories(
    root: CacheRoot, *, warnings: list[str], last_only: bool = False
) -> list[FailureHistory]:
    """Failure records by key; ``last_only`` reads one record per key (``ls``)."""
    found: list[FailureHistory] = []
    for digest in listdir(root.failures):
        names = sorted(n for n in listdir(root.failures / digest) if n.endswith(".json"))
        records = [read_dict(root.failures / digest / name) for name in (names[-1:] if last_only else names)]
        records = [r for r in records if r]
        if not records:
            if names:
                warnings.append(f"failures/{digest}: records are unreadable")
            continue
        found.append(FailureHistory(digest, tuple(records), len(names)))
    return found


def quarantined(root: CacheRoot) -> list[Quarantined]:
    found = []
    for name in listdir(root.quarantine):
        path = root.quarantine / name
        if name.endswith(".reason.json"):
            continue  # the rest: entries moved aside, also links or files found in their place
        note = read_dict(path.with_name(name + ".reason.json"))
        own, shared = tree_usage(path)
        found.append(
            Quarantined(name, path, own + shared, str(note.get("reason", "")), number(note.get("at")))
        )
    return found


def tree_usage(path: Path) -> tuple[int, int]:
    """(own bytes, bytes shared by hard link) of a tree: the vllm strategy's staging copy and
    its published entry share inodes, and counting both would double the figure."""
    own = shared = 0
    try:
        # Its last component refused as a link, nothing below followed (the layout directories
        # above it were checked when the root was opened).
        with safefs.open_tree(path, within=None) as top:
            for _, item, _ in safefs.walk(top):
                with contextlib.suppress(FileNotFoundError):
                    st = item.stat(follow_symlinks=False)
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    if st.st_nlink > 1:
                        shared += st.st_size
                    else:
                        own += st.st_size
    except (FileNotFoundError, NotADirectoryError, safefs.UnsafePathError):
        return own, shared
    return own, shared


def read_dict(path: Path) -> dict[str, Any]:
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def listdir(path: Path) -> list[str]:
    """Names in a directory of the layout, never listed through a symlink (then: nothing)."""
    try:
        fd = os.open(path, safefs.DIR_FLAGS)
    except OSError as error:
        if isinstance(error, FileNotFoundError | NotADirectoryError) or error.errno == errno.ELOOP:
            return []
        raise
    try:
        return sorted(n for n in os.listdir(fd) if not n.startswith("."))
    finally:
        os.close(fd)


def entry_digest(root: CacheRoot, name: str) -> str:
    """An entry's full digest from its summary or key.json, else the 16 digits in its name."""
    for file in (SUMMARY_NAME, KEY_NAME):
        key = read_dict(root.entries / name / file).get("key")
        if isinstance(key, str) and _DIGEST.fullmatch(key) and name.endswith(key[:16]):
            return key
    return name.rsplit("__", 1)[-1]


def number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
