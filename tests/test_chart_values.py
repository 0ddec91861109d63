"""What the modelserver chart accepts and refuses, by the real Helm 4: lint, template and install.

``helm lint`` reports a template's ``fail`` only as an INFO line and passes (issue 32): a refusal the
schema (values.schema.json) can express lives there, so that lint, template and install refuse the
same values, each with the key's path and the reason. The few a schema cannot say (a comparison
of two numbers, an existing PVC through ``lookup``) stay in templates/_checks.tpl; the chart's
README lists them, and ``TEMPLATE_ONLY`` below holds the two lists together.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from cachemgr_testkit.helm import CHART, TEST_IMAGE, helm, refusal, template_text, values_file
from cachemgr_testkit.kube import by_kind, container, merge, pod_spec, render, workload

from cachemgr.cli.main import build_parser
from cachemgr.core.errors import UsageError

ROLES = ("prefill", "decode")
WARM = {"prefill": {"warm": True}, "decode": {"warm": True}}
RWO = {
    "storage": {"compileCache": {"accessModes": ["ReadWriteOnce"]}},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
}
# A real public key, as `cachemgr keys generate --name builder-1` printed it (32 bytes).
TRUSTED = ["builder-1:7Hy+1Hr7O+3xKVnKafnKcp/iKblqbVBadtH1dbt3xnY="]
SIGNING = {"signingKeySecret": {"name": "modelserver-signing-key", "key": "signing.key"}}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chart-values")


def lint(values: dict[str, Any], work: Path) -> tuple[bool, str]:
    """``helm lint --strict``: whether it passed, and what it printed."""
    result = helm("lint", "--strict", str(CHART), "-f", str(values_file(work, values)), check=False)
    return result.returncode == 0, result.stdout + result.stderr


def dry_install(values: dict[str, Any], work: Path, *extra: str) -> Any:
    return helm(
        "install", "modelserver", str(CHART), "--dry-run=client", "-f", str(values_file(work, values)),
        *extra, check=False,
    )  # fmt: skip


# --- bad values: one refusal naming the key, at lint and install alike ---------------------------------

REFUSALS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "negative replicas": ({"prefill": {"replicas": -1}}, ["/prefill/replicas", "minimum: got -1, want 0"]),
    "fractional replicas": ({"decode": {"replicas": 1.5}}, ["/decode/replicas", "want integer"]),
    "replicas not a number": (
        {"decode": {"replicas": "two"}},
        ["/decode/replicas", "got string, want integer"],
    ),
    "size not a quantity": (
        {"storage": {"compileCache": {"size": "200 Gi"}}},
        ["/storage/compileCache/size", "a Kubernetes quantity of bytes"],
    ),
    "size in millibytes": (
        {"storage": {"compileCache": {"size": "500m"}}},
        ["/storage/compileCache/size", "a Kubernetes quantity of bytes"],
    ),
    "size zero": (
        {"storage": {"compileCache": {"size": "0Gi"}}},
        ["/storage/compileCache/size", "more than nothing"],
    ),
    "size zero as a number": (
        {"storage": {"compileCache": {"size": 0}}},
        ["/storage/compileCache/size", "minimum: got 0, want 1"],
    ),
    "size under a byte": (
        {"storage": {"compileCache": {"size": "0.5"}}},
        ['storage.compileCache.size "0.5" is no room at all'],
    ),
    "tmp limit not a quantity": (
        {"storage": {"tmp": {"sizeLimit": "lots"}}},
        ["/storage/tmp/sizeLimit", "a Kubernetes quantity of bytes"],
    ),
    "unknown access mode": (
        {"storage": {"compileCache": {"accessModes": ["ReadWriteMany", "ReadWriteAll"]}}},
        ["/storage/compileCache/accessModes/1", "must be one of"],
    ),
    "read-only access mode": (
        {"storage": {"compileCache": {"accessModes": ["ReadWriteMany", "ReadOnlyMany"]}}},
        ["/storage/compileCache/accessModes/1", "must be writable"],
    ),
    "RWO with two pods": (
        {"storage": {"compileCache": {"accessModes": ["ReadWriteOnce"]}}, "prefill": {"replicas": 1}},
        ["/decode/replicas", "at most 1 without ReadWriteMany", "set it to 1"],
    ),
    "RWO with a warm Job": (
        merge(RWO, {"decode": {"warm": True}}),
        ["/decode/warm", "false without ReadWriteMany"],
    ),
    "empty image": ({"image": {"repository": ""}}, ["/image/repository", "the image built from"]),
    "an image that is not a reference": (
        {"image": {"repository": "Registry.example.com/Model Server"}},
        ["/image/repository", "does not match pattern"],
    ),
    "a tag that adds pod-spec fields": (
        {"image": {"tag": "sdk-0.12\nhostPID: true"}},
        ["/image/tag", "does not match pattern"],
    ),
    "unknown key": (
        {"storage": {"compileCache": {"sizes": "300Gi"}}},
        ["/storage/compileCache", "'sizes' not allowed"],
    ),
    "--port in the args": (
        {"prefill": {"args": ["vllm", "serve", "m", "--port=8001"]}},
        ["/prefill/args/3", "anything but --host and --port"],
    ),
    "--host in the args": (
        {"decode": {"args": ["vllm", "serve", "m", "--host", "::"]}},
        ["/decode/args/3", "anything but --host and --port"],
    ),
    "null in the args": ({"decode": {"args": ["vllm", "serve", "m", None]}}, ["/decode/args/3"]),
    "chart-owned env": (
        {"extraEnv": [{"name": "CACHEMGR_ROLE", "value": "x"}]},
        ["/extraEnv/0/name", "a variable the chart does not set itself"],
    ),
    "chart-owned env of a role": (
        {"prefill": {"extraEnv": [{"name": "CACHEMGR_TRUSTED_KEYS", "value": ""}]}},
        ["/prefill/extraEnv/0/name", "a variable the chart does not set itself"],
    ),
    "a pinned compiler version": (
        {"decode": {"extraEnv": [{"name": "CACHEMGR_COMPILER_VERSION", "value": "0.12"}]}},
        ["/decode/extraEnv/0/name", "the cache key takes the version the image holds"],
    ),
    "a run option with a space": (
        {"cachemgr": {"extraArgs": ["--wait-timeout 2h"]}},
        ["/cachemgr/extraArgs/0"],
    ),
    "the server argv in the run options": (
        {"cachemgr": {"extraArgs": ["--", "vllm"]}},
        ["/cachemgr/extraArgs/0", "the server argv is ROLE.args"],
    ),
    "read-only serving with no builder": (
        {"trust": {"readOnlyServing": True}, "prefill": {"warm": True}},
        ["/decode/warm", "true while serving pods mount the cache read-only"],
    ),
    "a signing key with no builder": (
        {"trust": {"signingKeySecret": {"name": "k"}}},
        ["/trust/signingKeySecret/name", "while no warm Job runs"],
    ),
    "a class name that is YAML": (
        {"storage": {"compileCache": {"storageClassName": "fast\nkind: Secret"}}},
        ["/storage/compileCache/storageClassName", "does not match pattern"],
    ),
    "a signing key path out of its directory": (
        merge(WARM, {"trust": {"signingKeySecret": {"name": "k", "key": "../../etc/passwd"}}}),
        ["/trust/signingKeySecret/key"],
    ),
    "a malformed trusted key": (
        merge(WARM, {"trust": {"trustedKeys": ["no-colon"], **SIGNING}}),
        ["/trust/trustedKeys/0"],
    ),
    "a trusted key that is not 32 bytes": (
        merge(
            WARM,
            {
                "trust": {
                    "trustedKeys": ["builder-1:MCowBQYDK2VwAyEAGb9ECWmEzf6FQbrBZ9w7lshQhqowtrbLDFw4rXAxZuE="],
                    **SIGNING,
                }
            },
        ),
        ["/trust/trustedKeys/0"],
    ),
    "trusted keys with nobody to sign": (
        merge(WARM, {"trust": {"trustedKeys": TRUSTED}}),
        ["/trust/signingKeySecret/name", "the Secret holding the signing key"],
    ),
    "trusted keys in the signed mode with no builder": (
        {"trust": {"trustedKeys": TRUSTED, "readOnlyServing": False, **SIGNING}, "prefill": {"warm": True}},
        ["/decode/warm", "the builder that signs"],
    ),
    "trusted keys make serving read-only, which needs a builder": (
        {"trust": {"trustedKeys": TRUSTED, **SIGNING}, "prefill": {"warm": True}},
        ["/decode/warm", "true while serving pods mount the cache read-only", "trust.readOnlyServing=false"],
    ),
    "trusted keys with a remote builder still need a warm Job to fill read-only pods": (
        {"trust": {"trustedKeys": TRUSTED}, "remote": {"url": "s3://bucket/prefix"}},
        ["/prefill/warm", "true while serving pods mount the cache read-only"],
    ),
    "read-only serving that is neither true, false nor auto": (
        {"trust": {"readOnlyServing": "yes"}},
        ["/trust/readOnlyServing", "must be one of"],
    ),
    "a lower-case NPU name": ({"npu": {"type": "rbln-ca25"}}, ["/npu/type", "RBLN-CA25"]),
    "an NPU name without its family": ({"npu": {"type": "CA25"}}, ["/npu/type", "RBLN-CA25"]),
    "health timeout above the probe's": (
        {"probes": {"readiness": {"healthTimeout": 5}}},
        ["probes.readiness.healthTimeout 5 must be below probes.readiness.timeoutSeconds 5"],
    ),
    "a hook with no warm Job": ({"warm": {"hook": True}}, ["/warm/hook", "false while no warm Job runs"]),
    "every spelling of an option the chart owns": (
        {"cachemgr": {"extraArgs": ["--compiler", "0.12"]}},
        ["/cachemgr/extraArgs/0", "other than --compiler-version", "the version the image holds"],
    ),
    "a selector label in podLabels": (
        {"podLabels": {"app.kubernetes.io/component": "prefill"}},
        ["/podLabels/app.kubernetes.io~1component", "use a label of your own"],
    ),
    "a CPU warm Job of a model off the vLLM-model path": (
        merge(WARM, {"decode": {"args": ["vllm", "serve", "m", "--model-impl", "optimum"]}}),
        ["/decode/args", "--model-impl vllm", "warm.npus"],
    ),
    "a toolbox without ReadWriteMany": (
        merge(RWO, {"toolbox": {"enabled": True}}),
        ["/toolbox/enabled", "false without ReadWriteMany"],
    ),
}

# What only the templates can refuse: `helm lint` passes these (it reports a template's `fail` as
# INFO), `helm template` and `helm install` refuse them. The chart's README names each.
TEMPLATE_ONLY = {"size under a byte", "health timeout above the probe's"}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_values_are_refused_naming_the_key(case: str, work: Path) -> None:
    values, expected = REFUSALS[case]
    message = refusal(merge(TEST_IMAGE, values), work=work)
    assert message.startswith("Error: "), message
    for part in expected:
        assert part in message, message
    if "execution error" in message:  # a template `fail`: one line, after Helm's location prefix
        lines = [line for line in message.splitlines() if line.strip() and "--debug" not in line]
        assert len(lines) == 1, message
    else:  # the schema's: each leaf of its tree is a key's path and a reason; one reason here
        lines = [line for line in message.splitlines() if line.lstrip().startswith("- at '")]
        leaves = [
            line for line, after in zip(lines, [*lines[1:], ""], strict=True)
            if len(after) - len(after.lstrip()) <= len(line) - len(line.lstrip())
        ]  # fmt: skip
        assert len({leaf.split("': ", 1)[1] for leaf in leaves}) == 1, message


@pytest.mark.parametrize("case", list(REFUSALS))
def test_lint_refuses_what_install_refuses(case: str, work: Path) -> None:
    values, _expected = REFUSALS[case]
    passed, output = lint(merge(TEST_IMAGE, values), work)
    assert dry_install(merge(TEST_IMAGE, values), work).returncode != 0, case
    if case in TEMPLATE_ONLY:
        assert passed, output  # Helm's own limit: the chart README says so
        assert "funcMap fail" in output, output
    else:
        assert not passed, f"helm lint passed what helm install refuses ({case}):\n{output}"


def test_the_readme_names_what_only_template_and_install_refuse() -> None:
    readme = re.sub(r"\s+", " ", (CHART / "README.md").read_text())
    section = readme[readme.index("Only `helm template` and `helm install`") :]
    for phrase in (
        "`probes.readiness.healthTimeout`",
        "less than one byte",
        "existing PVC",
    ):
        assert phrase in section[:1500], phrase


def test_the_readme_shows_a_real_schema_refusal(work: Path) -> None:
    readme = (CHART / "README.md").read_text()
    section = readme[readme.index("## Bad values") :]
    (shown,) = re.findall(r"```text\n(.*?)```", section[: section.index("Only `helm template`")], re.DOTALL)
    values = merge(
        TEST_IMAGE,
        {"storage": {"compileCache": {"accessModes": ["ReadWriteOnce"]}}, "prefill": {"replicas": 1}},
    )
    assert refusal(values, work=work) == shown.strip()


# --- the NPU type, the image and the args ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["RBLN-CA25", "RBLN-CA12", "RBLN-CR13"])
def test_npu_names_as_vllm_rbln_names_them_are_accepted(name: str, work: Path) -> None:
    """vllm-rbln 0.12 knows two families, RBLN-CA (ATOM) and RBLN-CR (REBEL): the schema's
    $comment cites where. The name is keyed as written, so case matters."""
    docs = render(work, {"npu": {"type": name}})
    for deployment in by_kind(docs, "Deployment"):
        env = {e["name"]: e.get("value") for e in container(deployment)["env"]}
        assert env["CACHEMGR_NPU_TYPE"] == name
    schema = (CHART / "values.schema.json").read_text()
    assert "vllm_rbln/platform/__init__.py:54" in schema


def test_a_tag_carrying_yaml_cannot_add_pod_spec_fields(work: Path) -> None:
    """Refused by the schema; and were a template to print it anyway (the schema skipped), it
    renders as one quoted string: no hostPID, no extra container."""
    # Indented as the pod spec's keys: printed unquoted, this closed the container and opened an
    # initContainer that took the rest of the modelserver container's fields.
    evil = "\n      hostPID: true\n      initContainers:\n        - name: evil\n          image: evil"
    for field, image in (
        ("tag", f"registry.example.com/modelserver-cachemgr:sdk-0.12{evil}"),
        ("repository", f"registry.example.com/modelserver-cachemgr{evil}:sdk-0.12"),
    ):
        values = merge(TEST_IMAGE, {"image": {field: TEST_IMAGE["image"][field] + evil}})
        assert f"/image/{field}" in refusal(values, work=work)
        skipped = template_text(merge(WARM, values), work=work, extra=("--skip-schema-validation",))
        assert skipped.returncode == 0, skipped.stderr
        docs = [doc for doc in yaml.safe_load_all(skipped.stdout) if doc]
        workloads = [*by_kind(docs, "Deployment"), *by_kind(docs, "Job")]
        assert len(workloads) == 4
        for doc in workloads:
            assert not {"hostPID", "initContainers"} & set(pod_spec(doc)), doc["metadata"]["name"]
            assert container(doc)["image"] == image


def test_numbers_in_the_args_are_accepted_and_rendered_as_strings(work: Path) -> None:
    """`--set prefill.args={...,8,...}` types 8 as a number; a values file may hold 0.9 or 1e6 too."""
    result = helm(
        "template", "modelserver", str(CHART), "-f", str(values_file(work, TEST_IMAGE)),
        "--set", "prefill.args={vllm,serve,m,--tensor-parallel-size,8,--max-model-len,32768}",
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    args = container(workload(docs, "Deployment", "prefill"))["args"]
    assert args[:7] == ["vllm", "serve", "m", "--tensor-parallel-size", "8", "--max-model-len", "32768"]
    values = {
        "decode": {
            "args": [
                "vllm",
                "serve",
                "m",
                "--gpu-memory-utilization",
                0.9,
                "--max-num-batched-tokens",
                1000000,
                "--x",
                True,
                "--model-impl",
                "vllm",
            ]
        }
    }
    docs = render(work, merge(WARM, values))
    for doc in (workload(docs, "Deployment", "decode"), workload(docs, "Job", "decode")):
        args = container(doc)["args"]
        assert all(isinstance(word, str) for word in args), args
        assert args[3:9] == [
            "--gpu-memory-utilization",
            "0.9",
            "--max-num-batched-tokens",
            "1000000",
            "--x",
            "true",
        ]


# --- what the chart sets itself: never overridden through cachemgr.extraArgs (issues 33, 40) ---------------

RUN = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["run"]
ENV_OF = re.compile(r"\[env (CACHEMGR_[A-Z_]+)")


def spellings(dest: str) -> set[str]:
    """Every word ``cachemgr run`` reads as ``dest``: the option, its = form, and each abbreviation
    argparse accepts (allow_abbrev), found by parsing each prefix with the real parser."""
    (action,) = [a for a in RUN._actions if a.dest == dest]
    default = getattr(RUN.parse_args([]), dest, None)
    value = action.choices[-1] if action.choices else "9091"  # a value every type here takes
    found = set()
    for option in action.option_strings:
        for end in range(3, len(option) + 1) if option.startswith("--") else [len(option)]:
            prefix = option[:end]
            if dest == "help":
                with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(UsageError):
                    try:
                        RUN.parse_args([prefix])
                    except SystemExit as stop:
                        found |= {prefix} if stop.code == 0 else set()
                continue
            for argv in ([prefix, value], [f"{prefix}={value}"]):
                try:
                    parsed = RUN.parse_args(argv)
                except UsageError:  # an ambiguous prefix: cachemgr's parser refuses it itself
                    continue
                if getattr(parsed, dest) != default:
                    found.add(prefix)
    return found


def owned_options(work: Path) -> set[str]:
    """The ``cachemgr run`` options (by dest) the chart decides: those whose variable it renders in a
    serving pod or a warm Job or refuses in extraEnv, those its values write into CACHEMGR_RUN_ARGS,
    and --help, which ends cachemgr before it runs (a warm Job would succeed having compiled nothing)."""
    everything = merge(
        WARM,
        {
            "trust": {"trustedKeys": TRUSTED, **SIGNING},
            "remote": {"url": "s3://bucket/prefix", "endpoint": "http://minio:9000"},
            "cachemgr": {"onMiss": "fail", "stallTimeout": "15m"},
        },
    )
    docs = render(work, everything)
    envs = [container(workload(docs, kind, role))["env"] for kind in ("Deployment", "Job") for role in ROLES]
    schema = json.loads((CHART / "values.schema.json").read_text())
    refused = {
        name
        for rule in schema["$defs"]["extraEnv"]["items"]["properties"]["name"]["allOf"]
        for name in rule["if"]["enum"]
    }
    named = {e["name"] for env in envs for e in env} | refused
    owned = {a.dest for a in RUN._actions if (m := ENV_OF.search(a.help or "")) and m.group(1) in named}
    base = vars(RUN.parse_args([]))
    for env in envs:
        run_args = next(e["value"] for e in env if e["name"] == "CACHEMGR_RUN_ARGS")
        owned |= {
            dest for dest, value in vars(RUN.parse_args(run_args.split())).items() if value != base[dest]
        }
    return owned | {"help"}


def extra_args_rules() -> dict[str, tuple[set[str], str]]:
    """The schema's refusals of cachemgr.extraArgs words, by the option they refuse: the words each
    pattern names, and its reason."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    rules = {}
    for rule in schema["properties"]["cachemgr"]["properties"]["extraArgs"]["items"]["allOf"]:
        pattern = rule["if"].get("pattern")
        if pattern is None:
            continue
        found = re.fullmatch(r"\^\(([-a-z|]+)\)\(=\.\*\)\?\$", pattern)
        assert found, pattern
        words = set(found.group(1).split("|"))
        (dest,) = {a.dest for a in RUN._actions for w in words if w in a.option_strings}
        rules[dest] = (words, rule["then"]["const"])
    return rules


