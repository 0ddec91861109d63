"""The walk and the removal under the cache root hold a few descriptors whatever the depth, and never
follow a folder out of the tree (cachemgr.core.safewalk, issue 33).

A descriptor per level ran out of them on a chain of 1,100 folders under a limit of 1,024 open
files. Now the walk goes back up through ``..``, checked to be the folder it left (device and
inode), and reaches a folder moved meanwhile again by name from the top. The descriptors are
counted in ``/proc/self/fd`` at every step of a real 1,100-deep walk; the moves are real renames
made while the walk is under way.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from cachemgr_testkit.hostile import deep_folder, file_leaf, remove_deep

from cachemgr.core import safefs, safewalk

pytestmark = pytest.mark.quick

DEPTH = 1_100


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _walk(top: Path) -> list[str]:
    with safefs.open_tree(top, within=None) as fd:
        return [rel for rel, _, _ in safewalk.walk(fd)]


def test_a_walk_1100_deep_holds_a_few_descriptors_and_sees_everything(tmp_path: Path) -> None:
    top = tmp_path / "tree"
    top.mkdir()
    try:
        deep_folder(top, DEPTH, leaf=file_leaf(b"x"))
        (top / "beside.txt").write_text("y")
        before = _open_descriptors()
        most = 0
        found = []
        with safefs.open_tree(top, within=None) as fd:
            for rel, entry, parent in safewalk.walk(fd):
                most = max(most, _open_descriptors() - before)
                if entry.is_file(follow_symlinks=False):
                    found.append((rel, entry.stat(follow_symlinks=False).st_size, os.fstat(parent).st_ino))
        assert most <= 2, f"{most} descriptors open at once"
        deepest = "/".join(["d"] * DEPTH) + "/planted.bin"
        assert sorted(rel for rel, _, _ in found) == ["beside.txt", deepest]
        assert {size for _, size, _ in found} == {1}
        assert _open_descriptors() == before, "every descriptor closed"
        safewalk.remove(tmp_path, top)
        assert not top.exists()
        assert _open_descriptors() == before
    finally:
        remove_deep(top)


def test_removal_of_1100_levels_of_read_only_folders_holds_a_few_descriptors(tmp_path: Path) -> None:
    top = tmp_path / "tree"
    top.mkdir()
    try:
        deep_folder(top, DEPTH, leaf=file_leaf(b"x"))
        _read_only_chain(top / "d")  # as a published entry's folders are (0555)
        before = _open_descriptors()
        seen = []
        real_rmdir = os.rmdir

        def counting_rmdir(*args: object, **kwargs: object) -> None:
            seen.append(_open_descriptors() - before)
            real_rmdir(*args, **kwargs)  # type: ignore[arg-type]

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(os, "rmdir", counting_rmdir)
            safewalk.remove(tmp_path, top)
        assert len(seen) == DEPTH + 1
        assert max(seen) <= 3, "the parent remove opened, the top, the folder emptied"
        assert not top.exists()
    finally:
        remove_deep(top)


def _read_only_chain(first: Path) -> None:
    fd = os.open(first, os.O_RDONLY | os.O_DIRECTORY)
    try:
        while True:
            os.fchmod(fd, 0o555)
            try:
                child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            except FileNotFoundError:
                return
            os.close(fd)
            fd = child
    finally:
        os.close(fd)


def _chain(top: Path, names: str) -> Path:
    path = top
    for name in names:
        path = path / name
        path.mkdir()
        (path / f"file-{name}").write_text(name)
    return path


def test_a_folder_moved_under_the_walk_is_not_followed_to_its_new_parent(tmp_path: Path) -> None:
    """While the walk is in a/b/c/d, c moves to the top: going up from c, ``..`` is the top, not
    b; the walk reaches b again by name from the top and goes on with b's other names."""
    top = tmp_path / "tree"
    top.mkdir()
    deepest = _chain(top, "abcd")
    (top / "a" / "b" / "later").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the walk's")
    seen = []
    with safefs.open_tree(top, within=None) as fd:
        for rel, _, _ in safewalk.walk(fd):
            seen.append(rel)
            if rel == "a/b/c/d/file-d":
                os.rename(top / "a" / "b" / "c", top / "moved-c")
    assert "a/b/later" in seen, "b's other names still visited, from b itself"
    assert not [rel for rel in seen if rel.startswith("moved-c")], "the top was listed before the move"
    assert deepest.name == "d"


def test_a_folder_replaced_under_the_walk_stops_it_with_an_unsafe_path_error(tmp_path: Path) -> None:
    """The folder above the walk replaced by another of the same name: reached again from the top,
    it is not the folder the walk entered, and the walk stops rather than list a stranger."""
    top = tmp_path / "tree"
    top.mkdir()
    _chain(top, "abc")
    outside = tmp_path / "outside"
    seen = []

    def walk_and_replace() -> None:
        with safefs.open_tree(top, within=None) as fd:
            for rel, _, _ in safewalk.walk(fd, shown=top):
                seen.append(rel)
                if rel == "a/b/c/file-c":
                    os.rename(top / "a" / "b", outside)  # b and c leave the tree
                    os.rename(outside / "c", top / "a" / "c-elsewhere")  # c's ".." is now a
                    (top / "a" / "b").mkdir()  # and a stranger takes b's name
                    (top / "a" / "b" / "stranger.txt").write_text("not the walk's")

    with pytest.raises(safefs.UnsafePathError, match=r"tree/a/b was replaced while cachemgr walked it"):
        walk_and_replace()
    assert not [rel for rel in seen if "stranger" in rel or "c-elsewhere" in rel]


def test_a_removal_never_empties_a_folder_moved_out_of_the_tree(tmp_path: Path) -> None:
    """A prune deleting trash/X while someone moves a folder of X out of the volume: what the
    removal had listed there goes (it is X's), the folder it was moved into is never touched."""
    top = tmp_path / "tree"
    top.mkdir()
    _chain(top, "abc")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the removal's")
    real_unlink = os.unlink
    moved = []

    def unlink_then_move(name: str, *args: object, **kwargs: object) -> None:
        real_unlink(name, *args, **kwargs)  # type: ignore[arg-type]
        if name == "file-c" and not moved:
            os.rename(top / "a" / "b", outside / "b")
            moved.append(True)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "unlink", unlink_then_move)
        with contextlib.suppress(OSError):  # b gone from under a: the removal may stop there
            safewalk.remove(tmp_path, top)
    assert (outside / "keep.txt").read_text() == "not the removal's"
    assert moved
