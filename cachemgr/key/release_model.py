"""What a release's rules are made of: the types of cachemgr.key.releases' table, and helpers the
generated rules modules (cachemgr/key/rules_*.py, tools/gen_rules.py) build them with.

(NamedTuples, not dataclasses: the table is built at every pod start, and a dataclass costs ~0.7 ms
of CPU to define.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

Path = Literal["vllm", "optimum"]
# How envs.py parses a variable (each a lambda or function there): see cachemgr.key.rbln_env.
Kind = Literal[
    "bool", "int", "str", "opt_int", "int_list", "bucket_strategy", "num_devices", "w8a16", "auto_port"
]
BOTH: frozenset[Path] = frozenset({"vllm", "optimum"})
VLLM_PATH: frozenset[Path] = frozenset({"vllm"})
OPTIMUM_PATH: frozenset[Path] = frozenset({"optimum"})
NEITHER: frozenset[Path] = frozenset()
# How a model path's compiled artifacts lie in VLLM_CACHE_ROOT (cachemgr.runtime.loadable):
# "bundle": rbln/<model>-<sha1>/<signature>/rank<N>/mega_cache.bin (vllm-rbln's mega cache);
# "optimum_dir": compiled_models/<name>/ with its rbln_config.json;
# "compiler": nothing under VLLM_CACHE_ROOT cachemgr can hold (the RBLN compiler caches the graphs
# itself: vllm-rbln 0.11.1's vLLM-model path): such a path cannot be cached.
Layout = Literal["bundle", "optimum_dir", "compiler"]
LAYOUTS: dict[Path, Layout] = {"vllm": "bundle", "optimum": "optimum_dir"}


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
    # path, the fields proven not to reach that path's identity (the identity module's FIELDS; tools/oracle)
    structured: Mapping[str, Mapping[str, Any]] = {}
    # The model paths whose identity the key oracle checked (tools/releases/manifest.toml): a path
    # not in it is keyed strictly by itself (:meth:`on_paths`)
    checked: frozenset[Path] = BOTH
    layouts: Mapping[Path, Layout] = LAYOUTS  # never changed: one shared table is fine
    why_strict: str = ""  # a strict rule set: why (its describe())
    same_code_as: str = ""  # the release whose code (and oracle table) these rules are, if another's
    # The optimum path takes any existing model path as compiled, so optimum-rbln compiles a local
    # model directory in place on every start and saves nothing under VLLM_CACHE_ROOT (0.11.2; an
    # override of tools/releases/overrides.toml says where)
    local_model_in_place: bool = False

    @property
    def strict(self) -> bool:
        return not self.versions

    def describe(self) -> str:
        if self.strict:
            return f"strict ({self.why_strict or 'a release this cachemgr was not checked against'})"
        text = ", ".join(f"{_DIST[k]} {v}" for k, v in self.versions.items())
        return f"{text} (the code of vllm-rbln {self.same_code_as})" if self.same_code_as else text

    def on_paths(self, paths: frozenset[Path]) -> Release:
        """These rules where every path in ``paths`` was checked; else strict, saying which was not."""
        unchecked = sorted(paths - self.checked)
        if self.strict or not unchecked:
            return self
        names = " and ".join(_PATH_NAMES[p] for p in unchecked)
        return STRICT._replace(
            layouts=self.layouts,
            why_strict=f"{self.name}'s {names} was not checked against the server's code",
        )

    def uncacheable(self, paths: frozenset[Path], *, local_model: bool = False) -> list[str]:
        """Why a model path in ``paths`` cannot be cached by its artifacts' layout, if it cannot;
        ``local_model``: the server reads the model from a path of this pod (a directory, or a hub
        id that vLLM replaces with its snapshot directory under HF_HUB_OFFLINE)."""
        reasons = [
            f"{self.name or 'this release'}'s {_PATH_NAMES[p]} leaves no artifacts cachemgr can hold "
            "(the RBLN compiler caches its graphs itself, outside VLLM_CACHE_ROOT)"
            for p in sorted(paths)
            if self.layouts.get(p) == "compiler"
        ]
        if local_model and self.local_model_in_place and paths == {"optimum"}:
            reasons.append(
                f"{self.name}'s optimum path compiles a model read from a local path in place, on every "
                "start, and saves nothing under VLLM_CACHE_ROOT (it takes any existing path as compiled)"
            )
        return reasons


_DIST = {"vllm_rbln": "vllm-rbln", "optimum_rbln": "optimum-rbln", "vllm": "vLLM"}
_PATH_NAMES: dict[Path, str] = {"vllm": "vLLM-model path", "optimum": "optimum path"}

# Any release not in the table: every VLLM_*/RBLN_* variable raw, every flag but the ones runtime-only
# in every release (cachemgr.key.serving.ALWAYS_RUNTIME), additional_config whole, no defaults assumed.
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


def flags(dests: frozenset[str]) -> frozenset[str]:
    """Option dests (``max_num_seqs``) as the flags the rules name (``max-num-seqs``)."""
    return frozenset(dest.replace("_", "-") for dest in dests)
