"""What a hit loads before its server starts (issue 34 item 5): a pin, not a timing.

A real ``cachemgr run`` on a real published entry, its modules read at the moment it spawns the
server: an audit hook on ``subprocess.Popen`` (Python's own event, no internals patched). Each
module below was taken off the hit path for what it cost a pod's start
(bench/bench_hitpath.py; docs/benchmarks.md, "Warm start"): one that creeps back fails here, in
whichever module imports it. The other pins live beside their feature: boto3 on a local hit
(tests/test_remote.py), the trust code in the open mode (tests/test_trust.py), the server-failure
code on a good hit (tests/test_server_failures.py), the probe's standard library
(tests/test_probes.py), shutil while parsing (tests/test_help.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cachemgr_testkit.podlib import STANDIN_COMPILER, Cluster, cluster

# module -> why a hit must not load it before its server starts
OFF_THE_HIT_PATH = {
    "dataclasses": "importing it loads inspect, ast, dis and tokenize, and each class it makes is "
    "~0.5 ms: the hit path's records are NamedTuples or plain classes",
    "inspect": "dataclasses' import (6 to 7 ms)",
    "cachemgr.core.signing": "the open mode reads the trust settings' names from core.trust_env",
    "base64": "only signing keys use it",
    "hashlib": "OpenSSL's load (~2 ms): an odd pod name's hash imports it when it needs it",
    "structlog": "log events are held until the server is launched (cachemgr.core.log)",
    "logging": "structlog's; four level numbers do not need it",
    "psutil": "only a compile's progress and stopping a process tree need it",
    "filelock": "the compile lease, a miss only",
    "packaging": "plain versions are read by core.versions",
    "yaml": "vllm serve --config only",
    "tempfile": "views and records name their temporary files themselves",
    "shutil": "argparse's formatter's terminal width, asked with os alone",
    "socket": "the hostname comes from os.uname()",
    "cachemgr.runtime.waiting": "the lease step, a miss only",
    "cachemgr.volume.failure_records": "a failure's record, written on a failure only",
    "cachemgr.ops.space": "the space preflight scans the volume: a miss only",
    "cachemgr.volume.lease": "a miss only",
}

# Records the modules loaded when the first child is spawned (the server: a hit spawns nothing
# before it), then runs the CLI as the console script does.
_CODE = """
import json, sys
def hook(event, args):
    if event == "subprocess.Popen" and not hasattr(hook, "seen"):
        hook.seen = True
        with open(sys.argv[1], "w") as out:
            json.dump(sorted(sys.modules), out)
sys.addaudithook(hook)
from cachemgr.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[Cluster]:
    with cluster(tmp_path) as group:
        yield group


def _argv(record: Path) -> list[str]:
    compile_cmd = f"{STANDIN_COMPILER} --output-dir {{output_dir}} --files 40 --bytes 40960 --seconds 0 --record {record}"
    return [
        "--strategy",
        "command",
        "--compile-cmd",
        compile_cmd,
        "--verify",
        "fast",
        "--",
        "sh",
        "-c",
        "exit 0",
    ]


def test_a_hit_loads_none_of_the_miss_paths_modules_before_its_server(pods: Cluster, root: Path) -> None:
    record = pods.work / "compiler.jsonl"
    env = {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root), "CACHEMGR_STATE_DIR": str(pods.work / "st")}
    published = subprocess.run(
        [sys.executable, "-m", "cachemgr", "warm", *_argv(record)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert published.returncode == 0, published.stderr
    loaded_file = pods.work / "modules.json"
    hit = subprocess.run(
        [sys.executable, "-c", _CODE, str(loaded_file), "run", *_argv(record)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert hit.returncode == 0, hit.stderr
    events = [json.loads(line)["event"] for line in hit.stderr.splitlines() if line.startswith("{")]
    assert "launching" in events, hit.stderr
    assert "published" not in events, "a hit, not a compile"
    compiles = [
        line for line in record.read_text().splitlines() if json.loads(line).get("event") == "compile"
    ]
    assert len(compiles) == 1, "compiled once, by the warm Job"
    loaded = set(json.loads(loaded_file.read_text()))
    assert "cachemgr.runtime.launch" in loaded, "read at the server's spawn"
    crept = {
        m: why for m, why in OFF_THE_HIT_PATH.items() if any(x == m or x.startswith(f"{m}.") for x in loaded)
    }
    assert crept == {}, f"a hit loaded these before its server started: {crept}"
