"""STAND-IN: what vllm-rbln 0.12.0 (on vLLM 0.30.0, with optimum-rbln 0.12.0) keys its compile cache on.

Written from their code, not from cachemgr's (a test double that shared cachemgr's rules could not
catch a wrong one); tools/rbln_facts.py in cachemgr lists where each rule is:

* the vLLM-model path's bundle signature (``v1/worker/mega_cache.config_signature``): vLLM's
  ``VllmConfig.compute_hash()`` (the vLLM version, the ``hf_config`` the server loads, which carries
  ``transformers_version``, and every config field but the ignored ones: ``seed`` and the tokenizer,
  the executor and worker classes, prefix caching...; ``--model-impl`` is reset to ``auto`` first),
  ``RBLNConfig.compute_hash()`` (its fields resolved from ``additional_config``, ``--rbln-*`` and
  ``VLLM_RBLN_*``), the warm-up graph set (max_num_seqs, gpu_memory_utilization, the draft model's
  ``compute_hash``), ``RBLN_COMPILE_ENV`` parsed, the NPU name and rebel major.minor. The attention
  backend follows ``VLLM_MLA_DISABLE``, which no hash covers: the stand-in's graphs differ with it;
* the optimum path's directory name (``utils/optimum/converter/dispatch._generate_model_path_name``):
  model, max_num_seqs, block_size, max_model_len, devices per rank, dtype, the user's
  max_num_batched_tokens, gpu_memory_utilization and the optimum overrides without runtime keys.

Defaults as the platform sets them: max_num_seqs 1, gpu_memory_utilization 0.93 (0.92, vLLM's own
default, is raised to it).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# vLLM 0.30's ignored_factors that arrive as `vllm serve` flags (config/model.py 432-465,
# config/parallel.py 828-867, config/cache.py 260-276), and what vllm-rbln resets (model-impl).
HASH_IGNORED = frozenset(
    {
        "seed", "tokenizer", "tokenizer-mode", "tokenizer-revision", "skip-tokenizer-init", "enforce-eager",
        "distributed-executor-backend", "worker-cls", "disable-custom-all-reduce", "max-parallel-loading-workers",
        "data-parallel-rank", "enable-prefix-caching", "gpu-memory-utilization", "num-gpu-blocks-override",
        "model-impl", "additional-config",
    }
)  # fmt: skip
DEFAULT_MAX_NUM_SEQS = 1
DEFAULT_GPU_MEMORY_UTILIZATION = 0.93
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
# vllm_rbln/envs.py RBLN_COMPILE_ENV, each parsed as envs.py parses it
RBLN_COMPILE_ENV = ("VLLM_RBLN_USE_VLLM_MODEL", "VLLM_RBLN_NUM_HIDDEN_LAYERS", "VLLM_RBLN_USE_DEVICE_TENSOR")
# RBLNConfig's fields (config.py 72-164): default, the envs.py variable(s) read for it, hashed?
RBLN_FIELDS: dict[str, tuple[Any, tuple[str, ...], bool]] = {
    "num_devices_per_local_rank": (1, ("VLLM_RBLN_NUM_DEVICES_PER_LOCAL_RANK", "VLLM_RBLN_TP_SIZE"), True),
    "use_custom_sampler": (True, ("VLLM_RBLN_SAMPLER",), False),
    "sub_block_size": (None, ("VLLM_RBLN_SUB_BLOCK_SIZE",), False),
    "enforce_model_fp32": (False, ("VLLM_RBLN_ENFORCE_MODEL_FP32",), True),
    "use_batch_attn_opt": (False, ("VLLM_RBLN_BATCH_ATTN_OPT",), True),
    "use_custom_kernel": (False, ("RBLN_USE_CUSTOM_KERNEL",), True),
    "use_dynamic_kv_cache": (None, ("VLLM_RBLN_USE_DYNAMIC_KV_CACHE",), True),
    "enable_sub_block_cache": (True, ("VLLM_RBLN_SUB_BLOCK_CACHE",), False),
    "specialize_moe_decode": (True, ("VLLM_RBLN_SPECIALIZE_MOE_DECODE",), True),
    "use_moe_tokens_mask": (True, ("VLLM_RBLN_USE_MOE_TOKENS_MASK",), True),
    "use_all2all_dispatch": (False, ("VLLM_RBLN_DISPATCH_ALL2ALL",), True),
    "use_all2all_combine": (False, ("VLLM_RBLN_COMBINE_ALL2ALL",), True),
    "use_w8a8": (False, ("VLLM_RBLN_USE_W8A8",), True),
    "compile_dtype": ("", (), True),
}
RBLN_BOOL_FLAGS = frozenset(
    f"{prefix}rbln-{name.replace('_', '-')}"
    for name, (default, _, _) in RBLN_FIELDS.items()
    if isinstance(default, bool) or name == "use_dynamic_kv_cache"
    for prefix in ("", "no-")
)
_OPTIMUM_RUNTIME_KEYS = frozenset({"create_runtimes", "device", "kvcache_num_blocks"})


def env_bool(environ: Mapping[str, str], name: str, default: str) -> bool:
    """envs.py's booleans: ``os.environ.get(name, default).lower() in ("true", "1")``."""
    return environ.get(name, default).lower() in {"true", "1"}


def sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _number(value: Any) -> Any:
    if isinstance(value, str):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
    return value


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, tuple) and value else value


def max_num_seqs(flags: Mapping[str, Any]) -> int:
    value = _number(_first(flags.get("max-num-seqs")))
    return value if isinstance(value, int) else DEFAULT_MAX_NUM_SEQS


def gpu_memory_utilization(flags: Mapping[str, Any]) -> float:
    """The parser's default is 0.93; apply_config_platform_defaults raises vLLM's 0.92 to it."""
    value = _number(_first(flags.get("gpu-memory-utilization")))
    if not isinstance(value, int | float) or value == VLLM_DEFAULT_GPU_MEMORY_UTILIZATION:
        return DEFAULT_GPU_MEMORY_UTILIZATION
    return float(value)


def additional_config(flags: Mapping[str, Any]) -> dict[str, Any]:
    """``--additional-config`` JSON with every ``--rbln-FIELD``/``--no-rbln-FIELD`` written into it."""
    given: dict[str, Any] = {}
    raw = _first(flags.get("additional-config"))
    if isinstance(raw, str):
        loaded = json.loads(raw)
        if isinstance(loaded, dict):
            given.update(loaded)
    for name, value in flags.items():
        if name.startswith("rbln-"):
            given[name[5:].replace("-", "_")] = _number(value) if value is not True else True
        elif name.startswith("no-rbln-"):
            given[name[8:].replace("-", "_")] = False
    return given


def _env_value(environ: Mapping[str, str], names: tuple[str, ...], default: Any) -> Any:
    if names[0] == "VLLM_RBLN_NUM_DEVICES_PER_LOCAL_RANK":
        raw = environ.get(names[0], environ.get(names[1]))
        return int(raw) if raw is not None else default
    if names == ("VLLM_RBLN_USE_DYNAMIC_KV_CACHE",):
        return env_bool(environ, names[0], "True")
    if names == ("VLLM_RBLN_SUB_BLOCK_SIZE",):
        return int(environ[names[0]]) if environ.get(names[0]) else None
    return env_bool(environ, names[0], str(default))


