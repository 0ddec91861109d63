"""A running pod is never disturbed by anyone else, and its server reads what was published.

Real ``cachemgr run`` pods with the stand-in server (podlib), and real second processes typed
into them as ``kubectl exec`` would: the same environment, so the same CACHEMGR_STATE_DIR.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from cachemgr_testkit.mounts import tmpfs_volume
from cachemgr_testkit.podlib import Cluster, Pod, free_port, read_jsonl, run_cli, wait_for
from cachemgr_testkit.scenarios import compile_cmd, entry_dirs, server_argv

from cachemgr.runtime.views import ANCHORS, ROOT, build_view, remove_old_views
from cachemgr.volume.manifest import ARTIFACTS, FileRecord, Manifest, read_manifest


def _views(pod: Pod) -> list[Path]:
    """The views of the pod's starts, as its servers got them (each in a home of its own)."""
    views = pod.state_dir / "views"
    return sorted(home / ROOT for home in views.iterdir()) if views.is_dir() else []


def _readable(view: Path, entry: Path) -> None:
    """Every file of the entry, read through the view as the server opens it."""
    manifest = read_manifest(entry)
    cut = len(ARTIFACTS) + 1
    files = [record for record in manifest.files if record.path.startswith(ARTIFACTS + "/")]
    assert files
    for record in files:
        assert len((view / record.path[cut:]).read_bytes()) == record.size


def _probes_pass(pod: Pod) -> None:
    for kind in ("startup", "live", "ready"):
        done = run_cli("probe", kind, env=pod.env)
        assert done.returncode == 0, f"{kind}: {done.stdout}{done.stderr}"


def _serving(pods: Cluster, root: Path, record: Path) -> tuple[Pod, Path, Path]:
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record)]
    pod = pods.start("a", server_argv(free_port()), cache_root=root, options=options)
    pod.wait_phase("serving")
    (entry,) = entry_dirs(root)
    wait_for(lambda: len(_views(pod)) == 1, what="the pod's one view")
    return pod, entry, _views(pod)[0]


def test_a_second_run_in_a_serving_pod_is_refused_and_warm_leaves_the_pod_alone(
    pods: Cluster, root: Path
) -> None:
    record = pods.work / "compiler.jsonl"
    pod, entry, view = _serving(pods, root, record)
    before = pod.state()
    env = {**pod.env, "CACHEMGR_LOG_FORMAT": "console"}
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record)]

    second = run_cli("run", *options, "--", *server_argv(free_port()), env=env, timeout=30)
    assert second.returncode == 64, second.stderr
    (line,) = second.stderr.splitlines()
    assert f"pid {pod.proc.pid}" in line
    assert "owns the state dir" in line
    assert "cachemgr warm" in line

    # warm on a hit (this pod's key), then on a miss (another compile command, another key).
    for compile_line in (compile_cmd(record), compile_cmd(record, extra="--files 3")):
        warm = run_cli(
            "warm", "--strategy", "command", "--compile-cmd", compile_line, "--",
            *server_argv(free_port()), env=env, timeout=60,
        )  # fmt: skip
        assert warm.returncode == 0, warm.stderr
    assert len(entry_dirs(root)) == 2, "the warm on a miss compiled and published"

    assert pod.proc.poll() is None
    assert _views(pod) == [view]
    _readable(view, entry)
    after = pod.state()
    assert (after["pid"], after["phase"], after["started_at"]) == (
        before["pid"], "serving", before["started_at"],
    )  # fmt: skip
    _probes_pass(pod)
    assert not (pod.state_dir / "termination-log").exists(), "the live pod's termination message"


def test_a_second_run_after_the_first_ended_takes_the_state_dir_over(pods: Cluster, root: Path) -> None:
    """The claim dies with its owner: the next container (same emptyDir) starts as usual."""
    record = pods.work / "compiler.jsonl"
    pod, _entry, old_view = _serving(pods, root, record)
    pod.signal_pod(9)  # a container killed outright: no cleanup ran
    pod.wait_exit()
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record)]
    again = pods.start("a2", server_argv(free_port()), cache_root=root, options=options, env=pod.env)
    # a2 writes into a's state dir (its env says so), as the next container of the pod would.
    wait_for(
        lambda: pod.state().get("pid") == again.proc.pid and pod.phase == "serving",
        what="the next container to own the state dir and serve",
    )
    wait_for(lambda: old_view not in _views(pod), what="the dead container's view to be removed")
    assert len(_views(pod)) == 1
    _probes_pass(pod)


