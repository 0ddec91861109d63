"""``ls``, ``show``, ``explain``, ``du``, ``verify``, ``prune``, ``locks``: parse, call the library, render.

Results go to stdout (aligned tables, or JSON with ``-o json``); notes and warnings go to
stderr, so ``-o json`` output always parses. Only ``verify --fix`` and ``prune`` write to the
volume, and nothing prompts without a terminal.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cachemgr.cli.cmd_run import cache_root, key_request
from cachemgr.cli.render import Column, emit, emit_json, emit_long_json, flatten, table
from cachemgr.core.coerce import as_dict
from cachemgr.core.errors import UsageError, VolumeError
from cachemgr.core.units import human_age, human_bytes, human_duration, parse_duration, parse_size
from cachemgr.key.cachekey import compute_key
from cachemgr.ops.diskusage import DiskUsage, disk_usage
from cachemgr.ops.explain import Explanation
from cachemgr.ops.explain import explain as explain_key
from cachemgr.ops.image import ImageInfo, resolve_image
from cachemgr.ops.inspection import EntryDetail, Listing, list_cache, volume_errors
from cachemgr.ops.inspection import show as show_key
from cachemgr.ops.locks import LockInfo, list_locks
from cachemgr.ops.meter import interval_from, open_meter
from cachemgr.ops.prune import execute
from cachemgr.ops.prune_plan import PrunePlan, PruneRequest, PruneResult, plan_prune
from cachemgr.ops.scan import EntryInfo, scan
from cachemgr.ops.verify import VerifyReport
from cachemgr.ops.verify import verify as verify_entries
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import CacheRoot, open_root

_TOP_ENTRIES = 15  # du lists the largest entries; -o json has them all


def _root(args: argparse.Namespace) -> CacheRoot:
    return open_root(cache_root(args), create=False)  # inspection never creates the layout


def _image(args: argparse.Namespace, environ: Mapping[str, str]) -> ImageInfo:
    return resolve_image(compiler_version=args.compiler_version, npu_type=args.npu_type, environ=environ)


def _tell(kind: str, lines: Iterable[str]) -> None:
    for line in lines:
        print(f"{kind}: {line}", file=sys.stderr)


def _kv(pairs: Sequence[tuple[str, Any]]) -> str:
    width = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k:<{width}}  {'-' if v is None else v}" for k, v in pairs)


def _n(count: int, noun: str) -> str:
    """``1 entry``, ``2 entries``."""
    if count == 1:
        return f"1 {noun}"
    return f"{count} {noun[:-1]}ies" if noun.endswith("y") else f"{count} {noun}s"


def _section(title: str, body: str) -> str:
    return f"\n\n{title}\n{body}"


# --- ls -------------------------------------------------------------------------------------

_LS = [
    Column("key", "key"),
    Column("model", "model"),
    Column("role", "role"),
    Column("compiler", "compiler"),
    Column("npu", "npu"),
    Column("size", "size", ">"),
    Column("created", "created"),
    Column("last used", "last_used"),
    Column("in use", "in_use"),
    Column("status", "status"),
]


def ls(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    image = _image(args, environ)
    root = _root(args)
    with volume_errors(root):
        listing = list_cache(root, compat=image.compat)
    if args.output == "json":
        emit_long_json(listing.to_json())
    else:
        emit(_ls_text(listing, image, args.cache_root))
    _tell("warning", listing.warnings)
    _tell("note", image.notes)
    return 0


def _ls_text(listing: Listing, image: ImageInfo, root: str) -> str:
    rows = [
        {
            "key": e.short,
            "model": e.model or "?",
            "role": e.role or "?",
            "compiler": e.compiler or "?",
            "npu": e.npu or "?",
            "size": e.size_str,
            "created": e.created_str,
            "last_used": e.last_used_str,
            "in_use": _n(len(e.users), "pod") if e.in_use else "no",
            "status": e.status if e.origin_kind == "local" else f"{e.status} ({e.origin_kind})",
        }
        for e in listing.entries
    ]
    text = table(rows, _LS) if rows else f"no entries under {root}"
    total = human_bytes(sum(e.size_bytes for e in listing.entries))
    text += f"\n\n{_n(len(rows), 'entry')}, {total}"
    incompatible = [e for e in listing.entries if e.status == "incompatible"]
    if incompatible:
        size = human_bytes(sum(e.size_bytes for e in incompatible if not e.in_use))
        text += (
            f"; {len(incompatible)} incompatible with this image (compiler {image.compat.compiler or '?'}): "
            f"'cachemgr prune --incompatible' frees {size} of them now"
        )
    text += _other_npus(listing.entries, image)
    if listing.count("damaged"):
        text += f"; {listing.count('damaged')} damaged: 'cachemgr verify --fix' moves them aside"
    drifted = [e.short for e in listing.entries if e.recompiled_on_hit]
    if drifted:
        text += (
            f"\nRECOMPILED ON HIT: the server compiled anyway after loading {', '.join(drifted)}: the key lacks an "
            "input the server hashes ('cachemgr show KEY' names the new files)"
        )
    return text + _side_sections(listing)


def _other_npus(entries: tuple[EntryInfo, ...], image: ImageInfo) -> str:
    """Entries for another NPU type are another hardware's pods', not dead: say so, and how to name them."""
    others = sorted({e.npu for e in entries if e.status == "ok" and image.compat.other_npu(e.npu)})
    if not others:
        return ""
    count = sum(1 for e in entries if e.npu in others and e.status == "ok")
    return (
        f"; {_n(count, 'entry')} for other NPU types ({', '.join(others)}; this pod has {image.compat.npu}): "
        f"pods on that hardware may use them, so --incompatible keeps them; "
        f"'cachemgr prune --npu {others[0]}' removes them once that hardware is gone"
    )


def _silent_rows(e: EntryInfo) -> list[tuple[str, str]]:
    """Use records silent by this node's clock: a dead pod's, or one on a node whose clock is off."""
    if not e.silent_users:
        return []
    pods = ", ".join(f"{u.pod} (node {u.node or '?'})" for u in e.silent_users)
    return [("silent users", f"{pods}: dead, or their node's clock differs; prune watches them for a beat")]


def _side_sections(listing: Listing) -> str:
    text = ""
    rows: list[dict[str, Any]]
    if listing.attempts:
        rows = [
            {
                "key": a.key[:12],
                "model": a.model or "?",
                "role": a.role or "?",
                "pod": a.pod or "?",
                "node": a.node or "-",
                "size": a.size_str,
                "started": human_age(a.started_at),
                "status": a.status,
                "detail": a.detail,
            }
            for a in listing.attempts
        ]
        cols = ["key", "model", "role", "pod", "node", "size", "started", "status", "detail"]
        text += _section(
            "STAGING (compile attempts)",
            table(rows, [Column(c, c, ">" if c == "size" else "<") for c in cols]),
        )
    if listing.failures:
        published = {e.key for e in listing.entries}
        rows = [
            {
                **{c: row.get(c) or "?" for c in ("model", "role", "compiler", "npu", "pod", "reason")},
                "key": f.key[:12],
                "failures": f.count,
                "last": human_age(row["created_at"]),
                "now": "published" if f.key in published else "not published",
            }
            for f in listing.failures
            for row in [f.to_json()]
        ]
        cols = ["key", "model", "role", "compiler", "npu", "failures", "last", "pod", "reason", "now"]
        text += _section(
            "FAILED COMPILES ('cachemgr show KEY' has the output)", table(rows, [Column(c, c) for c in cols])
        )
    if listing.quarantined:
        rows = [
            {
                "name": q.name,
                "size": human_bytes(q.size_bytes),
                "moved": human_age(q.moved_at),
                "reason": q.reason,
            }
            for q in listing.quarantined
        ]
        cols = ["name", "size", "moved", "reason"]
        text += _section(
            "QUARANTINE ('cachemgr prune --damaged' removes)", table(rows, [Column(c, c) for c in cols])
        )
    return text


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


# --- show -----------------------------------------------------------------------------------


def show(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    image = _image(args, environ)
    root = _root(args)
    with volume_errors(root):
        detail = show_key(root, args.key, compat=image.compat)
    if args.output == "json":
        emit_json(detail.to_json())
    else:
        emit(_show_text(detail))
    _tell("warning", detail.warnings)
    return 0


def _origin_pairs(origin: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``show``: where a downloaded entry came from (nothing for one compiled on this volume)."""
    if origin.get("kind") != "remote":
        return []
    by = as_dict(origin.get("downloaded_by"))
    return [
        (
            "downloaded",
            f"{human_age(_float(origin.get('downloaded_at')))} from {origin.get('remote', '?')} "
            f"in {human_duration(_float(origin.get('download_seconds')))} by pod {by.get('pod', '?')}",
        )
    ]


