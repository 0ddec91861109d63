"""The remote tier's deadline: a store that trickles or stalls never holds a pod past its budget.

A real S3 server (``weed mini``) behind a real TCP proxy (cachemgr_testkit.trickle) that passes,
trickles (one byte every half second: no read timeout ever fires) or stalls what the store
sends. Pods are real ``cachemgr run`` processes. ``CACHEMGR_REMOTE_BUDGET`` is one deadline for
the whole remote attempt (the manifest GET, every object, the retries); at it the transfer is
abandoned (its connections closed, its partial files removed), one warning says so, and the pod
compiles. SIGTERM ends the attempt at once. The operator's ``push``, ``pull`` and ``ls --remote``
keep the same deadline (``--budget``, per entry; else the variable) and stop at once on a signal.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.podlib import Cluster, cluster, error_lines, free_port, run_cli, wait_for
from cachemgr_testkit.s3server import BUCKET, S3Server
from cachemgr_testkit.scenarios import (
    assert_clean_after_failure,
    assert_entries_valid,
    command_key,
    compile_cmd,
    compiles,
    server_argv,
)
from cachemgr_testkit.trickle import PASS, Stall, Trickle, TrickleProxy, trickle_proxy

from cachemgr.remote.config import ENV_BUDGET
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import open_root
from cachemgr.volume.store import create_staging, publish

BUDGET = 6.0
SLACK = 8.0  # beyond the budget: a loaded 2-core machine starting Python processes
ARTIFACT_BYTES = "2m"  # six files of it: an entry that takes minutes at a trickle


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[TrickleProxy]:
    with trickle_proxy(s3.endpoint) as running:
        yield running


@pytest.fixture
def env(s3: S3Server, proxy: TrickleProxy, request: pytest.FixtureRequest) -> dict[str, str]:
    """A pod's remote through the proxy, under a prefix of this test's own."""
    tag = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]
    return {
        **s3.env(prefix=f"d/{request.node.name[:40]}-{tag}"),
        "CACHEMGR_REMOTE_ENDPOINT": proxy.endpoint,
        "CACHEMGR_REMOTE_TIMEOUT": "3s",
        "CACHEMGR_REMOTE_BUDGET": f"{BUDGET:g}s",
    }


@pytest.fixture(scope="module")
def filled(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A prefix another cluster filled once for the module's downloads (none of them changes it),
    and the compiler's record every pod using it shares (its path is part of the key)."""
    work = tmp_path_factory.mktemp("filled")
    env = {**s3.env(prefix=f"d/filled-{os.urandom(4).hex()}"), "CACHEMGR_REMOTE_BUDGET": "2m"}
    with cluster(work / "work") as pods:
        yield env["CACHEMGR_REMOTE"], _fill_remote(pods, work, env)


def _options(record: Path) -> list[str]:
    return ["--strategy", "command", "--compile-cmd", compile_cmd(record, extra=f"--bytes {ARTIFACT_BYTES}")]


def _events(pod: Any, name: str) -> list[dict[str, Any]]:
    return [e for e in pod.log_events() if e.get("event") == name]


def _warnings(pod: Any) -> list[dict[str, Any]]:
    return [e for e in pod.log_events() if e.get("level") == "warning"]


def _fill_remote(pods: Cluster, tmp_path: Path, env: dict[str, str]) -> Path:
    """Another cluster compiles the key and uploads it (the proxy passing everything); the
    compiler's record, which every pod of the test shares (its path is part of the key)."""
    root = tmp_path / "cluster-a"
    root.mkdir()
    record = tmp_path / "compiler.jsonl"
    patient = {**env, "CACHEMGR_REMOTE_BUDGET": "2m", "CACHEMGR_REMOTE_TIMEOUT": "30s"}  # a loaded machine
    pod = pods.start("a0", server_argv(free_port()), cache_root=root, options=_options(record), env=patient)
    pod.wait_phase("serving", timeout=90)
    wait_for(
        lambda: _events(pod, "remote_uploaded") or _events(pod, "remote_upload_failed"),
        what="the upload",
        timeout=120,
    )
    assert _events(pod, "remote_uploaded"), _warnings(pod)
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0
    assert compiles(record) == 1
    return record


