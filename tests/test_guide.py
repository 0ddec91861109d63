"""docs/operator-guide.md, followed as a new operator would: every output it shows is re-made here.

The guide's story runs for real: the Deployments and warm Jobs that the chart (deploy/helm/modelserver,
rendered by the real Helm) makes start as real processes (their entrypoint scripts, their
environment, the stand-in ``vllm`` on PATH) on two 200Gi volumes (tmpfs, so ``du`` reports the
PVC's size), one per role. The guide marks where the story moves on with HTML comments, invisible
when rendered:

* ``<!-- guide: STEP -->`` runs STEP (a function below: pods start, an image is upgraded...);
* a ``console`` block is a shell in the pod the story is in: each ``$ command`` runs there (the
  container's environment, as ``kubectl exec`` gives it), and its output must match the lines
  under it; after ``<!-- guide: workstation -->`` it is the operator's own shell instead, in the
  checkout, with the real Helm on PATH (``helm template``, ``helm lint``: what runs without a
  cluster);
* ``<!-- guide: exit N [VARIANT] -->`` before a ``text`` block: a pod failing with exit code N
  (``failing_pod``: VARIANT picks another cause of the same code); the block is its termination
  message;
* ``<!-- guide: log ROLE-warm -->`` before a ``text`` block: the last two lines of the role's
  latest warm Job, as ``kubectl logs job/... --tail 2`` shows them;
* ``<!-- guide: refusal NAME -->`` before a ``text`` block: the line the chart refuses an
  install or upgrade with (``REFUSALS`` below: values against an existing PVC, which the same
  template helper gets from ``testing.existingClaims`` where ``lookup`` has no cluster to ask).

What only a real cluster prints (kubectl, helm install/upgrade) is shown as ``sh`` blocks, never
with output.
Output is compared after the volatile parts are blurred: ages and durations, timestamps, pids,
column padding. ``CACHEMGR_GUIDE_WRITE=1 pytest tests/test_guide.py`` writes the fresh output
into the guide instead (review the diff before committing it).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from cachemgr_testkit.helm import refusal
from cachemgr_testkit.kube import ROOT, Container, Node, by_kind, container, merge, render, workload
from cachemgr_testkit.mounts import tmpfs_volume
from cachemgr_testkit.podlib import wait_for

GUIDE = ROOT / "docs" / "operator-guide.md"
SECTION = "# Operator guide"  # the guide runs from this heading to the next of its level
WRITE = os.environ.get("CACHEMGR_GUIDE_WRITE") == "1"
PVC_SIZE = 200 << 30  # the chart's default storage.compileCache.size
OLD_SDK, NEW_SDK = "0.12.3", "0.13.0"  # rebel-compiler of the first image, and of the upgrade
# The images of the story as they declare themselves to cachemgr (their rebel-compiler and server
# versions; vLLM and transformers stay the stand-in's), and the template hash of their ReplicaSet:
# the first install's, the SDK upgrade's, and a server upgrade on the same compiler after it.
IMAGES: dict[str, dict[str, str]] = {
    "sdk-0.12": {"CACHEMGR_COMPILER_VERSION": OLD_SDK, "CACHEMGR_VLLM_RBLN_VERSION": "0.12.0",
                 "CACHEMGR_OPTIMUM_RBLN_VERSION": "0.12.0"},
    "sdk-0.13": {"CACHEMGR_COMPILER_VERSION": NEW_SDK, "CACHEMGR_VLLM_RBLN_VERSION": "0.13.0",
                 "CACHEMGR_OPTIMUM_RBLN_VERSION": "0.13.0"},
    "sdk-0.13.1": {"CACHEMGR_COMPILER_VERSION": NEW_SDK, "CACHEMGR_VLLM_RBLN_VERSION": "0.13.1",
                   "CACHEMGR_OPTIMUM_RBLN_VERSION": "0.13.0"},
}  # fmt: skip
TEMPLATES = {"sdk-0.12": "7d9c6b5f48", "sdk-0.13": "5b8f7c9d64", "sdk-0.13.1": "6c8d4f7b59"}
SERVER_PORT = "8000"
# The guide's install: the image it builds, both warm Jobs on for the upgrade it makes.
GUIDE_IMAGE = {"image": {"repository": "registry.example.com/modelserver-cachemgr", "tag": "sdk-0.12"}}
WARM = {"prefill": {"warm": True}, "decode": {"warm": True}}

# --- the guide's blocks ----------------------------------------------------------------------------


@dataclass
class Block:
    """A fenced block the test re-makes: its place in the guide, what runs, what it shows."""

    kind: str  # console | exit | refusal | log
    start: int  # first line inside the fence
    end: int  # the closing fence's line
    steps: list[str]  # guide steps to run before it
    text: str
    code: int | None = None
    refusal: str | None = None
    variant: str = ""  # exit: which cause of the code (failing_pod); log: whose log


def guide_section(lines: list[str]) -> tuple[int, int]:
    """Where the guide is in its page: its heading's line, and the next heading's of the same level."""
    first = lines.index(SECTION)
    level = SECTION.split(maxsplit=1)[0] + " "
    fenced = False
    for i, line in enumerate(lines[first + 1 :], first + 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith(level):  # a "# " line in a block is no heading
            return first, i
    return first, len(lines)


def parse(lines: list[str]) -> list[Block]:
    blocks: list[Block] = []
    pending: list[str] = []
    exit_code: int | None = None
    refused: str | None = None
    variant: str | None = None  # an exit's cause, or a log's owner
    i = 0
    while i < len(lines):
        line = lines[i]
        directive = re.fullmatch(r"<!-- guide: (.+?) -->", line.strip())
        if directive:
            words = directive[1].split()
            if words[0] == "exit":
                exit_code, variant = int(words[1]), " ".join(words[2:])
            elif words[0] == "refusal":
                refused = words[1]
            elif words[0] == "log":
                variant = words[1]
            else:
                pending.append(directive[1])
        fence = re.fullmatch(r"```(\w*)", line.strip())
        if fence and fence[1] in ("console", "text"):
            end = lines.index("```", i + 1)
            if fence[1] == "console" or exit_code is not None or refused is not None or variant is not None:
                kind = (
                    "console"
                    if fence[1] == "console"
                    else "exit"
                    if exit_code is not None
                    else "refusal"
                    if refused is not None
                    else "log"
                )
                text = "\n".join(lines[i + 1 : end])
                blocks.append(Block(kind, i + 1, end, pending, text, exit_code, refused, variant or ""))
                pending, exit_code, refused, variant = [], None, None, None
            i = end
        i += 1
    assert not pending, f"steps with no block after them: {pending}"
    return blocks


def commands(text: str) -> list[tuple[str, str]]:
    """A console block's ``$ command`` lines, each with the output lines under it."""
    pairs: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            pairs.append((line[2:], []))
        else:
            assert pairs, f"output before any command: {line!r}"
            pairs[-1][1].append(line)
    return [(cmd, "\n".join(out)) for cmd, out in pairs]


