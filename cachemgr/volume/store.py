"""The cache volume's layout: published entries, private staging, and their transitions.

::

    <root>/cachemgr-layout.json     layout version marker (a newer one is refused)
    <root>/CACHEDIR.TAG             tells backup tools this is a cache
    <root>/entries/<name>/          published, immutable: key.json, artifacts/, manifest.json
    <root>/staging/<digest>/<id>/   one private directory per compile attempt (+ <id>.json owner)
    <root>/leases/<digest>.lock     the compile lease of a key (+ .holder.json: pod, node, since)
    <root>/usage/<digest>/          who uses an entry now, and when it was last used
    <root>/failures/<digest>/       one record per failed compile, never replayed
    <root>/quarantine/              damaged entries, moved aside for inspection
    <root>/trash/                   entries being pruned

Correctness never rests on the lease: an attempt compiles into its own staging directory,
writes the manifest last, fsyncs, and publishes with one rename of the whole directory. The
first rename wins; a later one finds the entry there and discards its copy.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from cachemgr.core import safefs, safewalk
from cachemgr.core.errors import CompileError
from cachemgr.core.fsutil import (
    atomic_write_json,
    fit_name,
    fsync_dir,
    fsync_tree,
    make_read_only,
    random_suffix,
    remove_tree,
    walk_files,
)
from cachemgr.core.log import get_logger
from cachemgr.key.cachekey import CacheKey, digest_of
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import CacheRoot
from cachemgr.volume.manifest import (
    ARTIFACTS,
    KEY_NAME,
    SUMMARY_NAME,
    Manifest,
    ManifestError,
    Problem,
    VerifyMode,
    build_manifest,
    check_files,
    read_manifest,
    write_manifest,
)

if TYPE_CHECKING:
    from cachemgr.core.signing import SecretKey, TrustedKeys
    from cachemgr.volume.contentcheck import StopFlag

# --- lookup -------------------------------------------------------------------------------

# untrusted: whole and committed, but not what a trusted publisher built (cachemgr.volume.trust).
LookupStatus = Literal["hit", "miss", "damaged", "untrusted"]


class Lookup(NamedTuple):
    """The result of looking for a key's entry: lock-free and read-only."""

    status: LookupStatus
    path: Path
    manifest: Manifest | None = None
    problems: tuple[Problem, ...] = ()
    signer: str | None = None  # the key that signed a trusted hit
    untrusted: str = ""  # why, for status "untrusted": "untrusted: unsigned", ...

    @property
    def reason(self) -> str:
        return self.untrusted or "; ".join(str(p) for p in self.problems)


def lookup(
    root: CacheRoot,
    key: CacheKey,
    *,
    mode: VerifyMode = "fast",
    trusted: TrustedKeys | None = None,
    stop: StopFlag | None = None,
) -> Lookup:
    """Is there a committed entry for ``key`` whose files match its manifest?

    With ``trusted`` keys (a trusting pod), a hit must also be signed by one of them, and every
    artifact's bytes must be the signed ones (read now, in parallel: cachemgr.volume.trust);
    ``InterruptedError`` once ``stop`` is set meanwhile.
    """
    path = root.entry_path(key)
    st = safefs.lstat(root.path, path)
    if st is None:
        return Lookup("miss", path)
    if not stat.S_ISDIR(st.st_mode):
        # A symlink here would serve files from outside the volume; a rename moves it aside safely.
        what = f"the entry is {safefs.describe(st)}, not a directory"
        return Lookup("damaged", path, problems=(Problem(path.name, what),))
    try:
        found = _check_entry(root, key, path, mode=mode, stop=stop)
        return (
            check_trust(root, key, found, trusted, stop=stop) if trusted and found.status == "hit" else found
        )
    except FileNotFoundError as error:
        # Moved away while it was checked (a prune, a writer of the volume): none to use. Still
        # there, something in it went: damage, never an I/O error that stops the pod.
        if safefs.lstat(root.path, path) is None:
            return Lookup("miss", path)
        return Lookup(
            "damaged", path, problems=(Problem(path.name, f"a file went while it was checked: {error}"),)
        )
    except PermissionError as error:
        if not trusted:
            raise  # the open mode: an unreadable entry is an I/O error (exit 74), as it always was
        # A trusting pod never exits for what a writer of the volume did (cachemgr.volume.contentcheck).
        # The name comes from a manifest no key has vouched for yet: shown only if it is plain.
        name = os.path.basename(str(error.filename or ""))
        name = name if name.isprintable() and 0 < len(name) <= 100 else "a file or folder of it"
        what = f"untrusted: {name} is not readable by this pod: its mode was changed"
        return Lookup("untrusted", path, untrusted=what)


