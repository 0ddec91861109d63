"""What ``push``, ``pull``, ``ls --remote`` and ``prune --remote`` do, as library calls.

The CLI (:mod:`cachemgr.cli.cmd_remote`) parses and renders; everything that reads or writes
the bucket is here. A listing reads each entry's manifest (a few hundred KiB at most) in
parallel; an entry whose objects exist without a manifest is an upload cut short (or under
way): listed apart, never taken, removed by ``prune --remote --stale-uploads`` once old.

``push_entry`` and ``pull_entry`` move an entry through :class:`cachemgr.remote.bounded.BoundedRemote`
(the transfer in a child process, killed at its deadline or on a signal), as a pod does; the CLI
asks that child for the listing too (``listing_to_wire`` there, ``listing_from_wire`` here).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachemgr.core import jsonread
from cachemgr.core.coerce import as_dict, number, text
from cachemgr.core.errors import NotFoundError, UsageError
from cachemgr.core.units import human_bytes, plural
from cachemgr.key.cachekey import CacheKey, digest_of
from cachemgr.key.serving import ServerCommand
from cachemgr.ops.generation import KeyFacts, key_facts
from cachemgr.ops.scan import Compat
from cachemgr.remote.client import RemoteDamageError, RemoteError
from cachemgr.remote.hooks import download_and_publish
from cachemgr.remote.layout import OBJECTS, check_upload_id, objects_prefix, unsafe_paths
from cachemgr.remote.transfer import Moved, Progress, Remote, StopFlag
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.manifest import MANIFEST_NAME, ManifestError, check_files, parse_manifest, read_manifest
from cachemgr.volume.store import PublishOutcome

if TYPE_CHECKING:
    from cachemgr.core.signing import TrustedKeys
    from cachemgr.remote.bounded import BoundedRemote

STALE_UPLOAD_AFTER = 86400.0  # objects without a manifest this old are a dead upload, not one under way
# A manifest's own upload time is kept (finer than the store's whole seconds) only this near the
# store's: an uploader's clock may be off by minutes, a forger's claim by no more.
CLAIMED_TIME_SLACK = 300.0


@dataclass(frozen=True)
class RemoteEntry:
    """One committed entry in the remote, as its manifest describes it."""

    entry: str
    key: str
    model: str
    role: str
    compiler: str
    npu: str
    size_bytes: int
    files: int
    uploaded_at: float
    uploaded_by: str
    upload_id: str
    inputs: dict[str, Any]

    @property
    def size_str(self) -> str:
        return human_bytes(self.size_bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "remote-entry",
            "key": self.key,
            "entry": self.entry,
            "model": self.model,
            "role": self.role,
            "compiler": self.compiler,
            "npu": self.npu,
            "size_bytes": self.size_bytes,
            "files": self.files,
            "uploaded_at": self.uploaded_at,
            "uploaded_by": self.uploaded_by,
            "upload_id": self.upload_id,
        }


@dataclass(frozen=True)
class StaleUpload:
    """Objects of an upload no manifest names: cut short, replaced, or still under way."""

    entry: str
    upload_id: str
    objects: int
    size_bytes: int
    last_modified: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": "upload-without-manifest", **self.__dict__}


@dataclass(frozen=True)
class RemoteListing:
    entries: tuple[RemoteEntry, ...]
    uploads: tuple[StaleUpload, ...]  # objects no manifest names
    warnings: tuple[str, ...]
    # Entries whose manifest no reader takes (name -> why): listed nowhere, named by a warning,
    # and removable by name (``prune --remote --key NAME``): the bucket stays cleanable.
    damaged: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> list[dict[str, Any]]:
        return [e.to_json() for e in self.entries] + [u.to_json() for u in self.uploads]


# --- listing ------------------------------------------------------------------------------------


def list_remote(remote: Remote) -> RemoteListing:
    """Every entry in the remote (by manifest) and every upload no manifest names.

    One walk of the prefix (:func:`_list`, which ends a listing that loops); each entry's size and
    time are the store's own from that walk, never what its manifest claims (anyone who can
    write the bucket writes the manifest: one claiming a PiB must not make ``prune --remote
    --keep-bytes`` remove an untouched entry).
    """
    manifests, objects = _walk(remote)
    names = sorted({entry for entry, _ in objects} | set(manifests))
    with ThreadPoolExecutor(max_workers=8) as pool:
        read = list(pool.map(lambda name: _read_entry(remote, name, objects, manifests.get(name)), names))
    entries, warnings, damaged = [], [], []
    named: set[tuple[str, str]] = set()
    for name, (entry, warning) in zip(names, read, strict=True):
        if entry is not None:
            entries.append(entry)
            named.add((name, entry.upload_id))
        if warning:
            warnings.append(f"{name}: {warning}")
            damaged.append((name, warning))
    uploads = [
        StaleUpload(entry, upload, len(items), sum(s for s, _ in items), max(t for _, t in items))
        for (entry, upload), items in sorted(objects.items())
        if (entry, upload) not in named
    ]
    return RemoteListing(tuple(entries), tuple(uploads), tuple(warnings), tuple(damaged))


def listing_to_wire(listing: RemoteListing) -> dict[str, Any]:
    """A listing as the transfer's child sends it to ``push``/``pull`` (every field, as JSON)."""
    return {
        "entries": [dataclasses.asdict(e) for e in listing.entries],
        "uploads": [dataclasses.asdict(u) for u in listing.uploads],
        "warnings": list(listing.warnings),
        "damaged": [list(pair) for pair in listing.damaged],
    }


