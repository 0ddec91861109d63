"""Moving one entry between a cache volume and the remote: parallel transfers, manifest last.

boto3's transfer manager runs every file of an entry at once over ``max_concurrency`` threads and
splits large files into multipart uploads and ranged downloads, so a 2,000-file entry of a few
GiB moves at the link's speed rather than at one request's latency per file. A transfer is
bounded by a deadline and a stop event: past either, it is cancelled and raises.

A download never trusts what it reads: the manifest must parse, name this key and its inputs,
and list only plain paths (:func:`cachemgr.remote.layout.unsafe_paths`); each file is written
into private staging and then hashed against the manifest (the same check as ``--verify
full``). Anything else is :class:`RemoteDamageError`, and the caller publishes nothing.

``progress`` callbacks get byte counts as they move, from the transfer threads: the hook a
progress bar attaches to.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from cachemgr.key.cachekey import CacheKey
from cachemgr.remote.client import RemoteDamageError, RemoteError, describe, make_client
from cachemgr.remote.config import RemoteConfig
from cachemgr.remote.layout import (
    MAX_MANIFEST_BYTES,
    check_upload_id,
    manifest_key,
    objects_prefix,
    unsafe_paths,
)
from cachemgr.volume.manifest import MANIFEST_NAME, Manifest, ManifestError, check_files, read_manifest

Progress = Callable[[int], None]


class StopFlag(Protocol):
    """``threading.Event`` or the runner's signal-safe flag: a transfer polls it to cancel."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float) -> bool: ...


_CHUNK = 16 << 20  # multipart part / ranged GET size: few requests for big files, parallel within one
_WORKERS = 16


@dataclass(frozen=True)
class Moved:
    """What one transfer moved."""

    entry: str
    files: int
    bytes: int
    seconds: float
    upload_id: str = ""
    skipped: bool = False  # upload: the remote already had a manifest for this entry

    @property
    def mib_per_s(self) -> float:
        return self.bytes / (1 << 20) / max(self.seconds, 1e-9)


