"""The chart's alerts, recording rules and dashboard (issue 41), held to the real tools.

- the PrometheusRule's shape (kubernetes-validate knows no CRD): what kube-prometheus-stack's
  ruleSelector needs, a summary, a description with a command that parses, and a severity on
  every alert, thresholds from the values;
- ``promtool check rules`` on the rendered rules;
- ``promtool test rules``: each alert fired (and not fired) from series real ``cachemgr run`` pods
  exported, taken from a real scrape of their status ports;
- the dashboard is tools/gen_dashboard.py's output, and every metric name the rules and the
  dashboard use is in a real scrape;
- a real Prometheus (Debian's package) scraping real pods on a small tmpfs volume, evaluating the
  chart's rules: the hit-that-compiled and the volume-nearly-full alerts fire.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cachemgr_testkit.kube import by_kind, merge, render
from cachemgr_testkit.monitoring import (
    MONITORING,
    RELEASE,
    Sample,
    find,
    metric_names,
    prometheus,
    prometheus_rule,
    rules_file,
    scrape,
    target_labels,
    tool,
)
from cachemgr_testkit.podlib import Cluster, Pod, cluster, free_port, status_port, wait_for
from cachemgr_testkit.scenarios import vllm_argv

from cachemgr.cli.main import build_parser

ROOT = Path(__file__).parents[1]
DASHBOARD = ROOT / "deploy" / "helm" / "modelserver" / "dashboards" / "cachemgr.json"
ALERTS = {
    "CachemgrRecompiledOnHit",
    "CachemgrCompileStalled",
    "CachemgrCompileFailing",
    "CachemgrNextCompileWontFit",
    "CachemgrNextGenerationWontFit",
    "CachemgrVolumeNearlyFull",
    "CachemgrDamagedEntries",
    "CachemgrUntrustedEntries",
    "CachemgrRemoteFailing",
    "CachemgrLeaseWaitTooLong",
}
BY = ("namespace", "app_kubernetes_io_instance", "app_kubernetes_io_component")
STATUS = ["--status-port", "0"]
VLLM = ("--model-impl", "vllm")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("monitoring")


@pytest.fixture(scope="module")
def rule(work: Path) -> dict[str, Any]:
    return prometheus_rule(work)


def alerts_of(rule: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r}


def records_of(rule: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["record"]: r for group in rule["spec"]["groups"] for r in group["rules"] if "record" in r}


# --- the PrometheusRule's shape ------------------------------------------------------------------


def test_every_alert_says_what_it_means_what_to_do_and_how_bad(rule: dict[str, Any]) -> None:
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["metadata"]["namespace"] == "default"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack", "what its ruleSelector matches"
    alerts = alerts_of(rule)
    assert set(alerts) == ALERTS
    parser = build_parser()
    named = 0
    for name, alert in alerts.items():
        assert set(alert) == {"alert", "expr", "for", "labels", "annotations"}, name
        assert alert["labels"]["severity"] in ("warning", "critical"), name
        assert re.fullmatch(r"([0-9]+[smhd])+", alert["for"]), name
        annotations = alert["annotations"]
        assert set(annotations) == {"summary", "description"}, name
        assert len(annotations["summary"]) < 160, name
        text = rendered(annotations["description"], {"key": "0123456789abcdef0123456789abcdef", "pod": "p"})
        assert re.search(r"kubectl (?:logs|exec) ", text), f"{name}: its description names no command"
        commands = re.findall(r"cachemgr ([a-z]+(?: (?:--?[a-z-]+|[0-9]+[a-z]|[0-9a-f]{32}|KEY))*)", text)
        named += len(commands)
        for command in commands:
            parser.parse_args(shlex.split(command.replace("KEY", "0123abcd")))  # an unknown option fails
        for label in re.findall(r"\$labels\.(\w+)", json.dumps(annotations)):
            assert label in (*BY, "pod", "key", "problem"), (name, label)
        selectors = re.findall(r"cachemgr_[a-z_]+\{([^}]*)\}", alert["expr"])
        assert selectors, name
        for selector in selectors:
            assert 'namespace="default",app_kubernetes_io_instance="modelserver"' in selector, (
                name,
                selector,
            )
    assert named >= 15, "the cachemgr commands the descriptions give, each parsed"


def test_thresholds_durations_severities_and_labels_come_from_the_values(work: Path) -> None:
    values = {
        "metrics": {
            "prometheusRule": {
                "namespace": "monitoring",
                "labels": {"release": "kps", "app.kubernetes.io/name": "taken"},
                "alertLabels": {"team": "inference"},
                "selector": 'cluster="eu-1",namespace="serving"',
                "alerts": {
                    "volumeNearlyFull": {"freeRatio": 0.25, "for": "3m", "severity": "critical"},
                    "compileFailing": {"count": 5, "window": "6h"},
                    "leaseWaitTooLong": {"factor": 4, "fallbackSeconds": 600},
                    "remoteFailing": {"severity": ""},
                },
            }
        }
    }
    rule = prometheus_rule(work, values)
    assert rule["metadata"]["namespace"] == "monitoring"
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["metadata"]["labels"]["app.kubernetes.io/name"] == "modelserver", (
        "the chart's own label stays"
    )
    alerts = alerts_of(rule)
    assert "CachemgrRemoteFailing" not in alerts, "an empty severity drops the alert"
    full = alerts["CachemgrVolumeNearlyFull"]
    assert full["expr"].endswith("< 0.25")
    assert (full["for"], full["labels"]) == ("3m", {"severity": "critical", "team": "inference"})
    assert "[6h])) >= 5" in alerts["CachemgrCompileFailing"]["expr"]
    assert "(4 * max by" in alerts["CachemgrLeaseWaitTooLong"]["expr"]
    assert "> 600 unless" in alerts["CachemgrLeaseWaitTooLong"]["expr"]
    for alert in alerts.values():
        for selector in re.findall(r"cachemgr_[a-z_]+\{([^}]*)\}", alert["expr"]):
            assert selector.startswith('cluster="eu-1",namespace="serving"'), selector


def test_commands_that_change_the_volume_run_where_it_is_writable(work: Path) -> None:
    """A read-only serving pod (trust's builder mode) cannot prune: with a toolbox, the alerts send
    the volume's commands there; the pod's own questions (show, verify, logs) stay with the pod."""
    toolbox = "deploy/modelserver-toolbox-{{ $labels.app_kubernetes_io_component }} -- cachemgr"
    for values, where in (({}, "deploy/modelserver-{{"), ({"toolbox": {"enabled": True}}, toolbox)):
        alerts = alerts_of(prometheus_rule(work, merge(values, {"prefill": {"replicas": 1}})))
        for name in ("CachemgrVolumeNearlyFull", "CachemgrNextCompileWontFit", "CachemgrDamagedEntries"):
            description = " ".join(alerts[name]["annotations"]["description"].split())
            assert where in description, (name, description)
        recompiled = " ".join(alerts["CachemgrRecompiledOnHit"]["annotations"]["description"].split())
        assert "{{ $labels.pod }} -- cachemgr show" in recompiled
        assert f"{where.split(' -- ')[0]}" in recompiled.split("cachemgr show")[1]


def test_no_rule_without_pods_and_none_unless_asked(work: Path) -> None:
    assert not by_kind(render(work, {}), "PrometheusRule")
    assert not by_kind(render(work, {}), "ConfigMap")
    none = render(work, merge(MONITORING, {"prefill": {"replicas": 0}, "decode": {"replicas": 0}}))
    assert not by_kind(none, "PrometheusRule"), "no pods, no series"


@pytest.mark.parametrize("case", ["ratio", "severity", "duration", "selector", "unknown"])
def test_bad_alert_values_are_refused_naming_the_key(case: str, work: Path) -> None:
    from cachemgr_testkit.helm import refusal

    alerts = {
        "ratio": {"volumeNearlyFull": {"freeRatio": 2}},
        "severity": {"compileStalled": {"severity": "Page Me"}},
        "duration": {"compileFailing": {"window": "1 hour"}},
        "selector": {},
        "unknown": {"volumeFull": {"severity": "warning"}},
    }[case]
    rule: dict[str, Any] = {"enabled": True, "alerts": alerts}
    if case == "selector":
        rule["selector"] = 'namespace="x"}) or vector(1'
    message = refusal(merge(MONITORING, {"metrics": {"prometheusRule": rule}}), work=work)
    assert "metrics" in message, message
    assert "prometheusRule" in message, message


def test_the_recording_rules_answer_what_operators_ask(rule: dict[str, Any]) -> None:
    records = records_of(rule)
    assert set(records) == {
        "cachemgr:cache_hit_ratio:pods",
        "cachemgr:saved_seconds:pods",
        "cachemgr:compile_seconds:pods",
        "cachemgr:compiles:per_key",
        "cachemgr:generation_bytes:max",
        "cachemgr:volume_free_bytes:min",
    }
    for name, record in records.items():
        assert all(f"{label}" in record["expr"] for label in BY), name


def test_promtool_checks_the_rendered_rules(work: Path, rule: dict[str, Any]) -> None:
    checked = subprocess.run(
        [tool("promtool"), "check", "rules", str(rules_file(work, rule))],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alerts_of(rule)) + len(records_of(rule))} rules found" in checked.stdout


# --- real pods: their scrapes --------------------------------------------------------------------


def compiled_then_drifted(
    pods: Cluster, root: Path, *, cold_env: dict[str, str] | None = None
) -> tuple[Pod, Pod]:
    """A pod that compiles and serves, then one that hits its entry and whose server compiles
    anyway (the stand-in finds graphs missing from the bundle: recompiled_on_hit)."""
    cold = pods.start("cold", vllm_argv(free_port(), *VLLM), cache_root=root, options=STATUS, env=cold_env)
    cold.wait_phase("serving")
    extra = {"STANDIN_EXTRA_GRAPHS": "1"}
    drifted = pods.start("drifted", vllm_argv(free_port(), *VLLM), cache_root=root, options=STATUS, env=extra)
    return cold, drifted


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[Sample]]]:
    """Scrapes of real pods in each state the alerts watch: one that compiled and serves (its remote
    unreachable: it counted failures), one whose server compiled on a hit, one whose compile is
    stalled (with an expected time learned from the first), and one waiting on it."""
    work = tmp_path_factory.mktemp("pods")
    root = work / "cache"
    root.mkdir()
    remote = {
        "CACHEMGR_REMOTE": "s3://cache/prod",
        "CACHEMGR_REMOTE_ENDPOINT": f"http://127.0.0.1:{free_port()}",
    }
    env = {"HF_HOME": str(work / "hf"), "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"}
    with cluster(work, **env) as pods:
        cold, drifted = compiled_then_drifted(pods, root, cold_env=remote)
        other = vllm_argv(free_port(), *VLLM, "--max-model-len", "2048")
        stall = [*STATUS, "--stall-timeout", "2s"]
        stalled = pods.start("stalled", other, cache_root=root, options=stall, env={"STANDIN_HANG": "1"})
        stalled.wait_phase("compiling")
        waiter = pods.start("waiter", other, cache_root=root, options=STATUS)
        waiter.wait_phase("waiting")
        ports = {pod.name: status_port(pod) for pod in (cold, drifted, stalled, waiter)}

        def settled() -> dict[str, list[Sample]] | None:
            found = {name: scrape(port) for name, port in ports.items()}
            named = {name: {s.name: s.value for s in samples} for name, samples in found.items()}
            ready = (
                named["drifted"].get("cachemgr_recompiled_on_hit_total") == 1
                and named["stalled"].get("cachemgr_compile_stalled") == 1
                and "cachemgr_remote_failures_total" in named["cold"]
                and "cachemgr_generation_bytes" in named["cold"]
            )
            return found if ready else None

        yield wait_for(settled, timeout=60, what="the pods to reach the states the alerts watch", every=0.5)


def test_every_metric_the_rules_and_the_dashboard_use_is_in_a_real_scrape(
    rule: dict[str, Any], scrapes: dict[str, list[Sample]]
) -> None:
    scraped = {s.name for samples in scrapes.values() for s in samples}
    used = {
        name
        for r in (*alerts_of(rule).values(), *records_of(rule).values())
        for name in metric_names(r["expr"])
    }
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for t in panel.get("targets", [])
        for name in metric_names(t["expr"])
    }
    queried |= {
        name for v in dashboard["templating"]["list"] for name in metric_names(json.dumps(v.get("query")))
    }
    assert len(used) > 15
    assert len(queried) > 20
    assert sorted((used | queried) - scraped) == []


# --- promtool test rules: each alert from the pods' real series ----------------------------------


def timeline(*values: float | None) -> str:
    """promtool's values: one a minute, '_' for no sample."""
    return " ".join("_" if v is None else repr(float(v)) for v in values)


def alerts_series(name: str, labels: dict[str, str], severity: str) -> str:
    everything = {"alertname": name, "alertstate": "firing", "severity": severity, **labels}
    return "ALERTS{" + ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(everything.items())) + "}"


