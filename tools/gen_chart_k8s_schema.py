"""Write the Kubernetes objects the chart's values pass through into values.schema.json's ``$defs``.

Some values are Kubernetes objects the chart copies into its pods as they are (``resources``,
``affinity``, ``tolerations``, ``securityContext``, ``extraVolumes``...). Without a schema of their
own, ``helm lint`` passed any shape there and the API server refused the install (issue 40: the
chart values fuzzer, tests/test_chart_fuzz.py). Their schemas are Kubernetes' own: the strict
definitions kubernetes-validate ships for the version the chart's tests validate against (every
object closed, ``additionalProperties: false``), with each definition they reference, and without
their descriptions (the schema's size). The values refer to them by ``$ref``.

    .venv/bin/python tools/gen_chart_k8s_schema.py           # rewrites the $defs in place
    .venv/bin/python tools/gen_chart_k8s_schema.py --check   # 1 if the committed file is not current

tests/test_chart_fuzz.py runs the check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

KUBERNETES = "1.33.0"  # the version tests/test_chart.py validates the renders against
PREFIX = "io.k8s."
SCHEMA = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "modelserver" / "values.schema.json"
ROOTS = tuple(
    f"io.k8s.api.core.v1.{name}"
    for name in (
        "ResourceRequirements", "Affinity", "Toleration", "SecurityContext", "PodSecurityContext",
        "Volume", "VolumeMount", "LocalObjectReference", "EnvVar",
    )
)  # fmt: skip


def definitions() -> dict[str, Any]:
    import kubernetes_validate  # the test set-up's (scripts/install test)

    path = (
        Path(kubernetes_validate.__file__).parent
        / "kubernetes-json-schema"
        / f"v{KUBERNETES}-local-strict"
        / "_definitions.json"
    )
    return dict(json.loads(path.read_text())["$defs"])


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"].rsplit("/", 1)[-1]] if isinstance(node.get("$ref"), str) else []
        return own + [r for key, value in node.items() if key != "$ref" for r in _refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in _refs(value)]
    return []


def _bare(node: Any) -> Any:
    """Without descriptions; references point into values.schema.json's own ``$defs``."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "description" and isinstance(value, str):
                continue
            if key == "$ref" and isinstance(value, str):
                out[key] = "#/$defs/" + value.rsplit("/", 1)[-1]
            else:
                out[key] = _bare(value)
        return out
    if isinstance(node, list):
        return [_bare(value) for value in node]
    return node


def closure(defs: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    stack = list(ROOTS)
    while stack:
        name = stack.pop()
        if name not in found:
            found[name] = _bare(defs[name])
            stack += _refs(defs[name])
    return dict(sorted(found.items()))


def rewritten(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    kept = {k: v for k, v in schema["$defs"].items() if not k.startswith(PREFIX)}
    return {**schema, "$defs": {**kept, **closure(defs)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if values.schema.json is not current")
    args = parser.parse_args()
    schema = json.loads(SCHEMA.read_text())
    text = json.dumps(rewritten(schema, definitions()), indent=2, ensure_ascii=False) + "\n"
    if args.check:
        current = text == SCHEMA.read_text()
        print("values.schema.json is current" if current else "values.schema.json is not current: run me")
        return 0 if current else 1
    SCHEMA.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
