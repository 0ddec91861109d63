"""Derive, from the key oracle's table, what each model path's identity reads of ``vllm serve``'s options.

Writes, for a release of tools/releases/manifest.toml, the module its ``identity`` names
(``cachemgr/key/<identity>.py``) from its table (``--release``; ``--check``: exit 1 if the committed
file is not what the table gives). tools/gen_rules.py runs it for every release. Runs in the project's venv (it reads option values with cachemgr's own parser, the one
the key uses); the table is tests/data/oracle/vllm-rbln-RELEASE.json, which scripts/oracle writes from
the real server code.

Two facts per option and model path, both answers of the executed server, not a reading of its code:

- ``DEFAULTS``: the values, as cachemgr's parser reads them, that the server takes as the option's
  default: the option given at the parser's own default (``--dtype auto``, ``-tp 1``, ``--max-logprobs
  20``, ``--optimization-level 2``) whose identity and compile were the base's. Such a value is keyed
  as if the option were not given.
- ``IGNORED``: the options none of whose tried values changed the path's identity or what it compiles
  (each option is tried at every choice but its default, three at most, or at values of its kind;
  tools/oracle/corpus.py). An option the server refused at every value is not in it (nothing was
  learnt: it stays keyed), nor is one whose value switched the model path. A structured option (a
  JSON object, tools/oracle/fields.py) is in it only when every field of the class it fills was
  tried and none changed the path's identity; a free-form one (no class: ``--hf-overrides``) never
  is, for its keys are open-ended and no list of them can be tried.
- ``FIELDS``: per structured option, each field's default (a field given at it is the field not
  given) and, per model path, the fields proven not to reach that path's identity: the field alone
  at a value other than its default, on top of the option's seed where it has one, answered the
  same identity and compile as without it. A field never tried, or refused by the server, is not
  proven and stays keyed.

The corpus also holds what these facts were not derived from (pairs of options, spellings, the
environment, model edits, images): tests/test_oracle.py holds the key to every variant, so a fact
derived too broadly shows as a false hit there.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cachemgr_testkit import manifest, oracle

from cachemgr.key.serving import parse_server_argv

REPO = Path(__file__).resolve().parents[2]
# Each release the oracle runs, from the manifest: its table, and the module derived from it.
OUTPUTS = {
    release: REPO / "cachemgr" / "key" / f"{manifest.release(release).identity}.py"
    for release in manifest.oracle_releases()
}
TABLES = {release: REPO / "tests" / "data" / "oracle" / f"vllm-rbln-{release}.json" for release in OUTPUTS}
_MODEL = "/models/m"  # any path: option values never name it but --model/--tokenizer (keyed apart)


def derive(table: Mapping[str, Any]) -> dict[str, Any]:
    options = [v for v in table["variants"] if v["kind"] == "option"]
    defaults: dict[str, list[Any]] = defaultdict(list)
    seen: dict[tuple[str, str], list[bool]] = defaultdict(list)
    for variant in options:
        base, dest, answer = variant["base"], variant["dest"], variant["answer"]
        if answer.get("refused"):
            continue
        same = answer["server_same"] and answer["compile_same"]
        if variant["id"].endswith(" (default)"):
            if same and answer["path"] == variant["base"]:
                value = _parsed(variant, dest, table["release"])
                if value is not _MISSING and value not in defaults[dest]:
                    defaults[dest].append(value)
            continue
        seen[(base, dest)].append(same and answer["path"] == base)
    # A default must hold on both paths to be one (the key does not know the path of every model).
    for variant in options:
        if variant["id"].endswith(" (default)") and variant["dest"] in defaults:
            answer = variant["answer"]
            if answer.get("refused") or not (answer["server_same"] and answer["compile_same"]):
                defaults.pop(variant["dest"], None)
    fields = derive_fields(table)
    structured = table.get("structured", {})
    ignored = {
        base: sorted(
            dest
            for (b, dest), sames in seen.items()
            if b == base
            and sames
            and all(sames)
            and _whole_option_proven(structured.get(dest), fields, dest, base)
        )
        for base in oracle.bases(table["release"])
    }
    return {"defaults": {k: defaults[k] for k in sorted(defaults)}, "ignored": ignored, "fields": fields}


def derive_fields(table: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per structured option that fills a class: its fields' defaults, and per model path the fields
    whose every tried variant answered the reference's identity and compile (none refused)."""
    structured: Mapping[str, Any] = table.get("structured", {})
    answers: dict[tuple[str, str, str], list[bool]] = defaultdict(list)
    tried: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    seeds: dict[tuple[str, str], bool] = {}
    for variant in table["variants"]:
        if variant["kind"] not in ("field", "field-seed"):
            continue
        answer, base = variant["answer"], variant["base"]
        same = not answer.get("refused") and bool(
            answer["server_same"] and answer["compile_same"] and answer["path"] == base
        )
        if variant["kind"] == "field-seed":
            seeds[(variant["dest"], base)] = same
        else:
            answers[(variant["dest"], base, variant["field"])].append(same)
            value = variant.get("value", _value_of(variant))
            tried[(variant["dest"], base, variant["field"])].append(json.dumps(value, sort_keys=True))
    found: dict[str, dict[str, Any]] = {}
    for dest in sorted(structured):
        spec = structured[dest]
        if spec["free_form"]:
            continue
        defaults: dict[str, Any] = {}
        ignored: dict[str, list[str]] = {}
        for base, on in sorted(spec["bases"].items()):
            for path, field in on["fields"].items():
                defaults.setdefault(path, field["default"])
            ignored[base] = sorted(
                path
                for path, field in on["fields"].items()
                if answers.get((dest, base, path))
                and all(answers[(dest, base, path)])
                and _every_value_tried(field, tried[(dest, base, path)])
            )
        found[dest] = {
            "empty_is_default": not spec["none_default"],
            "defaults": dict(sorted(defaults.items())),
            "ignored": ignored,
            "seed_same": {
                base: seeds[(dest, base)] for base in sorted(spec["bases"]) if (dest, base) in seeds
            },
        }
    return found


