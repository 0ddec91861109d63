"""deploy/helm/modelserver, rendered by the real Helm 4, held to the compile cache page fact by fact.

Every render here is ``helm template`` (or ``helm lint``, ``helm install --dry-run=client``) of the
chart in this checkout, offline: no cluster, so ``lookup`` answers nothing. The refusals of a
smaller size or other access modes on an existing PVC (what ``helm install``/``helm upgrade``
check through ``lookup``) run through the same template helper with ``testing.existingClaims``
standing in for the API server's answer; the chart's README says what that does and does not
exercise. The chart's workloads are run as real processes in tests/test_deploy.py.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from cachemgr_testkit.helm import CHART, TEST_IMAGE, helm, refusal, template_text, values_file
from cachemgr_testkit.kube import by_kind, container, merge, pod_spec, render, role_of, venv_tool, workload

from cachemgr.cli.main import build_parser, split_server_argv
from cachemgr.core.units import parse_size

ROLES = ("prefill", "decode")
Docs = list[dict[str, Any]]
WARM = {"prefill": {"warm": True}, "decode": {"warm": True}}
RWO = {
    "storage": {"compileCache": {"accessModes": ["ReadWriteOnce"]}},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
}
EXISTING = "modelserver-prefill-compile-cache"
# A real public key, as `cachemgr keys generate --name builder-1` printed it (32 bytes).
TRUSTED = ["builder-1:7Hy+1Hr7O+3xKVnKafnKcp/iKblqbVBadtH1dbt3xnY="]
TRUST = merge(
    WARM,
    {
        "trust": {
            "trustedKeys": TRUSTED,
            "signingKeySecret": {"name": "modelserver-signing-key", "key": "signing.key"},
            "readOnlyServing": True,
        }
    },
)
REMOTE = {
    "remote": {
        "url": "s3://modelserver-compile-cache/prod",
        "endpoint": "https://s3.example.internal",
        "credentialsSecret": "modelserver-remote-credentials",
    },
    "serviceAccount": {
        "create": True,
        "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/compile-cache"},
    },
}

# The matrix every render check runs over: the issue's list, and each optional part switched on.
MATRIX: dict[str, dict[str, Any]] = {
    "defaults": {},
    "prefill-0": {"prefill": {"replicas": 0}},
    "decode-0": {"decode": {"replicas": 0}},
    "rwo-one-pod": RWO,
    "size-and-class": {"storage": {"compileCache": {"size": "1.5Ti", "storageClassName": "juicefs-sc"}}},
    "warm-on": WARM,
    "warm-prefill-only": {"prefill": {"warm": True}},
    "remote": merge(WARM, REMOTE),
    "trust": TRUST,
    "options": {
        "cachemgr": {"onMiss": "fail", "stallTimeout": "15m", "extraArgs": ["--wait-timeout", "2h"]},
        "prefill": {"extraEnv": [{"name": "VLLM_RBLN_USE_VLLM_MODEL", "value": "1"}], "warm": True},
        "storage": {"tmp": {"sizeLimit": "500Gi"}, "home": {"sizeLimit": "20Gi"}},
        "image": {"digest": "sha256:" + "ab" * 32},
        "tolerations": [{"key": "rebellions.ai/npu", "operator": "Exists", "effect": "NoSchedule"}],
        "extraVolumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
        "extraVolumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
        "podAnnotations": {"example.com/team": "inference"},
        "metrics": {"prometheusAnnotations": False},
    },
    "signed": merge(TRUST, {"trust": {"readOnlyServing": False}}),
    "toolbox-and-monitor": merge(
        WARM,
        {
            "toolbox": {"enabled": True},
            "metrics": {
                "podMonitor": {"enabled": True, "interval": "30s", "labels": {"release": "kps"}},
                "prometheusRule": {"enabled": True, "labels": {"release": "kps"}},
                "grafanaDashboard": {"enabled": True},
            },
        },
    ),
}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chart")


@pytest.fixture(scope="module")
def renders(work: Path) -> dict[str, Docs]:
    """Each matrix case rendered once for the module."""
    return {name: render(work, values) for name, values in MATRIX.items()}


def claims(docs: Docs) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in by_kind(docs, "PersistentVolumeClaim")}


def claim_of(doc: dict[str, Any]) -> str:
    volumes = {v["name"]: v for v in pod_spec(doc)["volumes"]}
    name: str = volumes["compile-cache"]["persistentVolumeClaim"]["claimName"]
    return name


def env_of(doc: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(doc)["env"] if "value" in e}


def existing_claim(
    size: str = "200Gi", modes: list[str] | None = None, cls: str = "juicefs-sc"
) -> dict[str, Any]:
    """A PVC as the API server returns it to ``lookup`` (spec filled in, status bound)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": EXISTING, "namespace": "default"},
        "spec": {
            "accessModes": modes or ["ReadWriteMany"],
            "resources": {"requests": {"storage": size}},
            "storageClassName": cls,
            "volumeMode": "Filesystem",
            "volumeName": "pvc-3f1c",
        },
        "status": {"phase": "Bound", "capacity": {"storage": size}},
    }