def firing(name: str, at: str, *labelled: dict[str, str], severity: str = "warning") -> dict[str, Any]:
    """A promql_expr_test: at ``at``, exactly these firing alerts of ``name`` (none if none given)."""
    return {
        "expr": f'ALERTS{{alertname="{name}",alertstate="firing"}}',
        "eval_time": at,
        "exp_samples": [{"labels": alerts_series(name, labels, severity), "value": 1} for labels in labelled],
    }


def rendered(text: str, labels: dict[str, str]) -> str:
    """Prometheus's template for annotations that use only $labels (YAML folded the lines)."""
    return re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), text)


def role_labels() -> dict[str, str]:
    return {k: v for k, v in target_labels("x").items() if k in BY}


def unit_tests(scrapes: dict[str, list[Sample]], rule: dict[str, Any]) -> list[dict[str, Any]]:
    """One promtool test group per alert, each from series of the pods' real scrapes."""
    cold, drifted, stalled, waiter = (scrapes[n] for n in ("cold", "drifted", "stalled", "waiter"))
    pod = {name: target_labels(name) for name in scrapes}

    def series(sample: Sample, name: str, values: str) -> dict[str, str]:
        return {"series": sample.series(**pod[name]), "values": values}

    tests: list[dict[str, Any]] = []
    # A hit whose server compiled: its counter, and cachemgr_info for the key.
    recompiled, info = find(drifted, "cachemgr_recompiled_on_hit_total"), find(drifted, "cachemgr_info")
    key = dict(info.labels)["key"]
    assert recompiled.value == 1
    assert re.fullmatch(r"[0-9a-f]{32}", key)
    labels = {**role_labels(), "pod": "drifted", "key": key}
    alert = alerts_of(rule)["CachemgrRecompiledOnHit"]
    tests.append(
        {
            "name": "a hit that compiled",
            "input_series": [
                series(recompiled, "drifted", timeline(0, 0, *[recompiled.value] * 4)),
                series(info, "drifted", timeline(*[info.value] * 6)),
            ],
            "promql_expr_test": [firing(alert["alert"], "1m"), firing(alert["alert"], "3m", labels)],
            "alert_rule_test": [
                {
                    "eval_time": "3m",
                    "alertname": alert["alert"],
                    "exp_alerts": [
                        {
                            "exp_labels": {**labels, "severity": "warning"},
                            "exp_annotations": {
                                k: rendered(v, labels) for k, v in alert["annotations"].items()
                            },
                        }
                    ],
                }
            ],
        }
    )
    # A stalled compile: seen once within the window is enough (liveness restarts the pod soon).
    stall = find(stalled, "cachemgr_compile_stalled")
    assert stall.value == 1
    pod_labels = {**role_labels(), "pod": "stalled"}
    tests.append(
        {
            "name": "a stalled compile",
            "input_series": [series(stall, "stalled", timeline(0, 0, 1, None, None, 0, 0))],
            "promql_expr_test": [
                firing("CachemgrCompileStalled", "1m"),
                firing("CachemgrCompileStalled", "5m", pod_labels, severity="critical"),
            ],
        }
    )
    failed = find(stalled, "cachemgr_failures_total", reason="compile-failed")
    tests.append(
        {
            "name": "a compile failing again and again",
            "input_series": [series(failed, "stalled", timeline(failed.value, 0, 0, 1, 1, 1, 2, 2, 2))],
            "promql_expr_test": [
                firing("CachemgrCompileFailing", "4m"),
                firing("CachemgrCompileFailing", "8m", pod_labels, severity="critical"),
            ],
        }
    )
    # The volume: free space against the largest entry, a generation, the size.
    free, size = find(cold, "cachemgr_volume_free_bytes"), find(cold, "cachemgr_volume_size_bytes")
    largest = find(cold, "cachemgr_cache_largest_entry_bytes")
    (generation,) = [s for s in cold if s.name == "cachemgr_generation_bytes"]
    assert largest.value == generation.value > 0
    for name, bar, hold in (
        ("CachemgrNextCompileWontFit", largest, 15),
        ("CachemgrNextGenerationWontFit", generation, 30),
        ("CachemgrVolumeNearlyFull", size, 10),
    ):
        low = (bar.value - 1) if bar is not size else size.value * 0.05
        # Room at first whatever this machine's disk (the pods' volume) holds now, then low.
        steps = [max(free.value, size.value / 2)] * 3 + [low] * (hold + 5)
        tests.append(
            {
                "name": f"the volume: {name}",
                "input_series": [
                    series(free, "cold", timeline(*steps)),
                    series(bar, "cold", timeline(*[bar.value] * len(steps))),
                    *(
                        [series(size, "cold", timeline(*[size.value] * len(steps)))]
                        if bar is not size
                        else []
                    ),
                ],
                "promql_expr_test": [
                    firing(name, f"{hold}m"),  # low since 3m: not yet held for long enough
                    firing(name, f"{hold + 4}m", role_labels()),
                ],
            }
        )
    # Refused entries: a pod that counts one later in its life, and one that counted at its start
    # (a new series born at 1: no increase Prometheus could see); both stop after the window.
    for name, metric in (
        ("CachemgrDamagedEntries", "cachemgr_damaged_entries_total"),
        ("CachemgrUntrustedEntries", "cachemgr_untrusted_entries_total"),
    ):
        refused = find(cold, metric)
        born = Sample(metric, refused.labels, 1)
        later = timeline(refused.value, 0, 0, *[1] * 70)
        at_start = timeline(None, None, *[born.value] * 71)
        severity = "critical" if name == "CachemgrUntrustedEntries" else "warning"
        tests.append(
            {
                "name": f"refused: {name}",
                "input_series": [series(refused, "cold", later), series(born, "drifted", at_start)],
                "promql_expr_test": [
                    firing(name, "1m"),
                    firing(
                        name,
                        "5m",
                        {**role_labels(), "pod": "cold"},
                        {**role_labels(), "pod": "drifted"},
                        severity=severity,
                    ),
                    firing(name, "70m"),
                ],
            }
        )
    (remote,) = [s for s in cold if s.name == "cachemgr_remote_failures_total"]
    problem = dict(remote.labels)["problem"]
    assert remote.value >= 1
    tests.append(
        {
            "name": "the remote tier failing",
            "input_series": [
                series(remote, "cold", timeline(None, None, *[remote.value] * 70)),
                series(remote, "drifted", timeline(None, None, None, *[1] * 69)),
            ],
            "promql_expr_test": [
                firing("CachemgrRemoteFailing", "1m"),
                firing("CachemgrRemoteFailing", "4m", {**role_labels(), "problem": problem}),
                firing("CachemgrRemoteFailing", "70m"),
            ],
        }
    )
    # A wait on a peer's compile: against the compile's expected time (here 10 min), or the fallback.
    waiting, since = (
        find(waiter, "cachemgr_phase", phase="waiting"),
        find(waiter, "cachemgr_phase_started_timestamp_seconds"),
    )
    expected = find(stalled, "cachemgr_compile_expected_seconds")
    assert waiting.value == 1
    assert expected.value > 0
    minutes = 140
    wait = [
        series(waiting, "waiter", timeline(*[1] * minutes)),
        series(since, "waiter", timeline(*[0] * minutes)),  # began at the test's time 0
    ]
    waiter_labels = dict(pod["waiter"].items())
    tests.append(
        {
            "name": "a wait far longer than a compile takes",
            "input_series": [*wait, series(expected, "stalled", timeline(*[600] * minutes))],
            "promql_expr_test": [
                firing("CachemgrLeaseWaitTooLong", "22m"),  # past 2 x 10 min since 20m: not held 5m
                firing("CachemgrLeaseWaitTooLong", "26m", waiter_labels),
            ],
        }
    )
    tests.append(
        {
            "name": "a wait with nothing to say how long a compile takes",
            "input_series": wait,
            "promql_expr_test": [
                firing("CachemgrLeaseWaitTooLong", "60m"),
                firing("CachemgrLeaseWaitTooLong", "126m", waiter_labels),
            ],
        }
    )
    # The recording rules over the two serving pods as scraped: one compiled (a miss), one hit.
    names = (
        "cachemgr_cache_hits_total",
        "cachemgr_cache_misses_total",
        "cachemgr_saved_seconds_total",
        "cachemgr_compile_seconds_total",
        "cachemgr_compiles_total",
        "cachemgr_info",
        "cachemgr_volume_free_bytes",
    )
    scraped = {(n, name): find(scrapes[n], name) for n in ("cold", "drifted") for name in names}
    assert (
        scraped["cold", "cachemgr_cache_misses_total"].value
        == scraped["drifted", "cachemgr_cache_hits_total"].value
        == 1
    )
    assert scraped["cold", "cachemgr_compiles_total"].value == 1

    def total(name: str) -> float:
        return sum(scraped[n, name].value for n in ("cold", "drifted"))

    def record(name: str, value: float, **extra: str) -> dict[str, Any]:
        labels = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted({**role_labels(), **extra}.items()))
        return {
            "expr": name,
            "eval_time": "4m",
            "exp_samples": [{"labels": f"{name}{{{labels}}}", "value": value}],
        }

    tests.append(
        {
            "name": "the recording rules",
            "input_series": [
                *(series(sample, n, timeline(*[sample.value] * 5)) for (n, _), sample in scraped.items()),
                series(generation, "cold", timeline(*[generation.value] * 5)),
                series(generation, "drifted", timeline(*[generation.value] * 5)),
            ],
            "promql_expr_test": [
                record("cachemgr:cache_hit_ratio:pods", 0.5),
                record("cachemgr:saved_seconds:pods", total("cachemgr_saved_seconds_total")),
                record("cachemgr:compile_seconds:pods", total("cachemgr_compile_seconds_total")),
                record("cachemgr:compiles:per_key", 1, key=key),
                record(
                    "cachemgr:generation_bytes:max",
                    generation.value,
                    generation=dict(generation.labels)["generation"],
                ),
                record(
                    "cachemgr:volume_free_bytes:min",
                    min(scraped[n, "cachemgr_volume_free_bytes"].value for n in ("cold", "drifted")),
                ),
            ],
        }
    )
    # Healthy pods as scraped: nothing fires. Their volume is this machine's disk, whose fullness is
    # not the pods' state: its free space is shown as half its size (a disk 80 % used fired
    # VolumeNearlyFull here).
    size = next(s.value for s in cold if s.name == "cachemgr_volume_size_bytes")

    def healthy(s: Sample) -> float:
        return size / 2 if s.name == "cachemgr_volume_free_bytes" else s.value

    tests.append(
        {
            "name": "the pods as scraped, healthy",
            "input_series": [
                series(s, "cold", timeline(*[healthy(s)] * 20))
                for s in cold
                if s.name.startswith("cachemgr_") and s.name not in ("cachemgr_remote_failures_total",)
            ],
            "promql_expr_test": [{"expr": "ALERTS", "eval_time": "19m", "exp_samples": []}],
        }
    )
    return tests


