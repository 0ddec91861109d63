"""The chart's objects as the tests use them: rendered by the real Helm (cachemgr_testkit.helm),
and their containers run as real processes on a test "node" (volumes in a work directory, the
stand-in ``vllm`` on PATH, free ports). tests/test_deploy.py runs the chart's workloads with it;
tests/test_guide.py re-makes the operator guide's outputs with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cachemgr_standin import DECLARED_VERSIONS
from cachemgr_standin.shim import write_vllm_shim

from cachemgr_testkit.helm import ROOT, TEST_IMAGE, template
from cachemgr_testkit.podlib import DEADLINE, free_port, read_jsonl, wait_for

# The checkout this package is installed from (scripts/install installs it editable): the
# chart, the entrypoint scripts and the README are read from there.
ENTRYPOINT = ROOT / "entrypoint"
STANDIN_COMPILER_VERSION = "0.12.0"  # stands in for the image's rebel-compiler, absent here


# --- rendering the chart -----------------------------------------------------------------------


def load_yaml(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def venv_tool(name: str) -> str:
    """A tool of the test set-up, beside this interpreter (helm, kubernetes-validate)."""
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(
            f"{name} is not installed beside {sys.executable}: install the test extra (scripts/test does)"
        )
    return found


def render(
    work: Path, values: Mapping[str, Any] | None = None, *, release: str = "modelserver"
) -> list[dict[str, Any]]:
    """What ``helm template`` makes of the chart for ``values`` (over a test image), as objects."""
    return template(merge(TEST_IMAGE, dict(values or {})), work=work, release=release)


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base`` as Helm lays a values file on the defaults: maps merge, the rest replaces."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def role_of(doc: dict[str, Any]) -> str:
    """prefill or decode: a warm Job's component is ``<role>-warm``, so no role selector picks it."""
    component: str = doc["metadata"]["labels"]["app.kubernetes.io/component"]
    return component.removesuffix("-warm")


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["spec"]["template"]["spec"]
    return spec


def container(doc: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod_spec(doc)["containers"]
    return dict(only)


def workload(docs: list[dict[str, Any]], kind: str, role: str) -> dict[str, Any]:
    (found,) = [doc for doc in by_kind(docs, kind) if role_of(doc) == role]
    return found


# --- running the containers as the manifests say ---------------------------------------------------


@dataclass
class Container:
    """A manifest's container run as a real process: volumes in tmp, stand-in vllm on PATH."""

    name: str
    doc: dict[str, Any]
    env: dict[str, str]  # as the kubelet gives it to the container, and to what it execs there
    proc: subprocess.Popen[bytes]
    pod_dir: Path

    @property
    def state_dir(self) -> Path:
        return Path(self.env["CACHEMGR_STATE_DIR"])

    @property
    def termination_log(self) -> Path:
        return Path(self.env["CACHEMGR_TERMINATION_LOG"])

    @property
    def log(self) -> Path:
        return self.pod_dir / "log"

    def phase(self) -> str | None:
        try:
            value: str | None = json.loads((self.state_dir / "state.json").read_text()).get("phase")
        except (OSError, ValueError):
            return None
        return value

    def wait_phase(self, *phases: str) -> None:
        def reached() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited {self.proc.returncode} before {phases}:\n{self.tail()}"
                )
            return self.phase() in phases

        wait_for(reached, what=f"{self.name} to reach {'/'.join(phases)}")

    def wait_exit(self) -> int:
        try:
            return self.proc.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit:\n{self.tail()}") from None

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def stop(self) -> None:
        """Kill the whole pod (cachemgr, server, compiler): it runs in a session of its own."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def _localized(value: str, local: Mapping[str, str]) -> str:
    """A path in the container (a mount path, or a file under one) as the test's local path."""
    for mount in sorted(local, key=len, reverse=True):
        if value == mount or value.startswith(mount.rstrip("/") + "/"):
            return local[mount] + value[len(mount) :]
    return value


# bind(source, target, read_only): mount ``source`` at ``target`` until the test ends (a test that
# can mount passes cachemgr_testkit.mounts' binds through an ExitStack).
Bind = Callable[[Path, Path, bool], Path]


