"""``cachemgr run`` and ``cachemgr warm``: key, lookup, lease, compile, publish, launch.

The flow, in one direction::

    key      compiler major.minor + NPU type + serving config -> digest
    lookup   published entry for the digest? (lock-free, read-only; damaged -> quarantined)
    hit      launch the server against a pod-local view of the entry; supervise it
    miss     take the key's lease (or wait while a peer compiles, watching for its publish)
             look again; clean dead attempts; check space
             compile into private staging; manifest last; publish by one rename
             release the lease; launch as on a hit

``warm`` is the same flow for a Job: it exits 0 once the entry is published (or found).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cachemgr.core.errors import (
    CacheMgrError,
    CompileError,
    ConfigError,
    DiskFullError,
    Interrupted,
    MissError,
    StateDirInUseError,
    VolumeError,
    WaitTimeoutError,
)
from cachemgr.core.fsutil import is_disk_full, tree_bytes
from cachemgr.core.log import get_logger
from cachemgr.core.log import hold as hold_logs
from cachemgr.core.log import release as release_logs
from cachemgr.key.cachekey import CacheKey, KeyRequest, compute_key
from cachemgr.runtime import launcher
from cachemgr.runtime.metrics import Metrics
from cachemgr.runtime.state import StateDirBusy, StateWriter, claim_state_dir
from cachemgr.runtime.strategies import (
    build_view,
    default_health_url,
    health_ok,
    remove_old_views,
    render,
    snapshot_tree,
)
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import CacheRoot, open_root
from cachemgr.volume.manifest import MANIFEST_NAME, VerifyMode
from cachemgr.volume.records import HEARTBEAT_SECONDS, Heartbeat, record_failure, register_use, release_use
from cachemgr.volume.store import (
    Lookup,
    Staging,
    clean_stale_staging,
    create_staging,
    lookup,
    publish,
    quarantine,
    stale_staging_after,
)

if TYPE_CHECKING:
    from cachemgr.ops.progress import CompileProgress, Every
    from cachemgr.ops.space import Preflight, SpaceCheck
    from cachemgr.remote.config import RemoteConfig
    from cachemgr.remote.hooks import FetchOutcome, Upload
    from cachemgr.volume.drift import DriftWatch
    from cachemgr.volume.lease import Holder, KeyLease

log = get_logger("cachemgr.run")

OnMiss = Literal["compile", "fail"]
_MAX_ROUNDS = 4  # lookups after quarantining damaged entries; more means something keeps breaking them


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """Everything ``run``/``warm`` take besides the key inputs (see ``cachemgr run --help``)."""

    cache_root: Path
    state_dir: Path
    on_miss: OnMiss = "compile"
    lease_duration: float = 30.0
    lease_heartbeat: float | None = None
    lease_confirm: float | None = None  # None: by the volume's filesystem type (softlease.py)
    wait_timeout: float | None = None
    expected_size: int | None = None
    space_check: SpaceCheck = "fail"
    auto_prune: Literal["off", "incompatible"] = "off"
    verify: VerifyMode = "fast"
    health_url: str | None = None
    stall_timeout: float = 1800.0
    status_port: int | None = None
    warm: bool = False
    # compile_progress and waiting_for_compile, at most once per this (cachemgr.ops.progress.DEFAULT_INTERVAL)
    progress_interval: float = 30.0
    remote: RemoteConfig | None = None  # the remote tier (cachemgr.remote); off by default

    @property
    def stale_staging_after(self) -> float:
        """An attempt silent this long is dead: far beyond its 10s heartbeat and the lease."""
        return stale_staging_after(self.lease_duration)


class Runner:
    """One pod start: owns the signal relay, the state record and the heartbeats."""

    def __init__(self, request: KeyRequest, options: RunOptions, *, environ: Mapping[str, str]) -> None:
        self.request = request
        self.options = options
        self.environ = dict(environ)
        self.identity = PodIdentity.current(environ)
        self.relay = launcher.SignalRelay()
        # warm writes no probe state: typed into a serving pod it must not replace the live record.
        self._claim = None if options.warm else _claim_state_dir(options.state_dir)
        self.state = StateWriter(
            None if options.warm else options.state_dir, stall_timeout=options.stall_timeout
        )
        self.metrics = Metrics()
        self.state.on_change(self.metrics.on_phase)
        self._volume_beat = Heartbeat(interval=HEARTBEAT_SECONDS)
        self._state_beat = Heartbeat(interval=self.state.current.heartbeat_interval)
        self._state_beat.on_beat(self.state.beat)
        self._use_record: Path | None = None
        self._reaper = False
        self._server_exited = threading.Event()
        self._missed = False
        self._preflight_found: Preflight | None = None
        self._compile_progress: CompileProgress | None = None
        self._peak_staged = 0  # the most the last attempt was seen to have staged
        self._wait_log: Every | None = None
        self._upload: Upload | None = None
        self._fetched: FetchOutcome | None = None

    # --- the flow ---------------------------------------------------------------------

    def run(self) -> int:
        # Hold log events until the server is launched or the path turns into a miss: a warm
        # start does not wait for the logging library's import (see cachemgr.core.log).
        hold_logs()
        self.relay.install()
        self._reaper = launcher.become_subreaper() or os.getpid() == 1
        self._state_beat.start()
        self._volume_beat.start()
        status = None
        try:
            status = self._start_status_server()
            return self._run()
        except CacheMgrError as error:
            self.metrics.failure(error.reason)
            self.state.phase("failed", reason=error.one_line(), exit_code=_code(error))
            raise
        finally:
            release_logs()
            self._finish_upload()
            if status is not None:
                status.close()
            self._volume_beat.stop()
            self._state_beat.stop()
            release_use(self._use_record)
            self.relay.restore()
            if self._claim is not None:
                os.close(self._claim)

    def _start_status_server(self) -> Any:
        """``--status-port``: the probes and /metrics over HTTP, from this process."""
        if self.options.status_port is None:
            return None
        if self.options.warm:
            # The endpoints read the state dir, which warm leaves alone (a shared CACHEMGR_RUN_ARGS
            # may carry the serving pods' --status-port into a warm Job).
            log.info("status_port_ignored", reason="warm writes no probe state")
            return None
        from cachemgr.runtime.status_server import start_status_server

        return start_status_server(
            port=self.options.status_port,
            state_dir=self.options.state_dir,
            metrics=self.metrics,
            cache_root=self.options.cache_root,
        )

    def _run(self) -> int:
        key = self._resolve()
        root = open_root(self.options.cache_root, create=False)
        for _ in range(_MAX_ROUNDS):
            found = self._lookup(root, key)
            if found is None and not self._missed:
                # Counted once per start: later lookups (after our own publish) are not hits.
                self._missed = True
                self.metrics.misses += 1
            if found is None and self.options.on_miss == "fail":
                found = self._wait_for_peer(root, key)
            if found is None:
                self._check_can_compile(key)
                root = self._open_for_writing(root, key)
                outcome = self._compile_under_lease(root, key)
                if isinstance(outcome, int):
                    return outcome
                found = outcome
            if found is not None:
                code = self._serve_entry(root, key, found)
                if code is not None:
                    return code
        raise CompileError(
            f"the entry for key {key.short} kept disappearing or breaking after {_MAX_ROUNDS} attempts",
            remedy="check the cache volume's health and whether something else deletes entries (cachemgr ls)",
        )

    def _check_can_compile(self, key: CacheKey) -> None:
        """``warm`` on a node without an NPU: refuse a model that cannot compile there, up front."""
        if self.options.warm and key.inputs["strategy"] == "vllm" and not key.details.get("npu_from_device"):
            from cachemgr.key.vllm_rbln import cpu_compile_refusal

            why = cpu_compile_refusal(key.server.settings, self.environ)
            if why is not None:
                raise ConfigError(
                    f"this warm Job runs without an NPU and cannot compile key {key.short}: {why}",
                    remedy="run the warm Job on an NPU node (node affinity rebellions.ai/npu.present), or pass "
                    "--model-impl vllm if the model runs on vllm-rbln's vLLM-model path",
                )

    def _open_for_writing(self, root: CacheRoot, key: CacheKey) -> CacheRoot:
        """The layout a miss needs; a volume too full even for that gets the full space report."""
        from cachemgr.ops.space import disk_report

        try:
            return open_root(self.options.cache_root, create=True)
        except DiskFullError as error:
            raise disk_report(
                root, key, cause=error.what, given=self.options.expected_size
            ).error() from error

    def _resolve(self) -> CacheKey:
        started = time.monotonic()
        key = compute_key(self.request)
        self.state.update(key=key.digest, entry=key.entry_name)
        log.info(
            "key_resolved",
            key=key.short,
            entry=key.entry_name,
            compiler=key.inputs["compiler"],
            npu=key.inputs["npu"],
            role=key.inputs["role"],
            strategy=key.inputs["strategy"],
            seconds=round(time.monotonic() - started, 3),
            npu_query_s=key.details.get("npu_query_seconds"),
        )
        return key

    def _lookup(self, root: CacheRoot, key: CacheKey) -> Lookup | None:
        """A verified hit, or None; a damaged entry is moved aside and counts as a miss."""
        try:
            found = lookup(root, key, mode=self.options.verify)
        except OSError as error:
            raise VolumeError(
                f"cannot read the cache entry for key {key.short} under {root.entries}: {error.strerror}",
                remedy="check the compile cache PVC mount (kubectl describe pod; dmesg on the node)",
            ) from error
        if found.status == "hit":
            return found
        if found.status == "damaged":
            self.metrics.damaged += 1
            moved = quarantine(root, found.path, reason=found.reason)
            log.warning("entry_damaged", entry=found.path.name, problems=found.reason, moved_to=str(moved))
        return None

    def _wait_for_peer(self, root: CacheRoot, key: CacheKey) -> Lookup | None:
        """--on-miss fail: wait for a compile already under way (a warm Job), never start one."""
        from cachemgr.ops.progress import Every
        from cachemgr.volume.lease import marker_path, read_holder  # the miss path only
        from cachemgr.volume.softlease import MarkerWatch, patience, read_marker_view

        started = time.monotonic()
        notify = Every(min(5.0, self.options.progress_interval))
        # A holder is dead once its marker stops changing, by this node's clock: the marker's
        # mtime against our wall clock would misjudge a holder on a node with a skewed clock.
        watch = MarkerWatch()
        while True:
            if self._published(root, key):
                found = self._lookup(root, key)
                if found is not None:
                    return found
            holder = read_holder(root, key.digest) if root.leases.is_dir() else None
            view = read_marker_view(marker_path(root, key.digest)) if holder is not None else None
            silent = watch.silent_for(view)
            if (
                holder is None
                or view is None
                or silent > patience(view.record, default=self.options.lease_duration)
            ):
                raise MissError(
                    f"no published entry for key {key.short} ({key.entry_name}) and --on-miss fail forbids "
                    "compiling in this pod",
                    remedy="run the cachemgr warm Job for this configuration, or use --on-miss compile; "
                    "'cachemgr explain -- ARGV' shows the nearest entries",
                )
            if notify.due():
                self._on_wait(holder, time.monotonic() - started, root=root, key=key)
            self._check_wait(started, key, root)
            self.relay.stop.wait(0.2)

    def _check_wait(self, started: float, key: CacheKey, root: CacheRoot) -> None:
        if self.relay.stop.is_set():
            raise Interrupted(self.relay.received or 15)
        timeout = self.options.wait_timeout
        if timeout is not None and time.monotonic() - started >= timeout:
            raise self._wait_timeout(root, key, time.monotonic() - started)

    def _published(self, root: CacheRoot, key: CacheKey) -> bool:
        return (root.entry_path(key) / MANIFEST_NAME).is_file()

    # --- the lease ----------------------------------------------------------------------

    def _compile_under_lease(self, root: CacheRoot, key: CacheKey) -> Lookup | int | None:
        from cachemgr.volume.lease import KeyLease  # imported on a miss only

        release_logs()  # a miss takes seconds to minutes: log as it happens from here on

        lease = KeyLease(
            root,
            key.digest,
            self.identity,
            duration=self.options.lease_duration,
            heartbeat=self.options.lease_heartbeat,
            confirm=self.options.lease_confirm,
        )
        started = time.monotonic()
        try:
            outcome = lease.wait_or_acquire(
                published=lambda: self._published(root, key),
                stop=self.relay.stop,
                wait_timeout=self.options.wait_timeout,
                on_wait=lambda holder, waited: self._on_wait(holder, waited, root=root, key=key),
                notify_every=min(5.0, self.options.progress_interval),
            )
        except TimeoutError:
            raise self._wait_timeout(root, key, time.monotonic() - started) from None
        except InterruptedError:
            raise Interrupted(self.relay.received or 15) from None
        except OSError as error:
            # Taking the lease writes its marker file: on a full volume that write fails first.
            reported = _as_reported(error, root, key, given=self.options.expected_size)
            if reported is None:
                raise
            self._record(root, key, reported, written=0, elapsed=0.0, tail=[])
            raise reported from error
        self.metrics.lease_wait_seconds += time.monotonic() - started
        if outcome == "published":
            log.info("peer_published", key=key.short, waited_s=round(time.monotonic() - started, 2))
            return None
        try:
            found = self._lookup(root, key)  # a peer may have published just before we took over
            if found is not None:
                return found
            removed = clean_stale_staging(
                root, key.digest, stale_after=self.options.stale_staging_after, identity=self.identity
            )
            if removed:
                log.info("stale_staging_removed", key=key.short, attempts=[p.name for p in removed])
            if self._fetch_remote(root, key):
                return self._lookup(root, key)
            try:
                self._preflight(root, key)
            except CacheMgrError as error:
                self._record(root, key, error, written=0, elapsed=0.0, tail=[])
                raise
            if key.inputs["strategy"] == "command":
                self._compile_command(root, key, lease)
                return None
            return self._compile_vllm(root, key, lease)
        finally:
            lease.release()

    def _on_wait(self, holder: Holder | None, waited: float, *, root: CacheRoot, key: CacheKey) -> None:
        """Called while a peer compiles: the state every few seconds, a log line per progress interval."""
        from cachemgr.ops.progress import Every, holder_detail

        detail: dict[str, Any] = {"waited_s": round(waited)}
        if holder is not None and holder.current:
            detail.update(holder=holder.pod, holder_node=holder.node, held_for_s=round(holder.held_for))
            detail.update(holder_detail(root, key.digest, token=holder.token))
        if self._wait_log is None:
            self._wait_log = Every(self.options.progress_interval)
        if self._wait_log.due():
            log.info("waiting_for_compile", **detail)
        if self.state.current.phase != "waiting":
            self.state.phase("waiting", **detail)
        else:
            self.state.update(detail=detail)

    def _wait_timeout(self, root: CacheRoot, key: CacheKey, waited: float) -> WaitTimeoutError:
        from cachemgr.volume.lease import read_holder

        holder = read_holder(root, key.digest)
        who = holder.describe() if holder else "a peer that has since released it"
        return WaitTimeoutError(
            f"gave up after {waited:.0f}s (--wait-timeout) waiting for {who} to compile key {key.short}",
            remedy="raise --wait-timeout or unset it to wait; 'cachemgr locks' shows the holder, whose logs say "
            "how its compile is going",
        )

    def _preflight(self, root: CacheRoot, key: CacheKey) -> None:
        if self.options.auto_prune == "incompatible":
            from cachemgr.ops.prune import prune_incompatible_for_space  # only when asked

            prune_incompatible_for_space(root, key, given=self.options.expected_size)
        from cachemgr.ops.space import preflight  # scans the volume: the miss path only

        found = preflight(
            root, key, given=self.options.expected_size, check=self.options.space_check, environ=self.environ
        )
        self._preflight_found = found
        expectation = found.expectation
        self.state.update(detail={"expected_bytes": expectation.bytes, "expected_source": expectation.source})

    # --- the remote tier (cachemgr.remote) ------------------------------------------------

    def _fetch_remote(self, root: CacheRoot, key: CacheKey) -> bool:
        """Under the lease, before compiling: publish the remote's entry here if it has a good one."""
        if self.options.remote is None:
            return False
        from cachemgr.remote.hooks import fetch

        self.state.update(detail={"remote": self.options.remote.url, "downloading": True})
        self._fetched = fetch(
            root,
            key,
            config=self.options.remote,
            identity=self.identity,
            metrics=self.metrics,
            beat=self._volume_beat,
            stop=self.relay.stop,
        )
        if self._fetched != "hit" and self.relay.stop.is_set():
            raise Interrupted(self.relay.received or 15)
        return self._fetched == "hit"

    def _finish_upload(self) -> None:
        """A stopping pod waits a bounded time for its upload (a warm Job: up to the budget)."""
        if self._upload is not None and self.options.remote is not None:
            remote = self.options.remote
            self._upload.wait(remote.budget if self.options.warm else remote.upload_wait)

    # --- compiling ----------------------------------------------------------------------

    def _compile_command(self, root: CacheRoot, key: CacheKey, lease: KeyLease) -> None:
        staging = self._new_staging(root, key)
        argv = render(key.inputs["compile_cmd"], output_dir=str(staging.artifacts))
        self.state.phase("compiling", strategy="command", staging=str(staging.path))
        started = time.monotonic()
        watch: launcher.OutputWatch | None = None
        self._start_progress(root, key, lease)
        try:
            child = launcher.start(argv, env=self.environ, capture=True, what="compile command")
            watch = launcher.OutputWatch(child)
            monitor = launcher.ProgressMonitor(child, staging=staging.artifacts, output=watch)
            code = launcher.run_until(
                child,
                events=[self.relay.stop, watch.disk_full],
                every=lambda: self._progress(monitor),
                tick=0.5,
            )
            if code is None:
                launcher.terminate_tree(child)
            watch.join()
            self._check_compile_end(code, watch, what="compile command")
            self._stop_progress(staged=staging.artifacts)
            self._check_loadable(key, staging, serving=False)
            self._publish(root, key, staging, lease, seconds=time.monotonic() - started)
        except BaseException as error:
            self._fail_attempt(root, key, staging, error, watch=watch, started=started)
            raise
        finally:
            self._stop_progress()
            self._volume_beat.discard(staging.owner_file)

    def _compile_vllm(self, root: CacheRoot, key: CacheKey, lease: KeyLease) -> int:
        staging = self._new_staging(root, key)
        env = {**self.environ, "VLLM_CACHE_ROOT": str(staging.artifacts)}
        url = self._health_url(key)
        self.state.update(health_url=url)
        self.state.phase("compiling", strategy="vllm", staging=str(staging.path))
        started = time.monotonic()
        watch: launcher.OutputWatch | None = None
        child = None
        healthy = threading.Event()
        self._start_progress(root, key, lease)
        try:
            child = launcher.start(key.server.argv, env=env, capture=True, what="server")
            self.relay.attach(child)
            watch = launcher.OutputWatch(child)
            monitor = launcher.ProgressMonitor(child, staging=staging.artifacts, output=watch)

            def tick() -> None:
                self._progress(monitor)
                if url is not None and health_ok(url):
                    healthy.set()

            code = launcher.run_until(child, events=[self.relay.stop, watch.disk_full, healthy], every=tick)
            if code is None and not healthy.is_set():
                launcher.terminate_tree(child, grace=30.0)
                code = child.returncode
            if not healthy.is_set():
                watch.join()
                # A compile-only server (VLLM_RBLN_COMPILE_ONLY=1) exits 0 once its artifacts are saved.
                self._check_compile_end(code, watch, what="server", compile_only_ok=True)
            self._stop_progress(staged=staging.artifacts)
            if self._check_loadable(key, staging, serving=healthy.is_set() and not self.options.warm):
                self._publish_snapshot(root, key, staging, lease, seconds=time.monotonic() - started)
            else:
                lease.release()  # nothing will be published: peers must not wait on this pod
        except BaseException as error:
            self._stop_progress()
            if child is not None:
                launcher.terminate_tree(child)
            self._fail_attempt(root, key, staging, error, watch=watch, started=started)
            raise
        if not healthy.is_set() or self.options.warm:
            # Compile-only run, or a warm Job: the entry is published, the server is not needed.
            launcher.terminate_tree(child, grace=30.0)
            staging.discard()
            self._volume_beat.discard(staging.owner_file)
            self.state.phase("stopped", exit_code=0, published=True)
            return 0
        self.state.phase("serving", entry=key.entry_name)
        code = launcher.wait_reaping(child, reaper=self._reaper)
        watch.join(timeout=2.0)
        self.state.phase("stopped", exit_code=code)
        staging.discard()
        self._volume_beat.discard(staging.owner_file)
        return code

    def _new_staging(self, root: CacheRoot, key: CacheKey) -> Staging:
        from cachemgr.ops.space import disk_report

        try:
            staging = create_staging(root, key, self.identity)
        except OSError as error:
            if is_disk_full(error):
                raise disk_report(
                    root, key, cause=f"creating staging: {error.strerror}", given=self.options.expected_size
                ).error() from error
            raise VolumeError(
                f"cannot create a staging directory under {root.staging}: {error.strerror}",
                remedy="check that the compile cache PVC is mounted read-write",
            ) from error
        self._volume_beat.add(staging.owner_file)
        return staging

    def _check_compile_end(
        self,
        code: int | None,
        watch: launcher.OutputWatch,
        *,
        what: str,
        compile_only_ok: bool = False,
    ) -> None:
        """Turn how a compile ended into the right error, or return when it succeeded."""
        if watch.disk_full_line is not None:
            raise _DiskFullSeenError(f"the {what} printed: {watch.disk_full_line}")
        if self.relay.stop.is_set():
            raise Interrupted(self.relay.received or 15)
        if code == 0:
            return  # what it left is judged next: publish only what the server will load (loadable)
        status = launcher.exit_status(code if code is not None else -9)
        ended = "before its health endpoint answered" if compile_only_ok else "while compiling"
        raise CompileError(
            f"the {what} exited with code {status} {ended}; nothing was published",
            remedy="read its output above (the last lines are kept: cachemgr show KEY); the next start retries",
            exit_status=status,
        )

    def _start_progress(self, root: CacheRoot, key: CacheKey, lease: KeyLease) -> None:
        """compile_progress events and the progress record beside the lease (cachemgr.ops.progress)."""
        from cachemgr.ops.progress import start_compile_progress

        self._compile_progress = start_compile_progress(
            root,
            key,
            token=lease.token,
            pod=self.identity.pod,
            preflight=self._preflight_found,
            interval=self.options.progress_interval,
            bar=self.options.warm,  # a Job run by hand on a terminal; pods log compile_progress
        )

    def _stop_progress(self, *, staged: Path | None = None) -> None:
        reporter, self._compile_progress = self._compile_progress, None
        if reporter is not None:
            reporter.close(staged=staged)
            self._peak_staged = reporter.peak_staged

    def _check_loadable(self, key: CacheKey, staging: Staging, *, serving: bool) -> bool:
        """Publish only what the server will load (cachemgr.runtime.loadable): a serving server keeps
        serving unpublished; a compile that is all there is (warm, compile-only) has failed."""
        from cachemgr.runtime.loadable import why_not_loadable

        why = why_not_loadable(staging.artifacts, strategy=str(key.inputs["strategy"]))
        if why is None:
            return True
        cannot = "; ".join(key.details.get("uncacheable", ())) or "see the server's output"
        if serving:
            log.warning(
                "not_published", key=key.short, reason=why, cause=cannot, note="the server keeps serving"
            )
            return False
        raise CompileError(
            f"{why}; nothing was published ({cannot})",
            remedy="'cachemgr explain -- ARGV' says whether this configuration can be cached at all",
        )

    def _progress(self, monitor: launcher.ProgressMonitor) -> None:
        progress = monitor.sample()
        if self._compile_progress is not None:
            self._compile_progress.tick(cpu_seconds=progress.cpu_seconds, staged_bytes=progress.staging_bytes)
        stalled = monitor.stalled_for()
        detail: dict[str, Any] = {
            "cpu_seconds": round(progress.cpu_seconds, 1),
            "written_bytes": progress.written_bytes,
            "staging_bytes": progress.staging_bytes,
            "output_lines": progress.output_lines,
            "no_progress_s": round(stalled, 1),
            "stalled": stalled >= self.options.stall_timeout,
        }
        if detail["stalled"] and not self.state.current.detail.get("stalled"):
            log.error(
                "compile_stalled", no_progress_s=round(stalled), stall_timeout=self.options.stall_timeout
            )
        self.state.update(detail=detail)

    # --- publishing ---------------------------------------------------------------------

    def _publish(
        self, root: CacheRoot, key: CacheKey, staging: Staging, lease: KeyLease, *, seconds: float
    ) -> None:
        if lease.lost:
            log.warning(
                "publishing_after_lease_lost", key=key.short, note="first publisher wins; ours may be dropped"
            )
        self.state.phase("publishing")
        # Use before publishing: a prune running now sees the new entry in use and leaves it.
        self._register_use(root, key)
        outcome = publish(
            root,
            staging,
            key,
            identity=self.identity,
            compile_seconds=seconds,
            strategy=str(key.inputs["strategy"]),
        )
        self.metrics.compiles += 1
        self.metrics.compile_seconds += seconds
        log.info(
            "published" if outcome.published else "publish_discarded_peer_won",
            key=key.short,
            entry=outcome.path.name,
            bytes=outcome.manifest.total_bytes,
            compile_s=round(seconds, 2),
        )
        lease.release()
        if outcome.published and self.options.remote is not None:
            from cachemgr.remote.hooks import start_upload  # boto3 loads in the upload thread

            self._upload = start_upload(
                outcome.path,
                within=root.path,
                config=self.options.remote,
                identity=self.identity,
                metrics=self.metrics,
                fetched=self._fetched,
            )

    def _publish_snapshot(
        self, root: CacheRoot, key: CacheKey, staging: Staging, lease: KeyLease, *, seconds: float
    ) -> None:
        """vllm strategy: publish a hard-linked copy; the server keeps its own directory."""
        snapshot = self._new_staging(root, key)
        try:
            method = snapshot_tree(staging.artifacts, snapshot.artifacts, within=root.path)
            log.info("snapshot", method=method, key=key.short)
            self._publish(root, key, snapshot, lease, seconds=seconds)
        except BaseException:
            snapshot.discard()
            raise
        finally:
            self._volume_beat.discard(snapshot.owner_file)

    def _fail_attempt(
        self,
        root: CacheRoot,
        key: CacheKey,
        staging: Staging,
        error: BaseException,
        *,
        watch: launcher.OutputWatch | None,
        started: float,
    ) -> None:
        """Remove the attempt, then record why it failed (after freeing space, so the record fits)."""
        # A compiler may remove its partial output before it exits (optimum-rbln 0.12.0 save_pretrained
        # deletes its .tmp copy on any error, optimum/rbln/modeling_base.py:719-723): the most it was
        # seen to have staged counts too.
        self._stop_progress()
        written = max(tree_bytes(staging.artifacts), self._peak_staged)
        staging.discard()
        self._volume_beat.discard(staging.owner_file)
        found = self._preflight_found
        reported = _as_reported(
            error,
            root,
            key,
            given=self.options.expected_size,
            written=written,
            free_at_start=found.space.free_bytes if found is not None else None,
        )
        if reported is None:
            return
        tail = watch.tail_text() if watch is not None else []
        self._record(root, key, reported, written=written, elapsed=time.monotonic() - started, tail=tail)
        if reported is not error:
            raise reported from error

    def _record(
        self,
        root: CacheRoot,
        key: CacheKey,
        error: CacheMgrError,
        *,
        written: int,
        elapsed: float,
        tail: list[str],
    ) -> None:
        """The failure record: the same one-line message as the log and the termination message."""
        record_failure(
            root,
            key.digest,
            self.identity,
            {
                "key": key.digest,
                "entry": key.entry_name,
                "reason": error.reason,
                "message": error.one_line(),
                "exit_code": _code(error),
                "exit_status": error.fields.get("exit_status"),
                "strategy": key.inputs["strategy"],
                "bytes_written": written,
                "elapsed_s": round(elapsed, 2),
                "output_tail": tail,
                "report": error.fields.get("report"),
            },
        )

    # --- serving ------------------------------------------------------------------------

    def _serve_entry(self, root: CacheRoot, key: CacheKey, found: Lookup) -> int | None:
        self._register_use(root, key)
        if not self._published(root, key):
            # Pruned between our lookup and our use record: look again (prune re-checks users).
            release_use(self._use_record)
            return None
        if not self._missed:
            self.metrics.hits += 1
        assert found.manifest is not None  # a hit always has one
        if self.options.warm:
            log.info("already_published", key=key.short, entry=found.path.name)
            self.state.phase("stopped", exit_code=0, published=True)
            return 0
        views = self.options.state_dir / "views"
        view = build_view(views, found.path, found.manifest)
        argv = list(key.server.argv)
        env = dict(self.environ)
        if key.inputs["strategy"] == "vllm":
            env["VLLM_CACHE_ROOT"] = str(view)
        else:
            argv = render(argv, artifact_dir=str(view))
        env["CACHEMGR_ARTIFACT_DIR"] = str(view)
        url = self._health_url(key)
        self.state.update(health_url=url)
        self.state.phase("launching", entry=found.path.name)
        log.info("launching", key=key.short, entry=found.path.name, view=str(view))
        child = launcher.start(argv, env=env, capture=False, what="server")
        self.relay.attach(child)
        release_logs()
        self._watch_health(url, child)
        drift = self._watch_drift(root, key, found, view)
        threading.Thread(
            target=remove_old_views, args=(views,), kwargs={"keep": view}, name="cachemgr-views", daemon=True
        ).start()
        code = launcher.wait_reaping(child, reaper=self._reaper)
        self._server_exited.set()
        if drift is not None:
            drift.check()  # a compile-only server exits without ever serving
        self.state.phase("stopped", exit_code=code)
        return code

    def _watch_drift(self, root: CacheRoot, key: CacheKey, found: Lookup, view: Path) -> DriftWatch | None:
        """vllm strategy: new compiled artifacts in the view mean the key missed something."""
        if key.inputs["strategy"] != "vllm" or found.manifest is None:
            return None
        from cachemgr.volume import drift

        def report(paths: list[str]) -> None:
            self.metrics.recompiled_on_hit += 1
            log.warning(
                drift.EVENT,
                key=key.short,
                entry=found.path.name,
                new_paths=drift.shown(paths),
                count=len(paths),
                note="the server compiled although cachemgr found an entry: its key has an input cachemgr's lacks",
            )
            drift.record(root, key.digest, self.identity, entry=found.path.name, paths=paths)

        watch = drift.DriftWatch(view, found.manifest, report=report)
        watch.start(serving=lambda: self.state.current.phase == "serving", exited=self._server_exited)
        return watch

    def _register_use(self, root: CacheRoot, key: CacheKey) -> None:
        try:
            self._use_record = register_use(root, key.digest, self.identity, entry=key.entry_name)
        except OSError as error:
            # The hit path needs no write access; without it, prune cannot see this pod.
            log.warning("use_not_recorded", error=error.strerror, note="read-only volume?")
            return
        self._volume_beat.add(self._use_record)

    def _health_url(self, key: CacheKey) -> str | None:
        return self.options.health_url or default_health_url(key.server.host, key.server.port)

    def _watch_health(self, url: str | None, child: Any) -> None:
        """Launching -> serving when the server first answers; meanwhile watch the model load.

        A load that stops making progress (no CPU, no I/O, no output) for --stall-timeout is a
        stall, like a compile's: liveness fails and the kubelet restarts the pod.
        """
        if url is None:
            self.state.phase("serving")
            return
        monitor = launcher.ProgressMonitor(child, staging=None, output=None)

        def watch() -> None:
            next_sample = 0.0
            while not self._server_exited.is_set():
                if health_ok(url):
                    self.state.phase("serving")
                    return
                if time.monotonic() >= next_sample:
                    self._progress(monitor)
                    next_sample = time.monotonic() + 1.0
                self._server_exited.wait(0.25)

        threading.Thread(target=watch, name="cachemgr-health", daemon=True).start()