def _check_entry(
    root: CacheRoot, key: CacheKey, path: Path, *, mode: VerifyMode, stop: StopFlag | None = None
) -> Lookup:
    """The committed entry at ``path`` against its manifest: a hit, or damaged (why)."""
    try:
        manifest = read_manifest(path)
    except ManifestError as error:
        return Lookup("damaged", path, problems=(Problem("manifest.json", str(error)),))
    if manifest.key != key.digest or dict(manifest.inputs) != dict(key.inputs):
        what = "manifest was written for different key inputs (digest collision or tampering)"
        return Lookup("damaged", path, manifest, (Problem("manifest.json", what),))
    problems = check_files(path, manifest, mode=mode, within=root.path, on_file=_stopping(stop))
    return Lookup("damaged" if problems else "hit", path, manifest, tuple(problems))


def _stopping(stop: StopFlag | None) -> Callable[[int], None] | None:
    """``--verify full`` reads every byte (seconds to minutes on a large entry): between two
    files, a termination signal ends the check with ``InterruptedError``."""
    if stop is None:
        return None

    def after_file(_size: int) -> None:
        if stop.is_set():
            raise InterruptedError("stopped while the entry's files were checked")

    return after_file


def check_trust(
    root: CacheRoot, key: CacheKey, found: Lookup, trusted: TrustedKeys, *, stop: StopFlag | None = None
) -> Lookup:
    """A hit whose signature is a trusted key's and whose bytes are the signed ones, else untrusted."""
    from cachemgr.volume.trust import check  # a trusting pod only

    assert found.manifest is not None  # a hit has its manifest
    try:
        verdict = check(root.path, found.path, found.manifest, key=key, trusted=trusted, stop=stop)
    except safefs.UnsafePathError as error:  # the entry swapped for a link since the fast check
        return Lookup("damaged", found.path, found.manifest, (Problem(found.path.name, error.what),))
    if not verdict.trusted:
        return Lookup(
            "untrusted", found.path, found.manifest, signer=verdict.signer, untrusted=verdict.reason
        )
    return found._replace(signer=verdict.signer)


