"""Write each release's rules module: manifest + facts + oracle table + overrides -> cachemgr/key/rules_*.py.

For every release of tools/releases/manifest.toml the oracle runs, this writes
``cachemgr/key/rules_<release>.py`` (its :class:`cachemgr.key.release_model.Release`) from:

- the facts tools/rbln_facts.py read off the release's unpacked wheels
  (tests/data/rbln_facts/vllm-rbln-<release>.json; ``--src DIR`` re-derives them first): every
  variable of ``envs.py`` with its executed default, what the bundle signature hashes, the RBLNConfig
  fields, the optimum directory's name, the model-path rule, the artifacts' layout;
- the key oracle's table (tests/data/oracle/vllm-rbln-<release>.json), through tools/oracle/derive.py
  (run here: it writes ``cachemgr/key/<identity>.py``): what each checked path ignores and takes as
  default. A release with no table yet is written all the same, strict on every path: nothing has to
  exist before its rules can be;
- the reviewed judgement calls of tools/releases/overrides.toml, each written beside what it changes
  with its reason and cite.

A release with ``same_code_as`` is recognised as that release's code from the wheels: with ``--src``
its vllm-rbln wheel is compared file by file with the other's, and only version strings may differ
(``_version.py``); the verdict is kept in its facts file (the wheels' RECORDs and the files that
differ), which ``--check`` re-reads. It is then keyed by that release's rules under its own versions.

Last, ``cachemgr/key/rules_index.py`` lists every release (cachemgr.key.releases.KNOWN).
``--check``: exit 1 if a written file is not what the inputs give (CI runs it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cachemgr_testkit import manifest

REPO = Path(__file__).resolve().parents[1]
KEY = REPO / "cachemgr" / "key"
FACTS = REPO / "tests" / "data" / "rbln_facts"
TABLES = REPO / "tests" / "data" / "oracle"
_PATHS = {"vllm": "VLLM_PATH", "optimum": "OPTIMUM_PATH"}
# The names a kind of envs.py parser reads besides the variable's own (cachemgr.key.rbln_env).
_KIND_READS = {"num_devices": "VLLM_RBLN_TP_SIZE", "auto_port": "VLLM_RBLN_USE_DEVICE_TENSOR"}
# Files a release may differ in from the release whose code it is: the version module setuptools-scm
# writes (its version, version tuple and commit id).
_VERSION_FILES = {"vllm_rbln/_version.py"}


def module_of(release: str) -> str:
    return "rules_" + re.sub(r"\W", "_", release)


def facts_of(release: str) -> dict[str, Any]:
    path = FACTS / f"vllm-rbln-{release}.json"
    if not path.is_file():
        raise SystemExit(
            f"{path.relative_to(REPO)} is missing: run tools/gen_rules.py --src DIR (the unpacked wheels)"
        )
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def overrides_for(release: str) -> list[dict[str, Any]]:
    with manifest.OVERRIDES.open("rb") as handle:
        items: list[dict[str, Any]] = tomllib.load(handle)["override"]
    return [o for o in items if o["releases"] == "*" or release in o["releases"]]


# --- one release ----------------------------------------------------------------------------------


def _paths(paths: set[str]) -> str:
    if paths == {"vllm", "optimum"}:
        return "BOTH"
    if not paths:
        return "NEITHER"
    (one,) = paths
    return _PATHS[one]


def _lit(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_lit(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_lit(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _names(values: Any) -> str:
    items = sorted(values)
    return "frozenset({" + ", ".join(json.dumps(v) for v in items) + "})" if items else "frozenset()"


def fields(facts: Mapping[str, Any], overrides: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """RBLNConfig / OptimumRBLNConfig fields (0.12): where each is compiled, its variable."""
    config = facts.get("rbln_config") or {}
    if not config:
        return {}
    defaults = {o["name"]: o["value"] for o in overrides if o["what"] == "field_default"}
    derived_by_hand = {n for o in overrides if o["what"] == "field_derived" for n in o["names"]}
    out: dict[str, dict[str, Any]] = {}
    for name, fact in config["fields"].items():
        derived = bool((fact.get("metadata") or {}).get("derived")) or name in derived_by_hand
        compiled = set()
        if "vllm" in fact["classes"] and not derived and name not in config["hash_ignored"]:
            compiled.add("vllm")
        if name in facts["optimum_name_fields"]:
            compiled.add("optimum")
        attr = config["env_name"].get(name, f"VLLM_RBLN_{name.upper()}")
        out[name] = {
            "default": defaults.get(name, fact.get("default")),
            "classes": set(fact["classes"]),
            "compiled_on": compiled,
            "env": attr if attr in facts["env"] else None,
            "derived": derived,
            "line": fact["line"],
        }
    return out


def env(facts: Mapping[str, Any], rbln_fields: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Every variable of envs.environment_variables: its parser, executed default, where compiled."""
    hashed = facts["rbln_compile_env"]  # None: no bundle signature (no mega cache) to read it from
    by_env = {spec["env"]: name for name, spec in rbln_fields.items() if spec["env"]}
    out: dict[str, dict[str, Any]] = {}
    for name, fact in facts["env"].items():
        if fact["kind"] == "unknown":
            raise SystemExit(f"{name}: envs.py parses it in a way cachemgr does not know: {fact['code']}")
        compiled: set[str] = set()
        field = by_env.get(name)
        if hashed is None or name in hashed:
            compiled.add("vllm")  # no partition to read: every variable counts on that path
        if field is not None:
            compiled |= rbln_fields[field]["compiled_on"]
        if name in facts["optimum_name_env"]:
            compiled.add("optimum")
        reads = list(fact.get("reads", []))
        if fact["kind"] in _KIND_READS:
            reads = [name, _KIND_READS[fact["kind"]]]
        out[name] = {"kind": fact["kind"], "default": fact["default"], "compiled_on": compiled,
                     "reads": reads, "field": field, "line": fact["line"]}  # fmt: skip
    return out


