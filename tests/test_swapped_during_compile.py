"""A folder swapped for a symlink while a compile runs never leads the compiler outside the root.

cachemgr makes the attempt's folder safely (one level at a time from the root), but a compiler is
handed a path and resolves it itself. Someone with write access to the volume who swaps
``staging/<digest>`` for a symlink to a folder outside the root after the attempt was made would
have the compiler write its output there (found by the fuzzer's swapper, issue 40). The compiler
is therefore handed ``/proc/<pid>/fd/<n>``, the pod's descriptor of the attempt's folder
(``safefs.pinned``): its output lands in the attempt wherever it was moved. The pod's own
measure of the attempt goes from the root too, and the pinned path leads nowhere once the
compile has ended.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.podlib import DEADLINE, cluster, free_port, wait_for
from cachemgr_testkit.scenarios import server_argv, vllm_argv

# A compiler that waits for the test's go-ahead (with its own deadline), then makes a folder and a
# file under the output path it was given, as rebel's and optimum-rbln's exports do.
_COMPILER = """
import os, sys, time
out, go, started = sys.argv[1], sys.argv[2], sys.argv[3]
open(started, "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.05)
os.makedirs(os.path.join(out, "submodule"), exist_ok=True)
with open(os.path.join(out, "submodule", "graph.rbln"), "wb") as f:
    f.write(b"compiled")
"""


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")
def test_a_staging_folder_swapped_during_the_compile_gets_nothing_written_outside(tmp_path: Path) -> None:
    root = tmp_path / "volume"
    root.mkdir()
    outside = tmp_path / "outside"  # stands for a pod's model weights or another mount
    outside.mkdir()
    go, started = tmp_path / "go", tmp_path / "started"
    with cluster(tmp_path / "work") as pods:
        pod = pods.start(
            "swapped",
            server_argv(free_port()),
            cache_root=root,
            options=_command(tmp_path, _COMPILER, go, started),
        )
        wait_for(started.exists, what="the compiler to start")
        digest_folder = next(p for p in (root / "staging").iterdir() if p.is_dir())
        moved = digest_folder.with_name(digest_folder.name + ".moved")
        digest_folder.rename(moved)
        digest_folder.symlink_to(outside, target_is_directory=True)
        go.touch()
        pod.wait_exit(timeout=DEADLINE)
    assert list(outside.iterdir()) == [], "the compiler wrote through the swapped-in link"
    written = list(moved.glob("*/artifacts/submodule/graph.rbln"))
    assert [p.read_bytes() for p in written] == [b"compiled"], "the output landed in the attempt itself"
    assert os.readlink(digest_folder) == str(outside)  # the planted link is left for the operator


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")
def test_the_vllm_servers_cache_root_swapped_during_its_compile_gets_nothing_written_outside(
    tmp_path: Path,
) -> None:
    """The same for the server that compiles as it starts (``VLLM_CACHE_ROOT`` in the attempt)."""
    root = tmp_path / "volume"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    started = tmp_path / "server-started.jsonl"
    with cluster(tmp_path / "work") as pods:
        pod = pods.start(
            "swapped",
            vllm_argv(free_port()),
            cache_root=root,
            env={"STANDIN_COMPILE_SECONDS": "3", "STANDIN_START_RECORD": str(started)},
        )
        wait_for(started.exists, what="the server to start")
        digest_folder = next(p for p in (root / "staging").iterdir() if p.is_dir())
        moved = digest_folder.with_name(digest_folder.name + ".moved")
        digest_folder.rename(moved)
        digest_folder.symlink_to(outside, target_is_directory=True)
        wait_for(lambda: pod.proc.poll() is not None or pod.phase == "serving", what="the compile to end")
        pod.signal(signal.SIGTERM)
        pod.wait_exit(timeout=DEADLINE)
    assert list(outside.iterdir()) == [], "the server wrote through the swapped-in link"
    assert list(moved.glob("*/artifacts/*")), "the server's output landed in the attempt itself"


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")
def test_the_compiles_progress_never_measures_a_tree_through_a_swapped_in_link(tmp_path: Path) -> None:
    """The pod measures what its compile staged every tick (the compile_progress events, the
    progress record peers read): through a swapped ``staging/<digest>`` it walked the link's
    target, a tree outside the root (a 1 TiB sparse file there showed as 1 TiB staged)."""
    root = tmp_path / "volume"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    go, started = tmp_path / "go", tmp_path / "started"
    options = [*_command(tmp_path, _COMPILER, go, started), "--progress-interval", "0.5"]
    with cluster(tmp_path / "work") as pods:
        pod = pods.start("swapped", server_argv(free_port()), cache_root=root, options=options)
        wait_for(started.exists, what="the compiler to start")
        digest_folder = next(p for p in (root / "staging").iterdir() if p.is_dir())
        attempt = next(digest_folder.glob("*/artifacts")).parent.name
        digest_folder.rename(digest_folder.with_name(digest_folder.name + ".moved"))
        (outside / attempt / "artifacts").mkdir(parents=True)
        with (outside / attempt / "artifacts" / "big").open("wb") as big:
            big.truncate(1 << 40)
        before = len(_progress(pod.log))
        digest_folder.symlink_to(outside, target_is_directory=True)
        wait_for(lambda: len(_progress(pod.log)) >= before + 2, what="two progress events after the swap")
        go.touch()
        pod.wait_exit(timeout=DEADLINE)
    staged = [event["staged_bytes"] for event in _progress(pod.log)]
    assert max(staged) < 1 << 30, f"the pod measured the link's target as staged: {staged}"


def _progress(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if '"compile_progress"' in line]


# Writes its output, then leaves a detached helper that, once the command has exited (its parent
# gone), keeps creating "stray" under the output path it was given until told to stop.
_STRAGGLER = """
import os, sys, time
out, stop = sys.argv[1], sys.argv[2]
os.makedirs(os.path.join(out, "submodule"), exist_ok=True)
with open(os.path.join(out, "submodule", "graph.rbln"), "wb") as f:
    f.write(b"compiled")
parent = os.getpid()
if os.fork() == 0:
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    deadline = time.monotonic() + 60
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.001)
    while not os.path.exists(stop) and time.monotonic() < deadline:
        try:
            os.close(os.open(os.path.join(out, "stray"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except OSError:
            pass
        time.sleep(0.001)
    os._exit(0)
"""


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")
def test_a_compilers_straggler_writes_nowhere_once_the_compile_ended(tmp_path: Path) -> None:
    """The compiler's pinned output path never leads into another folder once the compile ends.

    ``{output_dir}`` is ``/proc/<pid>/fd/<n>``: the kernel resolves it to whatever this process holds
    as descriptor ``n`` *now*. Once the compile ends the pin is closed, and the next folder cachemgr
    opens (the root, at publish) would take the lowest free number, ``n`` itself. A process the
    compile command left behind (a compiler's daemonized helper, which outlives its parent and is
    no child of the pod's any more) that still writes under the path it was given would then write
    into that folder: the cache root, a published entry. The pin therefore sits at a descriptor
    number nothing else takes, and such a straggler finds the path gone (ENOENT), as it would had
    it been handed the attempt's plain path.
    """
    root = tmp_path / "volume"
    root.mkdir()
    stop = tmp_path / "stop"
    try:
        with cluster(tmp_path / "work") as pods:
            pod = pods.start(
                "straggler",
                server_argv(free_port()),
                cache_root=root,
                options=_command(tmp_path, _STRAGGLER, stop),
            )
            wait_for(lambda: pod.proc.poll() is not None or pod.phase == "serving", what="the pod to serve")
            served = pod.phase == "serving"
            pod.signal(signal.SIGTERM)
            pod.wait_exit(timeout=DEADLINE)
    finally:
        stop.touch()
    # While the pin was held the path was the attempt's folder: a "stray" there is the compile's,
    # published with it (and in the pod's view of the entry, which mirrors its artifacts).
    attempt = {*root.glob("entries/*/artifacts/stray"), *tmp_path.glob("work/pods/*/views/*/v/stray")}
    strays = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("stray") if p not in attempt)
    assert strays == [], f"the straggler wrote through a reused descriptor into {strays}"
    assert served, f"the pod did not serve:\n{pod.tail()}"
    assert list(root.glob("entries/*/artifacts/submodule/graph.rbln")), "the compile was published"


def _command(tmp_path: Path, source: str, *args: Path) -> list[str]:
    """``run``'s options for a compile command running ``source`` on ``{output_dir}`` and ``args``."""
    script = tmp_path / "compiler.py"
    script.write_text(source)
    words = [
        shlex.quote(sys.executable),
        shlex.quote(str(script)),
        "{output_dir}",
        *(shlex.quote(str(a)) for a in args),
    ]
    return ["--strategy", "command", "--compile-cmd", " ".join(words)]
