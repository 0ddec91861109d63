"""Shared pytest fixtures for the cachemgr tests.

Layout: one section per concern, each with a short header. Add new fixtures in a section of their own
(or to the one they belong to) and keep the heavy lifting in helper modules, as cachemgr_testkit.mounts does
for real filesystems.

Real filesystems
    juicefs_mounts          two mounts of one fresh JuiceFS volume: two "nodes" sharing a volume.
    juicefs_volume_factory  more control: juicefs_volume_factory(mounts=3, quota_bytes=16 << 20).
    seaweedfs_mounts        two `weed mount`s of one fresh SeaweedFS store: nodes where flock does
                            nothing and a create reaches the other mount only through its metadata
                            subscription (the O_EXCL race of issue 12).
    tmpfs_small             tmpfs_small(size_bytes) -> a fresh tmpfs of that size (fills up: ENOSPC).
    readonly_bind           readonly_bind(source) -> a read-only bind mount of it (a PVC mounted readOnly).
    bind_mounts             bind_mounts(source, target, read_only) -> target: the kubelet's mounts of a
                            pod's PVC (readOnly, subPath), for cachemgr_testkit.kube.Node(bind=...).
Tests using them are marked `juicefs` / `seaweedfs` / `tmpfs` / `bind` automatically (select with -m, e.g. -m "not juicefs").
Where mounting is impossible (not root, no /dev/fuse, no juicefs or weed binary) they skip with the reason;
with CACHEMGR_REQUIRE_MOUNTS=1 (CI sets it) they fail instead, so CI never skips them silently.

The helpers themselves (pods, mounts, the S3 server, scenarios, the manifests' harness) are the
package cachemgr_testkit (testkit/, installed by ``scripts/install .venv test``); tests import it,
never each other. Tiers and parallel runs: tests/README.md.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.mounts import (
    REQUIRE_MOUNTS_ENV,
    juicefs_volume,
    mount_unavailable_reason,
    readonly_bind,
    seaweedfs_volume,
    tmpfs_volume,
    writable_bind,
)
from cachemgr_testkit.podlib import Cluster, cluster, sweep_faketime_shm
from cachemgr_testkit.s3server import S3Server, require_s3, s3_server

# --------------------------------------------------------------------------------------------------
# Real filesystems (cachemgr_testkit.mounts)

# fixture name -> marker name; pytest_collection_modifyitems marks every test that uses the fixture.
_MOUNT_FIXTURE_MARKERS = {
    "juicefs_mounts": "juicefs",
    "juicefs_volume_factory": "juicefs",
    "seaweedfs_mounts": "seaweedfs",
    "tmpfs_small": "tmpfs",
    "readonly_bind": "bind",
    "bind_mounts": "bind",
}


# Parallel runs (scripts/test: pytest-xdist, --dist loadgroup) spread the tests one by one over the
# workers, except these modules, each kept on one worker: a module-scoped fixture there is costly or
# gathers the whole module's results, and would otherwise be made once per worker.
_ONE_WORKER_MODULES = {
    "test_campaign.py": "the campaign's totals and its clean-compile references: one summary",
    "test_deploy.py": "the chart's workloads, rendered once by helm",
    "test_fuzz.py": "the fuzzer's golden volume and S3 server, and its totals: one summary",
    "test_inspect.py": "one volume built by seven warm Jobs",
    "test_remote.py": "one S3 server (weed mini)",
    "test_trust_remote.py": "one S3 server (weed mini)",
}


@pytest.hookimpl(optionalhook=True)  # an xdist hook, on the controller
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """--dist loadgroup with the groups above. Not xdist_group marks: xdist 3.8 groups by renaming
    ``item._nodeid``, which pytest 9.2 no longer reads, so its groups silently spread."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling  # only under xdist

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if Path(path).name in _ONE_WORKER_MODULES else nodeid

    return ModuleGroups(config, log)


@pytest.hookimpl(optionalhook=True)  # an xdist hook, on the controller
def pytest_testnodedown(node: Any, error: object) -> None:
    """Lines a worker kept for the run's terminal (the campaign's seed and totals), as it ends."""
    reporter = node.config.pluginmanager.get_plugin("terminalreporter")
    for line in getattr(node, "workeroutput", {}).get("terminal_lines", []):
        if reporter is not None:
            reporter.write_line(line)


# The real server's long form (marker realserver_long): minutes each, by hand only (docs/development.md).
REALSERVER_LONG_ENV = "CACHEMGR_REALSERVER_LONG"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    asked = "realserver_long" in (config.option.markexpr or "") or os.environ.get(REALSERVER_LONG_ENV) == "1"
    if not asked:
        long_form = [item for item in items if item.get_closest_marker("realserver_long")]
        if long_form:
            config.hook.pytest_deselected(items=long_form)
            items[:] = [item for item in items if not item.get_closest_marker("realserver_long")]
    for item in items:
        for fixture, marker in _MOUNT_FIXTURE_MARKERS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)
    # The real server's tests (minutes each, mostly waiting on its start) go out to the workers
    # first, so that they run beside the rest of the suite instead of after it.
    items.sort(key=lambda item: item.get_closest_marker("realserver") is None)


