"""``ls`` and ``du`` take what has not changed from the volume's hints file (issue 25, item 5).

- a scan for display that read many entries writes ``scan-hints.json``; the next one takes each
  row only while the entry directory's (and usage folder's) stamp is what the row saw;
- a change (a pod registering, an entry quarantined and compiled again, a summary replaced)
  is read afresh; a usage folder with use records is always read;
- the file is hostile ground: a link, a FIFO, a huge or broken file, rows for other entries or
  that do not check out are ignored, never followed or blocking; a lying row shows only in
  ``ls``: ``prune`` and the space check never read hints.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cachemgr.key.cachekey import KeyRequest, compute_key
from cachemgr.ops import scanhints
from cachemgr.ops.prune_plan import PruneRequest, plan_prune
from cachemgr.ops.scan import scan
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import CacheRoot, open_root
from cachemgr.volume.manifest import SUMMARY_NAME
from cachemgr.volume.records import register_use, release_use
from cachemgr.volume.store import create_staging, publish

pytestmark = pytest.mark.quick
IDENTITY = PodIdentity(pod="hints-test", node="node-a", host="host", pid=os.getpid())
COUNT = scanhints.REWRITE_AFTER + 6


def _key(i: int) -> object:
    return compute_key(
        KeyRequest(
            argv=["vllm", "serve", "{artifact_dir}", "--max-model-len", str(1024 + i)],
            role="prefill",
            strategy="command",
            compile_cmd="compiler --output-dir {output_dir}",
            compiler_version="0.12.0",
            npu_type="RBLN-CA25",
            environ={},
        )
    )


def _volume(tmp_path: Path, count: int = COUNT) -> CacheRoot:
    (tmp_path / "volume").mkdir()
    root = open_root(tmp_path / "volume", create=True)
    for i in range(count):
        key = _key(i)
        staging = create_staging(root, key, IDENTITY)
        (staging.artifacts / "graph.rbln").write_bytes(b"x" * (100 + i))
        publish(root, staging, key, identity=IDENTITY, compile_seconds=1.0, strategy="command")
        release_use(register_use(root, key.digest, IDENTITY, entry=key.entry_name))  # a usage folder
    return root


def _shown(root: CacheRoot, *, hints: bool) -> list[dict[str, object]]:
    return [e.to_json() for e in scan(root, hints=hints, with_staging=False).entries]


def _rewrite_in_place(path: Path, **changes: object) -> None:
    """The summary's bytes changed in place: its directory's times stay as they were."""
    data = json.loads(path.read_text())
    data.update(changes)
    os.chmod(path, 0o644)
    with path.open("r+") as handle:
        handle.write(json.dumps(data))
        handle.truncate()


def test_a_display_scan_writes_hints_and_the_next_one_takes_them(tmp_path: Path) -> None:
    root = _volume(tmp_path)
    plain = _shown(root, hints=False)
    assert not (root.path / scanhints.HINTS_NAME).exists()
    assert _shown(root, hints=True) == plain  # read afresh, and the hints written
    written = json.loads((root.path / scanhints.HINTS_NAME).read_text())
    assert len(written["entries"]) == COUNT
    assert len(written["usage"]) == COUNT
    assert _shown(root, hints=True) == plain  # from the hints: the same rows
    # Proof that they were taken: a summary changed in place (its directory's stamp unchanged)
    # is shown as hinted by a display scan, as it is by a scan that reads everything.
    first = sorted((root.path / "entries").iterdir())[0]
    _rewrite_in_place(first / SUMMARY_NAME, model="rewritten-in-place")
    hinted = {e["entry"]: e["model"] for e in _shown(root, hints=True)}
    fresh = {e["entry"]: e["model"] for e in _shown(root, hints=False)}
    assert fresh[first.name] == "rewritten-in-place"
    assert hinted[first.name] != "rewritten-in-place"


def test_what_changed_is_read_afresh(tmp_path: Path) -> None:
    root = _volume(tmp_path)
    _shown(root, hints=True)
    entry = sorted((root.path / "entries").iterdir())[1]
    summary = json.loads((entry / SUMMARY_NAME).read_text())
    # A pod starts to use an entry: its usage folder changes and holds a use record.
    record = register_use(root, summary["key"], IDENTITY, entry=entry.name)
    shown = {e["entry"]: e for e in _shown(root, hints=True)}
    assert shown[entry.name]["in_use"] is True
    release_use(record)
    assert {e["entry"]: e for e in _shown(root, hints=True)}[entry.name]["in_use"] is False
    # A summary replaced by a rename (as publish writes it) changes the directory: read afresh.
    os.chmod(entry, 0o755)
    data = json.loads((entry / SUMMARY_NAME).read_text())
    data["model"] = "replaced"
    tmp = entry / ".summary.tmp"
    tmp.write_text(json.dumps(data))
    os.replace(tmp, entry / SUMMARY_NAME)
    assert {e["entry"]: e["model"] for e in _shown(root, hints=True)}[entry.name] == "replaced"


def test_rows_that_do_not_check_out_are_read_afresh(tmp_path: Path) -> None:
    root = _volume(tmp_path)
    _shown(root, hints=True)
    path = root.path / scanhints.HINTS_NAME
    data = json.loads(path.read_text())
    names = sorted(data["entries"])
    data["entries"][names[0]]["summary"]["key"] = "f" * 32  # another entry's key
    data["entries"][names[1]]["stamp"][0] += 1  # another directory
    data["entries"][names[2]]["summary"]["size_bytes"] = "many"  # the wrong type
    data["entries"]["not-listed__x"] = data["entries"][names[3]]  # no such entry
    path.write_text(json.dumps(data))
    plain = _shown(root, hints=False)
    assert _shown(root, hints=True) == plain


@pytest.mark.parametrize("stamp", [5, 1.5, True])
def test_a_row_whose_stamp_is_not_a_list_is_read_afresh_never_a_crash(tmp_path: Path, stamp: object) -> None:
    """Adversarial pass: a planted ``"stamp": 5`` made every ls and du (and the status port's volume
    figures) fail with a TypeError, exit 70; in an entry's row and in a usage folder's."""
    root = _volume(tmp_path)
    _shown(root, hints=True)
    path = root.path / scanhints.HINTS_NAME
    data = json.loads(path.read_text())
    for rows in (data["entries"], data["usage"]):
        for row in rows.values():
            row["stamp"] = stamp
    path.write_text(json.dumps(data))
    plain = _shown(root, hints=False)
    assert _shown(root, hints=True) == plain
    assert _shown(root, hints=True) == plain, "and the file the scan rewrote is read as well"


@pytest.mark.parametrize("kind", ["symlink", "fifo", "huge", "garbage", "directory"])
def test_a_hints_file_that_is_not_one_is_ignored_and_never_followed(tmp_path: Path, kind: str) -> None:
    root = _volume(tmp_path)
    _shown(root, hints=True)
    good = (root.path / scanhints.HINTS_NAME).read_bytes()
    path = root.path / scanhints.HINTS_NAME
    path.unlink()
    outside = tmp_path / "outside.json"
    if kind == "symlink":
        lie = json.loads(good)
        for row in lie["entries"].values():
            row["summary"]["model"] = "from outside the root"
        outside.write_text(json.dumps(lie))
        path.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(path)  # would block a reader that opened it plainly
    elif kind == "huge":
        with path.open("wb") as handle:
            handle.truncate(scanhints.MAX_BYTES + 1)
    elif kind == "garbage":
        path.write_bytes(b"{" * 100_000)
    else:
        path.mkdir()
    models = {e["model"] for e in _shown(root, hints=True)}
    assert "from outside the root" not in models
    if kind == "symlink":
        assert path.is_symlink() is False  # replaced by the rewrite: the link itself, never its target
        assert "from outside the root" in outside.read_text()


def test_a_lying_hint_shows_only_in_ls_prune_reads_the_use_records(tmp_path: Path) -> None:
    root = _volume(tmp_path)
    entry = sorted((root.path / "entries").iterdir())[0]
    digest = json.loads((entry / SUMMARY_NAME).read_text())["key"]
    register_use(root, digest, IDENTITY, entry=entry.name)  # in use now
    _shown(root, hints=True)
    # A writer of the volume hints the usage folder as one without records, with its true stamp.
    path = root.path / scanhints.HINTS_NAME
    data = json.loads(path.read_text())
    st = (root.path / "usage" / digest).stat()
    stamp = [st.st_ino, st.st_mtime_ns, st.st_ctime_ns]
    data["usage"][digest] = {"stamp": stamp, "recompiled": 0, "starts": {}, "waited": []}
    path.write_text(json.dumps(data))
    shown = {e["entry"]: e for e in _shown(root, hints=True)}
    assert shown[entry.name]["in_use"] is False  # the lie reaches the display...
    plan = plan_prune(root, scan(root), PruneRequest(unused_for=0.0), identity=IDENTITY)
    planned = {item.name for item in plan.items}
    assert entry.name not in planned  # ...never a removal: prune reads the folder itself
