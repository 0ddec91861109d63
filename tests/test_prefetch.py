"""Read-ahead on a hit (issue 25): the parallel reader, the memory budget, and the pod's prefetch.

- the reader reads every byte of an entry in the server's order, through descriptors that refuse
  a symlink at any level, a FIFO without blocking, and a file of the wrong size; a chunk
  callback sees each file's bytes in order (a hash can ride on the read);
- it stops on its stop flag, at its memory budget, and leaves what the server has read itself;
- the budget is a fraction of the room under the tightest cgroup limit (v2 and v1) and the
  node's, tested against fake cgroup trees, against the real files in /sys, and with a real
  memory cgroup holding a reader below an entry's size (root, cgroup v1 or v2 writable);
- a pod on a hit logs one ``prefetch_done`` after its launch; ``--prefetch off`` and
  ``CACHEMGR_PREFETCH=off`` turn it off; SIGTERM stops it on a slow volume.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import xxhash
from cachemgr_testkit.podlib import Cluster, wait_for
from cachemgr_testkit.scenarios import command_key

from cachemgr.core import membudget, safefs
from cachemgr.runtime.prefetch import ServerReads
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import open_root
from cachemgr.volume.manifest import ARTIFACTS, FileRecord, read_manifest
from cachemgr.volume.reader import READ_CHUNK, SEGMENT, hash_entry, loader_order, mechanism_for, read_entry
from cachemgr.volume.store import create_staging, publish

IDENTITY = PodIdentity(pod="prefetch-test", node="node-a", host="host", pid=os.getpid())
MiB = 1 << 20


class Flag:
    def __init__(self) -> None:
        self.value = False

    def is_set(self) -> bool:
        return self.value


def _publish(root: Path, files: dict[str, int]) -> Path:
    """An entry published by library call, with artifacts of the given sizes (random bytes)."""
    root.mkdir(exist_ok=True)
    volume = open_root(root, create=True)
    key = command_key()
    staging = create_staging(volume, key, IDENTITY)
    for name, size in files.items():
        path = staging.artifacts / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as out:
            for start in range(0, size, 4 * MiB):
                out.write(os.urandom(min(4 * MiB, size - start)))
    return publish(volume, staging, key, identity=IDENTITY, compile_seconds=1.0, strategy="command").path


def _drop_cache(entry: Path) -> None:
    """The entry's pages out of the page cache (its own files only, not the machine's)."""
    for path in entry.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _artifacts(entry: Path) -> tuple[list[FileRecord], list[int]]:
    files = list(read_manifest(entry).files)
    return files, loader_order(files, prefix=ARTIFACTS + "/")


# --- the order and the mechanism -----------------------------------------------------------------


@pytest.mark.quick
def test_the_loader_order_is_configs_first_then_paths_in_natural_order() -> None:
    files = [
        FileRecord("key.json", 100, "x"),
        FileRecord("artifacts/rank10/mega_cache.bin", 5 * MiB, "x"),
        FileRecord("artifacts/rank2/mega_cache.bin", 5 * MiB, "x"),
        FileRecord("artifacts/graph_001.rbln", 3 * MiB, "x"),
        FileRecord("artifacts/rbln_config.json", 900, "x"),
        FileRecord("artifacts/sub/graph_000.rbln", 3 * MiB, "x"),
    ]
    order = [files[i].path for i in loader_order(files, prefix="artifacts/")]
    assert order == [
        "artifacts/rbln_config.json",
        "artifacts/graph_001.rbln",
        "artifacts/rank2/mega_cache.bin",
        "artifacts/rank10/mega_cache.bin",
        "artifacts/sub/graph_000.rbln",
    ]


@pytest.mark.quick
def test_the_mechanism_is_advice_on_local_disks_reads_on_fuse_and_nothing_in_memory() -> None:
    assert mechanism_for("ext4") == "advise"
    assert mechanism_for("xfs") == "advise"
    assert mechanism_for("fuse.juicefs") == "read"
    assert mechanism_for("nfs4") == "read"
    assert mechanism_for("ceph") == "read"
    assert mechanism_for(None) == "read"
    assert mechanism_for("tmpfs") is None


# --- the reader ----------------------------------------------------------------------------------


@pytest.mark.quick
def test_the_reader_reads_every_byte_and_a_hash_rides_on_the_read(tmp_path: Path) -> None:
    sizes = {"rbln_config.json": 700, "graph_000.rbln": 3 * MiB + 5, "sub/graph_001.rbln": 2 * MiB, "e": 0}
    entry = _publish(tmp_path, sizes)
    files, order = _artifacts(entry)
    digests: dict[int, Any] = {}
    offsets: dict[int, int] = {}

    def hash_chunk(index: int, offset: int, data: memoryview) -> None:
        assert offsets.get(index, 0) == offset  # in file order, from one worker
        digests.setdefault(index, xxhash.xxh3_128()).update(data)
        offsets[index] = offset + len(data)

    result = read_entry(
        entry, files, order, within=tmp_path, mechanism="read", workers=3, on_chunk=hash_chunk
    )
    assert result.bytes == sum(sizes.values())
    assert result.files_done == set(order)
    assert result.stopped is None
    assert not result.skipped
    for index in order:
        want = files[index].xxh3
        got = digests[index].hexdigest() if index in digests else xxhash.xxh3_128_hexdigest(b"")
        assert got == want, files[index].path


@pytest.mark.quick
def test_a_large_file_is_shared_among_workers_and_advice_brings_it_all(tmp_path: Path) -> None:
    entry = _publish(tmp_path, {"mega_cache.bin": SEGMENT * 2 + 3 * MiB})
    files, order = _artifacts(entry)
    _drop_cache(entry)
    for mechanism in ("advise", "read"):
        result = read_entry(entry, files, order, within=tmp_path, mechanism=mechanism, workers=4)  # type: ignore[arg-type]
        assert result.bytes == SEGMENT * 2 + 3 * MiB, mechanism
        assert result.files_done == set(order)


@pytest.mark.quick
def test_the_reader_refuses_links_fifos_and_changed_files_and_reads_the_rest(tmp_path: Path) -> None:
    entry = _publish(tmp_path, {"a.rbln": 64 << 10, "b.rbln": 64 << 10, "c.rbln": 64 << 10, "d/e.rbln": 1000})
    files, order = _artifacts(entry)
    outside = tmp_path / "outside-secret"
    outside.write_bytes(b"s" * (64 << 10))
    art = entry / ARTIFACTS
    os.chmod(art, 0o755)
    (art / "a.rbln").unlink()
    (art / "a.rbln").symlink_to(outside)  # same size: only the refusal keeps it out
    (art / "b.rbln").unlink()
    os.mkfifo(art / "b.rbln")  # would block a reader that opened it plainly
    os.chmod(art / "c.rbln", 0o644)
    with (art / "c.rbln").open("ab") as grow:
        grow.write(b"more")
    os.chmod(art / "d", 0o755)
    (art / "d" / "e.rbln").unlink()
    os.rmdir(art / "d")
    (art / "d").symlink_to(tmp_path)  # a folder swapped for a link
    seen: list[str] = []
    result = read_entry(
        entry,
        files,
        order,
        within=tmp_path,
        mechanism="read",
        workers=2,
        on_chunk=lambda i, _o, data: seen.append(files[i].path),
    )
    assert result.skipped == {"not_a_regular_file": 2, "size_changed": 1, "unsafe_path": 1}
    assert result.bytes == 0
    assert not seen
    assert result.files_done == set()


@pytest.mark.quick
def test_an_entry_reached_through_a_link_is_refused(tmp_path: Path) -> None:
    entry = _publish(tmp_path, {"a.rbln": 1000})
    files, order = _artifacts(entry)
    elsewhere = tmp_path / "elsewhere"
    entry.rename(elsewhere)
    entry.symlink_to(elsewhere)
    with pytest.raises(safefs.UnsafePathError):
        read_entry(entry, files, order, within=tmp_path, mechanism="read", workers=1)


@pytest.mark.quick
def test_the_reader_stops_on_its_flag(tmp_path: Path) -> None:
    entry = _publish(tmp_path, {f"g{i}.rbln": 2 * MiB for i in range(6)})
    files, order = _artifacts(entry)
    stop = Flag()

    def stop_after_first(_index: int, _offset: int, _data: memoryview) -> None:
        stop.value = True

    result = read_entry(
        entry,
        files,
        order,
        within=tmp_path,
        mechanism="read",
        workers=1,
        stop=stop,
        on_chunk=stop_after_first,
    )
    assert result.stopped == "stop"
    assert result.bytes == READ_CHUNK  # the chunk in hand, then nothing more
    assert not result.skipped  # stopped files are not "skipped" for a reason of their own


@pytest.mark.quick
def test_the_reader_stays_within_its_budget(tmp_path: Path) -> None:
    entry = _publish(tmp_path, {f"g{i}.rbln": 4 * MiB for i in range(8)})
    files, order = _artifacts(entry)
    budget = membudget.MemoryBudget(bytes=10 * MiB, ceiling=None, binding="test")
    result = read_entry(entry, files, order, within=tmp_path, mechanism="read", workers=4, budget=budget)
    assert result.stopped == "budget"
    assert result.bytes == 10 * MiB  # never a chunk more, whatever the workers
    result = read_entry(entry, files, order, within=tmp_path, mechanism="read", workers=1, budget=budget)
    assert result.files_done == set(order[:2])  # the first files whole, in the server's order


@pytest.mark.quick
def test_the_reader_leaves_what_the_server_has_read(tmp_path: Path) -> None:
    entry = _publish(tmp_path, {"a.rbln": 3 * MiB, "b.rbln": 3 * MiB, "c.rbln": 3 * MiB})
    files, order = _artifacts(entry)
    a, b, _c = order
    reached = {a: 3 * MiB, b: 2 * MiB}  # a read whole by the server, b two thirds
    result = read_entry(
        entry, files, order, within=tmp_path, mechanism="read", workers=1, skip=lambda i: reached.get(i, 0)
    )
    assert result.skipped == {"server_read": 1}
    assert result.bytes == 1 * MiB + 3 * MiB


# --- the memory budget ---------------------------------------------------------------------------


def _cgroup(base: Path, rel: str, files: dict[str, str]) -> None:
    folder = base / rel
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (folder / name).write_text(value + "\n")


@pytest.mark.quick
def test_the_budget_is_a_fraction_of_the_tightest_room_v2(tmp_path: Path) -> None:
    fs, proc, meminfo = tmp_path / "cg", tmp_path / "self-cgroup", tmp_path / "meminfo"
    (fs / "cgroup.controllers").parent.mkdir(parents=True)
    (fs / "cgroup.controllers").write_text("memory\n")
    _cgroup(fs, "kubepods", {"memory.max": str(1000 * MiB), "memory.current": str(900 * MiB)})
    _cgroup(fs, "kubepods/pod1", {"memory.max": str(800 * MiB), "memory.current": str(300 * MiB)})
    _cgroup(fs, "kubepods/pod1/ctr", {"memory.max": "max", "memory.current": str(200 * MiB)})
    proc.write_text("0::/kubepods/pod1/ctr\n")
    meminfo.write_text("MemTotal: 99999999 kB\nMemAvailable: 2048000 kB\n")
    got = membudget.budget(fraction=0.5, cgroup_fs=fs, proc_cgroup=proc, meminfo=meminfo)
    # kubepods binds: 100 MiB of room (its children's usage counts in it), half of it is ours.
    assert got.bytes == 50 * MiB
    assert got.binding.endswith("kubepods/memory.max")
    assert got.ceiling == 950 * MiB  # its limit minus the other half: the headroom
    assert got.watch is not None
    assert got.watch.directory == fs / "kubepods"
    assert not got.exceeded()
    (fs / "kubepods" / "memory.current").write_text(str(951 * MiB))
    assert got.exceeded()


@pytest.mark.quick
def test_the_budget_reads_v1_and_a_container_without_a_cgroup_namespace(tmp_path: Path) -> None:
    fs, proc, meminfo = tmp_path / "cg", tmp_path / "self-cgroup", tmp_path / "meminfo"
    # The host's path is not under the container's mount: the mount is the pod's own cgroup.
    _cgroup(fs, "memory", {"memory.limit_in_bytes": str(512 * MiB), "memory.usage_in_bytes": str(112 * MiB)})
    proc.write_text("12:memory:/kubepods/burstable/podX/abc\n11:cpu,cpuacct:/kubepods\n0::/\n")
    meminfo.write_text("MemAvailable: 99999999 kB\n")
    got = membudget.budget(fraction=0.25, cgroup_fs=fs, proc_cgroup=proc, meminfo=meminfo)
    assert got.bytes == 100 * MiB
    assert got.ceiling == 512 * MiB - 300 * MiB
    # No cgroup limit at all (9223372036854771712 is v1's "none"): the node's MemAvailable binds.
    (fs / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    got = membudget.budget(fraction=0.5, cgroup_fs=fs, proc_cgroup=proc, meminfo=meminfo)
    assert got.binding == "node MemAvailable"
    assert got.ceiling is None
    assert got.bytes == 99999999 * 1024 // 2


@pytest.mark.quick
def test_the_budget_against_this_machines_own_files() -> None:
    """The arithmetic against the real /proc/self/cgroup, /sys/fs/cgroup and /proc/meminfo."""
    got = membudget.budget(fraction=0.5)
    rooms = [limit.room for f in membudget.cgroup_chain() if (limit := f.read()) is not None]
    available = membudget.node_available()
    assert available is not None  # Linux has had MemAvailable since 3.14
    tightest = min([*rooms, available])
    # MemAvailable moves between the two reads on a busy machine: a few percent at most.
    assert abs(got.bytes - tightest // 2) <= tightest // 40
    assert 0 < got.bytes < available


def _cgroup_v1_memory() -> Path | None:
    """This process's v1 memory cgroup, if the v1 memory controller is mounted here."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            return folder if folder.is_dir() else Path("/sys/fs/cgroup/memory")
    return None


