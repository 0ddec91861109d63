"""A rollout on one volume: what each generation of entries holds, who uses it, and what frees it.

During an image upgrade two generations share a role's volume (cachemgr.ops.generation): the old
pods serve from the older, the new pods (and a warm Job run ahead of them) from the newer. ``du``
shows the bytes of each, ``ls`` names them, a warm Job says before anything rolls whether both
fit, and a full volume's message says which of them holds the space and what frees it
(cachemgr.ops.space, from :class:`Prunable`: what prune could free now, and what an older
generation's pods still hold).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from cachemgr.core.units import human_bytes
from cachemgr.ops.entryinfo import EntryInfo
from cachemgr.ops.generation import Generation, named_parts

# How a generation stands to this image's: its own; older (its entries incompatible or
# superseded); newer (a newer image's); other (neither older nor newer: a local build); unknown
# (its key.json cannot be read, or this image's generation cannot be told).
Standing = Literal["this image", "older", "newer", "other", "unknown"]
_ORDER: dict[str, int] = {"this image": 0, "older": 1, "newer": 2, "other": 3, "unknown": 4}
UNUSED_AFTER = 14 * 86400.0  # what a full volume's message and du offer as --unused-for


@dataclass(frozen=True)
class Share:
    """One generation's entries on the volume."""

    generation: Generation | None
    standing: Standing
    entries: tuple[EntryInfo, ...]
    label: str = ""

    @property
    def bytes(self) -> int:
        return sum(e.size_bytes for e in self.entries)

    @property
    def in_use(self) -> tuple[EntryInfo, ...]:
        return tuple(e for e in self.entries if e.in_use)

    @property
    def in_use_bytes(self) -> int:
        return sum(e.size_bytes for e in self.in_use)

    @property
    def pods(self) -> tuple[str, ...]:
        return tuple(sorted({u.pod for e in self.entries for u in e.users}))

    @property
    def selectors(self) -> tuple[str, ...]:
        """The prune flags that choose its entries by generation (none for this image's or a newer one)."""
        statuses = {e.status for e in self.entries}
        return tuple(f"--{s}" for s in ("incompatible", "superseded") if s in statuses)

    @property
    def prunable_bytes(self) -> int:
        """What those flags free now: its older entries no pod uses."""
        return sum(e.size_bytes for e in self.entries if e.older and not e.in_use)

    def to_json(self) -> dict[str, Any]:
        return {
            "generation": self.generation.to_json() if self.generation is not None else None,
            "label": self.label,
            "vs_image": self.standing,
            "entries": len(self.entries),
            "size_bytes": self.bytes,
            "in_use_bytes": self.in_use_bytes,
            "in_use_by": list(self.pods),
            "selectors": list(self.selectors),
            "prunable_bytes": self.prunable_bytes,
        }


def shares(entries: Iterable[EntryInfo], image: Generation | None = None) -> tuple[Share, ...]:
    """The volume's entries by generation: this image's first, then older, newer, other, unknown;
    damaged entries are not a generation's (``du`` counts them apart)."""
    found: dict[tuple[tuple[str, str], ...] | None, list[EntryInfo]] = {}
    for entry in entries:
        if entry.status != "damaged":
            gen = entry.generation
            found.setdefault(gen.parts if gen is not None else None, []).append(entry)
    gens = [Generation(parts) for parts in found if parts is not None]
    parts = named_parts([*gens, *([image] if image is not None else [])])
    made = [
        Share(
            Generation(key) if key is not None else None,
            _standing(group),
            tuple(group),
            Generation(key).label(parts) if key is not None else "unknown generation",
        )
        for key, group in found.items()
    ]
    return tuple(sorted(made, key=lambda s: (_ORDER[s.standing], s.label)))


def _standing(group: list[EntryInfo]) -> Standing:
    """By the entries' own judgement against this image (cachemgr.ops.generation.Compat.judge)."""
    first = group[0]
    if first.generation is None:
        return "unknown"
    if any(e.older for e in group) or first.vs_image == "older":
        return "older"
    return _BY_ORDER.get(first.vs_image or "", "unknown")


_BY_ORDER: dict[str, Standing] = {"same": "this image", "newer": "newer", "unordered": "other"}


def image_label(image: Generation, entries: Iterable[EntryInfo]) -> str:
    """This image's generation, named as ``shares`` names the entries' (the same parts)."""
    gens = {e.generation for e in entries if e.generation is not None}  # a few, of many entries
    return image.label(named_parts([*gens, image]))


