"""``ls``, ``explain``, ``locks``: what is on the volume and why; parse, call the library, render
(``show`` is :mod:`cachemgr.cli.cmd_show`, ``stats`` :mod:`cachemgr.cli.cmd_stats`).

Results go to stdout in the form ``-o`` asks for (cachemgr.cli.render); notes and warnings go to
stderr, so ``-o json`` output always parses. Every word a table or a line shows that comes from
the volume goes through ``render.safe``. Nothing here writes to the volume; ``du``, ``verify``
and ``prune`` are :mod:`cachemgr.cli.cmd_maintain`.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from typing import Any

from cachemgr.cli.cmd_run import cache_root, key_request, trusted_keys
from cachemgr.cli.render import (
    Block,
    Column,
    Pairs,
    Table,
    Text,
    result,
    tell,
)
from cachemgr.core.errors import ExitCode
from cachemgr.core.printable import safe
from cachemgr.core.units import human_age, human_bytes, human_duration, plural
from cachemgr.key.cachekey import compute_key
from cachemgr.key.describe import keyed_pairs
from cachemgr.key.vllm_rbln import VERSION_ENV
from cachemgr.ops.attempts import LEGEND, Attempt, FailureHistory, Quarantined
from cachemgr.ops.explain import Difference, Explanation
from cachemgr.ops.explain import explain as explain_key
from cachemgr.ops.generation import PART_NAMES, Generation
from cachemgr.ops.image import ImageInfo, resolve_image
from cachemgr.ops.inspection import Listing, list_cache, volume_errors
from cachemgr.ops.locks import LockInfo, list_locks
from cachemgr.ops.rollout import image_label, shares
from cachemgr.ops.scan import EntryInfo
from cachemgr.volume.layout import MARKER, CacheRoot, open_root


def open_cache(args: argparse.Namespace) -> CacheRoot:
    root = open_root(cache_root(args), create=False)  # inspection never creates the layout
    if not (root.path / MARKER).is_file():
        # "0 entries" of a directory no pod used reads as an empty cache: say which it may be.
        tell(
            "note",
            [
                f"{root.path} has no {MARKER}: no 'cachemgr run' or 'warm' has used it yet. If pods of "
                "this role have, it is not their compile cache volume: set CACHEMGR_CACHE_ROOT (or "
                "--cache-root) to where the PVC is mounted (the chart mounts it at /var/cache/cachemgr)"
            ],
        )
    return root


def image_of(args: argparse.Namespace, environ: Mapping[str, str]) -> ImageInfo:
    return resolve_image(compiler_version=args.compiler_version, npu_type=args.npu_type, environ=environ)


# --- ls -------------------------------------------------------------------------------------

# The essential columns fit 80 (a model shortened to its name); -o wide adds the rest.
LS_COLUMNS = (
    Column("key", "key"),
    Column("model", "model", shrink="model", least=10),
    Column("role", "role", wide=True),
    Column("compiler", "compiler"),
    Column("npu", "npu"),
    Column("size", "size", ">"),
    Column("created", "created", wide=True),
    Column("last used", "last_used", wide=True),
    Column("in use", "in_use"),
    Column("hits", "hits", ">", wide=True),
    Column("status", "status"),
    Column("generation", "generation", wide=True),
    Column("origin", "origin", wide=True),
    Column("entry", "entry", wide=True),
)
STAGING_COLUMNS = (
    Column("key", "key"),
    Column("model", "model", wide=True),
    Column("role", "role", wide=True),
    Column("pod", "pod", shrink="tail", least=16),
    Column("node", "node", shrink="tail", least=8),
    Column("size", "size", ">"),
    Column("started", "started"),
    Column("status", "status"),
    Column("detail", "detail", wide=True),
)
FAILED_COLUMNS = (
    Column("key", "key"),
    Column("model", "model", shrink="model", least=10),
    Column("role", "role", wide=True),
    Column("compiler", "compiler", wide=True),
    Column("npu", "npu", wide=True),
    Column("failures", "failures", ">"),
    Column("last", "last"),
    Column("pod", "pod", wide=True),
    Column("reason", "reason", shrink="head", least=12),
    Column("now", "now"),
)
QUARANTINE_COLUMNS = (
    Column("key", "key"),
    Column("size", "size", ">"),
    Column("moved", "moved"),
    Column("reason", "reason", shrink="cause", least=20),
    Column("name", "name", wide=True),
)


def ls(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    image = image_of(args, environ)
    trusted = trusted_keys(args)
    root = open_cache(args)
    with volume_errors(root):
        listing = list_cache(root, compat=image.compat, trusted=trusted)
    result(
        args,
        kind="EntryList",
        data=listing.to_json,
        blocks=lambda: _ls_blocks(listing, image, str(root.path)),
        names=lambda: _ls_names(listing),
        long=True,
    )
    tell("warning", listing.warnings)
    tell("note", image.notes)
    return 0


def _ls_names(listing: Listing) -> Iterator[str]:
    yield from (f"entry/{e.name}" for e in listing.entries)
    yield from (f"staging/{a.key}/{a.name}" for a in listing.attempts)
    yield from (f"failure/{f.key}" for f in listing.failures)
    yield from (f"quarantine/{q.name}" for q in listing.quarantined)


def _ls_blocks(listing: Listing, image: ImageInfo, root: str) -> Iterator[Block]:
    named = generation_names(listing.entries, image.compat.generation)
    rows = [{**_entry_row(e), "generation": named.get(e.name, "?")} for e in listing.entries]
    columns: tuple[Column, ...] = LS_COLUMNS
    if any(e.signer or e.trust for e in listing.entries):  # the open mode's table stays as it was
        columns = (*LS_COLUMNS[:-4], Column("signed by", "signer", shrink="head", least=10), *LS_COLUMNS[-4:])
    yield Table(
        rows,
        columns,
        empty=f"no entries under {safe(root)}",
        kind="entry",
        items=lambda: [e.to_json() for e in listing.entries],
    )
    yield Text(_ls_summary(listing, image))
    if listing.attempts:
        statuses = list(dict.fromkeys(a.status for a in listing.attempts))
        legend = "\n".join(f"{status}: {LEGEND[status]}" for status in statuses)
        yield Table(
            [attempt_row(a) for a in listing.attempts],
            STAGING_COLUMNS,
            title="STAGING (compile attempts)",
            kind="staging",
            items=lambda: [a.to_json() for a in listing.attempts],
        )
        yield Text(legend)
    if listing.failures:
        published = {e.key for e in listing.entries}
        yield Table(
            [_failure_row(f, published) for f in listing.failures],
            FAILED_COLUMNS,
            title="FAILED COMPILES ('cachemgr show KEY' has the output)",
            kind="failure",
            items=lambda: [f.to_json() for f in listing.failures],
        )
    if listing.quarantined:
        yield Table(
            [_quarantine_row(q) for q in listing.quarantined],
            QUARANTINE_COLUMNS,
            title="QUARANTINE ('cachemgr prune --damaged' removes them)",
            kind="quarantine",
            items=lambda: [q.to_json() for q in listing.quarantined],
        )


def _entry_row(e: EntryInfo) -> dict[str, Any]:
    return {
        "key": e.short,
        "model": e.model or "?",
        "role": e.role or "?",
        "compiler": e.compiler or "?",
        "npu": e.npu or "?",
        "size": e.size_str,
        "created": e.created_str,
        "last_used": e.last_used_str,
        "in_use": plural(len(e.users), "pod") if e.in_use else "no",
        "hits": e.hits,
        "status": _status(e) + ("*" if e.recompiled_on_hit else ""),
        "signer": e.signer or "-",
        "origin": e.origin_kind,
        "entry": e.name,
    }


def _ls_summary(listing: Listing, image: ImageInfo) -> str:
    total = human_bytes(sum(e.size_bytes for e in listing.entries))
    lines = [f"{plural(len(listing.entries), 'entry')}, {total}"]
    if listing.entries:
        # A size check of every file would cost more than the listing itself, many times over on a
        # network filesystem (bench/bench_inspect.py; docs/benchmarks.md): ls says what it read.
        lines.append(
            "STATUS is what each entry's summary and manifest say: ls reads none of their files "
            "('cachemgr show KEY' checks their sizes, 'cachemgr verify' hashes them)"
        )
    lines += generation_lines(listing.entries, image.compat.generation)
    lines += _other_npus(listing.entries, image)
    if listing.count("damaged"):
        lines.append(f"{listing.count('damaged')} damaged: 'cachemgr verify --fix' moves them aside")
    untrusted = [e for e in listing.entries if e.trust not in (None, "trusted")]
    if untrusted:
        lines.append(
            f"{len(untrusted)} untrusted: pods that trust these keys never load them "
            "('cachemgr show KEY' says why; a publisher with the signing key replaces them)"
        )
    drifted = [e.short for e in listing.entries if e.recompiled_on_hit]
    if drifted:
        lines.append(
            f"* RECOMPILED ON HIT: the server compiled anyway after loading {', '.join(drifted)}: the key lacks "
            "an input the server hashes ('cachemgr show KEY' names the new files)"
        )
    failed = [e for e in listing.entries if e.server_failed]
    if failed:
        lines.append(
            f"{plural(len(failed), 'entry')} whose server exited before it was ready ({', '.join(e.short for e in failed)}): "
            "'cachemgr show KEY' has its last lines; 'cachemgr prune --key KEY --yes' removes the entry "
            "(the next start compiles it again)"
        )
    silent = [e for e in listing.entries if e.silent_users]
    if silent:
        lines.append(
            f"{plural(sum(len(e.silent_users) for e in silent), 'use record')} silent by this node's clock "
            "(dead pods, or a node whose clock differs): not counted as in use; prune watches them for a beat"
        )
    return "\n".join(lines)


def generation_names(entries: tuple[EntryInfo, ...], image: Generation) -> dict[str, str]:
    """Each entry's generation, named as the others' and this image's are told apart."""
    return {e.name: s.label for s in shares(entries, image) for e in s.entries}


