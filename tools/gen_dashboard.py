"""Generate the Grafana dashboard the chart ships (deploy/helm/modelserver/dashboards/cachemgr.json).

The dashboard is code, not hand-edited JSON: each panel is a title, a unit and its PromQL here,
and this script lays them out in Grafana's dashboard model (schemaVersion 39), one row per role
(a repeated row over the ``role`` variable: prefill and decode have a volume each). Every query
uses only metric names cachemgr's status port exports (tests/test_monitoring.py holds them to a
real scrape) and the labels the chart's PodMonitor puts on them (``namespace``,
``app_kubernetes_io_instance``, ``app_kubernetes_io_component``, ``pod``).

    python tools/gen_dashboard.py          # write the file
    python tools/gen_dashboard.py --check  # exit 1 if the committed file is not what this makes
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "modelserver" / "dashboards" / "cachemgr.json"
UID = "cachemgr-compile-cache"
# This release's series, in the role the row repeats over.
SEL = 'namespace="$namespace",app_kubernetes_io_instance="$release",app_kubernetes_io_component=~"$role"'
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    stacked: bool = False
    kind: str = "timeseries"


def q(expr: str, legend: str) -> Query:
    return Query(expr.replace("SEL", SEL), legend)


PANELS: tuple[Panel, ...] = (
    Panel(
        "Pods by phase",
        "cachemgr's phase in each serving pod: resolving, waiting on a peer's compile, compiling, "
        "publishing, launching the server, serving.",
        "short",
        (q("sum by (phase) (cachemgr_phase{SEL} == 1)", "{{phase}}"),),
        stacked=True,
    ),
    Panel(
        "Starts: hits, misses, compiles, waits",
        "Of the pods running now: starts that found a published entry (hits), that found none "
        "(misses), compiles they published, and pods waiting on a peer's compile now.",
        "short",
        (
            q("sum(cachemgr_cache_hits_total{SEL})", "hits"),
            q("sum(cachemgr_cache_misses_total{SEL})", "misses"),
            q("sum(cachemgr_compiles_total{SEL})", "compiles"),
            q('count(cachemgr_phase{SEL,phase="waiting"} == 1) or vector(0)', "waiting now"),
        ),
    ),
    Panel(
        "Compile progress",
        "Bytes each compiling pod has staged, of what its compile is expected to write.",
        "percentunit",
        (q("cachemgr_compile_staging_bytes{SEL} / cachemgr_compile_expected_bytes{SEL}", "{{pod}}"),),
    ),
    Panel(
        "Compile ETA",
        "How long each compile under way has left, by an earlier compile of its model and compiler "
        "on the volume (none: nothing to learn from yet); below zero, it runs past that.",
        "s",
        (
            q(
                "cachemgr_compile_expected_seconds{SEL} - (time() - cachemgr_phase_started_timestamp_seconds{SEL})",
                "{{pod}}",
            ),
        ),
    ),
    Panel(
        "Compile without progress",
        "Seconds since each compile last used CPU, wrote or printed; at --stall-timeout the pod is "
        "restarted (1 = stalled).",
        "s",
        (
            q("cachemgr_compile_no_progress_seconds{SEL}", "{{pod}}"),
            q("max(cachemgr_compile_stalled{SEL})", "stalled"),
        ),
    ),
    Panel(
        "Compile time saved",
        "Compile seconds the running pods did not spend (the entry's compile time on a hit, less "
        "the wait), against the seconds they spent compiling.",
        "s",
        (
            q("sum(cachemgr_saved_seconds_total{SEL})", "saved"),
            q("sum(cachemgr_compile_seconds_total{SEL})", "spent compiling"),
            q("sum(cachemgr_lease_wait_seconds_total{SEL})", "spent waiting"),
        ),
    ),
    Panel(
        "Volume space by generation",
        "The role's volume: bytes of each generation's entries (compiler, vllm-rbln), the free "
        "space, and the largest entry (the room the next compile needs).",
        "bytes",
        (
            q("max by (generation) (cachemgr_generation_bytes{SEL})", "{{generation}}"),
            q("min(cachemgr_volume_free_bytes{SEL})", "free"),
            q("max(cachemgr_cache_largest_entry_bytes{SEL})", "largest entry"),
            q("max(cachemgr_volume_size_bytes{SEL})", "size"),
        ),
    ),
    Panel(
        "Refusals and failures",
        "Entries refused (damaged, untrusted), hits whose server compiled anyway, and failed runs "
        "by reason, of the running pods.",
        "short",
        (
            q("sum(cachemgr_damaged_entries_total{SEL})", "damaged"),
            q("sum(cachemgr_untrusted_entries_total{SEL})", "untrusted"),
            q("sum(cachemgr_recompiled_on_hit_total{SEL})", "recompiled on hit"),
            q("sum by (reason) (cachemgr_failures_total{SEL}) > 0", "failed: {{reason}}"),
        ),
    ),
    Panel(
        "Remote tier",
        "Downloads that replaced a compile, uploads, bytes downloaded, and failures by problem.",
        "short",
        (
            q("sum(cachemgr_remote_hits_total{SEL})", "downloads"),
            q("sum(cachemgr_remote_uploads_total{SEL})", "uploads"),
            q("sum by (problem) (cachemgr_remote_failures_total{SEL})", "failed: {{problem}}"),
        ),
    ),
    Panel(
        "Remote bytes",
        "Bytes downloaded from the remote tier by the running pods.",
        "bytes",
        (q("sum(cachemgr_remote_bytes_total{SEL})", "downloaded"),),
    ),
)


def panel_json(panel: Panel, ident: int, x: int, y: int) -> dict[str, Any]:
    custom: dict[str, Any] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
    if panel.stacked:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        "id": ident,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {
                "datasource": DATASOURCE,
                "expr": query.expr,
                "legendFormat": query.legend,
                "refId": chr(ord("A") + i),
            }
            for i, query in enumerate(panel.queries)
        ],
    }


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "sort": 1,
        "includeAll": name == "role",
        "multi": name == "role",
        "current": {},
    }


def dashboard() -> dict[str, Any]:
    row = {
        "id": 1,
        "type": "row",
        "title": "$role",
        "repeat": "role",
        "collapsed": False,
        "gridPos": {"h": 1, "w": 24, "x": 0, "y": 0},
        "panels": [],
    }
    panels = [row] + [
        panel_json(panel, ident=i + 2, x=12 * (i % 2), y=1 + 8 * (i // 2)) for i, panel in enumerate(PANELS)
    ]
    return {
        "uid": UID,
        "title": "cachemgr: compile cache",
        "description": "Generated by tools/gen_dashboard.py; do not edit by hand.",
        "tags": ["cachemgr", "rbln"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                },
                variable("namespace", "Namespace", "label_values(cachemgr_info, namespace)"),
                variable(
                    "release",
                    "Release",
                    'label_values(cachemgr_info{namespace="$namespace"}, app_kubernetes_io_instance)',
                ),
                variable(
                    "role",
                    "Role",
                    'label_values(cachemgr_info{namespace="$namespace",app_kubernetes_io_instance="$release"}, '
                    "app_kubernetes_io_component)",
                ),
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed file is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is out of date: run python tools/gen_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