def rbln_config(flags: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """RBLNConfig.compute_hash()'s factors: additional_config, else the environment, else the default."""
    given = additional_config(flags)
    factors: dict[str, Any] = {}
    for name, (default, env_names, hashed) in RBLN_FIELDS.items():
        if not hashed:
            continue
        if name in given:
            value = given[name]
        elif env_names and any(n in environ for n in env_names):
            value = _env_value(environ, env_names, default)
        else:
            value = default
        factors[name] = value is not False if name == "use_dynamic_kv_cache" else value
    return factors


def compile_env(environ: Mapping[str, str]) -> dict[str, Any]:
    return {
        "VLLM_RBLN_USE_VLLM_MODEL": env_bool(environ, "VLLM_RBLN_USE_VLLM_MODEL", "False"),
        "VLLM_RBLN_NUM_HIDDEN_LAYERS": int(environ.get("VLLM_RBLN_NUM_HIDDEN_LAYERS", "0")),
        "VLLM_RBLN_USE_DEVICE_TENSOR": env_bool(environ, "VLLM_RBLN_USE_DEVICE_TENSOR", "True"),
    }


def hf_cache(environ: Mapping[str, str]) -> Path:
    home = environ.get("HF_HOME") or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(
        environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    )


def hf_config(model: str, revision: str | None, environ: Mapping[str, str]) -> dict[str, Any]:
    """What ``normalize_value(hf_config)`` hashes: the loaded config.json, with transformers_version."""
    from cachemgr_standin import TRANSFORMERS_VERSION

    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        repo = hf_cache(environ) / ("models--" + model.replace("/", "--"))
        ref = repo / "refs" / (revision or "main")
        commit = ref.read_text().strip() if ref.is_file() else (revision or "")
        config_file = repo / "snapshots" / commit / "config.json"
    content = config_file.read_bytes() if config_file.is_file() else b"(as downloaded)"
    installed = environ.get("STANDIN_TRANSFORMERS_VERSION") or TRANSFORMERS_VERSION
    return {"config": hashlib.sha256(content).hexdigest(), "transformers_version": installed}


def draft_model(flags: Mapping[str, Any], environ: Mapping[str, str]) -> Any:
    """The speculative config's draft model: its ModelConfig.compute_hash() (mega_cache.py 105)."""
    raw = _first(flags.get("speculative-config"))
    spec = json.loads(raw) if isinstance(raw, str) else None
    if not isinstance(spec, dict) or not spec.get("model"):
        return None
    return {"model": spec["model"], "hf_config": hf_config(str(spec["model"]), spec.get("revision"), environ)}


def data_parallel(flags: Mapping[str, Any], environ: Mapping[str, str]) -> tuple[int, int | None]:
    """(size, rank): from the flags when DP is on there, else VLLM_DP_SIZE / VLLM_DP_RANK (parallel.py 910-940)."""
    size = _number(_first(flags.get("data-parallel-size", "1")))
    rank = _number(_first(flags.get("data-parallel-rank")))
    if isinstance(size, int) and size > 1:
        return size, rank if isinstance(rank, int) else None
    size = int(environ.get("VLLM_DP_SIZE", "1"))
    return size, int(environ.get("VLLM_DP_RANK", "0")) if size > 1 else None


def hashed_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """The flags compute_hash() covers, as values (the ignored ones, RBLN options and defaults aside)."""
    kept = {
        name: list(value) if isinstance(value, tuple) else value
        for name, value in flags.items()
        if name not in HASH_IGNORED and not name.startswith(("rbln-", "no-rbln-")) and value is not False
    }
    if max_num_seqs(flags) == DEFAULT_MAX_NUM_SEQS:
        kept.pop("max-num-seqs", None)
    return dict(sorted(kept.items()))


def vllm_config_hash(
    model: str, revision: str | None, flags: Mapping[str, Any], environ: Mapping[str, str], vllm_version: str
) -> str:
    """VllmConfig.compute_hash(): the vLLM version first, then every config's factors."""
    size, _ = data_parallel(flags, environ)
    factors = {
        "vllm": vllm_version,
        "model": model,
        "hf_config": hf_config(model, revision, environ),
        "flags": hashed_flags(flags),
        "data_parallel_size": size,
        "rbln": rbln_config(flags, environ),
    }
    return sha(factors)


def graph_set(flags: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    """mega_cache._warmup_graph_set_factors."""
    return sha(
        {
            "max_num_seqs": max_num_seqs(flags),
            "gpu_memory_utilization": gpu_memory_utilization(flags),
            "num_gpu_blocks_override": _number(_first(flags.get("num-gpu-blocks-override"))),
            "dynamic_kv": rbln_config(flags, environ)["use_dynamic_kv_cache"],
            "draft_model": draft_model(flags, environ),
        }
    )


def attention_backend(environ: Mapping[str, str]) -> str:
    """vLLM's use_mla is off with VLLM_MLA_DISABLE (bool(int(...))): another backend, other graphs."""
    return "FLASH_ATTN" if bool(int(environ.get("VLLM_MLA_DISABLE", "0"))) else "FLASH_ATTN_MLA"


def optimum_name_hash(model: str, flags: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    """dispatch._generate_model_path_name's config hash."""
    given = additional_config(flags)
    for old, new in (("rbln_config", "optimum_overrides"), ("prefix_block_size", "sub_block_size")):
        if old in given:
            given[new] = given.pop(old)
    devices = given.get("num_devices_per_local_rank")
    if devices is None:
        devices = _env_value(environ, RBLN_FIELDS["num_devices_per_local_rank"][1], 1)
    config: dict[str, Any] = {
        "model_name": model,
        "batch_size": max_num_seqs(flags),
        "block_size": _number(_first(flags.get("block-size"))),
        "max_model_len": _number(_first(flags.get("max-model-len"))),
        "num_devices": devices,
        "dtype": _first(flags.get("dtype", "auto")),
        "max_num_batched_tokens": _number(_first(flags.get("max-num-batched-tokens"))),
        "memory_budget": gpu_memory_utilization(flags),
    }
    overrides = given.get("optimum_overrides")
    if isinstance(overrides, dict):
        stripped = {k: v for k, v in overrides.items() if k not in _OPTIMUM_RUNTIME_KEYS}
        if stripped:
            config["rbln_config"] = stripped
    return sha(config)[:16]
