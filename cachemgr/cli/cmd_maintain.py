"""``du``, ``verify``, ``prune``: the volume's space and damage, and what may go; parse, call the
library, render.

Results go to stdout in the form ``-o`` asks for (cachemgr.cli.render); notes and warnings go to
stderr. Only ``verify --fix`` and ``prune`` write to the volume, and nothing prompts without a
terminal. ``prune`` prints its plan first, then removes (a bar on a terminal, progress events in a
log), then says what it did.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from cachemgr.cli.cmd_inspect import image_of, open_cache
from cachemgr.cli.cmd_run import trusted_keys
from cachemgr.cli.render import (
    Block,
    Column,
    Pairs,
    Style,
    Table,
    Text,
    emit,
    emit_data,
    layout,
    result,
    tell,
)
from cachemgr.core.errors import UsageError, VolumeError
from cachemgr.core.log import configured_format
from cachemgr.core.printable import safe
from cachemgr.core.units import human_bytes, plural
from cachemgr.ops.diskusage import DiskUsage, disk_usage
from cachemgr.ops.inspection import volume_errors
from cachemgr.ops.meter import interval_from, open_meter
from cachemgr.ops.prune import execute
from cachemgr.ops.prune_plan import PrunePlan, PruneRequest, PruneResult, named_entries, plan_prune
from cachemgr.ops.scan import scan
from cachemgr.ops.verify import VerifyReport
from cachemgr.ops.verify import verify as verify_entries
from cachemgr.volume.identity import PodIdentity

_TOP_ENTRIES = 15  # du lists the largest entries; -o json has them all


# --- du -------------------------------------------------------------------------------------

DU_ENTRY_COLUMNS = (
    Column("key", "key"),
    Column("model", "model", shrink="model", least=10),
    Column("role", "role", wide=True),
    Column("compiler", "compiler"),
    Column("npu", "npu", wide=True),
    Column("size", "size", ">"),
    Column("last used", "last_used"),
    Column("status", "status"),
)


def du(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    image = image_of(args, environ)
    root = open_cache(args)
    with volume_errors(root):
        usage = disk_usage(root, compat=image.compat)
    result(args, kind="DiskUsage", data=usage.to_json, blocks=lambda: _du_blocks(usage), long=True)
    tell("warning", usage.warnings)
    tell("note", image.notes)
    return 0


def _du_blocks(u: DiskUsage) -> Iterator[Block]:
    staged = f"{human_bytes(u.staging_bytes)} in {plural(len(u.attempts), 'attempt')}"
    shared = sum(a.shared_bytes for a in u.attempts)
    if shared:
        staged += f" (+{human_bytes(shared)} hard-linked with a published or quarantined copy, counted there)"
    # The path alone on its line: a long one is never wrapped (its length moves no other word).
    size = human_bytes(u.usable_bytes)
    if u.reserved_bytes:
        size += f" usable by the pod (of {human_bytes(u.total_bytes)}: {human_bytes(u.reserved_bytes)} reserved for root)"
    size += " by statvfs (a CephFS/JuiceFS directory quota shows here)"
    share = f" ({u.used_percent:.0f}%)" if u.used_percent is not None else ""
    yield Pairs(
        [
            ("volume", u.volume),
            ("size", size),
            ("used", human_bytes(u.used_bytes) + share),
            ("free", human_bytes(u.free_bytes)),
            ("cache", human_bytes(u.cache_bytes)),
            ("  entries", f"{human_bytes(u.entries_bytes)} in {plural(len(u.entries), 'entry')}"),
            ("  staging", staged),
            ("  quarantine", f"{human_bytes(u.quarantine_bytes)} in {plural(len(u.quarantined), 'entry')}"),
            ("  trash", human_bytes(u.trash_bytes)),
            (
                "  failures",
                f"{human_bytes(u.failures_bytes)} of failure records for {plural(len(u.failures), 'key')}",
            ),
        ]
    )
    yield from _generation_blocks(u)
    largest = sorted(u.entries, key=lambda e: e.size_bytes, reverse=True)[:_TOP_ENTRIES]
    if largest:
        rows = [
            {"key": e.short, "model": e.model or "?", "role": e.role or "?", "compiler": e.compiler or "?",
             "npu": e.npu or "?", "size": e.size_str, "last_used": e.last_used_str, "status": e.status}
            for e in largest
        ]  # fmt: skip
        more = (
            f" (largest {len(largest)} of {len(u.entries)}; -o json lists all)"
            if len(u.entries) > len(largest)
            else ""
        )
        yield Table(rows, DU_ENTRY_COLUMNS, title=f"BY ENTRY{more}", kind="entry")
    freeable: list[dict[str, Any]] = [
        {"command": f"cachemgr prune {f.flag}", "items": f.items, "frees": f.bytes_str} for f in u.prunable
    ]
    freeable.append(
        {
            "command": "total",
            "items": sum(f.items for f in u.prunable),
            "frees": human_bytes(sum(f.bytes for f in u.prunable)),
        }
    )
    cols = (Column("command", "command"), Column("items", "items", ">"), Column("frees", "frees", ">"))
    yield Table(
        freeable,
        cols,
        title="PRUNE COULD FREE NOW (never an entry in use; rows do not overlap)",
        kind="prune",
    )
    if not u.compiler_known:
        yield Text(
            "'cachemgr prune --incompatible' needs this image's RBLN Compiler version: set "
            "CACHEMGR_COMPILER_VERSION (or --compiler-version) to see what it frees"
        )


def _generation_blocks(u: DiskUsage) -> Iterator[Block]:
    """What each generation holds: during a rollout, the older one until its pods are gone."""
    pairs = []
    for share in u.by_generation:
        held = f"{safe(share.label)}: {plural(len(share.entries), 'entry')}, {human_bytes(share.bytes)}"
        if share.pods:
            held += f", {human_bytes(share.in_use_bytes)} in use by {safe(', '.join(share.pods))}"
        if share.standing == "older":
            held += f"; {' '.join(share.selectors)} frees {human_bytes(share.prunable_bytes)} now"
            held += ", the rest once those pods stop" if share.pods else ""
        elif share.standing == "newer":
            held += "; a newer image's: this image's --incompatible and --superseded never remove it"
        pairs.append((share.standing, held))
    if pairs:
        yield Pairs(pairs, title="BY GENERATION")


# --- verify ---------------------------------------------------------------------------------

VERIFY_COLUMNS = (
    Column("key", "key"),
    Column("model", "model", shrink="model", least=10),
    Column("size", "size", ">"),
    Column("status", "status"),
    Column("entry", "entry", wide=True),
    Column("problems", "problems", wide=True),
)


def verify(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    root = open_cache(args)
    meter = open_meter(
        what="verify", event="verify_progress", interval=interval_from(args.progress_interval, environ)
    )
    try:
        with volume_errors(root):
            report = verify_entries(
                root, list(args.keys), fix=args.fix, meter=meter, trusted=trusted_keys(args)
            )
    finally:
        meter.close()
    result(
        args,
        kind="VerifyReport",
        data=report.to_json,
        blocks=lambda: _verify_blocks(report),
        names=lambda: (f"entry/{i.name}" for i in report.items),
    )
    tell("warning", (f"{i.name}: {w}" for i in report.items for w in i.warnings))
    error = report.damage_error()
    if error is not None:
        raise error  # after the report: exit 74, with one line saying what to do
    return 0


def _verify_blocks(r: VerifyReport) -> Iterator[Block]:
    rows = [
        {"key": i.key[:12] or i.name.rsplit("__", 1)[-1][:12], "model": _model_of(i.name), "size": i.size_str,
         "signer": i.signer or "-", "status": i.status, "entry": i.name, "problems": "; ".join(i.problems) or "-"}
        for i in r.items
    ]  # fmt: skip
    columns: tuple[Column, ...] = VERIFY_COLUMNS
    if any(i.signer or i.trust for i in r.items):  # the open mode's table stays as it was
        columns = (
            *VERIFY_COLUMNS[:3],
            Column("signed by", "signer", shrink="head", least=10),
            *VERIFY_COLUMNS[3:],
        )
    yield Table(rows, columns, empty="no entries to verify", items=lambda: [i.to_json() for i in r.items])
    problems = [
        f"{safe(i.name)}:\n" + "\n".join(f"  - {safe(p)}" for p in i.problems) for i in r.items if i.problems
    ]
    if problems:
        yield Text("PROBLEMS\n" + "\n".join(problems))
    kinds = ("ok", "damaged", "untrusted", "unreadable", "gone")
    counts = {s: sum(1 for i in r.items if i.status == s) for s in kinds}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "nothing"
    text = f"verified {plural(len(r.items), 'entry')} ({human_bytes(r.checked_bytes)}) in {r.seconds:.1f}s: {summary}"
    for item in r.items:
        if item.moved_to:
            users = f" (it was in use by {safe(', '.join(item.users))}: restart them)" if item.users else ""
            text += f"\nmoved aside to quarantine/{safe(item.moved_to.rsplit('/', 1)[-1])}{users}"
    yield Text(text)


def _model_of(name: str) -> str:
    """An entry name's model part (``MiniMaxAI--MiniMax-M2.7__prefill__...``), as a hub id."""
    return name.split("__", 1)[0].replace("--", "/") if "__" in name else name


