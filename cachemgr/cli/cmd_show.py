"""``show``: everything about one key, its status from the check it prints.

Split from :mod:`cachemgr.cli.cmd_inspect` (``ls``, ``explain``, ``locks``), whose helpers it uses.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from typing import Any

from cachemgr.cli.cmd_inspect import attempt_row, image_of, open_cache
from cachemgr.cli.cmd_run import trusted_keys
from cachemgr.cli.render import (
    INPUT_COLUMNS,
    Block,
    Column,
    Pairs,
    Table,
    Text,
    input_notes,
    input_rows,
    result,
    tell,
)
from cachemgr.core.coerce import as_dict
from cachemgr.core.errors import shorten
from cachemgr.core.printable import safe
from cachemgr.core.units import human_age, human_duration, plural
from cachemgr.ops.generation import PARTS
from cachemgr.ops.inspection import EntryDetail, volume_errors
from cachemgr.ops.inspection import show as show_key
from cachemgr.ops.scan import EntryInfo
from cachemgr.volume.serverfail import ServerFailure


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def show(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    image = image_of(args, environ)
    trusted = trusted_keys(args)
    root = open_cache(args)
    with volume_errors(root):
        detail = show_key(root, args.key, compat=image.compat, trusted=trusted)
    result(args, kind="KeyDetail", data=detail.to_json, blocks=lambda: _show_blocks(detail))
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


def _status_line(d: EntryDetail) -> str:
    """The status and the check it comes from, in one line."""
    e = d.entry
    if e is None:
        return "not published"
    if d.problems:
        return _failed_check(d)
    if e.status == "damaged":
        return f"damaged ({e.problem})"
    check = "every file's size and mtime match the manifest ('cachemgr verify' hashes them)"
    judged = _generation_status(e)
    if judged:
        return f"{judged}; {check}"
    if d.server_failed:
        return (
            f"server-failed {len(d.server_failed)}: the server exited before it was ready on this entry "
            f"(below), though {check}"
        )
    return f"ok: {check}"


def _generation_status(e: EntryInfo) -> str:
    """An older or a newer generation's status, with what prunes it (or that nothing here does)."""
    if e.status in {"incompatible", "superseded"}:
        use = "kept while a pod uses it" if e.in_use else "no pod uses it"
        return f"{e.status} ({e.problem}): 'cachemgr prune --{e.status}' removes it ({use})"
    if e.status == "newer":
        return (
            f"newer ({e.problem}): a newer image's entry, never removed by this image's "
            "'prune --incompatible' or '--superseded'"
        )
    return ""


def _generation_text(e: EntryInfo) -> str:
    """Every part of the entry's generation, and how it stands to this image's."""
    if e.generation is None:
        return "unknown: its key.json cannot be read (never judged older; the warning says why)"
    parts = e.generation.label(PARTS)
    stands = {
        "same": "this image's",
        "older": "older than this image's",
        "newer": "newer than this image's: a newer image's",
        "unordered": "neither older nor newer than this image's",
    }.get(e.vs_image or "", "this image's cannot be told")
    by = f"; superseded by {e.superseded_by[:12]}" if e.superseded_by else ""
    return f"{parts} ({stands}{by})"


def _damaged_remedy(d: EntryDetail) -> str:
    """What to do about a damaged entry: the command that moves it aside, as it works here."""
    return (
        f"what to do: 'cachemgr verify --fix {d.digest[:12]}' hashes it and moves it to quarantine/ "
        "(a pod that finds it damaged does the same); the next pod start compiles the key again, "
        "and 'cachemgr prune --damaged --yes' removes the quarantined copy"
    )


def _failed_check(d: EntryDetail) -> str:
    if d.manifest is None:
        # No manifest, no file check: a half-copied entry, or one whose commit record is gone.
        return f"damaged: {d.problems[0].rpartition('/')[2]}; no file of it can be checked"
    failing = len(d.problems)
    return (
        f"damaged: {failing} of the manifest's {plural(_manifest_files(d), 'file')} "
        f"{'fails' if failing == 1 else 'fail'} the size and mtime check (below)"
    )


