"""Version numbers (PEP 440) without importing ``packaging`` on the hit path.

The versions a pod meets (``0.12.0``, ``0.30.0+cpu``) are plain releases, with a local label at
most; a regular expression accepting exactly such a subset of PEP 440 reads them. Anything else
(``0.12.0rc1``, ``v0.12``, ``1.0.post2``, a typo) goes to ``packaging.version``, which decides:
importing it costs a start about 2 ms (bench/bench_warm.py's import breakdown).
"""

from __future__ import annotations

import re

# A release with an optional local label: valid PEP 440 whatever it holds, and read the same.
# ASCII: IGNORECASE alone folds the Kelvin sign, a long s and a dotless i into [a-z], which
# packaging 26 refuses in a label (older releases take them: the fallback then agrees as well).
_PLAIN = re.compile(r"([0-9]+(?:\.[0-9]+)*)(?:\+[a-z0-9]+(?:[._-][a-z0-9]+)*)?", re.IGNORECASE | re.ASCII)


def release_numbers(text: str) -> tuple[int, ...]:
    """The release numbers of a version: ``0.12.1.dev4+gabc`` -> ``(0, 12, 1)``.

    ``ValueError`` when ``text`` is not a PEP 440 version.
    """
    plain = _PLAIN.fullmatch(text.strip())
    if plain is not None:
        return tuple(int(part) for part in plain.group(1).split("."))
    from packaging.version import InvalidVersion, Version

    try:
        return Version(text).release
    except InvalidVersion:
        raise ValueError(f"{text!r} is not a version number") from None
