"""The cache key: what must be equal for a compiled model to be reused.

The chart page promises reuse only when the RBLN Compiler's major.minor version, the serving
settings of the cache key and the NPU type are all the same. Each input below carries the
reason it is in the key. The canonical form is sorted JSON; the digest is xxh3-128. Golden
digests in the tests pin this derivation: changing it by accident fails CI, changing it on
purpose means bumping :data:`SCHEMA_VERSION`.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

from cachemgr.core.errors import ConfigError, UsageError
from cachemgr.core.versions import release_numbers
from cachemgr.key import npu as npu_type
from cachemgr.key import vllm_rbln
from cachemgr.key.digest import canonical_json, digest_of
from cachemgr.key.models import resolve_model
from cachemgr.key.npu import Npu
from cachemgr.key.releases import release_for
from cachemgr.key.serving import RUNTIME_ONLY, ServerCommand, parse_server_argv
from cachemgr.key.vllm_key import draft_model, vllm_config

__all__ = ["CacheKey", "KeyRequest", "canonical_json", "compute_key", "digest_of", "major_minor"]

# Bump when the key's derivation or the entry layout changes: old entries then stop matching
# instead of being misread.
SCHEMA_VERSION = 1

Strategy = Literal["vllm", "command"]

# The command strategy's environment (the vllm strategy's follows the server's release, in
# cachemgr.key.vllm_key): every VLLM_RBLN_* variable counts, as given, except those vllm-rbln
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


class CacheKey(NamedTuple):
    """A computed key: its digest, the hashed inputs, and where each input came from."""

    digest: str
    inputs: Mapping[str, Any]
    sources: Mapping[str, str]
    server: ServerCommand
    details: Mapping[str, Any] = MappingProxyType({})

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

    @property
    def dropped(self) -> tuple[str, ...]:
        """The flags given that are left out of the key as runtime-only (flag names, no dashes)."""
        return tuple(self.details.get("dropped", self.server.dropped))

    @property
    def defaulted(self) -> tuple[str, ...]:
        """Flags given at the server's default value, keyed as if not given (``max-num-seqs 1``)."""
        return tuple(self.details.get("defaulted", ()))

    @property
    def notes(self) -> tuple[str, ...]:
        """How this key was made that an operator must know: strict rules, an unresolved snapshot."""
        return tuple(self.details.get("notes", ()))

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.digest,
            "short": self.short,
            "entry": self.entry_name,
            "inputs": dict(self.inputs),
            "sources": dict(self.sources),
            "rules": self.details.get("release"),
            "dropped_runtime_flags": list(self.dropped),
            "defaulted_flags": list(self.defaulted),
            "unknown_flags": list(self.server.unknown),
            "notes": list(self.notes),
            "cannot_be_cached": list(self.details.get("uncacheable", ())),
        }


class KeyRequest:
    """Everything a key is computed from; the CLI fills it from flags and the environment.

    A plain class, not a dataclass: the hit path makes none (docs/benchmarks.md, "The hit path
    without dataclasses"); ``environ`` defaults to a copy of the process's environment, taken now.
    """

    __slots__ = (
        "argv",
        "compile_cmd",
        "compiler_version",
        "environ",
        "key_env",
        "npu_type",
        "role",
        "strategy",
    )

    def __init__(
        self,
        *,
        argv: Sequence[str],
        role: str | None,
        strategy: Strategy | None = None,
        compile_cmd: str | None = None,
        key_env: Sequence[str] = (),
        compiler_version: str | None = None,
        npu_type: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.argv = argv
        self.role = role
        self.strategy = strategy
        self.compile_cmd = compile_cmd
        self.key_env = key_env
        self.compiler_version = compiler_version
        self.npu_type = npu_type
        self.environ: Mapping[str, str] = dict(os.environ) if environ is None else environ

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__ if name != "environ")
        return f"KeyRequest({shown}, environ=<{len(self.environ)} variables>)"