def test_promtool_fires_each_alert_from_the_pods_real_series(
    work: Path, rule: dict[str, Any], scrapes: dict[str, list[Sample]]
) -> None:
    tests = unit_tests(scrapes, rule)
    covered = {
        t["expr"].split('"')[1]
        for case in tests
        for t in case["promql_expr_test"]
        if "alertname" in t["expr"]
    }
    assert covered == ALERTS
    rules = rules_file(work, rule, "unit-rules.yaml")
    path = work / "unit-tests.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "rule_files": [rules.name],
                "evaluation_interval": "1m",
                "tests": [{"interval": "1m", **t} for t in tests],
            }
        )
    )
    result = subprocess.run(
        [tool("promtool"), "test", "rules", path.name], cwd=work, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout, result.stdout


# --- the dashboard -------------------------------------------------------------------------------


def test_the_dashboard_is_what_its_generator_makes() -> None:
    checked = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_dashboard.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stderr


def test_the_dashboard_configmap_is_labelled_for_the_grafana_sidecar(work: Path) -> None:
    (config,) = by_kind(render(work, MONITORING), "ConfigMap")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config["data"]["cachemgr.json"])
    assert dashboard == json.loads(DASHBOARD.read_text())
    titles = [p["title"] for p in dashboard["panels"]]
    for asked in ("phase", "hits", "progress", "ETA", "saved", "generation", "Refusals", "Remote"):
        assert any(asked in title for title in titles), asked
    assert dashboard["panels"][0]["repeat"] == "role", "a row per role"
    moved = render(
        work,
        merge(
            MONITORING,
            {
                "metrics": {
                    "grafanaDashboard": {
                        "namespace": "monitoring",
                        "labels": {"dash": "yes", "grafana_dashboard": None},
                    }
                }
            },
        ),
    )
    (config,) = by_kind(moved, "ConfigMap")
    assert config["metadata"]["namespace"] == "monitoring"
    assert config["metadata"]["labels"]["dash"] == "yes"
    assert "grafana_dashboard" not in config["metadata"]["labels"], (
        "null drops the default (the README says so)"
    )


