"""The run's heartbeats: how peers, prune and the probes tell a live pod from a dead one.

Two daemon threads. The volume's touches this pod's use record (prune leaves an entry in use
alone) and the owner file of each staging attempt (a silent attempt is dead and may be
removed); the pod state's refreshes the state record the probes read. A frozen or killed
process stops both, and goes stale.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cachemgr.core.log import get_logger
from cachemgr.volume.records import HEARTBEAT_SECONDS, Heartbeat, register_use, release_use

if TYPE_CHECKING:
    from cachemgr.key.cachekey import CacheKey
    from cachemgr.runtime.state import StateWriter
    from cachemgr.volume.identity import PodIdentity
    from cachemgr.volume.layout import CacheRoot

log = get_logger("cachemgr.run")


class Heartbeats:
    """The volume's heartbeat and the pod state's, with this pod's use record."""

    def __init__(self, state: StateWriter, identity: PodIdentity) -> None:
        self.identity = identity
        self.volume = Heartbeat(interval=HEARTBEAT_SECONDS)
        self._state = Heartbeat(interval=state.current.heartbeat_interval)
        self._state.on_beat(state.beat)
        self._use_record: Path | None = None
        self._start = "hit"  # how this start got its entry: its use record's kind (records.STARTS)

    def start(self) -> None:
        self._state.start()
        self.volume.start()

    def stop(self) -> None:
        """Stop beating and end the use: the record goes into the entry's history (cachemgr stats)."""
        self.volume.stop()
        self._state.stop()
        release_use(self._use_record, ended=self._start)

    def add(self, path: Path, *, within: Path) -> None:
        """Keep ``path`` fresh (a staging attempt's owner file under root ``within``) until :meth:`discard`."""
        self.volume.add(path, within=within)

    def discard(self, path: Path) -> None:
        self.volume.discard(path)

    def use(
        self,
        root: CacheRoot,
        key: CacheKey,
        *,
        start: str = "hit",
        saved_s: float | None = None,
        waited_s: float | None = None,
    ) -> None:
        """Record that this pod uses the key's entry (and how it got it), and keep the record fresh."""
        self._start = start
        try:
            self._use_record = register_use(
                root,
                key.digest,
                self.identity,
                entry=key.entry_name,
                start=start,
                saved_s=saved_s,
                waited_s=waited_s,
            )
        except OSError as error:
            # The hit path needs no write access; without it, prune cannot see this pod.
            log.warning("use_not_recorded", error=error.strerror, note="read-only volume?")
            return
        self.volume.add(self._use_record, within=root.path)

    def release_use(self) -> None:
        """The entry went before this pod used it (pruned): no start to keep."""
        release_use(self._use_record)
