"""What the chart gives the operator, by the real Helm 4: NOTES, warm Jobs as pre-upgrade hooks,
the toolbox, and the metrics port and PodMonitor (issue 32, items 3, 6 and 9).

``helm upgrade`` runs offline through Helm's own upgrade action (cachemgr_testkit.helm_upgrade:
a previous release in Helm's memory driver, a stand-in for the API server's discovery), so the
hooks are the ones Helm itself sorts out of the release. The workloads run as real processes
in tests/test_deploy_modes.py.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from cachemgr_testkit.helm import TEST_IMAGE, install_notes, template_text
from cachemgr_testkit.helm_upgrade import upgrade
from cachemgr_testkit.kube import ENTRYPOINT, by_kind, container, merge, pod_spec, render, venv_tool, workload

from cachemgr.cli.main import build_parser

ROOT = Path(__file__).parents[1]
ROLES = ("prefill", "decode")
WARM = {"prefill": {"warm": True}, "decode": {"warm": True}}
HOOK = merge(WARM, {"warm": {"hook": True}})
RWO = {
    "storage": {"compileCache": {"accessModes": ["ReadWriteOnce"]}},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
}
TRUSTED = ["builder-1:7Hy+1Hr7O+3xKVnKafnKcp/iKblqbVBadtH1dbt3xnY="]
TOOLBOX = {"toolbox": {"enabled": True}}
MONITOR = {"metrics": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}}}}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chart-ops")


def existing(*roles: str) -> dict[str, Any]:
    """The roles' PVCs as lookup would find them at an upgrade (testing.existingClaims)."""
    claims = {
        f"modelserver-{role}-compile-cache": {
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "200Gi"}}}
        }
        for role in roles
    }
    return {"testing": {"existingClaims": claims}}


def notes(values: dict[str, Any], work: Path, namespace: str = "serving") -> str:
    return install_notes(merge(TEST_IMAGE, values), work=work, namespace=namespace)


def flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


# --- NOTES ------------------------------------------------------------------------------------------


def test_every_kubectl_line_of_the_notes_names_the_namespace(work: Path) -> None:
    for values in ({}, merge(HOOK, TOOLBOX), merge(RWO, {"prefill": {"replicas": 0}})):
        text = notes(values, work)
        commands = [line.strip() for line in text.splitlines() if line.strip().startswith("kubectl ")]
        assert commands, text
        for command in commands:
            assert command.split()[2:4] == ["-n", "serving"], command


def test_the_notes_name_the_pvcs_the_usage_command_and_mark_rwo_unverified(work: Path) -> None:
    default = notes({}, work, namespace="default")
    assert "compile cache PVC modelserver-prefill-compile-cache (200Gi, ReadWriteMany)" in default
    assert "kubectl exec -n default deploy/modelserver-prefill -- cachemgr du" in default
    assert "helm.sh/resource-policy: keep" in default
    assert "Unverified" not in default
    assert "restarts and scale-out then load the compiled model only" in flat(default)
    rwo = notes(merge(RWO, {"prefill": {"replicas": 0}}), work)
    assert 'storage.compileCache.accessModes ["ReadWriteOnce"]: Unverified' in rwo
    assert "prefill: 0 replicas: no Deployment and no compile cache PVC" in rwo


def test_readwriteonce_notes_promise_no_scale_out(work: Path) -> None:
    text = flat(notes(RWO, work))
    assert "scale-out" not in text.replace("No scale-out", ""), text
    assert "No scale-out: the volume attaches to one node" in text


def test_notes_give_the_compile_time_measured_only_for_the_model_it_was_measured_for(work: Path) -> None:
    """Issue 40: the NOTES said "about 11 minutes for MiniMax-M2.7" whatever model the values serve."""
    assert "compiles (about 11 minutes for MiniMax-M2.7), once per role" in flat(notes({}, work))
    other = ["vllm", "serve", "meta-llama/Llama-3.1-8B", "--model-impl", "vllm"]
    for values in ({"decode": {"args": other}}, {"prefill": {"args": other}, "decode": {"args": other}}):
        text = flat(notes(values, work))
        assert "11 minutes" not in text, text
        assert "MiniMax" not in text, text
        assert "compiles (as long as its model takes), once per role" in text
    # A role at 0 serves nothing: the one that runs decides.
    text = flat(notes({"prefill": {"replicas": 0, "args": other}}, work))
    assert "compiles (about 11 minutes for MiniMax-M2.7)" in text