def _staging(root: Path) -> list[Path]:
    return list((root / "staging").glob("*/*")) if (root / "staging").is_dir() else []


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(Trickle(nbytes=1, interval=0.5), id="manifest-trickles"),
        pytest.param(Trickle(nbytes=1, interval=0.5, after=300_000), id="objects-trickle"),
        pytest.param(Stall(after=300_000), id="objects-stall"),
    ],
)
def test_a_slow_store_costs_the_budget_then_one_warning_and_a_local_compile(
    pods: Cluster, env: dict[str, str], proxy: TrickleProxy, filled: tuple[str, Path], mode: Any
) -> None:
    url, record = filled
    env = {**env, "CACHEMGR_REMOTE": url}
    compiled = compiles(record)
    root = pods.work / "cluster-b"
    root.mkdir()
    proxy.set_mode(mode)
    started = time.monotonic()
    pod = pods.start("b0", server_argv(free_port()), cache_root=root, options=_options(record), env=env)
    wait_for(lambda: compiles(record) > compiled, what="the local compile", timeout=BUDGET + SLACK)
    assert time.monotonic() - started < BUDGET + SLACK
    pod.wait_phase("serving", timeout=60)
    (warning,) = _warnings(pod)  # one warning, and no upload attempt to a store known slow
    assert warning["event"] == "remote_unusable_compiling_locally", warning
    assert warning["problem"] == "budget"
    assert "CACHEMGR_REMOTE_BUDGET=6s" in warning["message"]
    left = "its manifest had not arrived" if mode.after == 0 else " MiB of its 9 files had arrived"
    assert left in warning["message"], warning["message"]
    wait_for(
        lambda: proxy.stats().open == 0, what="the abandoned transfer's connections to close", timeout=10
    )
    assert _staging(root) == [], "the abandoned download's partial files were removed"
    assert compiles(record) == compiled + 1
    assert_entries_valid(root)
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0


def test_sigterm_during_a_trickling_download_ends_the_pod_at_once(
    pods: Cluster, tmp_path: Path, env: dict[str, str], proxy: TrickleProxy, filled: tuple[str, Path]
) -> None:
    url, record = filled
    env = {**env, "CACHEMGR_REMOTE": url}
    compiled = compiles(record)
    root = tmp_path / "cluster-b"
    root.mkdir()
    proxy.set_mode(Trickle(nbytes=1, interval=0.5, after=300_000))
    slow = {**env, "CACHEMGR_REMOTE_BUDGET": "10m"}
    pod = pods.start("b0", server_argv(free_port()), cache_root=root, options=_options(record), env=slow)
    wait_for(lambda: proxy.stats().down_bytes > 300_000, what="the download to be under way")
    wait_for(lambda: any(p.rglob("artifacts/*") for p in _staging(root)), what="the download's partial files")
    signalled = time.monotonic()
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit(timeout=10) == 143, pod.tail()
    assert time.monotonic() - signalled < 5.0, "SIGTERM ends the remote attempt at once"
    assert "stopped by signal 15 before the server started" in (pod.state_dir / "termination-log").read_text()
    assert compiles(record) == compiled, "no compile after the signal"
    assert_clean_after_failure(root)  # no staging, no lease held, no use record
    wait_for(lambda: proxy.stats().open == 0, what="the download's connections to close", timeout=10)


def test_an_upload_that_trickles_is_abandoned_at_its_budget(
    pods: Cluster, tmp_path: Path, env: dict[str, str], proxy: TrickleProxy, s3: S3Server
) -> None:
    root = tmp_path / "volume"
    root.mkdir()
    record = tmp_path / "a.jsonl"
    pod = pods.start("a0", server_argv(free_port()), cache_root=root, options=_options(record), env=env)
    wait_for(lambda: _events(pod, "remote_miss"), what="the lease holder to look in the remote")
    # Every answer of the store trickles: a PUT's body goes out whole (no send times out),
    # its answer comes one byte every half second (no read times out either).
    proxy.set_mode(Trickle(nbytes=1, interval=0.5))
    pod.wait_phase("serving", timeout=60)
    published = time.monotonic()
    warning = wait_for(
        lambda: _events(pod, "remote_upload_failed"), what="the upload's budget", timeout=BUDGET + SLACK
    )[0]
    assert time.monotonic() - published < BUDGET + SLACK
    assert warning["problem"] == "budget", warning
    assert "CACHEMGR_REMOTE_BUDGET=6s" in warning["message"]
    wait_for(lambda: proxy.stats().open == 0, what="the upload's connections to close", timeout=10)
    assert pod.phase == "serving", "an abandoned upload never stops the server"
    proxy.set_mode(PASS)
    assert _manifests(s3, env) == [], "no manifest: no reader takes the abandoned upload"
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit(timeout=10) == 0


