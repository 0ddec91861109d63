"""Version numbers (PEP 440) without importing ``packaging`` on the hit path.

The versions a pod meets (``0.12.0``, ``0.30.0+cpu``) are plain releases, with a local label at
most; a regular expression accepting exactly such a subset of PEP 440 reads them. Anything else
(``0.12.0rc1``, ``v0.12``, ``1.0.post2``, a typo) goes to ``packaging.version``, which decides:
importing it costs a start about 2 ms (bench/bench_warm.py's import breakdown).
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packaging.version import Version

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


_VERSION_MAX = 128  # characters: PEP 440 versions in the wild are a few dozen


@functools.lru_cache(maxsize=4096)  # a volume holds a few generations, and ls judges each entry
def compare_versions(a: str, b: str) -> int | None:
    """-1, 0 or 1 as ``a`` is older than, the same as or newer than ``b``; None when that cannot
    be told, so that nothing is ever judged older on a guess.

    PEP 440 orders pre-releases and post-releases around their release (``0.13.0rc1`` <
    ``0.13.0`` < ``0.13.0.post1``), and that order is a fact of the release process. Two things it
    orders are not: a local label (``0.30.0+cpu`` and ``0.30.0+gabc``: two builds of one release,
    neither newer), and two development versions of one release (``0.13.0.dev4+gabc`` and
    ``0.13.0.dev5+gdef``: setuptools-scm counts commits since the last tag, on whichever branch,
    so dev5 need not contain dev4). Those are None. Anything not a version is None too.
    """
    if a.strip() == b.strip():
        return 0
    parsed = _parsed(a, b)
    if parsed is None:
        return None
    va, vb = parsed
    ra, rb = _trimmed(va.release), _trimmed(vb.release)
    if ra != rb:
        return -1 if ra < rb else 1
    if va.dev is not None and vb.dev is not None:
        return None  # two dev builds of one release: which holds the other is unknown
    pa, pb = type(va)(va.public), type(vb)(vb.public)
    if pa == pb:  # one release: the same spelled two ways, or two local builds (no order)
        return 0 if va.local == vb.local else None
    return -1 if pa < pb else 1


def _parsed(a: str, b: str) -> tuple[Version, Version] | None:
    """Both as versions, or None: not a version, or longer than any release spells one (a
    string read from the volume; a number past int()'s 4,300 digits raises ValueError)."""
    if len(a) > _VERSION_MAX or len(b) > _VERSION_MAX:
        return None
    from packaging.version import InvalidVersion, Version  # inspection only, never the hit path

    try:
        return Version(a), Version(b)
    except (InvalidVersion, ValueError):
        return None


def _trimmed(release: tuple[int, ...]) -> tuple[int, ...]:
    """``(0, 12, 0)`` -> ``(0, 12)``: PEP 440 pads releases with zeros, so 0.12 is 0.12.0."""
    end = len(release)
    while end > 1 and release[end - 1] == 0:
        end -= 1
    return release[:end]
