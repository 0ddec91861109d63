"""The key's rules per server release: what each checked release hashes or compiles from, as data.

(NamedTuples, not dataclasses: the table is built at every pod start, and a dataclass costs ~0.7 ms
of CPU to define.)

The ``vllm`` strategy keys what the server keys, or more (docs/design.md, the cache key). What that
is differs from release to release: vllm-rbln 0.12.0 hashes 3 environment variables into its bundle
signature and reads 16 more into ``RBLNConfig`` fields; 0.11.2 hashes 20 and hashes
``additional_config`` whole (vLLM 0.24); a future 0.13 will differ again. So the rules are held
per release the key was checked against, as a table, and a release that is not in it is keyed
strictly (:data:`STRICT`), never by another release's rules.

Every entry is re-derived from the release's unpacked wheels by ``tools/rbln_facts.py`` (its
``--table`` output is what is written here, its file:line citations are in ``cite``), and
tests/test_rbln_facts.py holds this table to the derived facts (tests/data/rbln_facts/*.json in CI,
the wheels themselves where they are unpacked). Adding a release: derive, review the diff, add the
entry to :data:`KNOWN`, give the stand-in its behaviour if it differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from cachemgr.key import vllm_identity as identity_0_12
from cachemgr.key import vllm_identity_0_11_2 as identity_0_11

Path = Literal["vllm", "optimum"]
# How envs.py parses a variable (each a lambda or function there): see cachemgr.key.rbln_env.
Kind = Literal[
    "bool", "int", "str", "opt_int", "int_list", "bucket_strategy", "num_devices", "w8a16", "auto_port"
]
BOTH: frozenset[Path] = frozenset({"vllm", "optimum"})
VLLM_PATH: frozenset[Path] = frozenset({"vllm"})
NEITHER: frozenset[Path] = frozenset()


class EnvVar(NamedTuple):
    """One variable of vllm-rbln's ``envs.environment_variables``, as the release reads it."""

    name: str  # its name in envs.py, and in the key
    kind: Kind
    default: Any  # the parsed value when unset
    # The model paths whose compiled artifacts it changes: hashed into the bundle signature
    # (RBLN_COMPILE_ENV), or read into a config field one of the paths compiles from.
    compiled_on: frozenset[Path] = NEITHER
    reads: tuple[str, ...] = ()  # the os.environ names it reads, when not just its own name
    field: str | None = None  # the RBLNConfig field it sets, when that is how the server takes it

    @property
    def sources(self) -> tuple[str, ...]:
        return self.reads or (self.name,)


class RblnField(NamedTuple):
    """One field of vllm-rbln 0.12's RBLNConfig / OptimumRBLNConfig (``vllm_rbln/config.py``)."""

    name: str
    default: Any
    classes: frozenset[Path]  # RBLNConfig is the vLLM-model path's, OptimumRBLNConfig the optimum path's
    compiled_on: frozenset[
        Path
    ]  # where it changes the compiled artifacts (its class's compute_hash, the name)
    env: str | None = None  # the envs.py variable _env_overrides reads for it
    derived: bool = False  # written by the server from other inputs: a given value is overwritten


class Release(NamedTuple):
    """What one checked release of vllm-rbln (with its vLLM and optimum-rbln) keys on."""

    name: str
    versions: Mapping[str, str]  # exactly the installed versions these rules were checked against
    env: Mapping[str, EnvVar]  # every variable of envs.environment_variables
    # vLLM flags its config hash ignores and nothing the key holds reads (runtime-only on both paths),
    # and those runtime-only on the vLLM-model path only, and on the optimum path only.
    runtime_flags: frozenset[str]
    runtime_flags_vllm_path: frozenset[str]
    # dest -> the values the server treats as its default (as if the flag were not given)
    defaults: Mapping[str, tuple[Any, ...]]
    # "fields": additional_config resolves into RBLNConfig fields; "whole": vLLM hashes the dict whole
    additional_config: Literal["fields", "whole"]
    # "flag_then_env": --model-impl, the inherited resolved path, then VLLM_RBLN_USE_VLLM_MODEL;
    # "env": VLLM_RBLN_USE_VLLM_MODEL alone (--model-impl is vLLM's own then, and hashed)
    model_impl: Literal["flag_then_env", "env"]
    rbln_fields: Mapping[str, RblnField] = {}  # never changed: one shared empty table is fine
    optimum_runtime_keys: frozenset[str] = frozenset()  # dispatch.py's _RUNTIME_ONLY_KEYS
    envs_xxh3: str = (
        ""  # xxh3-128 of the release's vllm_rbln/envs.py: an installed one equal to it is this table
    )
    cite: str = ""
    runtime_flags_optimum_path: frozenset[str] = frozenset()
    # The architectures optimum-rbln implements: --model-impl auto takes the optimum path for them
    optimum_architectures: frozenset[str] = frozenset()
    # Per structured option (a JSON object filling a config class): its fields' defaults and, per model
    # path, the fields proven not to reach that path's identity (vllm_identity.FIELDS; tools/oracle)
    structured: Mapping[str, Mapping[str, Any]] = {}

    @property
    def strict(self) -> bool:
        return not self.versions

    def describe(self) -> str:
        if self.strict:
            return "strict (a release this cachemgr was not checked against)"
        return ", ".join(f"{_DIST[k]} {v}" for k, v in self.versions.items())