# --- the story's world ----------------------------------------------------------------------------


@dataclass
class World:
    """The cluster of the guide's story: pods by name, the image's SDK, the pod a shell is in."""

    node: Node
    base: list[dict[str, Any]]
    jobs: list[dict[str, Any]]
    image: str = "sdk-0.12"  # the tag the Deployments and Jobs run (IMAGES)
    pods: dict[str, Container] = field(default_factory=dict)
    shell: Container | None = None
    frozen: list[psutil.Process] = field(default_factory=list)
    serial: int = 0
    workstation: bool = False  # the next console block runs in the operator's shell, not a pod
    warm_logs: dict[str, Path] = field(default_factory=dict)  # each role's latest warm Job's log

    def last_log_lines(self, owner: str) -> str:
        """``kubectl logs job/...-ROLE-warm-... --tail 2``: its report on the space, what it did."""
        return "\n".join(
            self.warm_logs[owner.removesuffix("-warm")].read_text().rstrip("\n").splitlines()[-2:]
        )

    def deployment(self, role: str) -> dict[str, Any]:
        return workload(self.base, "Deployment", role)

    def start(self, role: str, *, node: str, env: dict[str, str] | None = None) -> Container:
        """A pod of the role's Deployment, named as a ReplicaSet names them, on the current image."""
        self.serial += 1
        name = f"modelserver-{role}-{TEMPLATES[self.image]}-{POD_SUFFIXES[self.serial]}"
        pod = self.node.start(
            self.deployment(role),
            name=name,
            node_name=node,
            env={**IMAGES[self.image], "STANDIN_COMPILE_SECONDS": "0.5", **(env or {})},
        )
        self.pods[name] = pod
        return pod

    def warm(self, role: str) -> None:
        job = workload(self.jobs, "Job", role)
        self.serial += 1
        name = f"{job['metadata']['name']}-{POD_SUFFIXES[self.serial]}"
        run = self.node.start(job, name=name, node_name="cpu-node-1", env=IMAGES[self.image])
        assert run.wait_exit() == 0, run.tail()
        self.warm_logs[role] = run.pod_dir / "log"

    def stop(self, pod: Container) -> None:
        pod.proc.send_signal(signal.SIGTERM)
        assert pod.wait_exit() == 0, pod.tail()
        del self.pods[pod.name]

    def running(self, role: str) -> list[Container]:
        return [p for p in self.pods.values() if p.doc["metadata"]["name"] == f"modelserver-{role}"]

    def sh(self, command: str) -> str:
        """``command`` in the current pod, as ``kubectl exec POD -- sh -c COMMAND`` runs it; or in
        the operator's shell in the checkout (``workstation``), with the test venv's Helm on PATH."""
        if self.workstation:
            env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "HOME": str(self.node.work)}
            cwd = ROOT
        else:
            assert self.shell is not None, "a console block before any pod is running"
            env, cwd = self.shell.env, self.shell.pod_dir
        result = subprocess.run(
            ["sh", "-c", command],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=60,
            check=False,
        )
        return result.stdout.rstrip("\n")


