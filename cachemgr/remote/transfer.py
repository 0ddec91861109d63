"""Moving one entry between a cache volume and the remote: parallel transfers, manifest last.

boto3's transfer manager runs every file of an entry at once over ``max_concurrency`` threads and
splits large files into multipart uploads and ranged downloads, so a 2,000-file entry of a few
GiB moves at the link's speed rather than at one request's latency per file. A transfer is
bounded by a deadline and a stop event: past either, it is cancelled and raises.

Local files are opened from the cache root, never by path (:mod:`cachemgr.remote.localfiles`):
the transfer manager gets open file objects, at most a window of them at a time, each closed
as soon as its transfer is done. An upload hashes each file as it streams and sends the
manifest only if every file's bytes matched it (:class:`~cachemgr.remote.localfiles.HashedReader`).

A download never trusts what it reads: the manifest must parse, name this key and its inputs,
and list only plain paths (:func:`cachemgr.remote.layout.unsafe_paths`); each file is written
into private staging and then hashed against the manifest, read through descriptors reached
from the cache root as it was written (a folder swapped for a link meanwhile is refused, never
followed), and staging walked for anything else. Anything else is :class:`RemoteDamageError`,
and the caller publishes nothing.

``progress`` callbacks get byte counts as they move, from the transfer threads: the hook a
progress bar attaches to.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from cachemgr.core.fsutil import hash_fd
from cachemgr.core.units import plural
from cachemgr.remote.client import OBJECT_REFUSALS, RemoteDamageError, RemoteError, describe, make_client
from cachemgr.remote.config import RemoteConfig
from cachemgr.remote.layout import (
    MAX_MANIFEST_BYTES,
    EntryKey,
    WireKey,
    checked_manifest,
    manifest_key,
    objects_prefix,
)
from cachemgr.remote.localfiles import HashedReader, LocalDir
from cachemgr.remote.sizes import Capped, ObjectTooLargeError, SizeGuard
from cachemgr.volume.manifest import (
    KEY_NAME,
    MANIFEST_NAME,
    FileRecord,
    Manifest,
    ManifestError,
    Problem,
    check_files,
    parse_manifest,
)

Progress = Callable[[int], None]
# A transfer's local file: a download's, or an upload's (verified once its transfer is done).
Open = BinaryIO | HashedReader | Capped
# Submits one file's transfer to the manager: (its future, the open local file to close after it).
Job = Callable[[Any, list[Any]], tuple[Any, Open]]


class StopFlag(Protocol):
    """``threading.Event`` or the runner's signal-safe flag: a transfer polls it to cancel."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float) -> bool: ...


_CHUNK = 16 << 20  # multipart part / ranged GET size: few requests for big files, parallel within one
_WORKERS = 16
_UNCREATABLE = frozenset({errno.ENAMETOOLONG, errno.EILSEQ})  # a name the volume refuses to hold
_OPEN_PER_WORKER = 4  # files open at once: enough queued per transfer thread, far below any fd limit


@dataclass(frozen=True)
class Moved:
    """What one transfer moved."""

    entry: str
    files: int
    bytes: int
    seconds: float
    upload_id: str = ""
    skipped: bool = False  # upload: the remote already had a manifest for this entry
    replaced: str = ""  # upload: why the remote's manifest for this entry was damaged ("": it was not)

    @property
    def mib_per_s(self) -> float:
        return self.bytes / (1 << 20) / max(self.seconds, 1e-9)


