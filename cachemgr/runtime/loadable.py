"""Publish only what the server will load: an entry without compiled artifacts is a lie.

vllm-rbln loads exactly two things from ``VLLM_CACHE_ROOT``:

- ``compiled_models/<name>/rbln_config.json`` with its ``.rbln`` files: the optimum path counts a
  directory as compiled when that file is in it (``utils/optimum/converter/dispatch.py`` 120-124,
  ``utils/optimum/paths.py`` ``is_compiled_dir``);
- ``rbln/<model>-<sha1>/<signature>/rank<N>/mega_cache.bin``: the vLLM-model path's bundle
  (``v1/worker/mega_cache.py`` 161-174).

A server that ran with warm-up off, with ``--enforce-eager`` or with ``VLLM_DISABLE_COMPILE_CACHE=1``
saves no bundle, and a failed save is only logged (``mega_cache.py`` 184-247); either way its staging
holds nothing loadable, and publishing it would make every later pod "hit" and compile anyway. A
compile command must have written at least one non-empty file into ``{output_dir}``.
"""

from __future__ import annotations

import os
from pathlib import Path

BUNDLE = "mega_cache.bin"
RBLN_CONFIG = "rbln_config.json"


def why_not_loadable(artifacts: Path, *, strategy: str) -> str | None:
    """None when ``artifacts`` holds something the server will load, else why not (one clause)."""
    if strategy == "vllm":
        if _compiled_dirs(artifacts) or _bundles(artifacts):
            return None
        return (
            f"the server saved no compiled model under {artifacts} (no compiled_models/*/{RBLN_CONFIG}, "
            f"no rbln/**/rank*/{BUNDLE})"
        )
    if _any_file(artifacts):
        return None
    return f"the compile command wrote no file into {artifacts}"


def _compiled_dirs(artifacts: Path) -> list[Path]:
    return [p for p in (artifacts / "compiled_models").glob(f"*/{RBLN_CONFIG}") if _nonempty(p)]


def _bundles(artifacts: Path) -> list[Path]:
    return [p for p in (artifacts / "rbln").glob(f"*/*/rank*/{BUNDLE}") if _nonempty(p)]


def _nonempty(path: Path) -> bool:
    try:
        return path.is_file() and not path.is_symlink() and path.stat().st_size > 0
    except OSError:
        return False


def _any_file(artifacts: Path) -> bool:
    for dirpath, _dirnames, filenames in os.walk(artifacts):
        if any(_nonempty(Path(dirpath) / name) for name in filenames):
            return True
    return False
