"""The ``vllm`` strategy's key: the server's own inputs, keyed as the server's release reads them.

The rule (docs/design.md, the cache key): every input the server hashes or compiles from is keyed
as the server reads it; what it ignores is not keyed; where cachemgr cannot tell, it keys strictly.
"As the server reads it" depends on the release (cachemgr.key.releases), so this module takes the
parsed argv (cachemgr.key.serving) and the environment and applies one release's rules:

- ``serving``: every flag as vLLM stores it, minus the flags runtime-only in that release (for the
  model path the server takes) and minus values equal to the server's default (``--max-num-seqs 1``);
- ``model_impl`` and ``rbln`` (0.12): the model path as vllm-rbln resolves it (it resets
  ``--model-impl`` to ``auto`` before vLLM hashes it) and the RBLN options it compiles from
  (:func:`resolve_rbln`, below), so a flag, an ``additional_config`` key and a variable that set
  one field are one input;
- ``env``: the vllm-rbln variables the path compiles from, parsed (cachemgr.key.rbln_env), and the
  vLLM variables that change what it compiles: ``VLLM_MLA_DISABLE`` (the attention backend) and the
  data-parallel size and rank vLLM takes from ``VLLM_DP_SIZE``/``VLLM_DP_RANK`` when the argv does not;
- ``draft_model``: the speculative decoding draft's weights, which its ``compute_hash`` covers.

A release not in the table is keyed strictly: every ``VLLM_*``/``RBLN_*`` variable as given, every
flag but :data:`cachemgr.key.serving.ALWAYS_RUNTIME`, ``additional_config`` whole, and a note says so.
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from cachemgr.key import vllm_rbln
from cachemgr.key.models import model_exists, resolve_weights
from cachemgr.key.rbln_env import SECRET, keyed_env, parse, present, read
from cachemgr.key.releases import BOTH, Path, RblnField, Release
from cachemgr.key.serving import ALWAYS_RUNTIME, RUNTIME_ONLY, ServerCommand

# Variables no release compiles from (vLLM's compile_factors ignores them too, vLLM 0.30 envs.py
# 2257-2331): where the pod listens, its credentials and logging, the cache directory cachemgr
# itself points the server at, the device selection of this pod, how the NPU is named (keyed as
# `npu`), the redirect table (keyed through the model), and cachemgr warm's own compile-only switch.
ALWAYS_RUNTIME_ENV = frozenset(
    {
        "VLLM_CACHE_ROOT", "VLLM_API_KEY", "VLLM_HOST_IP", "VLLM_PORT", "VLLM_RPC_BASE_PATH", "VLLM_LOGGING_LEVEL",
        "VLLM_LOGGING_PREFIX", "VLLM_LOGGING_STREAM", "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_COLOR",
        "VLLM_CONFIGURE_LOGGING", "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK", "VLLM_USAGE_STATS_SERVER",
        "VLLM_DP_MASTER_IP", "VLLM_DP_MASTER_PORT", "VLLM_MODEL_REDIRECT_PATH", "RBLN_DEVICES",
        "RBLN_VISIBLE_DEVICES", "RBLN_FORCE_NPU_NAME", "RBLN_TARGET_SOC", "VLLM_RBLN_COMPILE_ONLY",
    }
)  # fmt: skip
_STRICT_ENV = re.compile(r"^_?(VLLM|RBLN)_")


class VllmConfig(NamedTuple):
    """The server's configuration as the release's rules key it, where each input came from, and what
    key/explain say about it."""

    model: str | None  # the model string the server uses (after VLLM_MODEL_REDIRECT_PATH)
    inputs: dict[str, Any]
    sources: dict[str, str]
    notes: tuple[str, ...]  # the strict warning: said by key, explain and run
    aside: frozenset[str]  # the flags left out (runtime-only, at their default): of unknown_flags too
    details: dict[str, Any]  # not hashed: the release, the flags left out, the model path, ...
    revision_keyed: bool  # the path's identity hashes --revision of a local model directory too


def vllm_config(
    server: ServerCommand,
    release: Release,
    environ: Mapping[str, str],
    *,
    npu: str,
    versions: Mapping[str, str],
) -> VllmConfig:
    """What this release of the server compiles from, read as it reads it, once."""
    # vLLM applies VLLM_MODEL_REDIRECT_PATH to the model string before anything reads it.
    model = vllm_rbln.redirected_model(server.model, environ) if server.model else server.model
    impl, paths = model_path(release, server, environ, model=model)
    # a path whose artifacts the compiler keeps (0.11.1's vLLM path), or that compiles a local model
    # in place (0.11.2's optimum path); vLLM reads a hub id from its snapshot directory offline
    local = bool(model and (model_exists(pathlib.Path(model).expanduser()) or _offline(environ)))
    layout = release.uncacheable(paths, local_model=local)
    release_layouts = release.layouts
    release = release.on_paths(paths)  # a path the oracle did not check is keyed strictly by itself
    inputs: dict[str, Any] = {"rules": release.name}
    sources: dict[str, str] = {"rules": release.describe()}
    notes: list[str] = []
    if release.strict:
        why = release.why_strict or "this cachemgr was not checked against that release"
        notes.append(
            f"{_versions_text(versions)}: {why}, so the key is "
            "strict (every VLLM_*/RBLN_* variable, every flag but the ones runtime-only in every release, "
            "additional_config whole): pods reuse only what was compiled with exactly their settings"
        )
    else:
        inputs["model_impl"], sources["model_impl"] = (
            impl,
            "--model-impl, _VLLM_RBLN_RESOLVED_MODEL_IMPL, VLLM_RBLN_USE_VLLM_MODEL",
        )
    runtime = runtime_flags(release, paths)
    serving, dropped, defaulted, aside = _serving(server, release, runtime, paths)
    inputs["serving"], sources["serving"] = serving, "argv"
    if release.additional_config == "fields":
        rbln = resolve_rbln(release, server.options.get("additional_config"), environ, paths, npu=npu)
        if rbln:
            inputs["rbln"], sources["rbln"] = rbln, "--rbln-*, --additional-config, VLLM_RBLN_*"
    if release.strict:
        env = {
            k: v
            for k, v in environ.items()
            if _STRICT_ENV.match(k) and k not in ALWAYS_RUNTIME_ENV and not SECRET.search(k)
        }
        env_source = "environment (every VLLM_*/RBLN_* variable: strict)"
    else:
        env, env_source = keyed_env(release, paths, environ, npu=npu)
        env |= vllm_env(server.options, environ, paths)
    inputs["env"], sources["env"] = dict(sorted(env.items())), env_source
    keyed_impl = inputs.get("model_impl", vllm_rbln.model_impl(server.settings, environ))
    details: dict[str, Any] = {
        "release": release.name,
        "dropped": list(dropped),
        "defaulted": list(defaulted),
        "model_impl": keyed_impl,
        "uncacheable": layout + vllm_rbln.uncacheable(server.settings, environ, impl=keyed_impl),
    }
    # How the release lays out the artifacts of the paths this key may take (runtime.loadable, drift),
    # where it is not both vllm-rbln layouts; and a path whose artifacts cachemgr cannot hold.
    layouts = sorted({release_layouts.get(p, "compiler") for p in paths} - {"compiler"})
    if layouts != ["bundle", "optimum_dir"]:
        details["layouts"] = layouts
    if layout:
        details["layout_uncacheable"] = layout
    if model != server.model:
        details["model_redirected_to"] = model
    # vLLM's ModelConfig.compute_hash hashes the revision (config/model.py), which the vLLM-model path's
    # bundle signature holds; the optimum directory name does not (dispatch.py 59-98).
    revision_keyed = "vllm" in paths
    return VllmConfig(model, inputs, sources, tuple(notes), aside, details, revision_keyed)


def _offline(environ: Mapping[str, str]) -> bool:
    """huggingface_hub's HF_HUB_OFFLINE (constants.py: its truthy spellings)."""
    return environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def model_path(
    release: Release, server: ServerCommand, environ: Mapping[str, str], *, model: str | None = None
) -> tuple[str, frozenset[Path]]:
    """The model path as this release picks it, and the paths whose rules apply (both where not known)."""
    if release.strict:
        return "auto", BOTH
    if release.model_impl == "env":
        var = release.env["VLLM_RBLN_USE_VLLM_MODEL"]
        impl = "vllm" if parse(var, environ) is True else "optimum"
    else:
        impl = vllm_rbln.model_impl(server.settings, environ)
        if impl == "auto" and release.optimum_architectures:
            impl = vllm_rbln.auto_path(model, server.options, release.optimum_architectures)
    if impl in ("vllm", "optimum"):
        return impl, frozenset({impl})  # type: ignore[arg-type]
    return impl, BOTH