def test_notes_with_both_roles_at_zero_say_nothing_runs(work: Path) -> None:
    text = flat(notes({"prefill": {"replicas": 0}, "decode": {"replicas": 0}}, work))
    assert "Nothing runs: prefill.replicas and decode.replicas are both 0" in text
    assert "compiles (about 11 minutes" not in text, "nothing will compile"
    assert "kubectl exec" not in text, "no pod to exec into"
    assert "kubectl logs" not in text, "no pod to read"


# --- warm Jobs as pre-upgrade hooks (warm.hook) ------------------------------------------------------


def jobs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {job["metadata"]["name"]: job for job in by_kind(docs, "Job")}


def test_install_keeps_the_plain_warm_jobs_under_warm_hook(work: Path) -> None:
    """pre-install would run before the PVC exists: an install renders the plain, digest-named Jobs."""
    for values in (HOOK, merge(HOOK, existing(*ROLES))):
        found = jobs(render(work, values))
        assert sorted(found) == sorted(jobs(render(work, WARM))), "the same Jobs as without the hook"
        for job in found.values():
            assert "helm.sh/hook" not in job["metadata"].get("annotations", {})


def test_helm_upgrade_runs_the_warm_jobs_as_pre_upgrade_hooks(work: Path) -> None:
    """Through Helm's own upgrade action: a role whose PVC exists gets its Job as a pre-upgrade
    hook (not a release object); a role whose PVC this upgrade makes keeps the plain Job."""
    installed = merge(TEST_IMAGE, WARM)
    upgraded = upgrade(
        installed,
        merge(merge(installed, HOOK), merge(existing("prefill"), {"image": {"tag": "sdk-0.13"}})),
        work=work / "up",
    )
    hooks = {hook["name"]: hook for hook in upgraded["hooks"]}
    assert sorted(hooks) == ["modelserver-prefill-warm"]
    hook = hooks["modelserver-prefill-warm"]
    assert (hook["kind"], hook["events"], hook.get("weight", 0)) == ("Job", ["pre-upgrade"], 0)
    assert hook["delete_policies"] == ["before-hook-creation"], "kept after it ends, for its logs"
    manifest = [doc for doc in yaml.safe_load_all(upgraded["manifest"]) if doc]
    (plain,) = by_kind(manifest, "Job")
    assert plain["metadata"]["name"].startswith("modelserver-decode-warm-")
    text = flat(upgraded["info"]["notes"])
    assert "Pre-upgrade hooks this time (warm.hook): prefill." in text
    assert "decode: a plain Job beside the rollout (its PVC is new in this upgrade" in text
    assert "kubectl logs -n default job/modelserver-prefill-warm | grep rollout_space" in text
    # Without warm.hook, an upgrade has no hook.
    plain_upgrade = upgrade(installed, merge(installed, existing(*ROLES)), work=work / "up-plain")
    assert not plain_upgrade.get("hooks")


def test_the_hook_job_is_the_warm_job_under_a_fixed_name(work: Path) -> None:
    values = merge(TEST_IMAGE, merge(HOOK, existing(*ROLES)))
    result = template_text(values, work=work, extra=("--is-upgrade",))
    assert result.returncode == 0, result.stderr
    hooked = jobs([doc for doc in yaml.safe_load_all(result.stdout) if doc])
    plain = jobs(render(work, WARM))
    assert sorted(hooked) == ["modelserver-decode-warm", "modelserver-prefill-warm"]
    for role in ROLES:
        job = hooked[f"modelserver-{role}-warm"]
        assert job["metadata"]["annotations"] == {
            "helm.sh/hook": "pre-upgrade",
            "helm.sh/hook-weight": "0",
            "helm.sh/hook-delete-policy": "before-hook-creation",
            "helm.sh/hook-output-log-policy": "hook-failed",
        }
        # The same pod, the same key; but the hook knows it is one (issue 40): its full volume's
        # remedy says what works before any pod rolls.
        spec, plain_spec = job["spec"], workload(list(plain.values()), "Job", role)["spec"]
        env = container(job)["env"]
        assert {"name": "CACHEMGR_WARM_HOOK", "value": "pre-upgrade"} in env
        assert all(
            e["name"] != "CACHEMGR_WARM_HOOK"
            for e in container(workload(list(plain.values()), "Job", role))["env"]
        )
        env.remove({"name": "CACHEMGR_WARM_HOOK", "value": "pre-upgrade"})
        assert spec == plain_spec, "the same pod, the same key"
    # The longest release name still fits a label value (the Job's name labels its pods).
    long = template_text(values | {}, work=work, release="r" * 53, extra=("--is-upgrade",))
    assert long.returncode == 0, long.stderr