_DIST = {"vllm_rbln": "vllm-rbln", "optimum_rbln": "optimum-rbln", "vllm": "vLLM"}


def _env(*items: EnvVar) -> dict[str, EnvVar]:
    return {item.name: item for item in items}


def _off(name: str, kind: Kind = "bool", default: Any = False, **kw: Any) -> EnvVar:
    """A variable no model path compiles from (RBLN_NON_COMPILE_ENV and not a hashed field)."""
    return EnvVar(name, kind, default, NEITHER, **kw)


_R = "VLLM_RBLN_"

# --- vllm-rbln 0.12.0, optimum-rbln 0.12.0, vLLM 0.30.0+cpu ------------------------------------
# vllm_rbln/envs.py 189-379 (environment_variables), 386-392 (RBLN_COMPILE_ENV: hashed by
# mega_cache._compile_env_factors, mega_cache.py 52-66), 394-427 (RBLN_NON_COMPILE_ENV, of which the
# RBLNConfig fields are hashed through RBLNConfig.compute_hash, config.py 145-164, from
# config._env_overrides, config.py 256-310).
_ENV_0_12 = _env(
    EnvVar(f"{_R}USE_VLLM_MODEL", "bool", False, VLLM_PATH),
    EnvVar(f"{_R}NUM_HIDDEN_LAYERS", "int", 0, VLLM_PATH),
    EnvVar(f"{_R}USE_DEVICE_TENSOR", "bool", True, VLLM_PATH),
    EnvVar(f"{_R}NUM_DEVICES_PER_LOCAL_RANK", "num_devices", 1, BOTH,
           reads=(f"{_R}NUM_DEVICES_PER_LOCAL_RANK", f"{_R}TP_SIZE"), field="num_devices_per_local_rank"),
    _off(f"{_R}SAMPLER", default=True, field="use_custom_sampler"),
    _off(f"{_R}ENABLE_WARM_UP", default=True),
    _off(f"{_R}METRICS"),
    _off(f"{_R}METRICS_FILE", "str", ""),
    _off(f"{_R}METRICS_DIR", "str", ""),
    _off(f"{_R}NUMA", default=True),
    _off(f"{_R}COMPILE_STRICT_MODE", default=True),
    _off(f"{_R}COMPILE_ONLY"),
    _off(f"{_R}DISABLE_OFFLOAD", default=True),
    _off(f"{_R}DISABLE_WORKER_FAIL_FAST"),
    _off(f"{_R}AUTO_PORT", "auto_port", True, reads=(f"{_R}AUTO_PORT", f"{_R}USE_DEVICE_TENSOR")),
    EnvVar(f"{_R}ENFORCE_MODEL_FP32", "bool", False, VLLM_PATH, field="enforce_model_fp32"),
    EnvVar(f"{_R}USE_DYNAMIC_KV_CACHE", "bool", True, VLLM_PATH, field="use_dynamic_kv_cache"),
    EnvVar(f"{_R}BATCH_ATTN_OPT", "bool", False, VLLM_PATH, field="use_batch_attn_opt"),
    # named VLLM_RBLN_USE_CUSTOM_KERNEL in envs.py, read from RBLN_USE_CUSTOM_KERNEL (envs.py 312-316)
    EnvVar(f"{_R}USE_CUSTOM_KERNEL", "bool", False, VLLM_PATH, reads=("RBLN_USE_CUSTOM_KERNEL",),
           field="use_custom_kernel"),
    _off(f"{_R}SUB_BLOCK_CACHE", default=True, field="enable_sub_block_cache"),
    _off(f"{_R}SUB_BLOCK_SIZE", "opt_int", None, field="sub_block_size"),
    EnvVar(f"{_R}SPECIALIZE_MOE_DECODE", "bool", True, VLLM_PATH, field="specialize_moe_decode"),
    EnvVar(f"{_R}USE_MOE_TOKENS_MASK", "bool", True, VLLM_PATH, field="use_moe_tokens_mask"),
    EnvVar(f"{_R}DISPATCH_ALL2ALL", "bool", False, VLLM_PATH, field="use_all2all_dispatch"),
    EnvVar(f"{_R}COMBINE_ALL2ALL", "bool", False, VLLM_PATH, field="use_all2all_combine"),
    EnvVar(f"{_R}DECODE_BATCH_BUCKET_STRATEGY", "bucket_strategy", "exponential", VLLM_PATH,
           field="decode_batch_bucket_strategy"),
    EnvVar(f"{_R}DECODE_BATCH_BUCKET_MIN", "int", 1, VLLM_PATH, field="decode_batch_bucket_min"),
    EnvVar(f"{_R}DECODE_BATCH_BUCKET_STEP", "int", 2, VLLM_PATH, field="decode_batch_bucket_step"),
    EnvVar(f"{_R}DECODE_BATCH_BUCKET_LIMIT", "int", 1, VLLM_PATH, field="decode_batch_bucket_limit"),
    EnvVar(f"{_R}DECODE_BATCH_BUCKET_MANUAL_BUCKETS", "int_list", [], VLLM_PATH,
           field="decode_batch_bucket_manual_buckets"),
    EnvVar(f"{_R}USE_W8A8", "bool", False, VLLM_PATH, field="use_w8a8"),
)  # fmt: skip


