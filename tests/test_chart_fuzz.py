"""The chart's values, fuzzed (issue 40: "no chart values beyond the schema tests").

Each trial lays one to three hostile changes on a full set of values (warm Jobs, toolboxes, a
PodMonitor): a wrong type at any key, a string with newlines, quotes or template syntax, a huge
number, an unknown key, at any depth, in maps and lists alike. The real Helm 4 renders it. Every
render either fails with the chart's own refusal (the schema's ``value must be ...`` tree, or a
template ``fail`` of templates/_checks.tpl) or makes objects that parse, carry no key a value
smuggled in, and pass ``kubernetes-validate --strict``. Never a Go template error, a YAML parse
error, or an object the API server would refuse.

Bounded and seeded: ``CACHEMGR_CHART_FUZZ_TRIALS`` (CI's short form: 30), ``CACHEMGR_CHART_FUZZ_SEED``
replays one run (the failure names its seed and trial).
"""

from __future__ import annotations

import copy
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from cachemgr_testkit.helm import CHART, TEST_IMAGE, template_text
from cachemgr_testkit.kube import merge, venv_tool

TRIALS = int(os.environ.get("CACHEMGR_CHART_FUZZ_TRIALS", "30"))
SEED = int(os.environ.get("CACHEMGR_CHART_FUZZ_SEED", "4040"))
MARK = "smuggled"  # a key no object of the chart has: found anywhere, a value added a field
BASE = merge(
    TEST_IMAGE,
    {
        "prefill": {"warm": True},
        "decode": {"warm": True},
        "toolbox": {"enabled": True},
        "metrics": {"podMonitor": {"enabled": True}},
    },
)
STRINGS = [
    f"x\n{MARK}: true",
    f"x\n  {MARK}: true\n    - a",
    f'"}}\n{MARK}: 1',
    'it\'s "quoted"',
    "{{ .Release.Name }}",
    '{{ fail "from a value" }}',
    "{{- /* c */ -}}",
    "${HOME}",
    "",
    " ",
    "-",
    "--",
    "é漢\u202e",
    "x" * 5000,
    "null",
    "true",
    "0x10",
    "1e400",
    "200Gi\n",
    "RBLN-CA25\t",
]
NUMBERS = [0, -1, 1.5, 2**31, 2**63, -(2**63) - 1, 2**64, 1e300, -1e300, 1e-300]
OTHERS: list[Any] = [None, True, False, [], {}, ["x"], {"a": 1}, {MARK: True}, [{"a": [1, {"b": None}]}]]


def hostile(rng: random.Random) -> Any:
    kind = rng.random()
    if kind < 0.5:
        return rng.choice(STRINGS)
    if kind < 0.75:
        return rng.choice(NUMBERS)
    return copy.deepcopy(rng.choice(OTHERS))