def test_the_readme_says_what_the_hook_needs_and_what_a_failure_leaves() -> None:
    readme = flat((ROOT / "deploy" / "helm" / "modelserver" / "README.md").read_text())
    section = readme[readme.index("Before the rollout: warm Jobs as pre-upgrade hooks") :]
    section = section[: section.index("## Trust")]
    for phrase in (
        "--timeout 45m",
        "its default, 5m",
        "pre-upgrade hooks failed",
        "the old Deployments and their pods serve on, untouched",
        "kubectl logs job/RELEASE-ROLE-warm",
        "Argo CD",
        "PreSync",
        "Flux",
        "spec.timeout",
        "rollout_space",
    ):
        assert phrase in section, phrase


# --- the toolbox ------------------------------------------------------------------------------------------


def toolboxes(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["labels"]["app.kubernetes.io/component"].removesuffix("-toolbox"): d
        for d in by_kind(docs, "Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"].endswith("-toolbox")
    }


def test_the_toolbox_is_the_image_without_an_npu_on_the_roles_pvc_read_write(work: Path) -> None:
    trust = {"trust": {"trustedKeys": TRUSTED, "signingKeySecret": {"name": "k"}}}
    docs = render(work, merge(merge(WARM, trust), TOOLBOX))
    boxes = toolboxes(docs)
    assert sorted(boxes) == sorted(ROLES)
    for role, box in boxes.items():
        assert box["metadata"]["name"] == f"modelserver-toolbox-{role}"
        assert box["spec"]["replicas"] == 1
        spec = container(box)
        serving = container(workload(docs, "Deployment", role))
        assert spec["image"] == serving["image"]
        assert spec["command"] == ["cachemgr-toolbox"]
        assert (ENTRYPOINT / "cachemgr-toolbox").is_file(), "the image's script (COPY entrypoint/)"
        assert "args" not in spec
        assert spec["resources"] == {
            "requests": {"cpu": "100m", "memory": "256Mi"},
            "limits": {"memory": "2Gi"},
        }
        assert "rebellions.ai/npu" not in str(spec["resources"]), "no NPU"
        assert "nodeSelector" not in pod_spec(box), "not held to the NPU nodes"
        mounts = [m for m in spec["volumeMounts"] if m["name"] == "compile-cache"]
        assert mounts == [{"name": "compile-cache", "mountPath": "/var/cache/cachemgr"}], "read-write"
        (claim,) = [v for v in pod_spec(box)["volumes"] if "persistentVolumeClaim" in v]
        assert claim["persistentVolumeClaim"] == {"claimName": f"modelserver-{role}-compile-cache"}
        env = {e["name"]: e.get("value") for e in spec["env"]}
        served = {e["name"]: e.get("value") for e in serving["env"]}
        for name in ("CACHEMGR_ROLE", "CACHEMGR_CACHE_ROOT", "CACHEMGR_NPU_TYPE", "CACHEMGR_TRUSTED_KEYS"):
            assert env[name] == served[name], name
        assert not {"CACHEMGR_SIGNING_KEY_FILE", "CACHEMGR_RUN_ARGS", "VLLM_RBLN_COMPILE_ONLY"} & set(env)
        assert not {"ports", "livenessProbe", "readinessProbe"} & set(spec), "it serves nothing"
    assert not toolboxes(render(work, WARM)), "opt-in"
    assert sorted(toolboxes(render(work, merge(TOOLBOX, {"decode": {"replicas": 0}})))) == ["prefill"]


