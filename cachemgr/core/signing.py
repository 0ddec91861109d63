"""Signing keys of trusted publishers: Ed25519 key pairs with names, as Nix's binary-cache keys.

A secret key file holds one line ``NAME:BASE64``, BASE64 being 64 bytes: the 32-byte seed, then
the 32-byte public key (libsodium's ``crypto_sign`` secret key, which ``nix-store
--generate-binary-cache-key`` writes too, so a Nix key works as it is). A public key is
``NAME:BASE64`` of its 32 bytes. A signature names its key, so keys rotate: pods trust
``builder-1`` and ``builder-2`` while the publisher moves to ``builder-2``, then only
``builder-2`` (Nix's ``trusted-public-keys``).

Every bad key input (a missing, unreadable, wrongly permissioned or malformed key file, a
malformed public key, one name for two different keys) is a :class:`ConfigError` (exit 78)
naming the variable or file. ``cryptography`` is imported only where a key signs, verifies or
is made: parsing public keys needs base64 alone.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from cachemgr.core.errors import ConfigError, UsageError
from cachemgr.core.trust_env import SIGNING_KEY_ENV as SIGNING_KEY_ENV  # noqa: PLC0414
from cachemgr.core.trust_env import TRUSTED_KEYS_ENV as TRUSTED_KEYS_ENV  # noqa: PLC0414

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

# Shown in logs, tables and file names: plain characters only (Nix's own names, such as
# cache.nixos.org-1, fit).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_PUBLIC_BYTES = 32
_SECRET_BYTES = 64  # seed + public key
_SECRET_FILE_LIMIT = 4096
# Group write, or any access by others. Group read stays allowed: a Kubernetes Secret volume
# with an fsGroup gets mode 0440 whatever its defaultMode (the kubelet adds the group's read).
_TOO_OPEN = 0o027


@dataclass(frozen=True)
class PublicKey:
    """A named Ed25519 public key: what a pod trusts."""

    name: str
    raw: bytes = field(repr=False)

    def __str__(self) -> str:
        return f"{self.name}:{base64.b64encode(self.raw).decode()}"

    def verify(self, data: bytes, signature: bytes) -> bool:
        """Whether ``signature`` is this key's over ``data``."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, data)
        except (InvalidSignature, ValueError):
            return False
        return True


@dataclass(frozen=True)
class SecretKey:
    """A named Ed25519 secret key: what a publisher signs with."""

    name: str
    seed: bytes = field(repr=False)
    public: PublicKey

    def sign(self, data: bytes) -> bytes:
        return _private(self.seed).sign(data)

    def to_text(self) -> str:
        return f"{self.name}:{base64.b64encode(self.seed + self.public.raw).decode()}"


@dataclass(frozen=True)
class TrustedKeys:
    """The public keys a pod trusts, by name; any of them may have signed an entry."""

    by_name: Mapping[str, PublicKey] = field(default_factory=lambda: MappingProxyType({}))

    def __bool__(self) -> bool:
        return bool(self.by_name)

    def __iter__(self) -> Iterator[PublicKey]:
        return iter(self.by_name.values())

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.by_name)

    def get(self, name: str) -> PublicKey | None:
        return self.by_name.get(name)

    def signing_with(self, key: PublicKey, *, where: str) -> TrustedKeys:
        """These keys, for a pod that signs with ``key``: :class:`ConfigError` unless they list it.

        A publisher trusting keys that leave out its own would sign what its peers, given the same
        keys, never load: the builder finds its entry a hit and exits 0 while the serving pods wait
        for a publisher for ever (a rotation done in the wrong order: the new signing key before
        the new public key). Nix trusts its own secret-key-files; here a peer trusts only the list.
        """
        _merged({**self.by_name}, key, where=where)  # one name for two keys
        if key.name not in self.by_name:
            raise ConfigError(
                f"{where}: this pod signs with key {key.name}, which CACHEMGR_TRUSTED_KEYS does not list "
                f"({', '.join(self.names)}): pods that trust those keys would never load what it publishes",
                remedy=f"add {key.name}'s public key ('cachemgr keys public --secret-file FILE') to "
                "CACHEMGR_TRUSTED_KEYS of every pod; when rotating, list the new key before signing with it",
                variable=where,
            )
        return self


def _merged(found: dict[str, PublicKey], key: PublicKey, *, where: str) -> dict[str, PublicKey]:
    known = found.get(key.name)
    if known is not None and known.raw != key.raw:
        raise ConfigError(
            f"{where}: key name {key.name} stands for two different public keys",
            remedy="give each key pair its own name (name-1, name-2, ...) and list each public key once",
            variable=where,
        )
    found[key.name] = key
    return found


def parse_public_key(text: str, *, where: str) -> PublicKey:
    """``NAME:BASE64`` -> a public key; :class:`ConfigError` naming ``where`` otherwise."""
    name, raw = _split(text, where=where, what="public key", size=_PUBLIC_BYTES)
    return PublicKey(name, raw)


