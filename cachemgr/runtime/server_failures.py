"""A server that exits before it is ready on a hit: the record, the message, and the opt-in policy.

An entry the server cannot load passes every check cachemgr makes (its files match its manifest,
a trusted key signed it), so the pods that hit it crash-loop while ``ls`` says it is fine. Each
such exit is recorded beside the entry (cachemgr.volume.serverfail), and the pod's error (the
launch step's ServerFailedError, cachemgr.runtime.launch) says how many it has and names the
command that removes the entry, in its one line and so in the termination message.

``--on-server-failure set-aside-after N`` (off by default): once the entry as it is now has N
recorded pre-ready exits, from any pods, the next start moves it to ``quarantine/`` (as a damaged
one is moved) and compiles afresh, once. Never when the key's earlier copy was set aside for the
same failure (the same exit status) and this one fails the same way: a fresh compile that fails
alike says the entry is not the cause, and setting it aside again would only loop compile, fail,
set aside. Nor while a live pod serves from it: a server loads it there.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

from cachemgr.core.errors import ServerFailedError
from cachemgr.core.log import get_logger
from cachemgr.core.units import plural
from cachemgr.volume import serverfail
from cachemgr.volume.records import read_usage

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cachemgr.key.cachekey import CacheKey
    from cachemgr.runtime.pod import Pod
    from cachemgr.volume.layout import CacheRoot
    from cachemgr.volume.store import Lookup

log = get_logger("cachemgr.run")


def recorded(
    pod: Pod, root: CacheRoot, key: CacheKey, found: Lookup, error: ServerFailedError
) -> ServerFailedError:
    """Record the exit beside the entry (not on a read-only volume); the error, saying how many
    such exits the entry has and what removes it (or, on a copy this pod just compiled after the
    copy before failed alike, that the entry is not the cause)."""
    code = int(error.fields["exit_status"])
    last_lines = [str(line) for line in error.fields.get("last_lines") or []]
    signame = error.fields.get("signal")
    instance = serverfail.instance_at(root, found.path.name)
    pod.metrics.server_failed += 1
    _record(pod, root, key, found, instance=instance, code=code, signame=signame, last_lines=last_lines)
    records = serverfail.read(root, key.digest)
    now = records.of(instance)
    count = f"; {plural(len(now), 'such exit')} recorded on it" if now else ""
    if pod.metrics.compiles > 0 and _same_as_before(records, instance, code):
        remedy = (
            "the entry is not the cause: this pod compiled it afresh and its server fails the same way as on "
            "the copy before it; read the server's last lines, check its flags and the node"
        )
    else:
        remedy = (
            f"if the server cannot load this entry, remove it: cachemgr prune --key {key.short} --yes (the next "
            f"start compiles afresh); 'cachemgr show {key.short}' has the last lines of each such exit"
        )
    return ServerFailedError(error.what + count, remedy=remedy, **error.fields, recorded=len(now))


def _record(
    pod: Pod,
    root: CacheRoot,
    key: CacheKey,
    found: Lookup,
    *,
    instance: str,
    code: int,
    signame: str | None,
    last_lines: Sequence[str],
) -> None:
    if not pod.records_use:
        log.info(
            "server_failure_not_recorded",
            key=key.short,
            reason="read-only volume: a hit writes nothing there",
        )
        return
    try:
        serverfail.write(
            root,
            key.digest,
            pod.identity,
            instance=instance,
            entry=found.path.name,
            exit_status=code,
            signal_name=signame,
            last_lines=last_lines,
            compiled_here=pod.metrics.compiles > 0,
        )
    except OSError as error:
        log.warning("server_failure_not_recorded", key=key.short, error=str(error))


# How long an earlier copy's failures count as evidence against a fresh one: a copy that worked for
# a month and then fails is judged on its own, not on what its predecessor did back then.
EVIDENCE_SECONDS = 24 * 3600


def _same_as_before(records: serverfail.Records, instance: str, code: int) -> bool:
    """An earlier copy of the key failed with this exit status too, recently."""
    since = time.time() - EVIDENCE_SECONDS
    return any(f.exit_status == code and f.time >= since for f in records.before(instance))


def should_set_aside(pod: Pod, root: CacheRoot, key: CacheKey, found: Lookup, *, after: int) -> bool:
    """The policy: N pre-ready exits on the entry as it is now, and nothing saying it is not the cause."""
    if pod.read_only or pod.cannot_compile:
        return False  # it could not compile a fresh copy: the entry stays for a publisher to replace
    usage = read_usage(root, key.digest)
    instance = serverfail.instance_at(root, found.path.name)
    if usage.server_failed.get(instance, 0) < after:
        return False
    records = serverfail.read(root, key.digest)
    now = records.of(instance)
    if len(now) < after:
        return False  # counted by name, but not records of ours (malformed): no action on those
    fields = {"key": key.short, "entry": found.path.name, "recorded": len(now)}
    if any(f.compiled_here and _same_as_before(records, instance, f.exit_status) for f in now):
        log.warning(
            "server_failure_not_set_aside",
            **fields,
            reason="a fresh compile of this key fails the same way as the copy set aside before: "
            "the entry is not the cause (check the server's flags and the node)",
        )
        return False
    if usage.live or usage.silent:  # a silent record may be a live pod on a node whose clock differs
        users = ", ".join(u.pod for u in (*usage.live, *usage.silent))
        log.warning(
            "server_failure_not_set_aside", **fields, reason=f"in use by {users}: a server loads it there"
        )
        return False
    return True


def set_aside(root: CacheRoot, key: CacheKey, found: Lookup, *, after: int) -> bool:
    """Move the entry to quarantine with the reason (True: the caller then compiles afresh).

    As prune does: a pod that registered its use between the check and the move (a rollout's
    replicas start together) gets the entry back, put back where it was before it can miss it.
    Any use record counts then, silent ones too: :func:`should_set_aside` saw none, and a pod on a
    node whose clock is off by more than the in-use window writes one this node reads as silent
    (on JuiceFS a record's mtime is the writing client's clock).
    """
    from cachemgr.core import safefs
    from cachemgr.volume.store import quarantine

    reason = f"its server exited before ready {after}+ {'time' if after == 1 else 'times'} (--on-server-failure set-aside-after {after})"
    moved = quarantine(root, found.path, reason=reason)
    if moved is None:
        return False  # another pod moved it first: look again
    usage = read_usage(root, key.digest)
    if usage.live or usage.silent:
        safefs.rename(root.path, moved, found.path)
        with contextlib.suppress(OSError):
            safefs.unlink(root.path, moved.with_name(moved.name + ".reason.json"))
        users = ", ".join(u.pod for u in (*usage.live, *usage.silent))
        log.warning(
            "server_failure_not_set_aside",
            key=key.short,
            entry=found.path.name,
            reason=f"{users} began to use it as it was set aside: put back",
        )
        return False
    log.warning("entry_set_aside", key=key.short, entry=found.path.name, reason=reason, moved_to=str(moved))
    return True