def _child_cgroup(tmp_path: Path, limit: int) -> tuple[Path, str]:
    """A child memory cgroup of our own with ``limit``: its directory and its peak usage file."""
    name = f"cachemgr-test-{os.getpid()}-{tmp_path.name}"
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists() and "memory" in (v2 / "cgroup.subtree_control").read_text():
        own = Path(Path("/proc/self/cgroup").read_text().split("::", 1)[1].strip().lstrip("/"))
        folder = v2 / own.parent / name  # a sibling: v2 allows no processes in an inner cgroup
        names = ("memory.max", "memory.current", "memory.peak")
    else:
        base = _cgroup_v1_memory()
        if base is None or os.geteuid() != 0:
            pytest.skip("no writable memory cgroup (cgroup v2 memory controller or v1 memory, as root)")
        folder = base / name
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.max_usage_in_bytes")
    try:
        folder.mkdir()
        (folder / names[0]).write_text(str(limit))
    except OSError as error:
        pytest.skip(f"cannot make a memory cgroup at {folder}: {error}")
    return folder, names[2]


READER_IN_CGROUP = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    procs, root, entry = sys.argv[1:4]
    Path(procs).write_text(str(os.getpid()))  # into the test's memory cgroup, before any read
    from cachemgr.core import membudget
    from cachemgr.volume.manifest import ARTIFACTS, read_manifest
    from cachemgr.volume.reader import loader_order, read_entry
    budget = membudget.budget()
    files = list(read_manifest(Path(entry)).files)
    order = loader_order(files, prefix=ARTIFACTS + "/")
    result = read_entry(Path(entry), files, order, within=Path(root), mechanism="read", workers=4, budget=budget)
    print(json.dumps({"budget": budget.to_json(), "bytes": result.bytes, "stopped": result.stopped,
                      "done": len(result.files_done), "watch": str(budget.watch.directory if budget.watch else None)}))
    """
)


def test_in_a_memory_cgroup_below_the_entry_size_the_read_stays_within_its_budget(tmp_path: Path) -> None:
    limit = 160 * MiB
    entry = _publish(tmp_path / "vol", {f"graph_{i:03d}.rbln": 16 * MiB for i in range(16)})  # 256 MiB
    _drop_cache(entry)
    folder, peak_file = _child_cgroup(tmp_path, limit)
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                READER_IN_CGROUP,
                str(folder / "cgroup.procs"),
                str(tmp_path / "vol"),
                str(entry),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout)
        peak = int((folder / peak_file).read_text())
    finally:
        wait_for(
            lambda: not (folder / "cgroup.procs").read_text().strip(), what="the reader to leave its cgroup"
        )
        folder.rmdir()
    assert got["watch"] == str(folder), got  # the child's own cgroup bound it, not the node
    assert got["stopped"] in {"budget", "memory"}, got
    assert 0 < got["bytes"] < 256 * MiB  # it still helps, and it stopped short of the limit
    ceiling = got["budget"]["ceiling"]
    # The reader keeps what it has in flight below the ceiling too: past it by no more than the
    # interpreter's own allocations between two looks at the usage.
    assert peak <= ceiling + 2 * MiB, (peak, ceiling, limit)
    assert ceiling < limit


# --- the server's own reads, from /proc ----------------------------------------------------------


SERVER_READS_ONE = textwrap.dedent(
    """
    import sys, time
    with open(sys.argv[1], "rb") as f:
        while f.read(1 << 20):
            pass
        print("read", flush=True)
        time.sleep(60)
    """
)


def test_a_file_the_server_has_read_is_left_by_the_read_ahead(tmp_path: Path) -> None:
    entry = _publish(tmp_path, {"a.rbln": 2 * MiB, "b.rbln": 2 * MiB})
    files, order = _artifacts(entry)
    first = files[order[0]]
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER_READS_ONE, str(entry / first.path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline() == "read\n"
        seen = ServerReads(server.pid, entry, files)
        seen.look()
        assert seen.reached(order[0]) == first.size
        assert seen.reached(order[1]) == 0
        result = read_entry(
            entry, files, order, within=tmp_path, mechanism="read", workers=2, skip=seen.reached
        )
    finally:
        server.kill()
        server.wait(timeout=10)
        if server.stdout is not None:
            server.stdout.close()
    assert result.skipped == {"server_read": 1}
    assert result.bytes == files[order[1]].size


# --- pods ----------------------------------------------------------------------------------------

LOADER = textwrap.dedent(
    """
    import os, sys, time
    artifacts, out = sys.argv[1], os.environ["LOADER_OUT"]  # not in argv: argv is in the key
    open(out + ".started", "w").close()
    time.sleep(float(os.environ.get("LOADER_INIT", "0.5")))  # the engine set-up before the load
    total = 0
    for folder, _, names in sorted(os.walk(artifacts)):
        for name in sorted(names):
            with open(os.path.join(folder, name), "rb") as f:
                while chunk := f.read(1 << 20):
                    total += len(chunk)
    open(out, "w").write(str(total))
    time.sleep(float(os.environ.get("LOADER_SERVE", "0")))
    """
)
COMPILE = f"{sys.executable} -m cachemgr_standin.compiler --output-dir {{output_dir}} --files 6 --bytes 12M --seconds 0.1"
COMMAND = ("--strategy", "command", "--compile-cmd", COMPILE)


def _argv(pods: Cluster) -> list[str]:
    loader = pods.work / "loader.py"
    loader.write_text(LOADER)
    return [sys.executable, str(loader), "{artifact_dir}"]


def _warm(pods: Cluster, root: Path) -> None:
    """Publish the entry the pods of these tests hit (a warm Job)."""
    warm = pods.start(f"warm-{len(pods.pods)}", _argv(pods), cache_root=root, command="warm", options=COMMAND)
    assert warm.wait_exit() == 0, warm.tail()


def _start(
    pods: Cluster, root: Path, name: str, *, options: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> Any:
    """A pod whose server is the loader: it initialises, then reads every file whole."""
    loader_env = {"LOADER_OUT": str(pods.work / f"{name}.loaded"), **(env or {})}
    return pods.start(name, _argv(pods), cache_root=root, options=(*COMMAND, *options), env=loader_env)


def _hit_pod(
    pods: Cluster, root: Path, name: str, *, options: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> Any:
    """A pod on a hit: the entry is published first."""
    _warm(pods, root)
    return _start(pods, root, name, options=options, env=env)


def _events(pod: Any, event: str) -> list[dict[str, Any]]:
    return [e for e in pod.log_events() if e.get("event") == event]


def test_a_hit_reads_ahead_after_the_launch_and_logs_one_prefetch_done(pods: Cluster, root: Path) -> None:
    pod = _hit_pod(pods, root, "hit", env={"LOADER_SERVE": "30"})
    done = wait_for(lambda: _events(pod, "prefetch_done"), what="prefetch_done")
    assert len(done) == 1
    assert not _events(pod, "published")  # a hit: the entry came from the warm Job
    (event,) = done
    assert event["stopped"] == "done", event
    assert event["bytes"] == event["entry_bytes"] > 12_000_000, event
    assert event["mechanism"] in {"advise", "read"}
    assert event["files_done"] == event["files"]
    names = [e["event"] for e in pod.log_events()]
    assert names.index("launching") < names.index("prefetch_done")  # after the spawn, never before
    wait_for((pods.work / "hit.loaded").exists, what="the server's load")
    pod.signal(signal.SIGTERM)
    pod.wait_exit()
    assert len(_events(pod, "prefetch_done")) == 1


@pytest.mark.parametrize("how", ["flag", "env"])
def test_prefetch_off_turns_it_off(pods: Cluster, root: Path, how: str) -> None:
    options = ("--prefetch", "off") if how == "flag" else ()
    env = {"CACHEMGR_PREFETCH": "off"} if how == "env" else {}
    pod = _hit_pod(pods, root, f"off-{how}", options=options, env=env)
    assert pod.wait_exit() == 0, pod.tail()
    assert (pods.work / f"off-{how}.loaded").exists()
    assert not _events(pod, "prefetch_done")


def test_a_prefetch_value_other_than_auto_or_off_is_a_usage_error(pods: Cluster, root: Path) -> None:
    pod = _hit_pod(pods, root, "bad", env={"CACHEMGR_PREFETCH": "sometimes"})
    assert pod.wait_exit() == 64
    assert "must be auto or off" in pod.tail()


@pytest.mark.juicefs
def test_sigterm_stops_the_read_ahead_on_a_slow_volume(pods: Cluster, juicefs_volume_factory: Any) -> None:
    """JuiceFS whose object store delivers 1 MB/s: the read-ahead of 12 MiB would take 12 s."""
    mounts = juicefs_volume_factory(mounts=2, extra_mount_args=["--download-limit=8"])  # Mbps
    _warm(pods, mounts[0])  # written through one node: the other's page cache is cold
    pod = _start(pods, mounts[1], "slow", env={"LOADER_INIT": "60"})
    wait_for((pods.work / "slow.loaded.started").exists, what="the server's start")
    sent = time.monotonic()
    pod.signal(signal.SIGTERM)
    code = pod.wait_exit(timeout=30)
    took = time.monotonic() - sent
    assert code == 128 + signal.SIGTERM, pod.tail()
    assert not _events(pod, "published")  # a hit: its bytes are in the other node's caches only
    (event,) = _events(pod, "prefetch_done")
    assert event["stopped"] == "stop", event
    assert event["bytes"] < event["entry_bytes"], event
    assert took < 8, took  # within a chunk or two at 1 MB/s, not the 12 s a whole read takes


@pytest.mark.quick
def test_one_parallel_pass_hashes_every_file_as_its_manifest_does(tmp_path: Path) -> None:
    """What a content check before the launch (issue 22's trusting modes) reads through."""
    entry = _publish(tmp_path, {"a.rbln": 3 * MiB + 1, "b/c.rbln": 5000, "empty": 0})
    files, order = _artifacts(entry)
    digests, result = hash_entry(entry, files, order, within=tmp_path, workers=3)
    assert set(digests) == set(order) == result.files_done
    assert all(digests[i] == files[i].xxh3 for i in order)
    os.chmod(entry / ARTIFACTS, 0o755)
    (entry / ARTIFACTS / "a.rbln").unlink()
    (entry / ARTIFACTS / "a.rbln").symlink_to(tmp_path)  # a link is left, never hashed
    digests, result = hash_entry(entry, files, order, within=tmp_path, workers=3)
    assert len(digests) == 2
    assert result.skipped == {"not_a_regular_file": 1}
