"""The compile lease's default duration, the one definition of it.

A module of its own so that the CLI's parser (built for every command, ``cachemgr probe``
included) and ``run``'s options read it without importing the lease's machinery.
"""

from __future__ import annotations

DEFAULT_DURATION = 30.0  # seconds a holder may stay silent before a waiter takes the lease over
CONFIRM_ENV = "CACHEMGR_LEASE_CONFIRM"  # --lease-confirm's environment variable