def listing_from_wire(doc: dict[str, Any]) -> RemoteListing:
    return RemoteListing(
        tuple(RemoteEntry(**e) for e in doc["entries"]),
        tuple(StaleUpload(**u) for u in doc["uploads"]),
        tuple(doc["warnings"]),
        tuple((str(name), str(why)) for name, why in doc.get("damaged", ())),
    )


def _list(remote: Remote, prefix: str, *, deadline: float | None = None) -> Iterator[dict[str, Any]]:
    """Every object under ``prefix``, page by page, ended (a RemoteError) by a page that leads back
    to one before it (a continuation token or a key given twice: pagination that loops) or by
    ``deadline`` (a monotonic time)."""
    request: dict[str, Any] = {"Bucket": remote.config.bucket, "Prefix": prefix}
    tokens: set[str] = set()
    keys: set[str] = set()
    while True:
        if deadline is not None and time.monotonic() > deadline:
            raise RemoteError(
                f"remote {remote.config.url} did not finish listing {prefix!r} within its budget "
                f"({plural(len(keys), 'object')} listed)",
                remedy="check the store's throughput (a slow gateway or proxy), or raise CACHEMGR_REMOTE_BUDGET",
                problem="budget",
            )
        page = remote.client.list_objects_v2(**request)
        for item in page.get("Contents", []):
            if item.get("Key") in keys:
                raise _looping(remote, prefix, f"object {str(item.get('Key'))[:200]!r}")
            keys.add(item.get("Key"))
            yield item
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated") or not token:
            return
        if token in tokens:
            raise _looping(remote, prefix, "continuation token")
        tokens.add(token)
        request["ContinuationToken"] = token


def _looping(remote: Remote, prefix: str, what: str) -> RemoteError:
    return RemoteError(
        f"remote {remote.config.url} listed {prefix!r} in a loop: a {what} it had listed before came again",
        remedy="check the store (or the gateway or proxy in front of it), then run the command again",
        problem="listing",
    )


def _walk(
    remote: Remote,
) -> tuple[dict[str, tuple[int, float]], dict[tuple[str, str], list[tuple[int, float]]]]:
    """One walk of the entries: entry -> its manifest's (size, mtime); (entry, upload id) ->
    [(size, mtime)] of every object under ``objects/``."""
    top = remote.config.entries_prefix
    manifests: dict[str, tuple[int, float]] = {}
    objects: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for item in _list(remote, top):
        parts = item["Key"][len(top) :].split("/")
        found = (int(item["Size"]), item["LastModified"].timestamp())
        if len(parts) == 2 and parts[1] == MANIFEST_NAME:
            manifests[parts[0]] = found
        elif len(parts) >= 4 and parts[1] == OBJECTS:
            objects.setdefault((parts[0], parts[2]), []).append(found)
    return manifests, objects


def _read_entry(
    remote: Remote,
    name: str,
    objects: dict[tuple[str, str], list[tuple[int, float]]],
    listed: tuple[int, float] | None,
) -> tuple[RemoteEntry | None, str | None]:
    """The entry ``name`` as its manifest describes it, or why it cannot be listed (a warning).

    The manifest is read as the volume's are (:func:`cachemgr.volume.manifest.parse_manifest`, by
    the one bounded reader): anyone who can write the bucket writes it, and one that is damaged
    (too large, nested 200,000 deep, of the wrong shape, refused by the store) is skipped with a
    warning naming the command that removes it, never the end of the listing. Its size is what
    the store holds under its upload (``objects``), its time the store's (``listed``) unless the
    manifest's own is within minutes of it.
    """
    removal = f"'cachemgr prune --remote --key {name}' removes it"
    try:
        found = remote.get_manifest(name)
    except RemoteDamageError as error:
        return None, f"{error.what}: {removal}"
    if found is None:
        return None, None
    raw, modified = found
    try:
        manifest = parse_manifest(raw, path=Path(MANIFEST_NAME))
        info = as_dict(jsonread.as_object(jsonread.parse(raw)).get("remote"))
    except ValueError as error:
        return None, f"{error}: {removal}"
    inputs = dict(manifest.inputs)
    upload_id = check_upload_id(info.get("objects")) or ""
    unsafe = unsafe_paths(manifest, prefix=objects_prefix(remote.config, name, upload_id or "x"))
    if unsafe:  # what every reader refuses (cachemgr.remote.layout.checked_manifest): damage, said here too
        return None, f"its manifest lists unsafe paths ({', '.join(unsafe[:2])}): {removal}"
    stored = listed[1] if listed is not None else modified
    claimed = number(info.get("uploaded_at"))
    return RemoteEntry(
        entry=name,
        key=manifest.key,
        model=manifest.model_name,
        role=text(inputs.get("role")),
        compiler=text(inputs.get("compiler")),
        npu=text(inputs.get("npu")),
        size_bytes=sum(size for size, _ in objects.get((name, upload_id), ())),
        files=len(manifest.files),
        uploaded_at=claimed if claimed and abs(claimed - stored) <= CLAIMED_TIME_SLACK else stored,
        uploaded_by=text(as_dict(info.get("uploaded_by")).get("pod")),
        upload_id=upload_id,
        inputs=inputs,
    ), None


