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

import re
from collections.abc import Iterable

from cachemgr.remote.config import RemoteConfig
from cachemgr.volume.manifest import ARTIFACTS, KEY_NAME, MANIFEST_NAME, SUMMARY_NAME, Manifest
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
