"""Which Hugging Face snapshot a server given a hub model id will load, from the local HF cache.

vLLM hashes the ``hf_config`` it loads (``ModelConfig.compute_hash`` hashes every field, and
``normalize_value`` turns a ``PretrainedConfig`` into its JSON, vLLM 0.30 ``config/utils.py``
318-322), so two pods that load another snapshot of ``org/model`` compile different graphs. Without
``--revision`` the server loads ``main``, whatever the hub says it is today; where the pod's HF cache
already holds the repository, ``refs/<revision>`` names the commit it resolves to, and that commit is
keyed. Where it cannot be told (no cache, a revision the cache has not seen), the key says so.

The cache is found as huggingface_hub finds it: ``HF_HUB_CACHE``, else ``HUGGINGFACE_HUB_CACHE``, else
``$HF_HOME/hub`` (``HF_HOME`` defaults to ``$XDG_CACHE_HOME/huggingface``, then
``~/.cache/huggingface``); a ``--download-dir`` is looked at first, as the server downloads there.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

_COMMIT = re.compile(r"[0-9a-f]{40}")


def cache_dirs(environ: Mapping[str, str], download_dir: str | None = None) -> list[Path]:
    """Where the server looks for hub snapshots, in order."""
    home = environ.get("HF_HOME") or os.path.join(
        environ.get("XDG_CACHE_HOME")
        or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache"),
        "huggingface",
    )
    hub = environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    found = [Path(download_dir).expanduser()] if download_dir else []
    return [*found, Path(hub).expanduser()]


def snapshot(
    model_id: str, revision: str | None, environ: Mapping[str, str], *, download_dir: str | None = None
) -> str | None:
    """The commit the server will load for ``model_id`` at ``revision`` (default ``main``), or None."""
    wanted = revision or "main"
    if _COMMIT.fullmatch(wanted):
        return wanted  # a commit names itself, whether or not it is downloaded yet
    folder = "models--" + model_id.replace("/", "--")
    for cache in cache_dirs(environ, download_dir):
        ref = cache / folder / "refs" / wanted
        try:
            commit = ref.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if _COMMIT.fullmatch(commit) and (cache / folder / "snapshots" / commit).is_dir():
            return commit
    return None
