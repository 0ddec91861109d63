"""The image recipe, the entrypoint scripts and the chart's workloads, against the real code.

Nothing here trusts the chart's own comments: every command, subcommand and flag its Deployments
and warm Jobs name goes through cachemgr's real parser (``build_parser``), every ``CACHEMGR_*``
variable must be one the code reads, the warm Jobs' keys are computed by ``cachemgr key`` beside
the Deployments', and the workloads run for real (their entrypoint scripts, their environment,
the stand-in ``vllm`` on PATH, a temporary cache volume) to show that the probes pass through a
compile, signals reach the server and exit codes come back. The chart is rendered by the real
Helm (tests/test_chart.py holds the renders to the chart page); a pod's volumes become temporary
directories, its ports free ones; everything else is run as the chart renders it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from cachemgr_standin import DECLARED_VERSIONS
from cachemgr_testkit.kube import (
    ENTRYPOINT,
    ROOT,
    Node,
    by_kind,
    container,
    merge,
    pod_spec,
    render,
    role_of,
    workload,
)
from cachemgr_testkit.podlib import DEADLINE, error_lines, wait_for

from cachemgr.cli.main import build_parser
from cachemgr.core.units import parse_size
from cachemgr.runtime.probes import stale_after
from cachemgr.runtime.state import State

ROLES = ("prefill", "decode")
ENTRYPOINT_SUBCOMMAND = {"cachemgr-entrypoint": "run", "cachemgr-warm": "warm"}
# The toolbox's PID 1 runs no cachemgr command: operators exec them into its pod.
WAITS = {"cachemgr-toolbox"}
WARM = {"prefill": {"warm": True}, "decode": {"warm": True}}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The chart's defaults with both warm Jobs: Deployments, PVCs, Services and Jobs."""
    return render(tmp_path_factory.mktemp("chart"), WARM)


