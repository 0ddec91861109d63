"""The runner's two calls into the remote tier: fetch on a local miss, upload after a publish.

fetch (the lease holder, after its re-check found no entry)
    download the remote entry into private staging, check every file against the manifest,
    record where it came from, and publish by the same rename as a compile. Anything wrong, be
    it a damaged entry, an unreachable or slow store, refused credentials, a full volume, or
    CACHEMGR_REMOTE_BUDGET running out, ends in one warning and ``False``: the pod compiles.

upload (after this pod published a compile)
    a daemon thread uploads the entry, manifest last, while the server starts. A stopping
    ``run`` waits for it up to CACHEMGR_REMOTE_UPLOAD_WAIT (``warm`` up to the budget); a pod
    that dies first leaves objects no manifest names, which no reader takes (``cachemgr push``
    uploads the entry later; ``prune --remote --stale-uploads`` removes the leftovers).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from cachemgr.core import jsonread
from cachemgr.core.fsutil import atomic_write_json, hash_fd, is_disk_full, walk_files
from cachemgr.core.log import get_logger
from cachemgr.remote.config import RemoteConfig, client_missing, malformed_credential, not_installed
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.manifest import KEY_NAME, MANIFEST_NAME, SUMMARY_NAME, FileRecord, Manifest
from cachemgr.volume.store import commit, create_staging, lookup, quarantine

if TYPE_CHECKING:
    from cachemgr.core.signing import TrustedKeys
    from cachemgr.key.cachekey import CacheKey
    from cachemgr.remote.bounded import BoundedRemote
    from cachemgr.remote.transfer import Moved, Progress, Remote, StopFlag
    from cachemgr.volume.identity import PodIdentity
    from cachemgr.volume.records import Heartbeat
    from cachemgr.volume.store import PublishOutcome

log = get_logger("cachemgr.remote")


class RemoteCounters(Protocol):
    """What the remote tier counts; the pod's metrics (cachemgr.runtime.metrics) are one."""

    remote_misses: int

    def remote_hit(self, nbytes: int, seconds: float) -> None: ...

    def remote_upload(self, nbytes: int, seconds: float) -> None: ...

    def remote_failure(self, problem: str) -> None: ...


# How a fetch ended: the upload after a local compile follows from it (see start_upload).
FetchOutcome = Literal["hit", "miss", "damaged", "unusable"]


def fetch(
    root: CacheRoot,
    key: CacheKey,
    *,
    config: RemoteConfig,
    identity: PodIdentity,
    metrics: RemoteCounters,
    beat: Heartbeat,
    stop: StopFlag,
    trusted: TrustedKeys | None = None,
    compiling: bool = True,
) -> FetchOutcome:
    """Publish the remote's entry of ``key`` on this volume: "hit"; else why not (one warning at most).

    With ``trusted`` keys the entry must be signed by one of them, its bytes as signed, before it
    is published here. ``compiling``: what the pod does otherwise (compile, or wait for a publisher).
    """
    started = time.monotonic()
    missing = client_missing()
    if missing is not None:
        # boto3 not installed: one warning and a local compile (and, "unusable", no upload), not
        # the pod. The tier is optional, and every other way it can be unusable from a pod (a
        # store unreachable or full, credentials refused, the budget spent) costs just that; a
        # refusal (78) would turn an image built without the extra into an outage of every pod
        # at its next restart, for a tier whose absence costs at most a compile per key and
        # cluster. The operator's remote commands, which are the tier, exit 78 instead.
        metrics.remote_failure("not-installed")
        log.warning(
            "remote_not_installed", remote=config.url, message=not_installed(config, missing).one_line()
        )
        return "unusable"
    malformed = malformed_credential(os.environ)
    if malformed is not None:  # as above: a warning naming the variable (never its value), a compile
        metrics.remote_failure("credentials")
        event = "remote_unusable_compiling_locally" if compiling else "remote_unusable_waiting_for_publisher"
        log.warning(event, key=key.short, problem="credentials", message=malformed.one_line())
        return "unusable"
    try:
        from cachemgr.remote.bounded import BoundedRemote  # the transfer's child: a remote path only

        fetched = download_and_publish(
            root,
            key,
            BoundedRemote(config),
            identity=identity,
            deadline=started + config.budget,
            stop=stop,
            beat=beat,
            trusted=trusted,
        )
        if fetched is None:
            metrics.remote_misses += 1
            log.info("remote_miss", key=key.short, remote=config.url)
            return "miss"
        outcome, moved = fetched
    except InterruptedError:
        return "unusable"
    except BaseException as error:  # the remote never stops a pod: any failure -> compile
        if isinstance(error, KeyboardInterrupt | SystemExit):
            raise
        return _warn_fetch(error, key, config, metrics, compiling=compiling)
    seconds = time.monotonic() - started
    metrics.remote_hit(moved.bytes, seconds)
    log.info(
        "remote_hit" if outcome.published else "remote_hit_peer_published_first",
        key=key.short,
        entry=key.entry_name,
        remote=config.url,
        files=moved.files,
        bytes=moved.bytes,
        seconds=round(seconds, 2),
        mib_per_s=round(moved.mib_per_s, 1),
    )
    return "hit"