def _manifest_files(d: EntryDetail) -> int:
    files = (d.manifest or {}).get("files")
    return files if isinstance(files, int) else d.entry.files if d.entry is not None else 0


def _size_text(d: EntryDetail, e: EntryInfo) -> str:
    if e.files or d.manifest is not None:
        return f"{e.size_str} in {plural(e.files or _manifest_files(d), 'file')}"
    return f"{e.size_str} on the volume (how many files it should have, only a manifest says)"


def _created_text(d: EntryDetail, e: EntryInfo) -> str:
    """When and by whom, from the manifest (or the summary of an entry that is not damaged); a
    damaged entry without a manifest says so rather than guess from its folder's mtime."""
    m = d.manifest or {}
    when = _float(m.get("created_at")) or (e.created_at if e.status != "damaged" else None)
    if when is None:
        return f"unknown: its manifest, which records it, cannot be read (the folder last changed {human_age(e.created_at)})"
    by = as_dict(m.get("created_by"))
    pod, node = by.get("pod"), by.get("node")
    who = f" by pod {pod}" if pod else ""
    return f"{human_age(when)}{who}{f' on node {node}' if node else ''}"


def _compiled_text(d: EntryDetail, e: EntryInfo) -> str:
    m = d.manifest or {}
    seconds, strategy = _float(m.get("compile_seconds")), m.get("strategy") or e.strategy
    if seconds is None and not strategy:
        return "unknown: its manifest, which records it, cannot be read"
    return f"{human_duration(seconds)} ({strategy or '?'} strategy)"


def _show_blocks(d: EntryDetail) -> Iterator[Block]:
    e = d.entry
    pairs: list[tuple[str, Any]] = [("key", d.digest), ("entry", d.name or "?"), ("status", _status_line(d))]
    if e is not None:
        pairs += [
            ("path", str(e.path)),
            ("size", _size_text(d, e)),
            ("created", _created_text(d, e)),
            ("compiled in", _compiled_text(d, e)),
            *_origin_pairs(e.origin),
            ("generation", _generation_text(e)),
            ("last used", e.last_used_str),
            ("in use by", ", ".join(f"{u.pod} (node {u.node or '?'}, since {human_age(u.since)})" for u in e.users) or "no pod"),
            ("starts", _starts_text(e)),
            *_signature_rows(d),
        ]  # fmt: skip
        if e.silent_users:
            pods = ", ".join(f"{u.pod} (node {u.node or '?'})" for u in e.silent_users)
            pairs.append(
                (
                    "silent users",
                    f"{pods}: dead, or their node's clock differs; prune watches them for a beat",
                )
            )
    yield Pairs(pairs)
    if d.problems and d.manifest is not None:
        yield Text(
            "FILES CHECK (size and mtime against the manifest)\n"
            + "\n".join(f"- {safe(p)}" for p in d.problems)
        )
    if d.status == "damaged":
        yield Text(_damaged_remedy(d))
    if d.inputs:
        yield Table(
            input_rows(d.inputs, as_dict(d.key_doc.get("sources"))),
            INPUT_COLUMNS,
            title="KEY INPUTS",
            kind="input",
        )
        notes = [safe(n) for n in input_notes(as_dict(d.key_doc.get("sources")))]
        dropped = d.key_doc.get("dropped_runtime_flags")
        if dropped and isinstance(dropped, list):
            notes.append(f"left out as runtime-only: {safe(', '.join('--' + str(f) for f in dropped))}")
        if notes:
            yield Text("\n".join(notes))
    if d.holder is not None:
        h = d.holder
        refreshed = f"refreshed {human_duration(h.refreshed_age)} ago, lease {human_duration(h.duration)}"
        yield Text(f"LEASE\nheld by {safe(h.describe())}; {refreshed}: {_lease_state(h.state)}")
    if d.attempts:
        yield Table(
            [attempt_row(a) for a in d.attempts], ATTEMPT_COLUMNS, title="COMPILE ATTEMPTS", kind="attempt"
        )
    if d.history is not None:
        yield Text(
            f"FAILED COMPILES ({d.history.count})\n" + "\n".join(_failure_text(r) for r in d.history.records)
        )
    if d.server_failed or d.server_failed_before:
        yield Text(_server_failed_text(d))
    if d.recompiled:
        yield Text(
            f"RECOMPILED ON HIT ({len(d.recompiled)}): the server compiled anyway; the key lacks an input it hashes\n"
            + "\n".join(_recompiled_text(r) for r in d.recompiled)
        )