def test_sigterm_during_a_trickling_upload_waits_only_the_upload_wait(
    pods: Cluster, tmp_path: Path, env: dict[str, str], proxy: TrickleProxy, s3: S3Server
) -> None:
    root = tmp_path / "volume"
    root.mkdir()
    record = tmp_path / "a.jsonl"
    slow = {
        **env,
        "CACHEMGR_REMOTE_BUDGET": "10m",
        "CACHEMGR_REMOTE_TIMEOUT": "60s",
        "CACHEMGR_REMOTE_UPLOAD_WAIT": "2s",
    }
    pod = pods.start("a0", server_argv(free_port()), cache_root=root, options=_options(record), env=slow)
    wait_for(lambda: _events(pod, "remote_miss"), what="the lease holder to look in the remote")
    # A store that reads slowly: requests go through, the bodies of the PUTs trickle in.
    proxy.set_mode(Trickle(nbytes=1024, interval=0.5, after=5000, direction="up"))
    pod.wait_phase("serving", timeout=60)
    wait_for(lambda: proxy.stats().up_bytes > 50_000, what="the upload's bodies to be under way")
    signalled = time.monotonic()
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit(timeout=15) == 0, pod.tail()
    assert time.monotonic() - signalled < 2.0 + SLACK
    (warning,) = _warnings(pod)
    assert warning["event"] == "remote_upload_unfinished", warning
    # Nothing of the pod is left to hold a connection (the proxy cannot tell here: a killed
    # client's FIN waits in its kernel behind the bytes the trickle has not taken yet).
    wait_for(lambda: not _group_alive(pod.proc.pid), what="every process of the pod to be gone", timeout=10)
    proxy.set_mode(PASS)
    assert _manifests(s3, env) == []


def test_sigterm_ends_a_warm_jobs_wait_for_its_trickling_upload(
    pods: Cluster, tmp_path: Path, env: dict[str, str], proxy: TrickleProxy, s3: S3Server
) -> None:
    """A warm Job waits for its upload up to the budget; after SIGTERM, the upload wait at most."""
    root = tmp_path / "ci-volume"
    root.mkdir()
    slow = {**env, "CACHEMGR_REMOTE_BUDGET": "10m", "CACHEMGR_REMOTE_UPLOAD_WAIT": "2s"}
    options = _options(tmp_path / "compiler.jsonl")
    job = pods.start(
        "ci", server_argv(free_port()), cache_root=root, command="warm", options=options, env=slow
    )
    wait_for(lambda: _events(job, "remote_miss"), what="the warm Job to look in the remote")
    proxy.set_mode(Trickle(nbytes=1, interval=0.5))
    wait_for(lambda: _events(job, "published"), what="the warm Job's publish", timeout=60)
    signalled = time.monotonic()
    job.signal(signal.SIGTERM)
    assert job.wait_exit(timeout=15) == 0, "published here; the upload is what it was waiting for"
    assert time.monotonic() - signalled < 2.0 + SLACK
    (warning,) = _warnings(job)
    assert warning["event"] == "remote_upload_unfinished", warning
    wait_for(lambda: not _group_alive(job.proc.pid), what="every process of the Job to be gone", timeout=10)
    proxy.set_mode(PASS)
    assert _manifests(s3, env) == []


def test_a_remote_object_larger_than_its_manifest_entry_is_never_downloaded_past_its_size(
    pods: Cluster, tmp_path: Path, env: dict[str, str], proxy: TrickleProxy, s3: S3Server
) -> None:
    record = _fill_remote(pods, tmp_path, env)
    client: Any = s3.client()
    prefix = env["CACHEMGR_REMOTE"].removeprefix(f"s3://{BUCKET}/") + "/"
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]
    artifact = next(item for item in listed if "/artifacts/" in item["Key"])
    client.put_object(Bucket=BUCKET, Key=artifact["Key"], Body=os.urandom(1 << 20) * 24)  # 24 MiB
    entry_bytes = sum(item["Size"] for item in listed)
    before = proxy.stats().down_bytes
    root = tmp_path / "cluster-b"
    root.mkdir()
    pod = pods.start("b0", server_argv(free_port()), cache_root=root, options=_options(record), env=env)
    pod.wait_phase("serving", timeout=60)
    fetched = proxy.stats().down_bytes - before
    assert fetched < entry_bytes + (256 << 10), f"{fetched} bytes came down for an entry of {entry_bytes}"
    (warning,) = _warnings(pod)
    assert warning["event"] == "remote_unusable_compiling_locally", warning
    assert warning["problem"] == "damaged", warning
    assert f"is {24 << 20} bytes, its manifest lists {artifact['Size']}" in warning["message"]
    assert compiles(record) == 2, "the pod compiled locally"
    assert_entries_valid(root)
    assert _staging(root) == []


