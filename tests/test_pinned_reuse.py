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

from __future__ import annotations

import shlex
import signal
import sys
from pathlib import Path

import pytest
from cachemgr_testkit.podlib import DEADLINE, cluster, free_port, wait_for
from cachemgr_testkit.scenarios import server_argv

# Writes its output, then leaves a detached helper that, once the command has exited (its parent
# gone), keeps creating "stray" under the output path it was given until told to stop.
_COMPILER = """
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
    os._exit(0)
"""


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")
def test_a_compilers_straggler_writes_nowhere_once_the_compile_ended(tmp_path: Path) -> None:
    root = tmp_path / "volume"
    root.mkdir()
    stop = tmp_path / "stop"
    script = tmp_path / "compiler.py"
    script.write_text(_COMPILER)
    compile_cmd = (
        f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {{output_dir}} {shlex.quote(str(stop))}"
    )
    try:
        with cluster(tmp_path / "work") as pods:
            pod = pods.start(
                "straggler",
                server_argv(free_port()),
                cache_root=root,
                options=["--strategy", "command", "--compile-cmd", compile_cmd],
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
