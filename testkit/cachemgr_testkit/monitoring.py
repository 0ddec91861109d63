"""The chart's monitoring against real tools: its rules and dashboard, real scrapes of real pods,
promtool, and a real Prometheus server (Debian's ``prometheus`` package; scripts/test installs it).

A scrape here is what the PodMonitor would store: the pod's own samples, plus the target labels
the PodMonitor adds (``namespace``, ``pod``, ``job``, and ``podTargetLabels``: the release and the
role as ``app_kubernetes_io_instance`` and ``app_kubernetes_io_component``).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from cachemgr_testkit.kube import by_kind, render
from cachemgr_testkit.podlib import LOOPBACK, free_port, status_get, wait_for

RELEASE = "modelserver"
NAMESPACE = "default"  # cachemgr_testkit.helm renders into it


def target_labels(pod: str, role: str = "prefill") -> dict[str, str]:
    """The labels the chart's PodMonitor puts on every series of ``pod``."""
    return {
        "namespace": NAMESPACE,
        "pod": pod,
        "job": f"{NAMESPACE}/{RELEASE}",
        "app_kubernetes_io_instance": RELEASE,
        "app_kubernetes_io_component": role,
    }


def tool(name: str) -> str:
    """promtool or prometheus from Debian's package; absent, the caller's test cannot run."""
    found = shutil.which(name)
    if found is None:
        raise AssertionError(f"{name} is not installed: apt-get install prometheus (scripts/test does)")
    return found


# --- the chart's rules and dashboard ---------------------------------------------------------------


MONITORING = {
    "metrics": {
        "podMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "grafanaDashboard": {"enabled": True},
    }
}


def prometheus_rule(work: Path, values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    from cachemgr_testkit.kube import merge

    (rule,) = by_kind(render(work, merge(MONITORING, dict(values or {}))), "PrometheusRule")
    return rule


def rules_file(work: Path, rule: dict[str, Any], name: str = "rules.yaml") -> Path:
    """The PrometheusRule's spec as the Operator hands it to Prometheus: a rule file of its groups."""
    path = work / name
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path


def metric_names(expr: str) -> set[str]:
    """cachemgr's metric names in a PromQL expression (not recording rules' names, not labels)."""
    return set(re.findall(r"\bcachemgr_[a-z_]+[a-z]\b", expr))


# --- scrapes ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def series(self, **extra: str) -> str:
        """``name{labels}`` in PromQL/promtool notation, with ``extra`` labels added."""
        labels = {**dict(self.labels), **extra}
        inside = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
        return f"{self.name}{{{inside}}}"


def scrape(port: int) -> list[Sample]:
    """One scrape of a pod's /metrics through prometheus_client's parser."""
    code, text = status_get(port, "/metrics")
    assert code == 200, text
    return [
        Sample(s.name, tuple(sorted(s.labels.items())), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def find(samples: list[Sample], name: str, **labels: str) -> Sample:
    """The one sample of ``name`` with ``labels``: a series the unit tests use must be a real one."""
    found = [
        s for s in samples if s.name == name and all(dict(s.labels).get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples in the scrape"
    return found[0]


# --- a real Prometheus -----------------------------------------------------------------------------


@dataclass
class Prometheus:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    def api(self, path: str) -> Any:
        with LOOPBACK.open(f"http://127.0.0.1:{self.port}{path}", timeout=5) as reply:
            data = json.loads(reply.read())
        assert data["status"] == "success", data
        return data["data"]

    def firing(self) -> dict[str, list[dict[str, str]]]:
        """Firing alerts by name: each one's labels."""
        alerts: dict[str, list[dict[str, str]]] = {}
        for alert in self.api("/api/v1/alerts")["alerts"]:
            if alert["state"] == "firing":
                alerts.setdefault(alert["labels"]["alertname"], []).append(alert)
        return alerts

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


@contextlib.contextmanager
def prometheus(
    work: Path, targets: Mapping[str, int], rules: Path, *, every: str = "1s"
) -> Iterator[Prometheus]:
    """A Prometheus server on loopback (a free port, its own data dir), scraping ``targets``
    (pod name -> status port) with the PodMonitor's labels, evaluating ``rules``."""
    port = free_port()
    config = {
        "global": {"scrape_interval": every, "evaluation_interval": every, "scrape_timeout": every},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {
                "job_name": "cachemgr",
                "metrics_path": "/metrics",
                "static_configs": [
                    {"targets": [f"127.0.0.1:{status}"], "labels": target_labels(pod)}
                    for pod, status in targets.items()
                ],
            }
        ],
    }
    path = work / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    check = subprocess.run(
        [tool("promtool"), "check", "config", str(path)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr
    log = work / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                tool("prometheus"),
                f"--config.file={path}",
                f"--storage.tsdb.path={work / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--web.enable-lifecycle",
            ],
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    server = Prometheus(port, proc, log)
    try:
        wait_for(lambda: _ready(server), timeout=30, what=f"Prometheus to be ready:\n{server.tail()}")
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _ready(server: Prometheus) -> bool:
    if server.proc.poll() is not None:
        raise AssertionError(f"prometheus exited with {server.proc.returncode}:\n{server.tail()}")
    try:
        with LOOPBACK.open(f"http://127.0.0.1:{server.port}/-/ready", timeout=2) as reply:
            return int(reply.status) == 200
    except OSError:
        return False
