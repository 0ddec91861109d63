"""One rule per kind of staleness, which every reader calls.

A lease is stale when its marker has not changed for its holder's own promise (the duration and
confirm window written into the marker; the default duration for a marker that names none), as the
contenders in cachemgr.volume.softlease judge it: ``locks``, ``show``, ``explain`` and ``ls`` say
"stale" exactly when the next pod would take the lease over. An attempt in staging is a candidate
for removal after ``stale_staging_after``: the runner with its lease duration, ``ls`` and ``prune``
without one.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cachemgr.ops.attempts import STALE_STAGING_AFTER
from cachemgr.ops.locks import list_locks
from cachemgr.runtime.runner import RunOptions
from cachemgr.volume.layout import CacheRoot, open_root
from cachemgr.volume.lease import DEFAULT_DURATION, read_holder
from cachemgr.volume.stale import stale_staging_after


def _marker(root: CacheRoot, digest: str, *, age: float, **fields: float) -> None:
    lines = ["filelock/2", "pid=1", "host=node-x", "mode=lease", f"token={digest[:8]}"]
    lines += [f"{name}={value}" for name, value in fields.items()]
    path = root.leases / f"{digest}.lock"
    path.write_text("".join(f"{line}\n" for line in lines))
    then = time.time() - age
    os.utime(path, (then, then))


@pytest.mark.parametrize(
    ("age", "fields", "stale"),
    [
        (DEFAULT_DURATION + 10, {}, True),  # names no duration: judged by the default one
        (DEFAULT_DURATION - 10, {}, False),
        (60.0, {"duration": 300.0}, False),  # its holder promised to refresh within 300 s
        (60.0, {"duration": 30.0}, True),
        (60.0, {"duration": 30.0, "confirm": 60.0}, False),  # it does not refresh while confirming
        (100.0, {"duration": 30.0, "confirm": 60.0}, True),
    ],
)
def test_a_lease_is_stale_when_its_holder_broke_its_own_promise(
    tmp_path: Path, age: float, fields: dict[str, float], stale: bool
) -> None:
    (tmp_path / "cache").mkdir()
    root = open_root(tmp_path / "cache", create=True)
    digest = "c" * 32
    _marker(root, digest, age=age, **fields)
    holder = read_holder(root, digest)
    assert holder is not None
    assert holder.stale is stale
    assert [(lock.key, lock.stale) for lock in list_locks(root)] == [(digest, stale)]
    assert [lock.to_json()["stale"] for lock in list_locks(root)] == [stale]


def test_one_staging_rule_for_the_runner_ls_and_prune(tmp_path: Path) -> None:
    assert stale_staging_after() == STALE_STAGING_AFTER == 300.0, "ls and prune: the default lease's"
    assert stale_staging_after(DEFAULT_DURATION) == STALE_STAGING_AFTER
    assert stale_staging_after(120.0) == 1200.0, "ten lease durations: a holder is never judged dead"
    options = RunOptions(cache_root=tmp_path, state_dir=tmp_path, lease_duration=120.0)
    assert options.stale_staging_after == stale_staging_after(120.0)