_OWNER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from cachemgr.volume.manifest import read_manifest
    from cachemgr.runtime.views import build_view
    entry = Path(sys.argv[2])
    print(build_view(Path(sys.argv[1]), entry, read_manifest(entry)), flush=True)
    if sys.argv[3] == "stay":
        sys.stdin.read()  # alive until the test closes our stdin
    """
)


def test_old_views_are_removed_only_when_their_owner_is_gone(
    pods: Cluster, root: Path, tmp_path: Path
) -> None:
    record = pods.work / "compiler.jsonl"
    warm = pods.start(
        "w", server_argv(free_port()), cache_root=root, command="warm",
        options=["--strategy", "command", "--compile-cmd", compile_cmd(record)],
    )  # fmt: skip
    assert warm.wait_exit() == 0
    (entry,) = entry_dirs(root)
    views = tmp_path / "views"

    def owner(mode: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", _OWNER, str(views), str(entry), mode],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    gone = owner("exit")
    gone_view = Path(gone.communicate(timeout=30)[0].strip())
    live = owner("stay")
    try:
        assert live.stdout is not None
        live_view = Path(live.stdout.readline().strip())
        mine = owner("exit")
        mine_view = Path(mine.communicate(timeout=30)[0].strip())
        legacy = views / f"{entry.name[-16:]}.abc123"  # named before views carried their owner
        legacy.mkdir()
        remove_old_views(views, keep=mine_view)
        assert sorted(views.iterdir()) == sorted([live_view.parent, mine_view.parent])
        _readable(live_view, entry)
    finally:
        live.communicate(timeout=30)  # closes its stdin: the owner exits
    remove_old_views(views, keep=mine_view)
    assert list(views.iterdir()) == [mine_view.parent]
    assert gone_view != live_view
    _readable(mine_view, entry)  # removing views through their anchors left the entry alone


def test_an_old_view_that_cannot_be_removed_leaves_the_others_to_go(
    pods: Cluster, root: Path, tmpfs_small: Callable[..., Path]
) -> None:
    """Removal runs in a thread beside the server: one dead start's view that will not go (here
    a filesystem mounted inside it, which removal never crosses) must neither end the cleanup of
    the others nor raise (in the thread, a traceback in the pod's log)."""
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record)]
    warm = pods.start("w", server_argv(free_port()), cache_root=root, command="warm", options=options)
    assert warm.wait_exit() == 0
    (entry,) = entry_dirs(root)
    views = tmpfs_small(1 << 20) / "views"  # the state dir an emptyDir of medium Memory

    def dead_view() -> Path:
        done = subprocess.run(
            [sys.executable, "-c", _OWNER, str(views), str(entry), "exit"],
            capture_output=True, text=True, check=True, timeout=30,
        )  # fmt: skip
        return Path(done.stdout.strip())

    stuck, gone, mine = dead_view(), dead_view(), dead_view()
    with tmpfs_volume(stuck / "scratch", size_bytes=1 << 20):
        remove_old_views(views, keep=mine)
        assert sorted(views.iterdir()) == sorted([stuck.parent, mine.parent])
        assert gone != mine
    _readable(mine, entry)


def test_a_relative_cache_root_gives_the_server_links_that_resolve(pods: Cluster, root: Path) -> None:
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record)]
    elsewhere = pods.work / "cwd"
    elsewhere.mkdir()
    relative = Path(os.path.relpath(root, elsewhere))
    assert not relative.is_absolute()
    pod = pods.start("a", server_argv(free_port()), cache_root=relative, options=options, cwd=elsewhere)
    pod.wait_phase("serving")
    (entry,) = entry_dirs(root)
    (view,) = _views(pod)
    links = [Path(d) / name for d, _, names in os.walk(view) for name in names]
    assert links
    # The anchors beside the view are absolute, one per directory of the entry; the file links
    # go through them, short enough for ext4 to keep in the inode (under 60 bytes: no block per
    # link) however long the entry's names.
    anchors = {os.readlink(anchor) for anchor in (view.parent / ANCHORS).iterdir()}
    artifacts = entry.resolve() / ARTIFACTS
    assert anchors == {str(artifacts), *(str(d) for d in artifacts.rglob("*") if d.is_dir())}
    assert all(os.readlink(link).startswith("../") for link in links)
    assert max(len(os.readlink(link)) for link in links) < 60
    _readable(view, entry)
    loads = [event for event in pods.record if event.get("event") == "load"]
    assert len(loads) == 1, pods.record