def quarantine(root: CacheRoot, entry: Path, *, reason: str) -> Path | None:
    """Move a damaged entry aside for inspection; None if another pod already did."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = root.quarantine / fit_name(
        "", entry.name, f".{stamp}.{random_suffix(3)}", room=len(".reason.json")
    )
    try:
        safefs.make_dirs(root.path, root.quarantine)
        safefs.rename(root.path, entry, target)
    except FileNotFoundError:
        return None
    with contextlib.suppress(OSError):
        safefs.check_dir(root.path, root.quarantine)  # the note is written by path: no link there
        atomic_write_json(
            target.with_name(target.name + ".reason.json"),
            {"reason": reason, "at": time.time()},
            within=root.path,
        )
    fsync_dir(root.entries)
    return target


log = get_logger("cachemgr.volume.store")


# --- staging and publish ------------------------------------------------------------------


class Staging(NamedTuple):
    """One compile attempt's private directory on the volume, and its owner record beside it."""

    path: Path
    owner_file: Path
    digest: str
    # The cache root: removal never follows a symlink between it and the attempt.
    within: Path | None = None
    # What the owner record says (create_staging): written again if someone removes it.
    owner: Mapping[str, Any] = MappingProxyType({})

    @property
    def artifacts(self) -> Path:
        return self.path / ARTIFACTS

    def restore_owner(self) -> bool:
        """The owner record again, as it was, while the attempt is there (the heartbeat's restore:
        a silent attempt is taken for a dead pod's); one published or discarded meanwhile keeps
        none. False: nothing was written (the attempt went, as a publish takes it, with its owner)."""
        if not (self.owner and self._there()):
            return False
        atomic_write_json(self.owner_file, dict(self.owner), within=self.within)
        if not self._there():
            remove_tree(self.owner_file, within=self.within)
            return False
        return True

    def _there(self) -> bool:
        st = safefs.lstat(self.within or self.path.parent, self.path)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def discard(self) -> None:
        """Remove the attempt: its files first, then its owner record."""
        remove_tree(self.path, within=self.within)
        remove_tree(self.owner_file, within=self.within)  # a folder planted in its place goes too
        with contextlib.suppress(OSError):
            _rmdir(self.path.parent, within=self.within)


def _rmdir(path: Path, *, within: Path | None) -> None:
    if within is None:
        path.rmdir()
    else:
        safefs.rmdir(within, path)


def create_staging(root: CacheRoot, key: CacheKey, identity: PodIdentity) -> Staging:
    """A fresh attempt directory with ``key.json`` and an empty ``artifacts/``; its owner record
    names this process as the liveness rule needs it (cachemgr.volume.liveness.process_marks)."""
    from cachemgr.volume.liveness import process_marks  # psutil: a miss only

    attempt = f"{identity.file_stem}.{random_suffix(4)}"
    parent = root.staging / key.digest
    safefs.make_dirs(root.path, parent)  # refuses staging/<digest> planted as a symlink
    owner = {**identity.to_json(), "entry": key.entry_name, "since": time.time(), **process_marks()}
    staging = Staging(
        path=parent / attempt,
        owner_file=parent / f"{attempt}.json",
        digest=key.digest,
        within=root.path,
        owner=MappingProxyType(owner),
    )
    atomic_write_json(staging.owner_file, owner, within=root.path)
    safefs.make_dirs(root.path, staging.artifacts)
    atomic_write_json(
        staging.path / KEY_NAME, {**key.to_json(), "details": dict(key.details)}, within=root.path
    )
    return staging


class PublishOutcome(NamedTuple):
    published: bool
    path: Path
    manifest: Manifest


def publish(
    root: CacheRoot,
    staging: Staging,
    key: CacheKey,
    *,
    identity: PodIdentity,
    compile_seconds: float,
    strategy: str,
    extra: dict[str, Any] | None = None,
    signer: SecretKey | None = None,
) -> PublishOutcome:
    """Write the manifest last, fsync everything, and rename the attempt into place.

    With ``signer`` the entry is signed first: the statement of its files, hashed from this
    private staging in the same read as the manifest's (cachemgr.volume.trust).
    If another attempt published first, ours is discarded and theirs is returned: both were
    compiled from the same key, and the first publisher wins.
    """
    _refuse_special_files(staging)
    _write_summary(
        staging,
        key,
        identity=identity,
        compile_seconds=compile_seconds,
        strategy=strategy,
        signer=signer.name if signer is not None else None,
    )
    manifest = build_manifest(
        staging.path,
        key=key.digest,
        inputs=key.inputs,
        created_by=identity.to_json(),
        compile_seconds=compile_seconds,
        strategy=strategy,
        model_name=key.model_name,
        extra=extra,
        blake3=signer is not None,
    )
    if signer is not None:
        from cachemgr.volume.trust import sign_staging  # a publisher with a key only

        manifest = sign_staging(
            staging.path, manifest, signer, built_by=identity.to_json(), within=staging.within
        )
    write_manifest(staging.path, manifest, within=staging.within)
    return commit(root, staging, key, manifest)


