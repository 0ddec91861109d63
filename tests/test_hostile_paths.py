"""The volume is hostile ground: symlinks and files planted in the layout never lead outside it.

Issue 12, defects 1, 8 and 9. A canary directory outside the cache root stands for a pod's
model weights; a symlink to it (or a plain file) replaces a layout directory, a child of one,
or a directory inside an entry, and every command runs against the volume: the canary must
come out byte for byte as it went in, and each command must work or exit with its documented
code and one line. The cache is built once by real ``cachemgr warm``/``run`` processes with
the stand-in compiler; each test works on its own copy.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cachemgr_testkit.podlib import DEADLINE, Cluster, cluster, error_lines, free_port, run_cli, wait_for
from cachemgr_testkit.scenarios import compile_cmd, entry_dirs, server_argv, vllm_argv

from cachemgr.core import safefs
from cachemgr.core.fsutil import atomic_write_json, hash_file, touch_at
from cachemgr.core.safefs import UnsafePathError
from cachemgr.volume.layout import open_root
from cachemgr.volume.manifest import ManifestError, VerifyMode, check_files, read_manifest

LAYOUT = ("entries", "staging", "quarantine", "trash", "usage", "leases", "failures")


@dataclass(frozen=True)
class Built:
    root: Path
    work: Path
    env: dict[str, str]
    hit_options: tuple[str, ...]  # run options whose key is the published entry's
    miss_options: tuple[str, ...]  # run options of a key never compiled
    key: str  # the published entry's digest
    miss_key: str
    failed_key: str


def _options(record: Path, seconds: float, extra: str = "") -> tuple[str, ...]:
    return ("--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=seconds, extra=extra))


def _digest(env: dict[str, str], options: tuple[str, ...]) -> str:
    done = run_cli("key", "-o", "json", *options, "--", *server_argv(8000), env=env)
    assert done.returncode == 0, done.stderr
    digest: str = json.loads(done.stdout)["key"]
    return digest


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    base = tmp_path_factory.mktemp("hostile")
    root = base / "volume"
    root.mkdir()
    with cluster(base / "work", STANDIN_COMPILE_SECONDS="0.1") as pods:
        record = pods.work / "compiler.jsonl"
        hit, miss = _options(record, 0.1), _options(record, 0.2)
        failing = _options(record, 0.1, "--fail-with 3")
        warm = pods.start("warm", server_argv(free_port()), cache_root=root, command="warm", options=hit)
        bad = pods.start("failing", server_argv(free_port()), cache_root=root, options=failing)
        assert (warm.wait_exit(), bad.wait_exit()) == (0, 70), [warm.tail(), bad.tail()]
        env = {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)}
        key, miss_key, failed_key = (_digest(env, o) for o in (hit, miss, failing))
        yield Built(root, pods.work, env, hit, miss, key, miss_key, failed_key)


@dataclass(frozen=True)
class Volume:
    """This test's copy of the cache, a canary outside it, and the pods it may start."""

    built: Built
    root: Path
    canary: Path
    env: dict[str, str]
    pods: Cluster

    @property
    def entry(self) -> Path:
        (entry,) = entry_dirs(self.root)
        return entry


@pytest.fixture
def volume(built: Built, tmp_path: Path) -> Iterator[Volume]:
    root = tmp_path / "volume"
    shutil.copytree(built.root, root, symlinks=True)
    _litter(root, built)
    canary = _canary(tmp_path / "canary")
    with cluster(tmp_path / "pods", STANDIN_COMPILE_SECONDS="0.1") as pods:
        yield Volume(built, root, canary, {**built.env, "CACHEMGR_CACHE_ROOT": str(root)}, pods)


def _litter(root: Path, built: Built) -> None:
    """What a working volume also holds: a dead pod's attempt, a quarantined entry, old trash,
    use records and a lease marker, so every command has something to list, walk and remove."""
    attempt = root / "staging" / ("a" * 32) / "dead-pod.1.abcd"
    (attempt / "artifacts" / "sub").mkdir(parents=True)
    (attempt / "artifacts" / "sub" / "graph.rbln").write_bytes(b"\0" * 100)
    owner = attempt.with_name(attempt.name + ".json")
    owner.write_text(json.dumps({"pod": "dead-pod", "host": "elsewhere", "pid": 1}))
    old = 1_000_000_000.0
    os.utime(owner, (old, old))
    moved = root / "quarantine" / "damaged.20260101T000000Z.abc123"
    (moved / "artifacts").mkdir(parents=True)
    (moved / "artifacts" / "x.rbln").write_bytes(b"x" * 10)
    (root / "trash" / "left.1234").mkdir(parents=True)
    (root / "trash" / "left.1234" / "y").write_bytes(b"y")
    usage = root / "usage" / built.key
    usage.mkdir(parents=True, exist_ok=True)
    (usage / "last-used").touch()
    (root / "leases" / f"{'c' * 32}.lock").write_text("filelock/2\npid=1\nhost=elsewhere\nduration=30\n")


