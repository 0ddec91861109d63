"""What a strategy and the lease step may use of the run that calls them: the narrow interface.

:class:`cachemgr.runtime.runner.Runner` is the one implementation. The strategies
(cachemgr.runtime.strategies), the waits on peers (cachemgr.runtime.waiting) and the handling of
unusable entries (cachemgr.runtime.unusable) see a run only
through this protocol, so neither imports the runner back: the flow goes one way, runner to
strategy, never round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import threading

    from cachemgr.key.cachekey import CacheKey
    from cachemgr.ops.space import Preflight
    from cachemgr.runtime.health import StallWatch
    from cachemgr.runtime.heartbeats import Heartbeats
    from cachemgr.runtime.launcher import SignalRelay
    from cachemgr.runtime.metrics import Metrics
    from cachemgr.runtime.options import RunOptions
    from cachemgr.runtime.state import Phase, StateWriter
    from cachemgr.volume.identity import PodIdentity
    from cachemgr.volume.layout import CacheRoot
    from cachemgr.volume.lease import KeyLease
    from cachemgr.volume.store import Lookup, Staging


class Pod(Protocol):
    """One pod start as its strategy and its lease step see it."""

    options: RunOptions
    environ: dict[str, str]
    identity: PodIdentity
    relay: SignalRelay
    state: StateWriter
    metrics: Metrics
    beats: Heartbeats
    stall: StallWatch
    reaper: bool
    server_exited: threading.Event
    preflight_found: Preflight | None
    read_only: bool  # the volume cannot be written by this pod: a hit writes nothing there
    records_use: bool  # but it can write use records: usage/ (beside the server-failure ones)

    @property
    def cannot_compile(self) -> bool: ...

    @property
    def why_not_compiling(self) -> str: ...

    def enter(self, phase: Phase, **detail: Any) -> None:
        """Enter a phase before the server runs; raises Interrupted after a termination signal."""

    def find(self, root: CacheRoot, key: CacheKey) -> Lookup | None: ...

    def published(self, root: CacheRoot, key: CacheKey) -> bool: ...

    def new_staging(self, root: CacheRoot, key: CacheKey) -> Staging: ...

    def publish(
        self, root: CacheRoot, key: CacheKey, staging: Staging, lease: KeyLease, *, seconds: float
    ) -> None: ...

    def health_url(self, key: CacheKey) -> str | None: ...