ATTEMPT_COLUMNS = (
    Column("pod", "pod", shrink="tail", least=16),
    Column("node", "node", shrink="tail", least=8),
    Column("size", "size", ">"),
    Column("started", "started"),
    Column("status", "status"),
    Column("detail", "detail", shrink="head", least=16),
)


def _starts_text(e: EntryInfo) -> str:
    if not e.starts:
        return "none recorded"
    return ", ".join(f"{count} {kind}" for kind, count in sorted(e.starts.items()))


def _lease_state(state: str) -> str:
    return {
        "dead": "DEAD (its process is gone: a pod on this host takes it over at once)",
        "expired": "STALE (not refreshed for its duration: the next pod to start takes it over)",
    }.get(state, "live")


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
    shown = [safe(p) for p in paths] if isinstance(paths, list) else []
    head = (
        f"{human_age(_float(record.get('time')))}  pod {safe(record.get('pod', '?'))} on node "
        f"{safe(record.get('node') or '?')}: {_new_files(record.get('count'), len(shown))}"
    )
    return "\n".join([head, *(f"    {p}" for p in shown)])


def _new_files(count: Any, shown: int) -> str:
    """``1 new file``, ``3 new files``: the record's count where it is a number, else the paths it lists."""
    number = count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else shown
    return plural(number, "new file")


def _server_failed_text(d: EntryDetail) -> str:
    """``show``: each pre-ready server exit on a hit, with its last lines, and what removes the entry."""
    lines = []
    if d.server_failed:
        lines.append(
            f"SERVER EXITED BEFORE READY ({len(d.server_failed)}): if the server cannot load this entry, "
            f"'cachemgr prune --key {d.digest[:12]} --yes' removes it and the next start compiles afresh"
        )
        lines += [_server_failure_text(f) for f in d.server_failed]
    if d.server_failed_before:
        lines.append(
            f"EARLIER COPIES' SERVER EXITS ({len(d.server_failed_before)}): set aside or removed since"
        )
        lines += [_server_failure_text(f) for f in d.server_failed_before]
    return "\n".join(lines)


def _server_failure_text(f: ServerFailure) -> str:
    compiled = ", on the copy it had just compiled" if f.compiled_here else ""
    head = f"{human_age(f.time)}  pod {safe(f.pod or '?')} on node {safe(f.node or '?')}: {f.how}{compiled}"
    return "\n".join([head, *(f"    | {safe(line)}" for line in f.last_lines)])


def _failure_text(record: Mapping[str, Any]) -> str:
    status = record.get("exit_status")
    codes = [f"exit {safe(record.get('exit_code', '?'))}"]
    if status is not None:
        codes.append(f"compiler status {safe(status)}")
    codes.append(f"after {human_duration(_float(record.get('elapsed_s')))}")
    head = (
        f"{human_age(_float(record.get('time')))}  pod {safe(record.get('pod', '?'))} on node "
        f"{safe(record.get('node') or '?')}: {safe(record.get('reason', '?'))} ({', '.join(codes)})"
    )
    tail = record.get("output_tail")
    tail = [str(line) for line in tail] if isinstance(tail, list) else []
    lines = [head, f"  {safe(record.get('message', ''))}"]
    raised = record.get("raised")
    # At most what a pod records (runtime.output.RAISED_KEPT, and the last): the record is the volume's.
    raised = (
        [str(r) for r in raised[:4] if not any(str(r) in t for t in tail)] if isinstance(raised, list) else []
    )
    if raised:
        lines.append("  the server raised:")
        lines += [f"    ! {safe(shorten(line, 300))}" for line in raised]
    if tail:
        lines.append("  last output:")
        lines += [f"    | {safe(line)}" for line in tail]
    return "\n".join(lines)