def _show_text(d: EntryDetail) -> str:
    e, m = d.entry, d.manifest or {}
    created_by = m.get("created_by") or {}
    status = "not published" if e is None else e.status + (f" ({e.problem})" if e.problem else "")
    pairs: list[tuple[str, Any]] = [("key", d.digest), ("entry", d.name or "?"), ("status", status)]
    if e is not None:
        pairs += [
            ("path", str(e.path)),
            ("size", f"{e.size_str} in {m.get('files', e.files)} files"),
            (
                "created",
                f"{e.created_str} by pod {created_by.get('pod', '?')} on node {created_by.get('node') or '?'}",
            ),
            (
                "compiled in",
                f"{human_duration(m.get('compile_seconds'))} ({m.get('strategy') or e.strategy} strategy)",
            ),
            *_origin_pairs(e.origin),
            ("last used", e.last_used_str),
            (
                "in use by",
                ", ".join(f"{u.pod} (node {u.node or '?'}, since {human_age(u.since)})" for u in e.users)
                or "no pod",
            ),
            *_silent_rows(e),
            (
                "files check",
                "; ".join(d.problems) or "sizes match the manifest ('cachemgr verify' hashes them)",
            ),
        ]
    text = _kv(pairs)
    inputs = d.inputs
    if inputs:
        sources = as_dict(d.key_doc.get("sources"))
        rows = [
            {"input": name, "value": value, "source": sources.get(name.split(".")[0], "")}
            for top, value_ in inputs.items()
            for name, value in flatten(top, value_)
        ]
        text += _section(
            "KEY INPUTS",
            table(rows, [Column("input", "input"), Column("value", "value"), Column("source", "source")]),
        )
        dropped = d.key_doc.get("dropped_runtime_flags")
        if dropped and isinstance(dropped, list):
            text += f"\nleft out as runtime-only: {', '.join('--' + str(f) for f in dropped)}"
    if d.holder is not None:
        h = d.holder
        stale = h.stale
        state = "STALE (dead or frozen: the next pod to start takes it over)" if stale else "live"
        refreshed = f"refreshed {human_duration(h.refreshed_age)} ago, lease {human_duration(h.duration)}"
        text += _section("LEASE", f"held by {h.describe()}; {refreshed}: {state}")
    for a in d.attempts:
        text += _section(
            "ATTEMPT", f"{a.name}: pod {a.pod} node {a.node or '?'}, {a.size_str}, {a.status}: {a.detail}"
        )
    if d.history is not None:
        text += _section(
            f"FAILED COMPILES ({d.history.count})", "\n".join(_failure_text(r) for r in d.history.records)
        )
    if d.recompiled:
        text += _section(
            f"RECOMPILED ON HIT ({len(d.recompiled)}): the server compiled anyway; the key lacks an input it hashes",
            "\n".join(_recompiled_text(r) for r in d.recompiled),
        )
    return text


