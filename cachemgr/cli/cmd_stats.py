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
    Column("misses", "misses", ">"),
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
        data=found.to_json,
        blocks=lambda: _stats_blocks(found),
        names=lambda: (f"entry/{s.entry}" if s.entry else f"failure/{s.key}" for s in found.keys),
    )
    tell("warning", found.warnings)
    return 0


def _stats_blocks(found: Any) -> Iterator[Block]:
    rows = [
        {"key": s.key[:12], "model": s.model or "?", "role": s.role or "?", "compiler": s.compiler or "?",
         "npu": s.npu or "?", "hits": s.hits, "misses": s.misses, "compiles": s.compiles,
         "compile_time": human_duration(s.compile_seconds), "saved": human_duration(s.saved_seconds),
         "status": s.status, "entry": s.entry or "-"}
        for s in found.keys
    ]  # fmt: skip
    yield Table(
        rows, STATS_COLUMNS, empty="no entries, pod starts or failed compiles recorded on this volume"
    )
    v = found.total
    ratio = f"{100 * v.hits / (v.hits + v.misses):.0f}% hits" if v.hits + v.misses else "no starts recorded"
    yield Text(
        f"volume: {plural(v.hits, 'hit')}, {plural(v.misses, 'miss')} ({ratio}), {plural(v.compiles, 'compile')} "
        f"({human_duration(v.compile_seconds)}; {v.failed} failed), {human_duration(v.saved_seconds)} of compile "
        "time saved\ncounted from the volume's records: each pod start's use record (kept when it ends), the "
        "entries' summaries and the failure records, for the entries and failures on the volume now"
    )
