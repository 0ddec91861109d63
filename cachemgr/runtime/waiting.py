"""While a peer compiles: take the key's lease or wait for its publish, and say how the wait goes.

A waiting pod shows the holder and its progress in the state record every few seconds and logs
``waiting_for_compile`` once per progress interval. ``--on-miss fail`` never takes the lease: it
waits only while a live holder compiles (a warm Job), and fails with exit 69 otherwise. A pod
that cannot publish (a read-only volume, trusted keys without a signing key) waits the same way;
with ``--on-miss compile`` it waits for a publisher even while none compiles (``--wait-timeout``
bounds it), having said once why it does not compile itself (``waiting_for_publisher``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from cachemgr.core.errors import MissError
from cachemgr.core.log import get_logger
from cachemgr.core.log import release as release_logs
from cachemgr.runtime import failures

if TYPE_CHECKING:
    from cachemgr.key.cachekey import CacheKey
    from cachemgr.ops.meter import Every
    from cachemgr.runtime.pod import Pod
    from cachemgr.volume.layout import CacheRoot
    from cachemgr.volume.lease import Holder, KeyLease
    from cachemgr.volume.store import Lookup

log = get_logger("cachemgr.run")


class Waiting:
    """One run's waits on its peers (the flow's lease step)."""

    def __init__(self, pod: Pod) -> None:
        self.pod = pod
        self._log: Every | None = None

    def for_peer(
        self, root: CacheRoot, key: CacheKey, *, until_published: bool = False, why: str | None = None
    ) -> Lookup | None:
        """Wait for a compile already under way (a warm Job), never start one.

        ``until_published``: also while no one compiles (a pod that cannot publish, waiting for
        the builder); ``why`` says why this pod does not compile itself.
        """
        from cachemgr.ops.meter import Every
        from cachemgr.volume.lease import marker_path, read_holder  # the miss path only
        from cachemgr.volume.softlease import MarkerWatch, patience, read_marker_view

        release_logs()  # a wait takes seconds to hours: log as it happens from here on
        started = time.monotonic()
        notify = Every(min(5.0, self.pod.options.progress_interval))
        # A holder is dead once its marker stops changing, by this node's clock: the marker's
        # mtime against our wall clock would misjudge a holder on a node with a skewed clock.
        watch = MarkerWatch()
        if why is not None:
            log.warning(
                "waiting_for_publisher",
                key=key.short,
                entry=key.entry_name,
                reason=why,
                on_miss=self.pod.options.on_miss,
                note=(
                    "run the builder (a warm Job with the signing key) for this configuration"
                    if self.pod.options.trusted
                    else "run a warm Job for this configuration where the volume is writable"
                )
                if until_published
                else "fails unless a compile is under way",
            )
        while True:
            # The signal first: a peer publishing just as this pod is stopped starts no server here.
            if self.pod.relay.stop.is_set():
                raise failures.interrupted(self.pod.relay)
            if self.pod.published(root, key):
                found = self.pod.find(root, key)
                if found is not None:
                    return found
            holder = read_holder(root, key.digest) if root.leases.is_dir() else None
            view = read_marker_view(marker_path(root, key.digest)) if holder is not None else None
            silent = watch.silent_for(view)
            live = not (
                holder is None
                or view is None
                or silent > patience(view.record, default=self.pod.options.lease_duration)
            )
            if not live and not until_published:
                raise _miss(key, why)
            if notify.due():
                self._on_wait(holder if live else None, time.monotonic() - started, root=root, key=key)
            timeout = self.pod.options.wait_timeout
            if timeout is not None and time.monotonic() - started >= timeout:
                raise failures.wait_timeout(root, key, time.monotonic() - started, publisher=until_published)
            self.pod.relay.stop.wait(0.2)

    def take_lease(self, root: CacheRoot, key: CacheKey) -> KeyLease | None:
        """The key's lease, or None once a peer has published while this pod waited."""
        from cachemgr.volume.lease import KeyLease  # imported on a miss only

        lease = KeyLease(
            root,
            key.digest,
            self.pod.identity,
            duration=self.pod.options.lease_duration,
            heartbeat=self.pod.options.lease_heartbeat,
            confirm=self.pod.options.lease_confirm,
            entry=key.entry_name,
        )
        started = time.monotonic()
        try:
            outcome = lease.wait_or_acquire(
                published=lambda: self.pod.published(root, key),
                stop=self.pod.relay.stop,
                wait_timeout=self.pod.options.wait_timeout,
                on_wait=lambda holder, waited: self._on_wait(holder, waited, root=root, key=key),
                notify_every=min(5.0, self.pod.options.progress_interval),
            )
        except TimeoutError:
            raise failures.wait_timeout(root, key, time.monotonic() - started) from None
        except InterruptedError:
            raise failures.interrupted(self.pod.relay) from None
        except OSError as error:
            # Taking the lease writes its marker file: on a full volume that write fails first.
            options = self.pod.options
            reported = failures.as_reported(error, root, key, given=options.expected_size, hook=options.hook)
            if reported is None:
                raise
            failures.record(root, key, self.pod.identity, reported)
            raise reported from error
        self.pod.metrics.lease_wait_seconds += time.monotonic() - started
        if outcome == "published":
            log.info("peer_published", key=key.short, waited_s=round(time.monotonic() - started, 2))
            return None
        return lease

    def _on_wait(self, holder: Holder | None, waited: float, *, root: CacheRoot, key: CacheKey) -> None:
        """Called while a peer compiles: the state every few seconds, a log line per progress interval."""
        from cachemgr.ops.meter import Every
        from cachemgr.ops.progress import holder_detail

        detail: dict[str, Any] = {"waited_s": round(waited)}
        if holder is not None and holder.current:
            detail.update(holder=holder.pod, holder_node=holder.node, held_for_s=round(holder.held_for))
            detail.update(holder_detail(root, key.digest, token=holder.token))
        if self._log is None:
            self._log = Every(self.pod.options.progress_interval)
        if self._log.due():
            log.info("waiting_for_compile", **detail)
        state = self.pod.state
        if state.current.phase != "waiting":
            self.pod.enter("waiting", **detail)
        else:
            state.update(detail=detail)


def _miss(key: CacheKey, why: str | None) -> MissError:
    """Exit 69: no entry this pod may use, and no compile under way to wait for."""
    if why is None:
        return MissError(
            f"no published entry for key {key.short} ({key.entry_name}) and --on-miss fail forbids "
            "compiling in this pod",
            remedy="run the cachemgr warm Job for this configuration, or use --on-miss compile; "
            "'cachemgr explain -- ARGV' shows the nearest entries",
        )
    return MissError(
        f"no entry this pod may use for key {key.short} ({key.entry_name}), no compile under way, and this "
        f"pod does not compile: {why}",
        remedy="run the builder (a cachemgr warm Job with the signing key) for this configuration, or use "
        "--on-miss compile to wait for it; 'cachemgr explain -- ARGV' says why an entry there is not used",
    )