class Remote:
    """One client and transfer settings for a pod start or a command."""

    def __init__(self, config: RemoteConfig, *, workers: int = _WORKERS, client: Any = None) -> None:
        self.config = config
        self.workers = workers
        self.client = client if client is not None else make_client(config)
        self._sizes = SizeGuard(self.client)

    def _manager(self) -> Any:
        from boto3.s3.transfer import TransferConfig, create_transfer_manager

        settings = TransferConfig(
            multipart_threshold=_CHUNK,
            multipart_chunksize=_CHUNK,
            max_concurrency=self.workers,
            use_threads=True,
        )
        return create_transfer_manager(self.client, settings)

    # --- reading the remote ------------------------------------------------------------------

    def get_manifest(self, entry: str) -> tuple[bytes, float] | None:
        """The raw remote manifest of ``entry`` and when it was written; None when there is none."""
        from botocore.exceptions import ClientError

        key = manifest_key(self.config, entry)
        try:
            answer = self.client.get_object(Bucket=self.config.bucket, Key=key)
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in {"NoSuchKey", "404"}:
                return None
            if self._object_refused(error, key):
                info = error.response.get("Error", {})
                raise RemoteDamageError(
                    f"remote manifest of {entry} is in the bucket, but the store refuses to serve it "
                    f"({info.get('Code')}: {str(info.get('Message', ''))[:200]})",
                    remedy=f"delete it ('cachemgr prune --remote --key {entry} --yes') and push a good copy",
                ) from None
            raise
        if int(answer.get("ContentLength") or 0) > MAX_MANIFEST_BYTES:
            answer["Body"].close()
            raise RemoteDamageError(
                f"remote manifest of {entry} is larger than {MAX_MANIFEST_BYTES >> 20} MiB",
                remedy="delete it ('cachemgr prune --remote') and push the entry again",
            )
        body: bytes = answer["Body"].read(MAX_MANIFEST_BYTES + 1)
        return body, answer["LastModified"].timestamp()

    def _object_refused(self, error: Any, key: str) -> bool:
        """Whether ``error`` is the store refusing this one object (SSE-C encrypted, archived,
        another account's), which is damage to its entry: the code says so, and the same
        credentials list the object (refused credentials or an outage fail the listing too)."""
        from botocore.exceptions import BotoCoreError, ClientError

        info = error.response.get("Error", {})
        status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if info.get("Code") not in OBJECT_REFUSALS and status not in {400, 403}:
            return False
        try:
            listed = self.client.list_objects_v2(Bucket=self.config.bucket, Prefix=key, MaxKeys=1)
        except (BotoCoreError, ClientError):
            return False
        return any(item.get("Key") == key for item in listed.get("Contents", []))

    # --- upload ------------------------------------------------------------------------------

    def upload(
        self,
        entry_dir: Path,
        *,
        within: Path,
        uploaded_by: Mapping[str, Any],
        deadline: float | None = None,
        stop: StopFlag | None = None,
        progress: Progress | None = None,
        force: bool = False,
        planned: Callable[[int, int], None] | None = None,
    ) -> Moved:
        """Upload a published entry: its files under a fresh upload id, then its manifest.

        ``entry_dir`` is reached from the cache root ``within`` and each file opened from it
        (:class:`LocalDir`): a symlink at any level, or anything but a regular file, stops the
        upload with an UnsafePathError naming it, before a byte of it is read.
        """
        started = time.monotonic()
        name = entry_dir.name
        replaced = ""
        with LocalDir.open(within, entry_dir) as local:
            manifest = _local_manifest(local)
            if not force:
                damage = self._damage_of(name, manifest)
                if damage is None:
                    return Moved(name, 0, 0, time.monotonic() - started, skipped=True)
                replaced = damage
            if planned is not None:
                planned(len(manifest.files), manifest.total_bytes)
            upload_id = f"{int(time.time()):x}-{os.urandom(6).hex()}"
            prefix = objects_prefix(self.config, name, upload_id)
            self._run_all(
                (partial(self._upload_one, local, rec, prefix + rec.path) for rec in manifest.files),
                deadline=deadline,
                stop=stop,
                progress=progress,
            )
        doc = manifest.to_json()
        doc["remote"] = {"objects": upload_id, "uploaded_at": time.time(), "uploaded_by": dict(uploaded_by)}
        # Last: until this object exists, no reader takes the entry.
        self.client.put_object(
            Bucket=self.config.bucket,
            Key=manifest_key(self.config, name),
            Body=json.dumps(doc, sort_keys=True).encode(),
            ContentType="application/json",
        )
        seconds = time.monotonic() - started
        return Moved(name, len(manifest.files), manifest.total_bytes, seconds, upload_id, replaced=replaced)

    def _damage_of(self, name: str, local: Manifest) -> str | None:
        """What is wrong with the remote's manifest of entry ``name``: None when it is a good one
        for the local entry's key (nothing to upload), "" when there is none, else why a reader
        would refuse it (an upload replaces it: "already in the remote" would leave it so)."""
        try:
            found = self.get_manifest(name)
            if found is None:
                return ""
            checked_manifest(
                found[0],
                Path(name),
                WireKey(local.key, local.inputs, name),
                prefix_of=partial(objects_prefix, self.config, name),
            )
        except RemoteDamageError as error:
            return error.what
        return None

    def _upload_one(
        self, local: LocalDir, record: FileRecord, key: str, manager: Any, subscribers: list[Any]
    ) -> tuple[Any, Open]:
        handle, st = local.open_file(record.path)
        if st.st_size != record.size:
            handle.close()
            raise RemoteDamageError(
                f"local entry {local.shown.name}: {record.path} is {st.st_size} bytes, its manifest says "
                f"{record.size}; not uploaded",
                remedy="'cachemgr verify --fix' moves it aside; the next start compiles it again",
            )
        # A rewrite in place after this check is caught as the bytes stream (the reader hashes them).
        reader = HashedReader(handle, size=record.size, xxh3=record.xxh3, shown=local.shown / record.path)
        return _submitted(
            lambda: manager.upload(reader, self.config.bucket, key, subscribers=subscribers), reader
        )

    def _download_one(
        self, local: LocalDir, record: FileRecord, key: str, manager: Any, subscribers: list[Any]
    ) -> tuple[Any, Open]:
        self._sizes.expect(key, record.size)
        try:
            created = local.create_file(record.path)
        except OSError as error:
            if error.errno not in _UNCREATABLE:
                raise
            # A path this volume cannot hold (its names are shorter, or must be UTF-8): damage,
            # which the compiling pod replaces, not a remote it calls unusable.
            raise RemoteDamageError(
                f"a remote manifest lists {record.path[:200]!r}, which this volume cannot create "
                f"({os.strerror(error.errno or 0)})",
                remedy="delete it ('cachemgr prune --remote --key KEY') and push a good copy; this pod compiles",
            ) from None
        handle = Capped(created, size=record.size, key=key)
        return _submitted(
            lambda: manager.download(self.config.bucket, key, handle, subscribers=subscribers), handle
        )

    # --- download ----------------------------------------------------------------------------

    def download(
        self,
        key: EntryKey,
        staging: Path,
        *,
        within: Path,
        deadline: float | None = None,
        stop: StopFlag | None = None,
        progress: Progress | None = None,
        on_manifest: Callable[[bytes, Manifest], None] | None = None,
    ) -> tuple[Manifest, Moved] | None:
        """Fetch the entry of ``key`` into ``staging`` and check it; None when the remote has none.

        ``staging`` is a fresh private directory under the cache root ``within``, reached from it
        without following a link; every file is created there new (``O_EXCL|O_NOFOLLOW``). On
        return every file in it matches the manifest (written there as ``manifest.json``), which
        names this key. Raises RemoteDamageError, or UnsafePathError for a link planted in staging.
        No file takes more bytes than the manifest lists for it: an object that is larger is
        damage as soon as the store says its size, before its body is read (:mod:`cachemgr.remote.sizes`).
        """
        started = time.monotonic()
        found = self.get_manifest(key.entry_name)
        if found is None:
            return None
        raw, _ = found
        manifest, upload_id = checked_manifest(
            raw, staging, key, prefix_of=partial(objects_prefix, self.config, key.entry_name)
        )
        if on_manifest is not None:
            on_manifest(raw, manifest)
        prefix = objects_prefix(self.config, key.entry_name, upload_id)
        with LocalDir.open(within, staging) as local:
            local.write_new(MANIFEST_NAME, raw)
            local.unlink(KEY_NAME)  # create_staging's own copy: the remote's, hashed, replaces it
            self._run_all(
                (partial(self._download_one, local, rec, prefix + rec.path) for rec in manifest.files),
                deadline=deadline,
                stop=stop,
                progress=progress,
                missing_is_damage=key.entry_name,
            )
        problems = _check_download(staging, manifest, within=within)
        if problems:
            shown = "; ".join(str(p) for p in problems[:3]) + (" ..." if len(problems) > 3 else "")
            raise RemoteDamageError(
                f"remote entry {key.entry_name} does not match its manifest ({plural(len(problems), 'file')}: {shown})",
                remedy="delete it ('cachemgr prune --remote --key KEY') and push a good copy; this pod compiles",
            )
        moved = Moved(key.entry_name, len(manifest.files), manifest.total_bytes, time.monotonic() - started)
        return manifest, moved

    # --- both --------------------------------------------------------------------------------

    def _run_all(
        self,
        jobs: Iterable[Job],
        *,
        deadline: float | None,
        stop: StopFlag | None,
        progress: Progress | None,
        missing_is_damage: str | None = None,
    ) -> None:
        """Run every transfer, a window of open files at a time, within the deadline.

        A transfer's file is closed as soon as it is done (the subscriber's ``on_done`` tells),
        and the next one opened: a 2,000-file entry never holds 2,000 descriptors.
        """
        manager = self._manager()
        finished: queue.SimpleQueue[Any] = queue.SimpleQueue()
        subscribers = [_Subscriber(progress, finished)]
        running: dict[Any, Open] = {}
        cancelled = False
        try:
            for job in jobs:
                while len(running) >= self.workers * _OPEN_PER_WORKER:
                    _reap_one(running, finished, deadline=deadline, stop=stop)
                future, handle = job(manager, subscribers)
                running[future] = handle
            while running:
                _reap_one(running, finished, deadline=deadline, stop=stop)
        except BaseException as error:
            cancelled = True
            # Cancel what is in flight. Not shutdown(cancel=True): s3transfer 0.19.3 passes its
            # arguments shifted there (TypeError: 'str' object is not callable) once a transfer
            # is in flight; the context-manager exit cancels with the error as the reason.
            manager.__exit__(type(error), error, error.__traceback__)
            if missing_is_damage and isinstance(error, ObjectTooLargeError):
                raise RemoteDamageError(
                    f"remote entry {missing_is_damage}: {error}; nothing past that was downloaded",
                    remedy="delete it ('cachemgr prune --remote --key KEY') and push it again; this pod compiles",
                ) from None
            if missing_is_damage and _is_missing(error):
                raise RemoteDamageError(
                    f"remote entry {missing_is_damage} lacks a file its manifest lists ({error})",
                    remedy="delete it ('cachemgr prune --remote --key KEY') and push it again; this pod compiles",
                ) from error
            raise
        finally:
            if not cancelled:
                manager.shutdown()
            for handle in running.values():  # after the shutdown: no transfer thread uses them now
                with contextlib.suppress(
                    OSError
                ):  # one failing close neither leaks the rest nor hides the error
                    handle.close()