def download_and_publish(
    root: CacheRoot,
    key: CacheKey,
    remote: Remote | BoundedRemote,
    *,
    identity: PodIdentity,
    deadline: float | None,
    stop: StopFlag | None = None,
    beat: Heartbeat | None = None,
    progress: Progress | None = None,
    trusted: TrustedKeys | None = None,
) -> tuple[PublishOutcome, Moved] | None:
    """Download into private staging, check, record the origin, publish by rename; None: no entry.

    ``remote``: a pod's :class:`BoundedRemote` (the transfer in a child it kills at the deadline),
    or ``pull``'s :class:`Remote` (in this process, with a progress bar).

    With ``trusted`` keys, also the signature and every file's signed BLAKE3, in staging, before
    anything is published (RemoteUntrustedError). Raises what went wrong (RemoteError,
    RemoteDamageError, OSError, TimeoutError); staging is removed in every case.
    """
    started = time.monotonic()
    staging = create_staging(root, key, identity)
    if beat is not None:
        beat.add(staging.owner_file, within=root.path, restore=staging.restore_owner)
    committed = False
    try:
        result = remote.download(
            key, staging.path, within=root.path, deadline=deadline, stop=stop, progress=progress
        )
        if result is None:
            return None
        manifest, moved = result
        if trusted:
            _check_trust(root, key, staging.path, manifest, trusted, stop=stop)
            _set_aside_untrusted(root, key, trusted, stop=stop)
        origin = _origin(remote.config, identity, seconds=time.monotonic() - started, manifest_doc=manifest)
        outcome = commit(root, staging, key, _with_origin(staging.path, manifest, origin, within=root.path))
        committed = True  # renamed into place, or discarded by commit for a peer's entry
        return outcome, moved
    finally:
        if beat is not None:
            beat.discard(staging.owner_file)
        if not committed:
            # Whatever is at the attempt's name goes, and its owner record: reached from the
            # root, never through a link (a link planted as the attempt is removed as a link).
            staging.discard()


def _check_trust(
    root: CacheRoot,
    key: CacheKey,
    staging: Path,
    manifest: Manifest,
    trusted: TrustedKeys,
    *,
    stop: StopFlag | None,
) -> None:
    """The downloaded entry, judged in staging as a trusting pod judges a local one."""
    from cachemgr.remote.client import RemoteUntrustedError
    from cachemgr.volume.trust import check

    verdict = check(root.path, staging, manifest, key=key, trusted=trusted, stop=stop)
    if not verdict.trusted:
        raise RemoteUntrustedError(
            f"remote entry {key.entry_name} is {verdict.reason}",
            remedy="push an entry a trusted publisher signed ('cachemgr push' from the builder), or delete it "
            "('cachemgr prune --remote --key KEY')",
            untrusted=verdict.reason,
        )


def _set_aside_untrusted(
    root: CacheRoot, key: CacheKey, trusted: TrustedKeys, *, stop: StopFlag | None
) -> None:
    """A trusted copy in staging replaces an entry here that no trusted key signed as it is.

    Whoever writes the volume must not keep the pods from the bucket's signed copy by planting an
    entry under the key's name (a pod without the signing key leaves an untrusted entry where it
    is, and the publishing rename would then take the planted entry for a peer's). It goes to
    ``quarantine/`` with its reason, never deleted. Only after the copy was found trusted, and
    only what is still not a trusted hit now (a peer's trusted publish meanwhile is kept).
    """
    try:
        found = lookup(root, key, trusted=trusted, stop=stop)
    except InterruptedError:
        raise
    except OSError:
        return  # unreadable here: the pod's own lookup after the download reports it (exit 74)
    if found.status in {"hit", "miss"}:
        return
    moved = quarantine(root, found.path, reason=found.reason)
    log.info(
        "untrusted_entry_replaced_from_remote",
        key=key.short,
        entry=found.path.name,
        reason=found.reason,
        moved_to=str(moved) if moved else None,
    )


