"""What vllm-rbln 0.12 does with its compile cache that the ``vllm`` strategy's key must follow.

Each fact is read from the real code (vllm-rbln 0.12.0, optimum-rbln 0.12.0, vLLM 0.30.0, which
vllm-rbln pins as ``vllm==0.30.0+cpu``); tests/test_rbln_facts.py re-reads those sources where
they are unpacked and fails when a fact moves, and tools/rbln_facts.py prints them.

- Versions: the bundle signature hashes ``VllmConfig.compute_hash()``, which starts with
  ``vllm.__version__`` (``vllm_rbln/v1/worker/mega_cache.py`` 113-158, vLLM ``config/vllm.py``
  462-484); the optimum directory name hashes no version at all (``utils/optimum/converter/
  dispatch.py`` 59-98, "FIXME ... should also include the versions"). So the key holds the
  installed vllm, vllm-rbln and optimum-rbln versions, exactly.
- The model string: vLLM replaces the model by its ``VLLM_MODEL_REDIRECT_PATH`` entry
  (``config/model.py`` 558, ``transformers_utils/utils.py`` 61-108) before vllm-rbln names its
  directories after it.
- The model path: ``--model-impl`` (``transformers`` is ``optimum``), else the deprecated
  ``VLLM_RBLN_USE_VLLM_MODEL``, else ``auto``, which reads the model's architectures
  (``vllm_rbln/config.py`` 319-324, 365-448, 451-520).
- What is never saved on the vLLM-model path: the bundle is written only after warm-up, which is
  skipped with ``--enforce-eager`` or ``VLLM_RBLN_ENABLE_WARM_UP`` off (``v1/worker/utils.py``
  378-384, ``rbln_worker.py`` 511-513, ``rbln_model_runner.py`` 3615-3645), and load/save are
  no-ops with ``VLLM_DISABLE_COMPILE_CACHE=1`` (``mega_cache.py`` 184-185, 208-209).
- The optimum path needs a device to compile: it builds runtimes and checks the devices before
  compiling (optimum-rbln ``configuration_utils.py`` 1133-1140, ``modeling_base.py`` 520-527);
  ``VLLM_RBLN_COMPILE_ONLY`` is read on the vLLM-model path only (``compilation/compiler.py`` 127).
- The optimum compile writes the whole model into a ``TemporaryDirectory()`` (``$TMPDIR``)
  first (optimum-rbln ``modeling.py`` 145-147), then ``save_pretrained`` copies it to
  ``<dir>.tmp`` on the cache and renames it (``modeling_base.py`` 681-718).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Mapping
from typing import Any, Literal

from cachemgr.core import jsonread
from cachemgr.core.errors import ConfigError
from cachemgr.core.versions import release_numbers

ModelImpl = Literal["vllm", "optimum", "auto"]

# The distributions the server runs, the key's name for each, and the variable that overrides it.
# transformers: the hf_config vLLM hashes carries "transformers_version" (PretrainedConfig.to_dict),
# and optimum-rbln compiles the model through transformers' modeling code.
VERSION_ENV: dict[str, tuple[str, str]] = {
    "vllm": ("vllm", "CACHEMGR_VLLM_VERSION"),
    "vllm_rbln": ("vllm-rbln", "CACHEMGR_VLLM_RBLN_VERSION"),
    "optimum_rbln": ("optimum-rbln", "CACHEMGR_OPTIMUM_RBLN_VERSION"),
    "transformers": ("transformers", "CACHEMGR_TRANSFORMERS_VERSION"),
}
# vllm_rbln/config.py 319-324: --model-impl values and the path each names (auto: none yet).
_MODEL_IMPL_ALIASES: dict[str, ModelImpl] = {
    "auto": "auto",
    "transformers": "optimum",
    "optimum": "optimum",
    "vllm": "vllm",
}
_CONFIG_LIMIT = 16 << 20  # a config.json is kilobytes; more is not a config
_REDIRECT_LIMIT = 1 << 20  # a redirect table is a line per model: a megabyte is ~10,000 of them
# vllm_rbln/envs.py 167-173: a parent's resolved path, inherited by the processes it spawns.
_RESOLVED_MODEL_IMPL_ENV = "_VLLM_RBLN_RESOLVED_MODEL_IMPL"


def resolve_versions(environ: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """vllm, vllm-rbln and optimum-rbln versions, exactly as installed (local label kept)."""
    versions: dict[str, str] = {}
    sources: list[str] = []
    missing: list[str] = []
    for key, (dist, env) in VERSION_ENV.items():
        given = environ.get(env, "").strip()
        if given:
            versions[key], source = given, env
        else:
            try:
                versions[key], source = installed_version(dist), f"package {dist}"
            except LookupError:
                missing.append(env)
                continue
        _check_version(versions[key], source, env)
        sources.append(f"{source} {versions[key]}")
    if missing:
        raise ConfigError(
            f"cannot tell the server's versions: {', '.join(VERSION_ENV[k][0] for k, (_, e) in VERSION_ENV.items() if e in missing)} "
            "not installed in this environment, and the variables naming them are unset (the server's "
            "compile cache is keyed on its versions)",
            remedy=f"run in the modelserver image, or set {', '.join(missing)} to the server's versions",
        )
    return versions, "; ".join(sources)


def _check_version(value: str, source: str, env: str) -> None:
    try:
        release_numbers(value)
    except ValueError:
        raise ConfigError(
            f"{source} gives {value!r}, which is not a version number",
            remedy=f"set {env} to a version such as 0.30.0+cpu",
        ) from None


def installed_version(distribution: str) -> str:
    """A distribution's version from its metadata; ``LookupError`` when it is not installed.

    The ``.dist-info`` directories on ``sys.path`` first (one listdir per path entry, one small
    read): ``importlib.metadata`` costs tens of ms on the hit path. Anything else (egg-info,
    odd names) falls back to ``importlib.metadata``.
    """
    wanted = _normalize(distribution)
    for folder in sys.path:
        for name in _dist_infos(folder or ".").get(wanted, ()):
            found = _metadata_version(os.path.join(folder or ".", name, "METADATA"))
            if found:
                return found
    return _importlib_version(distribution)


@functools.lru_cache(maxsize=64)
def _dist_infos(folder: str) -> dict[str, tuple[str, ...]]:
    """A ``sys.path`` folder's ``.dist-info`` directories by normalized name: listed once per process,
    though the key asks for five distributions (the compiler, vllm, vllm-rbln, optimum-rbln, transformers)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return {}
    found: dict[str, tuple[str, ...]] = {}
    for name in names:
        stem, dot, ext = name.rpartition(".")
        if ext == "dist-info" and dot:
            dist = _normalize(stem.partition("-")[0])
            found[dist] = (*found.get(dist, ()), name)
    return found