def with_existing(values: dict[str, Any], claim: dict[str, Any]) -> dict[str, Any]:
    return merge(values, {"testing": {"existingClaims": {EXISTING: claim}}})


# --- the page, fact by fact --------------------------------------------------------------------------


@dataclass(frozen=True)
class Fact:
    """One fact of docs/compile-cache.en.md, the values that exercise it, and what the render holds."""

    page: tuple[str, ...]  # the page's words, as they stand in docs/compile-cache.en.md
    values: dict[str, Any]
    holds: Callable[[Docs], None]
    extra: dict[str, Any] = field(default_factory=dict)


def one_pvc_per_role(docs: Docs) -> None:
    assert sorted(claims(docs)) == [f"modelserver-{r}-compile-cache" for r in ("decode", "prefill")]
    assert sorted(role_of(c) for c in claims(docs).values()) == sorted(ROLES)


def replicas_share_their_roles_pvc(docs: Docs) -> None:
    for role in ROLES:
        deployment = workload(docs, "Deployment", role)
        # One claim in the pod template: every replica mounts the same PVC, none gets its own.
        assert "volumeClaimTemplates" not in deployment["spec"]
        assert claim_of(deployment) == f"modelserver-{role}-compile-cache"
        assert claim_of(workload(docs, "Job", role)) == claim_of(deployment), (
            "the warm Job fills the same PVC"
        )


def target_configuration(docs: Docs) -> None:
    assert {role_of(d): d["spec"]["replicas"] for d in by_kind(docs, "Deployment")} == {
        "prefill": 2,
        "decode": 2,
    }


def role_without_pods(role: str) -> Callable[[Docs], None]:
    other = {"prefill": "decode", "decode": "prefill"}[role]

    def holds(docs: Docs) -> None:
        assert {role_of(d) for d in docs if "app.kubernetes.io/component" in d["metadata"]["labels"]} == {
            other
        }
        assert list(claims(docs)) == [f"modelserver-{other}-compile-cache"]

    return holds


def pvc_spec(size: str, modes: list[str], cls: str | None) -> Callable[[Docs], None]:
    def holds(docs: Docs) -> None:
        for claim in claims(docs).values():
            assert claim["spec"]["resources"]["requests"]["storage"] == size
            assert claim["spec"]["accessModes"] == modes
            assert claim["spec"].get("storageClassName") == cls

    return holds


def kept_by_uninstall(docs: Docs) -> None:
    for claim in claims(docs).values():
        assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    for doc in docs:
        if doc["kind"] != "PersistentVolumeClaim":
            assert "helm.sh/resource-policy" not in doc["metadata"].get("annotations", {}), doc["kind"]


def rwo_one_pod_recreate(docs: Docs) -> None:
    pvc_spec("200Gi", ["ReadWriteOnce"], None)(docs)
    for deployment in by_kind(docs, "Deployment"):
        assert deployment["spec"]["replicas"] == 1
        # A rolling update would start the new pod while the old one holds the volume.
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert by_kind(docs, "Job") == []


