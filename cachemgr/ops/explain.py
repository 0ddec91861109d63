"""``explain``: hit or miss for one server argv here, and on a miss, why, field by field.

Every entry keeps its full key inputs in ``key.json``. On a miss, the entries of the same role
are ranked by how few inputs differ from this argv's (then the same model, then the latest
used); for the nearest, each differing input is shown with both values (``compiler 0.12 ->
0.13``, ``serving.tensor_parallel_size 4 -> 8``), and the advice says what the difference means
and what to do: an SDK upgrade compiles again and leaves old entries to prune, a serving flag
changed, the model's revision moved, the NPU type differs, or nothing was compiled for this
role yet. A compile in progress and earlier failures of the key are named too. With trusted keys
the lookup is a trusting pod's, the bytes read and hashed: an entry not signed by one of them as
it is, is ``untrusted``, and the advice says why and what to do. Read-only.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cachemgr.core.coerce import as_dict, number, read_dict
from cachemgr.core.units import human_age, human_bytes, human_duration, plural
from cachemgr.key.cachekey import CacheKey
from cachemgr.ops.attempts import FailureHistory
from cachemgr.ops.locks import holder_json, read_holder_of
from cachemgr.ops.rollout import shares
from cachemgr.ops.scan import Compat, EntryInfo, scan
from cachemgr.volume import serverfail
from cachemgr.volume.drift import records as drift_records
from cachemgr.volume.failure_records import failures
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.manifest import KEY_NAME
from cachemgr.volume.store import lookup

if TYPE_CHECKING:
    from cachemgr.core.signing import TrustedKeys
    from cachemgr.volume.lease import Holder
    from cachemgr.volume.serverfail import ServerFailure

# The order fields are shown in: what operators change most, and the likeliest cause, first.
_FIELD_ORDER = (
    "compiler", "versions", "rules", "npu", "model", "draft_model", "model_impl", "serving", "rbln", "unknown_flags",
    "env", "strategy", "server", "compile_cmd", "schema",
)  # fmt: skip


@dataclass(frozen=True)
class Difference:
    """One key input that differs: the entry's value, then this argv's."""

    field: str
    entry: Any
    here: Any

    def __str__(self) -> str:
        return f"{self.field} {_value(self.entry)} -> {_value(self.here)}"

    def to_json(self) -> dict[str, Any]:
        return {"field": self.field, "entry": self.entry, "here": self.here}


@dataclass(frozen=True)
class Renamed:
    """One input two releases' rules name differently, with the same value on both sides (strict
    rules key --model-impl among the serving flags, 0.12's as the model path): no difference."""

    entry_field: str
    field: str
    value: Any

    def to_json(self) -> dict[str, Any]:
        return {"entry_field": self.entry_field, "field": self.field, "value": self.value}


@dataclass(frozen=True)
class Nearest:
    entry: EntryInfo
    differences: tuple[Difference, ...]
    renamed: tuple[Renamed, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            **self.entry.to_json(),
            "differences": [d.to_json() for d in self.differences],
            "renamed": [r.to_json() for r in self.renamed],
        }


@dataclass(frozen=True)
class Explanation:
    """``explain``: hit or miss for one argv here, and on a miss, why, field by field."""

    key: CacheKey
    result: Literal["hit", "miss", "damaged", "untrusted"]
    entry: EntryInfo | None
    problems: tuple[str, ...]
    nearest: tuple[Nearest, ...]
    holder: Holder | None
    history: FailureHistory | None
    other_roles: tuple[str, ...]
    advice: tuple[str, ...]
    warnings: tuple[str, ...] = ()
    recompiled: tuple[Mapping[str, Any], ...] = ()  # recompiled_on_hit records of the key
    signer: str | None = None  # the key that signed it (trusted if the result is a hit)
    untrusted: str = ""  # why the entry is not trusted ("untrusted: ...")
    trusting: bool = False  # looked up with trusted keys, as a trusting pod does
    # Pre-ready server exits on a hit of the entry as it is now (cachemgr.volume.serverfail), newest first.
    server_failed: tuple[ServerFailure, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "result": self.result,
            **self.key.to_json(),
            "found": self.entry.to_json() if self.entry else None,
            "problems": list(self.problems),
            "compiling": holder_json(self.holder),
            "failures": self.history.count if self.history else 0,
            "last_failure": dict(self.history.last) if self.history else None,
            "nearest": [n.to_json() for n in self.nearest],
            "other_roles": list(self.other_roles),
            "advice": list(self.advice),
            "warnings": list(self.warnings),
            "recompiled_on_hit": [dict(r) for r in self.recompiled],
            "server_failed": [f.to_json() for f in self.server_failed],
            "signer": self.signer,
            "trust": ("trusted" if self.result == "hit" else self.untrusted or None)
            if self.trusting
            else None,
        }