def render_release(entry: manifest.Release, facts: Mapping[str, Any], has_table: bool) -> str:
    overrides = overrides_for(entry.name)
    rbln_fields = fields(facts, overrides)
    checked = set(entry.checked) if has_table else set()
    if facts["versions"] != entry.versions:
        raise SystemExit(
            f"{entry.name}: the manifest says {entry.versions}, its wheels {facts['versions']}: fix the manifest entry"
        )
    lines = _header(entry, checked, has_table)
    lines += _env_lines(facts, env(facts, rbln_fields))
    lines += _field_lines(facts, rbln_fields)
    lines += _release_lines(
        entry, facts, overrides, checked, has_table=has_table, has_fields=bool(rbln_fields)
    )
    text = "\n".join(lines) + "\n"
    body = text.split("{IMPORTS}", 1)[1]
    used = [n for n in _MODEL_NAMES if re.search(rf"\b{n}\b", body)]
    return text.replace("{IMPORTS}", ", ".join(used))


def _header(entry: manifest.Release, checked: set[str], has_table: bool) -> list[str]:
    source = (
        f"cachemgr/key/{entry.identity}.py (tools/oracle/derive.py, from the key oracle's table)"
        if has_table
        else "no oracle table yet (every path is keyed strictly)"
    )
    lines = [
        f'"""Generated by tools/gen_rules.py: do not edit by hand. vllm-rbln {entry.name}\'s rules.',
        "",
        f"From tools/releases/manifest.toml, tests/data/rbln_facts/vllm-rbln-{entry.name}.json",
        f"(tools/rbln_facts.py, from the wheels), {source} and tools/releases/overrides.toml.",
        f"Model paths checked by the oracle: {', '.join(sorted(checked)) or 'none'}.",
        '"""',
        "",
    ]
    if has_table:
        lines.append(f"from cachemgr.key import {entry.identity} as identity")
    return [*lines, "from cachemgr.key.release_model import {IMPORTS}", ""]