def _claim_state_dir(state_dir: Path) -> int:
    """Own the pod-local state dir, or refuse: another live run's record and views stay its own."""
    try:
        return claim_state_dir(state_dir)
    except StateDirBusy as busy:
        raise StateDirInUseError(
            f"another cachemgr run (pid {busy.pid}) owns the state dir {state_dir} and serves this pod",
            remedy="use 'cachemgr warm' to fill the cache, or give this run its own --state-dir "
            "(CACHEMGR_STATE_DIR); the running server is left alone",
            state_dir=str(state_dir),
            owner_pid=busy.pid,
        ) from None
    except OSError as error:
        raise ConfigError(
            f"cannot use the state dir {state_dir}: {error.strerror or error}",
            remedy="point --state-dir (CACHEMGR_STATE_DIR) at a writable pod-local directory (an emptyDir)",
            state_dir=str(state_dir),
        ) from None


class _DiskFullSeenError(Exception):
    """The compiler reported a full volume; turned into the full report by _as_reported."""


def _as_reported(
    error: BaseException,
    root: CacheRoot,
    key: CacheKey,
    *,
    given: int | None,
    written: int = 0,
    free_at_start: int | None = None,
) -> CacheMgrError | None:
    """The documented error for a failed attempt; None for a signal (nothing to record)."""
    from cachemgr.ops.space import disk_report

    if isinstance(error, Interrupted):
        return None
    figures: dict[str, Any] = {"given": given, "written": written, "free_at_start": free_at_start}
    if isinstance(error, _DiskFullSeenError):
        return disk_report(root, key, cause=str(error), **figures).error()
    if isinstance(error, CacheMgrError):
        return error
    if isinstance(error, OSError) and is_disk_full(error):
        cause = f"writing {error.filename}: {error.strerror}" if error.filename else str(error.strerror)
        return disk_report(root, key, cause=cause, **figures).error()
    if isinstance(error, OSError):
        return VolumeError(
            f"cache volume I/O failed: {error}", remedy="check the compile cache PVC and the node's mount"
        )
    return None


def _code(error: CacheMgrError) -> int:
    return error.code if isinstance(error, Interrupted) else int(error.exit_code)


def run(request: KeyRequest, options: RunOptions, *, environ: Mapping[str, str]) -> int:
    """Entry point for ``cachemgr run`` / ``cachemgr warm``; raises CacheMgrError on failure."""
    return Runner(request, options, environ=environ).run()


__all__ = ["ConfigError", "DiskFullError", "RunOptions", "Runner", "run"]