@pytest.fixture(scope="module")
def warm_jobs(base: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return by_kind(base, "Job")


# --- what the code accepts -----------------------------------------------------------------------


def code_env_names() -> set[str]:
    """Every CACHEMGR_* name the package itself reads or sets."""
    names: set[str] = set()
    for path in (ROOT / "cachemgr").rglob("*.py"):
        names |= set(re.findall(r"\bCACHEMGR_[A-Z][A-Z0-9_]*\b", path.read_text()))
    return names


def entrypoint_env_names() -> set[str]:
    names: set[str] = set()
    for path in ENTRYPOINT.iterdir():
        names |= set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", path.read_text()))
    return names


def subcommands() -> set[str]:
    parser = build_parser()
    (sub,) = [
        a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"
    ]  # argparse keeps its subcommands there
    return set(sub.choices)  # type: ignore[attr-defined]


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """cachemgr's options and the server argv, as the entrypoint scripts read a container's args."""
    if args and args[0].startswith("-"):
        cut = args.index("--")
        return args[:cut], args[cut + 1 :]
    return [], args


def env_values(spec: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in spec.get("env", []) if "value" in e}


def containers(
    base: list[dict[str, Any]], warm_jobs: list[dict[str, Any]]
) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, its container) for every Deployment and warm Job."""
    for doc in [*by_kind(base, "Deployment"), *warm_jobs]:
        yield doc, container(doc)


def test_env_names_are_the_contract_and_wired_to_the_volumes(
    base: list[dict[str, Any]], warm_jobs: list[dict[str, Any]]
) -> None:
    known = code_env_names()
    assert {
        "CACHEMGR_CACHE_ROOT",
        "CACHEMGR_ROLE",
        "CACHEMGR_COMPILER_VERSION",
        "CACHEMGR_NPU_TYPE",
        "CACHEMGR_STATE_DIR",
        "CACHEMGR_LOG_FORMAT",
        "CACHEMGR_TERMINATION_LOG",
    } <= known, "the README's environment contract is read by the code"
    accepted = known | {"CACHEMGR_RUN_ARGS"}  # the entrypoint scripts' own
    for doc, spec in containers(base, warm_jobs):
        names = [e["name"] for e in spec["env"]]
        assert len(names) == len(set(names)), names
        values = env_values(spec)
        assert {n for n in names if n.startswith("CACHEMGR_")} <= accepted, names
        for required in ("CACHEMGR_ROLE", "CACHEMGR_CACHE_ROOT", "CACHEMGR_STATE_DIR", "CACHEMGR_NPU_TYPE"):
            assert required in values, (doc["metadata"]["name"], required)
        assert values["CACHEMGR_ROLE"] == role_of(doc)
        assert values["CACHEMGR_LOG_FORMAT"] == "json"
        # The key takes the image's compiler and server: a pinned version would survive an upgrade.
        for pinned in ("CACHEMGR_COMPILER_VERSION", *DECLARED_VERSIONS):
            assert pinned not in names, pinned
        refs = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in spec["env"] if "valueFrom" in e}
        assert refs == {"POD_NAME": "metadata.name", "NODE_NAME": "spec.nodeName"}

        mounts = {m["name"]: m["mountPath"] for m in spec["volumeMounts"]}
        volumes = {v["name"]: v for v in pod_spec(doc)["volumes"]}
        assert values["CACHEMGR_CACHE_ROOT"] == mounts["compile-cache"]
        assert "persistentVolumeClaim" in volumes["compile-cache"]
        assert values["CACHEMGR_STATE_DIR"] == mounts["cachemgr-state"]
        assert volumes["cachemgr-state"] == {"name": "cachemgr-state", "emptyDir": {}}
        # cachemgr writes its one-line reason where the kubelet reads the termination message.
        assert spec["terminationMessagePath"] == values.get(
            "CACHEMGR_TERMINATION_LOG", "/dev/termination-log"
        )
        assert spec["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_tmpdir_is_a_sized_emptydir_and_warm_jobs_name_the_vllm_model_path(
    base: list[dict[str, Any]], warm_jobs: list[dict[str, Any]]
) -> None:
    """The optimum path compiles into $TMPDIR first (optimum-rbln modeling.py 145-147); a CPU node
    compiles the vLLM-model path only (cachemgr refuses the others there, exit 78)."""
    for deployment in by_kind(base, "Deployment"):
        spec = container(deployment)
        mounts = {m["name"]: m["mountPath"] for m in spec["volumeMounts"]}
        volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
        assert env_values(spec)["TMPDIR"] == mounts["tmp"]
        assert parse_size(volumes["tmp"]["emptyDir"]["sizeLimit"]) >= 100 << 30
    for job in warm_jobs:
        args = container(job)["args"]
        assert args[args.index("--model-impl") + 1] == "vllm"


def test_the_entrypoint_scripts_name_only_what_the_code_accepts() -> None:
    known = code_env_names()
    key_source = "".join(
        (ROOT / "cachemgr" / "key" / name).read_text() for name in ("cachekey.py", "npu.py", "vllm_rbln.py")
    )
    for name in entrypoint_env_names():
        if name.startswith("CACHEMGR_"):
            assert name in known | {"CACHEMGR_RUN_ARGS"}, name
        else:
            assert name in key_source, f"{name}: the key code must know what the scripts set"
    for path in ENTRYPOINT.iterdir():
        assert os.access(path, os.X_OK), f"{path} is not executable"
        assert path.read_text().startswith("#!/bin/sh\n"), path
        assert re.search(r"^set -eu$", path.read_text(), re.MULTILINE), path
        execs = re.findall(r"^exec cachemgr (\S+)", path.read_text(), re.MULTILINE)
        assert execs == ([] if path.name in WAITS else [ENTRYPOINT_SUBCOMMAND[path.name]]), path
        assert set(execs) <= subcommands()
        subprocess.run(["sh", "-n", str(path)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "-s", "sh", *sorted(map(str, ENTRYPOINT.iterdir()))], check=True)


def test_probe_timings_fit_a_long_compile_and_catch_a_stall(base: list[dict[str, Any]]) -> None:
    heartbeat_limit = stale_after(State._field_defaults["heartbeat_interval"])
    stall_default = build_parser().parse_args(["run"]).stall_timeout  # parsed: seconds
    for role in ROLES:
        spec = container(workload(base, "Deployment", role))
        startup, live, ready = spec["startupProbe"], spec["livenessProbe"], spec["readinessProbe"]
        # Startup only waits for `cachemgr run` to write its first record; the compile never
        # counts against it, since startup passes while a compile progresses (checked for real below).
        assert 60 <= startup["periodSeconds"] * startup["failureThreshold"] <= 600
        # One late heartbeat must not restart a pod; a frozen one must not serve for long.
        assert live["periodSeconds"] * live["failureThreshold"] > heartbeat_limit
        assert live["periodSeconds"] * live["failureThreshold"] <= 60
        # A stall is declared after --stall-timeout, far past any quiet spell of a healthy compile.
        run_args = shlex.split(env_values(spec).get("CACHEMGR_RUN_ARGS", ""))
        assert "--stall-timeout" not in run_args
        assert stall_default >= 15 * 60
        # Exec probes start Python; a node busy compiling needs the slack.
        for probe in (startup, live, ready):
            assert probe["timeoutSeconds"] >= 5
        assert float(ready["exec"]["command"][-1]) < ready["timeoutSeconds"]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    where = Node(tmp_path)
    try:
        yield where
    finally:
        where.stop_all()


def key_of(node: Node, doc: dict[str, Any], *, extra: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``cachemgr key -o json`` for the container's server argv, in the container's environment."""
    spec = container(doc)
    pod = node.work / "keys" / doc["metadata"]["name"]
    pod.mkdir(parents=True, exist_ok=True)
    env = node.env(doc, pod, extra=extra or {})
    if doc["kind"] == "Job":  # what cachemgr-warm exports before it execs cachemgr
        env.setdefault("VLLM_RBLN_COMPILE_ONLY", "1")
        env.setdefault("RBLN_FORCE_NPU_NAME", env["CACHEMGR_NPU_TYPE"])
    _own, server = split_args(spec["args"])
    result = subprocess.run(
        [sys.executable, "-m", "cachemgr", "key", "-o", "json", "--", *server],
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def test_warm_job_keys_exactly_like_its_role(
    node: Node, base: list[dict[str, Any]], warm_jobs: list[dict[str, Any]]
) -> None:
    keys = {}
    for role in ROLES:
        deployment, job = workload(base, "Deployment", role), workload(warm_jobs, "Job", role)
        served, warmed = key_of(node, deployment), key_of(node, job)
        assert warmed["key"] == served["key"], (served["inputs"], warmed["inputs"])
        assert served["inputs"]["role"] == role
        assert container(job)["image"] == container(deployment)["image"], "the compiler is in the key"
        assert env_values(container(job))["VLLM_RBLN_COMPILE_ONLY"] == "1"
        assert (
            env_values(container(job))["RBLN_FORCE_NPU_NAME"]
            == env_values(container(deployment))["CACHEMGR_NPU_TYPE"]
        )
        keys[role] = served["key"]
    assert keys["prefill"] != keys["decode"]


def test_warm_job_then_serving_pods_start_without_compiling(
    node: Node, base: list[dict[str, Any]], warm_jobs: list[dict[str, Any]]
) -> None:
    """The Job (cachemgr-warm) fills the role's volume; the role's pod (cachemgr-entrypoint) hits.

    Both run with ``--on-miss fail`` added to the manifest's CACHEMGR_RUN_ARGS, as an operator who
    relies on the Job sets it: the Job must compile all the same, and the pod must not need to.
    """
    for role in ROLES:
        job, deployment = workload(warm_jobs, "Job", role), workload(base, "Deployment", role)
        strict = {
            "CACHEMGR_RUN_ARGS": f"{env_values(container(deployment))['CACHEMGR_RUN_ARGS']} --on-miss fail"
        }
        before = node.compiles()
        warm = node.start(job, env=strict)
        assert warm.wait_exit() == 0, warm.tail()
        assert node.compiles() == before + 1
        served = node.start(deployment, env=strict)
        served.wait_phase("serving")
        assert node.compiles() == before + 1, "the pod found the Job's entry"
        ready = node.probe("readinessProbe", served)
        assert ready.returncode == 0, ready.stdout
        served.proc.send_signal(signal.SIGTERM)
        assert served.wait_exit() == 0
    claims = sorted(node.volumes)
    assert claims == sorted(f"modelserver-{role}-compile-cache" for role in ROLES)


def test_probes_pass_through_a_compile_and_liveness_catches_a_stall(
    node: Node, base: list[dict[str, Any]]
) -> None:
    deployment = workload(base, "Deployment", "prefill")
    slow = node.start(deployment, env={"STANDIN_COMPILE_SECONDS": "120"})
    slow.wait_phase("compiling")
    for which, passes in (("startupProbe", True), ("livenessProbe", True), ("readinessProbe", False)):
        result = node.probe(which, slow)
        assert (result.returncode == 0) == passes, (which, result.stdout, result.stderr)
    assert "compiling" in node.probe("livenessProbe", slow).stdout
    slow.proc.send_signal(signal.SIGTERM)
    slow.wait_exit()

    run_args = f"{env_values(container(deployment))['CACHEMGR_RUN_ARGS']} --stall-timeout 2s"
    hung = node.start(deployment, env={"STANDIN_HANG": "1", "CACHEMGR_RUN_ARGS": run_args})
    hung.wait_phase("compiling")

    def live_fails() -> str | None:
        result = node.probe("livenessProbe", hung)
        return result.stdout if result.returncode == 1 else None

    assert "compile stalled" in wait_for(live_fails, timeout=30, what="liveness to fail on the stall")
    hung.proc.send_signal(signal.SIGTERM)
    hung.wait_exit()


def test_entrypoint_execs_cachemgr_which_forwards_signals_and_returns_the_server_code(
    node: Node, base: list[dict[str, Any]]
) -> None:
    deployment = workload(base, "Deployment", "decode")
    pod = node.start(deployment, env={"STANDIN_EXIT_CODE": "7"})
    pod.wait_phase("serving")
    # exec: the process the kubelet signals is cachemgr itself, not a shell in front of it.
    cmdline = Path(f"/proc/{pod.proc.pid}/cmdline").read_bytes().split(b"\0")
    assert any(part.endswith(b"cachemgr") for part in cmdline[:2]), cmdline
    assert b"run" in cmdline, cmdline
    pod.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "SIGHUP" in node.signals_seen(), what="the server to see SIGHUP")
    assert pod.proc.poll() is None, "SIGHUP is passed on, not a reason to stop"
    pod.proc.send_signal(signal.SIGTERM)
    assert pod.wait_exit() == 7, pod.tail()
    assert "SIGTERM" in node.signals_seen()

    killed = node.start(deployment)
    killed.wait_phase("serving")
    killed.proc.send_signal(signal.SIGQUIT)  # the stand-in dies by it: 128+N comes back
    assert killed.wait_exit() == 128 + signal.SIGQUIT