def _recompiled_text(record: Mapping[str, Any]) -> str:
    paths = record.get("paths")
    shown = [str(p) for p in paths] if isinstance(paths, list) else []
    head = (
        f"{human_age(_float(record.get('time')))}  pod {record.get('pod', '?')} on node {record.get('node') or '?'}: "
        f"{record.get('count', len(shown))} new file(s)"
    )
    return "\n".join([head, *(f"    {p}" for p in shown)])


def _failure_text(record: Mapping[str, Any]) -> str:
    head = (
        f"{human_age(_float(record.get('time')))}  pod {record.get('pod', '?')} on node {record.get('node') or '?'}: "
        f"{record.get('reason', '?')} (exit {record.get('exit_code', '?')}, "
        f"compiler status {record.get('exit_status', '-')}, after {human_duration(_float(record.get('elapsed_s')))})"
    )
    tail = record.get("output_tail")
    tail = [str(line) for line in tail] if isinstance(tail, list) else []
    lines = [head, f"  {record.get('message', '')}"]
    if tail:
        lines.append("  last output:")
        lines += [f"    | {line}" for line in tail]
    return "\n".join(lines)


# --- explain --------------------------------------------------------------------------------


def explain(args: argparse.Namespace, server_argv: list[str], environ: Mapping[str, str]) -> int:
    key = compute_key(key_request(args, server_argv, environ))
    root = _root(args)
    with volume_errors(root):
        result = explain_key(root, key)
    if args.output == "json":
        emit_json(result.to_json())
    else:
        emit(_explain_text(result))
    _tell("warning", result.warnings)
    return 0


