"""``du``, ``verify``, ``prune``: the volume's space and damage, and what may go; parse, call the
library, render.

Results go to stdout (aligned tables, or JSON with ``-o json``); notes and warnings go to
stderr. Only ``verify --fix`` and ``prune`` write to the volume, and nothing prompts without a
terminal.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

from cachemgr.cli.cmd_inspect import image_of, open_cache
from cachemgr.cli.cmd_run import trusted_keys
from cachemgr.cli.render import (
    Column,
    emit,
    emit_json,
    emit_long_json,
    kv,
    plural,
    section,
    table,
    tell,
)
from cachemgr.core.errors import UsageError, VolumeError
from cachemgr.core.units import human_bytes, parse_duration, parse_size
from cachemgr.ops.diskusage import DiskUsage, disk_usage
from cachemgr.ops.inspection import volume_errors
from cachemgr.ops.meter import interval_from, open_meter
from cachemgr.ops.prune import execute
from cachemgr.ops.prune_plan import PrunePlan, PruneRequest, PruneResult, plan_prune
from cachemgr.ops.scan import scan
from cachemgr.ops.verify import VerifyReport
from cachemgr.ops.verify import verify as verify_entries
from cachemgr.volume.identity import PodIdentity

_TOP_ENTRIES = 15  # du lists the largest entries; -o json has them all


# --- du -------------------------------------------------------------------------------------


def du(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    image = image_of(args, environ)
    root = open_cache(args)
    with volume_errors(root):
        usage = disk_usage(root, compat=image.compat)
    if args.output == "json":
        emit_long_json(usage.to_json())
    else:
        emit(_du_text(usage))
    tell("warning", usage.warnings)
    tell("note", image.notes)
    return 0


def _du_text(u: DiskUsage) -> str:
    share = f" ({100 * u.used_bytes / u.total_bytes:.0f}%)" if u.total_bytes else ""
    staged = f"{human_bytes(u.staging_bytes)} in {plural(len(u.attempts), 'attempt')}"
    shared = sum(a.shared_bytes for a in u.attempts)
    if shared:
        staged += f" (+{human_bytes(shared)} hard-linked with entries, counted there)"
    text = kv(
        [
            ("volume", f"{u.volume}  (statvfs: a CephFS/JuiceFS directory quota shows here)"),
            ("size", human_bytes(u.total_bytes)),
            ("used", human_bytes(u.used_bytes) + share),
            ("free", human_bytes(u.free_bytes)),
            *([("reserved", f"{human_bytes(u.reserved_bytes)} (for root only)")] if u.reserved_bytes else []),
            ("cache", human_bytes(u.cache_bytes)),
            ("  entries", f"{human_bytes(u.entries_bytes)} in {plural(len(u.entries), 'entry')}"),
            ("  staging", staged),
            ("  quarantine", f"{human_bytes(u.quarantine_bytes)} in {plural(len(u.quarantined), 'entry')}"),
            ("  trash", human_bytes(u.trash_bytes)),
        ]
    )
    rows = [{"compiler": c.compiler, "entries": c.entries, "size": c.size_str} for c in u.by_compiler]
    cols = [Column("compiler", "compiler"), Column("entries", "entries", ">"), Column("size", "size", ">")]
    text += section("BY COMPILER VERSION", table(rows, cols)) if rows else ""
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
        text += section(f"BY ENTRY{more}", table(rows, cols))
    rows = [
        {"command": f"cachemgr prune {f.flag}", "items": f.items, "frees": f.bytes_str} for f in u.prunable
    ]
    total = sum(f.bytes for f in u.prunable)
    rows.append({"command": "total", "items": sum(f.items for f in u.prunable), "frees": human_bytes(total)})
    cols = [Column("command", "command"), Column("items", "items", ">"), Column("frees", "frees", ">")]
    return text + section(
        "PRUNE COULD FREE NOW (never an entry in use; rows do not overlap)", table(rows, cols)
    )


# --- verify ---------------------------------------------------------------------------------


def verify(args: argparse.Namespace, _server_argv: list[str], _environ: Mapping[str, str]) -> int:
    root = open_cache(args)
    meter = open_meter(what="verify", event="verify_progress", interval=interval_from(args.progress_interval))
    try:
        with volume_errors(root):
            report = verify_entries(
                root, list(args.keys), fix=args.fix, meter=meter, trusted=trusted_keys(args)
            )
    finally:
        meter.close()
    if args.output == "json":
        emit_json(report.to_json())
    else:
        emit(_verify_text(report))
    tell("warning", (f"{i.name}: {w}" for i in report.items for w in i.warnings))
    error = report.damage_error()
    if error is not None:
        raise error  # after the report: exit 74, with one line saying what to do
    return 0


def _verify_text(r: VerifyReport) -> str:
    rows = [
        {
            "entry": i.name,
            "size": i.size_str,
            "signer": i.signer,
            "status": i.status,
            "problems": "; ".join(i.problems) or "-",
        }
        for i in r.items
    ]
    cols = [Column("entry", "entry"), Column("size", "size", ">"), Column("status", "status")]
    if any(i.signer or i.trust for i in r.items):  # the open mode's table stays as it was
        cols.insert(2, Column("signed by", "signer"))
    text = table(rows, [*cols, Column("problems", "problems")]) if rows else "no entries to verify"
    kinds = ("ok", "damaged", "untrusted", "unreadable", "gone")
    counts = {s: sum(1 for i in r.items if i.status == s) for s in kinds}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "nothing"
    text += f"\n\nverified {plural(len(r.items), 'entry')} ({human_bytes(r.checked_bytes)}) in {r.seconds:.1f}s: {summary}"
    for item in r.items:
        if item.moved_to:
            users = f" (it was in use by {', '.join(item.users)}: restart them)" if item.users else ""
            text += f"\nmoved aside to quarantine/{item.moved_to.rsplit('/', 1)[-1]}{users}"
    return text


# --- prune ----------------------------------------------------------------------------------


def prune(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    request = _prune_request(args)
    image = image_of(args, environ)
    compat = image.require() if request.incompatible else image.compat
    root = open_cache(args)
    identity = PodIdentity.current(environ)
    with volume_errors(root):
        plan = plan_prune(root, scan(root, compat=compat), request, identity=identity)
    tell("note", plan.notes)
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
            f"could not remove {len(result.failed)} of {plural(len(plan.items), 'item')} ({item.name}: {why})",
            remedy="run prune where the compile cache PVC is mounted read-write",
        )
    return 0


def _asked_yes(args: argparse.Namespace, plan: PrunePlan) -> bool:
    """On a terminal, show the plan and ask; without one, never prompt: print it and stop (64)."""
    what = f"{plural(len(plan.items), 'item')}, freeing {plan.bytes_str}"
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
        (table(rows, cols) + f"\n\nplan: {plural(len(rows), 'item')}, {plan.bytes_str}")
        if rows
        else "nothing to prune"
    )
    text += "".join(f"\nkept: {name}: {why}" for name, why in plan.kept)
    if result is not None:
        text += f"\nremoved {plural(len(result.removed), 'item')}, freed {result.freed_str}"
        text += "".join(f"\nskipped: {i.name}: {why}" for i, why in result.skipped)
        text += "".join(f"\nfailed: {i.name}: {why}" for i, why in result.failed)
    elif rows and args.dry_run:
        text += "\n(dry run: nothing removed)"
    if to is None:
        emit(text)
    else:
        print(text, file=to)