@dataclass(frozen=True)
class RolloutSpace:
    """A warm Job's report once its key is published: do both generations fit on the volume?

    It only warns, never fails: the entry is published, so the rollout's new pods will start on
    it, and both generations are on the volume already. What it warns about is the room left: less
    than one more entry of this generation's size means that the next compile of this role (another
    configuration, the next upgrade's warm Job) fails with exit 73 until the older generation is
    pruned, which only happens once its pods are gone.
    """

    this: Share | None
    older: tuple[Share, ...]
    newer: tuple[Share, ...]
    free_bytes: int
    total_bytes: int
    entry_bytes: int  # the entry this Job published or found

    @property
    def tight(self) -> bool:
        return self.free_bytes < self.entry_bytes

    def line(self) -> str:
        """One line, as the Job's last output: which generation holds what, and the room left."""
        this = (
            f"this generation ({self.this.label}) holds {human_bytes(self.this.bytes)} in {_entries(self.this)}"
            if self.this is not None
            else "this generation holds nothing yet"
        )
        parts = [this]
        for share in self.older:
            use = (
                f", {human_bytes(share.in_use_bytes)} of it in use by {_pods(share)}"
                if len(share.in_use) < len(share.entries)
                else f", in use by {_pods(share)}"
            )
            use = use if share.in_use else ", unused"
            parts.append(f"the older ({share.label}) {human_bytes(share.bytes)} in {_entries(share)}{use}")
        for share in self.newer:
            parts.append(f"a newer ({share.label}) {human_bytes(share.bytes)} in {_entries(share)}")
        room = f"{human_bytes(self.free_bytes)} free of {human_bytes(self.total_bytes)}"
        if not self.tight:
            return f"warm: both generations fit: {'; '.join(parts)}; {room}"
        selectors = " ".join(dict.fromkeys(s for share in self.older for s in share.selectors))
        prune = (
            f"'cachemgr prune {selectors} --yes' once the old pods are gone, or raise storage.compileCache.size"
            if selectors
            else "raise storage.compileCache.size"
        )
        return (
            f"warm: both generations fit, with little room left: {'; '.join(parts)}; {room}, less than one more "
            f"entry of this size ({human_bytes(self.entry_bytes)}): another compile for this role fails with exit 73 "
            f"until space is freed ({prune})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "this": self.this.to_json() if self.this is not None else None,
            "older": [s.to_json() for s in self.older],
            "newer": [s.to_json() for s in self.newer],
            "free_bytes": self.free_bytes,
            "total_bytes": self.total_bytes,
            "entry_bytes": self.entry_bytes,
            "tight": self.tight,
        }


def rollout_space(
    entries: Iterable[EntryInfo], image: Generation, *, entry_bytes: int, free_bytes: int, total_bytes: int
) -> RolloutSpace:
    found = shares(entries, image)
    return RolloutSpace(
        this=next((s for s in found if s.standing == "this image"), None),
        older=tuple(s for s in found if s.standing == "older"),
        newer=tuple(s for s in found if s.standing == "newer"),
        free_bytes=free_bytes,
        total_bytes=total_bytes,
        entry_bytes=entry_bytes,
    )


def _entries(share: Share) -> str:
    count = len(share.entries)
    return f"{count} {'entry' if count == 1 else 'entries'}"


def _pods(share: Share) -> str:
    pods = share.pods
    return ", ".join(pods[:4]) + (f" and {len(pods) - 4} more" if len(pods) > 4 else "")


@dataclass(frozen=True)
class Prunable:
    """What ``cachemgr prune`` could free right now, never counting an entry in use; and what an
    older generation holds that its pods still use (a rollout under way): freed once they go."""

    incompatible: tuple[EntryInfo, ...]
    unused: tuple[EntryInfo, ...]
    superseded: tuple[EntryInfo, ...] = ()
    kept: tuple[EntryInfo, ...] = ()  # of an older generation, in use

    @property
    def incompatible_bytes(self) -> int:
        return sum(e.size_bytes for e in self.incompatible)

    @property
    def superseded_bytes(self) -> int:
        return sum(e.size_bytes for e in self.superseded)

    @property
    def unused_bytes(self) -> int:
        return sum(e.size_bytes for e in self.unused)

    @property
    def unused_newer(self) -> tuple[EntryInfo, ...]:
        """Of the unused, a newer image's (a rollout's warm Job ran ahead of its pods, or stalled):
        ``--unused-for`` removes them too, though no generation selector of this image ever does."""
        return tuple(e for e in self.unused if e.status == "newer")

    @property
    def unused_newer_bytes(self) -> int:
        return sum(e.size_bytes for e in self.unused_newer)

    @property
    def kept_bytes(self) -> int:
        return sum(e.size_bytes for e in self.kept)

    @property
    def kept_pods(self) -> tuple[str, ...]:
        return tuple(sorted({u.pod for e in self.kept for u in e.users}))

    @property
    def older_selectors(self) -> str:
        """The prune flags that name the older generation's entries (the kept ones included)."""
        statuses = {e.status for e in (*self.incompatible, *self.superseded, *self.kept)}
        return " ".join(f"--{s}" for s in ("incompatible", "superseded") if s in statuses)


def prunable_now(entries: tuple[EntryInfo, ...], *, unused_after: float = UNUSED_AFTER) -> Prunable:
    idle = [e for e in entries if not e.in_use]
    incompatible = tuple(e for e in idle if e.status == "incompatible")
    superseded = tuple(e for e in idle if e.status == "superseded")
    unused = tuple(e for e in idle if not e.older and e.unused_for() >= unused_after)
    kept = tuple(e for e in entries if e.in_use and e.older)
    return Prunable(incompatible, unused, superseded, kept)