# --- a real Prometheus ---------------------------------------------------------------------------


def test_a_real_prometheus_fires_on_real_pods(work: Path, tmpfs_small: Any, tmp_path: Path) -> None:
    """Two pods on a volume about one entry large: the first compiles and fills it, the second hits
    and its server compiles anyway. Prometheus scrapes both every second and evaluates the chart's
    rules (their `for:` shortened by the values)."""
    volume = tmpfs_small(1_150_000)
    quick = {"for": "0m"}
    rule = prometheus_rule(
        work,
        {"metrics": {"prometheusRule": {"alerts": {"volumeNearlyFull": quick, "nextCompileWontFit": quick}}}},
    )
    rules = rules_file(tmp_path, rule)
    with cluster(tmp_path, HF_HOME=str(tmp_path / "hf")) as pods:
        cold, drifted = compiled_then_drifted(pods, volume)
        drifted.wait_phase("serving")
        targets = {pod.name: status_port(pod) for pod in (cold, drifted)}
        with prometheus(tmp_path, targets, rules) as server:

            def fired() -> dict[str, list[dict[str, Any]]] | None:
                alerts = server.firing()
                wanted = {"CachemgrRecompiledOnHit", "CachemgrVolumeNearlyFull", "CachemgrNextCompileWontFit"}
                return alerts if wanted <= set(alerts) else None

            try:
                alerts = wait_for(fired, timeout=45, every=0.5, what="the alerts to fire")
            except AssertionError as error:  # what Prometheus and the pods show at the deadline
                raise AssertionError(f"{error}\n{_state(server, pods)}") from None
    (hit,) = alerts["CachemgrRecompiledOnHit"]
    assert hit["labels"]["pod"] == "drifted"
    assert re.fullmatch(r"[0-9a-f]{32}", hit["labels"]["key"])
    assert f"cachemgr prune --key {hit['labels']['key']} --yes" in hit["annotations"]["description"]
    (full,) = alerts["CachemgrVolumeNearlyFull"]
    assert full["labels"]["app_kubernetes_io_component"] == "prefill"
    assert full["labels"]["app_kubernetes_io_instance"] == RELEASE
    assert "% free" in full["annotations"]["summary"]
    assert "deploy/modelserver-prefill -- cachemgr du" in full["annotations"]["description"]
    assert "CachemgrCompileStalled" not in alerts