def _env_lines(facts: Mapping[str, Any], variables: Mapping[str, Any]) -> list[str]:
    lines = [
        f"# {facts['cite']}: environment_variables (the line of each entry), each default as the entry",
        "# returns it on an empty environment",
        "ENV: dict[str, EnvVar] = {",
    ]
    for name, var in variables.items():
        args = [json.dumps(name), json.dumps(var["kind"]), _lit(var["default"]), _paths(var["compiled_on"])]
        if var["reads"]:
            args.append(
                "reads=("
                + ", ".join(json.dumps(r) for r in var["reads"])
                + ("," if len(var["reads"]) == 1 else "")
                + ")"
            )
        if var["field"]:
            args.append(f"field={json.dumps(var['field'])}")
        lines.append(f"    {json.dumps(name)}: EnvVar({', '.join(args)}),  # envs.py:{var['line']}")
    return [*lines, "}  # fmt: skip", ""]


def _field_lines(facts: Mapping[str, Any], rbln_fields: Mapping[str, Any]) -> list[str]:
    if not rbln_fields:
        return ["FIELDS: dict[str, RblnField] = {}  # no RBLNConfig: additional_config is a dict", ""]
    lines = [
        f"# {facts['rbln_config']['cite']}: RBLNConfigBase / RBLNConfig / OptimumRBLNConfig fields",
        "FIELDS: dict[str, RblnField] = {",
    ]
    for name, spec in rbln_fields.items():
        args = [json.dumps(name), _lit(spec["default"]), _paths(spec["classes"]), _paths(spec["compiled_on"])]
        if spec["env"]:
            args.append(f"env={json.dumps(spec['env'])}")
        if spec["derived"]:
            args.append("derived=True")
        lines.append(f"    {json.dumps(name)}: RblnField({', '.join(args)}),  # config.py:{spec['line']}")
    return [*lines, "}  # fmt: skip", ""]


def _release_lines(
    entry: manifest.Release,
    facts: Mapping[str, Any],
    overrides: list[dict[str, Any]],
    checked: set[str],
    *,
    has_table: bool,
    has_fields: bool,
) -> list[str]:
    lines: list[str] = []
    by_what: dict[str, set[str]] = {"runtime_flags": set(), "runtime_flags_vllm_path": set()}
    for item in overrides:
        lines.append(f"# override ({item['what']}): {' '.join(item['reason'].split())} ({item['cite']})")
        if item["what"] in by_what:
            by_what[item["what"]] |= set(item["add"])
    lines.append(f"_RUNTIME = {_names(by_what['runtime_flags'])}")
    lines.append(f"_RUNTIME_VLLM_PATH = {_names(by_what['runtime_flags_vllm_path'])}")
    lines.append(f"CHECKED: frozenset[Path] = {_paths(checked)}")
    if checked == {"vllm", "optimum"}:
        lines.append('_IGNORED_BOTH = flags(identity.IGNORED["vllm"] & identity.IGNORED["optimum"])')
    else:
        lines.append("_IGNORED_BOTH: frozenset[str] = frozenset()  # one path checked at most")
    on_path = {
        p: (f'flags(identity.IGNORED["{p}"]) - _IGNORED_BOTH' if p in checked else "frozenset()")
        for p in ("vllm", "optimum")
    }
    gpu = {
        facts["vllm_gpu_memory_utilization_default"],
        facts["platform_defaults"].get("gpu_memory_utilization"),
    }
    defaults = {
        "max_num_seqs": [facts["platform_defaults"]["max_num_seqs"]],
        "gpu_memory_utilization": sorted(gpu - {None}),
    }
    shown = ", ".join(f'"{k}": ({", ".join(_lit(v) for v in vs)},)' for k, vs in defaults.items())
    vllm_path = "_RUNTIME_VLLM_PATH" + (f" | {on_path['vllm']}" if "vllm" in checked else "")
    whats = {item["what"] for item in overrides}
    config_cite = facts["rbln_config"]["cite"] if has_fields else "no config.py"
    return [
        *lines,
        "",
        "RELEASE = Release(",
        f'    name="vllm-rbln {entry.name}",',
        f"    versions={_lit(entry.versions)},",
        "    env=ENV,",
        "    runtime_flags=_RUNTIME | _IGNORED_BOTH,",
        f"    runtime_flags_vllm_path={vllm_path},",
        f"    runtime_flags_optimum_path={on_path['optimum']},",
        # the platform's and vLLM's defaults (facts), and every option given at the value the server
        # takes as its default (the oracle's)
        f"    defaults={{**identity.DEFAULTS, {shown}}}," if has_table else f"    defaults={{{shown}}},",
        f'    additional_config="{"fields" if has_fields else "whole"}",',
        f'    model_impl="{facts["model_impl_rule"]}",',
        "    rbln_fields=FIELDS,",
        *(["    structured=identity.FIELDS,"] if has_table else []),
        f"    optimum_runtime_keys={_names(facts['optimum_runtime_keys'])},",
        f'    envs_xxh3="{facts["envs_xxh3"]}",',
        f'    cite="{facts["cite"]}, {config_cite}",',
        f"    optimum_architectures={_names(facts['optimum_architectures'])},",
        "    checked=CHECKED,",
        f"    layouts={_lit(facts['layouts'])},",
        *(["    local_model_in_place=True,"] if "local_model_in_place" in whats else []),
        ")",
    ]