def test_entrypoint_takes_options_from_the_environment_and_from_args(
    node: Node, base: list[dict[str, Any]]
) -> None:
    deployment = workload(base, "Deployment", "prefill")
    spec = container(deployment)
    run_args = env_values(spec)["CACHEMGR_RUN_ARGS"]

    from_env = node.start(deployment, env={"CACHEMGR_RUN_ARGS": f"{run_args} --on-miss fail"})
    assert from_env.wait_exit() == 69
    assert "--on-miss fail" in from_env.termination_log.read_text()

    from_args = node.start(deployment, args=["--on-miss", "fail", "--", *spec["args"]])
    assert from_args.wait_exit() == 69

    # Options in args come after CACHEMGR_RUN_ARGS, so they win.
    overridden = node.start(
        deployment,
        args=["--on-miss", "compile", "--", *spec["args"]],
        env={"CACHEMGR_RUN_ARGS": f"{run_args} --on-miss fail"},
    )
    overridden.wait_phase("serving")
    overridden.proc.send_signal(signal.SIGTERM)
    assert overridden.wait_exit() == 0

    nothing = node.start(deployment, args=[])
    assert nothing.wait_exit() == 64
    assert node.compiles() == 1


# A real public key, as `cachemgr keys generate --name builder-1` printed it (32 bytes).
TRUSTED = ["builder-1:7Hy+1Hr7O+3xKVnKafnKcp/iKblqbVBadtH1dbt3xnY="]


