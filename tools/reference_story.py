"""The story docs/reference.md's transcripts come from, run for real: prints each command and its output.

A prefill volume during an SDK upgrade, as a real one changes the image: the old image has RBLN
Compiler 0.12.3 with vllm-rbln and optimum-rbln 0.12.0, the new one RBLN Compiler 0.13.0 with
vllm-rbln and optimum-rbln 0.13.0 (as tests/test_rollout.py's ``sdk`` images; vLLM and transformers
as the stand-in declares them). Stand-in compiler and server, 48 MiB per entry, on a 200Gi tmpfs (so
``du`` shows a PVC's size): an old warm Job's entry no pod uses, one old pod serving a 0.12 entry,
two new pods serving the 0.13 entry a warm Job compiled, a canary with a longer context whose
compile failed, and a pod on another node compiling a TP 16 variant. The shell is a new (0.13)
pod's, no terminal, ``CACHEMGR_LOG_FORMAT=json`` as the chart sets it, 80 columns; one section
runs in the old pod's shell (the old image's versions) to show what an older image says of, and
never removes from, the newer generation. Paths are shown as the pod mounts the volume
(/var/cache/cachemgr).

Run as root from the repository root, after ``scripts/install .venv test`` (a tmpfs mount)::

    .venv/bin/python tools/reference_story.py > /tmp/story.txt

Then paste the transcripts into docs/reference.md (ages and pids differ from run to run).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cachemgr_testkit.mounts import tmpfs_volume
from cachemgr_testkit.podlib import Cluster, Pod, cluster, free_port, npu_node, wait_for

MODEL = "MiniMaxAI/MiniMax-M2.7"
MOUNT = "/var/cache/cachemgr"
# The two images' SDKs: what each image has installed, declared as an image without the real
# packages declares it (vLLM and transformers stay the stand-in's: the base image's).
OLD = {
    "CACHEMGR_COMPILER_VERSION": "0.12.3",
    "CACHEMGR_VLLM_RBLN_VERSION": "0.12.0",
    "CACHEMGR_OPTIMUM_RBLN_VERSION": "0.12.0",
}
NEW = {
    "CACHEMGR_COMPILER_VERSION": "0.13.0",
    "CACHEMGR_VLLM_RBLN_VERSION": "0.13.0",
    "CACHEMGR_OPTIMUM_RBLN_VERSION": "0.13.0",
}
NEW_POD = "modelserver-prefill-5b8f7c9d64-q5jlb"
OLD_POD = "modelserver-prefill-7d9c6b5f48-x7kqp"


def vllm(tp: int, max_model_len: int = 32768) -> list[str]:
    return ["vllm", "serve", MODEL, "--tensor-parallel-size", str(tp), "--max-model-len", str(max_model_len),
            "--host", "127.0.0.1", "--port", str(free_port())]  # fmt: skip


def start(
    pods: Cluster, root: Path, name: str, argv: list[str], *, node: str, sdk: dict[str, str], **env: str
) -> Pod:
    command = "warm" if "warm" in name else "run"
    more = {**sdk, **npu_node(pods.work), **env}
    if command == "warm":
        more["VLLM_RBLN_COMPILE_ONLY"] = "1"
    return pods.start(name, argv, cache_root=root, command=command, node=node, env=more)


def shell(pods: Cluster, root: Path, line: str, *, image: dict[str, str] = NEW, pod: str = NEW_POD) -> None:
    """``$ LINE`` in a pod's shell (by default a new pod's), and what it printed (stdout and stderr,
    in order)."""
    environ = {
        **pods.base_env, "CACHEMGR_CACHE_ROOT": str(root), **image,
        "CACHEMGR_LOG_FORMAT": "json", "COLUMNS": "80", "POD_NAME": pod,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{pods.base_env['PATH']}",
    }  # fmt: skip
    done = subprocess.run(
        ["sh", "-c", line], env=environ, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=120, check=False,
    )  # fmt: skip
    print(f"$ {line}\n{done.stdout.replace(str(root), MOUNT).rstrip()}")
    if done.returncode:
        print(f"$ echo $?\n{done.returncode}")
    print()


def story(pods: Cluster, root: Path) -> None:
    old, tp16 = upgrade(pods, root)
    inspect(pods, root)
    old_shell(pods, root)
    killed(pods, root, tp16)
    damage(pods, root, old)


def upgrade(pods: Cluster, root: Path) -> tuple[Pod, Pod]:
    """The volume mid-upgrade; the old pod and the TP 16 pod (compiling), for what follows."""
    size = {"STANDIN_ARTIFACT_BYTES": str(48 << 20), "STANDIN_COMPILE_SECONDS": "2"}
    old_warm = start(
        pods, root, "modelserver-warm-prefill-v012-8k2qz", vllm(4), node="cpu-node-2", sdk=OLD, **size
    )
    assert old_warm.wait_exit() == 0, old_warm.tail()
    old = start(pods, root, OLD_POD, vllm(8), node="npu-node-1", sdk=OLD, **size)
    old.wait_phase("serving")
    warm = start(
        pods, root, "modelserver-warm-prefill-v013-5rj9w", vllm(8), node="cpu-node-3", sdk=NEW, **size
    )
    assert warm.wait_exit() == 0, warm.tail()
    new = [
        start(pods, root, f"modelserver-prefill-5b8f7c9d64-{s}", vllm(8), node=n, sdk=NEW, **size)
        for s, n in (("m2v9d", "npu-node-2"), ("q5jlb", "npu-node-3"))
    ]
    for pod in new:
        pod.wait_phase("serving")
    canary = start(
        pods, root, "modelserver-prefill-canary-9f6d2", vllm(8, 131072), node="npu-node-4",
        sdk=NEW, STANDIN_EXIT_BEFORE_HEALTHY="1", **size,
    )  # fmt: skip
    canary.wait_exit()
    tp16 = start(
        pods, root, "modelserver-prefill-tp16-c4xw8", vllm(16), node="npu-node-4", sdk=NEW,
        STANDIN_COMPILE_SECONDS="600", STANDIN_ARTIFACT_BYTES=str(48 << 20),
    )  # fmt: skip
    tp16.wait_phase("compiling")
    time.sleep(3)  # its first progress record: the transcript shows what a holder reports
    return old, tp16


def inspect(pods: Cluster, root: Path) -> None:
    print("## ls, show, explain, du, stats (all pods as above)\n")
    for line in ("cachemgr ls", "cachemgr ls -o wide", "cachemgr ls -o json | head -8"):
        shell(pods, root, line)
    new_key = next(p.name.rsplit("__", 1)[-1] for p in (root / "entries").iterdir() if "__c0.13__" in p.name)
    failed = next(iter(os.listdir(root / "failures")))
    shell(pods, root, f"cachemgr show {new_key[:8]}")
    shell(pods, root, f"cachemgr show {failed[:8]}")
    shell(pods, root, f"cachemgr explain -- {' '.join(vllm(8)[:-1])} 8000")
    miss = vllm(8, 65536)
    shell(pods, root, f"cachemgr explain -- {' '.join(miss[:-1])} 8000")
    shell(pods, root, "cachemgr du")
    shell(pods, root, "cachemgr stats")
    shell(pods, root, "cachemgr locks")


def old_shell(pods: Cluster, root: Path) -> None:
    print("## the old pod's shell (the old image: compiler 0.12.3, vllm-rbln 0.12.0)\n")
    for line in ("cachemgr ls", "cachemgr prune --incompatible --superseded --dry-run"):
        shell(pods, root, line, image=OLD, pod=OLD_POD)


def killed(pods: Cluster, root: Path, tp16: Pod) -> None:
    print("## the TP 16 pod killed with its node\n")
    tp16.signal_pod(signal.SIGKILL)
    tp16.wait_exit()
    wait_for(lambda: subprocess.run(
        [sys.executable, "-m", "cachemgr", "locks", "-o", "jsonpath={.items[*].state}"],
        env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)}, capture_output=True, text=True, check=False,
    ).stdout == "silent", what="locks to call its lease silent", timeout=60)  # fmt: skip
    shell(pods, root, "cachemgr locks")
    shell(pods, root, "cachemgr prune --stale-staging --yes")
    shell(pods, root, "cachemgr ls")


def damage(pods: Cluster, root: Path, old: Pod) -> None:
    print("## verify, a flipped bit, verify --fix, prune\n")
    shell(pods, root, "cachemgr verify")
    victim = next(
        p for p in (root / "entries").iterdir() if "__c0.12__" in p.name and p.name.endswith(_unused(root))
    )
    artifact = next(p for p in sorted(victim.rglob("*.rbln")))
    stat = artifact.stat()
    artifact.parent.chmod(0o755)
    artifact.chmod(0o644)
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0x01
    artifact.write_bytes(bytes(data))
    os.utime(artifact, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    shell(pods, root, "cachemgr verify")
    shell(pods, root, "cachemgr verify --fix")
    shell(pods, root, "cachemgr prune --incompatible --dry-run")
    shell(pods, root, "CACHEMGR_COMPILER_VERSION= cachemgr prune --incompatible --yes")
    shell(pods, root, "cachemgr prune --damaged --incompatible --yes")
    old.signal(signal.SIGTERM)
    old.wait_exit()
    shell(pods, root, "cachemgr prune --incompatible")
    shell(pods, root, "cachemgr prune --incompatible --yes")


def _unused(root: Path) -> str:
    """The key digits of the 0.12 entry no pod uses (the old warm Job's, TP 4)."""
    for entry in (root / "entries").iterdir():
        if "__c0.12__" in entry.name and not any((root / "usage").glob(f"{_digest(entry)}*/*.json")):
            return entry.name.rsplit("__", 1)[-1]
    raise AssertionError("no unused 0.12 entry")


def _digest(entry: Path) -> str:
    import json

    return str(json.loads((entry / "summary.json").read_text())["key"])


def main() -> int:
    with (
        tempfile.TemporaryDirectory(prefix="reference-story-") as work,
        tmpfs_volume(Path(work) / "volume", size_bytes=200 << 30) as root,
        cluster(Path(work) / "pods") as pods,
    ):
        story(pods, root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
