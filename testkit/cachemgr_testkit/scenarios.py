"""Argvs and invariant checks shared by the run tests on a local directory and on JuiceFS."""

from __future__ import annotations

import os
import shlex
import signal
import time
from pathlib import Path
from typing import Any

from cachemgr_standin import DECLARED_VERSIONS

from cachemgr.key.cachekey import CacheKey, KeyRequest, compute_key
from cachemgr.volume.manifest import check_files, read_manifest
from cachemgr.volume.softlease import read_marker_view
from cachemgr_testkit.podlib import STANDIN_COMPILER, Cluster, free_port, read_jsonl, wait_for

MODEL = "rebellions/Test-LLM"

# A key computed in-process with nothing of this machine's: the stand-in image's declared versions,
# no home (no Hugging Face cache to resolve a snapshot in), and a server argv of the vllm strategy.
KEY_ENV = {
    "CACHEMGR_COMPILER_VERSION": "0.12.3",
    "CACHEMGR_NPU_TYPE": "RBLN-CA25",
    "PATH": "/usr/bin:/bin",
    "HOME": "/nonexistent",
    **DECLARED_VERSIONS,
}
SERVE_ARGV = ["vllm", "serve", "org/model", "--tensor-parallel-size", "4", "--port", "8000"]


def compile_cmd(record: Path, *, seconds: float | None = 0.3, extra: str = "") -> str:
    """The stand-in compiler writing to {output_dir}, recording each invocation.

    With ``seconds=None`` the compile time comes from each pod's STANDIN_COMPILE_SECONDS, so
    pods share one key (the command is part of it) yet compile at different speeds.
    """
    pace = f"--seconds {seconds} " if seconds is not None else ""
    return (
        f"{STANDIN_COMPILER} --output-dir {{output_dir}} --model {MODEL} --files 6 --bytes 256k "
        f"{pace}--record {shlex.quote(str(record))} {extra}"
    ).strip()


def command_key(role: str = "prefill") -> CacheKey:
    """A key of the command strategy, computed in process, for tests that publish by library call."""
    return compute_key(
        KeyRequest(
            argv=["vllm", "serve", "{artifact_dir}"],
            role=role,
            strategy="command",
            compile_cmd="compiler --output-dir {output_dir}",
            compiler_version="0.12.0",
            npu_type="RBLN-CA25",
            environ={},
        )
    )


def server_argv(port: int) -> list[str]:
    """The stand-in server loading the published artifacts, as vLLM loads a compiled dir."""
    return ["vllm", "serve", "{artifact_dir}", "--port", str(port)]


def vllm_argv(port: int, *extra: str) -> list[str]:
    return ["vllm", "serve", MODEL, "--tensor-parallel-size", "4", "--port", str(port), *extra]


def entry_dirs(root: Path) -> list[Path]:
    entries = root / "entries"
    return sorted(p for p in entries.iterdir() if p.is_dir()) if entries.is_dir() else []


def served_entry(pods: Cluster, root: Path) -> Path:
    """One entry, compiled by a pod (the stand-in vLLM server) that then serves and stops cleanly."""
    pod = pods.start("compiler", vllm_argv(free_port()), cache_root=root)
    pod.wait_phase("serving")
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0
    (entry,) = entry_dirs(root)
    return entry


def compiles(record: Path) -> int:
    return sum(1 for event in read_jsonl(record) if event.get("event") == "compile")


def assert_clean_after_failure(root: Path) -> None:
    """After a failed or interrupted attempt: no staging, no held lease, no use record."""
    staging = list((root / "staging").rglob("*")) if (root / "staging").is_dir() else []
    assert staging == [], f"staging left behind: {staging}"
    for marker in (root / "leases").glob("*.lock") if (root / "leases").is_dir() else []:
        assert read_marker_view(marker) is None, f"lease still held: {marker}"
    users = list((root / "usage").rglob("*.json")) if (root / "usage").is_dir() else []
    assert users == [], f"use records left behind: {users}"


def tree_state(root: Path) -> dict[str, tuple[Any, ...]]:
    """Everything about every name under ``root`` but its atime: what a write of any kind changes."""
    found: dict[str, tuple[Any, ...]] = {}
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            data = Path(path).read_bytes() if os.path.isfile(path) and not os.path.islink(path) else b""
            found[os.path.relpath(path, root)] = (
                st.st_mode,
                st.st_size,
                st.st_mtime_ns,
                st.st_ctime_ns,
                st.st_ino,
                st.st_nlink,
                data,
            )
    return found


