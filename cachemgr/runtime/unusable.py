"""What a pod does with an entry it cannot use: damaged, or not what a trusted publisher built.

A damaged entry is moved to ``quarantine/`` by any pod that can write the volume (it is compiled
again). An untrusted one is moved aside only by a pod that publishes its own instead (it holds the
signing key): nothing is deleted for being untrusted, and a pod that cannot replace it leaves it
where it is, warns once, and remembers it by what it is (the entry's and its manifest's inodes and
times), so that a wait for a publisher neither reads it again nor takes it for one; a publish
replaces the entry by a rename, which gives it other inodes. Imported only when a lookup finds
such an entry, or by a pod that cannot compile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cachemgr.core import safefs
from cachemgr.core.errors import VolumeError
from cachemgr.core.log import get_logger
from cachemgr.volume.manifest import MANIFEST_NAME
from cachemgr.volume.store import quarantine

if TYPE_CHECKING:
    from cachemgr.key.cachekey import CacheKey
    from cachemgr.runtime.pod import Pod
    from cachemgr.volume.layout import CacheRoot
    from cachemgr.volume.store import Lookup

log = get_logger("cachemgr.run")

Fingerprint = tuple[int, ...]


class Unusable:
    """One run's damaged and untrusted entries."""

    def __init__(self, pod: Pod) -> None:
        self.pod = pod
        self._left: set[Fingerprint] = set()

    def known(self, seen: Fingerprint | None) -> bool:
        return seen is not None and seen in self._left

    def set_aside(self, root: CacheRoot, found: Lookup, seen: Fingerprint | None) -> None:
        pod = self.pod
        damaged = found.status == "damaged"
        event = "entry_damaged" if damaged else "entry_untrusted"
        if damaged:
            pod.metrics.damaged += 1
        else:
            pod.metrics.untrusted += 1
        fields = {"problems": found.reason} if damaged else {"reason": found.reason, "signer": found.signer}
        if not pod.read_only and (damaged or not pod.cannot_compile):
            try:
                moved = quarantine(root, found.path, reason=found.reason)
            except PermissionError as error:  # entries/ or quarantine/ another user's (a root shell's)
                raise VolumeError(
                    f"cannot move the {'damaged' if damaged else 'untrusted'} entry {found.path} aside, nor "
                    f"publish over it: {error}",
                    remedy="give the pods' user (the chart's fsGroup) write access to entries/ and quarantine/, "
                    f"or remove the entry as its owner: cachemgr prune --key {found.path.name[-16:]} --yes",
                    path=str(found.path),
                ) from None
            log.warning(event, entry=found.path.name, **fields, moved_to=str(moved))
            return
        if seen is not None:
            self._left.add(seen)
        who = "a publisher with the signing key" if pod.options.trusted else "a pod that can write the volume"
        # A trusted copy from the remote replaces it too (cachemgr.remote.hooks), where this pod may write.
        remote = not damaged and not pod.read_only and pod.options.remote is not None
        log.warning(
            event,
            entry=found.path.name,
            **fields,
            moved_to=None,
            note=f"left in place: {pod.why_not_compiling}; {who} (the builder, a warm Job) moves it aside "
            "and publishes its own"
            + ("; so does a trusted copy from the remote tier, if it has one" if remote else ""),
        )

    def fingerprint(self, root: CacheRoot, key: CacheKey) -> Fingerprint | None:
        """What the key's entry is now; None if there is none (or it cannot be looked at)."""
        path = root.entry_path(key)
        try:
            entry = safefs.lstat(root.path, path)
            manifest = safefs.lstat(root.path, path / MANIFEST_NAME) if entry is not None else None
        except OSError:
            return None
        if entry is None or manifest is None:
            return None
        return (entry.st_dev, entry.st_ino, manifest.st_ino, manifest.st_mtime_ns, manifest.st_size)
