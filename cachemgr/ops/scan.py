"""A scan of the cache volume: entries, their status, users, and what could be pruned.

The scan reads each entry's small ``summary.json`` and checks that its manifest exists; it
never hashes (that is ``verify``) and never reads a manifest's file list, so ``ls`` and
``du`` stay well under a second on 10,000 entries. It survives damage: a broken entry
becomes a status and a warning, never an abort. The hit path does not scan; inspection,
space reports and ``prune`` do.

Speed notes (a volume may be NFS, where every syscall is a round trip): one directory read
of ``entries/`` and one of ``usage/``, then per entry one read of ``summary.json`` and of
``key.json`` (its generation: cachemgr.ops.generation) and one stat of ``manifest.json`` (all
relative to an open ``entries/``), one directory read and one stat of its usage folder. No
``Path`` object is made per file, only per entry.

What an entry is (:class:`~cachemgr.ops.entryinfo.EntryInfo`), how its generation stands to this
image's (:class:`~cachemgr.ops.generation.Compat`) and to its lineage's
(:mod:`cachemgr.ops.lineage`) live in their own modules; this one reads the volume.

Attempts in ``staging/``, failure histories and quarantined entries are read by
:mod:`cachemgr.ops.attempts`.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachemgr.core import jsonread, safefs
from cachemgr.core.coerce import as_dict, number, read_dict, text
from cachemgr.core.fsutil import tree_bytes
from cachemgr.ops import scanhints
from cachemgr.ops.entryinfo import OLDER, EntryInfo, EntryStatus
from cachemgr.ops.generation import Compat, KeyFacts, key_facts
from cachemgr.ops.lineage import kin, superseded
from cachemgr.volume import serverfail
from cachemgr.volume.entries import DIGEST
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.manifest import KEY_NAME, MANIFEST_NAME, SUMMARY_NAME
from cachemgr.volume.records import Usage, read_usage
from cachemgr.volume.stale import StagingInfo, list_staging

if TYPE_CHECKING:
    from cachemgr.core.signing import TrustedKeys

# What callers took from here before the split: the entry, its status and this image.
__all__ = [
    "OLDER",
    "Compat",
    "EntryInfo",
    "EntryStatus",
    "Scan",
    "last_use",
    "scan",
    "scan_entry",
    "total_bytes",
]

_SUMMARY_MAX = 1 << 20
_KEY_MAX = 1 << 20  # a key.json is a few KiB; one of a MiB is damage
_FACTS = "key_facts"  # the summary's field this scan adds: what the entry's key.json says
_PARSED = "_key_facts"  # the same, parsed once (never written: hints learn the summary before it)


@dataclass(frozen=True)
class Scan:
    """Everything on the volume, with warnings instead of aborts."""

    entries: tuple[EntryInfo, ...]
    staging: tuple[StagingInfo, ...]
    warnings: tuple[str, ...] = field(default_factory=tuple)


def scan(
    root: CacheRoot,
    *,
    compat: Compat | None = None,
    with_staging: bool = True,
    trusted: TrustedKeys | None = None,
    hints: bool = False,
) -> Scan:
    """Read every entry's summary; damaged ones are reported, not fatal. With ``trusted`` keys,
    also each entry's signature (a small file, not the manifest nor the bytes). ``hints``: for
    what is only shown (ls, du, /metrics), take what did not change (:mod:`cachemgr.ops.scanhints`)."""
    hinted = scanhints.load(root) if hints else None
    with _directory(root, root.entries) as entries_fd, _directory(root, root.usage) as usage_fd:
        names, used = scanhints.names(root, entries_fd, usage_fd, hinted)
        ctx = _Context(root, compat, used, time.time(), [], entries_fd, usage_fd, trusted, hinted)
        infos = {n: _entry_info(ctx, n, s) for n, s in hinted.summaries(_checked_hint)} if hinted else {}
        fresh = [name for name in names if name not in infos]
        infos.update(zip(fresh, _entry_infos(ctx, fresh), strict=True))
        scanhints.save(root, hinted, read=len(fresh))
        entries = tuple(info for name in names if (info := infos[name]) is not None)
    if compat is not None:
        entries = superseded(entries, compat.generation)
    staging = tuple(list_staging(root)) if with_staging and root.staging.is_dir() else ()
    # Sorted: entries read by threads (a slow volume) add theirs in no set order.
    return Scan(entries=entries, staging=staging, warnings=tuple(sorted(ctx.warnings)))


# Entries are read one by one first. Where that is slow, a network filesystem's round trips are
# the cost (milliseconds an entry on JuiceFS, a fraction of one on a local disk), and threads
# overlap them; on a local disk threads only fight over the GIL. The figures: docs/benchmarks.md,
# "`ls` and `du` on 10,000 entries" (bench/bench_inspect.py).
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


def scan_entry(
    root: CacheRoot, name: str, *, compat: Compat | None = None, trusted: TrustedKeys | None = None
) -> EntryInfo | None:
    """One entry as ``scan`` sees it (None if it is not there), without scanning the rest: with
    ``compat``, only the entries that could supersede it (their names share its model, role and
    NPU parts) are read too."""
    with _directory(root, root.entries) as entries_fd:
        if entries_fd is None or not _is_dir_at(entries_fd, name):
            return None  # gone, or a link or file in place of an entry: never read through
        ctx = _Context(root, compat, None, time.time(), [], entries_fd, None, trusted)
        info = _entry_info(ctx, name)
        if info is None or compat is None or info.status != "published" or info.vs_image == "same":
            return info
        names = [n for n in kin(root, name) if n != name and _is_dir_at(entries_fd, n)]
        others = [found for n in names if (found := _entry_info(ctx, n)) is not None]
        return superseded([info, *others], compat.generation)[0]


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
    trusted: TrustedKeys | None = None
    hints: scanhints.Hints | None = None  # a scan for display (ls, du): what did not change
    prefix: str = field(init=False)  # what to put before "<name>/file" (nothing with the fd)
    entries: Path = field(init=False)  # CacheRoot.entries makes a new Path on each access
    # usage/'s folders by their first 16 digits (an entry's name carries only those).
    by_digits: dict[str, list[str]] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", self.root.entries)
        by_digits: dict[str, list[str]] = {}
        for digest in self.used or ():
            by_digits.setdefault(digest[:16], []).append(digest)
        object.__setattr__(self, "by_digits", by_digits)
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


def _entry_info(ctx: _Context, name: str, hinted: dict[str, Any] | None = None) -> EntryInfo | None:
    """One entry: its summary read now, or ``hinted`` (already checked, cachemgr.ops.scanhints)."""
    summary, problem = (hinted, None) if hinted is not None else _read_summary(ctx, name)
    other = _another_key(ctx, summary["key"]) if problem is None else None
    if other is not None and hinted is not None:
        return _entry_info(ctx, name)  # a hint proves nothing: read the entry now
    if other is not None and summary.get(_PARSED) is None:
        # Pods record their use under the full key; a summary naming another key with the same
        # 16 digits would show an entry in use as unused, and prune would take it. (A key that
        # key.json's inputs hash to is the entry's own: the other folder is not its pods'.)
        problem = (
            f"summary.json names key {summary['key'][:20]!r}... but its pods' use is under "
            f"{other[:20]!r}...: one was planted or changed (cachemgr verify checks the entry)"
        )
        summary = _key_json(ctx, name)
    if problem is not None:
        path = ctx.entries / name
        if ctx.entries_fd is None or not _is_dir_at(ctx.entries_fd, name):
            return None  # pruned or quarantined while we looked: not damage
        ctx.warnings.append(f"{name}: {problem}")
        return _damaged(ctx, path, problem, summary)
    key = summary["key"]
    compiler, npu = text(summary.get("compiler")), text(summary.get("npu"))
    facts = _facts(summary)
    if facts is None:
        unknown = text(as_dict(summary.get(_FACTS)).get("unknown")) or "key.json cannot be read"
        ctx.warnings.append(
            f"{name}: {unknown}: its generation is unknown, so it is never judged older "
            "('cachemgr verify' checks it against its manifest)"
        )
    status, why, order = ctx.compat.judge(facts) if ctx.compat else ("published", None, None)
    usage = _usage(ctx, key)
    signer, trust = _trust(ctx, name, key) if ctx.trusted else (_claimed_signer(summary), None)
    return EntryInfo(
        name=name,
        path=ctx.entries / name,
        key=key,
        model=text(summary.get("model")),
        model_id=text(summary.get("model_id")),
        role=text(summary.get("role")),
        compiler=compiler,
        npu=npu,
        strategy=text(summary.get("strategy")),
        size_bytes=summary["size_bytes"],
        files=summary["files"],
        pipeline_parallel_size=summary["pipeline_parallel_size"],
        created_at=number(summary.get("created_at")),
        last_used_at=usage.last,
        users=usage.live,
        status=status,
        problem=why,
        facts=facts,
        vs_image=order,
        compile_seconds=number(summary.get("compile_seconds")),
        recompiled_on_hit=usage.recompiled_on_hit,
        silent_users=usage.silent,
        usage_seen=usage.seen,
        origin=as_dict(summary.get("origin")),
        signer=signer,
        trust=trust,
        starts=usage.starts,
        server_failed=serverfail.count_on(ctx.root, key, usage.server_failed, summary.get("created_at")),
    )


def _claimed_signer(summary: Mapping[str, Any]) -> str | None:
    """The signer summary.json claims (not checked without trusted keys), if it is a key name."""
    from cachemgr.core.signing import is_key_name  # only for a summary that claims one

    return summary["signer"] if "signer" in summary and is_key_name(summary["signer"]) else None


def _trust(ctx: _Context, name: str, key: str) -> tuple[str | None, str]:
    """The key the entry's signature names, and "trusted" or why not (see EntryInfo)."""
    from cachemgr.volume.trust import SIGNATURE_NAME, inspect_signature

    assert ctx.trusted is not None  # called only with trusted keys
    return inspect_signature(ctx.entries_fd, f"{ctx.prefix}{name}/{SIGNATURE_NAME}", ctx.trusted, key=key)


