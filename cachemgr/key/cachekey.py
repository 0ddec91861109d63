"""The cache key: what must be equal for a compiled model to be reused.

The chart page promises reuse only when the RBLN Compiler's major.minor version, the serving
settings of the cache key and the NPU type are all the same. Each input below carries the
reason it is in the key. The canonical form is sorted JSON; the digest is xxh3-128. Golden
digests in the tests pin this derivation: changing it by accident fails CI, changing it on
purpose means bumping :data:`SCHEMA_VERSION`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import xxhash

from cachemgr.core.errors import ConfigError, UsageError
from cachemgr.core.versions import release_numbers
from cachemgr.key import npu as npu_type
from cachemgr.key import vllm_rbln
from cachemgr.key.serving import ServerCommand, parse_server_argv

# Bump when the key's derivation or the entry layout changes: old entries then stop matching
# instead of being misread.
SCHEMA_VERSION = 1

Strategy = Literal["vllm", "command"]

# The vllm-rbln variables it hashes itself (RBLN_COMPILE_ENV) or that set RBLNConfig fields,
# which its config hash covers, are all VLLM_RBLN_*: every one counts, except those vllm-rbln
# 0.12 lists as not changing the compile (RBLN_NON_COMPILE_ENV, the runtime part of it).
_ENV_PREFIX = "VLLM_RBLN_"
_ENV_NOT_COMPILED = frozenset(
    {
        "VLLM_RBLN_DISABLE_WORKER_FAIL_FAST",
        "VLLM_RBLN_SAMPLER",  # sampler graphs compile with use_cache=False, never cached
        "VLLM_RBLN_COMPILE_STRICT_MODE",
        "VLLM_RBLN_ENABLE_WARM_UP",
        "VLLM_RBLN_METRICS",
        "VLLM_RBLN_METRICS_FILE",
        "VLLM_RBLN_METRICS_DIR",
        "VLLM_RBLN_NUMA",
        "VLLM_RBLN_COMPILE_ONLY",  # a cachemgr warm Job sets it; its key must match serving pods
        "VLLM_RBLN_DISABLE_OFFLOAD",
        "VLLM_RBLN_AUTO_PORT",
        "VLLM_RBLN_SUB_BLOCK_CACHE",  # prefix-cache reuse, not what is compiled
        "VLLM_RBLN_SUB_BLOCK_SIZE",
    }
)
# Compile-relevant variables outside the VLLM_RBLN_ prefix (RBLNConfig.use_custom_kernel).
_ENV_EXTRA = ("RBLN_USE_CUSTOM_KERNEL",)

_ROLE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".rbln")


@dataclass(frozen=True)
class CacheKey:
    """A computed key: its digest, the hashed inputs, and where each input came from."""

    digest: str
    inputs: Mapping[str, Any]
    sources: Mapping[str, str]
    server: ServerCommand
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def short(self) -> str:
        """Twelve hex digits: enough to name a key to an operator."""
        return self.digest[:12]

    @property
    def entry_name(self) -> str:
        """The entry's directory name: readable with ``ls``, unique by its digest."""
        model = _slug(str(self.details.get("model_name", "model")))
        npu = str(self.inputs["npu"])
        return f"{model}__{self.inputs['role']}__c{self.inputs['compiler']}__{npu}__{self.digest[:16]}"

    @property
    def model_name(self) -> str:
        return str(self.details.get("model_name", ""))

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.digest,
            "short": self.short,
            "entry": self.entry_name,
            "inputs": dict(self.inputs),
            "sources": dict(self.sources),
            "dropped_runtime_flags": list(self.server.dropped),
            "unknown_flags": list(self.server.unknown),
            "cannot_be_cached": list(self.details.get("uncacheable", ())),
        }


@dataclass(frozen=True, kw_only=True)
class KeyRequest:
    """Everything a key is computed from; the CLI fills it from flags and the environment."""

    argv: Sequence[str]
    role: str | None
    strategy: Strategy | None = None
    compile_cmd: str | None = None
    key_env: Sequence[str] = ()
    compiler_version: str | None = None
    npu_type: str | None = None
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))


def canonical_json(obj: Any) -> bytes:
    """Sorted, compact, UTF-8 JSON: the form that is hashed."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def digest_of(obj: Any) -> str:
    """xxh3-128 of the canonical JSON, as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(canonical_json(obj))