# Pods as a ReplicaSet names them: a stable template hash per image, a random-looking suffix.
POD_SUFFIXES = [
    "",
    "x7kqp",
    "m2v9d",
    "c4hzt",
    "r8wfn",
    "q5jlb",
    "t9gxs",
    "h3npk",
    "w6dzr",
    "b2mcv",
    "k8slq",
    "p4fxm",
    "d7rzn",
    "g2kvw",
    "s6hqt",
    "v9cbl",
    "n3wjd",
    "f8mpx",
    "j5tzq",
    "l2rkv",
    "y4dgs",
    "z7mtc",
    "a5qwn",
    "e9hvk",
    "u3bxs",
    "i6lfp",
]


def server_child(pod: Container) -> psutil.Process:
    """The stand-in server (compiling) under the pod's cachemgr."""

    def find() -> psutil.Process | None:
        for proc in psutil.Process(pod.proc.pid).children(recursive=True):
            if "cachemgr_standin.server" in " ".join(proc.cmdline()):
                return proc
        return None

    found: psutil.Process = wait_for(find, what=f"the server under {pod.name}")
    return found


STEPS: dict[str, Callable[[World], None]] = {}


def step(name: str) -> Callable[[Callable[[World], None]], Callable[[World], None]]:
    def register(func: Callable[[World], None]) -> Callable[[World], None]:
        STEPS[name] = func
        return func

    return register


