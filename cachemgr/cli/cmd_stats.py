"""``stats``: hits, misses, compiles and the compile time saved, per key and for the volume;
parse, call the library (cachemgr.ops.stats), render."""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from typing import Any

from cachemgr.cli.cmd_inspect import open_cache
from cachemgr.cli.render import Block, Column, Table, Text, result, tell
from cachemgr.core.units import human_duration, plural
from cachemgr.ops.inspection import volume_errors

STATS_COLUMNS = (
    Column("key", "key"),
    Column("model", "model", shrink="model", least=10),
    Column("role", "role", wide=True),
    Column("compiler", "compiler", wide=True),
    Column("npu", "npu", wide=True),
    Column("hits", "hits", ">"),
    Column("waits", "waits", ">"),
    Column("downloads", "downloads", ">", wide=True),
    Column("compiles", "compiles", ">"),
    Column("compile time", "compile_time", ">"),
    Column("saved", "saved", ">"),
    Column("status", "status", wide=True),
    Column("entry", "entry", wide=True),
)


def stats(args: argparse.Namespace, _server_argv: list[str], _environ: Mapping[str, str]) -> int:
    from cachemgr.ops.stats import volume_stats

    root = open_cache(args)
    with volume_errors(root):
        found = volume_stats(root)
    result(
        args,
        kind="Stats",
        data=found.to_json,
        blocks=lambda: _stats_blocks(found),
        names=lambda: (f"entry/{s.entry}" if s.entry else f"failure/{s.key}" for s in found.keys),
    )
    tell("warning", found.warnings)
    return 0


def _stats_blocks(found: Any) -> Iterator[Block]:
    rows = [
        {"key": s.key[:12], "model": s.model or "?", "role": s.role or "?", "compiler": s.compiler or "?",
         "npu": s.npu or "?", "hits": s.hits, "waits": s.waits, "downloads": s.downloads, "compiles": s.compiles,
         "compile_time": human_duration(s.compile_seconds), "saved": human_duration(s.saved_seconds),
         "status": s.status, "entry": s.entry or "-"}
        for s in found.keys
    ]  # fmt: skip
    yield Table(
        rows,
        STATS_COLUMNS,
        empty="no entries, pod starts or failed compiles recorded on this volume",
        items=lambda: [s.to_json() for s in found.keys],
    )
    yield Text(_volume_line(found.total))
    yield Text(
        "hits: found the entry; waits: waited for a peer's compile, then loaded its entry (no compile "
        "of their own); compiles: the entry's own and failed ones. Counted from the volume's records: "
        "each pod start's use record (kept when it ends), the entries' summaries and the failure "
        "records, for the entries and failures on the volume now"
    )


def _volume_line(v: Any) -> str:
    """``volume: 7 pod starts: 2 hits, 1 wait, 4 compiles (...)``: each start counted once, by what it did."""
    if not v.started:
        return f"volume: no pod starts recorded; {plural(v.compiles, 'compile')} ({human_duration(v.compile_seconds)})"
    done = [plural(v.hits, "hit"), plural(v.waits, "wait")]
    if v.downloads:
        done.append(plural(v.downloads, "download"))
    failed = f"; {v.failed} failed" if v.failed else ""
    done.append(f"{plural(v.compiles, 'compile')} ({human_duration(v.compile_seconds)}{failed})")
    share = f"{100 * v.no_compile / v.started:.0f}%"
    return (
        f"volume: {plural(v.started, 'pod start')}: {', '.join(done)}; {v.no_compile} of them ({share}) "
        f"loaded an entry without compiling it, {human_duration(v.saved_seconds)} of compile time saved"
    )