_MODEL_NAMES = (
    "BOTH",
    "NEITHER",
    "OPTIMUM_PATH",
    "VLLM_PATH",
    "EnvVar",
    "Path",
    "RblnField",
    "Release",
    "flags",
)


# --- code-identical releases ----------------------------------------------------------------------


def same_code(src: Path, release: str, base: str) -> dict[str, Any]:
    """Compare the unpacked vllm-rbln wheels of ``release`` and ``base``: the facts kept for --check."""
    rbln_facts = _rbln_facts()
    mine, theirs = src / f"vllm_rbln-{release}", src / f"vllm_rbln-{base}"
    record, other = rbln_facts.wheel_record(mine), rbln_facts.wheel_record(theirs)
    differs: dict[str, str] = {}
    for path in sorted(set(record) | set(other)):
        if record.get(path) == other.get(path):
            continue
        a, b = (mine / path), (theirs / path)
        if (
            path in _VERSION_FILES
            and a.is_file()
            and b.is_file()
            and _versionless(a, release) == _versionless(b, base)
        ):
            differs[path] = "version strings only"
        else:
            differs[path] = "code"
    return {"same_code_as": base, "record": record, "differs": differs}


def _versionless(path: Path, version: str) -> list[str]:
    """The file with its version, version tuple and commit id taken out."""
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if re.match(
            r"^(__version__|__version_tuple__|__commit_id__|version|version_tuple|commit_id)\b", line
        ):
            continue
        keep.append(line.replace(version, "<version>"))
    return keep


def check_same_code(release: str, base: str) -> str | None:
    """From the kept facts: why ``release`` is not ``base``'s code, or None if it is."""
    facts, other = facts_of(release), facts_of(base)
    if facts.get("same_code_as") != base:
        return f"its facts say same_code_as {facts.get('same_code_as')!r}: rerun tools/gen_rules.py --src DIR"
    record, theirs = facts["record"], other["record"]
    changed = {p for p in set(record) | set(theirs) if record.get(p) != theirs.get(p)}
    if changed != set(facts["differs"]):
        return (
            f"its RECORD differs from {base}'s in {sorted(changed)}, its facts say {sorted(facts['differs'])}"
        )
    code = sorted(p for p, why in facts["differs"].items() if why != "version strings only")
    return f"its code differs from {base}'s: {code}" if code else None