def _field(
    name: str, default: Any, classes: frozenset[Path], compiled_on: frozenset[Path], **kw: Any
) -> RblnField:
    return RblnField(name, default, classes, compiled_on, **kw)


# vllm_rbln/config.py 72-232: RBLNConfigBase (both classes), RBLNConfig (vLLM-model path: compute_hash
# ignores use_custom_sampler, enable_sub_block_cache, sub_block_size and hashes use_dynamic_kv_cache as
# "is not False", 145-164) and OptimumRBLNConfig (optimum path: its compiled directory is named by
# num_devices_per_local_rank and the optimum overrides, utils/optimum/converter/dispatch.py 59-98;
# sub_block_size only sets the scheduler's block size, common.py 40-76).
_FIELDS_0_12 = {
    f.name: f
    for f in (
        _field("num_devices_per_local_rank", 1, BOTH, BOTH, env=f"{_R}NUM_DEVICES_PER_LOCAL_RANK"),
        _field("use_custom_sampler", True, BOTH, NEITHER, env=f"{_R}SAMPLER"),
        _field("sub_block_size", None, BOTH, NEITHER, env=f"{_R}SUB_BLOCK_SIZE"),
        _field("enforce_model_fp32", False, VLLM_PATH, VLLM_PATH, env=f"{_R}ENFORCE_MODEL_FP32"),
        _field("use_batch_attn_opt", False, VLLM_PATH, VLLM_PATH, env=f"{_R}BATCH_ATTN_OPT"),
        _field("use_custom_kernel", False, VLLM_PATH, VLLM_PATH, env=f"{_R}USE_CUSTOM_KERNEL"),
        # None and True build the same graph (config.py 162-163): both are keyed as True
        _field("use_dynamic_kv_cache", True, VLLM_PATH, VLLM_PATH, env=f"{_R}USE_DYNAMIC_KV_CACHE"),
        _field("enable_sub_block_cache", True, VLLM_PATH, NEITHER, env=f"{_R}SUB_BLOCK_CACHE"),
        _field("specialize_moe_decode", True, VLLM_PATH, VLLM_PATH, env=f"{_R}SPECIALIZE_MOE_DECODE"),
        _field("use_moe_tokens_mask", True, VLLM_PATH, VLLM_PATH, env=f"{_R}USE_MOE_TOKENS_MASK"),
        _field("use_all2all_dispatch", False, VLLM_PATH, VLLM_PATH, env=f"{_R}DISPATCH_ALL2ALL"),
        _field("use_all2all_combine", False, VLLM_PATH, VLLM_PATH, env=f"{_R}COMBINE_ALL2ALL"),
        _field("decode_batch_bucket_strategy", "exponential", VLLM_PATH, VLLM_PATH,
               env=f"{_R}DECODE_BATCH_BUCKET_STRATEGY"),
        _field("decode_batch_bucket_min", 1, VLLM_PATH, VLLM_PATH, env=f"{_R}DECODE_BATCH_BUCKET_MIN"),
        _field("decode_batch_bucket_step", 2, VLLM_PATH, VLLM_PATH, env=f"{_R}DECODE_BATCH_BUCKET_STEP"),
        _field("decode_batch_bucket_limit", 1, VLLM_PATH, VLLM_PATH, env=f"{_R}DECODE_BATCH_BUCKET_LIMIT"),
        _field("decode_batch_bucket_manual_buckets", [], VLLM_PATH, VLLM_PATH,
               env=f"{_R}DECODE_BATCH_BUCKET_MANUAL_BUCKETS"),
        _field("use_w8a8", False, VLLM_PATH, VLLM_PATH, env=f"{_R}USE_W8A8"),
        _field("compile_dtype", "", VLLM_PATH, VLLM_PATH),
        _field("optimum_overrides", {}, frozenset({"optimum"}), frozenset({"optimum"})),
        # written by the platform from --max-num-batched-tokens (platform/__init__.py 249), which is keyed
        _field("user_max_num_batched_tokens", None, frozenset({"optimum"}), NEITHER, derived=True),
        # written from the compiled artifact (from_optimum.py 159) and by the config sync (config.py 199-215)
        _field("num_blocks_override", None, frozenset({"optimum"}), NEITHER, derived=True),
        _field("attn_block_size", None, frozenset({"optimum"}), NEITHER, derived=True),
        _field("image_prefill_chunk_size", None, frozenset({"optimum"}), NEITHER, derived=True),
        _field("cached_model_path", None, frozenset({"optimum"}), NEITHER, derived=True),
        _field("num_blocks_synced", False, frozenset({"optimum"}), NEITHER, derived=True),
    )
}  # fmt: skip