def _warn_fetch(
    error: BaseException, key: CacheKey, config: RemoteConfig, metrics: RemoteCounters, *, compiling: bool
) -> FetchOutcome:
    from cachemgr.remote.client import RemoteDamageError, RemoteUntrustedError, describe

    damaged = False
    if isinstance(error, OSError) and is_disk_full(error):
        problem, message = "volume-full", f"the cache volume filled up while downloading from {config.url}"
    else:
        reported = describe(error, config, doing=f"downloading key {key.short}")
        damaged = isinstance(reported, RemoteDamageError)
        problem = "damaged" if damaged else str(reported.fields.get("problem", "other"))
        problem = "untrusted" if isinstance(reported, RemoteUntrustedError) else problem
        message = reported.one_line()
    metrics.remote_failure(problem)
    event = "remote_unusable_compiling_locally" if compiling else "remote_unusable_waiting_for_publisher"
    log.warning(event, key=key.short, problem=problem, message=message)
    return "damaged" if damaged else "unusable"


def _origin(
    config: RemoteConfig, identity: PodIdentity, *, seconds: float, manifest_doc: Manifest
) -> dict[str, Any]:
    return {
        "kind": "remote",
        "remote": config.url,
        "downloaded_at": time.time(),
        "download_seconds": round(seconds, 3),
        "downloaded_by": identity.to_json(),
        "compiled_by": dict(manifest_doc.created_by),
    }


def _with_origin(staging: Path, manifest: Manifest, origin: dict[str, Any], *, within: Path) -> Manifest:
    """Record the entry's origin in its summary (what ls/show read), and the manifest to match.

    Beside the artifacts, never inside them; every other file keeps the record it was checked by.
    Every file is reached from the cache root ``within``, never through a link.
    """
    from cachemgr.remote.client import RemoteDamageError
    from cachemgr.remote.localfiles import LocalDir

    listed = {record.path for record in manifest.files}
    with LocalDir.open(within, staging) as local:
        try:
            summary = (
                jsonread.parse(local.read_bytes(SUMMARY_NAME, limit=1 << 20), limit=1 << 20)
                if {SUMMARY_NAME, KEY_NAME} <= listed
                else None
            )
        except (OSError, ValueError):
            summary = None
        if not isinstance(summary, dict):
            # Every entry cachemgr publishes has both, listed and hashed: this one was not made by it.
            raise RemoteDamageError(
                f"remote entry {manifest.key[:12]} lacks a readable {SUMMARY_NAME} or {KEY_NAME} in its manifest",
                remedy="delete it ('cachemgr prune --remote --key KEY') and push a good copy; this pod compiles",
            )
        summary["origin"] = origin
        atomic_write_json(staging / SUMMARY_NAME, summary, within=within)
        handle, _ = local.open_file(SUMMARY_NAME)
        with handle:
            summary_hash = hash_fd(handle.fileno())
    # This copy's sizes and mtimes, which every later fast check compares (the remote manifest's
    # mtimes are the uploading node's; its hashes were just checked): one walk, no lstat per file.
    stats = dict(walk_files(staging, within=within))
    files = tuple(
        _local(FileRecord(SUMMARY_NAME, 0, summary_hash) if r.path == SUMMARY_NAME else r, stats)
        for r in manifest.files
    )
    updated = manifest._replace(files=files, extra={**manifest.extra, "origin": origin})
    atomic_write_json(staging / MANIFEST_NAME, updated.to_json(), within=within)
    return updated


def _local(record: FileRecord, stats: dict[str, os.stat_result]) -> FileRecord:
    st = stats.get(record.path)
    if st is None:  # checked a moment ago: something removed it from our private staging since
        raise FileNotFoundError(errno.ENOENT, "gone from staging after its check", record.path)
    return record._replace(size=st.st_size, mtime_ns=st.st_mtime_ns)


# --- upload after a local publish -------------------------------------------------------------