def _rbln_facts() -> Any:
    spec = importlib.util.spec_from_file_location("rbln_facts", REPO / "tools" / "rbln_facts.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["rbln_facts"] = module
    spec.loader.exec_module(module)
    return module


def render_index(aliases: Mapping[str, str]) -> str:
    lines = [
        '"""Generated by tools/gen_rules.py from tools/releases/manifest.toml: do not edit by hand.',
        "",
        "Every release cachemgr keys by its own rules (cachemgr.key.releases.KNOWN), and each release whose",
        "wheels differ from one of those in version strings alone, keyed by that one's rules.",
        '"""',
        "",
    ]
    own = list(manifest.oracle_releases())
    lines.append("from cachemgr.key import " + ", ".join(sorted(module_of(n) for n in own)))
    lines += ["from cachemgr.key.release_model import Release", "", "KNOWN: tuple[Release, ...] = ("]
    for name in manifest.names():
        base = aliases.get(name)
        if base is None:
            lines.append(f"    {module_of(name)}.RELEASE,")
        else:
            versions = _lit(manifest.release(name).versions)
            lines.append(f"    {module_of(base)}.RELEASE._replace(")
            lines.append(f'        name="vllm-rbln {name}", versions={versions}, same_code_as="{base}"')
            lines.append("    ),")
    lines.append(")")
    return "\n".join(lines) + "\n"


# --- main -----------------------------------------------------------------------------------------


def _format(text: str, path: Path) -> str:
    """As the project's formatter writes it (the generated file passes ``ruff format --check``)."""
    ruff = Path(sys.executable).parent / "ruff"
    done = subprocess.run(
        [str(ruff), "format", "--stdin-filename", str(path), "-"],
        input=text, capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a written file is not current")
    parser.add_argument(
        "--src", type=Path, help="unpacked wheels (tools/rbln_facts.py): re-derive the facts first"
    )
    args = parser.parse_args(argv)
    outputs: dict[Path, str] = {}
    status = 0
    aliases: dict[str, str] = {}
    for name in manifest.names():
        entry = manifest.release(name)
        if entry.same_code_as is not None:
            if args.src is not None and not args.check:
                facts = same_code(args.src, name, entry.same_code_as)
                (FACTS / f"vllm-rbln-{name}.json").write_text(
                    json.dumps(facts, indent=1, sort_keys=True) + "\n"
                )
            why = check_same_code(name, entry.same_code_as)
            if why is not None:
                print(f"{name}: not keyed by {entry.same_code_as}'s rules: {why}", file=sys.stderr)
                return 1
            aliases[name] = entry.same_code_as
            continue
        if args.src is not None and not args.check:
            tool = _rbln_facts()
            table = tool.release_table(tool.sources(args.src, name))
            (FACTS / f"vllm-rbln-{name}.json").write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        has_table = (TABLES / f"vllm-rbln-{name}.json").is_file()
        if has_table:
            derive = [sys.executable, str(REPO / "tools" / "oracle" / "derive.py"), "--release", name]
            done = subprocess.run(derive + (["--check"] if args.check else []), check=False)
            status |= 1 if done.returncode else 0
        path = KEY / f"{module_of(name)}.py"
        outputs[path] = _format(render_release(entry, facts_of(name), has_table), path)
    index = KEY / "rules_index.py"
    outputs[index] = _format(render_index(aliases), index)
    stale = sorted(p.name for p in KEY.glob("rules_*.py") if p not in outputs)
    for path, text in outputs.items():
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                print(f"{path.relative_to(REPO)} is not what the manifest, facts, table and overrides give: "
                      "rerun tools/gen_rules.py")  # fmt: skip
                status = 1
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(REPO)}", file=sys.stderr)
    if stale:
        print(f"no release of the manifest has {stale}: remove them", file=sys.stderr)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