@step("first-install-compiling")
def _first_install_compiling(world: World) -> None:
    """Two prefill pods start on an empty cache: one compiles (held mid-compile), one waits."""
    first = world.start("prefill", node="npu-node-1", env={"STANDIN_COMPILE_SECONDS": "2"})
    first.wait_phase("compiling")
    server = server_child(first)
    server.suspend()  # hold the compile here while the guide looks at it; resumed below
    world.frozen.append(server)
    second = world.start("prefill", node="npu-node-2")
    second.wait_phase("waiting")
    world.shell = second


@step("first-install-done")
def _first_install_done(world: World) -> None:
    while world.frozen:
        world.frozen.pop().resume()
    for pod in world.running("prefill"):
        pod.wait_phase("serving")
    decode = [world.start("decode", node=f"npu-node-{n}") for n in (3, 4)]
    for pod in decode:
        pod.wait_phase("serving")
    assert world.node.compiles() == 2, "one compile per role"
    world.shell = world.running("prefill")[0]


@step("workstation")
def _workstation(world: World) -> None:
    world.workstation = True


@step("warm-restart")
def _warm_restart(world: World) -> None:
    """A prefill pod is deleted; its replacement finds the entry and loads it, no compile."""
    before = world.node.compiles()
    world.stop(world.running("prefill")[-1])
    again = world.start("prefill", node="npu-node-2")
    again.wait_phase("serving")
    assert world.node.compiles() == before, "a restart starts with a model load only"
    world.shell = again


@step("scale-out")
def _scale_out(world: World) -> None:
    before = world.node.compiles()
    third = world.start("prefill", node="npu-node-5")
    third.wait_phase("serving")
    assert world.node.compiles() == before, "scale-out starts with a model load only"
    world.shell = third


@step("upgrade-warm")
def _upgrade_warm(world: World) -> None:
    """The new SDK image: the warm Jobs compile its keys beside the old entries."""
    world.image = "sdk-0.13"
    before = world.node.compiles()
    for role in ("prefill", "decode"):
        world.warm(role)
    assert world.node.compiles() == before + 2


@step("upgrade-rollout")
def _upgrade_rollout(world: World) -> None:
    """The rollout's first new pods (surge): they hit the warm Jobs' entries; old pods still serve."""
    before = world.node.compiles()
    new = world.start("prefill", node="npu-node-6")
    new.wait_phase("serving")
    assert world.node.compiles() == before
    world.shell = new


@step("upgrade-old-shell")
def _upgrade_old_shell(world: World) -> None:
    """``kubectl exec deploy/...`` lands in a pod of the old image: it is still one of the Deployment's."""
    world.shell = next(p for p in world.running("prefill") if TEMPLATES["sdk-0.12"] in p.name)


@step("server-upgrade-warm")
def _server_upgrade_warm(world: World) -> None:
    """A server upgrade on the same compiler (vllm-rbln 0.13.1): the warm Jobs compile again."""
    world.image = "sdk-0.13.1"
    before = world.node.compiles()
    for role in ("prefill", "decode"):
        world.warm(role)
    assert world.node.compiles() == before + 2


@step("server-upgrade-done")
def _server_upgrade_done(world: World) -> None:
    replace_old_pods(world)
    world.shell = world.running("prefill")[0]


@step("upgrade-done")
def _upgrade_done(world: World) -> None:
    """The rollout completes: the old pods are replaced by new ones (3 prefill, 2 decode); the
    shell is a new pod's again."""
    replace_old_pods(world)
    world.shell = world.running("prefill")[0]


def replace_old_pods(world: World) -> None:
    old = [p for p in world.pods.values() if TEMPLATES[world.image] not in p.name]
    for pod in old:
        pod.proc.send_signal(signal.SIGTERM)
    for pod in old:
        assert pod.wait_exit() == 0, pod.tail()
        del world.pods[pod.name]
    wanted = {"prefill": 3, "decode": 2}
    new = [
        world.start(role, node=f"npu-node-{7 + n}")
        for role, count in wanted.items()
        for n in range(count - len(world.running(role)))
    ]
    for pod in new:
        pod.wait_phase("serving")