def commit(root: CacheRoot, staging: Staging, key: CacheKey, manifest: Manifest) -> PublishOutcome:
    """Publish a staging directory whose manifest is written: fsync, rename, make read-only.

    The one commit step of every publish: a local compile (:func:`publish`) and a download
    from the remote tier (:mod:`cachemgr.remote.hooks`), which keeps the manifest it checked.
    """
    fsync_tree(staging.path, within=root.path)
    target = root.entry_path(key)
    for attempt in (1, 2):
        try:
            safefs.rename(root.path, staging.path, target)
            break
        except OSError as error:
            # A rename onto a peer's entry fails with ENOTEMPTY or EEXIST. NFS, and JuiceFS in the
            # fault campaign, may answer ESTALE instead when a peer published (or quarantined) the
            # name from another client: try once more, then go by what the name holds now.
            if error.errno == errno.ESTALE and attempt == 1:
                continue
            if error.errno not in {errno.ENOTEMPTY, errno.EEXIST, errno.ESTALE}:
                raise
            try:
                theirs = read_manifest(target)
            except ManifestError:
                raise error from None
            staging.discard()
            return PublishOutcome(False, target, theirs)
    fsync_dir(root.entries)
    make_read_only(target, within=root.path)
    # Bookkeeping after the publish: the entry is there whatever happens to it (a folder or a
    # link planted as the owner record is left to the next cleaner, never a failed publish).
    with contextlib.suppress(OSError, safefs.UnsafePathError):
        remove_tree(staging.owner_file, within=root.path)
    with contextlib.suppress(OSError):
        safefs.rmdir(root.path, staging.path.parent)
    return PublishOutcome(True, target, manifest)


def _refuse_special_files(staging: Staging) -> None:
    """An entry holds regular files and real directories only (a link could lead a server out of
    the volume, and every later check would call the entry damaged): such output is a failed
    compile, never published. Neither vllm-rbln 0.12.0 nor optimum-rbln 0.12.0 writes links."""
    with safefs.open_tree(staging.path, within=staging.within) as top:
        for rel, entry, _ in safewalk.walk(top):
            if entry.is_dir(follow_symlinks=False) or entry.is_file(follow_symlinks=False):
                continue
            what = safefs.describe(entry.stat(follow_symlinks=False))
            raise CompileError(
                f"the compile left {what} at {rel} in its output; an entry holds only regular files "
                "and directories",
                remedy="make the compiler write real files there; cachemgr never publishes links or "
                "special files",
                path=rel,
            )


def _write_summary(
    staging: Staging,
    key: CacheKey,
    *,
    identity: PodIdentity,
    compile_seconds: float,
    strategy: str,
    signer: str | None,
) -> None:
    files = list(walk_files(staging.artifacts, within=staging.within))
    summary = {
        "format": 1,
        "key": key.digest,
        "entry": key.entry_name,
        "model": key.model_name,
        # Same weights, any serving settings: what a space estimate learns from.
        "model_id": digest_of(key.inputs["model"])[:16],
        "role": key.inputs["role"],
        "compiler": key.inputs["compiler"],
        "npu": key.inputs["npu"],
        "strategy": strategy,
        "pipeline_parallel_size": key.server.pipeline_parallel_size,
        "size_bytes": sum(st.st_size for _, st in files),
        "files": len(files),
        "created_at": time.time(),
        "compile_seconds": round(compile_seconds, 3),
        "created_by": identity.to_json(),
    }
    if signer is not None:
        # What `ls` shows as the signer without reading the signature: a claim, checked by pods
        # and, with --trusted-keys, by `ls`, `show` and `verify` (cachemgr.volume.trust).
        summary["signer"] = signer
    atomic_write_json(staging.path / SUMMARY_NAME, summary, within=staging.within)