def find_remote(listing: RemoteListing, query: str) -> RemoteEntry:
    """An entry name or a unique key prefix -> the remote entry; NotFoundError / UsageError otherwise."""
    query = query.strip()
    if not query:
        raise UsageError("an empty KEY matches everything", remedy="pass a key prefix or an entry name")
    found = [e for e in listing.entries if e.entry == query or e.key.startswith(query.lower())]
    if len(found) == 1:
        return found[0]
    if not found:
        for name, why in listing.damaged:
            if name == query:
                raise RemoteDamageError(
                    f"remote entry {name} cannot be used: {why}",
                    remedy=f"remove it with 'cachemgr prune --remote --key {name} --yes' and push a good copy",
                )
        raise NotFoundError(
            f"the remote has no entry matching {query!r}",
            remedy="'cachemgr ls --remote' lists the remote's entries",
        )
    raise UsageError(
        f"{query!r} matches {len(found)} remote entries ({', '.join(e.key[:12] for e in found[:6])})",
        remedy="pass a longer key prefix or the entry name",
    )


# --- push and pull ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PushResult:
    entry: str
    moved: Moved | None
    error: str | None = None


def push_entry(
    remote: BoundedRemote,
    root: CacheRoot,
    name: str,
    *,
    identity: PodIdentity,
    force: bool,
    deadline: float | None,
    stop: StopFlag | None = None,
) -> Moved:
    """Upload one published entry after checking its files' sizes against its manifest.

    The upload runs in the transfer's child, killed at ``deadline`` (a RemoteError, problem
    ``budget``: no manifest went up) or on ``stop`` (InterruptedError). It reads each file from
    the root, never through a link (a link planted after this check is refused there).
    """
    entry_dir = root.entries / name
    try:
        manifest = read_manifest(entry_dir)
        problems = [str(p) for p in check_files(entry_dir, manifest, mode="fast", within=root.path)]
    except ManifestError as error:
        problems = [str(error)]
    if problems:
        raise RemoteDamageError(
            f"local entry {entry_dir.name} does not match its manifest ({problems[0]}); not uploaded",
            remedy="'cachemgr verify --fix' moves it aside; the next start compiles it again",
        )
    return remote.upload(
        entry_dir,
        within=root.path,
        uploaded_by=identity.to_json(),
        force=force,
        deadline=deadline,
        stop=stop,
    )


def key_of(entry: RemoteEntry) -> CacheKey:
    """The key a remote entry claims, checked: its inputs must hash to its key and name its entry."""
    key = CacheKey(
        digest=digest_of(entry.inputs),
        inputs=entry.inputs,
        sources={},
        server=ServerCommand(argv=(), kind="other"),
        details={"model_name": entry.model},
    )
    if key.digest != entry.key or key.entry_name != entry.entry:
        raise RemoteDamageError(
            f"remote entry {entry.entry}: its manifest's inputs hash to key {key.digest[:16]}, "
            f"not to the key it claims ({entry.key[:16]}) or its name",
            remedy="delete it ('cachemgr prune --remote --key KEY') and push a good copy",
        )
    return key


def pull_entry(
    root: CacheRoot,
    remote: BoundedRemote,
    entry: RemoteEntry,
    *,
    identity: PodIdentity,
    deadline: float | None,
    stop: StopFlag | None = None,
    progress: Progress | None = None,
    trusted: TrustedKeys | None = None,
) -> tuple[PublishOutcome, Moved]:
    """Download, check and publish one remote entry here (as a pod's remote hit does; with
    ``trusted`` keys, as a trusting pod's: RemoteUntrustedError unless one of them signed it).

    The download runs in the transfer's child, killed at ``deadline`` or on ``stop``; its staging
    is removed then, and nothing is published."""
    key = key_of(entry)
    fetched = download_and_publish(
        root,
        key,
        remote,
        identity=identity,
        deadline=deadline,
        stop=stop,
        progress=progress,
        trusted=trusted,
    )
    if fetched is None:
        raise NotFoundError(
            f"remote entry {entry.entry} was removed while pulling it", remedy="'cachemgr ls --remote'"
        )
    return fetched


