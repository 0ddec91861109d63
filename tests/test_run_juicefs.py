"""Compile once across "nodes": two JuiceFS mounts of one volume, pods in their own UTS namespaces.

JuiceFS runs twice: with metadata caches off (what one mount does, the other sees at once) and
with JuiceFS's defaults (1 s attribute, entry and directory-entry caches), as a cluster mounts it.
SeaweedFS's `weed mount` is the third shared volume: flock does nothing there and two mounts can
both win an exclusive create (see test_lease.py).
The same scenarios also run on a local directory (with pods still on different "nodes"), so a
failure here that does not happen there points at the shared filesystem.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cachemgr_testkit.podlib import Cluster
from cachemgr_testkit.scenarios import (
    concurrent_runs_compile_once,
    entry_dirs,
    frozen_holder_late_publish_is_discarded,
    killed_holder_is_taken_over,
)

from cachemgr.volume.softlease import default_confirm

LEASE = 3.0
TAKEOVER_SLACK = 2.5  # waiter polls every 0.2 s; the holder's last refresh can be up to lease/3 old


@pytest.fixture(params=["local", "juicefs", "juicefs-cached", "seaweedfs"])
def roots(request: pytest.FixtureRequest, tmp_path: Path) -> list[Path]:
    """The cache root as each node sees it: one local dir, or one path per mount."""
    if request.param == "local":
        root = tmp_path / "volume"
        root.mkdir()
        return [root, root]
    if request.param == "seaweedfs":
        points: list[Path] = request.getfixturevalue("seaweedfs_mounts")
        (points[0] / "cache").mkdir()
        return [point / "cache" for point in points]
    make = request.getfixturevalue("juicefs_volume_factory")
    mounts: list[Path] = make(mounts=2, metadata_cache_s=1.0 if request.param == "juicefs-cached" else 0.0)
    (mounts[0] / "cache").mkdir()
    return [mount / "cache" for mount in mounts]


def test_eight_runs_over_two_nodes_compile_once(pods: Cluster, roots: list[Path]) -> None:
    concurrent_runs_compile_once(pods, roots, count=8)


def test_sigkilled_holder_is_taken_over_within_the_lease(pods: Cluster, roots: list[Path]) -> None:
    takeover = killed_holder_is_taken_over(pods, roots, lease=LEASE)
    # The new holder compiles only after its confirm window (none on a local filesystem). The bound
    # tells a takeover by the lease (some 6 s here) from one by the dead holder's 120 s compile, with
    # a lease's margin for a loaded machine (CI's took 7.57 s against a bound of 7.5); how long a
    # takeover takes is bench/bench_handoff.py's figure, not this test's.
    limit = 2 * LEASE + default_confirm(roots[0]) + TAKEOVER_SLACK
    assert takeover <= limit, f"takeover took {takeover:.2f}s with a {LEASE:g}s lease"


def test_frozen_holder_loses_to_the_waiter_and_its_late_publish_is_discarded(
    pods: Cluster, roots: list[Path]
) -> None:
    frozen_holder_late_publish_is_discarded(pods, roots, lease=LEASE)
    assert len(entry_dirs(roots[0])) == 1
