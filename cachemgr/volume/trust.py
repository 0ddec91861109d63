"""Only what a trusted publisher built: an entry's signed statement, and a pod's verdict on it.

A publisher with a signing key (``CACHEMGR_SIGNING_KEY_FILE``) signs one statement per entry,
computed from its private staging before the publishing rename (both strategies, in the same
read as the manifest's xxh3) and never from a published entry, which others can write::

    {"kind": "cachemgr-entry", "format": 1, "key": DIGEST, "inputs": {...},
     "files": N, "bytes": TOTAL, "list": "blake3:HEX", "signer": NAME, "signed_at": T, "built_by": {...}}

``list`` is the BLAKE3 of the canonical list ``[[path, size, blake3], ...]`` of every file under
``artifacts/`` (what a server loads), whose BLAKE3 each the manifest records. The statement's exact
bytes and the Ed25519 signature over them are ``signature.json``, beside ``manifest.json`` in the
entry; the manifest lists it, so ``push`` and the upload after a publish carry it to the remote.
As in Nix's binary caches (a signature over a store path's NAR hash, ``trusted-public-keys``,
``require-sigs``), a pod checks the signature over the hashes and then the bytes against them.

A trusting pod (``CACHEMGR_TRUSTED_KEYS``) uses an entry only if (:func:`judge`, then
:mod:`cachemgr.volume.contentcheck`): ``signature.json`` parses and names a trusted key whose
signature over the statement verifies; the statement names this key's digest and inputs; the
manifest's artifacts hash to the statement's list; and every artifact's bytes have their signed
BLAKE3. Anything else is untrusted, with a reason a person can act on (``untrusted: unsigned``,
``untrusted: key other-1``, ``untrusted: artifacts/rank3.rbln changed after signing``): never
launched, never deleted (quarantine keeps it), and never an exit for the pod: whoever writes
the volume must not be able to stop the pods that read it.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from cachemgr.core import jsonread, safefs
from cachemgr.core.fsutil import atomic_write_json, hash_fd
from cachemgr.volume.manifest import ARTIFACTS, FileRecord, Manifest

if TYPE_CHECKING:
    from cachemgr.core.signing import SecretKey, TrustedKeys
    from cachemgr.key.cachekey import CacheKey
    from cachemgr.volume.contentcheck import StopFlag

SIGNATURE_NAME = "signature.json"
KIND = "cachemgr-entry"
FORMAT = 1
_SIGNATURE_LIMIT = 1 << 20  # key inputs and a few numbers; a larger file is not ours
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_SIGNATURE_BYTES = 64  # Ed25519
_LIST = re.compile(r"blake3:[0-9a-f]{64}")


# NamedTuples, not dataclasses: this module is imported on a trusting pod's hit, before its
# server starts, and defining a frozen dataclass took about 0.5 ms here, a NamedTuple 0.06.
class Statement(NamedTuple):
    """What a publisher signs for one entry (the module docstring has the fields)."""

    key: str
    inputs: Mapping[str, Any]
    files: int
    total_bytes: int
    listed: str  # "blake3:HEX" of the canonical artifact list
    signer: str
    signed_at: float
    built_by: Mapping[str, Any]

    def canonical(self) -> bytes:
        doc = {
            "kind": KIND,
            "format": FORMAT,
            "key": self.key,
            "inputs": self.inputs,
            "files": self.files,
            "bytes": self.total_bytes,
            "list": self.listed,
            "signer": self.signer,
            "signed_at": self.signed_at,
            "built_by": self.built_by,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


class Signed(NamedTuple):
    """``signature.json`` as read: the statement's exact bytes, the key it names, the signature."""

    text: bytes
    key_name: str
    signature: bytes
    statement: Statement


class Verdict(NamedTuple):
    """A trusting pod's judgement of an entry's signature (its bytes are checked after this)."""

    trusted: bool
    reason: str  # "" when trusted, else "untrusted: ..."
    signer: str | None = None  # the key the signature names (a claim unless trusted)
    statement: Statement | None = None