def runtime_flags(release: Release, paths: frozenset[Path]) -> frozenset[str]:
    """The flags the release's rules leave out of the key, for the model paths in ``paths``."""
    if release.strict:
        return ALWAYS_RUNTIME
    on_path = (
        release.runtime_flags_vllm_path
        if paths == {"vllm"}
        else release.runtime_flags_optimum_path
        if paths == {"optimum"}
        else frozenset()  # the path is not known: only what neither path reads is left out
    )
    return RUNTIME_ONLY | release.runtime_flags | on_path


def _serving(
    server: ServerCommand, release: Release, runtime: frozenset[str], paths: frozenset[Path]
) -> tuple[dict[str, Any], tuple[str, ...], tuple[str, ...], frozenset[str]]:
    """The flags keyed, the runtime-only ones given, those at the default, and every flag put aside."""
    folded = {"additional_config"} if release.additional_config == "fields" else set()
    if release.model_impl == "flag_then_env":
        folded.add("model_impl")  # platform/__init__.py 238: reset to "auto" before vLLM hashes it
    serving: dict[str, Any] = {}
    dropped: list[str] = []
    defaulted: list[str] = []
    aside: set[str] = set(runtime)
    for dest, given in server.options.items():
        flag = dest.replace("_", "-")
        value = _ALIASES.get(dest, {}).get(given, given) if isinstance(given, str) else given
        if flag in runtime:
            dropped.append(flag)
        elif dest in folded:
            continue
        elif (
            _is_default(value, release.defaults.get(dest, ()))
            or (read := structured_value(release, dest, value, paths)) is _NOT_GIVEN
        ):
            defaulted.append(f"{flag} {_shown(value)}")
            aside.add(flag)
        elif not (dest == "additional_config" and read == {}):  # vLLM hashes an empty one as none
            serving[dest] = read
    return serving, tuple(sorted(dropped)), tuple(defaulted), frozenset(aside)