def _every_value_tried(field: Mapping[str, Any], tried: list[str]) -> bool:
    """A type of few values (tools/oracle/fields.py ``values``) is proven only at every one of them but
    the default: one tried value may be the one the server resolves an unset field to. A table made
    before ``values`` was recorded proves no such field (it is keyed)."""
    if "values" not in field:
        return False
    if field["values"] is None:
        return True
    wanted = {json.dumps(v, sort_keys=True) for v in field["values"] if v != field["default"]}
    return wanted <= set(tried)


def _value_of(variant: Mapping[str, Any]) -> Any:
    """The field's value in a variant's JSON document (tables made before variants named it)."""
    doc: Any = json.loads(variant["argv"][1])
    for name in variant["field"].split("."):
        doc = doc[name]
    return doc


def _whole_option_proven(
    spec: Mapping[str, Any] | None, fields: Mapping[str, Any], dest: str, base: str
) -> bool:
    """May a structured option leave the key whole on ``base``? Only when every field of its class was
    tried and proven, and, where it is None unless given, the option given at its seed is the same too."""
    if spec is None:
        return True  # not a structured option: its tried values decide
    if spec["free_form"] or base not in spec["bases"]:
        return False
    proven = fields[dest]
    every = set(spec["bases"][base]["fields"])
    return every == set(proven["ignored"][base]) and proven["seed_same"].get(base, True)


_MISSING = object()


def _parsed(variant: Mapping[str, Any], dest: str, release: str) -> Any:
    """The option's value as cachemgr's own parser stores it (what the key compares)."""
    argv = oracle.argv_of(variant, _MODEL, release)
    options = parse_server_argv(argv).options
    return options.get(dest, _MISSING)


def render(release: str, facts: Mapping[str, Any], table: Mapping[str, Any]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in sorted(table["versions"].items()))
    lines = [
        f'"""Generated by tools/oracle/derive.py from tests/data/oracle/vllm-rbln-{release}.json: do not edit by hand.',
        "",
        "What each model path's identity reads of `vllm serve`'s options, as the real server code answered",
        f"when the key oracle ran it ({versions}; scripts/oracle). DEFAULTS: the values the",
        "server takes as an option's default (keyed as if the option were not given). IGNORED: per model path,",
        "the options none of whose tried values changed that path's identity or what it compiles (a structured",
        "option: every field of its class tried and proven; a free-form one never). FIELDS: per structured",
        "option, the fields' defaults and the fields proven not to reach each path's identity.",
        '"""',
        "",
        "from typing import Any, Final",
        "",
        f"RELEASE: Final = {json.dumps(release)}",
        "",
        "DEFAULTS: Final[dict[str, tuple[Any, ...]]] = {",
    ]
    for dest, values in facts["defaults"].items():
        lines.append(f"    {json.dumps(dest)}: ({', '.join(_literal(v) for v in values)},),")
    lines.append("}")
    lines.append("")
    lines.append("IGNORED: Final[dict[str, frozenset[str]]] = {")
    for base, dests in facts["ignored"].items():
        lines.append(f"    {json.dumps(base)}: frozenset(")
        lines.append("        {")
        lines += [f"            {json.dumps(dest)}," for dest in dests]
        lines.append("        }")
        lines.append("    ),")
    lines.append("}")
    lines += [
        "",
        "# Per structured option (a JSON object filling a config class, tools/oracle/fields.py): whether the",
        "# object of defaults alone is the option not given, each field's default by dotted path, and per",
        "# model path the fields proven not to reach that path's identity (tried alone, answered the same).",
        "FIELDS: Final[dict[str, dict[str, Any]]] = {" + ("}" if not facts["fields"] else ""),
    ]
    for dest, spec in facts["fields"].items():
        lines.append(f"    {json.dumps(dest)}: {{")
        lines.append(f'        "empty_is_default": {spec["empty_is_default"]!r},')
        lines.append('        "defaults": {')
        lines += [
            f"            {json.dumps(path)}: {_literal(value)}," for path, value in spec["defaults"].items()
        ]
        lines.append("        },")
        lines.append('        "ignored": {')
        for base, paths in spec["ignored"].items():
            if paths:
                lines.append(f"            {json.dumps(base)}: frozenset(")
                lines.append("                {")
                lines += [f"                    {json.dumps(path)}," for path in paths]
                lines.append("                }")
                lines.append("            ),")
            else:
                lines.append(f"            {json.dumps(base)}: frozenset(),")
        lines.append("        },")
        lines.append("    },")
    if facts["fields"]:
        lines.append("}")
    return "\n".join(lines) + "\n"


def _literal(value: Any) -> str:
    """A Python literal of a JSON value (true/false/null spelled as Python), strings double-quoted as
    the project's formatter writes them, so the generated file passes ``ruff format --check``."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", required=True, choices=sorted(OUTPUTS))
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed file is not current")
    args = parser.parse_args()
    table = json.loads(TABLES[args.release].read_text(encoding="utf-8"))
    text = render(args.release, derive(table), table)
    output = OUTPUTS[args.release]
    if args.check:
        if output.read_text(encoding="utf-8") != text:
            print(
                f"{output.relative_to(REPO)} is not what {TABLES[args.release].name} gives: "
                f"rerun tools/oracle/derive.py --release {args.release}"
            )
            return 1
        return 0
    output.write_text(text, encoding="utf-8")
    print(f"wrote {output.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