def generation_lines(entries: tuple[EntryInfo, ...], image: Generation) -> list[str]:
    """Which generation holds what, when there is more than this image's: the older one's entries
    and what prunes them (or who still uses them), a newer image's that this one never prunes."""
    found = shares(entries, image)
    if all(s.standing == "this image" for s in found):
        return []
    lines = []
    for s in found:
        held = f"{plural(len(s.entries), 'entry')}, {human_bytes(s.bytes)}"
        use = f"{human_bytes(s.in_use_bytes)} in use by {plural(len(s.pods), 'pod')}" if s.pods else "unused"
        if s.standing == "this image":
            lines.append(f"this image: {safe(s.label)} ({held}, {use})")
        elif s.standing == "older":
            going = f"; {use}, kept until those pods stop" if s.pods else ""
            lines.append(
                f"older: {safe(s.label)} ({held}, {' and '.join(x.lstrip('-') for x in s.selectors)}): "
                f"'cachemgr prune {' '.join(s.selectors)}' frees {human_bytes(s.prunable_bytes)} of them now{going}"
            )
        elif s.standing == "newer":
            lines.append(
                f"newer: {safe(s.label)} ({held}, {use}): a newer image's, never removed by this image's "
                "'prune --incompatible' or '--superseded'"
            )
        elif s.standing == "other":
            lines.append(
                f"other: {safe(s.label)} ({held}, {use}): neither older nor newer than this image's, so kept "
                "by 'prune --incompatible' and '--superseded'"
            )
        elif s.generation is not None:
            lines.append(
                f"{safe(s.label)} ({held}, {use}): how it stands to this image's cannot be told here "
                f"({_unknown_parts(s.generation, image)}), so it is judged only against the newer entries of its model"
            )
        else:
            lines.append(f"unknown generation ({held}, {use}): never judged older (the warnings say why)")
    if image.get("compiler") and not any(s.standing == "this image" for s in found):
        known = all(image.get(p) for e in entries if e.generation for p, _ in e.generation.parts)
        what = "no entry of it yet" if known else "its server's versions cannot be told here"
        lines.insert(0, f"this image: {safe(image_label(image, entries))} ({what})")
    return lines