def test_the_chart_refuses_every_spelling_of_every_option_it_owns_as_the_parser_reads_it(work: Path) -> None:
    """Issue 40: ``--compiler-version 0.12``, ``--compiler 0.12``, ``--npu-type``, ``--cache-root``,
    ``--role`` passed lint and reached the serving pods and the warm Job, overriding what the chart
    refuses in extraEnv. The schema's list is held to cachemgr's own parser, both ways: a new option
    of the chart's, or a new option of cachemgr that makes an abbreviation ambiguous or unique,
    fails here until the schema follows."""
    owned = owned_options(work)
    assert {"compiler_version", "npu_type", "cache_root", "role", "trusted_keys", "status_port"} <= owned
    rules = extra_args_rules()
    assert {dest: words for dest, (words, _) in rules.items()} == {dest: spellings(dest) for dest in owned}
    assert {"--compiler", "--compiler-version", "--ro", "--n", "--ca", "--t", "--si", "-h"} <= set().union(
        *(words for words, _ in rules.values())
    )
    # Every spelling, alone and in its = form (the empty value too: --trusted-keys= would be the
    # open mode, silently, issue 33), in one render: each item refused with its option's reason.
    words = sorted(w for ws, _ in rules.values() for w in ws)
    extra = [form for word in words for form in (word, f"{word}=0.12", f"{word}=")]
    values = merge(TEST_IMAGE, merge(WARM, {"cachemgr": {"extraArgs": extra}}))
    for message in (refusal(values, work=work), lint(values, work)[1]):
        for index, word in enumerate(extra):
            dest = next(d for d, (ws, _) in rules.items() if word.split("=")[0] in ws)
            assert f"at '/cachemgr/extraArgs/{index}': value must be '{rules[dest][1]}'" in message, word
    for dest, (_, reason) in rules.items():
        option = next(
            o for a in RUN._actions if a.dest == dest for o in a.option_strings if o.startswith("--")
        )
        assert option in reason.split(":")[0], reason