# vLLM flags whose field the config hash ignores and that nothing else hashed is derived from:
# ModelConfig's seed and tokenizer (vLLM 0.30 config/model.py 434-440), ParallelConfig's launch
# details (config/parallel.py 847-853). Not hf_config_path or hf_overrides, which that list also
# ignores: they change the hf_config it hashes.
_VLLM_HASH_IGNORES = frozenset(
    {"seed", "tokenizer", "tokenizer-mode", "tokenizer-revision", "distributed-executor-backend", "worker-cls",
     "disable-custom-all-reduce", "max-parallel-loading-workers"}
)  # fmt: skip


# vllm_rbln/utils/optimum/registry.py 20-117 (_RBLN_SUPPORTED_MODELS): what `auto` sends to the optimum path.
_OPTIMUM_ARCHITECTURES_0_12 = frozenset(
    {
        "LlamaForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "PhiForCausalLM", "GPT2LMHeadModel",
        "MidmLMHeadModel", "MistralForCausalLM", "ExaoneForCausalLM", "Qwen2ForCausalLM", "OPTForCausalLM",
        "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM", "Qwen3ForSequenceClassification",
        "WhisperForConditionalGeneration", "LlavaNextForConditionalGeneration", "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
        "Qwen3ASRForConditionalGeneration", "Exaone4_5_ForConditionalGeneration",
        "Idefics3ForConditionalGeneration", "Blip2ForConditionalGeneration", "Gemma3ForConditionalGeneration",
        "Gemma4ForConditionalGeneration", "LlavaForConditionalGeneration", "PaliGemmaForConditionalGeneration",
        "BertModel", "RobertaForSequenceClassification", "XLMRobertaForSequenceClassification",
        "XLMRobertaModel", "Qwen3Model",
    }
)  # fmt: skip


def _flags(dests: frozenset[str]) -> frozenset[str]:
    return frozenset(dest.replace("_", "-") for dest in dests)


