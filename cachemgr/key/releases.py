"""The key's rules per server release: what each checked release hashes or compiles from, as data.

The ``vllm`` strategy keys what the server keys, or more (docs/design.md, the cache key). What that
is differs from release to release: vllm-rbln 0.12 hashes 3 environment variables into its bundle
signature and reads 16 more into ``RBLNConfig`` fields; 0.11.2 hashes 20 and hashes
``additional_config`` whole; 0.11.1 has no bundle at all on its vLLM-model path. So the rules are
held per release, as data, and a release that is not in the table is keyed strictly
(:data:`STRICT`), never by another release's rules; nor is a model path the key oracle did not
check (:meth:`Release.on_paths`).

Each release's rules are generated (tools/gen_rules.py: cachemgr/key/rules_*.py and the index
cachemgr/key/rules_index.py) from the one place a release is named by hand,
tools/releases/manifest.toml, the facts tools/rbln_facts.py reads off its wheels, the key oracle's
table, and the reviewed judgement calls of tools/releases/overrides.toml. Adding a release:
docs/development.md, "Adding a release".
"""

from __future__ import annotations

from collections.abc import Mapping

from cachemgr.key.release_model import (
    BOTH,
    NEITHER,
    STRICT,
    VLLM_PATH,
    EnvVar,
    Kind,
    Path,
    RblnField,
    Release,
)
from cachemgr.key.rules_index import KNOWN

__all__ = ["BOTH", "KNOWN", "NEITHER", "STRICT", "VLLM_PATH", "EnvVar", "Kind", "Path", "RblnField", "Release",
           "named", "release_for"]  # fmt: skip


def release_for(versions: Mapping[str, str]) -> Release:
    """The rules checked against exactly these versions of vllm-rbln, optimum-rbln and vLLM, else STRICT."""
    for release in KNOWN:
        if all(versions.get(name) == version for name, version in release.versions.items()):
            return release
    return STRICT


def named(vllm_rbln: str) -> Release:
    """The rules of the release whose vllm-rbln is this version (KeyError: no such checked release)."""
    for release in KNOWN:
        if release.versions["vllm_rbln"] == vllm_rbln:
            return release
    raise KeyError(vllm_rbln)