@pytest.mark.quick
def test_a_download_file_takes_no_byte_past_its_manifest_size(tmp_path: Path) -> None:
    """The second guard: a store that announces the right size and sends more."""
    from cachemgr.remote.sizes import Capped, ObjectTooLargeError  # new: the module-wide run before it

    with (tmp_path / "f").open("wb") as handle:
        capped = Capped(handle, size=10, key="p/entries/e/objects/u/artifacts/a.bin")
        capped.seek(4)
        capped.write(b"123456")  # up to the size: fine
        with pytest.raises(
            ObjectTooLargeError, match=re.escape("'a.bin' runs past the 10 bytes its manifest lists")
        ):
            capped.write(b"7")
    assert (tmp_path / "f").stat().st_size == 10


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _manifests(s3: S3Server, env: dict[str, str]) -> list[str]:
    prefix = env["CACHEMGR_REMOTE"].removeprefix(f"s3://{BUCKET}/") + "/"
    client: Any = s3.client()
    answer = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return [item["Key"] for item in answer.get("Contents", []) if item["Key"].endswith("/manifest.json")]


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("CACHEMGR_REMOTE_BUDGET", "soon"),
        ("CACHEMGR_REMOTE_BUDGET", "-5s"),
        ("CACHEMGR_REMOTE_TIMEOUT", "0"),
        ("CACHEMGR_REMOTE_UPLOAD_WAIT", "10 parsecs"),
        ("CACHEMGR_REMOTE", "gs://bucket/prefix"),
    ],
)
def test_a_bad_remote_variable_is_a_configuration_error_naming_it(
    tmp_path: Path, variable: str, value: str
) -> None:
    env = {
        **os.environ,
        "CACHEMGR_CACHE_ROOT": str(tmp_path),
        "CACHEMGR_REMOTE": "s3://bucket/prefix",
        variable: value,
    }
    result = run_cli("warm", "--role", "prefill", "--compile-cmd", "c {output_dir}", "--", "x", env=env)
    assert result.returncode == 78, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert variable in line, line
    assert "Traceback" not in result.stderr


# --- push and pull from a shell: the same child, a budget per entry (--budget) ------------------


@pytest.fixture(scope="module")
def pullable(s3: S3Server, filled: tuple[str, Path]) -> tuple[str, str]:
    """The filled prefix and its one entry's name, read from the store directly (not through the proxy)."""
    url, _ = filled
    (manifest,) = _manifests(s3, {"CACHEMGR_REMOTE": url})
    return url, manifest.rsplit("/", 2)[-2]


def _cli_env(pods: Cluster, env: dict[str, str], root: Path, url: str | None = None) -> dict[str, str]:
    return {
        **pods.base_env,
        **env,
        "CACHEMGR_CACHE_ROOT": str(root),
        **({"CACHEMGR_REMOTE": url} if url else {}),
    }