def compute_key(request: KeyRequest) -> CacheKey:
    """Resolve every input (failing closed when one cannot be known) and digest them."""
    server = parse_server_argv(request.argv)
    strategy = resolve_strategy(request.strategy, server, request.compile_cmd)
    sources: dict[str, str] = {}
    inputs: dict[str, Any] = {"schema": SCHEMA_VERSION}
    sources["schema"] = "cachemgr"
    # role: prefill and decode compile different graphs and have separate volumes.
    inputs["role"], sources["role"] = resolve_role(request.role)
    # compiler: the chart page reuses a compile only within one RBLN Compiler major.minor.
    inputs["compiler"], sources["compiler"] = resolve_compiler(request.compiler_version, request.environ)
    # npu: the compiled binary targets one NPU type (RBLN-CA25...), named as the server names it:
    # the device's answer first, as vllm-rbln asks (cachemgr.key.npu).
    npu = npu_type.resolve(request.npu_type, request.environ)
    inputs["npu"], sources["npu"] = npu.name, npu.source
    # server and strategy: they decide the layout of what is compiled and stored.
    inputs["server"], sources["server"] = server.kind, "argv[0]"
    inputs["strategy"], sources["strategy"] = strategy, "--strategy" if request.strategy else "default"
    if strategy == "vllm":
        # versions: vllm-rbln's bundle signature hashes vllm.__version__, and its optimum directory
        # names hash no version at all; a server upgrade must miss, not "hit" and compile anyway.
        inputs["versions"], sources["versions"] = vllm_rbln.resolve_versions(request.environ)
    # model: which weights are compiled; a local path by its content, not its mount path...
    model_string = _served_model(server, strategy, request.environ)
    model, model_source, details = resolve_model(server, model=model_string)
    if strategy == "vllm" and model["kind"] == "local":
        # ...except for the vllm strategy: vllm-rbln names its compiled_models/ directory and its
        # mega-cache bundle after the model path string, so an entry made under another path
        # would be found by cachemgr yet missed by the server, which would compile again.
        model = {**model, "path": model_string}
    inputs["model"], sources["model"] = model, model_source
    details = {**details, **_server_details(server, strategy, request.environ, npu)}
    # serving: the server's own settings that change what is compiled.
    inputs["serving"], sources["serving"] = dict(server.settings), "argv"
    # env: the compile-relevant environment vllm-rbln reads, and what the operator names.
    inputs["env"], sources["env"] = resolve_env(request.environ, request.key_env), "environment"
    if strategy == "command":
        # compile_cmd: the operator's compiler invocation produces the artifacts.
        inputs["compile_cmd"], sources["compile_cmd"] = _compile_argv(request.compile_cmd), "--compile-cmd"
        if model["kind"] in {"artifact_dir", "argv"}:
            # The compile command names the model better than the server's executable does.
            details = {**details, "model_name": _model_in(inputs["compile_cmd"])}
    return CacheKey(digest=digest_of(inputs), inputs=inputs, sources=sources, server=server, details=details)


def resolve_strategy(given: Strategy | None, server: ServerCommand, compile_cmd: str | None) -> Strategy:
    """``vllm`` for a vLLM server unless told otherwise; any other server needs a compile command."""
    if given is None:
        given = "command" if compile_cmd else ("vllm" if server.kind == "vllm" else None)
    if given is None:
        raise UsageError(
            f"'{server.argv[0]}' is not 'vllm serve', so cachemgr cannot let it compile for itself",
            remedy="pass --strategy command --compile-cmd 'COMPILER ... {output_dir}'",
        )
    if given == "command" and not compile_cmd:
        raise UsageError(
            "--strategy command needs --compile-cmd",
            remedy="pass --compile-cmd 'COMPILER ... {output_dir}'",
        )
    if given == "vllm" and server.kind != "vllm":
        raise UsageError(
            f"--strategy vllm needs a 'vllm serve' server, not '{server.argv[0]}'",
            remedy="use --strategy command --compile-cmd '...' for other servers",
        )
    return given


def _compile_argv(compile_cmd: str | None) -> list[str]:
    try:
        argv = shlex.split(compile_cmd or "")
    except ValueError as error:
        raise UsageError(
            f"--compile-cmd cannot be split into words ({error})", remedy="fix its quoting"
        ) from error
    if not argv or not any("{output_dir}" in arg for arg in argv):
        raise UsageError(
            f"--compile-cmd {compile_cmd!r} does not name {{output_dir}}",
            remedy="write the compiler's output to {output_dir}, e.g. --output-dir {output_dir}",
        )
    return argv