# What each path's identity reads of the options, as the real server code answered the key oracle
# (cachemgr.key.vllm_identity, derived by tools/oracle/derive.py): the options none of whose tried
# values changed the path's identity or what it compiles, and the values it takes as the default.
_IGNORED_BOTH = _flags(identity_0_12.IGNORED["vllm"] & identity_0_12.IGNORED["optimum"])
VLLM_RBLN_0_12_0 = Release(
    name="vllm-rbln 0.12.0",
    versions={"vllm_rbln": "0.12.0", "optimum_rbln": "0.12.0", "vllm": "0.30.0+cpu"},
    env=_ENV_0_12,
    # Read off the code before and now held by the oracle as well: vLLM's config hash ignores them.
    runtime_flags=_VLLM_HASH_IGNORES | _IGNORED_BOTH,
    # CacheConfig.compute_hash ignores it (config/cache.py 266) and the bundle's graph set does not read it
    # (mega_cache.py 79-110); the optimum path reads it when it sizes blocks (converter/common.py 92)
    runtime_flags_vllm_path=frozenset({"enable-prefix-caching"})
    | _flags(identity_0_12.IGNORED["vllm"]) - _IGNORED_BOTH,
    runtime_flags_optimum_path=_flags(identity_0_12.IGNORED["optimum"]) - _IGNORED_BOTH,
    # platform/__init__.py 49-51, 179-207, 299-321: an unset max_num_seqs is 1; the parser's default
    # gpu_memory_utilization is 0.93, and vLLM's own default (0.92) is raised to it; and every option
    # given at the value the server takes as its default (vllm_identity.DEFAULTS)
    defaults={**identity_0_12.DEFAULTS, "max_num_seqs": (1,), "gpu_memory_utilization": (0.92, 0.93)},
    additional_config="fields",
    model_impl="flag_then_env",
    rbln_fields=_FIELDS_0_12,
    optimum_runtime_keys=frozenset({"create_runtimes", "device", "kvcache_num_blocks"}),  # dispatch.py 41-43
    envs_xxh3="265a9016dfffceb088453ae6c87cd86e",
    optimum_architectures=_OPTIMUM_ARCHITECTURES_0_12,
    structured=identity_0_12.FIELDS,
    cite="vllm_rbln 0.12.0 envs.py, config.py, platform/__init__.py, v1/worker/mega_cache.py; vLLM 0.30.0 config/",
)

# --- vllm-rbln 0.11.2, optimum-rbln 0.11.2, vLLM 0.24.0+cpu ------------------------------------
# vllm_rbln/envs.py 198-407 (environment_variables), 412-435 (RBLN_COMPILE_ENV, 20 names, hashed by
# mega_cache._compile_env_factors), 437-454 (RBLN_NON_COMPILE_ENV). No RBLNConfig: additional_config
# is a dict, which vLLM 0.24 hashes whole (config/vllm.py 476-481). The optimum directory is named by
# VLLM_RBLN_NUM_DEVICES_PER_LOCAL_RANK (utils/optimum/converter/dispatch.py 65).
_ENV_0_11 = _env(
    EnvVar(f"{_R}USE_VLLM_MODEL", "bool", False, VLLM_PATH),
    EnvVar(f"{_R}NUM_DEVICES_PER_LOCAL_RANK", "num_devices", 1, BOTH,
           reads=(f"{_R}NUM_DEVICES_PER_LOCAL_RANK", f"{_R}TP_SIZE")),
    _off(f"{_R}SAMPLER", default=True),
    _off(f"{_R}ENABLE_WARM_UP", default=True),
    _off(f"{_R}METRICS"),
    _off(f"{_R}METRICS_FILE", "str", ""),
    _off(f"{_R}METRICS_DIR", "str", ""),
    _off(f"{_R}NUMA", default=True),
    EnvVar(f"{_R}COMPILE_MODEL", "bool", True, VLLM_PATH),
    _off(f"{_R}COMPILE_STRICT_MODE"),
    _off(f"{_R}COMPILE_ONLY"),
    EnvVar(f"{_R}NUM_HIDDEN_LAYERS", "int", 0, VLLM_PATH),
    EnvVar(f"{_R}USE_DEVICE_TENSOR", "bool", True, VLLM_PATH),
    _off(f"{_R}DISABLE_OFFLOAD"),
    _off(f"{_R}AUTO_PORT", "auto_port", True, reads=(f"{_R}AUTO_PORT", f"{_R}USE_DEVICE_TENSOR")),
    EnvVar(f"{_R}ENFORCE_MODEL_FP32", "bool", False, VLLM_PATH),
    _off(f"{_R}NUM_RAY_NODES", "int", 1),
    EnvVar(f"{_R}USE_DYNAMIC_KV_CACHE", "bool", False, VLLM_PATH),
    EnvVar(f"{_R}FLASH_CAUSAL_ATTN", "bool", True, VLLM_PATH),
    EnvVar(f"{_R}BATCH_ATTN_OPT", "bool", False, VLLM_PATH),
    EnvVar(f"{_R}USE_CUSTOM_KERNEL", "bool", False, VLLM_PATH, reads=("RBLN_USE_CUSTOM_KERNEL",)),
    _off(f"{_R}SORT_BATCH"),
    _off(f"{_R}SUB_BLOCK_CACHE", default=True),
    EnvVar(f"{_R}SPECIALIZE_MOE_DECODE", "bool", True, VLLM_PATH),
    EnvVar(f"{_R}USE_MOE_TOKENS_MASK", "bool", True, VLLM_PATH),
    EnvVar(f"{_R}DISPATCH_ALL2ALL", "bool", False, VLLM_PATH),
    EnvVar(f"{_R}COMBINE_ALL2ALL", "bool", False, VLLM_PATH),
    EnvVar(f"{_R}DECODE_BATCH_BUCKET_STRATEGY", "bucket_strategy", "exponential", VLLM_PATH),
    EnvVar(f"{_R}DECODE_BATCH_BUCKET_MIN", "int", 1, VLLM_PATH),
    EnvVar(f"{_R}DECODE_BATCH_BUCKET_STEP", "int", 2, VLLM_PATH),
    EnvVar(f"{_R}DECODE_BATCH_BUCKET_LIMIT", "int", 1, VLLM_PATH),
    EnvVar(f"{_R}DECODE_BATCH_BUCKET_MANUAL_BUCKETS", "int_list", [], VLLM_PATH),
    _off(f"{_R}NIXL_SWA_VIEW_OPT"),
    # unset: True unless the NPU takes W8A8 (RBLN-CR13, RBLN-CR23), envs.py 87-111
    EnvVar(f"{_R}USE_W8A16", "w8a16", None, VLLM_PATH),
)  # fmt: skip