@step("uninstall")
def _uninstall(world: World) -> None:
    for pod in list(world.pods.values()):
        world.stop(pod)
    world.shell = None


@step("reinstall")
def _reinstall(world: World) -> None:
    before = world.node.compiles()
    pods = [world.start(role, node=f"npu-node-{n}") for n, role in enumerate(["prefill", "decode"], 1)]
    for pod in pods:
        pod.wait_phase("serving")
    assert world.node.compiles() == before, "the kept PVCs serve the reinstall"
    world.shell = pods[0]


# --- pods failing with each exit code ------------------------------------------------------------


def failing_pod(
    work: Path, world: World, code: int, stack: ExitStack, variant: str = ""
) -> tuple[Node, Container]:
    """A prefill pod of the new SDK that ends with ``code``, on a volume of its own; the guide
    shows its message. 73 ``rollout``: the old SDK's pod still serves the entry that fills it."""
    small = code == 73  # a volume too small for a second compile: preflight stops it
    node = Node(
        work,
        volume=(lambda claim: stack.enter_context(tmpfs_volume(work / claim, size_bytes=3 << 19)))
        if small
        else None,
    )
    stack.callback(node.stop_all)
    deployment = workload(world.base, "Deployment", "prefill")
    run_args = container(deployment)["env"]
    run_args = next(e["value"] for e in run_args if e["name"] == "CACHEMGR_RUN_ARGS")
    env: dict[str, str] = dict(IMAGES["sdk-0.13"])
    holder_env = {**env, "STANDIN_COMPILE_SECONDS": "60"}
    holder = {"name": f"modelserver-prefill-5b8f7c9d64-{POD_SUFFIXES[1]}", "node_name": "npu-node-1"}
    if code == 64:
        env["CACHEMGR_RUN_ARGS"] = f"{run_args} --on-miss never"
    elif code == 69:
        env["CACHEMGR_RUN_ARGS"] = f"{run_args} --on-miss fail"
    elif code == 70:
        env["STANDIN_EXIT_BEFORE_HEALTHY"] = "1"
    elif code == 73 and variant == "rollout":  # the old SDK's pod serves the entry that fills it
        old = {"name": f"modelserver-prefill-7d9c6b5f48-{POD_SUFFIXES[1]}", "node_name": "npu-node-1"}
        node.start(
            deployment, env={**IMAGES["sdk-0.12"], "STANDIN_COMPILE_SECONDS": "0.5"}, **old
        ).wait_phase("serving")
    elif code == 73:  # the old SDK's entry fills the volume: the new SDK's compile cannot fit
        job = workload(world.jobs, "Job", "prefill")
        warm = node.start(job, env=IMAGES["sdk-0.12"], name=f"{job['metadata']['name']}-6xq2d")
        assert warm.wait_exit() == 0, warm.tail()
    elif code == 74:
        env["CACHEMGR_CACHE_ROOT"] = "/var/cache/cachemgr"  # the PVC is not mounted there
    elif code == 75:
        node.start(deployment, env=holder_env, **holder).wait_phase("compiling")
        env["CACHEMGR_RUN_ARGS"] = f"{run_args} --wait-timeout 1s"
    elif code == 78:
        env["CACHEMGR_COMPILER_VERSION"] = ""  # as in an image without rebel-compiler
    elif code == 143:
        node.start(deployment, env=holder_env, **holder).wait_phase("compiling")
    pod = node.start(
        deployment, env=env, name=f"modelserver-prefill-5b8f7c9d64-{POD_SUFFIXES[2]}", node_name="npu-node-2"
    )
    if code == 143:
        pod.wait_phase("waiting")
        pod.proc.send_signal(signal.SIGTERM)
    assert pod.wait_exit() == code, pod.tail()
    return node, pod


