"""A manifest whose file list holds something other than file records is damage, never a crash
(adversarial pass).

Whoever can write the volume can write an entry's ``manifest.json`` (its mode is 0444, but pods run
as its owner and may ``chmod``); whoever can write the bucket writes a remote one. A ``"files"``
list holding a string made every pod that hit the entry, ``show``, ``verify`` and ``explain``
exit 70 with a traceback: a one-file plant that crash-looped every pod of the key, in the signed
mode too. It is now a damaged manifest: the pod moves the entry aside and compiles.

A real entry published by a real pod, its manifest rewritten, a real pod and the real CLI.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from cachemgr_testkit.podlib import Cluster, free_port, run_cli
from cachemgr_testkit.scenarios import entry_dirs, vllm_argv


def test_a_file_list_of_strings_is_a_damaged_manifest_for_the_pod_and_the_cli(
    pods: Cluster, root: Path
) -> None:
    first = pods.start("compiler", vllm_argv(free_port()), cache_root=root)
    first.wait_phase("serving")
    first.signal(signal.SIGTERM)
    assert first.wait_exit() == 0
    (entry,) = entry_dirs(root)
    manifest = entry / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["files"] = ["artifacts/graph.rbln", *doc["files"][1:]]
    os.chmod(entry, 0o755)
    os.chmod(manifest, 0o644)
    manifest.write_text(json.dumps(doc))

    env = {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)}
    key = json.loads((entry / "summary.json").read_text())["key"][:12]
    for command in (("show", key), ("verify",), ("explain", "--", *vllm_argv(free_port()))):
        done = run_cli(*command, env=env)
        assert done.returncode != 70, f"{command}: {done.stderr[-600:]}"
        assert "Traceback" not in done.stderr, command

    second = pods.start("second", vllm_argv(free_port()), cache_root=root)
    second.wait_phase("serving")
    assert pods.compiles() == 2, "the damaged entry was set aside and compiled again"
    assert [p for p in (root / "quarantine").iterdir() if p.is_dir()]
    second.signal(signal.SIGTERM)
    assert second.wait_exit() == 0