def require_mount(kind: str) -> None:
    """Skip the test if a `kind` ('juicefs', 'seaweedfs' or 'tmpfs') volume cannot be mounted here; fail instead
    if CACHEMGR_REQUIRE_MOUNTS=1."""
    reason = mount_unavailable_reason(kind)
    if reason is None:
        return
    if os.environ.get(REQUIRE_MOUNTS_ENV) == "1":
        pytest.fail(f"{REQUIRE_MOUNTS_ENV}=1 but a {kind} volume cannot be mounted: {reason}", pytrace=False)
    pytest.skip(f"{kind} unavailable: {reason}")


@pytest.fixture
def juicefs_volume_factory(tmp_path: Path) -> Iterator[Callable[..., list[Path]]]:
    """juicefs_volume_factory(**options) -> mount points; options as for mounts.juicefs_volume.

    Each call makes a fresh volume under tmp_path; all are unmounted and removed after the test.
    """
    require_mount("juicefs")
    with ExitStack() as stack:
        count = 0

        def make(**options: Any) -> list[Path]:
            nonlocal count
            count += 1
            return stack.enter_context(juicefs_volume(tmp_path / f"juicefs{count}", **options))

        yield make


@pytest.fixture
def juicefs_mounts(juicefs_volume_factory: Callable[..., list[Path]]) -> list[Path]:
    """Two mounts of one fresh JuiceFS volume, as [mount1, mount2]: two nodes sharing a volume."""
    return juicefs_volume_factory(mounts=2)


@pytest.fixture
def seaweedfs_mounts(tmp_path: Path) -> Iterator[list[Path]]:
    """Two mounts of one fresh SeaweedFS store, as [mount1, mount2]; unmounted and removed after."""
    require_mount("seaweedfs")
    with seaweedfs_volume(tmp_path / "seaweedfs", mounts=2) as points:
        yield points


@pytest.fixture
def tmpfs_small(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """tmpfs_small(size_bytes, inodes=None) -> the mount point of a fresh tmpfs of that size
    (rounded up to pages), with at most ``inodes`` files, directories and links if given."""
    require_mount("tmpfs")
    with ExitStack() as stack:
        count = 0

        def make(size_bytes: int, inodes: int | None = None) -> Path:
            nonlocal count
            count += 1
            path = tmp_path / f"tmpfs{count}"
            return stack.enter_context(tmpfs_volume(path, size_bytes=size_bytes, inodes=inodes))

        yield make


@pytest.fixture
def bind_mounts(tmp_path: Path) -> Iterator[Callable[[Path, Path, bool], Path]]:
    """bind_mounts(source, target, read_only) -> target, bind-mounted until the test ends: how
    cachemgr_testkit.kube.Node mounts a pod's PVC mounts as the kubelet does (readOnly, subPath)."""
    require_mount("bind")
    with ExitStack() as stack:

        def bind(source: Path, target: Path, read_only: bool) -> Path:
            if read_only:
                return stack.enter_context(readonly_bind(source, target))
            target.mkdir(parents=True, exist_ok=True)
            return stack.enter_context(writable_bind(source, target))

        yield bind


@pytest.fixture(name="readonly_bind")
def readonly_bind_fixture(tmp_path: Path) -> Iterator[Callable[[Path], Path]]:
    """readonly_bind(source) -> a read-only bind mount of ``source``, unmounted after the test."""
    require_mount("bind")
    with ExitStack() as stack:

        def make(source: Path) -> Path:
            return stack.enter_context(readonly_bind(source, tmp_path / f"ro-{source.name}"))

        yield make


# --- real pods on a real volume (see podlib) ----------------------------------------------------


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One real S3 server (weed mini) for the module; each test uses a prefix of its own."""
    require_s3()
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A cache volume on the local disk: a directory that exists, as a mounted PVC does."""
    path = tmp_path / "volume"
    path.mkdir()
    return path


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[Cluster]:
    """Real `cachemgr run` pods for one test; every one of them is killed at teardown."""
    with cluster(tmp_path / "work") as group:
        yield group


def pytest_sessionfinish(session: pytest.Session) -> None:
    """libfaketime's /dev/shm objects of the skewed processes this run killed (podlib.skewed_env):
    only once every worker is done (the controller, or a run without xdist), and only of pids gone."""
    if not hasattr(session.config, "workerinput"):
        sweep_faketime_shm()


# --------------------------------------------------------------------------------------------------
# The quick tier (tests/README.md): tests marked `quick` start no process, mount nothing and serve
# nothing. An audit hook holds them to it in every run, CI's full one included: a quick test that
# spawns a process or binds a socket fails, so the mark cannot drift from what the test does.

_NOT_QUICK_EVENTS = frozenset(
    {"subprocess.Popen", "os.posix_spawn", "os.fork", "os.forkpty", "os.system", "os.exec", "socket.bind"}
)
_quick_guard: dict[str, Any] = {"on": False, "seen": []}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _quick_guard["on"] and event in _NOT_QUICK_EVENTS:
        _quick_guard["seen"].append(f"{event}{args[:2]!r}")
        raise RuntimeError(f"a test marked quick may not {event}: move it out of the quick tier")


sys.addaudithook(_audit)  # cannot be removed; idle outside the quick tests


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if item.get_closest_marker("quick") is None:
        return (yield)
    _quick_guard["on"], _quick_guard["seen"] = True, []
    try:
        return (yield)
    finally:
        _quick_guard["on"] = False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    if item.get_closest_marker("quick") is not None and _quick_guard["seen"] and report.when == "call":
        # Also when the test swallowed the hook's exception: the mark is wrong either way.
        report.outcome = "failed"
        report.longrepr = f"marked quick, but it did: {'; '.join(_quick_guard['seen'])}"
    return report
