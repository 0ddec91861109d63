"""What ``cachemgr run`` / ``warm`` take besides the key's inputs (see ``cachemgr run --help``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple

from cachemgr.volume.lease_defaults import DEFAULT_DURATION as DEFAULT_LEASE_DURATION
from cachemgr.volume.manifest import VerifyMode
from cachemgr.volume.stale import stale_staging_after

if TYPE_CHECKING:
    from cachemgr.core.signing import SecretKey, TrustedKeys
    from cachemgr.ops.space import SpaceCheck
    from cachemgr.remote.config import RemoteConfig

OnMiss = Literal["compile", "fail"]


class RunOptions(NamedTuple):
    """Everything ``run``/``warm`` take besides the key inputs (see ``cachemgr run --help``)."""

    cache_root: Path
    state_dir: Path
    on_miss: OnMiss = "compile"
    lease_duration: float = DEFAULT_LEASE_DURATION
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
    # A warm Job run as the chart's pre-upgrade hook (CACHEMGR_WARM_HOOK, which the chart sets):
    # a full volume's remedy says what works before any pod rolls.
    hook: bool = False
    # compile_progress and waiting_for_compile, at most once per this (cachemgr.ops.progress.DEFAULT_INTERVAL)
    progress_interval: float = 30.0
    remote: RemoteConfig | None = None  # the remote tier (cachemgr.remote); off by default
    # Trust (cachemgr.volume.trust): a publisher signs what it publishes with its signing key; a
    # pod with trusted keys uses only entries one of them signed (its own key among them).
    signing_key: SecretKey | None = None
    trusted: TrustedKeys | None = None
    prefetch: Literal["auto", "off"] = "auto"  # read-ahead after a hit's launch (cachemgr.runtime.prefetch)
    # --on-server-failure set-aside-after N (None: off): cachemgr.runtime.server_failures.
    on_server_failure: int | None = None

    @property
    def stale_staging_after(self) -> float:
        """An attempt silent this long is dead: far beyond its 10s heartbeat and the lease."""
        return stale_staging_after(self.lease_duration)
