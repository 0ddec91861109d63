"""``keys generate`` and ``keys public``: the signing keys of trusted publishers.

``generate`` writes a new Ed25519 secret key (mode 0600, never over an existing file) and prints
its public key ``NAME:BASE64`` on stdout, for the pods' ``CACHEMGR_TRUSTED_KEYS``; ``public``
prints it again from the secret key file. Notes go to stderr, so ``$(cachemgr keys ...)`` is the
key alone.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from cachemgr.cli.render import emit, tell
from cachemgr.core.errors import UsageError
from cachemgr.core.signing import generate_secret_key, load_secret_key


def keys(args: argparse.Namespace, _server_argv: list[str], _environ: Mapping[str, str]) -> int:
    path = Path(args.secret_file)
    if args.action == "public":
        if args.name:
            raise UsageError("'keys public' takes no --name", remedy="the name is in the secret key file")
        emit(str(load_secret_key(path, where="--secret-file").public))
        return 0
    if not args.name:
        raise UsageError(
            "'keys generate' needs --name",
            remedy="name keys NAME-N (builder-1, builder-2, ...) so they can rotate",
        )
    secret = generate_secret_key(args.name, path)
    emit(str(secret.public))
    tell(
        "note",
        [
            f"secret key {secret.name} written to {path} (mode 0600): give it to the publisher only "
            "(CACHEMGR_SIGNING_KEY_FILE, from a Secret with defaultMode 0400)",
            "the public key above goes into every pod's CACHEMGR_TRUSTED_KEYS",
        ],
    )
    return 0