@pytest.mark.parametrize(
    "extra", ["--trusted-keys=", "--trusted=other-1:7Hy+1Hr7O+3xKVnKafnKcp/iKblqbVBadtH1dbt3xnY="]
)
def test_a_trust_option_added_past_the_chart_is_refused_by_cachemgr(
    node: Node, tmp_path: Path, extra: str
) -> None:
    """The chart renders trust as CACHEMGR_TRUSTED_KEYS, and its schema refuses trust options in
    cachemgr.extraArgs (tests/test_chart_trust.py). An option added where the schema cannot see
    it (the Deployment's CACHEMGR_RUN_ARGS edited with kubectl, an image's entrypoint) that empties
    or changes the keys, however argparse lets it be abbreviated, stops the pod with 78 naming the
    setting: cachemgr itself lets one setting decide, where such an option used to turn trust off."""
    values = merge(
        WARM,
        {
            "trust": {
                "trustedKeys": TRUSTED,
                "signingKeySecret": {"name": "modelserver-signing-key", "key": "signing.key"},
            }
        },
    )
    deployment = workload(render(tmp_path / "chart", values), "Deployment", "prefill")
    env = env_values(container(deployment))
    assert env["CACHEMGR_TRUSTED_KEYS"] == TRUSTED[0]
    pod = node.start(deployment, env={"CACHEMGR_RUN_ARGS": f"{env['CACHEMGR_RUN_ARGS']} {extra}"})
    assert pod.wait_exit() == 78, pod.tail()
    said = pod.termination_log.read_text()
    assert said.startswith(
        ("CACHEMGR_TRUSTED_KEYS (--trusted-keys) is set but empty", "--trusted-keys gives other keys")
    ), said
    assert node.compiles() == 0, "nothing compiled, nothing served"