def termination_message(work: Path, world: World, code: int, variant: str = "") -> str:
    """What a pod failing with ``code`` leaves as its termination message, as the guide shows it."""
    with ExitStack() as stack:
        node, pod = failing_pod(work, world, code, stack, variant)
        return presentable(pod.termination_log.read_text(), node)


# --- what the chart refuses, against an existing PVC ---------------------------------------------------

EXISTING = "modelserver-prefill-compile-cache"
REFUSALS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (the values of the install or upgrade, the existing PVC's spec as lookup returns it)
    "smaller-size": (
        {"storage": {"compileCache": {"size": "100Gi"}}},
        {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "200Gi"}}},
    ),
    "rwo-with-a-pending-rwx-pvc": (
        {
            "storage": {"compileCache": {"accessModes": ["ReadWriteOnce"]}},
            "prefill": {"replicas": 1},
            "decode": {"replicas": 1},
        },
        {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "200Gi"}}},
    ),
    "rwo-with-two-pods": (
        {"storage": {"compileCache": {"accessModes": ["ReadWriteOnce"]}}, "decode": {"replicas": 1}},
        {},
    ),
}


def refusal_line(work: Path, name: str) -> str:
    """What the chart refuses the values with: a template's one line without Helm's location prefix
    (``Error: ... execution error at (...): ``), or the schema's refusal as Helm prints it."""
    values, spec = REFUSALS[name]
    claims = {EXISTING: {"spec": spec}} if spec else {}
    message = refusal(merge(merge(GUIDE_IMAGE, values), {"testing": {"existingClaims": claims}}), work=work)
    first = message.splitlines()[0]
    if "execution error at (" in first:
        return first.split("): ", 1)[1]
    return message


# --- making output presentable, and comparing it ---------------------------------------------------


def presentable(text: str, world: World | Node) -> str:
    """Harness paths and ports as the pod sees them (/var/cache/cachemgr, /run/cachemgr, :8000)."""
    node = world.node if isinstance(world, World) else world
    for path in node.volumes.values():
        text = text.replace(str(path), "/var/cache/cachemgr")
    text = re.sub(re.escape(str(node.work / "pods")) + r"/[^/\s]+/cachemgr-state", "/run/cachemgr", text)
    text = re.sub(
        re.escape(str(node.work / "pods")) + r"/[^/\s]+/termination-log", "/dev/termination-log", text
    )
    text = re.sub(r"127\.0\.0\.1:\d+", f"127.0.0.1:{SERVER_PORT}", text)
    assert str(node.work) not in text, f"a harness path leaks into the guide:\n{text}"
    return text


_DURATION = r"\d+(?:\.\d+)?(?:ms|s|m|h|d)(?: \d+(?:ms|s|m))?"


def blur(text: str) -> str:
    """What may differ between two runs of the same story."""
    text = re.sub(r"\d{4}-\d\d-\d\dT[\d:.]+Z?", "<time>", text)
    text = re.sub(rf"\b{_DURATION}\b", "<dur>", text)
    text = re.sub(r"\bpid \d+", "pid <pid>", text)
    text = re.sub(r"\d+ ms\b", "<ms>", text)
    # A server's own lines in a termination message: its log's clock, its port, the attempt's name.
    text = re.sub(r"\b\d\d-\d\d \d\d:\d\d:\d\d\b", "<clock>", text)
    text = re.sub(r"--port \d+", "--port <port>", text)
    text = re.sub(r"\.\d+\.[0-9a-f]{8}/", ".<attempt>/", text)
    text = re.sub(r"[ \t]+", " ", text)
    # Prose wraps at 80 columns: a value of another length (an age, a pid, the harness's path of
    # the volume) moves a word across a line break. A wrapped line goes on indented: joined back.
    text = re.sub(r" *\n(?=[ \t])[ \t]*", " ", text)
    return "\n".join(line.rstrip() for line in text.splitlines()).strip()


# --- the test ----------------------------------------------------------------------------------------


