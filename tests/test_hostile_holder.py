"""A lease holder's record planted with fields of the wrong type is no holder's: never a crash
(adversarial pass).

``leases/<digest>.holder.json`` names who compiles a key; every pod waiting for that compile reads
it, and so do ``ls``, ``locks``, ``show`` and ``explain``. Anyone who can write the volume writes it
(in every mode: leases lie on the shared volume), so a ``"pid": "abc"`` made each of them exit 70
with a traceback: a one-file plant crash-looped every pod that missed. A field of the wrong type
now reads as absent.

A real holder pod compiling, its holder record rewritten as a writer of the volume would, a real
waiter pod and the real CLI.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from cachemgr_testkit.podlib import Cluster, free_port, run_cli, wait_for
from cachemgr_testkit.scenarios import vllm_argv

PLANTED = {
    "pid": {"pid": "abc"},
    "since": {"since": "soon"},
    "names": {"pod": {"a": 1}, "node": ["n"], "host": 7, "entry": None, "token": ["not", "a", "token"]},
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_planted_holder_field_of_the_wrong_type_crashes_nobody(
    pods: Cluster, root: Path, case: str
) -> None:
    holder = pods.start(
        "holder", vllm_argv(free_port()), cache_root=root, env={"STANDIN_COMPILE_SECONDS": "60"}
    )
    holder.wait_phase("compiling")
    (record,) = (root / "leases").glob("*.holder.json")
    doc = json.loads(record.read_text())
    doc.update(PLANTED[case])
    record.write_text(json.dumps(doc))

    env = {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)}
    for command in (("locks",), ("ls",), ("ls", "-o", "json")):
        done = run_cli(*command, env=env)
        assert done.returncode == 0, f"{command}: {done.stderr[-500:]}"
        assert "Traceback" not in done.stderr

    waiter = pods.start("waiter", vllm_argv(free_port()), cache_root=root)
    waiter.wait_phase("waiting")
    wait_for(
        lambda: any(e.get("event") == "waiting_for_compile" for e in waiter.log_events()),
        what="the waiter's report of the holder",
    )
    waiter.signal(signal.SIGTERM)
    assert waiter.wait_exit() == 128 + signal.SIGTERM, waiter.tail()
    assert "Traceback" not in waiter.log.read_text()
    holder.signal(signal.SIGTERM)
    holder.wait_exit()