def _unknown_parts(entry: Generation, image: Generation) -> str:
    """What this shell does not know of its image, and the variables that tell it."""
    missing = [p for p, _ in entry.parts if image.get(p) is None]
    names = {"compiler": "CACHEMGR_COMPILER_VERSION", **{p: env for p, (_, env) in VERSION_ENV.items()}}
    return (
        f"this image's {', '.join(PART_NAMES[p] for p in missing)} unknown: set "
        f"{', '.join(names[p] for p in missing if p in names)}, or run it in a pod of the image"
    )


def _status(e: EntryInfo) -> str:
    """published / damaged / incompatible, or untrusted where trusted keys were given and none signed it;
    ``server-failed N`` for a published entry on which servers exited before ready N times."""
    if e.trust not in (None, "trusted") and e.status == "published":
        return "untrusted"
    if e.server_failed and e.status == "published":
        return f"server-failed {e.server_failed}"
    return e.status


def _other_npus(entries: tuple[EntryInfo, ...], image: ImageInfo) -> list[str]:
    """Entries for another NPU type are another hardware's pods', not dead: say so, and how to name them."""
    others = sorted({e.npu for e in entries if e.status == "published" and image.compat.other_npu(e.npu)})
    if not others:
        return []
    count = sum(1 for e in entries if e.npu in others and e.status == "published")
    return [
        f"{plural(count, 'entry')} for other NPU types ({safe(', '.join(others))}; this pod has "
        f"{safe(image.compat.npu)}): pods on that hardware may use them, so --incompatible keeps them; "
        f"'cachemgr prune --for-npu {safe(others[0])}' removes them once that hardware is gone"
    ]


