"""Generations: which SDK (and which cachemgr key schema) made an entry, and which of two is older.

An image upgrade leaves two generations of entries on one volume, the old pods serving from the
one and the new pods from the other, and whatever an operator types lands in a pod of either
image. So an image must tell an *older* generation (dead once no pod uses it) from a *newer* one
(a newer image's, which it must never call dead), and from one it cannot order.

An entry's generation is what its ``key.json`` says, and only where its inputs hash to the
entry's key (a key.json that does not is damage, or a writer's: unknown): the key ``schema``
(cachemgr's :data:`~cachemgr.key.cachekey.SCHEMA_VERSION`), the RBLN ``compiler`` major.minor,
and with the ``vllm`` strategy the server's ``versions`` (vllm-rbln, vLLM, optimum-rbln,
transformers: :data:`~cachemgr.key.vllm_rbln.VERSION_ENV`). Two generations are ordered only
where every part both know is ordered the same way (:func:`cachemgr.core.versions.compare_versions`:
a local label or two dev builds of one release have no order); anything else is ``unordered``,
and an unknown generation is never judged: nothing is called older that cannot be proved older.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from cachemgr.core import jsonread
from cachemgr.core.coerce import as_dict
from cachemgr.core.versions import compare_versions
from cachemgr.key.cachekey import SCHEMA_VERSION
from cachemgr.key.digest import digest_of
from cachemgr.key.vllm_rbln import VERSION_ENV

# The parts of a generation, in the order they are named: the compiler first (the chart page's
# reuse rule), then the server vllm-rbln, whose version names the SDK release.
PARTS: tuple[str, ...] = ("compiler", "vllm_rbln", "vllm", "optimum_rbln", "transformers", "schema")
PART_NAMES: dict[str, str] = {
    "compiler": "compiler",
    **{part: dist for part, (dist, _) in VERSION_ENV.items()},
    "schema": "key schema",
}
# A difference in these means no pod of the newer image can ever use the older entry whatever its
# server: ``incompatible`` (prune --incompatible); in the server's versions alone, ``superseded``.
INCOMPATIBLE_PARTS = frozenset({"compiler", "schema"})
# Always named in a generation's label: what an operator knows an SDK image by.
_ALWAYS_NAMED = ("compiler", "vllm_rbln")

Order = Literal["same", "older", "newer", "unordered"]
# What an entry is to this image by its generation (cachemgr.ops.entryinfo.EntryStatus adds damaged).
Judgement = Literal["published", "incompatible", "superseded", "newer"]


@dataclass(frozen=True)
class Difference:
    """One part where two generations differ: its value in the first, then in the second."""

    part: str
    mine: str
    theirs: str
    order: int | None  # -1 older, 1 newer, None: no order (compare_versions)


@dataclass(frozen=True)
class Comparison:
    """How one generation stands to another (``mine`` to ``theirs``), from the parts both know."""

    order: Order | None  # None: no part known to both: nothing can be said
    differences: tuple[Difference, ...] = ()

    @property
    def parts(self) -> frozenset[str]:
        return frozenset(d.part for d in self.differences)

    def words(self, theirs: str = "this image") -> str:
        """``compiler 0.12, this image has 0.13``: the parts that decide, the compiler and key schema
        where they differ (an SDK image brings its own server too: no need to list it), else the
        server's versions that differ."""
        major = [d for d in self.differences if d.part in INCOMPATIBLE_PARTS] or self.differences
        return "; ".join(f"{PART_NAMES[d.part]} {d.mine}, {theirs} has {d.theirs}" for d in major)


@dataclass(frozen=True)
class Generation:
    """The parts of a generation that are known (an image may not know its server's versions)."""

    parts: tuple[tuple[str, str], ...]  # (part, version), in PARTS order

    @classmethod
    def of(cls, known: Mapping[str, Any]) -> Generation:
        return cls(tuple((p, str(known[p])) for p in PARTS if known.get(p) not in (None, "")))

    @classmethod
    def of_inputs(cls, inputs: Mapping[str, Any]) -> Generation:
        """From a key's inputs: its schema, its compiler and (vllm strategy) its server's versions."""
        versions = as_dict(inputs.get("versions"))
        return cls.of(
            {
                "schema": inputs.get("schema") if type(inputs.get("schema")) is int else None,  # not a bool
                "compiler": inputs.get("compiler") if isinstance(inputs.get("compiler"), str) else None,
                **{p: v for p, v in versions.items() if p in VERSION_ENV and isinstance(v, str)},
            }
        )

    def get(self, part: str) -> str | None:
        return dict(self.parts).get(part)

    def compare(self, other: Generation) -> Comparison:
        """This generation against ``other``: older only where no part is newer or unordered and
        one is older; the differences name every part that differs."""
        return _compare(self.parts, other.parts)

    def label(self, parts: Iterable[str] | None = None) -> str:
        """``compiler 0.12, vllm-rbln 0.12.0``: the parts named (default: compiler and vllm-rbln)."""
        named = tuple(parts) if parts is not None else _ALWAYS_NAMED
        words = [f"{PART_NAMES[p]} {v}" for p, v in self.parts if p in named]
        return ", ".join(words) or "unknown generation"

    def to_json(self) -> dict[str, Any]:
        found = dict(self.parts)
        return {
            "schema": found.get("schema") if (n := _schema_number(found.get("schema"))) is None else n,
            "compiler": found.get("compiler"),
            "versions": {p: found[p] for p in PARTS if p in VERSION_ENV and p in found},
        }


