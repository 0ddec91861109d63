"""The key's canonical form and digest: sorted, compact JSON, hashed with xxh3-128."""

from __future__ import annotations

import json
from typing import Any

import xxhash


def canonical_json(obj: Any) -> bytes:
    """Sorted, compact, UTF-8 JSON: the form that is hashed."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def digest_of(obj: Any) -> str:
    """xxh3-128 of the canonical JSON, as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(canonical_json(obj))