def test_extra_args_cannot_override_the_trust_the_chart_renders(work: Path) -> None:
    # In the open mode as well: extraArgs must not turn trust on behind the chart's back either.
    message = refusal(
        merge(TEST_IMAGE, {"cachemgr": {"extraArgs": ["--trusted-keys", TRUSTED[0]]}}), work=work
    )
    assert "/cachemgr/extraArgs/0" in message
    assert "trust.trustedKeys and trust.signingKeySecret" in message, message
    # Other options pass, and reach cachemgr as written, in the serving pods and the warm Jobs.
    for ok in (["--wait-timeout", "2h"], ["--verify=full"], ["--lease-duration", "60s"], ["--key-env", "X"]):
        docs = render(work, merge(WARM, {"cachemgr": {"extraArgs": ok}}))
        for kind in ("Deployment", "Job"):
            env = {e["name"]: e.get("value") for e in container(workload(docs, kind, "prefill"))["env"]}
            assert env["CACHEMGR_RUN_ARGS"].endswith(" ".join(ok))


# --- labels the chart selects on; args a CPU warm Job cannot compile (issue 40) -----------------------------


def test_pod_labels_cannot_set_a_label_any_selector_of_the_chart_uses(work: Path) -> None:
    """A podLabels key the chart also sets repeated the key in the pod template (the API server
    refuses it) or took a pod out of its Deployment's selector. The schema's list is every label
    a selector of the chart's objects names; any other label passes to every pod."""
    docs = render(
        work, merge(WARM, {"metrics": {"podMonitor": {"enabled": True}}, "toolbox": {"enabled": True}})
    )
    selected: set[str] = set()
    for doc in docs:
        selector = doc["spec"].get("selector") or {}
        selected |= set(selector.get("matchLabels") or {})
        selected |= {e["key"] for e in selector.get("matchExpressions") or []}
        if doc["kind"] == "Service":
            selected |= set(selector)
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["properties"]["podLabels"]["properties"]) == selected
    for label in sorted(selected):
        message = refusal(merge(TEST_IMAGE, {"podLabels": {label: "x"}}), work=work)
        assert f"/podLabels/{label.replace('/', '~1')}" in message, message
    docs = render(work, merge(WARM, {"podLabels": {"team": "serving", "app.kubernetes.io/part-of": "llm"}}))
    for kind, role in (("Deployment", "prefill"), ("Job", "decode")):
        labels = workload(docs, kind, role)["spec"]["template"]["metadata"]["labels"]
        assert (labels["team"], labels["app.kubernetes.io/part-of"]) == ("serving", "llm"), labels