def _state(server: Any, pods: Cluster) -> str:
    try:
        firing = sorted(server.firing())
    except OSError as error:
        firing = [f"(no answer: {error})"]
    return f"firing: {firing}\n{server.tail()}\n" + "\n".join(f"{p.name}: {p.phase}" for p in pods.pods)


def test_docs_kubernetes_md_names_each_alert_with_its_severity_and_installs_what_it_says(
    work: Path, rule: dict[str, Any]
) -> None:
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    section = text[text.index("## Alerts and the dashboard") : text.index("## Logs")]
    documented = dict(re.findall(r"^\| `(Cachemgr\w+)` \((\w+)\) \|", section, re.M))
    assert documented == {name: alert["labels"]["severity"] for name, alert in alerts_of(rule).items()}
    for record in records_of(rule):
        assert f"`{record}`" in section, record
    (command,) = re.findall(r"```sh\n(helm upgrade --install .*?)```", section, re.DOTALL)
    words = shlex.split(command.replace("\\\n", " "))
    values: dict[str, Any] = {}
    for setting in (words[i + 1] for i, word in enumerate(words) if word == "--set"):
        path, value = setting.split("=", 1)
        node = values
        *parents, last = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value == "true" if value in ("true", "false") else value
    docs = render(work, values)
    (shown,) = by_kind(docs, "PrometheusRule")
    assert shown["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert by_kind(docs, "PodMonitor")[0]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (config,) = by_kind(docs, "ConfigMap")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
