"""The trust settings' environment variables, the one definition of their names.

A module of its own so that ``run``'s options read them without importing the signing code
(:mod:`cachemgr.core.signing`, its key classes and base64): a pod in the open mode, which sets
neither, never loads it.
"""

from __future__ import annotations

SIGNING_KEY_ENV = "CACHEMGR_SIGNING_KEY_FILE"  # a publisher's secret key file
TRUSTED_KEYS_ENV = "CACHEMGR_TRUSTED_KEYS"  # the public keys a pod trusts