_NOT_GIVEN = object()


def structured_value(release: Release, dest: str, value: Any, paths: frozenset[Path]) -> Any:
    """A structured option's object as the model paths in ``paths`` read it: the fields proven not to
    reach their identity left out (tools/oracle/derive.py FIELDS; on both paths only what both leave
    out), a field given at its default dropped (the server builds the same object), and an object of
    defaults only is the option not given where the class's defaults are what its absence means. A key
    the class does not have is kept as given (the server refuses it); a free-form option is whole."""
    spec = release.structured.get(dest)
    if spec is None or not isinstance(value, dict):
        return value
    ignored = frozenset.intersection(*(spec["ignored"].get(path, frozenset()) for path in paths))
    kept = _fields_kept(value, spec["defaults"], ignored, "")
    return _NOT_GIVEN if not kept and spec["empty_is_default"] else kept


def _fields_kept(
    obj: Mapping[str, Any], defaults: Mapping[str, Any], ignored: frozenset[str], prefix: str
) -> dict[str, Any]:
    kept: dict[str, Any] = {}
    for name, given in obj.items():
        path = prefix + name
        if path in ignored:
            continue
        if path in defaults:
            if not _is_default(given, (defaults[path],)):
                kept[name] = given
        elif isinstance(given, dict) and any(field.startswith(path + ".") for field in defaults):
            inner = _fields_kept(given, defaults, ignored, path + ".")  # a nested config class, by field
            if inner:
                kept[name] = inner
        else:
            kept[name] = given
    return kept


# Values one option reads as another: vLLM maps a dtype name to a torch dtype before anything reads it
# (vLLM 0.30 config/model.py 2238-2244), so --dtype half is --dtype float16 to the server.
_ALIASES: dict[str, dict[str, str]] = {"dtype": {"half": "float16", "float": "float32"}}


def _is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    """``value`` is one the server takes as the default: equal, and of the same type (``True == 1``
    and ``0 == 0.0`` are not the same option value)."""
    return any(type(value) is type(default) and value == default for default in defaults)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def vllm_env(
    options: Mapping[str, Any], environ: Mapping[str, str], paths: frozenset[Path]
) -> dict[str, Any]:
    """The vLLM variables that change what is compiled, read as vLLM reads them (envs.py: int(...))."""
    keyed: dict[str, Any] = {}
    if "vllm" in paths:
        # ModelConfig.use_mla (vLLM 0.30 config/model.py 1926-1927) picks the attention backend
        # (vllm-rbln platform/__init__.py 110-134), which the bundle signature does not hash.
        mla = _int_env(environ, "VLLM_MLA_DISABLE", 0)
        if mla != 0:
            keyed["VLLM_MLA_DISABLE"] = bool(mla) if isinstance(mla, int) else mla
    given = options.get("data_parallel_size", 1)
    if not ((isinstance(given, int) and given > 1) or options.get("data_parallel_size_local") == 0):
        # Not given on the command line: ParallelConfig takes them from the environment (vLLM 0.30
        # config/parallel.py 934-940). The size is hashed; the rank picks the rank<N> bundles
        # (vllm-rbln v1/worker/rbln_worker.py 818-835).
        size = _int_env(environ, "VLLM_DP_SIZE", 1)
        if size != 1:
            keyed["VLLM_DP_SIZE"] = size
        if isinstance(size, int) and size > 1:
            keyed["VLLM_DP_RANK"] = _int_env(environ, "VLLM_DP_RANK", 0)
    return keyed