def test_the_notes_give_the_toolbox_commands_and_they_parse(work: Path) -> None:
    text = notes(TOOLBOX, work)
    lines = [line.strip() for line in text.splitlines() if "deploy/modelserver-toolbox-" in line]
    assert len(lines) == 4, text
    parser = build_parser()
    for line in lines:
        assert line.startswith("kubectl exec -n serving deploy/modelserver-toolbox-"), line
        command = line.split(" -- ", 1)[1].split()
        assert command[0] == "cachemgr"
        parser.parse_args(command[1:])


# --- metrics: the status port on the Service, the PodMonitor ------------------------------------------------


def test_the_service_carries_the_status_port(work: Path) -> None:
    docs = render(work, {"cachemgr": {"statusPort": 9191}})
    for service in by_kind(docs, "Service"):
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        assert ports["cachemgr"] == {"name": "cachemgr", "port": 9191, "targetPort": "cachemgr"}
        role = service["metadata"]["labels"]["app.kubernetes.io/component"]
        named = {
            p["name"]: p["containerPort"] for p in container(workload(docs, "Deployment", role))["ports"]
        }
        assert named["cachemgr"] == 9191


def test_the_podmonitor_scrapes_every_serving_pod_and_nothing_else(work: Path) -> None:
    """kubernetes-validate knows no CRD: the PodMonitor is held to what it must match instead."""
    docs = render(work, merge(merge(WARM, TOOLBOX), MONITOR))
    (monitor,) = by_kind(docs, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kps"
    spec = monitor["spec"]
    selector = spec["selector"]
    (expression,) = selector["matchExpressions"]

    def selected(doc: dict[str, Any]) -> bool:
        labels = doc["spec"]["template"]["metadata"]["labels"]
        return all(labels.get(k) == v for k, v in selector["matchLabels"].items()) and (
            labels.get(expression["key"]) in expression["values"]
        )

    picked = [
        d["metadata"]["name"] for d in [*by_kind(docs, "Deployment"), *by_kind(docs, "Job")] if selected(d)
    ]
    assert sorted(picked) == ["modelserver-decode", "modelserver-prefill"]
    (endpoint,) = spec["podMetricsEndpoints"]
    for role in ROLES:
        ports = {p["name"] for p in container(workload(docs, "Deployment", role))["ports"]}
        assert endpoint["port"] in ports
    status_server = (ROOT / "cachemgr" / "runtime" / "status_server.py").read_text()
    assert f'route == "{endpoint["path"]}"' in status_server, "the path cachemgr serves its metrics on"
    assert spec["podTargetLabels"] == ["app.kubernetes.io/instance", "app.kubernetes.io/component"]
    assert not by_kind(render(work, WARM), "PodMonitor"), "opt-in"
    zero = render(work, merge(MONITOR, {"prefill": {"replicas": 0}, "decode": {"replicas": 0}}))
    assert not by_kind(zero, "PodMonitor"), "no pods, nothing to scrape"


def test_the_chart_labels_stay_the_charts_in_the_podmonitor(work: Path) -> None:
    values = merge(
        MONITOR, {"metrics": {"podMonitor": {"labels": {"app.kubernetes.io/name": "x", "team": "a"}}}}
    )
    result = template_text(merge(TEST_IMAGE, values), work=work)
    assert result.returncode == 0, result.stderr
    (monitor,) = by_kind([d for d in yaml.safe_load_all(result.stdout) if d], "PodMonitor")
    assert monitor["metadata"]["labels"]["app.kubernetes.io/name"] == "modelserver"
    assert monitor["metadata"]["labels"]["team"] == "a"
    block = result.stdout[result.stdout.index("kind: PodMonitor") :]
    assert block.count("app.kubernetes.io/name:") == 2, "once in the labels, once in the selector"


def test_new_objects_pass_kubernetes_validate_strict(work: Path) -> None:
    values = merge(TEST_IMAGE, merge(merge(HOOK, TOOLBOX), existing(*ROLES)))
    result = template_text(values, work=work, extra=("--is-upgrade",))
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert len(by_kind(docs, "Job")) == 2
    assert len(by_kind(docs, "Deployment")) == 4
    path = work / "hook-and-toolbox.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    checked = subprocess.run(
        [venv_tool("kubernetes-validate"), "--strict", "--kubernetes-version", "1.33.0", str(path)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count(" passed for resource ") == len(docs), checked.stdout