def _explain_text(x: Explanation) -> str:
    pairs: list[tuple[str, Any]] = [
        ("result", x.result.upper()),
        ("key", x.key.digest),
        ("entry", x.key.entry_name),
    ]
    if x.key.server.dropped:
        pairs.append(("runtime-only", " ".join("--" + f for f in x.key.server.dropped) + " (not in the key)"))
    for reason in x.key.details.get("uncacheable", ()):
        pairs.append(("cannot cache", reason))
    text = _kv(pairs)
    if x.nearest:
        blocks = []
        for rank, near in enumerate(x.nearest, 1):
            e = near.entry
            use = f"in use by {e.users_str}" if e.in_use else f"last used {e.last_used_str}"
            count = len(near.differences)
            head = f"{rank}. {e.short}  {e.name}  ({count} input{'s differ' if count > 1 else ' differs'}; {use})"
            blocks.append("\n".join([head, *(f"     {d}" for d in near.differences)]))
        text += _section("NEAREST ENTRIES (entry value -> this argv)", "\n".join(blocks))
    text += _section("WHAT TO DO", "\n".join(f"- {line}" for line in x.advice))
    return text


# --- du -------------------------------------------------------------------------------------


def du(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    image = _image(args, environ)
    root = _root(args)
    with volume_errors(root):
        usage = disk_usage(root, compat=image.compat)
    if args.output == "json":
        emit_long_json(usage.to_json())
    else:
        emit(_du_text(usage))
    _tell("warning", usage.warnings)
    _tell("note", image.notes)
    return 0


def _du_text(u: DiskUsage) -> str:
    share = f" ({100 * u.used_bytes / u.total_bytes:.0f}%)" if u.total_bytes else ""
    staged = f"{human_bytes(u.staging_bytes)} in {_n(len(u.attempts), 'attempt')}"
    shared = sum(a.shared_bytes for a in u.attempts)
    if shared:
        staged += f" (+{human_bytes(shared)} hard-linked with entries, counted there)"
    text = _kv(
        [
            ("volume", f"{u.volume}  (statvfs: a CephFS/JuiceFS directory quota shows here)"),
            ("size", human_bytes(u.total_bytes)),
            ("used", human_bytes(u.used_bytes) + share),
            ("free", human_bytes(u.free_bytes)),
            *([("reserved", f"{human_bytes(u.reserved_bytes)} (for root only)")] if u.reserved_bytes else []),
            ("cache", human_bytes(u.cache_bytes)),
            ("  entries", f"{human_bytes(u.entries_bytes)} in {_n(len(u.entries), 'entry')}"),
            ("  staging", staged),
            ("  quarantine", f"{human_bytes(u.quarantine_bytes)} in {_n(len(u.quarantined), 'entry')}"),
            ("  trash", human_bytes(u.trash_bytes)),
        ]
    )
    rows = [{"compiler": c.compiler, "entries": c.entries, "size": c.size_str} for c in u.by_compiler]
    cols = [Column("compiler", "compiler"), Column("entries", "entries", ">"), Column("size", "size", ">")]
    text += _section("BY COMPILER VERSION", table(rows, cols)) if rows else ""
    largest = sorted(u.entries, key=lambda e: e.size_bytes, reverse=True)[:_TOP_ENTRIES]
    if largest:
        rows = [
            {"key": e.short, "model": e.model, "role": e.role, "compiler": e.compiler, "size": e.size_str,
             "last_used": e.last_used_str, "status": e.status}
            for e in largest
        ]  # fmt: skip
        cols = [
            Column(c, c, ">" if c == "size" else "<") for c in ("key", "model", "role", "compiler", "size")
        ]
        cols += [Column("last used", "last_used"), Column("status", "status")]
        more = (
            f" (largest {len(largest)} of {len(u.entries)}; -o json lists all)"
            if len(u.entries) > len(largest)
            else ""
        )
        text += _section(f"BY ENTRY{more}", table(rows, cols))
    rows = [
        {"command": f"cachemgr prune {f.flag}", "items": f.items, "frees": f.bytes_str} for f in u.prunable
    ]
    total = sum(f.bytes for f in u.prunable)
    rows.append({"command": "total", "items": sum(f.items for f in u.prunable), "frees": human_bytes(total)})
    cols = [Column("command", "command"), Column("items", "items", ">"), Column("frees", "frees", ">")]
    return text + _section(
        "PRUNE COULD FREE NOW (never an entry in use; rows do not overlap)", table(rows, cols)
    )


# --- verify ---------------------------------------------------------------------------------


def verify(args: argparse.Namespace, _server_argv: list[str], _environ: Mapping[str, str]) -> int:
    root = _root(args)
    meter = open_meter(what="verify", event="verify_progress", interval=interval_from(args.progress_interval))
    try:
        with volume_errors(root):
            report = verify_entries(root, list(args.keys), fix=args.fix, meter=meter)
    finally:
        meter.close()
    if args.output == "json":
        emit_json(report.to_json())
    else:
        emit(_verify_text(report))
    _tell("warning", (f"{i.name}: {w}" for i in report.items for w in i.warnings))
    error = report.damage_error()
    if error is not None:
        raise error  # after the report: exit 74, with one line saying what to do
    return 0


def _verify_text(r: VerifyReport) -> str:
    rows = [
        {"entry": i.name, "size": i.size_str, "status": i.status, "problems": "; ".join(i.problems) or "-"}
        for i in r.items
    ]
    cols = [Column("entry", "entry"), Column("size", "size", ">"), Column("status", "status")]
    text = table(rows, [*cols, Column("problems", "problems")]) if rows else "no entries to verify"
    counts = {s: sum(1 for i in r.items if i.status == s) for s in ("ok", "damaged", "unreadable", "gone")}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "nothing"
    text += f"\n\nverified {_n(len(r.items), 'entry')} ({human_bytes(r.checked_bytes)}) in {r.seconds:.1f}s: {summary}"
    for item in r.items:
        if item.moved_to:
            users = f" (it was in use by {', '.join(item.users)}: restart them)" if item.users else ""
            text += f"\nmoved aside to quarantine/{item.moved_to.rsplit('/', 1)[-1]}{users}"
    return text


# --- prune ----------------------------------------------------------------------------------


def prune(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    request = _prune_request(args)
    image = _image(args, environ)
    compat = image.require() if request.incompatible else image.compat
    root = _root(args)
    identity = PodIdentity.current(environ)
    with volume_errors(root):
        plan = plan_prune(root, scan(root, compat=compat), request, identity=identity)
    if not plan.items or args.dry_run:
        _render_prune(args, plan, None)
        return 0
    if not args.yes and not _asked_yes(args, plan):
        return 0
    meter = open_meter(what="prune", event="prune_progress", interval=interval_from(args.progress_interval))
    try:
        result = execute(root, plan, stale_after=request.stale_after, identity=identity, meter=meter)
    finally:
        meter.close()
    _render_prune(args, plan, result)
    if result.failed:
        item, why = result.failed[0]
        raise VolumeError(
            f"could not remove {len(result.failed)} of {_n(len(plan.items), 'item')} ({item.name}: {why})",
            remedy="run prune where the compile cache PVC is mounted read-write",
        )
    return 0


def _asked_yes(args: argparse.Namespace, plan: PrunePlan) -> bool:
    """On a terminal, show the plan and ask; without one, never prompt: print it and stop (64)."""
    what = f"{_n(len(plan.items), 'item')}, freeing {plan.bytes_str}"
    if not sys.stdin.isatty():
        _render_prune(args, plan, None)
        raise UsageError(
            f"prune would remove {what}, and asks first, but there is no terminal to ask on",
            remedy="pass --yes to remove them, or --dry-run to only print the plan",
        )
    _render_prune(args, plan, None, to=sys.stderr)
    print(f"remove {what}? [y/N] ", end="", file=sys.stderr, flush=True)
    if sys.stdin.readline().strip().lower() in {"y", "yes"}:
        return True
    print("nothing removed", file=sys.stderr)
    return False


def _prune_request(args: argparse.Namespace) -> PruneRequest:
    try:
        unused = parse_duration(args.unused_for) if args.unused_for is not None else None
    except ValueError as error:
        raise UsageError(
            f"--unused-for {args.unused_for!r}: {error}", remedy="pass e.g. --unused-for 14d"
        ) from None
    try:
        keep = parse_size(args.keep_bytes) if args.keep_bytes is not None else None
    except ValueError as error:
        raise UsageError(f"--keep-bytes: {error}", remedy="pass e.g. --keep-bytes 150Gi") from None
    request = PruneRequest(
        incompatible=args.incompatible,
        unused_for=unused,
        keep_bytes=keep,
        stale_staging=args.stale_staging,
        damaged=args.damaged,
        npu=frozenset(_npu_name(name) for name in args.npu),
    )
    if request.empty:
        raise UsageError(
            "prune needs at least one of --incompatible, --npu, --unused-for, --keep-bytes, --stale-staging, --damaged",
            remedy="say what may go, e.g. 'cachemgr prune --incompatible --dry-run'",
        )
    return request


def _npu_name(name: str) -> str:
    """An NPU type as keys spell it (upper case, as ``key`` resolves it)."""
    clean = name.strip().upper()
    if not clean or len(clean) > 64 or not clean.replace("-", "").replace("_", "").isalnum():
        raise UsageError(f"--npu {name[:32]!r} is not an NPU type", remedy="pass e.g. --npu RBLN-CA12")
    return clean


def _render_prune(
    args: argparse.Namespace, plan: PrunePlan, result: PruneResult | None, to: Any = None
) -> None:
    if args.output == "json" and to is None:  # the question on a terminal shows the table, on stderr
        emit_json(
            {"plan": plan.to_json(), "executed": result is not None, "result": result and result.to_json()}
        )
        return
    rows = [{"kind": i.kind, "name": i.name, "size": i.bytes_str, "reason": i.reason} for i in plan.items]
    cols = [
        Column("kind", "kind"),
        Column("name", "name"),
        Column("size", "size", ">"),
        Column("reason", "reason"),
    ]
    text = (
        (table(rows, cols) + f"\n\nplan: {_n(len(rows), 'item')}, {plan.bytes_str}")
        if rows
        else "nothing to prune"
    )
    text += "".join(f"\nkept: {name}: {why}" for name, why in plan.kept)
    if result is not None:
        text += f"\nremoved {_n(len(result.removed), 'item')}, freed {result.freed_str}"
        text += "".join(f"\nskipped: {i.name}: {why}" for i, why in result.skipped)
        text += "".join(f"\nfailed: {i.name}: {why}" for i, why in result.failed)
    elif rows and args.dry_run:
        text += "\n(dry run: nothing removed)"
    if to is None:
        emit(text)
    else:
        print(text, file=to)


# --- locks ----------------------------------------------------------------------------------


def locks(args: argparse.Namespace, _server_argv: list[str], _environ: Mapping[str, str]) -> int:
    root = _root(args)
    with volume_errors(root):
        found = list_locks(root)
    if args.output == "json":
        emit_json([lock.to_json() for lock in found])
        return 0
    emit(_locks_text(found) if found else "no leases held")
    return 0


def _locks_text(found: list[LockInfo]) -> str:
    rows = [
        {"key": x.key[:12], "entry": x.entry or "?", "holder": x.holder.pod, "node": x.holder.node or "-",
         "held_for": human_duration(x.holder.held_for), "refreshed": f"{human_duration(x.holder.refreshed_age)} ago",
         "lease": human_duration(x.holder.duration), "stale": "STALE" if x.stale else "no"}
        for x in found
    ]  # fmt: skip
    cols = [
        Column(c.replace("_", " "), c)
        for c in ("key", "entry", "holder", "node", "held_for", "refreshed", "lease", "stale")
    ]
    note = "\n\nages by this node's clock from the marker's mtime; a lease is stale when not refreshed for its duration"
    progress = [
        f"{x.key[:12]}  {x.progress.describe()}; reported {human_duration(x.progress.age_s)} ago"
        if x.progress is not None
        else f"{x.key[:12]}  no progress reported yet"
        for x in found
    ]
    return table(rows, cols) + _section("PROGRESS (as the holder reports it)", "\n".join(progress)) + note