class Remote:
    """One client and transfer settings for a pod start or a command."""

    def __init__(self, config: RemoteConfig, *, workers: int = _WORKERS, client: Any = None) -> None:
        self.config = config
        self.workers = workers
        self.client = client if client is not None else make_client(config)

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

        try:
            answer = self.client.get_object(Bucket=self.config.bucket, Key=manifest_key(self.config, entry))
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in {"NoSuchKey", "404"}:
                return None
            raise
        if int(answer.get("ContentLength") or 0) > MAX_MANIFEST_BYTES:
            answer["Body"].close()
            raise RemoteDamageError(
                f"remote manifest of {entry} is larger than {MAX_MANIFEST_BYTES >> 20} MiB",
                remedy="delete it ('cachemgr prune --remote') and push the entry again",
            )
        body: bytes = answer["Body"].read(MAX_MANIFEST_BYTES + 1)
        return body, answer["LastModified"].timestamp()

    # --- upload ------------------------------------------------------------------------------

    def upload(
        self,
        entry_dir: Path,
        *,
        uploaded_by: Mapping[str, Any],
        deadline: float | None = None,
        stop: StopFlag | None = None,
        progress: Progress | None = None,
        force: bool = False,
    ) -> Moved:
        """Upload a published entry: its files under a fresh upload id, then its manifest."""
        started = time.monotonic()
        manifest = read_manifest(entry_dir)
        name = entry_dir.name
        if not force and self.get_manifest(name) is not None:
            return Moved(name, 0, 0, time.monotonic() - started, skipped=True)
        upload_id = f"{int(time.time()):x}-{os.urandom(6).hex()}"
        prefix = objects_prefix(self.config, name, upload_id)
        self._run_all(
            lambda manager, subscribers: [
                manager.upload(
                    os.path.join(entry_dir, rec.path),
                    self.config.bucket,
                    prefix + rec.path,
                    subscribers=subscribers,
                )
                for rec in manifest.files
            ],
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
        return Moved(name, len(manifest.files), manifest.total_bytes, time.monotonic() - started, upload_id)

    # --- download ----------------------------------------------------------------------------

    def download(
        self,
        key: CacheKey,
        staging: Path,
        *,
        deadline: float | None = None,
        stop: StopFlag | None = None,
        progress: Progress | None = None,
    ) -> tuple[Manifest, Moved] | None:
        """Fetch the entry of ``key`` into ``staging`` and check it; None when the remote has none.

        ``staging`` is a fresh private directory; on return every file in it matches the manifest
        (written there as ``manifest.json``), which names this key. Raises RemoteDamageError.
        """
        started = time.monotonic()
        found = self.get_manifest(key.entry_name)
        if found is None:
            return None
        raw, _ = found
        manifest, upload_id = _checked_manifest(raw, staging, key)
        prefix = objects_prefix(self.config, key.entry_name, upload_id)
        for folder in sorted({rec.path.rpartition("/")[0] for rec in manifest.files} - {""}):
            (staging / folder).mkdir(parents=True, exist_ok=True)
        self._run_all(
            lambda manager, subscribers: [
                manager.download(
                    self.config.bucket,
                    prefix + rec.path,
                    os.path.join(staging, rec.path),
                    subscribers=subscribers,
                )
                for rec in manifest.files
            ],
            deadline=deadline,
            stop=stop,
            progress=progress,
            missing_is_damage=key.entry_name,
        )
        # The content, not the times: a remote manifest's mtimes are the uploading node's files'.
        # This copy's own go into the local manifest (cachemgr.remote.hooks._with_origin).
        problems = check_files(staging, _without_mtimes(manifest), mode="full")
        if problems:
            shown = "; ".join(str(p) for p in problems[:3]) + (" ..." if len(problems) > 3 else "")
            raise RemoteDamageError(
                f"remote entry {key.entry_name} does not match its manifest ({len(problems)} files: {shown})",
                remedy="delete it ('cachemgr prune --remote --key KEY') and push a good copy; this pod compiles",
            )
        moved = Moved(key.entry_name, len(manifest.files), manifest.total_bytes, time.monotonic() - started)
        return manifest, moved

    # --- both --------------------------------------------------------------------------------

    def _run_all(
        self,
        submit: Callable[[Any, list[Any]], Sequence[Any]],
        *,
        deadline: float | None,
        stop: StopFlag | None,
        progress: Progress | None,
        missing_is_damage: str | None = None,
    ) -> None:
        """Submit every transfer at once, then wait for all of them within the deadline."""
        manager = self._manager()
        cancelled = False
        try:
            futures = submit(manager, [_Subscriber(progress)] if progress else [])
            _wait_all(futures, deadline=deadline, stop=stop)
            for future in futures:
                future.result()
        except BaseException as error:
            cancelled = True
            manager.shutdown(cancel=True)
            if missing_is_damage and _is_missing(error):
                raise RemoteDamageError(
                    f"remote entry {missing_is_damage} lacks a file its manifest lists ({error})",
                    remedy="delete it ('cachemgr prune --remote --key KEY') and push it again; this pod compiles",
                ) from error
            raise
        finally:
            if not cancelled:
                manager.shutdown()


def _wait_all(futures: Sequence[Any], *, deadline: float | None, stop: StopFlag | None) -> None:
    """Until every transfer is done; TimeoutError past the deadline, InterruptedError on stop.

    One future at a time, in submission order (about the order they finish): a sweep over all
    2,000 at every tick would take the GIL from the transfer threads it waits for.
    """
    wake: StopFlag = stop or threading.Event()
    for future in futures:
        while not future.done():
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("the transfer did not finish within CACHEMGR_REMOTE_BUDGET")
            if stop is not None and stop.is_set():
                raise InterruptedError("stopped")
            wake.wait(0.02)


def _checked_manifest(raw: bytes, staging: Path, key: CacheKey) -> tuple[Manifest, str]:
    """Parse the remote manifest with the volume's own parser and hold it to this key."""
    where = f"remote manifest of {key.entry_name}"
    remedy = "delete it ('cachemgr prune --remote --key KEY') and push a good copy; this pod compiles"
    (staging / MANIFEST_NAME).write_bytes(raw)
    try:
        manifest = read_manifest(staging)
        doc = json.loads(raw)
    except (ManifestError, ValueError) as error:
        raise RemoteDamageError(f"{where} is not a manifest ({error})", remedy=remedy) from None
    if manifest.key != key.digest or dict(manifest.inputs) != dict(key.inputs):
        raise RemoteDamageError(f"{where} was written for another key ({manifest.key[:16]})", remedy=remedy)
    unsafe = unsafe_paths(manifest)
    if unsafe:
        raise RemoteDamageError(f"{where} lists unsafe paths: {', '.join(unsafe[:3])}", remedy=remedy)
    remote = doc.get("remote") if isinstance(doc, dict) else None
    upload_id = check_upload_id(remote.get("objects") if isinstance(remote, dict) else None)
    if upload_id is None:
        raise RemoteDamageError(f"{where} names no valid upload ('remote.objects')", remedy=remedy)
    return manifest, upload_id


def _is_missing(error: BaseException) -> bool:
    from botocore.exceptions import ClientError

    if isinstance(error, ClientError):
        code = error.response.get("Error", {}).get("Code")
        return code in {"NoSuchKey", "404"}
    return False


class _Subscriber:
    """s3transfer calls ``on_progress`` with bytes moved; the other hooks are not needed."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress

    def on_queued(self, future: Any, **kwargs: Any) -> None:
        pass

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        self._progress(bytes_transferred)

    def on_done(self, future: Any, **kwargs: Any) -> None:
        pass


__all__ = ["Moved", "Progress", "Remote", "RemoteDamageError", "RemoteError", "describe"]


def _without_mtimes(manifest: Manifest) -> Manifest:
    return replace(manifest, files=tuple(replace(record, mtime_ns=None) for record in manifest.files))