def assert_entries_valid(root: Path) -> None:
    for entry in entry_dirs(root):
        manifest = read_manifest(entry)
        assert check_files(entry, manifest, mode="full") == [], f"{entry.name} does not verify"


def concurrent_runs_compile_once(pods: Cluster, roots: list[Path], *, count: int = 8) -> None:
    """``count`` runs of one key split over ``roots`` (one mount per node): one compile, same bytes."""
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=1.0)]
    started = [
        pods.start(
            f"p{i}",
            server_argv(free_port()),
            cache_root=roots[i % len(roots)],
            options=options,
            node=f"node-{i % len(roots)}",
        )
        for i in range(count)
    ]
    for pod in started:
        pod.wait_phase("serving", timeout=90)
    assert compiles(record) == 1
    loads = [e for e in pods.record if e["event"] == "load"]
    assert len(loads) == count
    assert len({e["digest"] for e in loads}) == 1
    for pod in started:
        pod.signal(signal.SIGTERM)
        assert pod.wait_exit() == 0
    again = [
        pods.start(f"q{i}", server_argv(free_port()), cache_root=roots[i % len(roots)], options=options)
        for i in range(count)
    ]
    for pod in again:
        pod.wait_phase("serving", timeout=90)
    assert compiles(record) == 1
    assert_entries_valid(roots[0])


def leased_command_options(record: Path, *, lease: float, seconds: float | None) -> list[str]:
    """``run`` options for the command strategy with the stand-in compiler and a given lease."""
    return [
        "--strategy",
        "command",
        "--lease-duration",
        str(lease),
        "--compile-cmd",
        compile_cmd(record, seconds=seconds),
    ]


def killed_holder_is_taken_over(pods: Cluster, roots: list[Path], *, lease: float) -> float:
    """SIGKILL the compiling pod; a waiter on the other node takes over and publishes. Returns takeover s."""
    record = pods.work / "compiler.jsonl"
    options = leased_command_options(record, lease=lease, seconds=None)
    holder = pods.start(
        "holder", server_argv(free_port()), cache_root=roots[0], options=options, node="node-a",
        env={"STANDIN_COMPILE_SECONDS": "120"},
    )  # fmt: skip
    holder.wait_phase("compiling")
    waiter = pods.start(
        "waiter", server_argv(free_port()), cache_root=roots[-1], options=options, node="node-b"
    )
    waiter.wait_phase("waiting")
    killed = time.monotonic()
    holder.signal_pod(signal.SIGKILL)
    waiter.wait_phase("compiling", "publishing", "serving", timeout=lease + 30)
    takeover = time.monotonic() - killed
    waiter.wait_phase("serving")
    assert compiles(record) == 2
    assert len(entry_dirs(roots[0])) == 1
    assert_entries_valid(roots[0])
    return takeover


def frozen_holder_late_publish_is_discarded(pods: Cluster, roots: list[Path], *, lease: float) -> None:
    """SIGSTOP the compiling pod past its lease; a waiter takes over; after SIGCONT the late publish loses."""
    record = pods.work / "compiler.jsonl"
    options = leased_command_options(record, lease=lease, seconds=3.0)
    holder = pods.start(
        "holder", server_argv(free_port()), cache_root=roots[0], options=options, node="node-a"
    )
    holder.wait_phase("compiling")
    wait_for(lambda: compiles(record) == 1, what="the holder's compiler to start")
    waiter = pods.start(
        "waiter", server_argv(free_port()), cache_root=roots[-1], options=options, node="node-b"
    )
    waiter.wait_phase("waiting")
    holder.signal_pod(signal.SIGSTOP)
    waiter.wait_phase("compiling", timeout=lease + 30)
    waiter.wait_phase("serving", timeout=60)
    holder.signal_pod(signal.SIGCONT)
    holder.wait_phase("serving", timeout=60)
    assert compiles(record) == 2
    assert len(entry_dirs(roots[0])) == 1
    assert_entries_valid(roots[0])
    events = [e["event"] for e in holder.log_events()]
    assert "publish_discarded_peer_won" in events or "peer_published" in events, events
    assert "publishing_after_lease_lost" in events or "lease_lost" in events, events