def attempt_row(a: Attempt) -> dict[str, Any]:
    return {
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


def _failure_row(f: FailureHistory, published: set[str]) -> dict[str, Any]:
    row = f.to_json()
    return {
        **{c: row.get(c) or "?" for c in ("model", "role", "compiler", "npu", "pod", "reason")},
        "key": f.key[:12],
        "failures": f.count,
        "last": human_age(row["created_at"]),
        "now": "published" if f.key in published else "not published",
    }


def _quarantine_row(q: Quarantined) -> dict[str, Any]:
    entry = q.name.rsplit(".", 2)[0]
    return {
        "key": entry.rsplit("__", 1)[-1][:12],
        "size": human_bytes(q.size_bytes),
        "moved": human_age(q.moved_at),
        "reason": q.reason or "?",
        "name": q.name,
    }


# --- explain --------------------------------------------------------------------------------


def explain(args: argparse.Namespace, server_argv: list[str], environ: Mapping[str, str]) -> int:
    key = compute_key(key_request(args, server_argv, environ))
    trusted = trusted_keys(args)
    root = open_cache(args)
    with volume_errors(root):
        found = explain_key(root, key, trusted=trusted)
    result(args, kind="Explanation", data=found.to_json, blocks=lambda: _explain_blocks(found))
    tell("warning", [*key.notes, *found.warnings])
    # Like `diff` and `terraform plan -detailed-exitcode`: 0 a hit, 1 not (docs/reference.md).
    return int(ExitCode.OK if found.result == "hit" else ExitCode.NOT_A_HIT)


def _by_rules(difference: Difference) -> str:
    """Another release's rules key some inputs otherwise (``model_impl auto -> (unset)`` under
    strict rules): said where the rules differ, so no one changes a flag for what the rules did."""
    return " (and the inputs below may differ by the rules alone)" if difference.field == "rules" else ""


def _explain_blocks(x: Explanation) -> Iterator[Block]:
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
    yield Pairs(pairs)
    if x.nearest:
        blocks = []
        for rank, near in enumerate(x.nearest, 1):
            e = near.entry
            use = f"in use by {e.users_str}" if e.in_use else f"last used {e.last_used_str}"
            if e.generation is not None and e.status in {"newer", "incompatible", "superseded"}:
                use += f"; {e.status}: {e.generation.label()}"
            count = len(near.differences)
            head = f"{rank}. {e.short}  ({count} input{'s differ' if count > 1 else ' differs'}; {use})"
            lines = [
                safe(head),
                f"   {safe(e.name)}",
                *(f"     {safe(d)}{_by_rules(d)}" for d in near.differences),
            ]
            blocks.append("\n".join(lines))
        yield Text("NEAREST ENTRIES (entry value -> this argv)\n" + "\n".join(blocks))
    yield Text("WHAT TO DO\n" + "\n".join(f"- {safe(line)}" for line in x.advice))


# --- locks ----------------------------------------------------------------------------------

LOCK_COLUMNS = (
    Column("key", "key"),
    Column("holder", "holder", shrink="tail", least=16),
    Column("node", "node", shrink="tail", least=8),
    Column("held for", "held_for"),
    Column("refreshed", "refreshed"),
    Column("lease", "lease", wide=True),
    Column("state", "state"),
    Column("entry", "entry", wide=True),
    Column("pid", "pid", ">", wide=True),
    Column("host", "host", wide=True),
)


def locks(args: argparse.Namespace, _server_argv: list[str], _environ: Mapping[str, str]) -> int:
    root = open_cache(args)
    with volume_errors(root):
        found = list_locks(root)
    result(
        args,
        kind="LeaseList",
        data=lambda: [lock.to_json() for lock in found],
        blocks=lambda: _locks_blocks(found),
        names=lambda: (f"lease/{x.key}" for x in found),
    )
    return 0


def _locks_blocks(found: list[LockInfo]) -> Iterator[Block]:
    rows = [
        {"key": x.key[:12], "entry": x.entry or "-", "holder": x.holder.pod, "node": x.holder.node or "-",
         "held_for": human_duration(x.holder.held_for), "refreshed": f"{human_duration(x.holder.refreshed_age)} ago",
         "lease": human_duration(x.holder.duration), "state": x.state, "pid": x.holder.pid, "host": x.holder.host}
        for x in found
    ]  # fmt: skip
    yield Table(rows, LOCK_COLUMNS, empty="no leases held", items=lambda: [x.to_json() for x in found])
    if not found:
        return
    progress = [
        f"{x.key[:12]}  {safe(x.progress.describe())}; reported {human_duration(x.progress.age_s)} ago"
        if x.progress is not None
        else f"{x.key[:12]}  no progress reported yet"
        for x in found
    ]
    yield Text("PROGRESS (as the holder reports it)\n" + "\n".join(progress))
    yield Text(
        "ages by this node's clock from the marker's mtime. state: live; stalled (no progress past its "
        "--stall-timeout); silent (its attempt stopped beating: the pod is gone, or its node's clock is off); "
        "expired (not refreshed for its duration: the next pod takes it over); dead (its process is gone "
        "from this host: a pod here takes it over at once)"
    )