# The same, from 0.11.2's own run of the oracle (cachemgr.key.vllm_identity_0_11_2, derived by
# tools/oracle/derive.py --release 0.11.2 from vLLM 0.24.0's parser): not 0.12's facts, which were
# answered by vLLM 0.30 and vllm-rbln 0.12 code. On the optimum path 0.11.2 ignores --dtype (the
# platform sets float32 whatever is asked, platform.py 386) and --model-impl (vLLM's own there).
_IGNORED_BOTH_0_11 = _flags(identity_0_11.IGNORED["vllm"] & identity_0_11.IGNORED["optimum"])
VLLM_RBLN_0_11_2 = Release(
    name="vllm-rbln 0.11.2",
    versions={"vllm_rbln": "0.11.2", "optimum_rbln": "0.11.2", "vllm": "0.24.0+cpu"},
    env=_ENV_0_11,
    # vLLM 0.24 config/model.py 369-375, config/parallel.py 764-770; and what the oracle found
    runtime_flags=_VLLM_HASH_IGNORES | _IGNORED_BOTH_0_11,
    runtime_flags_vllm_path=frozenset({"enable-prefix-caching"})  # config/cache.py 204
    | _flags(identity_0_11.IGNORED["vllm"]) - _IGNORED_BOTH_0_11,
    runtime_flags_optimum_path=_flags(identity_0_11.IGNORED["optimum"]) - _IGNORED_BOTH_0_11,
    # platform.py 53 (max_num_seqs); gpu_memory_utilization keeps vLLM 0.24's 0.92 (config/cache.py 67);
    # and every option given at the value the server takes as its default (vllm_identity_0_11_2.DEFAULTS)
    defaults={**identity_0_11.DEFAULTS, "max_num_seqs": (1,), "gpu_memory_utilization": (0.92,)},
    additional_config="whole",
    model_impl="env",
    envs_xxh3="ed1ce65e6d9b9ba97f522e508dfe1203",
    structured=identity_0_11.FIELDS,
    cite="vllm_rbln 0.11.2 envs.py, platform.py, v1/worker/mega_cache.py; vLLM 0.24.0 config/",
)

KNOWN: tuple[Release, ...] = (VLLM_RBLN_0_12_0, VLLM_RBLN_0_11_2)

# Any other release: every VLLM_*/RBLN_* variable raw, every flag but the ones runtime-only in every
# release (cachemgr.key.serving.ALWAYS_RUNTIME), additional_config whole, no defaults assumed.
STRICT = Release(
    name="strict",
    versions={},
    env={},
    runtime_flags=frozenset(),
    runtime_flags_vllm_path=frozenset(),
    defaults={},
    additional_config="whole",
    model_impl="env",
)


def release_for(versions: Mapping[str, str]) -> Release:
    """The rules checked against exactly these versions of vllm-rbln, optimum-rbln and vLLM, else STRICT."""
    for release in KNOWN:
        if all(versions.get(name) == version for name, version in release.versions.items()):
            return release
    return STRICT