@pytest.mark.parametrize(
    "case",
    [
        pytest.param((Trickle(nbytes=1, interval=0.5), "--budget"), id="listing-trickles"),
        # No --budget: the pods' own CACHEMGR_REMOTE_BUDGET (6s here) is the default.
        pytest.param((Trickle(nbytes=1, interval=0.5, after=300_000), ENV_BUDGET), id="objects-trickle"),
    ],
)
def test_pull_from_a_trickling_store_ends_at_its_budget_with_one_line_and_74(
    pods: Cluster,
    env: dict[str, str],
    proxy: TrickleProxy,
    pullable: tuple[str, str],
    case: tuple[Any, str],
) -> None:
    mode, flag = case
    url, entry = pullable
    root = pods.work / "volume"
    root.mkdir()
    cli_env = _cli_env(pods, env, root, url)
    assert cli_env[ENV_BUDGET] == f"{BUDGET:g}s"
    budget = ["--budget", f"{BUDGET:g}s"] if flag == "--budget" else []
    if budget:
        cli_env[ENV_BUDGET] = "10m"  # the flag wins
    proxy.set_mode(mode)
    started = time.monotonic()
    result = run_cli("pull", entry, *budget, env=cli_env, timeout=BUDGET + 60)
    assert time.monotonic() - started < BUDGET + SLACK, "the pull outlived its budget"
    assert result.returncode == 74, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    (line,) = error_lines(result.stderr)
    assert f"within {flag}={BUDGET:g}s" in line, line
    assert f"raise {flag}" in line, line
    if mode.after == 0:  # the listing itself trickles: a listing is small, not a few bytes
        assert "did not finish the listing of its entries" in line, line
    else:
        assert f"did not deliver entry {entry} " in line, line
        assert re.search(
            r": [\d.]+ [KM]iB of the [\d.]+ MiB of its 9 files had arrived; the transfer was abandoned", line
        ), line
    wait_for(
        lambda: proxy.stats().open == 0, what="the abandoned transfer's connections to close", timeout=10
    )
    assert _staging(root) == [], "the abandoned download's partial files were removed"
    assert not (root / "entries").is_dir() or list((root / "entries").iterdir()) == [], "nothing published"
    # The same pull at full speed: the budget changes nothing else.
    proxy.set_mode(PASS)
    again = run_cli("pull", entry, "--budget", "2m", env=cli_env, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "downloaded" in again.stdout
    assert_entries_valid(root)


@pytest.mark.parametrize(
    "case",
    [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGINT, True)],
    ids=[
        "SIGTERM",
        "SIGINT",
        "SIGINT-to-the-group",
    ],  # the last as a terminal's Ctrl-C: the child gets it too
)
def test_a_signal_during_a_trickling_pull_ends_it_at_once_with_its_staging_gone(
    pods: Cluster,
    env: dict[str, str],
    proxy: TrickleProxy,
    pullable: tuple[str, str],
    case: tuple[signal.Signals, bool],
) -> None:
    signum, group = case
    url, entry = pullable
    root = pods.work / "volume"
    root.mkdir()
    cli_env = {
        **_cli_env(pods, env, root, url),
        "CACHEMGR_REMOTE_BUDGET": "10m",
    }  # the default: only the signal ends it
    proxy.set_mode(Trickle(nbytes=1, interval=0.5, after=300_000))
    with (pods.work / "pull.err").open("w+") as errors:
        pull = subprocess.Popen(
            [sys.executable, "-m", "cachemgr", "pull", entry],
            env=cli_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            text=True,
            start_new_session=group,
        )
        try:
            wait_for(
                lambda: any(p.rglob("artifacts/*") for p in _staging(root)), what="the pull's partial files"
            )
            signalled = time.monotonic()
            if group:
                os.killpg(pull.pid, signum)
            else:
                pull.send_signal(signum)
            code = pull.wait(timeout=15)
        finally:
            if pull.poll() is None:
                pull.kill()
                pull.wait()
        assert time.monotonic() - signalled < 5.0, "a signal ends the transfer at once"
        errors.seek(0)
        stderr = errors.read()
    assert code == 128 + signum, stderr
    assert "Traceback" not in stderr
    (line,) = error_lines(stderr)
    assert f"stopped by signal {int(signum)} ({signum.name}) while pulling entry {entry}" in line, line
    assert "partial files removed, nothing was published" in line, line
    assert_clean_after_failure(root)
    assert not (root / "entries").is_dir() or list((root / "entries").iterdir()) == [], "nothing published"
    wait_for(lambda: proxy.stats().open == 0, what="the pull's connections to close", timeout=10)


def _published(root: Path, role: str) -> str:
    """An entry of ``role``'s key, published by library call (256 KiB of artifacts): its name."""
    identity = PodIdentity(pod="pod-a", node="node-a", host="host-a", pid=os.getpid())
    volume = open_root(root, create=True)
    key = command_key(role)
    staging = create_staging(volume, key, identity)
    (staging.artifacts / "graph.rbln").write_bytes(os.urandom(256 << 10))
    return publish(volume, staging, key, identity=identity, compile_seconds=1.0, strategy="command").path.name