# (args, what cachemgr warm on a CPU node does with them): the chart's rule must agree.
CPU_WARM_ARGS = [
    ["vllm", "serve", "m", "--model-impl", "vllm"],
    ["vllm", "serve", "m", "--model-impl=vllm", "--max-model-len", "4096"],
    ["vllm", "serve", "m", "--model_impl", "vllm"],
    ["vllm", "serve", "m"],
    ["vllm", "serve", "m", "--model-impl", "optimum"],
    ["vllm", "serve", "m", "--model-impl=transformers"],
    ["vllm", "serve", "m", "--model-impl", "auto"],
    ["vllm", "serve", "vllm", "--model-impl", "optimum"],
    ["vllm", "serve", "m", "--model-impl", "vllm", "--model-impl=optimum"],
]
# A schema cannot see which word follows which: one of these anywhere counts as naming its path,
# stricter than cachemgr warm (a model served as "auto" must be named another way on a CPU node).
STRICTER = [
    ["vllm", "serve", "m", "--model-impl", "vllm", "--served-model-name", "auto"],
    ["vllm", "serve", "m", "--model-impl=optimum", "--model-impl", "vllm"],
]


@pytest.mark.parametrize("args", CPU_WARM_ARGS + STRICTER, ids=lambda a: " ".join(a[3:]) or "no flag")
def test_lint_refuses_the_args_a_cpu_warm_job_cannot_compile_as_cachemgr_warm_does(
    args: list[str], work: Path
) -> None:
    """Issue 40: args a warm Job on a CPU node cannot compile (no --model-impl vllm) passed lint, and
    with warm.hook every upgrade failed at the hook (exit 78). Lint refuses exactly what cachemgr
    warm refuses, read by the real parser; with NPUs for the warm Jobs, or no warm Job, it passes."""
    from cachemgr.key.serving import parse_server_argv
    from cachemgr.key.vllm_rbln import cpu_compile_refusal

    warm_refuses = cpu_compile_refusal(parse_server_argv(args).settings, {}) is not None or args in STRICTER
    values = merge(TEST_IMAGE, merge(WARM, {"prefill": {"args": args}}))
    passed, output = lint(values, work)
    assert passed is not warm_refuses, output
    if warm_refuses:
        assert "at '/prefill/args': value must be 'args naming the vLLM-model path" in output, output
    assert lint(merge(values, {"warm": {"npus": 8}}), work)[0]
    assert lint(merge(values, {"prefill": {"warm": False}}), work)[0]


