"""Records on the volume are touched and removed from their folder reached from the root.

Someone with write access to the volume swaps a folder of the layout (``leases/``,
``usage/<digest>``, ``staging/<digest>``) for a symlink to a directory outside the root, after
cachemgr wrote its record there. Removing, refreshing or taking over that record by path would
then act on a file of the same name in the link's target. Every test plants the link for real
and checks that the file outside is left exactly as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
from cachemgr_testkit.podlib import DEADLINE, wait_for
from cachemgr_testkit.scenarios import command_key, entry_dirs

from cachemgr.core.safefs import UnsafePathError
from cachemgr.ops.progress import Snapshot, read_record, record_path, remove_record, write_record
from cachemgr.volume import store
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import CacheRoot, open_root
from cachemgr.volume.lease import KeyLease, holder_path, marker_path
from cachemgr.volume.manifest import Manifest
from cachemgr.volume.records import Heartbeat
from cachemgr.volume.softlease import SoftLease
from cachemgr.volume.store import create_staging, publish

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


# --- the compile lease (leases/<digest>.lock and .holder.json) -------------------------------------


class _Never:
    def is_set(self) -> bool:
        return False


def _dead_pid() -> int:
    """A pid no process has now: a holder that died on this host."""
    return next(pid for pid in range(4_000_000, 4_100_000) if not psutil.pid_exists(pid))


def test_the_lease_is_never_released_through_a_swapped_leases_folder(
    cache: CacheRoot, tmp_path: Path
) -> None:
    lease = KeyLease(cache, DIGEST, PodIdentity.current({"POD_NAME": "holder"}), duration=30.0, confirm=0.0)
    assert lease.wait_or_acquire(published=lambda: False, stop=_Never(), wait_timeout=5.0) == "acquired"
    outside = tmp_path / "outside"
    outside.mkdir()
    # Our marker and holder record, word for word, so every token check passes through the link.
    planted = [outside / marker_path(cache, DIGEST).name, outside / holder_path(cache, DIGEST).name]
    for path in planted:
        shutil.copy2(cache.leases / path.name, path)
    moved = _swap(cache.leases, outside)

    lease.release()

    assert all(path.is_file() for path in planted), "the lease removed a file outside the root"
    assert sorted(p.name for p in moved.iterdir()) == sorted(p.name for p in planted)


def test_a_stale_marker_outside_is_never_taken_over(cache: CacheRoot, tmp_path: Path) -> None:
    """A contender breaks a dead holder's marker by renaming it aside and unlinking it: through
    a swapped leases/ that removed any file of the marker's name in the link's target."""
    first = SoftLease(cache.leases / "k.lock", within=cache.path, duration=30.0, confirm=0.0)
    assert first.acquire(poll=0.01, cancel=lambda: True)
    text = (cache.leases / "k.lock").read_text()
    first.release()
    outside = tmp_path / "outside"
    outside.mkdir()
    dead = re.sub(r"(?m)^pid=\d+$", f"pid={_dead_pid()}", text)
    (outside / "k.lock").write_text(dead)
    _swap(cache.leases, outside)
    contender = SoftLease(cache.leases / "k.lock", within=cache.path, duration=30.0, confirm=0.0)

    with pytest.raises(UnsafePathError, match="symbolic link"):
        contender.acquire(poll=0.01, cancel=lambda: True)

    assert [p.name for p in outside.iterdir()] == ["k.lock"]
    assert (outside / "k.lock").read_text() == dead


def test_the_lease_heartbeat_never_touches_through_a_swapped_leases_folder(
    cache: CacheRoot, tmp_path: Path
) -> None:
    lost = threading.Event()
    lease = SoftLease(
        cache.leases / "k.lock", within=cache.path, duration=0.4, heartbeat=0.02, confirm=0.0,
        on_lost=lambda _: lost.set(),
    )  # fmt: skip
    assert lease.acquire(poll=0.01, cancel=lambda: True)
    outside = tmp_path / "outside"
    outside.mkdir()
    there = _aged(outside / "k.lock", (cache.leases / "k.lock").read_text())
    _swap(cache.leases, outside)
    try:
        # The refresh fails (refused) until the lease could have expired, then it is reported lost.
        assert lost.wait(DEADLINE), "the heartbeat never noticed"
        assert lease.lost
    finally:
        lease.release()
    assert there.stat().st_mtime == OLD, "the heartbeat touched the marker outside the root"
    assert there.is_file()


# --- publish: the summary and the manifest written into the attempt ---------------------------------


def test_publish_writes_nothing_through_a_swapped_staging_folder(
    cache: CacheRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``staging/<digest>`` swapped for a link to a copy of itself once the summary is written:
    the manifest went by path, through the link, over a file of that name (the summary's write
    is guarded the same way; its window is the instant after its own walk)."""
    key = command_key("decode")
    staging = create_staging(cache, key, PodIdentity(pod="p", node="n", host="h", pid=os.getpid()))
    (staging.artifacts / "graph.rbln").write_bytes(b"g" * 100)
    outside = tmp_path / "outside"
    build = store.build_manifest
    copied: dict[str, bytes] = {}

    def swap_then_build(entry_dir: Path, **fields: Any) -> Manifest:
        shutil.copytree(entry_dir.parent, outside)
        copied.update(
            (p.relative_to(outside).as_posix(), p.read_bytes()) for p in outside.rglob("*") if p.is_file()
        )
        _swap(entry_dir.parent, outside)
        return build(entry_dir, **fields)

    monkeypatch.setattr(store, "build_manifest", swap_then_build)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        publish(
            cache, staging, key, identity=PodIdentity.current({}), compile_seconds=1.0, strategy="command"
        )
    after = {p.relative_to(outside).as_posix(): p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    assert after == copied, "publish wrote into the copy outside the root"
    assert entry_dirs(cache.path) == []


def test_a_folder_moved_away_between_two_steps_is_named_whole(cache: CacheRoot) -> None:
    """A level missing on the way down (moved away by a writer of the volume) names the whole path:
    the pod's one-line error says where, not only the last folder's name."""
    from cachemgr.core import safefs

    missing = cache.staging / DIGEST / "attempt"
    with pytest.raises(FileNotFoundError) as caught, safefs.open_dir(cache.path, missing):
        pass
    assert caught.value.filename == str(cache.staging / DIGEST)


def test_a_link_planted_as_a_keys_staging_folder_is_refused_in_its_own_words(
    cache: CacheRoot, tmp_path: Path
) -> None:
    """The refusal names the link and what to do, not "cannot create a staging directory: None"."""
    from cachemgr.runtime import failures
    from cachemgr.runtime.options import RunOptions

    key = command_key("decode")
    (cache.staging / key.digest).symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(UnsafePathError) as caught:
        create_staging(cache, key, PodIdentity(pod="p", node="n", host="h", pid=os.getpid()))
    options = RunOptions(cache_root=cache.path, state_dir=tmp_path / "state")
    said = failures.staging_failed(caught.value, cache, key, options)
    assert said is caught.value
    assert "None" not in str(said)
    assert f"{cache.staging / key.digest} is a symbolic link" in str(said)


def test_a_hard_link_planted_as_a_touched_file_is_replaced_not_touched(
    cache: CacheRoot, tmp_path: Path
) -> None:
    """``usage/<digest>/last-used`` as a hard link to a file outside the root (one filesystem):
    the start's touch would set that file's times; it gets a file of its own instead."""
    from cachemgr.core.fsutil import touch_at

    outside = _aged(tmp_path / "weights.bin", "outside")
    folder = cache.usage / DIGEST
    folder.mkdir(parents=True)
    os.link(outside, folder / "last-used")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        touch_at(fd, "last-used")
    finally:
        os.close(fd)
    assert outside.stat().st_mtime == OLD
    assert outside.read_text() == "outside"
    assert (folder / "last-used").stat().st_nlink == 1
    assert (folder / "last-used").stat().st_mtime > OLD


def test_a_hard_link_planted_as_a_beaten_record_is_written_again_not_touched(
    cache: CacheRoot, tmp_path: Path
) -> None:
    """A live pod's use record replaced by a hard link to a file outside the root: the beat would
    set that file's times. It takes the name back with a record of its own (its restore)."""
    usage = cache.usage / DIGEST
    usage.mkdir()
    record = usage / "pod.1.json"
    outside = _aged(tmp_path / "weights.bin", "outside")
    os.link(outside, record)
    restored: list[Path] = []

    def restore() -> bool:
        record.write_text("{}")
        restored.append(record)
        return True

    beat = Heartbeat()
    beat.add(record, within=cache.path, restore=restore)
    beat.beat()

    assert outside.stat().st_mtime == OLD, "the beat touched a file outside the root"
    assert outside.read_text() == "outside"
    assert restored == [record]
    assert record.stat().st_nlink == 1


def test_an_entry_moved_away_while_it_is_checked_is_a_miss_not_an_io_error(
    cache: CacheRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer (or a prune) moves the entry away between the lookup's first look and its check of
    the files: the pod gets a miss and goes on, not exit 74 'cannot read the cache entry' (the
    fuzzer's swapper, issue 40). The move is made at that instant by wrapping the check (a race
    no real timing makes on purpose)."""
    key = command_key("decode")
    staging = create_staging(cache, key, PodIdentity(pod="p", node="n", host="h", pid=os.getpid()))
    (staging.artifacts / "graph.rbln").write_bytes(b"g" * 100)
    publish(cache, staging, key, identity=PodIdentity.current({}), compile_seconds=1.0, strategy="command")
    [entry] = entry_dirs(cache.path)

    def moved_mid_check(*args: Any, **kwargs: Any) -> Any:
        # The check had the folder; a file it opens next is gone with the move.
        entry.rename(tmp_path / "moved")
        raise FileNotFoundError(2, "No such file or directory", str(entry / "artifacts" / "graph.rbln"))

    monkeypatch.setattr(store, "_check_entry", moved_mid_check)
    assert store.lookup(cache, key).status == "miss"


def test_a_hard_link_planted_as_the_held_lease_marker_is_never_touched(
    cache: CacheRoot, tmp_path: Path
) -> None:
    """The held lease's marker replaced by a hard link to a file outside the root (with the
    marker's own text, so it reads as ours): the heartbeat's refresh would set that file's times.
    It is removed instead, and the next beat writes the marker again (the lease is still held)."""
    lease = SoftLease(cache.leases / "k.lock", within=cache.path, duration=30.0, heartbeat=0.02, confirm=0.0)
    assert lease.acquire(poll=0.01, cancel=lambda: True)
    marker = cache.leases / "k.lock"
    outside = _aged(tmp_path / "weights.bin", marker.read_text())
    aside = marker.with_name("k.lock.aside")
    os.link(outside, aside)
    os.replace(aside, marker)

    def mine_again() -> bool:
        with contextlib.suppress(FileNotFoundError):
            return marker.stat().st_nlink == 1
        return False

    try:
        wait_for(
            mine_again,
            timeout=DEADLINE,
            what="the hard-linked marker to be replaced by one of the lease's own",
        )
        assert not lease.lost
    finally:
        lease.release()
    assert outside.stat().st_mtime == OLD, "the lease's heartbeat touched a file outside the root"
    assert outside.read_text().strip()


def test_a_path_pinned_before_never_names_a_later_pins_folder(cache: CacheRoot) -> None:
    """A compiler's straggler may keep writing under the pinned path it was handed after the
    compile (``/proc/<pid>/fd/<n>``): the next pin of the process (the entry handed to the
    server) must not sit at that number, or the straggler writes into it."""
    from cachemgr.core.safefs import pinned

    first, second = cache.staging / "attempt", cache.entries / "published"
    first.mkdir(parents=True)
    second.mkdir(parents=True)
    with pinned(cache.path, first) as handed:
        assert os.path.samefile(handed, first)
    with pinned(cache.path, second) as later:
        assert os.path.samefile(later, second)
        assert not (os.path.exists(handed) and os.path.samefile(handed, second)), (handed, later)


def test_names_made_from_a_volume_name_fit_name_max_and_whole_characters() -> None:
    from cachemgr.core.fsutil import NAME_MAX, fit_name

    body = "é" * 200  # 400 bytes
    made = fit_name("", body, ".20261206T000000Z.abcdef", room=len(".reason.json"))
    assert len(made.encode()) + len(".reason.json") <= NAME_MAX
    assert made.endswith(".20261206T000000Z.abcdef")
    assert made.startswith("é")
    kept_end = fit_name("ended.hit.1f.", "x" + "é" * 200, keep_end=True)
    assert len(kept_end.encode()) <= NAME_MAX
    assert kept_end.startswith("ended.hit.1f.é")
    assert fit_name("a.", "short", ".b") == "a.short.b"


def test_an_entry_named_with_all_of_name_max_is_set_aside_whole(cache: CacheRoot) -> None:
    """A planted entry whose name is 255 bytes: its quarantine name (with a stamp) and the note
    beside it (``.reason.json``) must still be names the volume can hold."""
    entry = cache.entries / ("m" * 255)
    entry.mkdir(parents=True)
    (entry / "manifest.json").write_text("{")
    aside = store.quarantine(cache, entry, reason="damaged")
    assert aside is not None
    assert aside.is_dir()
    assert not entry.exists()
    assert aside.with_name(aside.name + ".reason.json").is_file()


def test_explain_of_an_entry_moved_away_after_its_lookup_says_what_the_lookup_found(
    cache: CacheRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``explain`` looks the key up, then lists the volume: an entry moved away in between (a
    prune, the fuzzer's swapper: seed 6363 trials 17 and 152) is a hit with no listed entry, and
    explain exited 70 on an assertion. The move is made at that instant by wrapping the listing."""
    from cachemgr.ops import explain

    key = command_key("decode")
    staging = create_staging(cache, key, PodIdentity(pod="p", node="n", host="h", pid=os.getpid()))
    (staging.artifacts / "graph.rbln").write_bytes(b"g" * 100)
    publish(cache, staging, key, identity=PodIdentity.current({}), compile_seconds=1.0, strategy="command")
    [entry] = entry_dirs(cache.path)
    listing = explain.scan

    def moved_before_the_listing(*args: Any, **kwargs: Any) -> Any:
        entry.rename(tmp_path / "moved")
        return listing(*args, **kwargs)

    monkeypatch.setattr(explain, "scan", moved_before_the_listing)
    found = explain.explain(cache, key)
    assert found.result == "hit"
    assert found.entry is None
    assert found.advice[0] == f"a pod with this argv loads entry {key.entry_name} without compiling"


def test_a_record_the_beat_cannot_refresh_is_said_once_until_it_beats_again(
    cache: CacheRoot, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The use record's folder swapped for a link: the beat refuses to touch through it, and the
    record goes silent, which peers and prune take for a dead pod. The pod said nothing (the beat
    suppressed the refusal); now ``record_not_refreshed`` names the record, why, and what the
    silence means, once however many beats it lasts, and again if it comes back after a beat
    refreshed the record."""
    from cachemgr.core import log

    usage = cache.usage / DIGEST
    usage.mkdir()
    record = _aged(usage / "pod.1.json")
    outside = tmp_path / "outside"
    outside.mkdir()
    beat = Heartbeat()
    beat.add(record, within=cache.path)

    def said() -> list[dict[str, object]]:
        lines = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
        return [e for e in lines if e.get("event") == "record_not_refreshed"]

    log.configure("json")  # its writer binds the captured stderr: unbound again below
    try:
        moved = _swap(usage, outside)
        for _ in range(3):
            beat.beat()
        [warning] = said()
        assert warning["record"] == record.name, warning
        assert "symlink" in str(warning["error"]), warning
        assert "for a dead pod's" in str(warning["note"]), warning
        assert "retried at every beat" in str(warning["note"]), warning
        assert not (outside / record.name).exists(), "nothing created through the link"

        usage.unlink()
        moved.rename(usage)
        beat.beat()
        assert record.stat().st_mtime > OLD, "the record beats again once its folder is back"
        assert said() == []

        _swap(usage, outside)
        beat.beat()
        assert len(said()) == 1, "a new refusal, after a beat that refreshed the record, is said again"
    finally:
        log.configure("json")  # the next event binds the stderr of its own time, not this test's


def test_the_beat_outlives_a_warning_it_cannot_write(cache: CacheRoot, tmp_path: Path) -> None:
    """A record's folder swapped for a link makes the beat warn, and the pod's stderr is a pipe
    nobody reads any more (EPIPE): the failed write ended the heartbeat's thread, and the pod's
    other records went silent, so peers and prune took the live pod for a dead one. The thread
    goes on; its other record keeps beating."""
    from cachemgr.core import log

    usage = cache.usage / DIGEST
    usage.mkdir()
    kept = _aged(usage / "pod.1.json")
    planted = cache.usage / ("e" * 64)
    planted.symlink_to(tmp_path, target_is_directory=True)
    read, write = os.pipe()
    os.close(read)
    broken = os.fdopen(write, "w", buffering=1)
    beat = Heartbeat(interval=0.05)
    beat.add(kept, planted / "pod.1.json", within=cache.path)
    saved = sys.stderr
    sys.stderr = broken
    log.configure("json")  # its writer binds this stderr at the first event
    try:
        beat.start()
        wait_for(lambda: kept.stat().st_mtime > OLD, timeout=10, what="the first beat")
        os.utime(kept, (OLD, OLD))
        wait_for(lambda: kept.stat().st_mtime > OLD, timeout=10, what="a beat after the warning failed")
    finally:
        beat.stop()
        sys.stderr = saved
        log.configure("json")
        with contextlib.suppress(OSError):
            broken.close()
