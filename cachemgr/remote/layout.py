"""The remote store's layout, and the checks a remote manifest must pass before anything is fetched.

::

    <prefix>entries/<entry name>/manifest.json          the commit record, written last
    <prefix>entries/<entry name>/objects/<upload id>/   the files of one upload (key.json, summary.json,
                                                        artifacts/...), by their manifest paths

The remote manifest is the entry's local manifest plus ``"remote": {"objects": "<upload id>",
...}``. Each upload writes its files under a fresh id, then the manifest: a reader takes only
what a manifest names, so an upload cut short leaves objects no manifest points to (nothing a
reader would take), and two clusters uploading one key at once cannot mix their files: the
last manifest written decides, and every file it names is from its own upload.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from cachemgr.core import jsonread
from cachemgr.remote.client import RemoteDamageError
from cachemgr.remote.config import RemoteConfig
from cachemgr.volume.manifest import (
    ARTIFACTS,
    KEY_NAME,
    MANIFEST_NAME,
    SUMMARY_NAME,
    Manifest,
    parse_manifest,
)
from cachemgr.volume.trust import SIGNATURE_NAME

OBJECTS = "objects"
_UPLOAD_ID = re.compile(r"[0-9a-z][0-9a-z.-]{0,63}")
_TOP_FILES = {KEY_NAME, SUMMARY_NAME, SIGNATURE_NAME}
# A manifest of a MiB lists ~5,000 files; this bounds what a hostile one can make us buffer.
MAX_MANIFEST_BYTES = 64 << 20
MAX_KEY_BYTES = 1024  # an S3 object key, in UTF-8: no object has a longer name
MAX_NAME_BYTES = 255  # a file name on Linux (NAME_MAX): no volume creates a longer one


def manifest_key(config: RemoteConfig, entry: str) -> str:
    return config.entry_prefix(entry) + MANIFEST_NAME


def objects_prefix(config: RemoteConfig, entry: str, upload_id: str) -> str:
    return f"{config.entry_prefix(entry)}{OBJECTS}/{upload_id}/"


def check_upload_id(value: object) -> str | None:
    """The manifest's upload id, or None if it is not one (it becomes part of object keys)."""
    if isinstance(value, str) and _UPLOAD_ID.fullmatch(value):
        return value
    return None


def unsafe_paths(manifest: Manifest, *, prefix: str = "") -> list[str]:
    """The manifest's file paths that could write outside a fresh staging directory, or clash,
    or that no volume can create or no object can have (under the objects' ``prefix``).

    The manifest parser already refuses absolute paths and ``..``; a remote manifest is also held
    to what a publish writes: ``key.json``, ``summary.json``, a signed entry's ``signature.json``
    and files under ``artifacts/``, with
    no empty or ``.`` parts, no backslashes or control characters, no duplicates, and no file
    that is also another file's directory; in UTF-8 (a lone surrogate is not), no part longer
    than a file name can be, and no object key longer than S3's 1,024 bytes (which also bounds
    the depth). Each of these is damage: the entry is refused and replaced, never a reason to
    call the remote unusable.
    """
    problems = []
    paths = [record.path for record in manifest.files]
    room = MAX_KEY_BYTES - len(prefix.encode("utf-8", "surrogatepass"))
    seen: set[str] = set()
    for path in paths:
        why = _path_problem(path, room=room)
        if why is None and path in seen:
            why = "listed twice"
        seen.add(path)
        if why is not None:
            problems.append(f"{_shown(path)}: {why}")
    folders = set(_parents(paths))
    problems += [f"{_shown(p)}: both a file and a directory" for p in paths if p in folders]
    return problems


def _shown(path: str) -> str:
    """A path as a problem names it: quoted, escaped, and no longer than a line can hold."""
    return repr(path) if len(path) <= 120 else f"{path[:100]!r}... ({len(path)} characters)"


def _path_problem(path: str, *, room: int = MAX_KEY_BYTES) -> str | None:
    if not path or path.startswith("/") or "\\" in path or any(ord(c) < 32 or c == "\x7f" for c in path):
        return "not a plain relative path"
    parts = path.split("/")
    if any(part in {"", ".", ".."} for part in parts):
        return "has an empty, '.' or '..' part"
    if path not in _TOP_FILES and (parts[0] != ARTIFACTS or len(parts) < 2):
        return "is not key.json, summary.json, signature.json or under artifacts/"
    return _length_problem(path, room=room)


def _length_problem(path: str, *, room: int) -> str | None:
    """Why no object key can name ``path`` (under a prefix leaving ``room`` bytes), or no volume hold it."""
    try:
        size = len(path.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not UTF-8 (no object key can name it)"
    if size > room:
        return f"is {size} bytes long: past the {MAX_KEY_BYTES}-byte limit of an object key"
    if any(len(part.encode("utf-8")) > MAX_NAME_BYTES for part in path.split("/")):
        return f"has a part longer than {MAX_NAME_BYTES} bytes, which no volume can create"
    return None


def _parents(paths: Iterable[str]) -> Iterable[str]:
    for path in paths:
        parts = path.split("/")
        for i in range(1, len(parts)):
            yield "/".join(parts[:i])


class EntryKey(Protocol):
    """What a transfer needs of a key: a CacheKey, or the worker's copy of these three."""

    @property
    def digest(self) -> str: ...

    @property
    def inputs(self) -> Mapping[str, Any]: ...

    @property
    def entry_name(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class WireKey:
    """What a download needs of a key: its digest, inputs and entry name (a CacheKey has them)."""

    digest: str
    inputs: Mapping[str, Any]
    entry_name: str


def checked_manifest(
    raw: bytes, staging: Path, key: EntryKey, *, prefix_of: Callable[[str], str] | None = None
) -> tuple[Manifest, str]:
    """Parse the remote manifest with the volume's own parser and hold it to this key (and, with
    ``prefix_of``, an upload id -> its objects' prefix, every object key to S3's length)."""
    where = f"remote manifest of {key.entry_name}"
    remedy = "delete it ('cachemgr prune --remote --key KEY') and push a good copy; this pod compiles"
    try:
        manifest = parse_manifest(raw, path=staging / MANIFEST_NAME)
        doc = jsonread.parse(raw)
    except ValueError as error:  # ManifestError too
        raise RemoteDamageError(f"{where} is not a manifest ({error})", remedy=remedy) from None
    if manifest.key != key.digest or dict(manifest.inputs) != dict(key.inputs):
        raise RemoteDamageError(f"{where} was written for another key ({manifest.key[:16]})", remedy=remedy)
    remote = doc.get("remote") if isinstance(doc, dict) else None
    upload_id = check_upload_id(remote.get("objects") if isinstance(remote, dict) else None)
    if upload_id is None:
        raise RemoteDamageError(f"{where} names no valid upload ('remote.objects')", remedy=remedy)
    unsafe = unsafe_paths(manifest, prefix=prefix_of(upload_id) if prefix_of else "")
    if unsafe:
        raise RemoteDamageError(f"{where} lists unsafe paths: {', '.join(unsafe[:3])}", remedy=remedy)
    return manifest, upload_id