def _int_env(environ: Mapping[str, str], name: str, default: int) -> Any:
    raw = environ.get(name)
    try:
        return int(raw) if raw is not None else default
    except ValueError:
        return {"$unparsed": raw}


def draft_model(
    server: ServerCommand, environ: Mapping[str, str]
) -> tuple[dict[str, Any], str, str | None] | None:
    """The draft model's weights: the bundle's graph set hashes its ModelConfig (mega_cache.py 105)."""
    spec = server.options.get("speculative_config")
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), str) or not spec["model"]:
        return None
    revision = spec.get("revision")
    model, source, details = resolve_weights(
        spec["model"], revision if isinstance(revision, str) else None, environ, what="draft model"
    )
    return model, f"--speculative-config model: {source}", details.get("unresolved_snapshot")


def _versions_text(versions: Mapping[str, str]) -> str:
    return ", ".join(
        f"{dist} {versions[key]}" for key, (dist, _) in vllm_rbln.VERSION_ENV.items() if key in versions
    )


# --- vllm-rbln 0.12's RBLN options -----------------------------------------------------------------
# vllm-rbln 0.12's RBLN options as the server resolves them, reduced to what a model path compiles from.
#
# ``vllm_rbln/config.py`` (``_resolve``, 532-605) builds ``RBLNConfig`` (vLLM-model path) or
# ``OptimumRBLNConfig`` (optimum path) from, highest first: ``additional_config`` (which every
# ``--rbln-*`` flag writes into, 629-679), then ``VLLM_RBLN_<FIELD>`` read through ``envs.py`` when one
# of the names it probes is set (``_env_overrides``, 256-310), then the field's default. So
# ``--rbln-enforce-model-fp32``, ``--additional-config '{"enforce_model_fp32": true}'`` and
# ``VLLM_RBLN_ENFORCE_MODEL_FP32=1`` are one configuration; ``RBLN_USE_CUSTOM_KERNEL=1`` and
# ``--rbln-use-custom-kernel`` another. The key holds each field the path compiles from, resolved so,
# where it differs from the default; ``use_dynamic_kv_cache`` unset and true are one value
# (``compute_hash``, 162-163). A key the class does not have is kept as given: the server refuses it.

# OptimumRBLNConfig's former names (config.py 238-245): the former name's value wins.
_RENAMED = {"rbln_config": "optimum_overrides", "prefix_block_size": "sub_block_size"}


def resolve_rbln(
    release: Release, additional_config: Any, environ: Mapping[str, str], paths: frozenset[Path], *, npu: str
) -> dict[str, Any]:
    """The RBLN options a path in ``paths`` compiles from, as that path resolves them, where not the default."""
    if additional_config is not None and not isinstance(additional_config, dict):
        return {"$additional_config": additional_config}  # _resolve refuses anything but a mapping
    given = dict(additional_config or {})
    if "optimum" in paths:
        for old, new in _RENAMED.items():
            if old in given:
                given = {k: v for k, v in given.items() if k != old} | {new: given[old]}
    fields = release.rbln_fields
    resolved: dict[str, Any] = {}
    for spec in fields.values():
        if spec.derived or not (spec.compiled_on & spec.classes & paths):
            continue
        value = _normalised(release, spec, _value(release, spec, given, environ, npu))
        if value != _normalised(release, spec, spec.default):
            resolved[spec.name] = value
    # Keys no class of these paths has: vllm-rbln refuses them (config.py 569-577), so keep them as given.
    known = {name for name, spec in fields.items() if spec.classes & paths}
    resolved |= {name: given[name] for name in given if name not in known}
    return dict(sorted(resolved.items()))


def _value(
    release: Release, spec: RblnField, given: Mapping[str, Any], environ: Mapping[str, str], npu: str
) -> Any:
    if spec.name in given:
        return given[spec.name]
    var = release.env.get(spec.env) if spec.env else None
    if var is not None and present(var, environ):
        return read(release, var, environ, npu=npu)
    return spec.default


def _normalised(release: Release, spec: RblnField, value: Any) -> Any:
    if spec.name == "use_dynamic_kv_cache":
        return value is not False  # RBLNConfig.compute_hash: unset and True build the same graph
    if spec.name == "optimum_overrides" and isinstance(value, dict):
        return _strip(value, release.optimum_runtime_keys)  # dispatch._strip_runtime_only_keys
    return value


def _strip(obj: Any, keys: frozenset[str]) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v, keys) for k, v in obj.items() if k not in keys}
    if isinstance(obj, list):
        return [_strip(item, keys) for item in obj]
    return obj
