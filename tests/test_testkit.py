"""The test kit's own promises that the campaign relies on."""

from __future__ import annotations

import os
import subprocess
import sys

# Each child draws ports, says which, then holds its block until told to go (stdin closes).
_DRAW = """
import sys
from cachemgr_testkit.podlib import free_port
ports = [free_port() for _ in range(20)]
print(" ".join(map(str, ports)), flush=True)
sys.stdin.read()
"""


def test_plain_test_processes_running_at_once_draw_ports_from_blocks_of_their_own() -> None:
    """A campaign split by -k runs plain pytest processes side by side: a port one of them handed
    to a pod (not bound until the pod's server starts) must never be handed out by another."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _DRAW], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        for _ in range(4)
    ]
    try:
        drawn = []
        for child in children:
            assert child.stdout is not None
            drawn.append({int(p) for p in child.stdout.readline().split()})
    finally:
        for child in children:
            child.communicate(timeout=30)
    assert all(len(ports) == 20 for ports in drawn), drawn
    for i, ports in enumerate(drawn):
        for other in drawn[i + 1 :]:
            assert not ports & other, "two live processes were handed one port"
    # ...and not by luck: each drew from one block of 1,000 (they start at 15000), none shared.
    blocks = [{port // 1000 for port in ports} for ports in drawn]
    assert all(len(block) == 1 for block in blocks), blocks
    assert len(set().union(*blocks)) == 4, blocks


def test_ports_drawn_from_many_threads_at_once_are_all_distinct() -> None:
    """test_guide starts pods from a thread pool: free_port is called concurrently."""
    code = (
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from cachemgr_testkit.podlib import free_port\n"
        "with ThreadPoolExecutor(8) as pool:\n"
        "    ports = list(pool.map(lambda _: free_port(), range(200)))\n"
        "assert len(set(ports)) == 200, ports\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
