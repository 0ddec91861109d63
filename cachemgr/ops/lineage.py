"""Lineages: the entries of one model, role, NPU and strategy replace each other across
generations, so an entry older than another of its lineage is superseded (cachemgr.ops.generation)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from cachemgr.ops.entryinfo import EntryInfo
from cachemgr.ops.generation import Generation
from cachemgr.volume.entries import entry_names
from cachemgr.volume.layout import CacheRoot


def superseded(entries: Iterable[EntryInfo], image: Generation) -> tuple[EntryInfo, ...]:
    """Entries this image cannot order against its own (a shell that knows its compiler but not its
    server's versions; a local build), marked ``superseded`` where a newer generation of their
    model, role and NPU is published here: what a server upgrade (vllm-rbln, vLLM, transformers)
    without a compiler change leaves.

    Never on a guess about this image: it must know its compiler (as ``prune --incompatible``
    must), an entry of its own generation is never superseded in its eyes, and a successor
    counts only where it is not newer than this image on any part the image knows (an operator
    in an old pod must not prune what the old pods start on again, though a newer image's entry
    of its model is there). A successor is published (not damaged or untrusted), its generation known.
    """
    entries = tuple(entries)
    if image.get("compiler") is None:
        return entries
    groups: dict[tuple[str, ...], list[EntryInfo]] = {}
    for entry in entries:
        if entry.facts is not None and entry.status != "damaged" and entry.trust in (None, "trusted"):
            groups.setdefault(entry.facts.lineage, []).append(entry)
    marked: dict[str, EntryInfo] = {}
    for group in (g for g in groups.values() if len(g) > 1):
        # A lineage holds a few generations and many entries (configurations): compare generations,
        # each against the newest successor entry of every other generation.
        newest: dict[Generation, EntryInfo] = {}
        for other in group:
            gen = other.generation
            if gen is None or gen.compare(image).order not in _NOT_NEWER:
                continue
            if gen not in newest or (other.created_at or 0.0) > (newest[gen].created_at or 0.0):
                newest[gen] = other
        for entry in group:
            if entry.status != "published" or entry.vs_image == "same" or entry.generation is None:
                continue
            mine = entry.generation
            newer = [
                (other, found)
                for gen, other in newest.items()
                if (found := mine.compare(gen)).order == "older"
            ]
            if newer:
                other, found = max(newer, key=lambda pair: pair[0].created_at or 0.0)
                marked[entry.name] = replace(
                    entry,
                    status="superseded",
                    problem=f"newer entry {other.short}: {found.words(other.short)}",
                    superseded_by=other.key,
                )
    return tuple(marked.get(e.name, e) for e in entries)


# Not newer than this image on any part it knows: the same, older, or equal where it knows.
_NOT_NEWER = frozenset({"same", "older", None})


def kin(root: CacheRoot, name: str) -> list[str]:
    """Entries whose names share ``name``'s model, role and NPU parts
    (``<model>__<role>__c<compiler>__<npu>__<digest16>``, cachemgr.key.cachekey): the only ones
    that can be of its lineage. The lineage itself is checked from their key.json."""
    parts = name.split("__")
    if len(parts) != 5:
        return []
    return [
        n
        for n in entry_names(root)
        if (p := n.split("__")) and len(p) == 5 and (p[0], p[1], p[3]) == (parts[0], parts[1], parts[3])
    ]