def compute_key(request: KeyRequest) -> CacheKey:
    """The key in one pass: the argv, the server's configuration, the inputs its model path reads, the digest.

    Every input is resolved once, failing closed when one cannot be known; each step reads only what
    the steps before it produced.
    """
    environ = request.environ
    # 1. The argv, read as the server reads it.
    server = parse_server_argv(request.argv)
    strategy = resolve_strategy(request.strategy, server, request.compile_cmd)
    inputs, sources, npu = _pod(request, server, strategy)
    details: dict[str, Any] = {
        "npu_from_device": npu.from_device,
        "npu_query_seconds": round(npu.query_seconds, 3),
    }
    # 2. The server's configuration: what it compiles from, as its release reads it.
    if strategy == "vllm":
        config = vllm_config(
            server, release_for(inputs["versions"]), environ, npu=npu.name, versions=inputs["versions"]
        )
        inputs |= config.inputs
        sources |= config.sources
        inputs["env"] |= _key_env(environ, request.key_env)
        model_string, model_environ = config.model, environ  # hub snapshots: the vllm strategy
        details |= config.details
    else:
        # serving: the server's own settings that change what is compiled.
        inputs["serving"], sources["serving"] = dict(server.settings), "argv"
        # env: the compile-relevant environment vllm-rbln reads, and what the operator names.
        inputs["env"], sources["env"] = resolve_env(environ, request.key_env), "environment"
        model_string, model_environ = server.model, None
    if server.unknown_argv:
        # Flags vLLM 0.30 does not know: a newer server may compile from them, and which token it
        # reads as whose value cannot be known, so the argv is keyed as given, minus runtime-only flags.
        runtime = config.aside if strategy == "vllm" else RUNTIME_ONLY
        inputs["unknown_flags"] = server.argv_without(runtime)
        sources["unknown_flags"] = (
            f"argv, as given (vLLM 0.30 does not know {', '.join('--' + u for u in server.unknown)})"
        )
    # 3. The inputs its model path reads: which weights are compiled (and the draft's).
    model, model_source, model_details = resolve_model(
        server,
        model=model_string,
        environ=model_environ,
        revision_keyed=strategy == "vllm" and config.revision_keyed,
    )
    if strategy == "vllm" and model["kind"] == "local":
        # vllm-rbln names its compiled_models/ directory and its mega-cache bundle after the model path
        # string, so an entry made under another path would be found by cachemgr yet missed by the
        # server, which would compile again.
        model = {**model, "path": model_string}
    inputs["model"], sources["model"] = model, model_source
    snapshot_note = model_details.pop("unresolved_snapshot", None)
    details = {**model_details, **details}
    if strategy == "vllm":
        notes = list(config.notes)
        draft = draft_model(server, environ)
        if draft is not None:
            inputs["draft_model"], sources["draft_model"], note = draft
            notes += [note] if note else []
        details["notes"] = [*notes, *([snapshot_note] if snapshot_note else [])]
    else:
        # compile_cmd: the operator's compiler invocation produces the artifacts.
        inputs["compile_cmd"], sources["compile_cmd"] = _compile_argv(request.compile_cmd), "--compile-cmd"
        if model["kind"] in {"artifact_dir", "argv"}:
            # The compile command names the model better than the server's executable does.
            details["model_name"] = _model_in(inputs["compile_cmd"])
    # 4. The digest of the canonical form.
    return CacheKey(digest=digest_of(inputs), inputs=inputs, sources=sources, server=server, details=details)


def _pod(
    request: KeyRequest, server: ServerCommand, strategy: Strategy
) -> tuple[dict[str, Any], dict[str, str], Npu]:
    """What the pod is: its role, the compiler and NPU it compiles for, and the server's versions."""
    inputs: dict[str, Any] = {"schema": SCHEMA_VERSION}
    sources: dict[str, str] = {"schema": "cachemgr"}
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
    return inputs, sources, npu


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
                remedy="run in the modelserver image, or set CACHEMGR_COMPILER_VERSION to the version "
                "that image has ('pip show rebel-compiler' in it)",
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


def resolve_env(environ: Mapping[str, str], key_env: Sequence[str]) -> dict[str, str | None]:
    """The ``command`` strategy's environment: VLLM_RBLN_* (minus the non-compile ones) and --key-env."""
    picked: dict[str, str | None] = {
        name: value
        for name, value in environ.items()
        if (name.startswith(_ENV_PREFIX) and name not in _ENV_NOT_COMPILED) or name in _ENV_EXTRA
    }
    return dict(sorted((picked | _key_env(environ, key_env)).items()))


def _key_env(environ: Mapping[str, str], key_env: Sequence[str]) -> dict[str, str | None]:
    """What the operator names with --key-env, as given."""
    picked: dict[str, str | None] = {}
    for name in key_env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UsageError(f"--key-env {name!r} is not an environment variable name", remedy="pass a NAME")
        picked[name] = environ.get(name)
    return picked


def _slug(text: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", text.replace("/", "--")).strip("-.")
    return (slug or "model")[:64]
