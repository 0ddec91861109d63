"""--on-server-failure's set-aside never takes an entry from a pod that began to use it meanwhile,
whatever that pod's clock (adversarial pass).

The policy checks the entry's users, then moves it to quarantine, then looks again and puts it back
if a pod registered in between (a rollout's replicas start together). A pod on a node whose clock is
off by more than the in-use window writes a use record this node reads as "silent" (on JuiceFS the
record's mtime is the writing client's clock: cachemgr.volume.records), so the look after the move
must count it, as prune does: it compares what it saw, not a clock.

A real entry published by a real pod, a real use record of a second pod on another node, aged as
that node's JuiceFS client would stamp it; the race (the record landing between the check and the
move) is made by calling the move right after the record is written.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from cachemgr_testkit.podlib import Cluster
from cachemgr_testkit.scenarios import served_entry

from cachemgr.key.cachekey import CacheKey
from cachemgr.key.serving import ServerCommand
from cachemgr.runtime import server_failures
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import open_root
from cachemgr.volume.records import read_usage, register_use
from cachemgr.volume.store import Lookup


def _key(entry: Path) -> CacheKey:
    doc = json.loads((entry / "key.json").read_text())
    inputs = doc.get("inputs", doc)
    digest = json.loads((entry / "summary.json").read_text())["key"]
    return CacheKey(digest=digest, inputs=inputs, sources={}, server=ServerCommand(argv=(), kind="other"))


def test_a_pod_on_a_skewed_node_that_registers_during_the_set_aside_keeps_its_entry(
    pods: Cluster, root: Path
) -> None:
    entry = served_entry(pods, root)
    key = _key(entry)
    cache = open_root(root, create=False)
    assert not read_usage(cache, key.digest).live, "the compiler has stopped: nobody uses it"

    # A replica on node-b starts on the entry now; node-b's clock is 10 minutes behind, so its
    # JuiceFS client stamps the record 10 minutes in this node's past.
    other = PodIdentity(pod="replica-b", node="node-b", host="host-b", pid=os.getpid())
    record = register_use(cache, key.digest, other, entry=entry.name)
    stamp = time.time() - 600
    os.utime(record, (stamp, stamp))
    usage = read_usage(cache, key.digest)
    assert usage.silent, "a live pod this node's clock cannot judge"

    found = Lookup(status="hit", path=entry)
    moved = server_failures.set_aside(cache, key, found, after=1)
    assert moved is False, "a pod uses it: not set aside"
    assert entry.is_dir(), "the entry replica-b serves from is where it was"
    assert not list((root / "quarantine").glob("*.reason.json")), "nor its note left behind"