def rwx_rolls_with_surge(docs: Docs) -> None:
    for deployment in by_kind(docs, "Deployment"):
        assert deployment["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        }


def key_takes_the_images_versions(docs: Docs) -> None:
    for doc in [*by_kind(docs, "Deployment"), *by_kind(docs, "Job")]:
        names = {e["name"] for e in container(doc)["env"]}
        for pinned in (
            "CACHEMGR_COMPILER_VERSION",
            "CACHEMGR_VLLM_VERSION",
            "CACHEMGR_VLLM_RBLN_VERSION",
            "CACHEMGR_OPTIMUM_RBLN_VERSION",
            "CACHEMGR_TRANSFORMERS_VERSION",
        ):
            assert pinned not in names, (doc["metadata"]["name"], pinned)
        assert container(doc)["image"] == "registry.example.com/modelserver-cachemgr:sdk-0.12"


def probes_follow_progress(docs: Docs) -> None:
    """The page's rule (a start budget longer than the first compile) does not hold with the chart:
    startup passes while cachemgr makes progress, and its budget covers only the process start."""
    eleven_minutes = 11 * 60
    for deployment in by_kind(docs, "Deployment"):
        spec = container(deployment)
        startup = spec["startupProbe"]
        assert startup["exec"]["command"] == ["cachemgr", "probe", "startup"]
        assert spec["livenessProbe"]["exec"]["command"] == ["cachemgr", "probe", "live"]
        assert spec["readinessProbe"]["exec"]["command"][:3] == ["cachemgr", "probe", "ready"]
        assert startup["periodSeconds"] * startup["failureThreshold"] < eleven_minutes


FACTS = {
    "one PVC per role": Fact(
        ("The chart makes one compile cache PVC for prefill and one for decode.",), {}, one_pvc_per_role
    ),
    "replicas share their role's PVC": Fact(
        ("Replicas of the same P/D role share one PVC.",), WARM, replicas_share_their_roles_pvc
    ),
    "target configuration": Fact(("2 prefill Pods and 2 decode Pods",), {}, target_configuration),
    "prefill with 0 replicas": Fact(
        ("A P/D role with 0 replicas gets no PVC.",),
        merge(WARM, {"prefill": {"replicas": 0}}),
        role_without_pods("prefill"),
    ),
    "decode with 0 replicas": Fact(
        ("A P/D role with 0 replicas gets no PVC.",),
        merge(WARM, {"decode": {"replicas": 0}}),
        role_without_pods("decode"),
    ),
    "defaults of size and accessModes": Fact(
        ("| storage.compileCache.size | 200Gi |", '| storage.compileCache.accessModes | ["ReadWriteMany"] |'),
        {},
        pvc_spec("200Gi", ["ReadWriteMany"], None),
    ),
    "a size and StorageClass decided before installing": Fact(
        ("Decide the PVC's size and accessModes before installing.",),
        {"storage": {"compileCache": {"size": "1.5Ti", "storageClassName": "juicefs-sc"}}},
        pvc_spec("1.5Ti", ["ReadWriteMany"], "juicefs-sc"),
    ),
    "RWX shares across nodes": Fact(
        ("With ReadWriteMany (RWX), Pods of the same P/D role on different nodes share the compile cache.",),
        {},
        rwx_rolls_with_surge,
    ),
    "RWO with one pod each": Fact(
        (
            'Then set storage.compileCache.accessModes to ["ReadWriteOnce"] and run prefill and decode with '
            "one Pod each.",
        ),
        RWO,
        rwo_one_pod_recreate,
    ),
    "kept by helm uninstall": Fact(
        (
            "helm uninstall does not delete the compile cache PVCs: the chart sets helm.sh/resource-policy: keep",
        ),
        WARM,
        kept_by_uninstall,
    ),
    "the compiler version is the image's": Fact(
        (
            "Replacing the modelserver image with one of another SDK version changes the RBLN Compiler version.",
        ),
        WARM,
        key_takes_the_images_versions,
    ),
    "the start budget": Fact(
        ("The modelserver Pod's start budget must be longer than the first compile.",),
        {},
        probes_follow_progress,
    ),
}


@pytest.mark.parametrize("fact", list(FACTS))
def test_each_fact_of_the_page_holds_in_the_render(fact: str, work: Path) -> None:
    page = (Path(__file__).parents[1] / "docs" / "compile-cache.en.md").read_text()
    the = FACTS[fact]
    words = re.sub(r"\s+", " ", page.replace("`", ""))
    for part in the.page:
        assert part in words, f"the page no longer says: {part}"
    the.holds(render(work, the.values))


def test_a_reinstall_under_the_release_name_finds_its_pvcs(work: Path) -> None:
    """PVC names derive from the release name alone: no value moves them, another release has its own."""
    names = {
        name: sorted(claims(render(work, values)))
        for name, values in MATRIX.items()
        if name not in ("prefill-0", "decode-0")
    }
    assert set(map(tuple, names.values())) == {
        ("modelserver-decode-compile-cache", "modelserver-prefill-compile-cache")
    }
    other = render(work, {}, release="prod")
    assert sorted(claims(other)) == ["prod-decode-compile-cache", "prod-prefill-compile-cache"]


def test_two_renders_of_one_release_are_identical(work: Path) -> None:
    for values in (MATRIX["defaults"], MATRIX["trust"], MATRIX["options"]):
        first = template_text(merge(TEST_IMAGE, values), work=work / "a")
        second = template_text(merge(TEST_IMAGE, values), work=work / "b")
        assert first.returncode == 0, first.stderr
        assert first.stdout == second.stdout


# --- helm install / upgrade against an existing PVC ---------------------------------------------------


def test_a_smaller_size_than_the_existing_pvc_is_refused_in_one_line(work: Path) -> None:
    message = refusal(with_existing({**TEST_IMAGE}, existing_claim("300Gi")), work=work)
    (line,) = [line for line in message.splitlines() if "storage.compileCache.size" in line]
    assert line.endswith(
        "storage.compileCache.size 200Gi is smaller than the existing PVC "
        "modelserver-prefill-compile-cache's 300Gi: a PVC can only grow. Set storage.compileCache.size "
        "to 300Gi or more (growing needs a StorageClass that allows volume expansion)"
    ), line
    # The same size, a larger one, or one written in other units: accepted.
    for size in ("300Gi", "0.5Ti", "322122547200", "330G", "3.3e11"):
        values = merge(TEST_IMAGE, {"storage": {"compileCache": {"size": size}}})
        assert template_text(with_existing(values, existing_claim("300Gi")), work=work).returncode == 0, size
    for size in ("299Gi", "322122547199", "3.2e11", "300G"):
        values = merge(TEST_IMAGE, {"storage": {"compileCache": {"size": size}}})
        assert "can only grow" in refusal(with_existing(values, existing_claim("300Gi")), work=work), size


def test_the_readme_shows_the_real_refusal(work: Path) -> None:
    readme = (CHART / "README.md").read_text()
    (shown,) = re.findall(r"```text\n\s*(storage\.compileCache\.size .*?)\n", readme)
    values = merge(TEST_IMAGE, {"storage": {"compileCache": {"size": "100Gi"}}})
    assert (
        refusal(with_existing(values, existing_claim("200Gi")), work=work)
        .splitlines()[0]
        .endswith(": " + shown)
    )


def test_other_access_modes_or_class_than_the_existing_pvc_are_refused(work: Path) -> None:
    values = merge(TEST_IMAGE, RWO)
    message = refusal(with_existing(values, existing_claim()), work=work)
    assert (
        'storage.compileCache.accessModes ["ReadWriteOnce"] differs from the existing PVC '
        'modelserver-prefill-compile-cache\'s ["ReadWriteMany"]: Kubernetes refuses changes to an existing '
        'PVC\'s spec. Set storage.compileCache.accessModes to ["ReadWriteMany"], or delete the PVC'
    ) in message
    values = merge(TEST_IMAGE, {"storage": {"compileCache": {"storageClassName": "ceph-sc"}}})
    assert "storage.compileCache.storageClassName ceph-sc differs from the existing PVC" in refusal(
        with_existing(values, existing_claim()), work=work
    )
    # The existing PVC's own settings pass (the cluster filled in the class: the chart left it out).
    assert template_text(with_existing(TEST_IMAGE, existing_claim()), work=work).returncode == 0


def test_helm_template_and_dry_run_do_not_check_the_existing_pvc(work: Path) -> None:
    """As the page says: with no cluster to ask, a smaller size renders (lookup returns nothing)."""
    small = merge(TEST_IMAGE, {"storage": {"compileCache": {"size": "1Gi"}}})
    assert template_text(small, work=work).returncode == 0
    dry = helm(
        "install",
        "modelserver",
        str(CHART),
        "--dry-run=client",
        "-f",
        str(values_file(work, small)),
        check=False,
    )
    assert dry.returncode == 0, dry.stderr
    # The template does ask: lookup is what feeds the check, under install and upgrade alike.
    checks = (CHART / "templates" / "_checks.tpl").read_text()
    assert 'lookup "v1" "PersistentVolumeClaim" .root.Release.Namespace .name' in checks


def test_the_lookup_stand_in_can_only_add_a_refusal() -> None:
    """A real PVC (lookup's answer) always wins over testing.existingClaims: the value cannot hide one."""
    checks = (CHART / "templates" / "_checks.tpl").read_text()
    helper = checks[checks.index('define "modelserver.existingClaim"') :]
    helper = helper[: helper.index("{{- end -}}\n\n")]
    assert helper.index("lookup") < helper.index("if not $found") < helper.index("testing.existingClaims")


# --- the matrix: lint, schemas, selectors, names, parsers -------------------------------------------------


def test_helm_lint_strict_passes_on_the_defaults_and_the_matrix(work: Path) -> None:
    for name, values in MATRIX.items():
        result = helm(
            "lint",
            "--strict",
            str(CHART),
            "-f",
            str(values_file(work, merge(TEST_IMAGE, values))),
            check=False,
        )
        assert result.returncode == 0, (name, result.stdout, result.stderr)
        assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout, (name, result.stdout)
    bare = helm("lint", "--strict", str(CHART), check=False)  # the chart's own defaults, nothing set
    assert bare.returncode == 0, bare.stdout + bare.stderr


def test_every_render_of_the_matrix_passes_kubernetes_validate_strict(work: Path) -> None:
    """Every object but the PodMonitor and the PrometheusRule, whose CRDs kubernetes-validate does not
    know: test_chart_ops checks the PodMonitor's selector and port against the pods instead, and
    test_monitoring the PrometheusRule's shape and, with promtool, its rules."""
    paths = []
    custom = 0
    for name, values in MATRIX.items():
        result = template_text(merge(TEST_IMAGE, values), work=work)
        assert result.returncode == 0, result.stderr
        docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
        known = [doc for doc in docs if not doc["apiVersion"].startswith("monitoring.coreos.com/")]
        custom += len(docs) - len(known)
        paths.append(work / f"render-{name}.yaml")
        paths[-1].write_text(yaml.safe_dump_all(known))
    assert custom == 2, "the matrix's one PodMonitor and one PrometheusRule"
    result = subprocess.run(
        [venv_tool("kubernetes-validate"), "--strict", "--kubernetes-version", "1.33.0", *map(str, paths)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fail" not in result.stdout.lower(), result.stdout
    objects = sum(1 for p in paths for doc in yaml.safe_load_all(p.read_text()) if doc)
    assert result.stdout.count(" passed for resource ") == objects, result.stdout


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def serving(docs: Docs) -> Docs:
    """The serving Deployments (component ROLE), not the toolboxes (ROLE-toolbox)."""
    return [d for d in by_kind(docs, "Deployment") if role_of(d) in ROLES]


def test_no_job_or_toolbox_pod_matches_a_serving_selector(renders: dict[str, Docs]) -> None:
    """kubectl exec deploy/RELEASE-ROLE, kubectl logs and the Service reach serving pods only."""
    jobs_seen = toolboxes_seen = 0
    for name, docs in renders.items():
        selectors = [d["spec"]["selector"]["matchLabels"] for d in serving(docs)]
        selectors += [d["spec"]["selector"] for d in by_kind(docs, "Service")]
        toolboxes = [d for d in by_kind(docs, "Deployment") if d not in serving(docs)]
        jobs_seen += len(by_kind(docs, "Job"))
        toolboxes_seen += len(toolboxes)
        for other in [*by_kind(docs, "Job"), *toolboxes]:
            labels = other["spec"]["template"]["metadata"]["labels"]
            for selector in selectors:
                assert not matches(selector, labels), (name, other["metadata"]["name"], selector)
        for deployment in by_kind(docs, "Deployment"):
            labels = deployment["spec"]["template"]["metadata"]["labels"]
            assert matches(deployment["spec"]["selector"]["matchLabels"], labels)
            others = [d for d in by_kind(docs, "Deployment") if d is not deployment]
            assert not [d for d in others if matches(d["spec"]["selector"]["matchLabels"], labels)]
    assert jobs_seen >= 8
    assert toolboxes_seen == 2


def test_names_fit_kubernetes_limits_for_the_longest_release(work: Path) -> None:
    release = "r" * 53  # Helm's longest release name
    docs = render(work, WARM, release=release)
    for doc in docs:
        name = doc["metadata"]["name"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
        limit = 253 if doc["kind"] in ("PersistentVolumeClaim", "Deployment") else 63
        assert len(name) <= limit, (doc["kind"], name)
    # A warm Job is named after what it compiles: a new image makes a new Job, the PVC stays.
    first = render(work, WARM)
    upgraded = render(work, merge(WARM, {"image": {"tag": "sdk-0.13"}}))
    assert [j["metadata"]["name"] for j in by_kind(first, "Job")] != [
        j["metadata"]["name"] for j in by_kind(upgraded, "Job")
    ]
    assert sorted(claims(first)) == sorted(claims(upgraded))
    replicas = render(work, merge(WARM, {"prefill": {"replicas": 3}}))
    assert [j["metadata"]["name"] for j in by_kind(first, "Job")] == [
        j["metadata"]["name"] for j in by_kind(replicas, "Job")
    ]


ENTRYPOINT_SUBCOMMAND = {"cachemgr-entrypoint": "run", "cachemgr-warm": "warm"}


def test_the_argv_and_env_the_chart_gives_cachemgr_parse_with_its_own_parser(
    renders: dict[str, Docs],
) -> None:
    parser = build_parser()
    for name, docs in renders.items():
        for doc in [*serving(docs), *by_kind(docs, "Job")]:
            spec = container(doc)
            (script,) = spec["command"]
            server = spec["args"]
            assert server[:2] == ["vllm", "serve"], (name, server)
            run_args = shlex.split(env_of(doc).get("CACHEMGR_RUN_ARGS", ""))
            own, after = split_server_argv([ENTRYPOINT_SUBCOMMAND[script], *run_args, "--", *server])
            assert after == server
            args = parser.parse_args(own)
            assert args.command == ENTRYPOINT_SUBCOMMAND[script]
            assert env_of(doc)["CACHEMGR_ROLE"] == role_of(doc)
            assert server[server.index("--port") + 1] == "8000"
            if doc["kind"] == "Job":
                assert "--status-port" not in run_args
                assert "--on-miss" not in run_args
                continue
            ports = {p["name"]: p["containerPort"] for p in spec["ports"]}
            assert args.status_port == ports["cachemgr"]
            assert ports["http"] == 8000
            for probe, kind in (
                ("startupProbe", "startup"),
                ("livenessProbe", "live"),
                ("readinessProbe", "ready"),
            ):
                parsed = parser.parse_args(spec[probe]["exec"]["command"][1:])
                assert (parsed.command, parsed.kind) == ("probe", kind)
    options = renders["options"]
    run_args = shlex.split(env_of(workload(options, "Deployment", "prefill"))["CACHEMGR_RUN_ARGS"])
    args = parser.parse_args(["run", *run_args])
    assert (args.on_miss, args.stall_timeout, args.wait_timeout) == ("fail", 900.0, 7200.0), "15m, 2h"


def test_a_roles_warm_job_carries_its_deployments_args_env_and_image(renders: dict[str, Docs]) -> None:
    for name in ("warm-on", "remote", "trust", "options"):
        docs = renders[name]
        for job in by_kind(docs, "Job"):
            deployment = workload(docs, "Deployment", role_of(job))
            served, warmed = container(deployment), container(job)
            assert warmed["args"] == served["args"], name
            assert warmed["image"] == served["image"]
            own = {
                "VLLM_RBLN_COMPILE_ONLY",
                "RBLN_FORCE_NPU_NAME",
                "CACHEMGR_RUN_ARGS",
                "CACHEMGR_SIGNING_KEY_FILE",
            }
            assert {k: v for k, v in env_of(job).items() if k not in own} == {
                k: v for k, v in env_of(deployment).items() if k not in own
            }, name
            assert env_of(job)["RBLN_FORCE_NPU_NAME"] == env_of(job)["CACHEMGR_NPU_TYPE"]


def test_the_remote_tier_and_its_credentials(renders: dict[str, Docs]) -> None:
    docs = renders["remote"]
    (account,) = by_kind(docs, "ServiceAccount")
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")
    for doc in [*by_kind(docs, "Deployment"), *by_kind(docs, "Job")]:
        env = env_of(doc)
        assert env["CACHEMGR_REMOTE"] == "s3://modelserver-compile-cache/prod"
        assert env["CACHEMGR_REMOTE_ENDPOINT"] == "https://s3.example.internal"
        assert container(doc)["envFrom"] == [{"secretRef": {"name": "modelserver-remote-credentials"}}]
        assert pod_spec(doc)["serviceAccountName"] == account["metadata"]["name"]
    for doc in by_kind(renders["defaults"], "Deployment"):
        assert "CACHEMGR_REMOTE" not in env_of(doc)
        assert "serviceAccountName" not in pod_spec(doc)


def test_pods_run_non_root_on_a_read_only_root_with_writable_places(renders: dict[str, Docs]) -> None:
    for doc in [*by_kind(renders["warm-on"], "Deployment"), *by_kind(renders["warm-on"], "Job")]:
        pod, spec = pod_spec(doc), container(doc)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 10001
        assert spec["securityContext"]["readOnlyRootFilesystem"] is True
        assert spec["securityContext"]["allowPrivilegeEscalation"] is False
        mounts = {m["mountPath"] for m in spec["volumeMounts"]}
        env = env_of(doc)
        for writable in (env["CACHEMGR_CACHE_ROOT"], env["CACHEMGR_STATE_DIR"], env["TMPDIR"], env["HOME"]):
            assert writable in mounts, writable
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert parse_size(volumes["tmp"]["emptyDir"]["sizeLimit"]) == 200 << 30


def test_prometheus_annotations_name_the_status_port(renders: dict[str, Docs]) -> None:
    for deployment in by_kind(renders["defaults"], "Deployment"):
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
        assert annotations == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(ports["cachemgr"]),
            "prometheus.io/path": "/metrics",
        }
    for deployment in by_kind(renders["options"], "Deployment"):
        assert deployment["spec"]["template"]["metadata"]["annotations"] == {"example.com/team": "inference"}


# --- the chart's README and the docs agree with the chart ---------------------------------------------------


def flatten(values: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of values.yaml by dotted key; an empty map or list, or a free-form one, is a leaf."""
    free = {
        "resources",
        "nodeSelector",
        "affinity",
        "podSecurityContext",
        "securityContext",
        "annotations",
        "podAnnotations",
        "podLabels",
        "existingClaims",
        "labels",
    }
    if isinstance(values, dict) and values and prefix.rsplit(".", 1)[-1] not in free:
        out: dict[str, Any] = {}
        for key, value in values.items():
            out |= flatten(value, f"{prefix}.{key}" if prefix else key)
        return out
    return {prefix: values}


def readme_table() -> dict[str, str]:
    rows = {}
    for line in (CHART / "README.md").read_text().splitlines():
        row = re.fullmatch(r"\| `([^`]+)` \| `(.*)` \|.*\|", line)
        if row:
            rows[row[1]] = row[2]
    return rows


@pytest.mark.quick
def test_the_readme_values_table_is_values_yaml() -> None:
    values = flatten(yaml.safe_load((CHART / "values.yaml").read_text()))
    table = readme_table()
    assert sorted(table) == sorted(values), set(table) ^ set(values)
    for key, default in values.items():
        assert json.loads(table[key]) == default, (key, table[key], default)


@pytest.mark.quick
def test_the_schema_knows_every_value_and_values_yaml_passes_it() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(node: dict[str, Any], value: Any, where: str) -> None:
        if node.get("type") == "object" and node.get("additionalProperties") is False:
            assert set(value) == set(node["properties"]), where
            assert set(node.get("required", [])) == set(node["properties"]), where
            for key, sub in node["properties"].items():
                walk(sub, value[key], f"{where}.{key}")

    walk(schema, values, "values")


def kubernetes_md_settings() -> dict[str, Any]:
    """The 'Settings that fit' block of docs/kubernetes.md: what it says the chart renders."""
    text = (Path(__file__).parents[1] / "docs" / "kubernetes.md").read_text()
    section = text[text.index("## Settings that fit") :]
    block = re.search(r"```yaml\n(.*?)```", section, re.DOTALL)
    assert block, "no yaml block under 'Settings that fit'"
    loaded: dict[str, Any] = yaml.safe_load(block[1])
    return loaded


def test_docs_kubernetes_md_shows_what_the_chart_renders(renders: dict[str, Docs]) -> None:
    """Issue 24's drift (the docs gave --stall-timeout 15m, the manifests did not): the chart is the truth."""
    shown = kubernetes_md_settings()
    spec = container(workload(renders["defaults"], "Deployment", "prefill"))
    env = {e["name"]: e.get("value") for e in spec["env"]}
    assert shown["env"], "the block shows env"
    for entry in shown["env"]:
        assert env.get(entry["name"]) == entry["value"], entry
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert shown[probe] == spec[probe], probe