def _metadata_version(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as meta:
            for line in meta:
                if line.startswith("Version:"):
                    return line.partition(":")[2].strip()
                if not line.strip():
                    return None  # end of the headers
    except OSError:
        return None
    return None


def _importlib_version(distribution: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError as error:
        raise LookupError(distribution) from error


def _normalize(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def redirected_model(model: str, environ: Mapping[str, str]) -> str:
    """vLLM's ``maybe_model_redirect``: the model string the server will really use."""
    path = environ.get("VLLM_MODEL_REDIRECT_PATH")
    if not path or not os.path.exists(path):
        return model
    try:
        # Bounded, and never blocking: a FIFO planted there would hang the pod past its SIGTERM (the
        # server would hang on it too, so it is refused). A link is followed, as the server follows
        # it: a ConfigMap's files are links.
        text = jsonread.read_bytes(path, limit=_REDIRECT_LIMIT, follow=True).decode("utf-8")
    except (OSError, ValueError) as error:  # ValueError: not a regular file, too large, not UTF-8
        raise ConfigError(
            f"cannot read VLLM_MODEL_REDIRECT_PATH {path}: {error}",
            remedy=f"make it a regular file of at most {jsonread.human_limit(_REDIRECT_LIMIT)}, "
            "or unset VLLM_MODEL_REDIRECT_PATH",
        ) from error
    try:
        mapping: Any = json.loads(text)
    except (ValueError, RecursionError):  # vLLM's _maybe_json_dict: any failure is "not JSON"
        mapping = {}
    if not mapping:
        # transformers_utils/utils.py 69-78: "model target" lines; a line of another shape is skipped.
        mapping = dict(parts for line in text.splitlines() if len(parts := line.strip().split()) == 2)
    if not isinstance(mapping, dict):
        raise ConfigError(
            f"VLLM_MODEL_REDIRECT_PATH {path} holds JSON that is not an object; vLLM fails on it",
            remedy='write {"model id": "/local/path"} or "model-id /local/path" lines',
        )
    target = mapping.get(model)
    return str(target) if target else model


def model_impl(settings: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    """Which model path vllm-rbln 0.12 takes, as far as it can be told without the model's config.

    ``resolve_model_impl`` (config.py 365-448): the flag; else the path a parent process published
    in ``_VLLM_RBLN_RESOLVED_MODEL_IMPL`` (any non-empty value is taken as it is, envs.py 167-173);
    else the deprecated ``VLLM_RBLN_USE_VLLM_MODEL``; else ``auto`` (the model's architectures decide).
    """
    flagged = _MODEL_IMPL_ALIASES.get(str(settings.get("model_impl", "auto")), "auto")
    if flagged != "auto":
        return flagged
    inherited = environ.get(_RESOLVED_MODEL_IMPL_ENV)
    if inherited:
        return inherited
    if "VLLM_RBLN_USE_VLLM_MODEL" in environ:
        return "vllm" if environ["VLLM_RBLN_USE_VLLM_MODEL"].lower() in {"true", "1"} else "optimum"
    return "auto"


def auto_path(model: str | None, options: Mapping[str, Any], architectures: frozenset[str]) -> str:
    """``--model-impl auto`` as vllm-rbln 0.12 resolves it (``config.py`` 451-520, ``_model_impl_for``):
    a compiled optimum-rbln directory takes the optimum path; else the model's architectures
    (``hf_overrides`` first, as the server passes them to ``get_config``) decide: optimum if optimum-rbln
    implements one of them (``utils/optimum/registry.py`` 112-117), else the vLLM-model path.

    Only a local directory (or ``--hf-config-path``) is read; a hub model's config is not at hand
    before the server downloads it, and its path stays ``auto`` (both paths' rules: stricter).
    """
    source = options.get("hf_config_path") or model
    if not isinstance(source, str) or not source or not os.path.isdir(source):
        return "auto"
    if model and os.path.isfile(os.path.join(model, "rbln_config.json")):
        return "optimum"  # utils/optimum/paths.py 19-22: an already compiled directory
    overrides = options.get("hf_overrides")
    named = overrides.get("architectures") if isinstance(overrides, dict) else None
    if named is None:
        config = _model_config(os.path.join(source, "config.json"))
        if config is _UNREADABLE:
            return "auto"  # the server reads it again a moment later and says what is wrong
        named = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(named, list):
        named = []
    return "optimum" if any(isinstance(a, str) and a in architectures for a in named) else "vllm"


_UNREADABLE = object()


def _model_config(path: str) -> Any:
    """The config.json at ``path``, or :data:`_UNREADABLE` where the server will say what is wrong.

    Read bounded, never blocking: a FIFO planted as the model's config.json would hang the pod past
    its SIGTERM, and the server would hang on it too; it and a file too large to be a config are a
    :class:`ConfigError`. A link is followed (a hub snapshot's files are links to its blobs).
    """
    try:
        raw = jsonread.read_bytes(path, limit=_CONFIG_LIMIT, follow=True)
    except OSError:
        return _UNREADABLE
    except ValueError as error:  # not a regular file, or larger than the limit
        raise ConfigError(
            f"cannot read the model's config {path}: {error}",
            remedy=f"make it the model's config.json, a regular file of at most {jsonread.human_limit(_CONFIG_LIMIT)}",
        ) from None
    try:
        return jsonread.parse(raw, limit=_CONFIG_LIMIT)
    except ValueError:
        return _UNREADABLE


def never_saved(settings: Mapping[str, Any], environ: Mapping[str, str]) -> list[str]:
    """Why the vLLM-model path would compile and save nothing: each reason, or none."""
    reasons = []
    if settings.get("enforce_eager") is True:
        reasons.append("--enforce-eager skips the warm-up that compiles and saves the bundle")
    if environ.get("VLLM_RBLN_ENABLE_WARM_UP", "True").lower() not in {"true", "1"}:
        reasons.append("VLLM_RBLN_ENABLE_WARM_UP is off, so the bundle is never compiled nor saved")
    if _disable_compile_cache(environ):
        reasons.append("VLLM_DISABLE_COMPILE_CACHE=1 makes vllm-rbln neither load nor save its bundle")
    return reasons


def _disable_compile_cache(environ: Mapping[str, str]) -> bool:
    # vLLM envs.py 364: bool(int(...)); a value int() refuses makes the server fail, not cache.
    try:
        return bool(int(environ.get("VLLM_DISABLE_COMPILE_CACHE", "0")))
    except ValueError:
        return False


def uncacheable(
    settings: Mapping[str, Any], environ: Mapping[str, str], *, impl: str | None = None
) -> list[str]:
    """``key``/``explain``: why this configuration cannot be cached, given its model path."""
    impl = _known(impl or model_impl(settings, environ))
    if impl == "optimum":
        return []  # the optimum path saves compiled_models/ at load, whatever these say
    reasons = never_saved(settings, environ)
    if impl == "auto":
        return [f"if the model takes the vLLM-model path (--model-impl auto): {r}" for r in reasons]
    return reasons


def cpu_compile_refusal(settings: Mapping[str, Any], environ: Mapping[str, str]) -> str | None:
    """Why ``warm`` on a node without an NPU cannot compile this model, or None if it can."""
    impl = _known(model_impl(settings, environ))
    if impl == "vllm":
        return None
    if impl == "optimum":
        return (
            "the model runs on vllm-rbln's optimum path, which creates NPU runtimes and checks the "
            "devices before it compiles (VLLM_RBLN_COMPILE_ONLY works on the vLLM-model path only)"
        )
    return (
        "with --model-impl auto, vllm-rbln picks the model path from the model's architectures, and "
        "its optimum path cannot compile without an NPU"
    )


def _known(impl: str) -> str:
    """A path name vllm-rbln acts on, or ``auto`` for any other value (the model's config decides)."""
    return impl if impl in ("vllm", "optimum") else "auto"