def _canary(path: Path) -> Path:
    """A tree standing for a pod's model weights, with names cachemgr would act on if it got there."""
    for rel in ("weights/model.safetensors", "dead-pod.1.abcd/artifacts/graph.rbln", "nested/deep/file"):
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(rel.encode() * 50)
    for name in ("dead-pod.1.abcd.json", "pod-x.1.json", "last-used", "manifest.json", "summary.json"):
        (path / name).write_text("{}")
    (path / "weights" / "read-only").write_bytes(b"ro")
    (path / "weights" / "read-only").chmod(0o444)
    return path


def snapshot(path: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every name under ``path`` with its mode, mtime and content (or link target): byte for byte."""
    found: dict[str, tuple[int, int, bytes]] = {}
    for current, dirs, files in os.walk(path):
        for name in dirs + files:
            full = Path(current) / name
            st = full.lstat()
            if stat.S_ISLNK(st.st_mode):
                data = os.readlink(full).encode()
            elif stat.S_ISREG(st.st_mode):
                data = full.read_bytes()
            else:
                data = b""
            found[str(full.relative_to(path))] = (st.st_mode, st.st_mtime_ns, data)
    st = path.stat()
    found["."] = (st.st_mode, st.st_mtime_ns, b"")
    return found


# --- where a symlink or a file is planted ------------------------------------------------------


def _plant(volume: Volume, where: str, *, how: str) -> Path:
    """Replace ``where`` (relative to the root) by a symlink to the canary, or by a plain file."""
    spot = volume.root / where
    if spot.is_dir() and not spot.is_symlink():
        shutil.rmtree(spot)
    elif spot.exists() or spot.is_symlink():
        spot.unlink()
    spot.parent.mkdir(parents=True, exist_ok=True)
    if how == "symlink":
        spot.symlink_to(volume.canary, target_is_directory=True)
    else:
        spot.write_text("not a directory")
    return spot


def _children(built: Built) -> dict[str, str]:
    return {
        "entry": "entries/{entry}",
        "staging-key": f"staging/{'a' * 32}",
        "staging-attempt": f"staging/{'a' * 32}/dead-pod.1.abcd",
        "staging-of-the-miss": f"staging/{built.miss_key}",
        "staging-of-the-hit": f"staging/{built.key}",
        "quarantined": "quarantine/damaged.20260101T000000Z.abc123",
        "trashed": "trash/left.1234",
        "usage": f"usage/{built.key}",
        "usage-of-the-miss": f"usage/{built.miss_key}",
        "lease": f"leases/{built.miss_key}.lock",
        "failures": f"failures/{built.failed_key}",
        "failures-of-the-miss": f"failures/{built.miss_key}",
        "artifacts": "entries/{entry}/artifacts",
        "artifacts-depth": "entries/{entry}/artifacts/{deep}",
    }


CHILD_SPOTS = [
    "entry",
    "staging-key",
    "staging-attempt",
    "staging-of-the-miss",
    "staging-of-the-hit",
    "quarantined",
    "trashed",
    "usage",
    "usage-of-the-miss",
    "lease",
    "failures",
    "failures-of-the-miss",
    "artifacts",
    "artifacts-depth",
]


def _where(volume: Volume, spot: str) -> str:
    kind, _, name = spot.partition(":")
    if kind == "layout":
        return name
    entry = volume.entry
    deep = next(p for p in sorted((entry / "artifacts").rglob("*")) if p.is_dir() or p.is_file())
    return _children(volume.built)[name].format(entry=entry.name, deep=deep.relative_to(entry / "artifacts"))


# --- every command --------------------------------------------------------------------------

# The inspection and prune commands of one test run in one process, one ``main()`` call each
# (the real CLI code, minus an interpreter start per command: 40 tests x 12 commands).
DRIVER = """
import contextlib, io, json, sys
from cachemgr.cli.main import main

results = []
for args in json.loads(sys.argv[1]):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(args)
    results.append({"args": args, "code": code, "stderr": err.getvalue()})
print(json.dumps(results))
"""

# Each command and the codes it may answer with something planted: documented ones only.
INSPECT = [(["ls", "-o", "json"], {0, 74}), (["du"], {0, 74}), (["locks"], {0, 74})]
REPAIR = [
    (["verify", "--fix"], {0, 74}),
    (["prune", "--damaged", "--yes"], {0, 74}),
    (["prune", "--stale-staging", "--yes"], {0, 74}),
    (["prune", "--incompatible", "--compiler-version", "0.13.0", "--yes"], {0, 74}),
    (["prune", "--unused-for", "0s", "--yes"], {0, 74}),
    (["prune", "--keep-bytes", "0", "--yes"], {0, 74}),
    (["ls"], {0, 74}),
]


def _check_cli(volume: Volume, commands: list[tuple[list[str], set[int]]]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps([args for args, _ in commands])],
        env=volume.env,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    for result, (args, allowed) in zip(json.loads(done.stdout), commands, strict=True):
        shown = f"cachemgr {' '.join(args)} exited {result['code']}:\n{result['stderr']}"
        assert "Traceback" not in result["stderr"], shown
        assert result["code"] in allowed, shown
        if result["code"] and (args[0], result["code"]) != ("explain", 1):  # explain's 1: not a hit, no error
            assert len(error_lines(result["stderr"])) == 1, shown


def _check_pod(volume: Volume, name: str, command: str, options: tuple[str, ...]) -> None:
    """``run`` or ``warm`` to its end (serving, or an exit); one line in the termination log."""
    pod = volume.pods.start(
        name, server_argv(free_port()), cache_root=volume.root, command=command, options=options
    )
    if command == "run" and pod.wait_phase("serving", "failed", "stopped") == "serving":
        pod.signal(signal.SIGTERM)
        pod.wait_exit()
        return
    code = pod.wait_exit()
    assert "Traceback" not in pod.tail(200), pod.tail()
    if code != 0:
        assert code in {70, 74}, f"{name} exited {code}:\n{pod.tail()}"
        message = (pod.state_dir / "termination-log").read_text()
        assert len(message.strip().splitlines()) == 1, message


def _every_command(volume: Volume) -> None:
    built = volume.built
    explain = ["explain", *built.hit_options, "--", *server_argv(8000)]
    _check_cli(volume, [*INSPECT, (["show", built.key[:12]], {0, 64, 66, 74}), (explain, {0, 1, 74})])
    _check_pod(volume, "warm", "warm", built.miss_options)  # a miss: lease, staging, publish
    _check_pod(volume, "hit", "run", built.hit_options)  # a hit: lookup, use record, view
    _check_cli(volume, REPAIR)


SPOTS = [
    *(pytest.param(f"layout:{name}", "symlink", id=f"{name}-symlink") for name in LAYOUT),
    *(pytest.param(f"layout:{name}", "file", id=f"{name}-file") for name in LAYOUT),
    *(pytest.param(f"child:{name}", "symlink", id=f"child-{name}-symlink") for name in CHILD_SPOTS),
    *(
        pytest.param(f"child:{name}", "file", id=f"child-{name}-file")
        for name in ("entry", "staging-of-the-miss", "usage", "artifacts-depth")
    ),
]


@pytest.mark.parametrize(("spot", "how"), SPOTS)
def test_a_canary_outside_the_root_survives_every_command(volume: Volume, spot: str, how: str) -> None:
    planted = _plant(volume, _where(volume, spot), how=how)
    before = snapshot(volume.canary)
    _every_command(volume)
    assert snapshot(volume.canary) == before, f"something outside the root changed (planted: {planted})"


# --- defect 1: deletes outside the cache root --------------------------------------------------


def test_prune_damaged_refuses_a_quarantine_that_is_a_symlink(volume: Volume) -> None:
    planted = _plant(volume, "quarantine", how="symlink")
    before = snapshot(volume.canary)
    done = run_cli("prune", "--damaged", "--yes", env=volume.env)
    assert snapshot(volume.canary) == before, "prune deleted through quarantine/"
    assert done.returncode == 74, done.stderr
    (line,) = error_lines(done.stderr)
    assert str(planted) in line
    assert "remove the symlink" in line.lower()


def test_prune_stale_staging_never_removes_through_a_symlinked_key_folder(volume: Volume) -> None:
    _plant(volume, f"staging/{'a' * 32}", how="symlink")
    before = snapshot(volume.canary)
    done = run_cli("prune", "--stale-staging", "--yes", "-o", "json", env=volume.env)
    assert snapshot(volume.canary) == before, "prune deleted through staging/<digest>"
    assert done.returncode == 0, done.stderr


def test_a_run_that_misses_never_cleans_staging_through_a_symlink(volume: Volume) -> None:
    planted = _plant(volume, f"staging/{volume.built.miss_key}", how="symlink")
    before = snapshot(volume.canary)
    pod = volume.pods.start(
        "miss", server_argv(free_port()), cache_root=volume.root, options=volume.built.miss_options
    )
    assert pod.wait_exit() == 74, pod.tail()
    assert snapshot(volume.canary) == before, "run's clean_stale_staging deleted through the link"
    message = (pod.state_dir / "termination-log").read_text()
    assert str(planted) in message
    assert "symlink" in message


def _dead_attempt_with_a_folder_for_its_record(volume: Volume, digest: str) -> Path:
    """A dead pod's attempt whose owner record someone replaced by a nested folder."""
    attempt = volume.root / "staging" / digest / "killed.10863.f7b51472"
    (attempt / "artifacts").mkdir(parents=True)
    record = attempt.with_name(attempt.name + ".json")
    (record / "a" / "b").mkdir(parents=True)
    (record / "a" / "b" / "c.json").write_text("{}")
    return record


def test_a_miss_cleans_a_dead_attempt_whose_record_is_a_folder(volume: Volume) -> None:
    record = _dead_attempt_with_a_folder_for_its_record(volume, volume.built.miss_key)
    job = volume.pods.start(
        "warm",
        server_argv(free_port()),
        cache_root=volume.root,
        command="warm",
        options=volume.built.miss_options,
    )
    assert job.wait_exit() == 0, job.tail()
    assert not record.exists()
    assert not record.with_suffix("").exists()


def test_prune_stale_staging_removes_a_dead_attempt_whose_record_is_a_folder(volume: Volume) -> None:
    record = _dead_attempt_with_a_folder_for_its_record(volume, "b" * 32)
    done = run_cli("prune", "--stale-staging", "--yes", env=volume.env)
    assert done.returncode == 0, done.stderr
    assert not record.exists()
    assert not record.with_suffix("").exists()


def test_commands_name_a_layout_directory_replaced_by_a_file(volume: Volume) -> None:
    planted = _plant(volume, "usage", how="file")
    done = run_cli("ls", env=volume.env)
    assert done.returncode == 74, done.stderr
    assert f"{planted} is a regular file" in done.stderr


# --- defect 8: links and special files inside an entry ------------------------------------------


def _symlink_a_directory_of(entry: Path, outside: Path) -> None:
    """Move one artifacts subdirectory out of the volume and link it back: the manifest still
    matches every path, size and hash, through the link."""
    sub = next(p for p in sorted((entry / "artifacts").rglob("*")) if p.is_dir())
    for path in [sub, *sub.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    entry_mode = (entry / "artifacts").stat().st_mode
    (entry / "artifacts").chmod(0o755)
    shutil.move(sub, outside)
    sub.symlink_to(outside, target_is_directory=True)
    (entry / "artifacts").chmod(stat.S_IMODE(entry_mode))


@pytest.fixture
def linked(volume: Volume, tmp_path: Path) -> Volume:
    if not any(p.is_dir() for p in (volume.entry / "artifacts").rglob("*")):
        pytest.fail("the stand-in compiler writes no subdirectory: nothing to link")
    _symlink_a_directory_of(volume.entry, tmp_path / "outside")
    return volume


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_an_entry_with_a_symlinked_directory_fails_the_check(linked: Volume, mode: VerifyMode) -> None:
    # The check a hit makes (store.lookup calls it with the root), and verify's.
    entry = linked.entry
    problems = check_files(entry, read_manifest(entry), mode=mode, within=linked.root)
    assert any("symbolic link" in problem.what for problem in problems), problems


def test_run_moves_an_entry_with_a_symlinked_directory_aside_and_compiles(linked: Volume) -> None:
    outside = snapshot(linked.canary.parent / "outside")
    pod = linked.pods.start(
        "a", server_argv(free_port()), cache_root=linked.root, options=linked.built.hit_options
    )
    assert pod.wait_phase("serving", "failed", "stopped") == "serving", pod.tail()
    events = [e["event"] for e in pod.log_events()]
    assert "entry_damaged" in events
    assert any(
        p.name.startswith(linked.entry.name.split(".")[0]) for p in (linked.root / "quarantine").iterdir()
    )
    assert snapshot(linked.canary.parent / "outside") == outside


def test_verify_finds_a_fifo_inside_an_entry(volume: Volume) -> None:
    artifacts = volume.entry / "artifacts"
    artifacts.chmod(0o755)
    os.mkfifo(artifacts / "pipe")
    done = run_cli("verify", "-o", "json", env=volume.env)
    assert done.returncode == 74, done.stderr
    (item,) = json.loads(done.stdout)["items"]
    assert item["status"] == "damaged"
    assert any("FIFO" in problem for problem in item["problems"]), item


def test_a_planted_giant_manifest_is_damage_not_read_whole(volume: Volume) -> None:
    """A 65 MiB manifest (sparse: it costs the volume nothing) is refused unread, not parsed."""
    manifest = volume.entry / "manifest.json"
    volume.entry.chmod(0o755)
    manifest.unlink()
    with manifest.open("wb") as planted:
        planted.truncate((64 << 20) + 1)
    done = run_cli("verify", "-o", "json", env=volume.env)
    assert done.returncode == 74, done.stderr
    (item,) = json.loads(done.stdout)["items"]
    assert item["status"] == "damaged"
    assert any("larger than 64 MiB" in problem for problem in item["problems"]), item


# --- a manifest naming its files by odd paths -------------------------------------------------


def _list_in_manifest(entry: Path, rel: str) -> None:
    """Add ``rel`` to the entry's manifest, with a real file where the kernel resolves it, so a
    full check of the entry passes: only the spelling of the path is odd."""
    for folder in [entry, *(p for p in entry.rglob("*") if p.is_dir())]:
        folder.chmod(0o755)
    real = entry / os.path.normpath(rel.replace("\0", "").replace("\ud800", ""))
    real.parent.mkdir(parents=True, exist_ok=True)
    if not real.exists():
        real.write_bytes(b"planted")
    st = real.stat()
    manifest = entry / "manifest.json"
    data = json.loads(manifest.read_bytes())
    data["files"].append(
        {"path": rel, "size": st.st_size, "xxh3": hash_file(real), "mtime_ns": st.st_mtime_ns}
    )
    manifest.chmod(0o644)
    manifest.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "odd",
    [
        "artifacts//{outside}",  # the view's join made it absolute: a link and folders outside the view
        "artifacts/./x.rbln",  # the relative link, one level off, dangled
        "artifacts/submodule//deep/x.rbln",
        "artifacts/graph_000.rbln",  # listed twice: the second link failed as 'fix the state dir' (78)
        "artifacts/x\0y",  # a NUL: 'a cachemgr bug' (70)
        "artifacts/x\ud800y",  # a lone surrogate, which no file name decodes to: 70 as well
    ],
)
def test_a_manifest_naming_a_file_by_an_odd_path_is_damage_and_nothing_leaves_the_view(
    volume: Volume, odd: str
) -> None:
    """Someone with write access to the volume spells a file's path as cachemgr never does, with
    a file where the kernel resolves it: even a full check finds the bytes. A pod must take the
    manifest for damage (move the entry aside, compile), never make a link or a folder outside
    its view, nor a link that dangles, nor fail the pod for it."""
    outside = volume.canary.parent / "outside" / "made-by-the-view"
    _list_in_manifest(volume.entry, odd.format(outside=str(outside).lstrip("/")))
    options = [*volume.built.hit_options, "--verify", "full"]
    pod = volume.pods.start("a", server_argv(free_port()), cache_root=volume.root, options=options)
    assert pod.wait_phase("serving", "failed", "stopped") == "serving", pod.tail()
    assert not os.path.lexists(outside.parent), "nothing is made outside the view"
    assert "entry_damaged" in [e["event"] for e in pod.log_events()]
    views = pod.state_dir / "views"
    links = [Path(d) / n for d, _, names in os.walk(views) for n in names if (Path(d) / n).is_symlink()]
    assert all(link.exists() for link in links), [(link, os.readlink(link)) for link in links]


def test_a_file_nested_deeper_than_a_relative_link_can_reach_is_served_through_the_view(
    volume: Volume,
) -> None:
    """A view's links climb one ``../`` per folder to the anchor: 820 folders deep, that way
    alone is past what a link may hold (4 KiB) while the file's absolute path is not. A real
    tree of that depth is odd, not damage: the pod serves it, the file readable in its view."""
    rel = "artifacts/" + "d/" * 820 + "deep.rbln"
    _list_in_manifest(volume.entry, rel)
    pod = volume.pods.start(
        "a", server_argv(free_port()), cache_root=volume.root, options=volume.built.hit_options
    )
    phase = pod.wait_phase("serving", "failed", "stopped")
    assert phase == "serving", (pod.wait_exit(), pod.tail())
    (home,) = (pod.state_dir / "views").iterdir()
    assert (home / "v" / rel.removeprefix("artifacts/")).read_bytes() == b"planted"
    assert "entry_damaged" not in [e["event"] for e in pod.log_events()]


# --- defect 9: manifest.json that is not a file -------------------------------------------------


def _manifest_as_directory(entry: Path) -> None:
    entry.chmod(0o755)
    (entry / "manifest.json").chmod(0o644)
    (entry / "manifest.json").unlink()
    (entry / "manifest.json").mkdir()


def test_a_manifest_that_is_a_directory_is_damage_run_recompiles(volume: Volume) -> None:
    _manifest_as_directory(volume.entry)
    pod = volume.pods.start(
        "a", server_argv(free_port()), cache_root=volume.root, options=volume.built.hit_options
    )
    assert pod.wait_phase("serving", "failed", "stopped") == "serving", pod.tail()


def test_a_manifest_that_is_a_directory_is_fixed_by_verify_fix_as_ls_advises(volume: Volume) -> None:
    _manifest_as_directory(volume.entry)
    rows = run_cli("ls", "-o", "json", env=volume.env)
    assert rows.returncode == 0, rows.stderr
    (row,) = [r for r in json.loads(rows.stdout)["items"] if r["kind"] == "entry"]
    assert row["status"] == "damaged"
    assert "verify --fix" in row["problem"]
    fixed = run_cli("verify", "--fix", env=volume.env)
    assert fixed.returncode == 74, fixed.stderr
    assert "moved 1 to quarantine" in fixed.stderr
    assert entry_dirs(volume.root) == []
    assert run_cli("verify", env=volume.env).returncode == 0


@pytest.mark.parametrize("kind", ["directory", "symlink", "fifo"])
def test_a_manifest_that_is_not_a_file_is_a_manifest_error(volume: Volume, tmp_path: Path, kind: str) -> None:
    entry = volume.entry
    real = tmp_path / "real-manifest.json"
    shutil.copy(entry / "manifest.json", real)
    entry.chmod(0o755)
    (entry / "manifest.json").unlink()
    if kind == "directory":
        (entry / "manifest.json").mkdir()
    elif kind == "symlink":
        (entry / "manifest.json").symlink_to(real)
    else:
        os.mkfifo(entry / "manifest.json")  # must not block the reader
    with pytest.raises(ManifestError):
        read_manifest(entry)


def test_a_compile_that_leaves_a_symlink_in_its_output_is_a_failed_compile(volume: Volume) -> None:
    # Published, it would be damage at every later check: a recompile on every start.
    script = f"mkdir -p {{output_dir}}/a && echo x > {{output_dir}}/a/f && ln -s {volume.canary} {{output_dir}}/a/link"
    options = ("--strategy", "command", "--compile-cmd", f"sh -c {shlex.quote(script)}")
    pod = volume.pods.start("a", server_argv(free_port()), cache_root=volume.root, options=options)
    assert pod.wait_exit() == 70, pod.tail()
    message = (pod.state_dir / "termination-log").read_text()
    assert "a symbolic link at artifacts/a/link" in message
    assert len(entry_dirs(volume.root)) == 1, "nothing new was published"


@pytest.mark.parametrize("command", ["warm", "run"])
def test_a_staging_folder_swapped_as_the_compile_ends_is_refused_not_called_an_empty_compile(
    volume: Volume, command: str
) -> None:
    """A writer swaps ``staging/<digest>`` for a link to a folder outside as the compile ends (here
    the compile command itself, the moment it is done): the refusal of a swapped folder (74,
    naming it), never "the compile command wrote no file" (70), and nothing outside is read into
    an entry or written."""
    script = (
        "echo graph > {output_dir}/graph.rbln && "
        'key=$(dirname "$(dirname "$(readlink -f {output_dir})")") && '
        f'mv "$key" "$key.aside" && ln -s {volume.canary} "$key"'
    )
    options = ("--strategy", "command", "--compile-cmd", f"sh -c {shlex.quote(script)}")
    before = sorted(p.name for p in volume.canary.rglob("*"))
    pod = volume.pods.start(
        "a", server_argv(free_port()), cache_root=volume.root, command=command, options=options
    )
    assert pod.wait_exit() == 74, pod.tail()
    message = (pod.state_dir / "termination-log").read_text()
    assert "staging/" in message, message
    assert "symbolic link" in message, message
    assert sorted(p.name for p in volume.canary.rglob("*")) == before, "the canary changed"
    assert len(entry_dirs(volume.root)) == 1, "nothing new was published"


@pytest.mark.quick
@pytest.mark.parametrize("strategy", ["command", "vllm"])
def test_the_loadable_check_refuses_a_swapped_staging_folder_rather_than_look_through_it(
    tmp_path: Path, strategy: str
) -> None:
    """The check that a compile wrote something loadable, between the compile and the publish,
    looked by path: a swap of ``staging/<digest>`` for a link in that moment (the fuzzer's
    swapper, seed 7070 trial 125: a warm Job exited 70, "the compile command wrote no file")
    made it look into the link's target and call a good compile empty. From the root, it meets
    the link and refuses it (74), as every other step of the attempt does."""
    from cachemgr.runtime.loadable import why_not_loadable

    root = tmp_path / "volume"
    artifacts = root / "staging" / ("d" * 32) / "attempt" / "artifacts"
    (artifacts / "compiled_models" / "m").mkdir(parents=True)
    (artifacts / "compiled_models" / "m" / "rbln_config.json").write_text('{"_compile_cfgs": [{}]}')
    (artifacts / "compiled_models" / "m" / "compiled_model.rbln").write_bytes(b"graph")
    assert why_not_loadable(artifacts, strategy=strategy, within=root) is None
    outside = tmp_path / "outside"
    outside.mkdir()
    key = artifacts.parent.parent
    key.rename(key.with_name("aside"))
    key.symlink_to(outside, target_is_directory=True)
    with pytest.raises(UnsafePathError):
        why_not_loadable(artifacts, strategy=strategy, within=root)
    assert list(outside.iterdir()) == []


# --- records are written by a temporary name nobody can guess --------------------------------------


@pytest.mark.quick
def test_a_record_is_never_written_through_a_planted_temporary_name(tmp_path: Path) -> None:
    """Records went to ``.NAME.PID.tmp`` opened with O_TRUNC: a symlink planted at that name
    (a pod's pid is 1) made every write land outside the root. Temporary names are now random
    and created with O_EXCL|O_NOFOLLOW; a planted link at the record's own name is replaced,
    never written through."""
    root = tmp_path / "root"
    (root / "usage" / "d").mkdir(parents=True)
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    record = root / "usage" / "d" / "pod.json"
    for pid in (1, os.getpid()):
        (record.parent / f".{record.name}.{pid}.tmp").symlink_to(outside)
    (root / "usage" / "d" / "other.json").symlink_to(outside)

    atomic_write_json(record, {"pod": "pod"}, within=root)
    atomic_write_json(root / "usage" / "d" / "other.json", {"pod": "other"}, within=root)

    assert outside.read_text() == "precious\n"
    assert json.loads(record.read_text()) == {"pod": "pod"}
    assert not (root / "usage" / "d" / "other.json").is_symlink()


@pytest.mark.quick
def test_a_record_is_never_written_through_a_planted_folder(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usage").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "usage" / "d").symlink_to(elsewhere)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        atomic_write_json(root / "usage" / "d" / "pod.json", {"pod": "pod"}, within=root)
    assert list(elsewhere.iterdir()) == []


@pytest.mark.quick
def test_a_dangling_cachedir_tag_creates_nothing_outside(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    target = tmp_path / "outside" / "created-by-cachemgr"
    target.parent.mkdir()
    (root / "CACHEDIR.TAG").symlink_to(target)
    open_root(root, create=True)
    assert not target.exists()
    assert (root / "CACHEDIR.TAG").is_symlink(), "left for the operator to see; never followed"


def test_a_server_directory_swapped_for_a_link_publishes_nothing_from_outside(tmp_path: Path) -> None:
    """vllm strategy: the server compiles into staging, then cachemgr hard-links a snapshot of
    it and publishes that. A link swapped in for the staging's ``artifacts/`` made the snapshot
    walk outside the volume: the outside files were published, hard-linked into the entry and
    chmod 0444. The snapshot now walks from directory descriptors and refuses the link."""
    root = tmp_path / "cache"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret-token"
    secret.write_text("token\n")
    mode = secret.stat().st_mode
    with cluster(tmp_path / "work", STANDIN_COMPILE_SECONDS="3") as pods:
        pod = pods.start("a", vllm_argv(free_port(), "--model-impl", "vllm"), cache_root=root)
        pod.wait_phase("compiling")
        (artifacts,) = wait_for(lambda: list((root / "staging").glob("*/*/artifacts")), what="the staging")
        artifacts.rename(artifacts.with_name("artifacts.orig"))
        artifacts.symlink_to(outside)
        wait_for(lambda: pod.phase in {"serving", "failed", "stopped"}, what="the attempt to end")
    published = [p.name for p in (root / "entries").rglob("*")] if (root / "entries").is_dir() else []
    assert "secret-token" not in published
    assert secret.stat().st_nlink == 1, "hard-linked into the volume"
    assert secret.stat().st_mode == mode, "chmod through the link"


@pytest.mark.quick
@pytest.mark.parametrize("exists", [False, True], ids=["new", "existing"])
def test_the_last_used_mark_is_never_touched_through_a_swapped_folder(tmp_path: Path, exists: bool) -> None:
    """``usage/<digest>`` swapped for a link after the use record was written (a second process on
    the volume): the heartbeat file is neither created nor touched in the link's target."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "usage").mkdir(parents=True)
    outside.mkdir()
    if exists:
        (outside / "last-used").write_bytes(b"")
        os.utime(outside / "last-used", (1_000_000, 1_000_000))
    (root / "usage" / "d").symlink_to(outside)
    with pytest.raises(UnsafePathError), safefs.open_dir(root, root / "usage" / "d") as fd:
        touch_at(fd, "last-used")
    assert [p.name for p in outside.iterdir()] == (["last-used"] if exists else [])
    if exists:
        assert (outside / "last-used").stat().st_mtime == 1_000_000
    (root / "usage" / "d").unlink()
    (root / "usage" / "d").mkdir()
    with safefs.open_dir(root, root / "usage" / "d") as fd:  # the real folder: made, then refreshed
        touch_at(fd, "last-used")
    assert (root / "usage" / "d" / "last-used").is_file()


def test_a_trashed_folder_swapped_for_a_link_is_not_read_through(tmp_path: Path) -> None:
    """prune reads a trash leftover's key to keep it for a live user: from its folder reached
    without a link, so a link swapped in after the listing cannot make it read outside the root."""
    from cachemgr.ops.prune_plan import _trashed_key

    (tmp_path / "cache").mkdir()
    root = open_root(tmp_path / "cache", create=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    atomic_write_json(outside / "summary.json", {"key": "f" * 32})
    real = root.trash / "real"
    real.mkdir()
    atomic_write_json(real / "summary.json", {"key": "a" * 32})
    assert _trashed_key(root, real) == "a" * 32
    (root.trash / "swapped").symlink_to(outside)
    assert _trashed_key(root, root.trash / "swapped") is None


# A pod whose entry is swapped for a link each time it comes to use it (the swap is real, on the
# volume, as the fuzzer's swapper makes it; only its moment is fixed, by wrapping the runner's use
# of an entry).
SWAPPING_RUN = """
import os, sys
from pathlib import Path
from cachemgr.cli.main import main
from cachemgr.runtime import runner

real_use = runner.Runner._use
swaps = []

def _use(self, root, key, found):
    entry = Path(found.path)
    if entry.is_dir() and not entry.is_symlink():
        aside = entry.with_name(f".swapped-{len(swaps)}")
        os.rename(entry, aside)
        os.symlink(aside / "artifacts", entry)  # a folder, but no entry: no manifest
        swaps.append(aside)
    return real_use(self, root, key, found)

runner.Runner._use = _use
sys.exit(main(sys.argv[1:]))
"""


def test_an_entry_that_keeps_breaking_as_the_pod_uses_it_is_the_volume_not_a_failed_compile(
    tmp_path: Path,
) -> None:
    """Every entry the pod comes to use is swapped for a link: each is set aside as damaged, the
    pod compiles again, and after its last lookup it stops with 74 (the volume) and a line saying
    what to do; it exited 70, "compile-failed", though every compile had succeeded (fuzzer seed
    7474 trial 183)."""
    root = tmp_path / "volume"
    root.mkdir()  # the PVC's mount
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(tmp_path / "c.jsonl", seconds=None)]
    with cluster(tmp_path / "work") as pods:  # a pod's environment: role, NPU, compiler, JSON logs
        env = {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root), "CACHEMGR_STATE_DIR": str(tmp_path / "st")}
        env.pop("CACHEMGR_REMOTE", None)
        # Its own session: were it to serve (the defect's opposite), the kill at the deadline
        # takes its server too, not the pod's process alone.
        pod = subprocess.Popen(
            [sys.executable, "-c", SWAPPING_RUN, "run", *options, "--", *server_argv(free_port())],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            _, stderr = pod.communicate(timeout=DEADLINE)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pod.pid, signal.SIGKILL)
            pod.wait()
    events = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    [failed] = [e for e in events if e.get("event") == "failed"]
    assert (pod.returncode, failed["reason"]) == (74, "volume"), stderr[-3000:]
    assert "kept disappearing or breaking after 4 lookups" in failed["message"]
    assert "'cachemgr ls' lists what was set aside" in failed["message"]
    # Its publishes met the link at their use; a later lookup set a link aside as damaged.
    assert [e for e in events if e.get("event") == "entry_damaged"], stderr[-3000:]
    assert len([e for e in events if e.get("event") == "published"]) >= 2, stderr[-3000:]
