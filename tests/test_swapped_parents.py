"""Records on the volume are touched and removed from their folder reached from the root.

Someone with write access to the volume swaps a folder of the layout (``leases/``,
``usage/<digest>``, ``staging/<digest>``) for a symlink to a directory outside the root, after
cachemgr wrote its record there. Removing, refreshing or taking over that record by path would
then act on a file of the same name in the link's target. Every test plants the link for real
and checks that the file outside is left exactly as it was.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cachemgr.ops.progress import Snapshot, read_record, record_path, remove_record, write_record
from cachemgr.volume.layout import CacheRoot, open_root
from cachemgr.volume.records import Heartbeat

pytestmark = pytest.mark.quick

OLD = 1_000_000_000  # an mtime nobody sets by accident
DIGEST = "d" * 64


def _swap(folder: Path, outside: Path) -> Path:
    """Move ``folder`` aside and put a symlink to ``outside`` in its place; returns the moved folder."""
    moved = folder.with_name(folder.name + ".orig")
    folder.rename(moved)
    folder.symlink_to(outside, target_is_directory=True)
    return moved


def _aged(path: Path, text: str = "{}") -> Path:
    path.write_text(text)
    os.utime(path, (OLD, OLD))
    return path


def _snapshot(token: str) -> Snapshot:
    return Snapshot(
        key=DIGEST, token=token, pod="holder", elapsed_s=1.0, cpu_seconds=1.0, staged_bytes=1,
        expected_bytes=None, expected_source="", eta_s=None, eta_source="", every_s=1.0,
    )  # fmt: skip


# --- the compile progress record (leases/<digest>.progress.json) --------------------------------


@pytest.fixture
def cache(tmp_path: Path) -> CacheRoot:
    (tmp_path / "root").mkdir()
    return open_root(tmp_path / "root", create=True)


def test_the_progress_record_is_never_removed_through_a_swapped_leases_folder(
    cache: CacheRoot, tmp_path: Path
) -> None:
    write_record(cache, _snapshot("mine"))
    outside = tmp_path / "outside"
    outside.mkdir()
    # Our own record, word for word, so the token check passes wherever it is read from.
    planted = outside / record_path(cache, DIGEST).name
    planted.write_text(json.dumps(_snapshot("mine").to_json()))
    moved = _swap(cache.leases, outside)

    remove_record(cache, DIGEST, token="mine")

    assert planted.is_file(), "the holder removed a file outside the root"
    assert (moved / planted.name).is_file(), "nothing reachable from the root was removed either"


def test_the_progress_record_is_removed_only_when_it_is_ours(cache: CacheRoot) -> None:
    write_record(cache, _snapshot("newer-holder"))
    remove_record(cache, DIGEST, token="mine")
    assert read_record(cache, DIGEST, token="newer-holder") is not None
    remove_record(cache, DIGEST, token="newer-holder")
    assert not record_path(cache, DIGEST).exists()


# --- the volume heartbeat (use records, staging owner files) --------------------------------------


def test_the_heartbeat_never_touches_through_a_swapped_folder(cache: CacheRoot, tmp_path: Path) -> None:
    usage = cache.usage / DIGEST
    usage.mkdir()
    record = _aged(usage / "pod-a.1.json")
    outside = tmp_path / "outside"
    outside.mkdir()
    there = _aged(outside / record.name)
    beat = Heartbeat()
    beat.add(record, usage / "pod-b.1.json", within=cache.path)  # pod-b's exists outside only as a name
    _swap(usage, outside)

    beat.beat()

    assert there.stat().st_mtime == OLD, "the heartbeat touched a file outside the root"
    assert sorted(p.name for p in outside.iterdir()) == [record.name], "it created one"


def test_the_heartbeat_touches_its_files_and_creates_none(cache: CacheRoot) -> None:
    usage, staging = cache.usage / DIGEST, cache.staging / DIGEST
    usage.mkdir()
    staging.mkdir()
    record, owner = _aged(usage / "pod.1.json"), _aged(staging / "pod.1.abcd.json")
    gone = usage / "released.1.json"  # a use released while still watched
    removed = cache.staging / ("e" * 64) / "attempt.json"  # its whole folder removed
    beat = Heartbeat()
    beat.add(record, gone, within=cache.path)
    beat.add(owner, removed, within=cache.path)

    beat.beat()

    assert record.stat().st_mtime > OLD
    assert owner.stat().st_mtime > OLD
    assert not gone.exists()
    assert not removed.parent.exists()
    beat.discard(record)
    os.utime(record, (OLD, OLD))
    beat.beat()
    assert record.stat().st_mtime == OLD, "a discarded path is no longer touched"
