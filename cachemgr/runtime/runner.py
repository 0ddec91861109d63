"""``cachemgr run`` and ``cachemgr warm``: key, lookup, lease, compile, publish, launch.

The flow, in one direction::

    key      compiler major.minor + NPU type + serving config -> digest
    lookup   published entry for the digest? (lock-free, read-only; damaged -> quarantined)
    trust    with trusted keys: signed by one of them, every file's bytes as signed (else a miss)
    hit      launch the server against a pod-local view of the entry; supervise it
    miss     take the key's lease (or wait while a peer compiles, watching for its publish)
             look again; clean dead attempts; check space
             compile into private staging (the key's strategy); manifest last; publish by one rename
             release the lease; launch as on a hit

``warm`` is the same flow for a Job: it exits 0 once the entry is published (or found).

A pod that cannot publish what it compiles (the volume is read-only to it, or it trusts keys
but holds no signing key) never compiles: on a miss it takes a trusted copy from the remote
tier if it can write the volume, else waits for a publisher (``--on-miss compile``) or fails
as ``--on-miss fail`` does. On a read-only volume a hit writes nothing there at all.

The flow only: compiling and pointing a server at an entry is cachemgr.runtime.strategies', failures
are cachemgr.runtime.failures', the launch (and the pass-through of what cannot be cached) .launch's.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any

from cachemgr.core.errors import CacheMgrError, ConfigError, DiskFullError, VolumeError
from cachemgr.core.log import get_logger
from cachemgr.core.log import hold as hold_logs
from cachemgr.core.log import release as release_logs
from cachemgr.key.cachekey import CacheKey, KeyRequest, compute_key
from cachemgr.runtime import failures, launcher
from cachemgr.runtime.health import StallWatch, default_health_url
from cachemgr.runtime.heartbeats import Heartbeats
from cachemgr.runtime.launch import launch, pass_through
from cachemgr.runtime.metrics import Metrics
from cachemgr.runtime.options import RunOptions
from cachemgr.runtime.state import Phase, StateWriter
from cachemgr.runtime.strategies import STRATEGIES, Compiled, Strategy
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import CacheRoot, is_read_only, is_writable_folder, open_root
from cachemgr.volume.manifest import MANIFEST_NAME
from cachemgr.volume.stale import clean_stale_staging
from cachemgr.volume.store import Lookup, Staging, create_staging, lookup, publish

if TYPE_CHECKING:
    from cachemgr.ops.space import Preflight
    from cachemgr.remote.hooks import FetchOutcome, Upload
    from cachemgr.runtime.unusable import Unusable
    from cachemgr.runtime.waiting import Waiting
    from cachemgr.volume.lease import KeyLease

log = get_logger("cachemgr.run")

_MAX_ROUNDS = 4  # lookups after quarantining damaged entries; more means something keeps breaking them


class Runner:
    """One pod start: owns the signal relay, the state record and the heartbeats."""

    def __init__(self, request: KeyRequest, options: RunOptions, *, environ: Mapping[str, str]) -> None:
        self.request = request
        self.options = options
        self.environ = dict(environ)
        self.identity = PodIdentity.current(environ)
        self.relay = launcher.SignalRelay()
        # warm writes no probe state: typed into a serving pod it must not replace the live record.
        self._claim = None if options.warm else failures.own_state_dir(options.state_dir)
        self.state = StateWriter(
            None if options.warm else options.state_dir, stall_timeout=options.stall_timeout
        )
        self.metrics = Metrics()
        self.state.on_change(self.metrics.on_phase)
        self.beats = Heartbeats(self.state, self.identity)
        self.stall = StallWatch(self.state, stall_timeout=options.stall_timeout)
        self.reaper = False
        self.server_exited = threading.Event()
        self.preflight_found: Preflight | None = None
        self.key: CacheKey | None = None  # once resolved
        self._missed = False
        self._published_here = False  # this start's own publish landed (not a peer's, kept instead)
        self._upload: Upload | None = None
        self._fetched: FetchOutcome | None = None
        self.read_only = False  # the volume cannot be written by this pod (set once it is opened)
        # It can write use records: the volume is writable, or its usage/ is (a mount of its own).
        self.records_use = True
        self._set_aside = False  # --on-server-failure moved the entry aside: at most once per start

    # --- the flow ---------------------------------------------------------------------

    def run(self) -> int:
        # Hold log events until the server is launched or the path turns into a miss: a warm
        # start does not wait for the logging library's import (see cachemgr.core.log).
        hold_logs()
        self.relay.install()
        self.reaper = launcher.become_subreaper() or os.getpid() == 1
        self.beats.start()
        status = None
        try:
            status = self._start_status_server()
            return self._run()
        except CacheMgrError as error:
            failures.count_failed_run(error, metrics=self.metrics, state=self.state)
            raise
        finally:
            release_logs()
            self._finish_upload()
            if status is not None:
                status.close()
            self.beats.stop()
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
        if key.details.get("layout_uncacheable"):  # the compiler keeps them (0.11.1's vLLM path); warm: 78
            return pass_through(self, key)
        strategy = STRATEGIES[str(key.inputs["strategy"])](self)
        root = open_root(self.options.cache_root, create=False)
        self.read_only = is_read_only(root.path)
        if self.read_only:
            # The chart mounts usage/ read-write over a read-only volume (trust.recordUse): the
            # pod's use is then seen by prune as any other's; nothing else is written.
            self.records_use = is_writable_folder(root.usage)
            note = "a hit writes only its use record (usage/ is writable)" if self.records_use else None
            log.info("read_only_volume", cache_root=str(root.path), note=note or "a hit writes nothing there")
        for _ in range(_MAX_ROUNDS):
            found = self.find(root, key)
            if found is None and not self._missed:
                # Counted once per start: later lookups (after our own publish) are not hits.
                self._missed = True
                self.metrics.misses += 1
            if found is None and self.cannot_compile:
                found = self._miss_without_compiling(root, key, strategy)
            elif found is None and self.options.on_miss == "fail":
                found = self.waiting.for_peer(root, key)
            if found is None:
                strategy.check_can_compile(key)
                root = self._open_for_writing(root, key)
                compiled = self._compile_under_lease(root, key, strategy)
                if compiled.exit_code is not None:
                    return compiled.exit_code
                if self.options.warm and self._published_here:
                    # A warm Job's work ends at its own publish: a SIGTERM in its upload wait does not
                    # fail it (a peer's entry kept instead of ours is looked up as any other).
                    self.state.phase("stopped", exit_code=0, published=True)
                    return 0
                found = compiled.found
            if found is not None and self._use(root, key, found):
                return self._launch(root, key, found, strategy)
        # The volume, not a compile (which may have succeeded every time): 74, as for any volume
        # that cannot be used (fuzzer seed 7474 trial 183: a swapped entry, then entries set aside
        # as untrusted, ended a pod with exit 70, "compile-failed").
        raise VolumeError(
            f"the entry for key {key.short} kept disappearing or breaking after {_MAX_ROUNDS} lookups "
            "(each set aside as damaged or untrusted, or gone, as this pod came to use it)",
            remedy="something else writes entries/ on this volume: 'cachemgr ls' lists what was set aside "
            "(QUARANTINE, with the reason); check the volume's health and who else writes it",
        )

    def _resolve(self) -> CacheKey:
        started = time.monotonic()
        key = self.key = compute_key(self.request)
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
        for note in key.notes:  # a key made by strict rules, a snapshot it could not resolve
            log.warning("key_note", key=key.short, note=note)
        return key

    def enter(self, phase: Phase, **detail: Any) -> None:
        """Enter a phase before the server runs: where a termination signal ends the run.

        Every phase passes through here (and every lookup through :meth:`find`): a signal that
        came during key resolution, a lookup, the view's build, a wait or a publish ends the run
        at the next of them with 128+N (cachemgr.runtime.launcher.SignalRelay.check); the spawn
        itself checks again under the relay.
        """
        self.relay.check()
        self.state.phase(phase, **detail)

    def find(self, root: CacheRoot, key: CacheKey) -> Lookup | None:
        """A verified (and with trusted keys, trusted) hit, or None; a damaged or untrusted entry
        is moved aside where this pod may (cachemgr.runtime.unusable), and counts as a miss."""
        self.relay.check()  # a signal since the last step: no lookup, no use record, no launch
        seen = self.unusable.fingerprint(root, key) if self.cannot_compile else None
        if seen is not None and self.unusable.known(seen):
            return None
        try:
            found = lookup(
                root, key, mode=self.options.verify, trusted=self.options.trusted, stop=self.relay.stop
            )
        except InterruptedError:
            raise failures.interrupted(self.relay) from None  # SIGTERM while the content was checked
        except OSError as error:
            raise failures.unreadable_entry(error, root, key) from error
        if found.status == "hit":
            return None if self._set_aside_failing(root, key, found) else found
        if found.status != "miss":
            self.unusable.set_aside(root, found, seen)
        return None

    def _set_aside_failing(self, root: CacheRoot, key: CacheKey, found: Lookup) -> bool:
        """--on-server-failure: an entry its servers keep failing on goes aside, once per start."""
        after = self.options.on_server_failure
        if after is None or self._set_aside or self.options.warm:  # warm launches no server to judge by
            return False
        from cachemgr.runtime import server_failures

        try:
            self._set_aside = server_failures.should_set_aside(
                self, root, key, found, after=after
            ) and server_failures.set_aside(root, key, found, after=after)
        except (OSError, CacheMgrError) as error:  # a link planted in usage/ or quarantine/: serve the hit
            log.warning("server_failure_policy_skipped", key=key.short, error=str(error))
            self._set_aside = True  # once per start: not again on the next lookup
            return False
        return self._set_aside

    @cached_property
    def unusable(self) -> Unusable:
        """Damaged and untrusted entries: moved aside, or left and remembered (not on a hit)."""
        from cachemgr.runtime.unusable import Unusable

        return Unusable(self)

    def published(self, root: CacheRoot, key: CacheKey) -> bool:
        """A committed entry is there, other than one this pod already found unusable."""
        if not (root.entry_path(key) / MANIFEST_NAME).is_file():
            return False
        unusable: Unusable | None = self.__dict__.get("unusable")  # the cached_property, once made
        return unusable is None or not unusable.known(unusable.fingerprint(root, key))

    # --- who may compile ---------------------------------------------------------------

    @property
    def cannot_compile(self) -> bool:
        """This pod could not publish what it compiled: it only takes what a publisher made."""
        return self.read_only or (bool(self.options.trusted) and self.options.signing_key is None)

    @property
    def why_not_compiling(self) -> str:
        if self.read_only:
            return "the cache volume is read-only to this pod"
        return (
            "this pod trusts signing keys (CACHEMGR_TRUSTED_KEYS) but holds none (CACHEMGR_SIGNING_KEY_FILE)"
        )

    def _miss_without_compiling(self, root: CacheRoot, key: CacheKey, strategy: Strategy) -> Lookup | None:
        """A trusted copy from the remote if this pod can write the volume; else wait or fail."""
        if self.options.warm:
            raise ConfigError(
                f"this warm Job cannot fill the cache for key {key.short}: {self.why_not_compiling}",
                remedy="give the warm Job the signing key (CACHEMGR_SIGNING_KEY_FILE) and the volume read-write",
            )
        found = None
        if not self.read_only and self.options.remote is not None:
            root = self._open_for_writing(root, key)
            found = self._compile_under_lease(root, key, strategy).found
        return found or self.waiting.for_peer(
            root, key, until_published=self.options.on_miss == "compile", why=self.why_not_compiling
        )

    # --- a miss: wait for a peer, or take the lease and compile --------------------------

    @cached_property
    def waiting(self) -> Waiting:
        """The lease step: waits on peers (imported on a miss only)."""
        from cachemgr.runtime.waiting import Waiting

        return Waiting(self)

    def _open_for_writing(self, root: CacheRoot, key: CacheKey) -> CacheRoot:
        """The layout a miss needs; a volume too full even for that gets the full space report."""
        from cachemgr.ops.space import disk_report

        try:
            return open_root(self.options.cache_root, create=True)
        except DiskFullError as error:
            raise disk_report(
                root, key, cause=error.what, given=self.options.expected_size, hook=self.options.hook
            ).error() from error

    def _compile_under_lease(self, root: CacheRoot, key: CacheKey, strategy: Strategy) -> Compiled:
        """Take the lease (or wait for a peer's publish), then compile unless the entry turned up."""
        release_logs()  # a miss takes seconds to minutes: log as it happens from here on
        lease = self.waiting.take_lease(root, key)
        if lease is None:
            return Compiled()  # a peer published: look again
        try:
            found = self.find(root, key)
            if found is not None:
                return Compiled(found=found)  # a peer published just before we took over
            # Dead attempts go before the download: their space may be what the entry needs.
            removed = clean_stale_staging(
                root, key.digest, stale_after=self.options.stale_staging_after, identity=self.identity
            )
            if removed:
                log.info("stale_staging_removed", key=key.short, attempts=[p.name for p in removed])
            if self._fetch_remote(root, key):
                return Compiled(found=self.find(root, key))  # the remote had it: launch it now
            if self.cannot_compile:
                return Compiled()  # nothing this pod may publish: it waits for a publisher
            self._preflight(root, key)
            return strategy.compile(root, key, lease)
        finally:
            lease.release()

    def _preflight(self, root: CacheRoot, key: CacheKey) -> None:
        """Room for the compile (cachemgr.ops.space); a volume without it gets a failure record."""
        try:
            if self.options.auto_prune == "incompatible":
                from cachemgr.ops.prune import prune_incompatible_for_space  # only when asked

                prune_incompatible_for_space(root, key, given=self.options.expected_size)
            from cachemgr.ops.space import preflight  # scans the volume: the miss path only

            found = preflight(
                root,
                key,
                given=self.options.expected_size,
                check=self.options.space_check,
                environ=self.environ,
                hook=self.options.hook,
            )
        except CacheMgrError as error:
            failures.record(root, key, self.identity, error)
            raise
        self.preflight_found = found
        expectation = found.expectation
        self.state.update(detail={"expected_bytes": expectation.bytes, "expected_source": expectation.source})

    # --- what strategies call: staging and publishing -----------------------------------

    def new_staging(self, root: CacheRoot, key: CacheKey) -> Staging:
        """A private attempt directory, kept fresh by the volume's heartbeat."""
        try:
            staging = create_staging(root, key, self.identity)
        except OSError as error:
            raise failures.staging_failed(error, root, key, self.options) from error
        self.beats.add(staging.owner_file, within=root.path, restore=staging.restore_owner)
        return staging

    def publish(
        self, root: CacheRoot, key: CacheKey, staging: Staging, lease: KeyLease, *, seconds: float
    ) -> None:
        if lease.lost:
            log.warning(
                "publishing_after_lease_lost", key=key.short, note="first publisher wins; ours may be dropped"
            )
        self.enter("publishing")
        # Use before publishing: a prune running now sees the new entry in use and leaves it.
        self.beats.use(root, key, start="compiled", saved_s=0.0)
        outcome = publish(
            root,
            staging,
            key,
            identity=self.identity,
            compile_seconds=seconds,
            strategy=str(key.inputs["strategy"]),
            signer=self.options.signing_key,
        )
        self._published_here = outcome.published
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

    def health_url(self, key: CacheKey) -> str | None:
        return self.options.health_url or default_health_url(key.server.host, key.server.port)

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
            beat=self.beats.volume,
            stop=self.relay.stop,
            trusted=self.options.trusted,
            compiling=not self.cannot_compile,
        )
        if self._fetched != "hit" and self.relay.stop.is_set():
            raise failures.interrupted(self.relay)
        return self._fetched == "hit"

    def _finish_upload(self) -> None:
        """A stopping pod waits a bounded time for its upload, SIGTERM or not (a warm Job: longer)."""
        if self._upload is not None:
            self._upload.finish(warm=self.options.warm, stop=self.relay.stop)

    # --- launching --------------------------------------------------------------------

    def _use(self, root: CacheRoot, key: CacheKey, found: Lookup) -> bool:
        """Record this pod's use of the entry; False if it was pruned meanwhile (look again).
        On a read-only volume without a writable usage/ there is no record: the use is in the
        pod's state record only, and prune cannot see it (docs/design.md, "The threat model")."""
        if not self.records_use:
            return self.published(root, key)
        if self.metrics.compiles:
            return self.published(root, key)  # registered when it published (Runner.publish)
        start, saved, waited = self._start_kind(found)
        self.beats.use(root, key, start=start, saved_s=saved, waited_s=waited)
        if self.published(root, key):
            return True
        # Pruned between our lookup and our use record: look again (prune re-checks users).
        self.beats.release_use()
        return False

    def _start_kind(self, found: Lookup) -> tuple[str, float, float | None]:
        """How this start got the entry, the compile time that saved, and how long it waited."""
        compile_s = float(found.manifest.compile_seconds or 0.0) if found.manifest is not None else 0.0
        if self._fetched == "hit":
            return (
                "fetched",
                0.0,
                None,
            )  # downloaded instead of compiling: the remote's saving, not the volume's
        if self._missed:
            waited = self.metrics.lease_wait_seconds
            return "waited", max(0.0, compile_s - waited), waited
        return "hit", compile_s, None

    def _launch(self, root: CacheRoot, key: CacheKey, found: Lookup, strategy: Strategy) -> int:
        """Count how this start got the entry, then the launch step (cachemgr.runtime.launch)."""
        if not self._missed:
            self.metrics.hits += 1
        if not self.metrics.compiles:
            self.metrics.saved_seconds += self._start_kind(found)[1]
        return launch(self, root, key, found, strategy)


def run(request: KeyRequest, options: RunOptions, *, environ: Mapping[str, str]) -> int:
    """Entry point for ``cachemgr run`` / ``cachemgr warm``; raises CacheMgrError on failure."""
    return Runner(request, options, environ=environ).run()


__all__ = ["RunOptions", "Runner", "run"]