def _submitted(submit: Any, handle: Open) -> tuple[Any, Open]:
    """The transfer's future and its file; the file closed if the manager refuses it at once."""
    try:
        return submit(), handle
    except BaseException:
        handle.close()
        raise


def _reap_one(
    running: dict[Any, Open],
    finished: queue.SimpleQueue[Any],
    *,
    deadline: float | None,
    stop: StopFlag | None,
) -> None:
    """Close the file of one finished transfer and raise its error; TimeoutError past the
    deadline, InterruptedError on stop (the caller cancels the rest)."""
    while True:
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError("the transfer did not finish within CACHEMGR_REMOTE_BUDGET")
        if stop is not None and stop.is_set():
            raise InterruptedError("stopped")
        try:
            future = finished.get(timeout=0.02)
        except queue.Empty:
            continue
        handle = running.pop(future, None)
        if handle is None:
            continue
        handle.close()
        if not isinstance(handle, HashedReader):
            future.result()
            return
        try:
            future.result()
        except BaseException:
            if handle.problem is not None:  # its refusal, however botocore wrapped or retried it
                raise handle.error() from None
            raise
        handle.verify()
        return


def _local_manifest(local: LocalDir) -> Manifest:
    """The manifest of the entry open as ``local``, read through its descriptor."""
    shown = local.shown / MANIFEST_NAME
    try:
        raw = local.read_bytes(MANIFEST_NAME, limit=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise ManifestError(f"{shown} is missing: the entry was never committed") from None
    return parse_manifest(raw, path=shown)


def _is_missing(error: BaseException) -> bool:
    from botocore.exceptions import ClientError

    if isinstance(error, ClientError):
        code = error.response.get("Error", {}).get("Code")
        return code in {"NoSuchKey", "404"}
    return False


class _Subscriber:
    """s3transfer calls ``on_progress`` with bytes moved, ``on_done`` once a transfer ended (its
    future is done by then): the waiting loop closes its file and opens the next."""

    def __init__(self, progress: Progress | None, finished: queue.SimpleQueue[Any]) -> None:
        self._progress = progress
        self._finished = finished

    def on_queued(self, future: Any, **kwargs: Any) -> None:
        pass

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        if self._progress is not None:
            self._progress(bytes_transferred)

    def on_done(self, future: Any, **kwargs: Any) -> None:
        self._finished.put(future)


__all__ = ["Moved", "Progress", "Remote", "RemoteDamageError", "RemoteError", "describe"]


def _check_download(staging: Path, manifest: Manifest, *, within: Path) -> list[Problem]:
    """What in ``staging`` disagrees with ``manifest``: each file hashed through descriptors
    reached from the cache root ``within`` one level at a time (a folder or file swapped for a
    link is refused, never read through), then one walk from the root for what else is there (a
    link or special file, also one swapped in while hashing). The content, not the times: a
    remote manifest's mtimes are the uploading node's files' (this copy's own go into the local
    manifest, cachemgr.remote.hooks._with_origin)."""
    found: dict[str, Problem] = {}
    with LocalDir.open(within, staging) as local:
        for record in manifest.files:
            problem = _hash_check(local, record)
            if problem is not None:
                found[record.path] = problem
    without_mtimes = manifest._replace(files=tuple(r._replace(mtime_ns=None) for r in manifest.files))
    for problem in check_files(staging, without_mtimes, mode="fast", within=within):
        found.setdefault(problem.path, problem)
    return list(found.values())


def _hash_check(local: LocalDir, record: FileRecord) -> Problem | None:
    try:
        handle, st = local.open_file(record.path)
    except FileNotFoundError:
        return Problem(record.path, "missing")
    with handle:
        if st.st_size != record.size:
            return Problem(record.path, f"size {st.st_size} bytes, manifest says {record.size}")
        if hash_fd(handle.fileno()) != record.xxh3:
            return Problem(record.path, "content differs from the manifest's xxh3-128")
    return None