@pytest.mark.quick
def test_view_links_stay_short_under_long_and_deep_names(tmp_path: Path) -> None:
    """vllm-rbln names its directories after the model and a hash (compiled_models/NAME_HASH/...):
    the links still fit in the inode, each reads its own file, and removing the view leaves
    the entry whole."""
    entry = (
        tmp_path / "volume" / "entries" / ("rebellions--MiniMax-M2.7__prefill__c0.12__RBLN-CA25__" + "f" * 16)
    )
    rels = [
        "rbln_config.json",
        "compiled_models/rebellions_MiniMax-M2.7-tp4-b16_60f4cfeaa1e886a8/prefill.rbln",
        "compiled_models/rebellions_MiniMax-M2.7-tp4-b16_60f4cfeaa1e886a8/decoder/batch_0016.rbln",
        "rbln/" + "a" * 64 + "/rank0/mega_cache.bin",
        "d1/d2/d3/d4/d5/d6/d7/d8/deep.bin",
    ]
    records = []
    for index, rel in enumerate(rels):
        path = entry / ARTIFACTS / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rel.encode() * (index + 1))
        records.append(FileRecord(path=f"{ARTIFACTS}/{rel}", size=path.stat().st_size, xxh3=""))
    manifest = Manifest(
        key="k", inputs={}, files=tuple(records), created_at=0.0, created_by={}, compile_seconds=0.0,
        strategy="vllm",
    )  # fmt: skip
    views = tmp_path / "state" / "views"
    view = build_view(views, entry, manifest)
    for index, rel in enumerate(rels):
        link = view / rel
        assert len(os.readlink(link)) < 60, os.readlink(link)
        assert link.read_bytes() == rel.encode() * (index + 1)
    remove_old_views(views, keep=tmp_path / "another" / ROOT)  # its owner (this test) counts as gone
    assert list(views.iterdir()) == []
    assert sorted(str(p.relative_to(entry / ARTIFACTS)) for p in entry.rglob("*") if p.is_file()) == sorted(
        rels
    )


# --- published entries cannot be changed unnoticed ---------------------------------------------


def _published(pods: Cluster, root: Path, record: Path) -> Path:
    warm = pods.start(
        "w", server_argv(free_port()), cache_root=root, command="warm",
        options=["--strategy", "command", "--compile-cmd", compile_cmd(record)],
    )  # fmt: skip
    assert warm.wait_exit() == 0
    (entry,) = entry_dirs(root)
    return entry


def test_published_files_are_0444_and_directories_below_the_entry_0555(pods: Cluster, root: Path) -> None:
    entry = _published(pods, root, pods.work / "compiler.jsonl")
    assert stat.S_IMODE(entry.stat().st_mode) & 0o200, "the entry itself stays movable (quarantine, prune)"
    for dirpath, dirnames, filenames in os.walk(entry):
        for name in dirnames:
            assert stat.S_IMODE(os.lstat(os.path.join(dirpath, name)).st_mode) == 0o555
        for name in filenames:
            assert stat.S_IMODE(os.lstat(os.path.join(dirpath, name)).st_mode) == 0o444
    assert all(record.mtime_ns for record in read_manifest(entry).files)