# --- prune ----------------------------------------------------------------------------------

PLAN_COLUMNS = (
    Column("kind", "kind"),
    Column("key", "key"),
    Column("size", "size", ">"),
    Column("reason", "reason", shrink="cause", least=20),
    Column("generation", "generation", wide=True),
    Column("name", "name", wide=True),
)


def prune(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    request = _prune_request(args)
    image = image_of(args, environ)
    compat = image.require() if request.incompatible else image.compat
    root = open_cache(args)
    identity = PodIdentity.current(environ)
    with volume_errors(root):
        request = replace(request, entries=frozenset(named_entries(root, args.key)))
        plan = plan_prune(root, scan(root, compat=compat), request, identity=identity)
    tell("note", plan.notes)
    if not plan.items or args.dry_run:
        _render_prune(args, plan, None)
        return 0
    if not args.yes and not _asked_yes(args, plan):
        return 0
    if _is_table(args):  # the plan first, then the progress, then what was done
        emit(_plan_text(args, plan))
        sys.stdout.flush()
    meter = open_meter(
        what="prune", event="prune_progress", interval=interval_from(args.progress_interval, environ)
    )
    try:
        done = execute(root, plan, stale_after=request.stale_after, identity=identity, meter=meter)
    finally:
        meter.close()
    if _is_table(args):
        emit(layout([Text(_done_text(plan, done))], Style.of(args)))
    else:
        _render_prune(args, plan, done)
    if done.failed:
        item, why = done.failed[0]
        raise VolumeError(
            f"could not remove {len(done.failed)} of {plural(len(plan.items), 'item')} ({item.name}: {why})",
            remedy="fix what it names and run prune again (a read-only mount: run prune where the compile "
            "cache PVC is mounted read-write)",
        )
    return 0


def _is_table(args: argparse.Namespace) -> bool:
    return Style.of(args).output in ("table", "wide")


def _asked_yes(args: argparse.Namespace, plan: PrunePlan) -> bool:
    """On a terminal, show the plan and ask; without one, never prompt: print it and stop (64)."""
    what = f"{plural(len(plan.items), 'item')}, freeing {plan.bytes_str}"
    json_log = configured_format() == "json"  # a question is no event: JSON stderr never asks
    if json_log or not sys.stdin.isatty():
        _render_prune(args, plan, None)
        where = (
            "its stderr is JSON (-o json), which cannot ask" if json_log else "there is no terminal to ask on"
        )
        raise UsageError(
            f"prune would remove {what}, and asks first, but {where}",
            remedy="pass --yes to remove them, or --dry-run to only print the plan",
        )
    print(_plan_text(args, plan), file=sys.stderr)
    print(f"remove {what}? [y/N] ", end="", file=sys.stderr, flush=True)
    if sys.stdin.readline().strip().lower() in {"y", "yes"}:
        return True
    print("nothing removed", file=sys.stderr)
    return False


def _prune_request(args: argparse.Namespace) -> PruneRequest:
    if args.npu:
        tell(
            "warning", ["--npu is deprecated: it is spelled --for-npu now (the entries for that NPU type go)"]
        )
    request = PruneRequest(
        incompatible=args.incompatible,
        superseded=args.superseded,
        unused_for=args.unused_for,
        keep_bytes=args.keep_bytes,
        stale_staging=args.stale_staging,
        damaged=args.damaged,
        failures=args.failures,
        npu=frozenset(_npu_name(name) for name in [*args.for_npu, *args.npu]),
        entries=frozenset(args.key),  # resolved to entry names once the volume is open
    )
    if args.unused_for is not None and args.unused_for < 0:
        raise UsageError("--unused-for must not be negative", remedy="pass e.g. --unused-for 14d")
    if request.empty:
        raise UsageError(
            "prune needs at least one of --key, --incompatible, --superseded, --for-npu, --unused-for, --keep-bytes, "
            "--stale-staging, --damaged, --failures",
            remedy="say what may go, e.g. 'cachemgr prune --incompatible --dry-run'",
        )
    return request


def _npu_name(name: str) -> str:
    """An NPU type as keys spell it (upper case, as ``key`` resolves it)."""
    clean = name.strip().upper()
    if not clean or len(clean) > 64 or not clean.replace("-", "").replace("_", "").isalnum():
        raise UsageError(
            f"--for-npu {name[:32]!r} is not an NPU type", remedy="pass e.g. --for-npu RBLN-CA12"
        )
    return clean


def _plan_blocks(plan: PrunePlan, *, dry_run: bool = False) -> Iterator[Block]:
    rows = [
        {"kind": i.kind, "key": (i.key or _key_of(i.name))[:12] or "-", "size": i.bytes_str, "reason": i.reason,
         "generation": f"{i.standing}: {i.generation}" if i.standing else "-", "name": i.name}
        for i in plan.items
    ]  # fmt: skip
    if rows:
        yield Table(rows, PLAN_COLUMNS)
    lines = [f"plan: {plural(len(rows), 'item')}, {plan.bytes_str}"] if rows else ["nothing to prune"]
    lines += _plan_generations(plan)
    lines += [f"kept: {safe(name)}: {safe(why)}" for name, why in plan.kept]
    if rows and dry_run:
        lines.append("(dry run: nothing removed)")
    yield Text("\n".join(lines))


def _plan_generations(plan: PrunePlan) -> list[str]:
    """Which generation the planned entries are of, when not all of this image's."""
    groups: dict[tuple[str, str], list[int]] = {}
    for item in plan.items:
        if item.kind == "entry":
            groups.setdefault((item.standing, item.generation), []).append(item.bytes)
    if all(standing == "this image's" for standing, _ in groups):
        return []
    return [
        f"  {safe(standing)} ({safe(label)}): {plural(len(sizes), 'entry')}, {human_bytes(sum(sizes))}"
        for (standing, label), sizes in sorted(
            groups.items(), key=lambda g: (_STANDINGS.index(g[0][0]), g[0][1])
        )
    ]


_STANDINGS = ["this image's", "older", "newer", "other", "unknown"]


def _key_of(name: str) -> str:
    """The key digits in an item's name: an entry's (or a quarantined one's), an attempt's folder."""
    if "__" in name:
        return name.rsplit("__", 1)[-1].split(".", 1)[0]
    return name.split("/", 1)[0] if "/" in name else ""


def _plan_text(args: argparse.Namespace, plan: PrunePlan) -> str:
    return layout(_plan_blocks(plan), Style.of(args))


def _done_text(plan: PrunePlan, done: PruneResult) -> str:
    lines = [f"removed {plural(len(done.removed), 'item')} of {len(plan.items)}, freed {done.freed_str}"]
    lines += [f"skipped: {safe(i.name)}: {safe(why)}" for i, why in done.skipped]
    lines += [f"failed: {safe(i.name)}: {safe(why)}" for i, why in done.failed]
    return "\n".join(lines)


def _render_prune(args: argparse.Namespace, plan: PrunePlan, done: PruneResult | None) -> None:
    style = Style.of(args)
    if style.data:
        emit_data(
            {"plan": plan.to_json(), "executed": done is not None, "result": done and done.to_json()},
            style,
            kind="Prune",
        )
        return
    if style.output == "name":
        names = [f"{i.kind}/{i.name}" for i in plan.items]
        if names:
            emit("\n".join(safe(n) for n in names))
        return
    blocks: list[Block] = list(_plan_blocks(plan, dry_run=args.dry_run and done is None))
    if done is not None:
        blocks.append(Text(_done_text(plan, done)))
    emit(layout(blocks, style))