def _model_in(argv: list[str]) -> str:
    """The model a compile command names (``--model X``/``--model-id X``), for the entry's name."""
    for i, word in enumerate(argv):
        name, eq, value = word.partition("=")
        if name in {"--model", "--model-id", "--model_id", "--model-name"}:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else "model")
    return Path(argv[0]).name


def resolve_role(role: str | None) -> tuple[str, str]:
    if not role:
        raise ConfigError(
            "the pod's role is not set",
            remedy="set CACHEMGR_ROLE (or --role) to prefill or decode",
        )
    if not _ROLE.fullmatch(role):
        raise ConfigError(
            f"role {role!r} is not a lowercase name",
            remedy="set CACHEMGR_ROLE to prefill or decode (letters, digits, dashes)",
        )
    return role, "CACHEMGR_ROLE"


def resolve_compiler(override: str | None, environ: Mapping[str, str]) -> tuple[str, str]:
    """The RBLN Compiler's major.minor, from the override or installed package metadata."""
    if override or environ.get("CACHEMGR_COMPILER_VERSION"):
        raw = override or environ["CACHEMGR_COMPILER_VERSION"]
        source = "CACHEMGR_COMPILER_VERSION"
    else:
        try:
            # Metadata only: importing the compiler would load its runtime and take seconds.
            raw = _installed_version("rebel-compiler")
        except LookupError:
            raise ConfigError(
                "cannot tell the RBLN Compiler version: rebel-compiler is not installed in this "
                "environment and CACHEMGR_COMPILER_VERSION is not set",
                remedy="run in the modelserver image, or set CACHEMGR_COMPILER_VERSION to its version, "
                "e.g. CACHEMGR_COMPILER_VERSION=0.12.0",
            ) from None
        source = f"package rebel-compiler {raw}"
    return major_minor(raw), source


def _installed_version(distribution: str) -> str:
    """A distribution's version from its metadata; ``LookupError`` when it is not installed."""
    return vllm_rbln.installed_version(distribution)


def major_minor(raw: str) -> str:
    """``0.12.3``, ``0.12.0rc1``, ``0.12.1.dev4+gabc`` -> ``0.12``: patch releases share a cache."""
    try:
        numbers = release_numbers(raw)
    except ValueError:
        raise ConfigError(
            f"RBLN Compiler version {raw!r} is not a version number",
            remedy="set CACHEMGR_COMPILER_VERSION to a version such as 0.12.0",
        ) from None
    major, minor = (*numbers, 0)[:2]
    return f"{major}.{minor}"


def resolve_npu(override: str | None, environ: Mapping[str, str], *, probe: bool = True) -> tuple[str, str]:
    """The NPU type and its source (see :mod:`cachemgr.key.npu`). Never "unknown".

    Inspection passes ``probe=False``: it must not wait on the device just to mark entries for
    another NPU as incompatible.
    """
    found = npu_type.resolve(override, environ, probe=probe)
    return found.name, found.source


def _served_model(server: ServerCommand, strategy: Strategy, environ: Mapping[str, str]) -> str | None:
    """The model string the server will use: vLLM applies VLLM_MODEL_REDIRECT_PATH to it first."""
    if strategy != "vllm" or not server.model:
        return server.model
    return vllm_rbln.redirected_model(server.model, environ)


def _server_details(
    server: ServerCommand, strategy: Strategy, environ: Mapping[str, str], npu: npu_type.Npu
) -> dict[str, Any]:
    """Not hashed: what run, warm, key and explain say about this configuration."""
    details: dict[str, Any] = {
        "npu_from_device": npu.from_device,
        "npu_query_seconds": round(npu.query_seconds, 3),
    }
    if strategy == "vllm":
        details["model_impl"] = vllm_rbln.model_impl(server.settings, environ)
        details["uncacheable"] = vllm_rbln.uncacheable(server.settings, environ)
        redirected = _served_model(server, strategy, environ)
        if redirected != server.model:
            details["model_redirected_to"] = redirected
    return details