def test_push_abandons_an_entry_at_its_budget_says_so_and_goes_on_with_the_next(
    pods: Cluster, tmp_path: Path, env: dict[str, str], proxy: TrickleProxy, s3: S3Server
) -> None:
    root = tmp_path / "volume"
    root.mkdir()
    names = {_published(root, "prefill"), _published(root, "decode")}
    # Every answer of the store trickles: the first entry's requests get their answers one byte
    # every half second (no read timeout fires); once its budget ended it, the store is well again.
    proxy.set_mode(Trickle(nbytes=1, interval=0.5))
    with (tmp_path / "push.err").open("w+") as errors:
        started = time.monotonic()
        push = subprocess.Popen(
            [sys.executable, "-m", "cachemgr", "push", "--budget", f"{BUDGET:g}s"],
            env=_cli_env(pods, env, root),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
        try:
            wait_for(
                lambda: "warning:" in Path(errors.name).read_text(),
                what="the first entry's budget",
                timeout=BUDGET + SLACK,
            )
            assert time.monotonic() - started < BUDGET + SLACK
            proxy.set_mode(PASS)
            out, _ = push.communicate(timeout=120)
        finally:
            if push.poll() is None:
                push.kill()
                push.wait()
        errors.seek(0)
        stderr = errors.read()
    assert push.returncode == 74, out + stderr
    assert "Traceback" not in stderr
    said = stderr.replace("\n  ", " ")  # a warning wider than 80 columns goes on two columns in
    (warning,) = [line for line in said.splitlines() if line.startswith("warning:")]
    (abandoned,) = [name for name in names if name in warning]
    assert f"did not finish the upload of {abandoned} within --budget={BUDGET:g}s" in warning, warning
    assert "the upload was abandoned before its manifest, so no reader takes it" in warning, warning
    (line,) = error_lines(stderr)
    assert line.startswith("1 of 2 entries not uploaded; the first: "), line
    (uploaded,) = names - {abandoned}
    assert [m.rsplit("/", 2)[-2] for m in _manifests(s3, env)] == [uploaded], "the next entry went up, whole"


def test_ls_remote_against_a_trickling_store_ends_at_the_budget_with_one_line_and_74(
    pods: Cluster, env: dict[str, str], proxy: TrickleProxy, pullable: tuple[str, str]
) -> None:
    """A listing is small, but at one byte every half second a few KiB of XML take an hour."""
    url, _ = pullable
    proxy.set_mode(Trickle(nbytes=1, interval=0.5))
    started = time.monotonic()
    result = run_cli("ls", "--remote", env=_cli_env(pods, env, pods.work, url), timeout=BUDGET + 60)
    assert time.monotonic() - started < BUDGET + SLACK, "the listing outlived its budget"
    assert result.returncode == 74, result.stdout + result.stderr
    (line,) = error_lines(result.stderr)
    assert f"did not finish the listing of its entries within {ENV_BUDGET}={BUDGET:g}s" in line, line
    wait_for(lambda: proxy.stats().open == 0, what="the listing's connections to close", timeout=10)


def test_sigterm_during_a_trickling_push_ends_it_at_once_and_nothing_goes_up(
    pods: Cluster, tmp_path: Path, env: dict[str, str], proxy: TrickleProxy, s3: S3Server
) -> None:
    root = tmp_path / "volume"
    root.mkdir()
    name = _published(root, "prefill")
    proxy.set_mode(Trickle(nbytes=1, interval=0.5))
    accepted = proxy.stats().accepted
    push = subprocess.Popen(
        [sys.executable, "-m", "cachemgr", "push", name],
        env={**_cli_env(pods, env, root), ENV_BUDGET: "10m"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: proxy.stats().accepted > accepted, what="the upload to reach the store")
        signalled = time.monotonic()
        push.send_signal(signal.SIGTERM)
        _, stderr = push.communicate(timeout=15)
    finally:
        if push.poll() is None:
            push.kill()
            push.wait()
    assert time.monotonic() - signalled < 5.0, "SIGTERM ends the upload at once"
    assert push.returncode == 143, stderr
    (line,) = error_lines(stderr)
    assert f"stopped by signal 15 (SIGTERM) while uploading {name}; that upload was abandoned" in line, line
    wait_for(lambda: proxy.stats().open == 0, what="the upload's connections to close", timeout=10)
    proxy.set_mode(PASS)
    assert _manifests(s3, env) == [], "no manifest: nothing of the entry is taken"