# --- prune --remote -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RemotePruneItem:
    entry: str
    upload_id: str  # "" for the whole entry (manifest first), else one upload no manifest names
    size_bytes: int
    why: str

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def plan_remote_prune(
    listing: RemoteListing,
    *,
    keys: Sequence[str] = (),
    compat: Compat | None = None,
    older_than: float | None = None,
    keep_bytes: int | None = None,
    stale_uploads: bool = False,
    now: float | None = None,
) -> list[RemotePruneItem]:
    """What ``prune --remote`` removes: each selector adds entries; nothing is removed here."""
    now = time.time() if now is None else now
    chosen: dict[str, RemotePruneItem] = {}
    damaged = dict(listing.damaged)
    for query in keys:
        if query.strip() in damaged:  # by its name: a damaged manifest names no key to match
            name = query.strip()
            size = sum(u.size_bytes for u in listing.uploads if u.entry == name)
            chosen[name] = RemotePruneItem(name, "", size, "named (its manifest is damaged)")
            continue
        entry = find_remote(listing, query)
        chosen[entry.entry] = RemotePruneItem(entry.entry, "", entry.size_bytes, "named")
    for entry in listing.entries:
        # Judged by its manifest's inputs, as a local entry by its key.json: only an older
        # generation is incompatible, never a newer image's (the bucket serves every cluster).
        facts = key_facts({"inputs": entry.inputs}, entry.key) if compat is not None else None
        why = compat.why_incompatible(facts) if compat is not None and isinstance(facts, KeyFacts) else None
        if why:
            chosen.setdefault(entry.entry, RemotePruneItem(entry.entry, "", entry.size_bytes, why))
        if older_than is not None and now - entry.uploaded_at > older_than:
            chosen.setdefault(entry.entry, RemotePruneItem(entry.entry, "", entry.size_bytes, "old"))
    if keep_bytes is not None:
        left = [e for e in listing.entries if e.entry not in chosen]
        total = sum(e.size_bytes for e in left)
        for entry in sorted(left, key=lambda e: e.uploaded_at):  # oldest first: no last-use in a bucket
            if total <= keep_bytes:
                break
            chosen[entry.entry] = RemotePruneItem(entry.entry, "", entry.size_bytes, "over --keep-bytes")
            total -= entry.size_bytes
    items = list(chosen.values())
    if stale_uploads:
        items += [
            RemotePruneItem(u.entry, u.upload_id, u.size_bytes, "upload without a manifest")
            for u in listing.uploads
            if now - u.last_modified > STALE_UPLOAD_AFTER and u.entry not in chosen
        ]
    return items


def remove(remote: Remote, item: RemotePruneItem, *, deadline: float | None = None) -> int:
    """Remove an entry (its manifest first: readers stop taking it at once) or one dead upload.

    Listing its objects ends at ``deadline`` or when the listing loops. The store's per-key
    refusals (DeleteObjects answers them in ``Errors``, even with ``Quiet``) are a RemoteError
    naming how many it kept: nothing is reported removed that is still there.
    """
    config = remote.config
    if item.upload_id:
        prefix = f"{config.entry_prefix(item.entry)}{OBJECTS}/{item.upload_id}/"
    else:
        prefix = config.entry_prefix(item.entry)
        remote.client.delete_object(Bucket=config.bucket, Key=prefix + MANIFEST_NAME)
    keys = [obj["Key"] for obj in _list(remote, prefix, deadline=deadline)]
    refused: list[dict[str, Any]] = []
    for start in range(0, len(keys), 1000):  # DeleteObjects takes up to 1,000 keys
        batch = [{"Key": k} for k in keys[start : start + 1000]]
        answer = remote.client.delete_objects(Bucket=config.bucket, Delete={"Objects": batch, "Quiet": True})
        refused += [e for e in answer.get("Errors") or () if isinstance(e, dict)]
    if refused:
        first = refused[0]
        raise RemoteError(
            f"remote {config.url} refused to remove {len(refused)} of the {plural(len(keys), 'object')} of "
            f"{item.entry} ({first.get('Code')}: {first.get('Message')}; the first: {str(first.get('Key'))[:200]!r})",
            remedy="check that the credentials may delete objects (s3:DeleteObject) and the bucket's object "
            "lock or retention rules; then run the prune again",
            problem="delete-refused",
        )
    return len(keys)