# --- the schema itself ----------------------------------------------------------------------------------


@pytest.mark.quick
def test_every_reason_the_schema_gives_is_a_const_no_value_can_equal() -> None:
    """The schema's way to carry a reason (JSON Schema has no messages): ``then: {const: REASON}``,
    which Helm prints as ``value must be 'REASON'``. A reason must not be a value someone could
    mean, so each is a sentence, and names no value of values.yaml."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    reasons: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            then = node.get("then")
            if isinstance(then, dict) and isinstance(then.get("const"), str):
                reasons.append(then["const"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    assert len(reasons) >= 15, reasons
    for reason in reasons:
        assert len(reason.split()) > 5, reason
        assert "\n" not in reason, reason
        assert "'" not in reason, f"Helm quotes the reason in '...' and escapes one inside: {reason}"


def string_leaves(values: Any, prefix: str = "") -> dict[str, str]:
    """The string values of values.yaml by dotted key (lists and maps descended into)."""
    if isinstance(values, dict):
        out: dict[str, str] = {}
        for key, value in values.items():
            out |= string_leaves(value, f"{prefix}.{key}" if prefix else key)
        return out
    return {prefix: values} if isinstance(values, str) else {}


def keys_anywhere(node: Any) -> set[str]:
    if isinstance(node, dict):
        return set(node) | {k for v in node.values() for k in keys_anywhere(v)}
    if isinstance(node, list):
        return {k for v in node for k in keys_anywhere(v)}
    return set()


def test_no_string_value_can_add_fields_to_an_object_even_past_the_schema(work: Path) -> None:
    """Every string the chart prints into YAML is quoted (or goes through toYaml): with the schema
    skipped, a value holding newlines at every indentation adds no key anywhere."""
    payload = "".join(f"\n{' ' * n}hostPID: true" for n in range(0, 14, 2))
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    base = merge(
        TEST_IMAGE,
        merge(
            WARM,
            {
                "toolbox": {"enabled": True},
                "metrics": {
                    "podMonitor": {"enabled": True},
                    "prometheusRule": {"enabled": True},
                    "grafanaDashboard": {"enabled": True},
                },
            },
        ),
    )
    leaves = string_leaves(merge(defaults, base))
    assert len(leaves) >= 15, leaves
    for key, value in leaves.items():
        over: dict[str, Any] = {}
        node = over
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value + payload
        result = template_text(merge(base, over), work=work, extra=("--skip-schema-validation",))
        assert "YAML parse error" not in result.stderr, (key, result.stderr)  # printed unquoted: it broke
        if result.returncode == 0:
            docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
            assert "hostPID" not in keys_anywhere(docs), key