@pytest.mark.parametrize("change", ["same-size", "append"])
def test_a_write_through_the_view_is_caught_and_the_entry_recompiled(
    pods: Cluster, root: Path, change: str
) -> None:
    record = pods.work / "compiler.jsonl"
    pod, _entry, view = _serving(pods, root, record)
    link = next(Path(d) / names[0] for d, _, names in os.walk(view) if names)
    os.chmod(os.path.realpath(link), 0o644)  # as the entry's owner may; root needs not even that
    with open(link, "r+b") as handle:  # the server writing in place through its view
        if change == "append":
            handle.seek(0, os.SEEK_END)
            handle.write(b"x")
        else:
            first = handle.read(1)
            handle.seek(0)
            handle.write(first)  # the same byte: only the mtime tells

    verify = run_cli("verify", env=pod.env)
    assert verify.returncode == 74, verify.stdout + verify.stderr
    assert ("mtime" if change == "same-size" else "size") in verify.stdout

    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record)]
    again = pods.start("b", server_argv(free_port()), cache_root=root, options=options)
    again.wait_phase("serving")
    assert len([e for e in read_jsonl(record) if e["event"] == "compile"]) == 2
    assert [p for p in (root / "quarantine").iterdir() if p.is_dir()], "the changed entry moved aside"
    events = again.log_events()
    assert any(e["event"] == "entry_damaged" for e in events), events


# As root (CAP_DAC_OVERRIDE, CAP_FOWNER) modes mean nothing: drop every capability, so the
# commands run as an unprivileged owner of the volume's files would.
_UNPRIVILEGED = ["setpriv", "--bounding-set", "-all", "--inh-caps", "-all", "--"] if os.geteuid() == 0 else []

_WRITE_IN_PLACE = textwrap.dedent(
    """
    import os, sys
    path = sys.argv[1]
    try:
        open(path, "r+b")
    except PermissionError:
        print("refused", flush=True)
    os.chmod(path, 0o644)
    with open(path, "r+b") as handle:
        first = handle.read(1)
        handle.seek(0)
        handle.write(first)
    """
)


def test_an_unprivileged_owner_is_refused_writes_and_still_quarantines_and_prunes(
    pods: Cluster, root: Path
) -> None:
    """0444 files refuse a plain write; 0555 directories do not stop quarantine or prune."""
    record = pods.work / "compiler.jsonl"
    env = {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root), "CACHEMGR_LOG_FORMAT": "console"}
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record)]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*_UNPRIVILEGED, sys.executable, "-m", "cachemgr", *args], env=env, capture_output=True,
            text=True, timeout=60, check=False, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def warm() -> Path:
        done = cli("warm", *options, "--", *server_argv(free_port()))
        assert done.returncode == 0, done.stderr
        (entry,) = entry_dirs(root)
        return entry

    entry = warm()
    victim = next(p for p in (entry / "artifacts").rglob("*") if p.is_file())
    wrote = subprocess.run(
        [*_UNPRIVILEGED, sys.executable, "-c", _WRITE_IN_PLACE, str(victim)],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert wrote.stdout.split() == ["refused"], "a plain write into a published file must fail"

    fixed = cli("verify", "--fix")
    assert fixed.returncode == 74, fixed.stdout + fixed.stderr
    assert entry_dirs(root) == []
    pruned = cli("prune", "--damaged", "--yes")
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    assert [p for p in (root / "quarantine").iterdir() if p.is_dir()] == []

    warm()
    pruned = cli("prune", "--keep-bytes", "0", "--yes")
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    assert entry_dirs(root) == []
    assert list((root / "trash").iterdir()) == []


def test_a_state_record_whose_pid_now_belongs_to_another_process_fails_the_probes(
    pods: Cluster, root: Path
) -> None:
    """The next container's processes reuse pids: the record names its process by pid and start."""
    record = pods.work / "compiler.jsonl"
    pod, _entry, _view = _serving(pods, root, record)
    _probes_pass(pod)
    pod.signal_pod(9)
    pod.wait_exit()
    with subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    ) as other:
        state = pod.state()
        assert state["pid_start_ticks"]
        state["pid"] = other.pid  # as if the dead run's pid now belonged to another process
        (pod.state_dir / "state.json").write_text(json.dumps(state))
        os.utime(pod.state_dir / "heartbeat")
        for kind in ("startup", "live", "ready"):
            done = run_cli("probe", kind, env=pod.env)
            assert done.returncode == 1, done.stdout
            assert f"(pid {other.pid}) is not running" in done.stdout
        other.communicate(timeout=30)