# --- the image recipe ------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    logical, current = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            logical.append(current.strip())
        current = ""
    pairs = []
    for text in logical:
        instruction, _, rest = text.partition(" ")
        pairs.append((instruction.upper(), rest.strip()))
    return pairs


def install_calls(text: str) -> list[list[str]]:
    """Each ``scripts/install ...`` command in a shell text, as argv (variables left as written)."""
    calls = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        for i, word in enumerate(words):
            if word.endswith("scripts/install"):
                calls.append(words[i:])
    return calls


@pytest.mark.quick
def test_dockerfile_installs_with_the_command_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "exec scripts/test" in ci
    ((ci_script, ci_venv, ci_extra),) = install_calls((ROOT / "scripts" / "test").read_text())
    assert ci_script == "scripts/install"
    assert ci_venv == ".venv"

    instructions = dockerfile()
    runs = [rest for instruction, rest in instructions if instruction == "RUN"]
    image_calls = [call for run in runs for call in install_calls(run)]
    ((script, venv, extra),) = image_calls  # one install, the same script, the same argument shape
    (copy_src,) = [
        rest.split() for instruction, rest in instructions if instruction == "COPY" and rest.startswith(". ")
    ]
    assert script == f"{copy_src[1]}/scripts/install", "the repository's own scripts/install"
    assert venv.startswith("/")
    assert not venv.startswith(copy_src[1])
    for run in runs:  # nothing else installs Python packages
        assert not re.search(r"\b(pip|pip3|uv|poetry)\b", run), run

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert ci_extra in extras
    # The extra comes from the flavor's stage: modelserver on the SDK base, remote (boto3) on the slim one.
    assert extra == "$CACHEMGR_INSTALL_EXTRA"
    stages: dict[str, str] = {}
    stage = None
    for instruction, rest in instructions:
        if instruction == "FROM":
            stage = rest.split(" AS ")[1] if " AS " in rest else None
        elif instruction == "ENV" and stage and rest.startswith("CACHEMGR_INSTALL_EXTRA="):
            stages[stage] = rest.partition("=")[2]
    assert stages == {"modelserver": "modelserver", "slim": "remote"}
    assert set(stages.values()) - {""} <= extras
    global_args = [
        rest for i, rest in instructions[: [i for i, _ in instructions].index("FROM")] if i == "ARG"
    ]
    assert "FLAVOR=modelserver" in global_args
    assert ("FROM", "${FLAVOR}") in instructions


