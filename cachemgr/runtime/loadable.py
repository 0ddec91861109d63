"""Publish only what the server will load: an entry without compiled artifacts is a lie.

vllm-rbln loads exactly two things from ``VLLM_CACHE_ROOT``:

- ``compiled_models/<name>/`` with its ``rbln_config.json``: the optimum path counts a directory as
  compiled when that file is in it (``utils/optimum/converter/dispatch.py`` 120-125,
  ``utils/optimum/paths.py`` ``is_compiled_dir``), and optimum-rbln then loads
  ``<compiled_model_name>.rbln`` for every entry of the file's ``_compile_cfgs``, raising when one is
  missing (optimum-rbln ``modeling_base.py`` 189-213, 308-309); a multi-module model keeps each
  submodule's graphs in ``<submodule>/``, named by the nested config under that key
  (``utils/submodule.py`` 150-181). So a directory is loadable only when every named graph is there;
- ``rbln/<model>-<sha1>/<signature>/rank<N>/mega_cache.bin``: the vLLM-model path's bundle
  (``v1/worker/mega_cache.py`` 161-174).

A server that ran with warm-up off, with ``--enforce-eager`` or with ``VLLM_DISABLE_COMPILE_CACHE=1``
saves no bundle, and a failed save is only logged (``mega_cache.py`` 184-247); either way its staging
holds nothing loadable, and publishing it would make every later pod "hit" and compile anyway. A
compile command must have written at least one non-empty file into ``{output_dir}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cachemgr.core import jsonread, safefs, safewalk
from cachemgr.volume.drift import LAYOUTS

BUNDLE = "mega_cache.bin"
RBLN_CONFIG = "rbln_config.json"
COMPILED_MODEL_NAME = "compiled_model"  # RBLNCompileConfig's default (configuration_utils.py 37, 85)
_CONFIG_LIMIT = 16 << 20  # an rbln_config.json is kilobytes; anything this large is not one
_DEPTH = 8  # submodules of submodules (a VLM's vision tower); deeper is not a model


def why_not_loadable(
    artifacts: Path, *, strategy: str, layouts: tuple[str, ...] = LAYOUTS, within: Path | None = None
) -> str | None:
    """None when ``artifacts`` holds something the server will load, else why not (one clause);
    for the vllm strategy, in one of ``layouts`` (the key's release's, for its model paths).

    ``within``: the cache root ``artifacts`` lies under, reached from it one level at a time
    (safefs): a writer who swaps ``staging/<digest>`` for a link meanwhile gets the refusal of a
    swapped folder (UnsafePathError, 74), never a look into wherever the link points, which would
    call a good compile empty (a warm Job's exit 70: the fuzzer, seed 7070 trial 125).
    """
    if strategy != "vllm":
        if _any_file(artifacts, within=within):
            return None
        return f"the compile command wrote no file into {artifacts}"
    if within is None:
        return _why_not_served(artifacts, layouts)
    try:
        with safefs.pinned(within, artifacts) as pinned:  # read through this process's descriptor
            why = _why_not_served(pinned, layouts)
    except FileNotFoundError:  # removed since the compile: nothing there to load
        return _nothing_saved(artifacts, layouts)
    return None if why is None else why.replace(str(pinned), str(artifacts))


def _why_not_served(artifacts: Path, layouts: tuple[str, ...]) -> str | None:
    found = []
    if "optimum_dir" in layouts:
        found = [p for p in (artifacts / "compiled_models").glob(f"*/{RBLN_CONFIG}") if _nonempty(p)]
    problems = [why for why in (missing_graphs(p.parent) for p in found) if why]
    if problems:
        return problems[0]
    if found or ("bundle" in layouts and _bundles(artifacts)):
        return None
    return _nothing_saved(artifacts, layouts)


def _nothing_saved(artifacts: Path, layouts: tuple[str, ...]) -> str:
    looked = [f"compiled_models/*/{RBLN_CONFIG}"] * ("optimum_dir" in layouts)
    looked += [f"rbln/**/rank*/{BUNDLE}"] * ("bundle" in layouts)
    return f"the server saved no compiled model under {artifacts} (no {', no '.join(looked)})"


def missing_graphs(compiled: Path) -> str | None:
    """Why optimum-rbln would fail to load ``compiled``, or None when every graph it names is there."""
    config = _read_config(compiled / RBLN_CONFIG)
    if config is None:
        return f"{compiled / RBLN_CONFIG} is not a JSON object optimum-rbln can read"
    named: list[str] = []
    missing: list[str] = []
    _walk(config, compiled, "", named, missing, depth=0)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        return f"{compiled} names graphs that are not there ({shown}): optimum-rbln would refuse to load it"
    if not named:
        return f"{compiled / RBLN_CONFIG} names no compiled graph (its _compile_cfgs are empty)"
    return None


def _walk(
    config: dict[str, Any], root: Path, rel: str, named: list[str], missing: list[str], *, depth: int
) -> None:
    """Every ``<compiled_model_name>.rbln`` the config (and its submodules' configs) names, found or not."""
    cfgs = config.get("_compile_cfgs") or []
    for cfg in cfgs if isinstance(cfgs, list) else [None]:  # anything but a list names nothing loadable
        name = cfg.get("compiled_model_name", COMPILED_MODEL_NAME) if isinstance(cfg, dict) else None
        graph = f"{rel}{name}.rbln"
        if not isinstance(name, str) or not _plain(name):
            missing.append(repr(name))
        elif _nonempty(root / graph):
            named.append(graph)
        else:
            missing.append(graph)
    for key, value in config.items():
        # a submodule's config is a nested RBLNModelConfig, which carries its cls_name
        if isinstance(value, dict) and "cls_name" in value and _plain(key) and depth < _DEPTH:
            _walk(value, root, f"{rel}{key}/", named, missing, depth=depth + 1)


def _plain(name: str) -> bool:
    """A name that stays in its folder."""
    return bool(name) and "/" not in name and "\x00" not in name and name not in {".", ".."}


def _read_config(path: Path) -> dict[str, Any] | None:
    try:
        data = jsonread.read(path, limit=_CONFIG_LIMIT)  # on the volume: bounded, no link followed
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _bundles(artifacts: Path) -> list[Path]:
    return [p for p in (artifacts / "rbln").glob(f"*/*/rank*/{BUNDLE}") if _nonempty(p)]


def _nonempty(path: Path) -> bool:
    try:
        return path.is_file() and not path.is_symlink() and path.stat().st_size > 0
    except OSError:
        return False


def _any_file(artifacts: Path, *, within: Path | None) -> bool:
    """A non-empty regular file anywhere below ``artifacts`` (the one walk: however deep, no link
    followed; os.walk recursed once per level, and a planted chain of 1,100 folders ended it).
    Reached from ``within`` when given: a folder on the way swapped for a link is refused."""
    try:
        with safefs.open_tree(artifacts, within=within) as top:
            for _, item, _ in safewalk.walk(top):
                if item.is_file(follow_symlinks=False) and item.stat(follow_symlinks=False).st_size > 0:
                    return True
    except safefs.UnsafePathError:
        if within is not None:
            raise  # the refusal of a swapped folder (74), not an empty compile
        return False
    except OSError:
        return False
    return False