class Node:
    """Where the test's containers run: one compile cache volume per PVC, pod-local dirs per pod.

    By default a PVC mount is the volume's directory itself (a subPath, the folder inside it) and
    ``readOnly`` is not enforced. With ``bind``, each PVC mount is bind-mounted where the pod sees
    it, parents first, read-only where the manifest says: the read-only cache root with its
    ``usage/`` subPath read-write over it, as the kubelet mounts them. ``secrets`` (name: {key:
    bytes}) fill a Secret volume's directory as the kubelet projects it.
    """

    def __init__(
        self,
        work: Path,
        *,
        volume: Callable[[str], Path] | None = None,
        bind: Bind | None = None,
        secrets: Mapping[str, Mapping[str, bytes]] | None = None,
    ) -> None:
        self.work = work
        self._bind = bind
        self.secrets = dict(secrets or {})
        self.bin = work / "bin"
        write_vllm_shim(self.bin)
        self.record = work / "record.jsonl"
        self.signals = work / "signals.log"
        self.started: list[Container] = []
        self.volumes: dict[str, Path] = {}
        self._make_volume = volume
        self.count = 0

    def volume(self, claim: str) -> Path:
        """The PVC ``claim``: a directory here, or what the ``volume`` factory mounts for it."""
        if claim not in self.volumes:
            if self._make_volume is not None:
                self.volumes[claim] = self._make_volume(claim)
            else:
                self.volumes[claim] = self.work / "volumes" / claim
                self.volumes[claim].mkdir(parents=True)
        return self.volumes[claim]

    def env(
        self,
        doc: dict[str, Any],
        pod: Path,
        *,
        node_name: str = "node-a",
        extra: Mapping[str, str] | None = None,
    ) -> dict[str, str]:
        """The container's environment as the kubelet builds it, with the pod's paths made local."""
        spec = container(doc)
        local = self.mounts(doc, pod)
        fields = {"metadata.name": pod.name, "spec.nodeName": node_name}
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("CACHEMGR_", "VLLM_", "RBLN_", "STANDIN_"))
        }
        for entry in spec["env"]:
            if "value" in entry:
                env[entry["name"]] = _localized(entry["value"], local)
            else:
                env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        env.update(
            PATH=os.pathsep.join(
                [str(self.bin), str(ENTRYPOINT), str(Path(sys.executable).parent), env["PATH"]]
            ),
            CACHEMGR_COMPILER_VERSION=STANDIN_COMPILER_VERSION,
            **DECLARED_VERSIONS,
            # A warm Job runs on a CPU node: the stand-in's rebel.get_npu_name(0) answers nothing.
            **({"STANDIN_NPU_NAME": "none"} if doc["kind"] == "Job" else {}),
            CACHEMGR_TERMINATION_LOG=str(pod / "termination-log"),
            STANDIN_COMPILE_SECONDS="0.3",
            STANDIN_RECORD=str(self.record),
            STANDIN_SIGNAL_LOG=str(self.signals),
            PYTHONUNBUFFERED="1",
        )
        env.update(extra or {})
        if "CACHEMGR_RUN_ARGS" in env:  # the status port: any free one (runtime-only, not in the key)
            env["CACHEMGR_RUN_ARGS"] = re.sub(
                r"--status-port \d+", "--status-port 0", env["CACHEMGR_RUN_ARGS"]
            )
        return env

    def mounts(self, doc: dict[str, Any], pod: Path) -> dict[str, str]:
        """Each of the container's mount paths as a local directory (the class says how)."""
        volumes = {v["name"]: v for v in pod_spec(doc)["volumes"]}
        local: dict[str, str] = {}
        for mount in sorted(container(doc)["volumeMounts"], key=lambda m: m["mountPath"]):
            source = volumes[mount["name"]]
            claim = source.get("persistentVolumeClaim")
            if claim is None:
                path = pod / mount["name"]
                path.mkdir(parents=True, exist_ok=True)
                self._project(source, path)
            else:
                path = self.volume(claim["claimName"]) / mount.get("subPath", "")
                path.mkdir(parents=True, exist_ok=True)  # the kubelet makes a missing subPath folder
                if self._bind is not None:
                    read_only = bool(mount.get("readOnly") or claim.get("readOnly"))
                    path = self._bind(path, pod / "mnt" / mount["mountPath"].lstrip("/"), read_only)
            local[mount["mountPath"]] = str(path)
        return local

    def _project(self, source: dict[str, Any], path: Path) -> None:
        """A Secret volume's items, as the kubelet writes them (its defaultMode)."""
        secret = source.get("secret")
        if secret is None or secret["secretName"] not in self.secrets:
            return
        data = self.secrets[secret["secretName"]]
        for item in secret.get("items") or [{"key": k, "path": k} for k in data]:
            target = path / item["path"]
            target.write_bytes(data[item["key"]])
            target.chmod(secret.get("defaultMode", 0o644))

    def start(
        self,
        doc: dict[str, Any],
        *,
        args: list[str] | None = None,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
        node_name: str = "node-a",
    ) -> Container:
        """Start the workload's container as pod ``name``, with its command and args (or ``args``)."""
        spec = container(doc)
        self.count += 1
        name = name or f"{doc['metadata']['name']}-{self.count}"
        pod = self.work / "pods" / name
        pod.mkdir(parents=True)
        argv = list(spec.get("args", []) if args is None else args)
        if "--port" in argv:
            argv[argv.index("--port") + 1] = str(free_port())
        environ = self.env(doc, pod, node_name=node_name, extra=env or {})
        with (pod / "log").open("wb") as out:
            proc = subprocess.Popen(
                [*spec["command"], *argv],
                env=environ,
                stdout=out,
                stderr=out,
                cwd=pod,
                start_new_session=True,
            )
        started = Container(name, doc, environ, proc, pod)
        self.started.append(started)
        return started

    def probe(self, which: str, running: Container) -> subprocess.CompletedProcess[str]:
        """The manifest's exec probe, in the container's environment (as the kubelet execs it)."""
        command = container(running.doc)[which]["exec"]["command"]
        return subprocess.run(
            command, env=running.env, capture_output=True, text=True, timeout=30, check=False
        )

    def compiles(self) -> int:
        """Servers that compiled: the vLLM-model path records one compile per rank, in one process."""
        return len({e["pid"] for e in read_jsonl(self.record) if e.get("event") == "compile"})

    def signals_seen(self) -> str:
        return self.signals.read_text() if self.signals.exists() else ""

    def stop_all(self) -> None:
        for running in self.started:
            running.stop()