@functools.lru_cache(maxsize=1024)  # a volume holds a few generations: ls compares each entry's
def _compare(mine: tuple[tuple[str, str], ...], others: tuple[tuple[str, str], ...]) -> Comparison:
    theirs = dict(others)
    shared = [(p, v, theirs[p]) for p, v in mine if p in theirs]
    if not shared:
        return Comparison(None)
    differences = tuple(
        Difference(p, value, other, order)
        for p, value, other in shared
        if (order := _order(p, value, other)) != 0
    )
    orders = {d.order for d in differences}
    if not orders:
        # The same only where every part of this one is known there too: an image that cannot
        # tell its server's versions does not know whether an entry's are its own.
        return Comparison("same" if len(shared) == len(mine) else None)
    if orders == {-1}:
        return Comparison("older", differences)
    if orders == {1}:
        return Comparison("newer", differences)
    return Comparison("unordered", differences)


def _order(part: str, mine: str, theirs: str) -> int | None:
    if part == "schema":
        a, b = _schema_number(mine), _schema_number(theirs)
        if a is None or b is None:
            return None if mine != theirs else 0
        return (a > b) - (a < b)
    return compare_versions(mine, theirs)


def _schema_number(value: str | None) -> int | None:
    """A key schema's number; None for anything else ("²" is a digit to str.isdigit, and a
    planted 5,000-digit one is past int()'s limit)."""
    if value is None or not (value.isascii() and value.isdigit()) or len(value) > 18:
        return None
    return int(value)


def named_parts(generations: Iterable[Generation]) -> tuple[str, ...]:
    """What tells these generations apart in a label: the compiler and vllm-rbln where known, and
    every other part whose value differs among them."""
    seen: dict[str, set[str]] = {}
    for gen in generations:
        for part, value in gen.parts:
            seen.setdefault(part, set()).add(value)
    return tuple(p for p in PARTS if p in seen and (p in _ALWAYS_NAMED or len(seen[p]) > 1))


# --- what an entry's key.json says -------------------------------------------------------------


@dataclass(frozen=True)
class KeyFacts:
    """An entry's generation and lineage, as its key.json says (its inputs hash to its key)."""

    generation: Generation
    # Entries of one lineage replace each other across generations: the same model, role, NPU
    # and strategy (docs/design.md, "Generations").
    lineage: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"generation": [list(p) for p in self.generation.parts], "lineage": list(self.lineage)}

    def to_hint(self) -> str:
        """One string for the scan's hints: 10,000 rows share a few, parsed once each (from_hint)."""
        return _to_hint(self)

    @staticmethod
    def from_hint(text: Any) -> KeyFacts | None:
        """What :meth:`to_hint` wrote, checked (the hints file is anyone's to write); None else."""
        return _from_hint(text) if isinstance(text, str) and len(text) < _HINT_MAX else None


_HINT_MAX = 1 << 14


@functools.lru_cache(maxsize=1024)
def _to_hint(facts: KeyFacts) -> str:
    return json.dumps(facts.to_json(), separators=(",", ":"))


@functools.lru_cache(maxsize=1024)  # a volume's entries share a few generations and lineages
def _from_hint(text: str) -> KeyFacts | None:
    try:
        data = jsonread.parse(text)  # a hint is the volume's bytes: bounded as every record
    except ValueError:
        return None
    parts, lineage = (data.get("generation"), data.get("lineage")) if isinstance(data, dict) else (None, None)
    if not isinstance(parts, list) or not isinstance(lineage, list):
        return None
    if not all(isinstance(x, str) for x in lineage) or not all(
        isinstance(p, list)
        and len(p) == 2
        and isinstance(p[0], str)
        and p[0] in PART_NAMES
        and isinstance(p[1], str)
        for p in parts
    ):
        return None
    return KeyFacts(Generation.of(dict(parts)), tuple(lineage))