def places(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key and list item under ``node``, by its path."""
    found = [path] if path else []
    if isinstance(node, dict):
        for key, value in node.items():
            found += places(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += places(value, (*path, index))
    return found


def mutate(values: dict[str, Any], rng: random.Random) -> list[str]:
    """One to three hostile changes, in place; what each was, for the failure's message."""
    done = []
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(places(values))
        *parents, last = path
        node: Any = values
        for part in parents:
            node = node[part]
        target = node[last]
        roll = rng.random()
        if roll < 0.15 and isinstance(target, dict):
            key = rng.choice([MARK, "x" * 300, "a\nb", "", "{{ .Values }}"])
            target[key] = hostile(rng)
            done.append(f"{path} += {key!r}")
        elif roll < 0.25 and isinstance(target, list):
            target.append(hostile(rng))
            done.append(f"{path} appended {target[-1]!r:.80}")
        else:
            node[last] = hostile(rng)
            done.append(f"{path} = {node[last]!r:.80}")
    return done


def keys_anywhere(node: Any) -> set[str]:
    if isinstance(node, dict):
        return {str(k) for k in node} | {k for v in node.values() for k in keys_anywhere(v)}
    if isinstance(node, list):
        return {k for v in node for k in keys_anywhere(v)}
    return set()


def is_the_charts_refusal(stderr: str) -> bool:
    """The schema's tree of reasons, or a template ``fail`` (``execution error at (...): MESSAGE``)
    of the chart's own: never Go's template errors, nor a YAML or JSON one."""
    # Helm's own log lines come first ("cannot overwrite table with non table": a map given a scalar).
    text = "\n".join(line for line in stderr.strip().splitlines() if not line.startswith("level=")).strip()
    foreign = ("executing \"", "error calling", "wrong type", "YAML parse error", "error converting YAML",
               "cannot unmarshal", "panic", "nil pointer", "invalid value; expected")  # fmt: skip
    if any(word in text for word in foreign):
        return False
    if text.startswith("Error: values don't meet the specifications of the schema(s)"):
        return True
    return text.startswith("Error: execution error at (modelserver/templates/") and text.count("\n") == 0


@pytest.mark.timeout(120 + 4 * TRIALS)  # a render a trial, and one validation of them all
def test_hostile_values_are_refused_by_the_chart_or_render_objects_kubernetes_accepts(tmp_path: Path) -> None:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    rng = random.Random(SEED)
    rendered: dict[Path, list[str]] = {}
    refused = 0
    for trial in range(TRIALS):
        values = merge(copy.deepcopy(defaults), copy.deepcopy(BASE))
        changes = mutate(values, rng)
        where = f"seed {SEED} trial {trial}: {changes}"
        result = template_text(values, work=tmp_path / "values")
        if result.returncode != 0:
            assert is_the_charts_refusal(result.stderr), f"{where}\n{result.stderr[:3000]}"
            refused += 1
            continue
        try:
            docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
        except yaml.YAMLError as error:
            raise AssertionError(f"{where}: the render does not parse: {error}") from None
        assert MARK not in keys_anywhere(docs), f"{where}: a value added a field"
        known = [
            doc for doc in docs if not str(doc.get("apiVersion", "")).startswith("monitoring.coreos.com/")
        ]
        path = tmp_path / f"trial-{trial}.yaml"
        path.write_text(yaml.safe_dump_all(known))
        rendered[path] = changes
    assert refused, "no trial was refused: the fuzzer does not reach the schema"
    assert rendered, "every trial was refused: the fuzzer never reaches the templates"
    result = subprocess.run(
        [venv_tool("kubernetes-validate"), "--strict", "--kubernetes-version", "1.33.0", *map(str, rendered)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    errors = [line for line in result.stdout.splitlines() if line.startswith("ERROR")]
    failed = sorted({p for p in rendered for line in errors if f"{p} " in line}, key=str)
    assert result.returncode == 0, "\n".join(
        [f"seed {SEED} trial {p.stem}: {rendered[p]}" for p in failed] + errors[:20] + [result.stderr[-2000:]]
    )


@pytest.mark.quick
def test_the_fuzzer_reaches_every_key_of_values_yaml() -> None:
    """Its places are every key of the values, nested ones and list items included."""
    values = merge(yaml.safe_load((CHART / "values.yaml").read_text()), BASE)
    found = {path[:2] for path in places(values)}
    assert ("storage", "compileCache") in found
    assert ("cachemgr", "extraArgs") in found
    assert ("prefill", "args") in found
    assert ("prefill", "args", 0) in set(places(values))


@pytest.mark.quick
def test_the_kubernetes_objects_in_the_schema_are_kubernetes_own() -> None:
    """values.schema.json's io.k8s.* definitions are what tools/gen_chart_k8s_schema.py makes of
    kubernetes-validate's strict ones, for the version the renders are validated against."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location(
        "gen", CHART.parent.parent.parent / "tools" / "gen_chart_k8s_schema.py"
    )
    assert spec is not None
    assert spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema == gen.rewritten(schema, gen.definitions()), "run tools/gen_chart_k8s_schema.py"
    refs = {
        node["$ref"].rsplit("/", 1)[-1]
        for node in _nodes(schema["properties"]) + _nodes(schema["$defs"]["extraEnv"])
        if "$ref" in node
    }
    assert {r for r in refs if r.startswith(gen.PREFIX)} == set(gen.ROOTS), refs


def _nodes(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        return [node] + [n for value in node.values() for n in _nodes(value)]
    if isinstance(node, list):
        return [n for value in node for n in _nodes(value)]
    return []