def resolve_model(
    server: ServerCommand, *, model: str | None = None
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """The model input, its source, and details (not hashed) for names and space estimates.

    ``model`` is the model string the server will use, if not the argv's (a redirect).
    """
    if server.kind != "vllm":
        # Any other server carries its model in its argv, which is keyed whole.
        return {"kind": "argv"}, "argv", {"model_name": Path(server.argv[0]).name}
    model = model or server.model
    if not model:
        raise ConfigError(
            "the vllm argv names no model",
            remedy="pass the model as 'vllm serve MODEL' or --model MODEL",
        )
    if "{artifact_dir}" in model:
        # The server loads what --compile-cmd produced: the compile command names the model.
        return {"kind": "artifact_dir"}, "--compile-cmd output", {"model_name": "compiled"}
    path = Path(model).expanduser()
    if _exists(path):
        return _local_model(path)
    if model.startswith(("/", "./", "../", "~")):
        raise ConfigError(
            f"model path {model} does not exist in this pod",
            remedy="mount the model volume at that path, or pass a Hugging Face model id",
        )
    hub = {"kind": "hub", "id": model, "revision": server.revision}
    source = "argv (--revision)" if server.revision else "argv (revision unpinned: the hub may change it)"
    return hub, source, {"model_name": model}


def _exists(path: Path) -> bool:
    """Does the model path exist? A name no path can have (ENAMETOOLONG) is bad input, not a bug."""
    try:
        return path.exists()
    except OSError as error:
        raise ConfigError(
            f"the model {str(path)[:80]!r}... ({len(str(path))} characters) cannot be a path here: {error.strerror}",
            remedy="pass a Hugging Face model id or a model directory that exists in this pod",
        ) from None


def _local_model(path: Path) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """Fingerprint a local model by its config, weight index and weight sizes, not its path."""
    if not path.is_dir():
        raise ConfigError(
            f"model path {path} is not a directory", remedy="point the server at a model directory"
        )
    described: dict[str, Any] = {}
    weights: dict[str, int] = {}
    try:
        for item in sorted(_model_files(path)):
            rel = item.relative_to(path).as_posix()
            if item.name.endswith(".json"):
                described[rel] = _model_json(item)
            else:
                weights[rel] = item.stat().st_size
    except OSError as error:
        raise ConfigError(
            f"cannot read model directory {path}: {error.strerror}", remedy="check the model volume mount"
        ) from error
    if "config.json" not in described and "rbln_config.json" not in described:
        raise ConfigError(
            f"model directory {path} has no config.json",
            remedy="point the server at a Hugging Face model directory",
        )
    fingerprint = digest_of({"json": described, "weights": weights})
    details = {"model_name": path.name, "model_path": str(path), "weight_bytes": sum(weights.values())}
    return {"kind": "local", "fingerprint": fingerprint}, f"local directory {path}", details


def _model_files(path: Path) -> list[Path]:
    found: list[Path] = []
    for item in path.iterdir():
        if item.is_dir() and not item.name.startswith("."):
            # One level down: compiled dirs and sharded checkpoints keep files in subdirectories.
            found += [sub for sub in item.iterdir() if _is_model_file(sub)]
        elif _is_model_file(item):
            found.append(item)
    return found


def _is_model_file(item: Path) -> bool:
    name = item.name
    is_json = name in {"config.json", "rbln_config.json"} or name.endswith(".index.json")
    return item.is_file() and (is_json or name.endswith(_WEIGHT_SUFFIXES))


def _model_json(item: Path) -> Any:
    try:
        data = json.loads(item.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {"unparsable_bytes": item.stat().st_size, "xxh3": xxhash.xxh3_128_hexdigest(item.read_bytes())}
    if isinstance(data, dict):
        # transformers writes the load path here; the same weights elsewhere must still hit.
        data.pop("_name_or_path", None)
    return data


def resolve_env(environ: Mapping[str, str], key_env: Sequence[str]) -> dict[str, str | None]:
    """The compile-relevant environment: VLLM_RBLN_* (minus the non-compile ones) and --key-env."""
    picked: dict[str, str | None] = {
        name: value
        for name, value in environ.items()
        if (name.startswith(_ENV_PREFIX) and name not in _ENV_NOT_COMPILED) or name in _ENV_EXTRA
    }
    for name in key_env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UsageError(f"--key-env {name!r} is not an environment variable name", remedy="pass a NAME")
        picked[name] = environ.get(name)
    return dict(sorted(picked.items()))


def _slug(text: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", text.replace("/", "--")).strip("-.")
    return (slug or "model")[:64]