@pytest.fixture
def world(tmp_path: Path, tmpfs_small: Callable[[int], Path]) -> Iterator[World]:
    with ExitStack() as stack:
        node = Node(tmp_path / "cluster", volume=lambda _claim: tmpfs_small(PVC_SIZE))
        objects = render(tmp_path / "chart", merge(GUIDE_IMAGE, WARM))
        story = World(node, objects, by_kind(objects, "Job"))
        stack.callback(node.stop_all)
        stack.callback(lambda: [p.resume() for p in story.frozen if p.is_running()])
        yield story


@pytest.mark.timeout(300)  # the story: some 25 pods and Jobs, one step after another
def test_every_output_in_the_operator_guide_is_what_the_commands_print(world: World, tmp_path: Path) -> None:
    everything = GUIDE.read_text().splitlines()
    first, last = guide_section(everything)
    lines = everything[first:last]
    blocks = parse(lines)
    assert sum(b.kind == "console" for b in blocks) >= 7
    assert {b.code for b in blocks if b.kind == "exit"} >= {64, 69, 70, 73, 74, 75, 78, 143}
    assert {b.refusal for b in blocks if b.kind == "refusal"} == set(REFUSALS)
    made: dict[int, str] = {}
    mismatches = []
    too_wide: list[str] = []
    # The failing pods are independent of the story and of each other: they run meanwhile.
    with ThreadPoolExecutor(max_workers=4) as pool:
        messages = {
            n: pool.submit(termination_message, tmp_path / f"exit{n}", world, block.code, block.variant)
            for n, block in enumerate(blocks)
            if block.code is not None
        }
        for n, block in enumerate(blocks):
            for name in block.steps:
                STEPS[name](world)
            if block.kind == "console":
                outputs = [(cmd, presentable(world.sh(cmd), world)) for cmd, _ in commands(block.text)]
                too_wide += [
                    f"guide line {block.start}: $ {cmd}\n{line}"
                    for cmd, out in outputs
                    for line in wider_than_80(cmd, out)
                ]
                actual = "\n".join(f"$ {cmd}\n{out}" if out else f"$ {cmd}" for cmd, out in outputs)
                world.workstation = False
            elif block.kind == "refusal":
                assert block.refusal is not None
                actual = refusal_line(tmp_path / "refusals", block.refusal)
            elif block.kind == "log":
                actual = presentable(world.last_log_lines(block.variant), world)
            else:
                actual = messages[n].result()
            made[n] = actual
            if blur(actual) != blur(block.text):
                mismatches.append(
                    f"--- guide line {block.start}: shown\n{block.text}\n--- now prints\n{actual}"
                )
    if WRITE:
        for n, block in reversed(list(enumerate(blocks))):
            lines[block.start : block.end] = made[n].splitlines()
        GUIDE.write_text("\n".join([*everything[:first], *lines, *everything[last:]]) + "\n")
    assert not too_wide, "\n\n".join(too_wide)
    assert WRITE or not mismatches, "\n\n".join(mismatches)


# What is never wrapped (docs/reference.md, "Every inspection command takes -o json"): machine forms,
# a probe's line (the kubelet records it as one), log events, the one-line error, a program's quoted
# output; and a line of one word too long for the room (a path, an entry name), beside its label.
_MACHINE = re.compile(r"-o (json|yaml|wide|jsonpath|custom-columns)|--output|\| *jq|^cachemgr probe ")
_NEVER_WRAPPED = re.compile(r"\d{4}-\d\d-\d\dT|cachemgr [a-z-]+: |\s*\| ")


def wider_than_80(command: str, output: str) -> list[str]:
    """Issue 40: at 80 columns (no terminal) every line a person reads fits, but the exceptions."""
    if not command.startswith("cachemgr ") or _MACHINE.search(command):
        return []
    return [
        line
        for line in output.splitlines()
        if len(line) > 80 and not _NEVER_WRAPPED.match(line) and len(line.split()) > 2
    ]
