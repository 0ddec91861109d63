"""vllm-rbln 0.12's RBLN options as the server resolves them, reduced to what a model path compiles from.

``vllm_rbln/config.py`` (``_resolve``, 532-605) builds ``RBLNConfig`` (vLLM-model path) or
``OptimumRBLNConfig`` (optimum path) from, highest first: ``additional_config`` (which every
``--rbln-*`` flag writes into, 629-679), then ``VLLM_RBLN_<FIELD>`` read through ``envs.py`` when one
of the names it probes is set (``_env_overrides``, 256-310), then the field's default. So
``--rbln-enforce-model-fp32``, ``--additional-config '{"enforce_model_fp32": true}'`` and
``VLLM_RBLN_ENFORCE_MODEL_FP32=1`` are one configuration; ``RBLN_USE_CUSTOM_KERNEL=1`` and
``--rbln-use-custom-kernel`` another. The key holds each field the path compiles from, resolved so,
where it differs from the default; ``use_dynamic_kv_cache`` unset and true are one value
(``compute_hash``, 162-163). A key the class does not have is kept as given: the server refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cachemgr.key.rbln_env import present, read
from cachemgr.key.releases import Path, RblnField, Release

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