class Upload:
    """A background upload of one published entry; ``wait`` bounds how long anyone waits for it."""

    def __init__(
        self,
        entry: Path,
        *,
        within: Path,
        config: RemoteConfig,
        identity: PodIdentity,
        metrics: RemoteCounters,
        transfers: Callable[[RemoteConfig], Remote | BoundedRemote] | None = None,
    ) -> None:
        """``transfers``: what moves the files; a pod's BoundedRemote (a child process it can
        kill) unless a test needs the transfer in this process to arrange a fault's moment."""
        self.entry = entry
        self.transfers = transfers
        self.within = within
        self.config = config
        self.identity = identity
        self.metrics = metrics
        self.done = threading.Event()
        self.stop = threading.Event()
        self.replace = False  # the remote's entry was damaged: upload ours over it
        self.thread = threading.Thread(target=self._run, name="cachemgr-upload", daemon=True)

    def start(self) -> Upload:
        self.thread.start()
        return self

    def _run(self) -> None:
        started = time.monotonic()
        try:
            from cachemgr.remote.bounded import BoundedRemote

            moved = (self.transfers or BoundedRemote)(self.config).upload(
                self.entry,
                within=self.within,
                uploaded_by=self.identity.to_json(),
                deadline=started + self.config.budget,
                stop=self.stop,
                force=self.replace,
            )
            self.metrics.remote_upload(moved.bytes, moved.seconds)
            log.info(
                "remote_already_had_entry" if moved.skipped else "remote_uploaded",
                entry=moved.entry,
                remote=self.config.url,
                files=moved.files,
                bytes=moved.bytes,
                seconds=round(moved.seconds, 2),
                **({"replaced_damaged": moved.replaced} if moved.replaced else {}),
            )
        except InterruptedError:
            pass  # stopped by wait(), which said so
        except BaseException as error:  # noqa: BLE001  # a failed upload is a warning, never a pod failure
            self._warn(error)
        finally:
            self.done.set()

    def _warn(self, error: BaseException) -> None:
        from cachemgr.remote.client import describe

        reported = describe(error, self.config, doing=f"uploading {self.entry.name}")
        problem = str(reported.fields.get("problem", "other"))
        self.metrics.remote_failure(problem)
        log.warning(
            "remote_upload_failed",
            entry=self.entry.name,
            problem=problem,
            message=reported.one_line(),
            note="nothing partial is visible remotely (the manifest goes last); 'cachemgr push' retries",
        )

    def finish(self, *, warm: bool, stop: StopFlag) -> bool:
        """A stopping pod's wait: ``run`` CACHEMGR_REMOTE_UPLOAD_WAIT, a warm Job up to the budget;
        either no longer than the upload wait once ``stop`` (SIGTERM) is set."""
        config = self.config
        wait = config.budget if warm else config.upload_wait
        return self.wait(wait, stop=stop, after_stop=config.upload_wait)

    def wait(self, timeout: float, *, stop: StopFlag | None = None, after_stop: float = 0.0) -> bool:
        """Wait up to ``timeout`` seconds, and no more than ``after_stop`` once ``stop`` is set (a
        warm Job's SIGTERM); past that, stop the upload (its process is killed) and say so once."""
        started = time.monotonic()
        deadline = started + timeout
        while not self.done.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            now = time.monotonic()
            if stop is not None and stop.is_set() and deadline > now + after_stop:
                deadline = now + after_stop
            if now >= deadline:
                break
        if self.done.is_set():
            return True
        self.stop.set()
        log.warning(
            "remote_upload_unfinished",
            entry=self.entry.name,
            waited_s=round(time.monotonic() - started),
            note="the pod stops before its upload finished; the remote has no manifest for it, so no reader "
            "takes it; 'cachemgr push' uploads it (CACHEMGR_REMOTE_UPLOAD_WAIT sets the wait)",
        )
        with contextlib.suppress(RuntimeError):
            self.done.wait(5.0)  # the upload's process is killed at once: its thread ends with it
        return False


def start_upload(
    entry: Path,
    *,
    within: Path,
    config: RemoteConfig,
    identity: PodIdentity,
    metrics: RemoteCounters,
    fetched: FetchOutcome | None,
) -> Upload | None:
    """Upload ``entry`` in the background; the caller goes on (the server starts at once).

    After a fetch that found the remote unusable (down, slow, credentials refused) there is no
    upload: it would fail the same way, and the pod has said so once. After a damaged one,
    ours replaces it.
    """
    if fetched == "unusable":
        return None
    upload = Upload(entry, within=within, config=config, identity=identity, metrics=metrics)
    upload.replace = fetched == "damaged"
    return upload.start()