def explain(
    root: CacheRoot, key: CacheKey, *, limit: int = 3, trusted: TrustedKeys | None = None
) -> Explanation:
    """Look the key up (read-only, sizes checked; with ``trusted`` keys, signature and bytes too)
    and, on a miss, rank the entries of its role."""
    compat = Compat.of_key(key.inputs)
    found = lookup(root, key, mode="fast", trusted=trusted)
    found_entries = scan(root, compat=compat, with_staging=False).entries
    role = str(key.inputs["role"])
    warnings: list[str] = []
    nearest: tuple[Nearest, ...] = ()
    if found.status != "hit":
        same_role = [
            e for e in found_entries if e.role == role and e.key != key.digest and e.status != "damaged"
        ]
        nearest = tuple(_rank(key, same_role, warnings)[:limit])
    records = failures(root, key.digest)
    history = FailureHistory(key.digest, tuple(records), len(records)) if records else None
    entry = next((e for e in found_entries if e.key == key.digest), None)
    served = serverfail.read(root, key.digest) if entry is not None and entry.server_failed else None
    warnings += served.notes if served is not None else ()
    partial = Explanation(
        key=key,
        result=found.status,
        entry=entry,
        server_failed=served.of(serverfail.instance_of(entry.created_at)) if served and entry else (),
        problems=tuple(str(p) for p in found.problems),
        nearest=nearest,
        holder=read_holder_of(root, key.digest) if found.status != "hit" else None,
        history=history,
        other_roles=tuple(sorted({e.role for e in found_entries if e.role and e.role != role})),
        advice=(),
        warnings=tuple(warnings),
        recompiled=tuple(drift_records(root, key.digest)),
        signer=found.signer or _claimed_signer(found.path, root),
        untrusted=found.untrusted,
        trusting=bool(trusted),
    )
    return replace(partial, advice=tuple(_advice(partial, found_entries)))


def _claimed_signer(entry: Path, root: CacheRoot) -> str | None:
    from cachemgr.volume.trust import signer_of

    return signer_of(entry, within=root.path)


def _rank(key: CacheKey, candidates: list[EntryInfo], warnings: list[str]) -> list[Nearest]:
    """Fewest differing inputs first; among equals, the same model, then the latest used."""
    here = _flat(dict(key.inputs))
    ranked = []
    for entry in candidates:
        inputs = as_dict(read_dict(entry.path / KEY_NAME).get("inputs"))
        if not inputs:
            warnings.append(f"{entry.name}: key.json is missing or damaged; it cannot be compared")
            continue
        theirs = _flat(inputs)
        diffs, renamed = _compare(theirs, here)
        model_differs = any(d.field.startswith("model") for d in diffs)
        ranked.append(
            (
                len(diffs),
                model_differs,
                -(entry.last_used_at or entry.created_at or 0.0),
                entry,
                diffs,
                renamed,
            )
        )
    ranked.sort(key=lambda r: r[:3])
    return [Nearest(entry, diffs, renamed) for *_, entry, diffs, renamed in ranked]