def _read_summary(ctx: _Context, name: str) -> tuple[dict[str, Any], str | None]:
    """The entry's summary, checked for shape, or what can be told of it and the problem."""
    where = f"{ctx.prefix}{name}/"
    try:
        # The one bounded reader: a FIFO does not hang ls, a link does not lead out, a summary of
        # more than a MiB or nested 200,000 deep is damage (a few hundred bytes are written).
        data = jsonread.read(where + SUMMARY_NAME, dir_fd=ctx.entries_fd, limit=_SUMMARY_MAX)
    except FileNotFoundError:
        problem = "summary.json is missing (cachemgr verify tells whether the files are intact)"
        return _key_json(ctx, name), problem
    except (OSError, ValueError) as error:
        return _key_json(ctx, name), f"summary.json is unreadable ({_short_error(error)})"
    if isinstance(data, dict):
        data.pop(_FACTS, None)  # only this scan says what key.json holds, never the summary
        data.pop(_PARSED, None)
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
    found = _read_key_facts(ctx, name, checked["key"])
    facts = found if isinstance(found, KeyFacts) else None
    checked[_FACTS] = {"unknown": found} if isinstance(found, str) else {}
    if ctx.hints is not None:  # what the next scan for display may take unread
        if facts is not None:
            checked[_FACTS] = {"facts": facts.to_hint()}
        ctx.hints.learn(name, checked)
    checked[_PARSED] = facts
    return checked, None