def artifacts(manifest: Manifest) -> list[FileRecord]:
    """The files a server loads (under ``artifacts/``), in the manifest's order."""
    return [record for record in manifest.files if record.path.startswith(ARTIFACTS + "/")]


def list_digest(records: Sequence[FileRecord]) -> str:
    """``blake3:HEX`` of ``[[path, size, blake3], ...]`` sorted by path; records without a BLAKE3
    count with ``null``, which no statement lists."""
    from blake3 import blake3

    rows = sorted([r.path, r.size, r.blake3] for r in records)
    text = json.dumps(rows, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return "blake3:" + blake3(text).hexdigest()


# --- signing, in private staging ---------------------------------------------------------------


def sign_staging(
    staging: Path,
    manifest: Manifest,
    secret: SecretKey,
    *,
    built_by: Mapping[str, Any],
    within: Path | None,
) -> Manifest:
    """Write ``signature.json`` into ``staging`` over ``manifest`` (just built there, with BLAKE3s)
    and return the manifest listing it too. Called before the publishing rename, never after."""
    files = artifacts(manifest)
    statement = Statement(
        key=manifest.key,
        inputs=manifest.inputs,
        files=len(files),
        total_bytes=sum(r.size for r in files),
        listed=list_digest(files),
        signer=secret.name,
        signed_at=round(time.time(), 3),
        built_by=dict(built_by),
    )
    text = statement.canonical()
    doc = {
        "format": FORMAT,
        "statement": text.decode("ascii"),
        "key": secret.name,
        "signature": base64.b64encode(secret.sign(text)).decode("ascii"),
    }
    atomic_write_json(staging / SIGNATURE_NAME, doc, within=within)
    with safefs.open_tree(staging, within=within) as folder:
        fd = os.open(SIGNATURE_NAME, _READ_FLAGS, dir_fd=folder)
        try:
            st = os.fstat(fd)
            record = FileRecord(SIGNATURE_NAME, st.st_size, hash_fd(fd), st.st_mtime_ns)
        finally:
            os.close(fd)
    listed = sorted([*(r for r in manifest.files if r.path != SIGNATURE_NAME), record], key=lambda r: r.path)
    return manifest._replace(files=tuple(listed))


# --- reading and judging -----------------------------------------------------------------------


class SignatureError(ValueError):
    """``signature.json`` is not a cachemgr signature: the entry is untrusted, never an exit."""


def read_signed(entry: Path, *, within: Path | None) -> Signed | None:
    """The entry's ``signature.json``, parsed; None if it has none; :class:`SignatureError` if it
    is not one. Read from the entry's folder reached from the root, never through a link."""
    try:
        with safefs.open_tree(entry, within=within) as folder:
            raw = _read_at(folder, SIGNATURE_NAME)
    except FileNotFoundError:
        return None
    return parse_signed(raw) if raw is not None else None


def _read_at(dir_fd: int | None, rel: str) -> bytes | None:
    """The signature's bytes, at most one past the limit (which :func:`parse_signed` refuses)."""
    try:
        with jsonread.open_regular(rel, dir_fd=dir_fd) as fd:
            return os.read(fd, _SIGNATURE_LIMIT + 1)
    except FileNotFoundError:
        return None
    except jsonread.NotRegularError:  # a symlink, a FIFO, a socket, a folder
        raise SignatureError(f"{SIGNATURE_NAME} is not a regular file") from None
    except PermissionError:  # a mode changed by a writer: no flaky volume
        raise SignatureError(f"{SIGNATURE_NAME} is not readable by this pod") from None


def parse_signed(raw: bytes) -> Signed:
    """``signature.json``'s bytes -> :class:`Signed`; :class:`SignatureError` unless it is exactly
    what :func:`sign_staging` writes (every field of its type, the key names plain key names).

    Nothing of a file that does not parse is repeated in the error: it comes from whoever wrote
    the volume or the bucket, and the reason goes to logs, tables and quarantine notes.
    """
    if len(raw) > _SIGNATURE_LIMIT:
        raise SignatureError(f"{SIGNATURE_NAME} is larger than {_SIGNATURE_LIMIT >> 20} MiB")
    try:
        doc = jsonread.parse(raw)
    except ValueError:
        raise SignatureError(f"{SIGNATURE_NAME} does not parse (not JSON)") from None
    return _signed(doc)


def _bad(why: str) -> SignatureError:
    return SignatureError(f"{SIGNATURE_NAME} does not parse ({why})")


def _signed(doc: Any) -> Signed:
    from cachemgr.core.signing import is_key_name

    if not isinstance(doc, dict) or not _count(doc.get("format")) or doc["format"] > FORMAT:
        raise _bad("not a signature of a format this cachemgr reads")
    text = doc.get("statement")
    if not isinstance(text, str) or not text.isascii():
        raise _bad("its statement is not ASCII text")
    if not is_key_name(doc.get("key")):
        raise _bad("the key it names is not a key name")
    encoded = doc.get("signature")
    try:
        signature = base64.b64decode(encoded, validate=True) if isinstance(encoded, str) else b""
    except (binascii.Error, ValueError):
        signature = b""
    if len(signature) != _SIGNATURE_BYTES:
        raise _bad("its signature is not 64 bytes of base64")
    try:
        statement = jsonread.parse(text)
    except ValueError:
        raise _bad("its statement is not JSON") from None
    return Signed(text.encode("ascii"), doc["key"], signature, _statement(statement))


def _statement(doc: Any) -> Statement:
    from cachemgr.core.signing import is_key_name

    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise _bad("its statement is not a cachemgr entry statement")
    if not _count(doc.get("format")) or doc["format"] > FORMAT:
        raise _bad("its statement is of a format this cachemgr does not read")
    fields = {
        "key": _plain(doc.get("key")),  # compared with the pod's digest once the signature holds
        "inputs": isinstance(doc.get("inputs"), dict),
        "files": _count(doc.get("files")),
        "bytes": _count(doc.get("bytes")),
        "list": isinstance(doc.get("list"), str) and _LIST.fullmatch(doc["list"]) is not None,
        "signer": is_key_name(doc.get("signer")),
        "signed_at": _finite(doc.get("signed_at")),
        "built_by": isinstance(doc.get("built_by", {}), dict),
    }
    wrong = [name for name, ok in fields.items() if not ok]
    if wrong:
        raise _bad(f"its statement's {wrong[0]} is not what a signer writes")
    return Statement(
        key=doc["key"],
        inputs=doc["inputs"],
        files=doc["files"],
        total_bytes=doc["bytes"],
        listed=doc["list"],
        signer=doc["signer"],
        signed_at=float(doc["signed_at"]),
        built_by=doc.get("built_by", {}),
    )


def _count(value: Any) -> bool:
    """A non-negative JSON integer (not a bool, not a string of digits)."""
    return type(value) is int and value >= 0


def _plain(value: Any) -> bool:
    """Letters and digits only, as a key digest is: safe to show before it is compared."""
    return isinstance(value, str) and 0 < len(value) <= 128 and value.isascii() and value.isalnum()


def _finite(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def judge_signature(signed: Signed | None, trusted: TrustedKeys) -> Verdict:
    """Unsigned, a key not trusted, or a signature that does not verify: untrusted."""
    if signed is None:
        return Verdict(False, "untrusted: unsigned")
    key = trusted.get(signed.key_name)
    if key is None:
        return Verdict(False, f"untrusted: key {signed.key_name}", signed.key_name, signed.statement)
    if not key.verify(signed.text, signed.signature) or signed.statement.signer != signed.key_name:
        what = f"untrusted: the signature by key {signed.key_name} does not verify (forged or altered)"
        return Verdict(False, what, signed.key_name, signed.statement)
    return Verdict(True, "", signed.key_name, signed.statement)


def judge(
    entry: Path,
    manifest: Manifest,
    *,
    digest: str,
    inputs: Mapping[str, Any],
    trusted: TrustedKeys,
    within: Path | None,
) -> Verdict:
    """Everything but the bytes: the signature, the key it was signed for, the signed file list.

    The bytes come next (:func:`check`).
    Raises ``OSError`` for an I/O error reading ``signature.json`` (a flaky volume, not tampering).
    """
    try:
        verdict = judge_signature(read_signed(entry, within=within), trusted)
    except SignatureError as error:
        return Verdict(False, f"untrusted: {error}")
    statement = verdict.statement
    if not verdict.trusted or statement is None:
        return verdict
    if statement.key != digest or dict(statement.inputs) != dict(inputs):
        return _untrusted(verdict, f"signed for another key ({statement.key[:16]})")
    files = artifacts(manifest)
    if len(files) != statement.files or list_digest(files) != statement.listed:
        return _untrusted(
            verdict, "the manifest's files are not the signed ones (added, removed or re-hashed)"
        )
    return verdict


def _untrusted(verdict: Verdict, why: str) -> Verdict:
    return verdict._replace(trusted=False, reason=f"untrusted: {why}")


def check(
    root: Path,
    entry: Path,
    manifest: Manifest,
    *,
    key: CacheKey,
    trusted: TrustedKeys,
    stop: StopFlag | None = None,
) -> Verdict:
    """:func:`judge` and every artifact's bytes against its signed BLAKE3 (read in parallel).

    Both at once: the signature is judged in a thread of its own (importing ``cryptography`` takes
    longer than anything else it does) while the files are read, and the reading stops as soon as
    the signature fails. Reading bytes runs nothing; only a trusted verdict launches a server.
    """
    from cachemgr.volume.contentcheck import Expected, first_problem

    judged: list[Verdict | BaseException] = []
    failed = threading.Event()

    def judging() -> None:
        try:
            judged.append(
                judge(entry, manifest, digest=key.digest, inputs=key.inputs, trusted=trusted, within=root)
            )
        except BaseException as error:  # noqa: BLE001  # raised in the caller's thread below
            judged.append(error)
        if not isinstance(judged[0], Verdict) or not judged[0].trusted:
            failed.set()

    thread = threading.Thread(target=judging, name="cachemgr-signature", daemon=True)
    thread.start()
    files = [Expected(r.path, r.size, r.blake3 or "") for r in artifacts(manifest)]
    try:
        problem = first_problem(root, entry, files, stop=_Either(stop, failed))
    except InterruptedError:
        if stop is not None and stop.is_set():
            raise
        problem = None  # stopped because the signature failed: that verdict is the answer
    finally:
        thread.join()
    verdict = judged[0]
    if isinstance(verdict, BaseException):
        raise verdict
    if not verdict.trusted or problem is None:
        return verdict
    return _untrusted(verdict, f"{problem.path} {problem.what}")


class _Either:
    """Set when either flag is: the pod's stop (SIGTERM), or a failed signature."""

    def __init__(self, first: StopFlag | None, second: threading.Event) -> None:
        self._first = first
        self._second = second

    def is_set(self) -> bool:
        return self._second.is_set() or (self._first is not None and self._first.is_set())


def inspect_signature(
    dir_fd: int | None, rel: str, trusted: TrustedKeys, *, key: str
) -> tuple[str | None, str]:
    """For ``ls`` (cachemgr.ops.scan): the key an entry's signature names (None: unsigned, or it
    does not parse) and "trusted" or why not. The signature and the key it was signed for, not the
    files: pods and ``verify`` check those. ``rel``: ``signature.json`` from ``dir_fd`` (the
    entries folder), opened as its summary is (no link followed, no FIFO waited on)."""
    try:
        raw = _read_at(dir_fd, rel)
        verdict = judge_signature(parse_signed(raw) if raw is not None else None, trusted)
    except SignatureError as error:
        return None, f"untrusted: {error}"
    except OSError as error:
        return None, f"untrusted: {SIGNATURE_NAME} is unreadable ({error.strerror})"
    if verdict.trusted and verdict.statement is not None and verdict.statement.key != key:
        return verdict.signer, f"untrusted: signed for another key ({verdict.statement.key[:16]})"
    return verdict.signer, "trusted" if verdict.trusted else verdict.reason


def signer_of(entry: Path, *, within: Path | None) -> str | None:
    """The key an entry's signature names, as claimed (not verified): for inspection."""
    try:
        signed = read_signed(entry, within=within)
    except (OSError, SignatureError):
        return None
    return signed.key_name if signed is not None else None