def key_facts(doc: Mapping[str, Any], digest: str) -> KeyFacts | str:
    """The facts of an entry's key.json, or why there are none (then its generation is unknown).

    The inputs must hash to the entry's key: a key.json changed since the publish (it is in the
    manifest: ``verify`` finds it) or planted by a writer must not make an entry look older.
    """
    inputs = doc.get("inputs")
    if not isinstance(inputs, dict):
        return "key.json holds no key inputs"
    try:
        matches = digest_of(inputs) == digest
    except (TypeError, ValueError):  # not JSON a key was made of (a NaN, a loop): damage
        matches = False
    if not matches:
        return "key.json's inputs do not hash to the entry's key"
    return KeyFacts(Generation.of_inputs(inputs), lineage(inputs, as_dict(doc.get("details"))))


def lineage(inputs: Mapping[str, Any], details: Mapping[str, Any]) -> tuple[str, ...]:
    """The model the entry names, its role, NPU and strategy: what a newer generation replaces.

    The model by the name the key gives it (a hub id; a local directory's path string, else its
    name), never by a content digest alone: the fingerprint of a local directory is how the key
    tells weights apart, and a newer cachemgr may compute it differently (issue 31), so the same
    weights under a new generation would otherwise look like another model and never replace the
    old entry. Two models under one path string are one lineage: the newer replaces the older.
    """
    model = as_dict(inputs.get("model"))
    kind = str(model.get("kind") or "")
    if kind == "hub":
        name = model.get("id")
    elif kind == "local":
        name = model.get("path") or details.get("model_path") or details.get("model_name")
    else:
        name = details.get("model_name")
    return (
        kind,
        str(name or ""),
        str(inputs.get("role") or ""),
        str(inputs.get("npu") or ""),
        str(inputs.get("strategy") or ""),
    )


def labels(generations: Iterable[Generation | None]) -> str:
    """The distinct generations named, told apart from each other: ``compiler 0.12, vllm-rbln
    0.12.0`` (``; `` between several)."""
    given = list(generations)
    known = [g for g in given if g is not None]
    parts = named_parts(known)
    names = list(dict.fromkeys(g.label(parts) for g in known))
    if len(known) < len(given):
        names.append("unknown generation")
    return "; ".join(names)


# --- this image -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Compat:
    """What this image is: its generation (cachemgr.ops.generation) and its NPU.

    An entry of an older generation is dead to this image once no pod uses it; one of a newer
    generation is a newer image's, never dead here (in a rollout an operator's command lands in a
    pod of either image, and a 0.12 pod that called a 0.13 entry incompatible pruned it: one
    11-minute compile per role, mid-rollout). An entry for another NPU type is not dead either: a
    role's Deployment may land on nodes of two NPU types sharing one volume, and those pods use
    it; treating it as dead made each type prune the other's entries and recompile in turn (11
    minutes each). Such entries go only when named (``prune --for-npu``) or by age or LRU.
    ``None`` means unknown: nothing is judged on that part.
    """

    compiler: str | None
    npu: str | None
    # The server's versions (the vllm strategy's key: vllm_rbln, vllm, optimum_rbln, transformers),
    # those known; None: none known (an image without the server, or an operator's own shell).
    versions: Mapping[str, str] | None = None
    schema: int = SCHEMA_VERSION

    @classmethod
    def of_key(cls, inputs: Mapping[str, Any]) -> Compat:
        """A pod's own: the generation and NPU of the key it computed."""
        versions = as_dict(inputs.get("versions"))
        return cls(
            str(inputs["compiler"]), str(inputs["npu"]), {k: str(v) for k, v in versions.items()} or None
        )

    @functools.cached_property  # asked once per entry of a scan
    def generation(self) -> Generation:
        return Generation.of({"schema": self.schema, "compiler": self.compiler, **(self.versions or {})})

    def judge(self, facts: KeyFacts | None) -> tuple[Judgement, str | None, Order | None]:
        """An entry's status by its generation against this image's, the words for it, the order."""
        if facts is None:
            return "published", None, None  # unknown: never judged (its warning says why)
        found = facts.generation.compare(self.generation)
        if found.order == "older":
            status: Judgement = "incompatible" if found.parts & INCOMPATIBLE_PARTS else "superseded"
            return status, found.words(), found.order
        if found.order == "newer":
            return "newer", found.words(), found.order
        if found.order == "unordered":
            return "published", f"another generation, neither older nor newer: {found.words()}", found.order
        return "published", None, found.order

    def why_incompatible(self, facts: KeyFacts | None) -> str | None:
        """Why no pod of this image can ever use an entry and a newer image replaced it, or None."""
        status, problem, _ = self.judge(facts)
        return problem if status == "incompatible" else None

    def other_npu(self, npu: str) -> bool:
        """For another NPU type than this pod's: kept by ``--incompatible``, named by ``--for-npu``."""
        return bool(self.npu and npu and npu != self.npu)