def _compare(
    theirs: dict[str, Any], here: dict[str, Any]
) -> tuple[tuple[Difference, ...], tuple[Renamed, ...]]:
    """The inputs that differ, like compared with like: where the two keys come from different
    rules, an input one names ``serving.model_impl`` and the other ``model_impl`` (each absent
    from the other side) is one input, a difference only if its values differ (issue 40)."""
    fields = sorted(set(here) | set(theirs), key=_field_rank)
    diffs = [Difference(f, theirs.get(f), here.get(f)) for f in fields if theirs.get(f) != here.get(f)]
    if theirs.get("rules") == here.get("rules"):
        return tuple(diffs), ()

    def leaf(d: Difference) -> str:
        return d.field.rsplit(".", 1)[-1]

    # One pass each way (a key.json is the volume's: any number of fields, none trusted).
    sides: dict[str, tuple[list[Difference], list[Difference]]] = defaultdict(lambda: ([], []))
    for d in diffs:
        if d.entry is not None and d.here is None:
            sides[leaf(d)][0].append(d)
        elif d.entry is None and d.here is not None:
            sides[leaf(d)][1].append(d)
    replaced: dict[str, Difference | None] = {}
    renamed = []
    for there, mine in sides.values():
        if len(there) != 1 or len(mine) != 1:
            continue  # only where one input on each side can be meant
        replaced[there[0].field] = None
        if there[0].entry == mine[0].here:
            replaced[mine[0].field] = None
            renamed.append(Renamed(there[0].field, mine[0].field, mine[0].here))
        else:
            replaced[mine[0].field] = Difference(mine[0].field, there[0].entry, mine[0].here)
    kept = [replaced.get(d.field, d) for d in diffs]
    diffs = [d for d in kept if d is not None]
    return tuple(diffs), tuple(renamed)