def parse_trusted_keys(text: str | None, *, where: str = TRUSTED_KEYS_ENV) -> TrustedKeys:
    """Public keys separated by whitespace; an empty or unset value trusts nothing (open mode)."""
    found: dict[str, PublicKey] = {}
    for word in (text or "").split():
        _merged(found, parse_public_key(word, where=where), where=where)
    return TrustedKeys(MappingProxyType(found))


def is_key_name(name: object) -> bool:
    """Whether ``name`` is a key name (``NAME`` of ``NAME:BASE64``): what a signature read from the
    volume or the bucket must name before it is shown anywhere."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def _split(text: str, *, where: str, what: str, size: int) -> tuple[str, bytes]:
    # A public key may be shown (abridged); a secret key never, not even in part: the error line
    # goes to logs and the termination message, which `kubectl describe pod` prints.
    shown = text if len(text) <= 24 else text[:12] + "..." + text[-8:]
    shown = repr(shown) if size == _PUBLIC_BYTES else "the file's text"
    name, colon, encoded = text.strip().partition(":")
    remedy = (
        f"give the {what} as NAME:BASE64, as 'cachemgr keys public --secret-file FILE' prints it"
        if size == _PUBLIC_BYTES
        else "make the file with 'cachemgr keys generate --name NAME --secret-file FILE'"
    )
    if not colon or not _NAME.fullmatch(name):
        raise ConfigError(
            f"{where}: {shown} is not a {what} of the form NAME:BASE64 (NAME: letters, digits, '.', '_', '-')",
            remedy=remedy,
            variable=where,
        )
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != size:
        raise ConfigError(
            f"{where}: the {what} {name} is not {size} bytes of base64 ({len(raw)} decoded)",
            remedy=remedy,
            variable=where,
        )
    return name, raw


def load_secret_key(path: Path, *, where: str = SIGNING_KEY_ENV) -> SecretKey:
    """The secret key in ``path`` (a pod-local file: a Kubernetes Secret volume's link is followed).

    :class:`ConfigError` naming ``where`` and the file if it is missing, unreadable, open to
    others, or not one key.
    """
    shown = f"{where} {path}"
    text = _read_secret_file(path, shown=shown)
    name, raw = _split(text, where=shown, what="secret key", size=_SECRET_BYTES)
    seed, public = raw[:32], raw[32:]
    derived = _public_of(seed)
    if derived != public:
        raise ConfigError(
            f"{shown}: the secret key {name} does not hold its own public key (the file is damaged)",
            remedy="make a new key pair with 'cachemgr keys generate' and distribute its public key",
            variable=where,
        )
    return SecretKey(name, seed, PublicKey(name, public))


def _read_secret_file(path: Path, *, shown: str) -> str:
    try:
        # O_NONBLOCK: a FIFO in its place must not hang a pod's start.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        remedy = (
            "mount the signing key Secret there, or point the variable at the key file"
            if isinstance(error, FileNotFoundError)
            else "make the file readable by the pod's user (and by no one else)"
        )
        raise ConfigError(f"{shown}: {error.strerror}", remedy=remedy, path=str(path)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(
                f"{shown} is not a regular file",
                remedy="point it at the secret key file 'cachemgr keys generate' wrote",
                path=str(path),
            )
        if st.st_mode & _TOO_OPEN:
            raise ConfigError(
                f"{shown} is open to others (mode {stat.S_IMODE(st.st_mode):04o}): a secret key must be "
                "readable by its owner only",
                remedy=f"chmod 600 {path}; a Kubernetes Secret volume needs defaultMode: 0400",
                path=str(path),
            )
        data = os.read(fd, _SECRET_FILE_LIMIT + 1)
    except OSError as error:
        raise ConfigError(
            f"{shown}: {error.strerror}", remedy="check the key file and its volume", path=str(path)
        ) from None
    finally:
        os.close(fd)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        text = ""
    if len(data) > _SECRET_FILE_LIMIT or len(text.split()) != 1:
        raise ConfigError(
            f"{shown} does not hold one NAME:BASE64 secret key",
            remedy="make the file with 'cachemgr keys generate --name NAME --secret-file FILE'",
            path=str(path),
        )
    return text


def generate_secret_key(name: str, path: Path) -> SecretKey:
    """A new key pair, its secret written to ``path`` (mode 0600, never over an existing file)."""
    if not _NAME.fullmatch(name):
        raise UsageError(
            f"--name {name!r} is not a key name (letters, digits, '.', '_', '-'; at most 100)",
            remedy="name keys NAME-N (builder-1, builder-2, ...) so that they can rotate",
        )
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    seed = Ed25519PrivateKey.generate().private_bytes_raw()
    key = SecretKey(name, seed, PublicKey(name, _public_of(seed)))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise UsageError(
            f"--secret-file {path} already exists; cachemgr never overwrites a key",
            remedy="choose another --secret-file, or remove the old key once nothing signs with it",
        ) from None
    except OSError as error:
        raise UsageError(
            f"--secret-file {path}: {error.strerror}", remedy="choose a writable path for the secret key"
        ) from None
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (key.to_text() + "\n").encode("ascii"))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)
    return key


def _private(seed: bytes) -> Ed25519PrivateKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(seed)


def _public_of(seed: bytes) -> bytes:
    return _private(seed).public_key().public_bytes_raw()