def test_the_image_never_carries_the_stand_ins() -> None:
    """The stand-in compiler and server are not product code: out of the build context, and
    installed only by the ``test`` and ``demo`` set-ups (never by an extra an image names)."""
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert "standin" in ignored
    install = (ROOT / "scripts" / "install").read_text()
    (line,) = [line for line in install.splitlines() if '"$here/standin"' in line]
    assert line.strip().startswith("test | demo)")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not [dep for deps in extras.values() for dep in deps if "standin" in dep]
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert packages["include"] == ["cachemgr", "cachemgr.*"]
    assert not list((ROOT / "cachemgr").rglob("standin/*.py")), "the stand-ins left cachemgr/ for standin/"


def test_demo_without_the_stand_ins_says_what_to_install(tmp_path: Path) -> None:
    """An image has no stand-ins: ``cachemgr demo`` there is one line and exit 78, not a traceback.

    The test venv has them installed, so the child hides the package (a ``None`` entry in
    ``sys.modules`` is how Python marks a module as not importable)."""
    code = (
        "import sys\n"
        "sys.modules['cachemgr_standin'] = None\n"
        "from cachemgr.cli.main import main\n"
        f"sys.exit(main(['demo', '--dir', {str(tmp_path / 'demo')!r}]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 78, result.stderr
    (line,) = error_lines(result.stderr)
    assert "cachemgr-standin" in line
    assert "scripts/demo" in line
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "demo").exists()


def test_dockerfile_runs_the_entrypoint_as_a_non_root_user_with_labels(base: list[dict[str, Any]]) -> None:
    instructions = dockerfile()
    (entrypoint,) = [json.loads(rest) for i, rest in instructions if i == "ENTRYPOINT"]
    assert entrypoint == ["cachemgr-entrypoint"]  # exec form: no shell between the kubelet and cachemgr
    assert ("COPY", "entrypoint/ /usr/local/bin/") in instructions
    assert not [rest for i, rest in instructions if i == "CMD"], "the server argv comes from the pod spec"

    user = [rest for i, rest in instructions if i == "USER"][-1]
    uid, gid = (int(x) for x in user.split(":"))
    assert uid != 0
    for role in ROLES:
        security = pod_spec(workload(base, "Deployment", role))["securityContext"]
        assert (security["runAsUser"], security["runAsGroup"], security["runAsNonRoot"]) == (uid, gid, True)

    env = " ".join(rest for i, rest in instructions if i == "ENV")
    state_dir = re.search(r"CACHEMGR_STATE_DIR=(\S+)", env)
    assert state_dir is not None
    assert any(
        f"install -d -o {uid} -g {gid}" in rest and state_dir[1] in rest
        for i, rest in instructions
        if i == "RUN"
    )
    ((_script, venv, _extra),) = [c for i, rest in instructions if i == "RUN" for c in install_calls(rest)]
    assert re.search(rf"PATH=\S*:{re.escape(venv)}/bin\b", env), "cachemgr on PATH, after the base's own"

    labels = " ".join(rest for i, rest in instructions if i == "LABEL")
    for field in (
        "title",
        "description",
        "version",
        "revision",
        "created",
        "licenses",
        "source",
        "base.name",
    ):
        assert f"org.opencontainers.image.{field}=" in labels, field
    license_ = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert f'org.opencontainers.image.licenses="{license_}"' in labels


@pytest.mark.quick
def test_dockerignore_keeps_what_the_install_needs() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for needed in ("pyproject.toml", "README.md", "cachemgr", "scripts", "entrypoint"):
        assert needed not in patterns, needed
    for excluded in (".git", ".venv", "tests"):
        assert excluded in patterns, excluded


def test_modelserver_install_sees_the_base_image_sdk_or_stops(tmp_path: Path) -> None:
    """scripts/install VENV modelserver: a venv over the system site-packages, and a clear stop
    when the SDK is not there (as here), before pip could fetch a second copy."""
    venv = tmp_path / "venv"
    result = subprocess.run(
        [str(ROOT / "scripts" / "install"), str(venv), "modelserver"],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    assert result.returncode == 1
    assert "rebel-compiler is not installed" in result.stderr
    assert "include-system-site-packages = true" in (venv / "pyvenv.cfg").read_text()
    assert not list(venv.glob("lib/python*/site-packages/cachemgr*")), "stopped before installing"