def _flat(value: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"serving": {"tp": 4}}`` -> ``{"serving.tp": 4}``; an empty mapping adds nothing."""
    out: dict[str, Any] = {}
    for name, item in value.items():
        path = f"{prefix}.{name}" if prefix else str(name)
        if isinstance(item, dict):
            out.update(_flat(item, path))
        else:
            out[path] = item
    return out


def _field_rank(name: str) -> tuple[int, str]:
    top = name.split(".", 1)[0]
    return (_FIELD_ORDER.index(top) if top in _FIELD_ORDER else len(_FIELD_ORDER), name)


def _value(value: Any) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _advice(ex: Explanation, entries: tuple[EntryInfo, ...]) -> list[str]:
    return _cache_advice(ex) + _lookup_advice(ex, entries) + _generations_advice(ex.key, entries)


def _generations_advice(key: CacheKey, entries: tuple[EntryInfo, ...]) -> list[str]:
    """The other generations on the volume (a rollout): what each holds, and what frees it."""
    advice = []
    for share in shares(entries, Compat.of_key(key.inputs).generation):
        held = f"{plural(len(share.entries), 'entry')}, {human_bytes(share.bytes)}"
        if share.standing == "older":
            prune = f"'cachemgr prune {' '.join(share.selectors)} --yes'"
            if share.pods:
                use = f", {human_bytes(share.in_use_bytes)} in use by {', '.join(share.pods)}"
                frees = (
                    f"{prune} frees {human_bytes(share.prunable_bytes)} of it now, the rest once no pod runs "
                    "the older image"
                    if share.prunable_bytes
                    else f"{prune} frees it once no pod runs the older image"
                )
            else:
                use, frees = "", f"{prune} frees it"
            advice.append(
                f"the volume holds an older generation ({share.label}: {held}{use}): this image never uses it; {frees}"
            )
        elif share.standing == "newer":
            advice.append(
                f"the volume holds a newer generation ({share.label}: {held}): a newer image's, which this image "
                "never uses and never prunes by --incompatible or --superseded"
            )
    return advice


def _cache_advice(ex: Explanation) -> list[str]:
    """What no lookup changes: a configuration that cannot be cached, a hit that compiled anyway."""
    advice = [
        f"this configuration cannot be cached: {reason}" for reason in ex.key.details.get("uncacheable", ())
    ]
    if ex.recompiled:
        last = ex.recompiled[-1]
        advice.append(
            f"recompiled_on_hit: {plural(len(ex.recompiled), 'pod start')} found this entry and the server compiled anyway, "
            f"the last {human_age(number(last.get('time')))} (pod {last.get('pod', '?')}, new files: "
            f"{', '.join([str(p) for p in last.get('paths') or []][:3])}): the server keys on something cachemgr does not. "
            f"Report it with 'cachemgr show {ex.key.short} -o json'; meanwhile such pods compile at every start"
        )
    if ex.server_failed:
        newest = ex.server_failed[0]
        line = f"; its last line: {newest.last_lines[-1]}" if newest.last_lines else ""
        advice.append(
            f"the server exited before it was ready {plural(len(ex.server_failed), 'time')} on this entry, the last "
            f"{human_age(newest.time)} (pod {newest.pod or '?'}, {newest.how}{line}): if the entry is what it cannot "
            f"load, 'cachemgr prune --key {ex.key.short} --yes' removes it and the next start compiles afresh "
            f"(or run pods with --on-server-failure set-aside-after N); 'cachemgr show {ex.key.short}' has the last lines"
        )
    return advice


def _lookup_advice(ex: Explanation, entries: tuple[EntryInfo, ...]) -> list[str]:
    key = ex.key
    if ex.result == "hit":
        signed = f", signed by {ex.signer}" if ex.trusting else ""
        if ex.entry is None:
            # The lookup found it, the listing before it did not (moved in meanwhile, or its summary
            # names another key): what the lookup checked is what a pod loads.
            return [
                f"a pod with this argv loads entry {key.entry_name}{signed and f' ({signed[2:]})'} without compiling"
            ]
        return [
            f"a pod with this argv loads entry {ex.entry.name} ({ex.entry.size_str}{signed}) without compiling"
        ]
    advice = []
    if ex.result == "untrusted":
        advice.append(
            f"entry {key.entry_name} is here but {ex.untrusted}: a pod that trusts these keys never loads it. "
            "A pod with the signing key (the builder, a warm Job) moves it to quarantine and publishes its own; "
            "pods without it wait for that (--on-miss compile) or exit 69 (--on-miss fail)"
        )
    if ex.result == "damaged":
        advice.append(
            f"entry {key.entry_name} is here but damaged ({'; '.join(ex.problems)}): the next pod start moves "
            "it to quarantine and compiles again; 'cachemgr verify --fix' moves it now"
        )
    if ex.holder is not None and not ex.holder.stale:
        advice.append(
            f"{ex.holder.describe()} is compiling this key now: pods starting now wait for it, then load it"
        )
    elif ex.holder is not None:
        advice.append(
            f"the lease of this key is stale ({ex.holder.describe()}, silent "
            f"{human_duration(ex.holder.refreshed_age)}): the next pod takes it over and compiles"
        )
    if ex.history is not None:
        last = ex.history.last
        advice.append(
            f"{plural(ex.history.count, 'earlier compile')} of this key failed, the last {human_age(number(last.get('time')))} "
            f"({last.get('reason')}): {last.get('message')} 'cachemgr show {key.short}' has the last output lines"
        )
    if not ex.nearest and ex.result == "untrusted":
        return advice  # the entry is here: what to do about it is said above
    if not ex.nearest:
        role = key.inputs["role"]
        elsewhere = (
            f" (this volume holds entries for {', '.join(ex.other_roles)}: is it the {role} volume?)"
            if ex.other_roles
            else ""
        )
        advice.append(
            f"nothing compiled yet for role {role} here{elsewhere}: the first pod (or a 'cachemgr warm' Job) "
            "compiles once, later pods reuse it"
        )
        return advice
    return advice + _differences_advice(key, ex.nearest[0], entries)


def _differences_advice(key: CacheKey, nearest: Nearest, entries: tuple[EntryInfo, ...]) -> list[str]:
    by_top: dict[str, list[Difference]] = defaultdict(list)
    for diff in nearest.differences:
        by_top[diff.field.split(".", 1)[0]].append(diff)
    advice = _generation_advice(key, nearest.entry, by_top)
    if "npu" in by_top:
        advice.append(
            f"the nearest entry targets {by_top['npu'][0].entry}, this pod {key.inputs['npu']}: each NPU type "
            "compiles its own (pods on that hardware use theirs: 'cachemgr prune --incompatible' keeps them; "
            f"once that hardware is gone, 'cachemgr prune --for-npu {by_top['npu'][0].entry}' removes them); "
            "if they should match, check CACHEMGR_NPU_TYPE / RBLN_FORCE_NPU_NAME and the node pool"
        )
    if "model" in by_top:
        advice.append(
            f"the model differs ({', '.join(map(str, by_top['model']))}): other weights or another revision "
            "compile separately; pin --revision so every pod resolves the same one"
        )
    if "serving" in by_top:
        flags = ", ".join(
            f"{_flag(d.field)} {_value(d.entry)} -> {_value(d.here)}" for d in by_top["serving"]
        )
        advice.append(
            f"serving settings differ ({flags}): each combination compiles its own graphs. If intended, the first "
            "pod compiles once and the others reuse it; if not, pass the entry's values"
        )
    advice += _keyed_advice(by_top, nearest.renamed)
    if "env" in by_top:
        names = ", ".join(d.field.split(".", 1)[-1] for d in by_top["env"])
        advice.append(
            f"the compile environment differs ({names}): set it as the entry had it to reuse the entry"
        )
    if by_top.keys() & {"strategy", "server", "compile_cmd"}:
        advice.append("the compile strategy or command differs (--strategy, --compile-cmd)")
    return advice


def _generation_advice(key: CacheKey, near: EntryInfo, by_top: Mapping[str, list[Difference]]) -> list[str]:
    """The nearest entry is of another generation (compiler, server versions, key schema): what
    that means (what each generation holds and what frees it follows: _generations_advice)."""
    if not by_top.keys() & {"compiler", "versions", "schema"}:
        return []
    changes = "; ".join(str(d) for top in ("compiler", "versions", "schema") for d in by_top.get(top, ()))
    if near.status == "newer":
        return [
            f"the nearest entry is of a newer generation ({changes}): a newer image's. This image compiles its own "
            "beside it, and never removes it by 'prune --incompatible' or '--superseded'"
        ]
    if "compiler" in by_top:
        return [
            f"the nearest entry was compiled by RBLN Compiler {by_top['compiler'][0].entry}, this image has "
            f"{key.inputs['compiler']}: another SDK image always compiles again (reuse needs the same major.minor)"
        ]
    if "versions" in by_top:
        return [
            f"the nearest entry was made by another server ({changes}): vllm-rbln keys its compile cache on the "
            "vLLM version, so a server upgrade compiles again"
        ]
    return ["the nearest entry was keyed by another cachemgr key schema: it is never reused"]


def _keyed_advice(by_top: Mapping[str, list[Difference]], renamed: tuple[Renamed, ...] = ()) -> list[str]:
    """The inputs the server's release rules add (cachemgr.key.vllm_key): what each difference means."""
    advice = []
    if "rules" in by_top:
        rules = by_top["rules"][0]
        named = "; ".join(
            f"{r.entry_field} there is {r.field} here, {_value(r.value)} in both" for r in renamed
        )
        advice.append(
            "the nearest entry was keyed by a cachemgr without per-release rules: it is never reused; prune it "
            "once no pod runs that cachemgr"
            if rules.entry is None
            else f"the nearest entry was keyed by the rules of {_value(rules.entry)}, this argv by {_value(rules.here)}: "
            "another server release compiles again, and the two rules differ in what they key"
            + (f" and in what they call it ({named}: not a difference)" if named else "")
        )
    if "model_impl" in by_top:
        advice.append(
            f"the model path differs ({', '.join(map(str, by_top['model_impl']))}): --model-impl, "
            "VLLM_RBLN_USE_VLLM_MODEL or _VLLM_RBLN_RESOLVED_MODEL_IMPL pick what vllm-rbln compiles"
        )
    if "draft_model" in by_top:
        advice.append(
            "the speculative decoding draft model differs: its weights are compiled into the graphs"
        )
    if "rbln" in by_top:
        options = ", ".join(
            f"{'--rbln-' + d.field.split('.', 1)[-1].replace('_', '-')} {_value(d.entry)} -> {_value(d.here)}"
            for d in by_top["rbln"]
        )
        advice.append(
            f"RBLN options differ ({options}): a --rbln-* flag, an --additional-config key or a VLLM_RBLN_* "
            "variable sets each; give the entry's values to reuse it"
        )
    if "unknown_flags" in by_top:
        advice.append(
            "the server argv, keyed as given because vLLM 0.30 does not know some of its flags, differs from "
            "the entry's (in order, runtime-only flags aside): give it as the entry had it to reuse it"
        )
    return advice


def _flag(name: str) -> str:
    """``serving.tensor_parallel_size`` -> ``--tensor-parallel-size`` (nested JSON: the flag, then the path)."""
    parts = name.split(".")[1:]
    flag = "--" + parts[0].replace("_", "-")
    return flag if len(parts) == 1 else f"{flag} {'.'.join(parts[1:])}"
