"""``ls``, ``show``, ``explain``, ``locks``: what is on the volume and why; parse, call the library, render.

Results go to stdout (aligned tables, or JSON with ``-o json``); notes and warnings go to
stderr, so ``-o json`` output always parses. Nothing here writes to the volume; ``du``,
``verify`` and ``prune`` are :mod:`cachemgr.cli.cmd_maintain`.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from cachemgr.cli.cmd_run import cache_root, key_request, trusted_keys
from cachemgr.cli.render import (
    Column,
    emit,
    emit_json,
    emit_long_json,
    entry_row,
    flatten,
    kv,
    plural,
    section,
    table,
    tell,
)
from cachemgr.core.coerce import as_dict
from cachemgr.core.errors import ExitCode
from cachemgr.core.units import human_age, human_bytes, human_duration
from cachemgr.key.cachekey import compute_key
from cachemgr.key.describe import keyed_pairs
from cachemgr.ops.explain import Explanation
from cachemgr.ops.explain import explain as explain_key
from cachemgr.ops.image import ImageInfo, resolve_image
from cachemgr.ops.inspection import EntryDetail, Listing, list_cache, volume_errors
from cachemgr.ops.inspection import show as show_key
from cachemgr.ops.locks import LockInfo, list_locks
from cachemgr.ops.scan import EntryInfo
from cachemgr.volume.layout import CacheRoot, open_root


def open_cache(args: argparse.Namespace) -> CacheRoot:
    return open_root(cache_root(args), create=False)  # inspection never creates the layout


def image_of(args: argparse.Namespace, environ: Mapping[str, str]) -> ImageInfo:
    return resolve_image(compiler_version=args.compiler_version, npu_type=args.npu_type, environ=environ)


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
    image = image_of(args, environ)
    trusted = trusted_keys(args)
    root = open_cache(args)
    with volume_errors(root):
        listing = list_cache(root, compat=image.compat, trusted=trusted)
    if args.output == "json":
        emit_long_json(listing.to_json())
    else:
        emit(_ls_text(listing, image, args.cache_root))
    tell("warning", listing.warnings)
    tell("note", image.notes)
    return 0


def _ls_text(listing: Listing, image: ImageInfo, root: str) -> str:
    rows = [
        entry_row(
            key=e.short, model=e.model, role=e.role, compiler=e.compiler, npu=e.npu, size=e.size_str,
            created=e.created_str, last_used=e.last_used_str,
            in_use=plural(len(e.users), "pod") if e.in_use else "no",
            status=_status(e), signer=e.signer,
        )
        for e in listing.entries
    ]  # fmt: skip
    columns = _LS
    if any(e.signer or e.trust for e in listing.entries):  # the open mode's table stays as it was
        columns = [*_LS[:-1], Column("signed by", "signer"), _LS[-1]]
    text = table(rows, columns) if rows else f"no entries under {root}"
    total = human_bytes(sum(e.size_bytes for e in listing.entries))
    text += f"\n\n{plural(len(rows), 'entry')}, {total}"
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
    untrusted = [e for e in listing.entries if e.trust not in (None, "trusted")]
    if untrusted:
        text += (
            f"; {len(untrusted)} untrusted: pods that trust these keys never load them "
            f"('cachemgr show KEY' says why; a publisher with the signing key replaces them)"
        )
    drifted = [e.short for e in listing.entries if e.recompiled_on_hit]
    if drifted:
        text += (
            f"\nRECOMPILED ON HIT: the server compiled anyway after loading {', '.join(drifted)}: the key lacks an "
            "input the server hashes ('cachemgr show KEY' names the new files)"
        )
    return text + _side_sections(listing)


def _status(e: EntryInfo) -> str:
    """ok / damaged / incompatible, or untrusted where trusted keys were given and none signed it."""
    status = "untrusted" if e.trust not in (None, "trusted") and e.status == "ok" else e.status
    return status if e.origin_kind == "local" else f"{status} ({e.origin_kind})"


def _other_npus(entries: tuple[EntryInfo, ...], image: ImageInfo) -> str:
    """Entries for another NPU type are another hardware's pods', not dead: say so, and how to name them."""
    others = sorted({e.npu for e in entries if e.status == "ok" and image.compat.other_npu(e.npu)})
    if not others:
        return ""
    count = sum(1 for e in entries if e.npu in others and e.status == "ok")
    return (
        f"; {plural(count, 'entry')} for other NPU types ({', '.join(others)}; this pod has {image.compat.npu}): "
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
        text += section(
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
        text += section(
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
        text += section(
            "QUARANTINE ('cachemgr prune --damaged' removes)", table(rows, [Column(c, c) for c in cols])
        )
    return text


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


# --- show -----------------------------------------------------------------------------------


def show(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    image = image_of(args, environ)
    trusted = trusted_keys(args)
    root = open_cache(args)
    with volume_errors(root):
        detail = show_key(root, args.key, compat=image.compat, trusted=trusted)
    if args.output == "json":
        emit_json(detail.to_json())
    else:
        emit(_show_text(detail))
    tell("warning", detail.warnings)
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
            *_signature_rows(d),
        ]
    text = kv(pairs)
    inputs = d.inputs
    if inputs:
        sources = as_dict(d.key_doc.get("sources"))
        rows = [
            {"input": name, "value": value, "source": sources.get(name.split(".")[0], "")}
            for top, value_ in inputs.items()
            for name, value in flatten(top, value_)
        ]
        text += section(
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
        text += section("LEASE", f"held by {h.describe()}; {refreshed}: {state}")
    for a in d.attempts:
        text += section(
            "ATTEMPT", f"{a.name}: pod {a.pod} node {a.node or '?'}, {a.size_str}, {a.status}: {a.detail}"
        )
    if d.history is not None:
        text += section(
            f"FAILED COMPILES ({d.history.count})", "\n".join(_failure_text(r) for r in d.history.records)
        )
    if d.recompiled:
        text += section(
            f"RECOMPILED ON HIT ({len(d.recompiled)}): the server compiled anyway; the key lacks an input it hashes",
            "\n".join(_recompiled_text(r) for r in d.recompiled),
        )
    return text


def _signature_rows(d: EntryDetail) -> list[tuple[str, Any]]:
    """``show``: who signed the entry, and whether a trusted key did (the bytes: 'cachemgr verify')."""
    e, sig = d.entry, d.signature
    if e is None or (sig is None and e.trust is None):
        return []  # the open mode's entries, shown as they always were
    if sig is None:
        signed = "unsigned"
    elif "problem" in sig:
        signed = f"signature.json does not parse ({sig['problem']})"
    else:
        by = as_dict(sig.get("built_by"))
        signed = (
            f"key {sig.get('key')}, {human_age(_float(sig.get('signed_at')))}, by pod {by.get('pod', '?')} "
            f"on node {by.get('node') or '?'}"
        )
    if e.trust is None:
        trust = "not checked: pass --trusted-keys (or set CACHEMGR_TRUSTED_KEYS)"
    elif e.trust == "trusted":
        trust = "trusted: a trusted key signed it for this key ('cachemgr verify' checks the bytes)"
    else:
        trust = e.trust
    return [("signed", signed), ("trust", trust)]


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
    trusted = trusted_keys(args)
    root = open_cache(args)
    with volume_errors(root):
        result = explain_key(root, key, trusted=trusted)
    if args.output == "json":
        emit_json(result.to_json())
    else:
        emit(_explain_text(result))
    tell("warning", [*key.notes, *result.warnings])
    # Like `diff` and `terraform plan -detailed-exitcode`: 0 a hit, 1 not (docs/reference.md).
    return int(ExitCode.OK if result.result == "hit" else ExitCode.NOT_A_HIT)


def _explain_text(x: Explanation) -> str:
    pairs: list[tuple[str, Any]] = [
        ("result", x.result.upper()),
        ("key", x.key.digest),
        ("entry", x.key.entry_name),
    ]
    pairs += keyed_pairs(x.key)
    if x.entry is not None and x.trusting:
        pairs.append(("trust", f"trusted: signed by {x.signer}" if x.result == "hit" else x.untrusted or "-"))
    elif x.entry is not None and x.signer:
        pairs.append(("signed by", f"{x.signer} (not checked: no --trusted-keys)"))
    text = kv(pairs)
    if x.nearest:
        blocks = []
        for rank, near in enumerate(x.nearest, 1):
            e = near.entry
            use = f"in use by {e.users_str}" if e.in_use else f"last used {e.last_used_str}"
            count = len(near.differences)
            head = f"{rank}. {e.short}  {e.name}  ({count} input{'s differ' if count > 1 else ' differs'}; {use})"
            blocks.append("\n".join([head, *(f"     {d}" for d in near.differences)]))
        text += section("NEAREST ENTRIES (entry value -> this argv)", "\n".join(blocks))
    text += section("WHAT TO DO", "\n".join(f"- {line}" for line in x.advice))
    return text


# --- locks ----------------------------------------------------------------------------------


def locks(args: argparse.Namespace, _server_argv: list[str], _environ: Mapping[str, str]) -> int:
    root = open_cache(args)
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
    return table(rows, cols) + section("PROGRESS (as the holder reports it)", "\n".join(progress)) + note