def _read_key_facts(ctx: _Context, name: str, key: str) -> KeyFacts | str:
    """What the entry's key.json says of its generation (cachemgr.ops.generation), or why nothing."""
    try:
        data = jsonread.read(f"{ctx.prefix}{name}/{KEY_NAME}", dir_fd=ctx.entries_fd, limit=_KEY_MAX)
    except FileNotFoundError:
        return "key.json is missing"
    except (OSError, ValueError) as error:
        return f"key.json is unreadable ({_short_error(error)})"
    return key_facts(data, key) if isinstance(data, dict) else "key.json is not a cachemgr key"


def _facts(summary: Mapping[str, Any]) -> KeyFacts | None:
    if _PARSED in summary:
        parsed: KeyFacts | None = summary[_PARSED]
        return parsed
    return KeyFacts.from_hint(as_dict(summary.get(_FACTS)).get("facts"))


def _checked_hint(data: Any, name: str) -> dict[str, Any] | str:
    """A hinted summary: checked as one read now, with what its key.json said (a row of an
    earlier release lacks it: read afresh)."""
    checked = _checked_summary(data, name)
    if isinstance(checked, str):
        return checked
    checked.pop(_PARSED, None)  # a row says what it likes: only what parses from it counts
    facts = as_dict(checked.get(_FACTS))
    parsed = KeyFacts.from_hint(facts.get("facts"))
    if parsed is None and not isinstance(facts.get("unknown"), str):
        return "a hint without what key.json says"
    checked[_PARSED] = parsed
    return checked


def _checked_summary(data: Any, name: str) -> dict[str, Any] | str:
    """The summary with its numbers as numbers, or why it is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("key"), str):
        return "summary.json is not a cachemgr summary"
    key = data["key"]
    if not DIGEST.fullmatch(key) or not name.endswith(key[:16]):
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
    data = read_dict(ctx.entries / name / KEY_NAME)
    if not data:
        return {}
    inputs = as_dict(data.get("inputs"))
    details = data.get("details")
    key = data.get("key")
    return {
        "key": key if isinstance(key, str) and DIGEST.fullmatch(key) else "",
        "role": text(inputs.get("role")),
        "compiler": text(inputs.get("compiler")),
        "npu": text(inputs.get("npu")),
        "model": text(details.get("model_name")) if isinstance(details, dict) else "",
    }


def _damaged(ctx: _Context, path: Path, problem: str, known: dict[str, Any]) -> EntryInfo:
    key = str(known.get("key") or "")
    if key and (not path.name.endswith(key[:16]) or _another_key(ctx, key) is not None):
        key = ""  # key.json of another entry (or not the key its pods use): trust only the name
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
        starts=usage.starts if usage else {},
    )


def _another_key(ctx: _Context, key: str) -> str | None:
    """A folder in usage/ with ``key``'s 16 digits but not ``key``: pods use another key than
    the one named (on a sound volume two keys share 16 digits once in 2**64)."""
    return next((d for d in ctx.by_digits.get(key[:16], ()) if d != key), None)


def _usage(ctx: _Context, key: str) -> Usage:
    """Last use and current users, from one directory read and a stat per file of ``usage/<key>``."""
    if ctx.used is not None and key not in ctx.used:
        return Usage()
    read = partial(read_usage, ctx.root, key, usage_fd=ctx.usage_fd, now=ctx.now)
    return read() if ctx.hints is None else ctx.hints.usage(key, read)


def last_use(root: CacheRoot, key: str) -> float | None:
    """When a pod last started or stopped using the entry (see ``EntryInfo.last_used_at``)."""
    return read_usage(root, key).last


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
