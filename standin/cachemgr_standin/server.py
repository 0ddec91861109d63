"""STAND-IN for ``vllm serve`` on an RBLN NPU (vllm-rbln 0.12). Not vLLM.

``python -m cachemgr_standin.server serve MODEL [vllm flags...]`` (or ``--model MODEL``), and the
same through the ``vllm`` shim (:mod:`cachemgr_standin.shim`). It does what the real server does
to the compile cache, and nothing else:

* optimum path (default; ``VLLM_RBLN_USE_VLLM_MODEL`` unset/0, or ``--model-impl optimum``):
  MODEL holding ``rbln_config.json`` is loaded as is; else
  ``$VLLM_CACHE_ROOT/compiled_models/<model, / and : as _>_<sha256(config)[:16]>/`` is loaded when
  compiled, or compiled in a temporary directory and saved there as optimum-rbln's
  ``save_pretrained`` does (copy to ``<dir>.tmp``, rename; merge when the directory exists).
  A loaded directory whose ``rbln_config.json`` sets ``use_inputs_embeds`` has its
  ``torch_artifacts.pth`` unpickled, as optimum-rbln's decoder-only models ``torch.load`` it with
  ``weights_only=False``: whoever writes the directory runs code here (:func:`load_torch_artifacts`).
* vLLM-model path (``VLLM_RBLN_USE_VLLM_MODEL=1`` or ``--model-impl vllm``): per worker rank,
  ``$VLLM_CACHE_ROOT/rbln/<safe model>-<sha1(model)[:8]>/<sig>/rank<R>/mega_cache.bin`` is loaded
  if readable, missing graphs are compiled, and after warm-up every rank's bundle is saved again
  (tmp file, flush, fsync, rename); a failed save is logged and serving goes on.

As the real code does (tools/rbln_facts.py lists where): the signature hashes the vLLM version
(``STANDIN_VLLM_VERSION``, default ``cachemgr_standin.VLLM_VERSION``) and the NPU name as
``RblnPlatform.get_device_name`` gives it (the device, ``STANDIN_NPU_NAME``, then
``RBLN_FORCE_NPU_NAME``, then ``RBLN_TARGET_SOC``, unchanged); ``--enforce-eager`` or
``VLLM_RBLN_ENABLE_WARM_UP`` off skip warm-up, so nothing is compiled at start nor saved;
``VLLM_RBLN_COMPILE_ONLY`` acts on the vLLM-model path only; the optimum path cannot compile without
a device, and compiles into ``$TMPDIR`` before copying to the cache.

HTTP (stdlib ``ThreadingHTTPServer``) binds only once the engine is warm, as uvicorn does:
``/health``, ``/v1/models``, ``/version``, ``/standin/artifacts``. Knobs are ``STANDIN_*``
variables; see :mod:`cachemgr_standin`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, cast

from cachemgr_standin import signature
from cachemgr_standin.compiler import (
    DEFAULT_BYTES,
    DEFAULT_COMPILE_SECONDS,
    DEFAULT_FILES,
    RBLN_CONFIG,
    CompileSpec,
    Faults,
    FlagValue,
    KnobError,
    append_line,
    artifact_bytes,
    artifact_seed,
    die,
    die_by_signal,
    digest_entries,
    env_flag,
    env_float,
    env_int,
    env_size,
    fault_point,
    fire_faults,
    load_compiled_dir,
    parse_flag_tokens,
    progress,
    record_event,
    spend,
    split_sizes,
    write_compiled_dir,
)

BANNER = "STAND-IN vllm server (cachemgr_standin, not vLLM)"
DEFAULT_NPU = "RBLN-CA25"
VERSION = "0.12.0+standin"  # what `vllm --version` prints; PEP 440, so it reduces to 0.12
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_LOAD_SECONDS = 0.1

# Flags that only shape the running server, never the compiled graphs.
RUNTIME_FLAGS = frozenset({"host", "port", "api-key", "served-model-name"})
# vLLM flags that take no value, so `--enforce-eager MODEL` does not eat MODEL as its value.
# Any `--no-*`, `--enable-*`, `--disable-*` flag is boolean as well.
BOOLEAN_FLAGS = (
    frozenset(
        {"enforce-eager", "trust-remote-code", "skip-tokenizer-init", "headless", "api-server-count-auto"}
    )
    | signature.RBLN_BOOL_FLAGS
)
ALIASES = {
    "tp": "tensor-parallel-size",
    "pp": "pipeline-parallel-size",
    "dp": "data-parallel-size",
    "q": "quantization",
}
BUNDLE_MAGIC = b"STANDIN-RBLN-MEGA-CACHE 1\n"
_TRAILER = 65  # 64 hex digits of sha256 and a newline


def log(level: str, message: str) -> None:
    """A vLLM-style log line; vLLM's logger writes to stdout."""
    print(f"{level} {time.strftime('%m-%d %H:%M:%S')} [standin] {message}", flush=True)


# ---------------------------------------------------------------------------
# Arguments and knobs
# ---------------------------------------------------------------------------

Flags = dict[str, FlagValue | tuple[str, ...]]


@dataclass(frozen=True)
class ServeArgs:
    model: str
    host: str
    port: int
    api_key: str | None
    served_names: tuple[str, ...]
    compile_flags: Flags  # every non-runtime flag, normalized: the config signature's input


@dataclass(frozen=True)
class Knobs:
    compile_seconds: float
    load_seconds: float
    files: int
    total_bytes: int
    record: str | None
    faults: Faults
    extra_graphs: int = 0  # graphs beyond `files` this server needs (a bundle it loads lacks them)
    stamp: bool = False  # each save stamps the bundle: the same graphs as other bytes of the same size


def parse_flat_yaml(text: str) -> dict[str, FlagValue] | None:
    """``key: scalar`` lines, as a ``vllm serve --config`` file usually is; None if anything
    fancier is in it (the caller then keys on the file's bytes instead)."""
    values: dict[str, FlagValue] = {}
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, colon, rest = line.partition(":")
        value = rest.split(" #", 1)[0].strip()
        if not colon or key != key.strip() or not key or not value or value[0] in "[{|>&*!":
            return None
        if value[0] == value[-1] and value[0] in "'\"" and len(value) > 1:
            values[key] = value[1:-1]
        elif value.lower() in {"true", "false"}:
            values[key] = value.lower() == "true"
        else:
            values[key] = value
    return values


def config_file_flags(path: str) -> Flags:
    """The flags a ``--config`` YAML sets (vLLM applies them under the command line's)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise KnobError(f"cannot read --config {path}: {exc}") from exc
    flat = parse_flat_yaml(text)
    if flat is None:
        return {"config-sha256": hashlib.sha256(text.encode()).hexdigest()}
    return {key.replace("_", "-"): value for key, value in flat.items()}


def _first(value: FlagValue | tuple[str, ...] | None) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, tuple):
        return value[0] if value else None
    return value


def parse_serve_args(tokens: Sequence[str]) -> ServeArgs:
    """Parse what follows ``serve``; unknown flags are kept (they key the compile), not refused."""
    flags, positionals = parse_flag_tokens(
        tokens, boolean=BOOLEAN_FLAGS, multi=frozenset({"served-model-name"}), aliases=ALIASES
    )
    config = _first(flags.pop("config", None))
    merged: Flags = {**(config_file_flags(config) if config else {}), **flags}
    if len(positionals) > 1:
        raise KnobError(f"unexpected positional arguments: {positionals[1:]}")
    model = positionals[0] if positionals else _first(merged.get("model"))
    if not model:
        raise KnobError("no model: use `serve MODEL ...` or `--model MODEL`")
    port_text = _first(merged.get("port")) or str(DEFAULT_PORT)
    if not port_text.isdigit():
        raise KnobError(f"--port {port_text!r} is not a port number")
    names = merged.get("served-model-name")
    served = names if isinstance(names, tuple) else ((names,) if isinstance(names, str) else ())
    compile_flags: Flags = {
        key: value
        for key, value in merged.items()
        # `false` from a YAML file is the flag left unset, so it must key like the default.
        if key not in RUNTIME_FLAGS and key != "model" and value is not False
    }
    return ServeArgs(
        model=model,
        host=_first(merged.get("host")) or DEFAULT_HOST,
        port=int(port_text),
        api_key=_first(merged.get("api-key")) or os.environ.get("VLLM_API_KEY") or None,
        served_names=served,
        compile_flags=compile_flags,
    )


def read_knobs() -> Knobs:
    exit_before = os.environ.get("STANDIN_EXIT_BEFORE_HEALTHY", "").strip()
    try:
        exit_code = int(exit_before) if exit_before else None
    except ValueError:
        raise KnobError(f"STANDIN_EXIT_BEFORE_HEALTHY={exit_before!r} is not an exit code") from None
    return Knobs(
        compile_seconds=env_float("STANDIN_COMPILE_SECONDS", DEFAULT_COMPILE_SECONDS),
        load_seconds=env_float("STANDIN_LOAD_SECONDS", DEFAULT_LOAD_SECONDS),
        files=env_int("STANDIN_ARTIFACT_FILES", DEFAULT_FILES),
        total_bytes=env_size("STANDIN_ARTIFACT_BYTES", DEFAULT_BYTES),
        record=os.environ.get("STANDIN_RECORD") or None,
        extra_graphs=env_int("STANDIN_EXTRA_GRAPHS", 0, minimum=0),
        stamp=env_flag("STANDIN_BUNDLE_STAMP"),
        faults=Faults(
            exit_code=exit_code,
            quota_exceeded=env_flag("STANDIN_QUOTA_EXCEEDED"),
            hang=env_flag("STANDIN_HANG"),
            exit_label="STANDIN_EXIT_BEFORE_HEALTHY",
        ),
    )


def term_exit_code() -> int:
    raw = os.environ.get("STANDIN_EXIT_CODE", "").strip()
    try:
        return int(raw) if raw else 0
    except ValueError:
        raise KnobError(f"STANDIN_EXIT_CODE={raw!r} is not an exit code") from None


def vllm_cache_root() -> Path:
    """``vllm.envs.VLLM_CACHE_ROOT``: $VLLM_CACHE_ROOT, else $XDG_CACHE_HOME/vllm, else ~/.cache/vllm."""
    default = Path(os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))) / "vllm"
    return Path(os.environ.get("VLLM_CACHE_ROOT", str(default))).expanduser()


def _env_bool(name: str, default: str) -> bool:
    # vllm_rbln.envs parses booleans as `.lower() in ("true", "1")`.
    return os.environ.get(name, default).lower() in {"true", "1"}


def resolve_impl(args: ServeArgs) -> str:
    """``resolve_model_impl`` (config.py 365-448): ``--model-impl``, which ``VLLM_RBLN_USE_VLLM_MODEL``
    must agree with; else the path a parent published in ``_VLLM_RBLN_RESOLVED_MODEL_IMPL``; else the
    deprecated variable; else ``auto``, which the stand-in (no architecture registry) takes as optimum."""
    flagged = _first(args.compile_flags.get("model-impl"))
    given = {"vllm": "vllm", "optimum": "optimum", "transformers": "optimum"}.get(str(flagged))
    legacy = None
    if "VLLM_RBLN_USE_VLLM_MODEL" in os.environ:
        legacy = "vllm" if _env_bool("VLLM_RBLN_USE_VLLM_MODEL", "False") else "optimum"
        if given is not None and given != legacy:
            # vllm-rbln raises this ValueError at config time: a traceback and exit 1.
            raise ValueError(
                f"VLLM_RBLN_USE_VLLM_MODEL selects the {legacy!r} model path and model_impl selects "
                f"{given!r}. VLLM_RBLN_USE_VLLM_MODEL is deprecated: unset it and keep --model-impl."
            )
    inherited = os.environ.get("_VLLM_RBLN_RESOLVED_MODEL_IMPL") or None
    resolved = given or inherited or legacy or "optimum"
    return "vllm" if resolved == "vllm" else "optimum"


def _int_flag(flags: Flags, name: str, default: int) -> int:
    text = _first(flags.get(name))
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise KnobError(f"--{name} {text!r} is not an integer") from None


def worker_ranks(flags: Flags) -> list[int]:
    """The LOCAL_RANK of each worker: vllm-rbln's worker sets it to its rank (rank across DP
    when DP > 1, rbln_worker.py 818-835), overriding any inherited LOCAL_RANK, and each rank keeps
    its own bundle. DP comes from the flags, else from VLLM_DP_SIZE / VLLM_DP_RANK (vLLM
    config/parallel.py 910-940)."""
    world = _int_flag(flags, "tensor-parallel-size", 1) * _int_flag(flags, "pipeline-parallel-size", 1)
    try:
        dp, dp_rank = signature.data_parallel(flags, os.environ)
    except ValueError:
        raise KnobError("VLLM_DP_SIZE / VLLM_DP_RANK are not integers") from None
    if dp <= 1:
        return list(range(world))
    dp_ranks = [dp_rank] if dp_rank is not None else list(range(dp))
    return [d * world + r for d in dp_ranks for r in range(world)]


def _jsonable(flags: Flags) -> dict[str, Any]:
    return {key: list(value) if isinstance(value, tuple) else value for key, value in sorted(flags.items())}


# ---------------------------------------------------------------------------
# Engine: what the server serves with
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One artifact location: a compiled directory, or one rank's mega-cache bundle."""

    path: str
    digest: str
    source: str  # precompiled | cache-hit | compiled | bundle-hit | bundle-partial | bundle-miss
    entries: int
    size: int
    rank: int | None = None


@dataclass
class Engine:
    impl: str
    signature: str
    cache_root: Path
    units: list[Unit] = field(default_factory=list)

    @property
    def digest(self) -> str:
        if len(self.units) == 1:
            return self.units[0].digest
        return hashlib.sha256("\n".join(unit.digest for unit in self.units).encode()).hexdigest()

    def describe(self) -> dict[str, Any]:
        return {
            "standin": True,
            "impl": self.impl,
            "signature": self.signature,
            "cache_root": str(self.cache_root),
            "digest": self.digest,
            "units": [dataclasses.asdict(unit) for unit in self.units],
            "pid": os.getpid(),
        }


def optimum_signature(args: ServeArgs) -> str:
    """``_generate_model_path_name``'s hash (cachemgr_standin.signature)."""
    return signature.optimum_name_hash(args.model, args.compile_flags, os.environ)


def merge_dir(src_root: Path, dst_root: Path) -> None:
    """optimum-rbln's ``_merge_dir``: move files over, in listing order (so rbln_config.json may
    land before the .rbln files, as with the real one)."""
    for src in src_root.iterdir():
        dst = dst_root / src.name
        if src.is_symlink() or src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            if dst.is_dir() and not dst.is_symlink():
                shutil.rmtree(dst)
            src.replace(dst)
        elif src.is_dir():
            if dst.is_symlink() or dst.is_file():
                dst.unlink()
            dst.mkdir(parents=True, exist_ok=True)
            merge_dir(src, dst)
        else:
            src.replace(dst)


def save_pretrained(src: Path, dest: Path) -> None:
    """optimum-rbln's ``save_pretrained``: copy to ``<dest>.tmp``, then rename (or merge).

    A copy failure surfaces as copytree's ``shutil.Error`` listing the ``[Errno 28]`` of each
    file, exactly as the real one reports it; the ``.tmp`` copy is removed on any Exception
    (but not on a signal, which is not one).
    """
    tmp = Path(f"{dest}.tmp")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        shutil.copytree(src, tmp)
        if dest.exists():
            merge_dir(tmp, dest)
            shutil.rmtree(tmp)
        else:
            tmp.rename(dest)
    except Exception:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        raise


TORCH_ARTIFACTS = "torch_artifacts.pth"


def load_torch_artifacts(root: Path) -> None:
    """optimum-rbln 0.12.0's ``RBLNDecoderOnlyModel.__post_init__``: when ``rbln_config.json`` sets
    ``use_inputs_embeds``, ``torch.load(model_save_dir / subfolder / "torch_artifacts.pth",
    weights_only=False)`` (transformers/models/decoderonly/modeling_decoderonly.py 78-82; about
    twenty vision-language and diffusers classes load it unconditionally, e.g.
    qwen2_vl/modeling_qwen2_vl.py 87). ``weights_only=False`` is a full unpickle: whatever the file's
    pickle calls runs in the server. The stand-in has no torch; ``pickle.load`` is what that load
    does to a legacy (non-zip) ``.pth``. Whoever can write the compiled directory runs code here.
    """
    config = json.loads((root / RBLN_CONFIG).read_bytes())
    if not isinstance(config, dict) or not config.get("use_inputs_embeds"):
        return
    with (root / TORCH_ARTIFACTS).open("rb") as handle:
        artifacts = pickle.load(handle)  # noqa: S301  # as optimum-rbln does: the risk trust guards against
    log("INFO", f"Loaded {TORCH_ARTIFACTS} from {root} ({type(artifacts).__name__})")


def _loaded_unit(root: Path, source: str, knobs: Knobs, cache_root: Path) -> Unit:
    digest, entries, size = load_compiled_dir(root)
    load_torch_artifacts(root)
    record_event(
        knobs.record, "load", impl="optimum", cache_root=str(cache_root), path=str(root), digest=digest
    )
    log("INFO", f"Loaded compiled model from {root} ({source}, {entries} files, {size} bytes)")
    return Unit(str(root), digest, source, entries, size)


def optimum_engine(args: ServeArgs, knobs: Knobs, cache_root: Path) -> Engine:
    signature = optimum_signature(args)
    engine = Engine("optimum", signature, cache_root)
    if (Path(args.model) / RBLN_CONFIG).is_file():
        engine.units.append(_loaded_unit(Path(args.model), "precompiled", knobs, cache_root))
        return engine
    safe = args.model.replace("/", "_").replace(":", "_")
    cached = cache_root / "compiled_models" / f"{safe}_{signature}"
    if (cached / RBLN_CONFIG).is_file():
        log("INFO", f"Found cached compiled model at {cached}")
        engine.units.append(_loaded_unit(cached, "cache-hit", knobs, cache_root))
        return engine
    spec = CompileSpec(
        args.model,
        signature,
        knobs.files,
        knobs.total_bytes,
        knobs.compile_seconds,
        _jsonable(args.compile_flags),
    )
    base = {"impl": "optimum", "cache_root": str(cache_root), "path": str(cached)}
    if device_npu() is None:
        # optimum-rbln creates runtimes and checks the devices before compiling, compile-only or
        # not (configuration_utils.py 1133-1140, modeling_base.py 520-527; runtime_utils.py 164-167).
        raise ValueError(
            "Device 0 is not a valid NPU device. Please check your NPU status with 'rbln-smi' command."
        )
    record_event(knobs.record, "compile", **base, digest=None, signature=signature)
    log("INFO", f"Compiling {args.model} via optimum-rbln (stand-in) into {cached}")
    # optimum-rbln compiles into a TemporaryDirectory (under TMPDIR), then save_pretrained copies.
    with tempfile.TemporaryDirectory(prefix="standin-rbln-") as staging:
        write_compiled_dir(Path(staging), spec, knobs.faults, fault_dir=Path(f"{cached}.tmp"))
        digest = load_compiled_dir(Path(staging))[0]
        record_event(knobs.record, "compiled", **{**base, "path": staging}, digest=digest)
        save_pretrained(Path(staging), cached)
    digest, entries, size = load_compiled_dir(cached)
    record_event(knobs.record, "save", **base, digest=digest)
    engine.units.append(Unit(str(cached), digest, "compiled", entries, size))
    return engine


# --- vLLM-model path: mega-cache bundles --------------------------------------


def safe_name(model: str) -> str:
    """``mega_cache._safe_name``."""
    cleaned = "".join(ch if ch.isascii() and (ch.isalnum() or ch in "._-") else "_" for ch in model)
    return cleaned.strip("_") or "unknown"


def vllm_version() -> str:
    """The vLLM version this stand-in "has installed" (``vllm.__version__``)."""
    from cachemgr_standin import VLLM_VERSION

    return os.environ.get("STANDIN_VLLM_VERSION") or VLLM_VERSION


def device_npu() -> str | None:
    """``rebel.get_npu_name(0)``: what the fake ``rebel`` (standin/pymods) answers, None without a device."""
    name = os.environ.get("STANDIN_NPU_NAME", DEFAULT_NPU).strip()
    return None if name.lower() in {"", "none"} else name


def npu_name() -> str | None:
    """``RblnPlatform.get_device_name``: the device first, then the settings, the raw string
    (vllm_rbln/platform/__init__.py 136-151)."""
    return device_npu() or os.environ.get("RBLN_FORCE_NPU_NAME") or os.environ.get("RBLN_TARGET_SOC") or None


def warmup_skip_reason(args: ServeArgs) -> str | None:
    """``compile_and_warmup_skip_reason`` (vllm_rbln/v1/worker/utils.py 378-384): no warm-up, no bundle."""
    if (
        args.compile_flags.get("enforce-eager") is True
        and args.compile_flags.get("no-enforce-eager") is not True
    ):
        return "enforce_eager is set"
    if not _env_bool("VLLM_RBLN_ENABLE_WARM_UP", "True"):
        return "VLLM_RBLN_ENABLE_WARM_UP is off"
    return None


def vllm_signature(args: ServeArgs) -> str:
    """``mega_cache.config_signature``: sha1 of config hash | graph set | compile env | npu | rebel
    major.minor (cachemgr_standin.signature), and the attention backend the graphs are built for."""
    revision = _first(args.compile_flags.get("revision"))
    cfg = signature.vllm_config_hash(args.model, revision, args.compile_flags, os.environ, vllm_version())
    graphs = signature.graph_set(args.compile_flags, os.environ)
    env_hash = signature.sha(signature.compile_env(os.environ))
    backend = signature.attention_backend(os.environ)
    text = "|".join([cfg, graphs, env_hash, f"npu={npu_name() or 'unknown'}", "rebel=0.12", backend])
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:16]


def bundle_path(cache_root: Path, model: str, signature: str, rank: int) -> Path:
    """``mega_cache.bundle_path``."""
    raw = model or "unknown"
    suffix = hashlib.sha1(raw.encode(), usedforsecurity=False).hexdigest()[:8]
    return cache_root / "rbln" / f"{safe_name(raw)}-{suffix}" / signature / f"rank{rank}" / "mega_cache.bin"


def encode_bundle(meta: dict[str, Any], graphs: dict[str, bytes]) -> Iterator[bytes]:
    """Magic line, JSON index line, graph bytes in index order, then sha256 of all that."""
    index = {**meta, "graphs": [{"name": name, "size": len(graphs[name])} for name in sorted(graphs)]}
    body_hash = hashlib.sha256()
    for part in (BUNDLE_MAGIC, json.dumps(index, sort_keys=True).encode() + b"\n"):
        body_hash.update(part)
        yield part
    for name in sorted(graphs):
        body_hash.update(graphs[name])
        yield graphs[name]
    yield body_hash.hexdigest().encode() + b"\n"


def decode_bundle(data: bytes) -> dict[str, bytes] | None:
    """The graphs of a bundle, or None if it is not a whole, intact stand-in bundle."""
    if not data.startswith(BUNDLE_MAGIC) or len(data) < len(BUNDLE_MAGIC) + _TRAILER:
        return None
    body, trailer = data[:-_TRAILER], data[-_TRAILER:]
    if trailer != hashlib.sha256(body).hexdigest().encode() + b"\n":
        return None
    end = body.find(b"\n", len(BUNDLE_MAGIC))
    if end < 0:
        return None
    try:
        index = json.loads(body[len(BUNDLE_MAGIC) : end])
        graphs: dict[str, bytes] = {}
        offset = end + 1
        for entry in index["graphs"]:
            size = int(entry["size"])
            graphs[str(entry["name"])] = body[offset : offset + size]
            offset += size
    except (ValueError, KeyError, TypeError):
        return None
    return graphs if offset == len(body) else None


def load_bundle(path: Path, knobs: Knobs, cache_root: Path, rank: int) -> dict[str, bytes]:
    """``mega_cache.load``: an absent, unreadable or damaged bundle means compiling, not failing."""
    if not path.is_file():
        return {}
    try:
        data = path.read_bytes()
    except OSError as exc:
        log("WARNING", f"Failed to load rbln mega-cache bundle: {exc}")
        return {}
    graphs = decode_bundle(data)
    if graphs is None:
        log("WARNING", f"Ignored an unreadable rbln mega-cache bundle at {path}; recompiling")
        return {}
    log("INFO", f"Loaded rbln mega-cache bundle from {path}")
    record_event(
        knobs.record,
        "load",
        impl="vllm",
        cache_root=str(cache_root),
        path=str(path),
        rank=rank,
        digest=digest_entries(graphs),
    )
    return graphs


def save_bundle(
    path: Path, meta: dict[str, Any], graphs: dict[str, bytes], knobs: Knobs, cache_root: Path
) -> None:
    """``mega_cache.save``: tmp file, flush, fsync, rename; on failure log and carry on serving."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    base = {"impl": "vllm", "cache_root": str(cache_root), "path": str(path), "rank": meta["rank"]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as dst:
            for part in encode_bundle(meta, graphs):
                dst.write(part)
            # Delayed allocation defers ENOSPC to flush; without fsync a truncated bundle could be renamed in.
            dst.flush()
            os.fsync(dst.fileno())
        tmp.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        out_of_space = exc.errno in {errno.ENOSPC, errno.EDQUOT}
        log(
            "ERROR",
            f"Could not persist the rbln mega-cache bundle to {path}: {exc}"
            f"{' (out of disk space)' if out_of_space else ''}. The previous bundle is left untouched, "
            "so every restart recompiles from scratch until this is resolved.",
        )
        record_event(knobs.record, "save-failed", **base, digest=None, errno=exc.errno, error=str(exc))
    else:
        size = path.stat().st_size
        log("INFO", f"Saved rbln mega-cache bundle to {path} ({size / (1 << 20):.1f} MiB)")
        record_event(knobs.record, "save", **base, digest=digest_entries(graphs))


def graph_names(count: int) -> list[str]:
    return [f"graph_{i:03d}" for i in range(count)]


def compile_graphs(
    args: ServeArgs, knobs: Knobs, signature: str, missing: list[tuple[int, str, int]], paths: dict[int, Path]
) -> dict[int, dict[str, bytes]]:
    """Compile the missing (rank, graph, size) triples; a full compile takes STANDIN_COMPILE_SECONDS
    whatever the TP size, as the real ranks compile in parallel."""
    per_graph = knobs.compile_seconds / (knobs.files * len(paths))
    compiled: dict[int, dict[str, bytes]] = {rank: {} for rank in paths}
    multi_rank = len(paths) > 1
    for index, (rank, name, size) in enumerate(missing, start=1):
        progress(index, len(missing), f" (rank {rank})" if multi_rank else "")
        spend(per_graph)
        compiled[rank][name] = artifact_bytes(
            artifact_seed(args.model, signature, f"rank{rank}/{name}"), size
        )
        if index == fault_point(len(missing)) and knobs.faults.any():
            fire_faults(knobs.faults, f"{paths[rank]}.{os.getpid()}.tmp")
    return compiled


def vllm_engine(args: ServeArgs, knobs: Knobs, cache_root: Path) -> Engine:
    signature = vllm_signature(args)
    engine = Engine("vllm", signature, cache_root)
    skip = warmup_skip_reason(args)
    if skip is not None:
        # rbln_worker.compile_or_warm_up_model: neither mega_cache.load nor .save runs.
        log("INFO", f"Skipping compile_or_warm_up_model ({skip}).")
        return engine
    # vLLM's VLLM_DISABLE_COMPILE_CACHE turns mega_cache.load/save into no-ops.
    use_cache = not bool(int(os.environ.get("VLLM_DISABLE_COMPILE_CACHE", "0") or "0"))
    log("INFO", f"mega-cache config_signature={signature} (stand-in)")
    ranks = worker_ranks(args.compile_flags)
    paths = {rank: bundle_path(cache_root, args.model, signature, rank) for rank in ranks}
    sizes = split_sizes(knobs.total_bytes // len(ranks), knobs.files)
    sizes += sizes[-1:] * knobs.extra_graphs  # STANDIN_EXTRA_GRAPHS: graphs a newer SDK also compiles
    loaded = {rank: load_bundle(paths[rank], knobs, cache_root, rank) if use_cache else {} for rank in ranks}
    missing = [
        (rank, name, size)
        for rank in ranks
        for name, size in zip(graph_names(len(sizes)), sizes, strict=True)
        if name not in loaded[rank]
    ]
    for rank in sorted({rank for rank, _, _ in missing}):
        record_event(
            knobs.record,
            "compile",
            impl="vllm",
            cache_root=str(cache_root),
            path=str(paths[rank]),
            rank=rank,
            digest=None,
            signature=signature,
        )
    compiled = compile_graphs(args, knobs, signature, missing, paths)
    for rank in ranks:
        graphs = {**loaded[rank], **compiled[rank]}
        if compiled[rank]:
            record_event(
                knobs.record,
                "compiled",
                impl="vllm",
                cache_root=str(cache_root),
                path=str(paths[rank]),
                rank=rank,
                digest=digest_entries(compiled[rank]),
            )
        if use_cache:
            meta = {"model": args.model, "signature": signature, "rank": rank}
            if knobs.stamp:  # STANDIN_BUNDLE_STAMP: a writer whose bundle is not byte-stable
                meta["stamp"] = os.urandom(8).hex()
            save_bundle(paths[rank], meta, graphs, knobs, cache_root)
        source = "bundle-miss" if not loaded[rank] else ("bundle-partial" if compiled[rank] else "bundle-hit")
        size = sum(len(data) for data in graphs.values())
        engine.units.append(Unit(str(paths[rank]), digest_entries(graphs), source, len(graphs), size, rank))
    return engine


def start_engine(args: ServeArgs, knobs: Knobs) -> Engine:
    impl = resolve_impl(args)
    cache_root = vllm_cache_root()
    # Shown as the folder it is where cachemgr hands it through its descriptor (/proc/<pid>/fd/<n>).
    shown = os.path.realpath(cache_root) if str(cache_root).startswith("/proc/") else cache_root
    log("INFO", f"STAND-IN engine: model={args.model} impl={impl} VLLM_CACHE_ROOT={shown}")
    if impl == "vllm":
        time.sleep(knobs.load_seconds)  # weights onto the device, then warm-up compiles
        return vllm_engine(args, knobs, cache_root)
    engine = optimum_engine(args, knobs, cache_root)
    time.sleep(knobs.load_seconds)  # the compiled model onto the device
    return engine


# ---------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client must not hold up exit

    def __init__(self, args: ServeArgs, engine: Engine) -> None:
        self.args = args
        self.engine = engine
        self.started = int(time.time())
        if ":" in args.host:
            self.address_family = socket.AF_INET6
        super().__init__((args.host, args.port), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server_version = f"standin-vllm/{VERSION}"

    def do_GET(self) -> None:
        state = cast(_Server, self.server)
        route = self.path.split("?", 1)[0]
        if route == "/health":
            self._send(200, b"")
        elif route == "/version":
            self._send_json(200, {"version": VERSION})
        elif route == "/standin/artifacts":
            self._send_json(200, state.engine.describe())
        elif route == "/v1/models":
            self._models(state)
        else:
            self._send_json(404, {"detail": "Not Found"})

    def _models(self, state: _Server) -> None:
        key = state.args.api_key
        if key is not None and self.headers.get("Authorization") != f"Bearer {key}":
            self._send_json(401, {"error": "Unauthorized"})
            return
        names = state.args.served_names or (state.args.model,)
        data = [
            {
                "id": name,
                "object": "model",
                "created": state.started,
                "owned_by": "vllm",
                "root": state.args.model,
            }
            for name in names
        ]
        self._send_json(200, {"object": "list", "data": data})

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: kubelet probes would drown the compile log."""


def serve(args: ServeArgs, engine: Engine) -> None:
    server = _Server(args, engine)
    host, port = server.server_address[:2]
    log("INFO", f"Starting vLLM API server (stand-in) on http://{host!s}:{port}")
    print("INFO:     Application startup complete.", file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()


# ---------------------------------------------------------------------------
# Signals and main
# ---------------------------------------------------------------------------


def install_signal_handlers(signal_log: str | None, term_code: int) -> None:
    """SIGTERM/SIGINT end gracefully (0, or STANDIN_EXIT_CODE for SIGTERM), SIGHUP is noted and
    ignored, SIGQUIT kills by SIGQUIT. Handlers run in the main thread, so they interrupt a
    compile step's sleep or the HTTP loop alike."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signal_log:
            append_line(signal_log, name)
        if signum == signal.SIGHUP:
            return
        if signum == signal.SIGQUIT:
            die_by_signal(signum)
        log("INFO", f"Received {name}; shutting down (stand-in)")
        raise SystemExit(term_code if signum == signal.SIGTERM else 0)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, handler)


def spawned_at() -> float | None:
    """When this process was forked, in seconds of CLOCK_BOOTTIME (``/proc/self/stat`` starttime,
    to the clock tick): the moment its parent started it, whatever this process's wall clock says
    (libfaketime skews that, not /proc). None where /proc is not Linux's."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def usage_error(message: str) -> NoReturn:
    print(f"usage: vllm serve MODEL [flags...]  (stand-in)\nerror: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


_LOADED = frozenset({"precompiled", "cache-hit", "bundle-hit", "bundle-partial"})


def exit_on_load(engine: Engine) -> None:
    """Stand-in fault ``STANDIN_EXIT_ON_LOAD=<code>`` (negative: die by that signal): having loaded
    compiled artifacts it did not compile itself, the server dies before it is ready, as vllm-rbln
    does on a graph the runtime rejects. A server that compiled (a miss) is not affected."""
    raw = os.environ.get("STANDIN_EXIT_ON_LOAD", "").strip()
    loaded = [unit for unit in engine.units if unit.source in _LOADED]
    if not raw or not loaded:
        return
    try:
        code = int(raw)
    except ValueError:
        usage_error(f"STANDIN_EXIT_ON_LOAD={raw!r} is not an exit code")
    print("Traceback (most recent call last):", file=sys.stderr)
    print('  File "vllm_rbln/worker/model_runner.py", line 412, in load_model', file=sys.stderr)
    print(
        f"RuntimeError: [standin] cannot load the compiled model at {loaded[0].path} "
        f"(stand-in fault STANDIN_EXIT_ON_LOAD={code})",
        file=sys.stderr,
        flush=True,
    )
    die(code)


def main(argv: Sequence[str] | None = None) -> int:
    tokens = list(sys.argv[1:] if argv is None else argv)
    print(f"{BANNER}: pid {os.getpid()}: vllm {' '.join(tokens)}", file=sys.stderr, flush=True)
    if tokens[:1] in (["--version"], ["-v"]):
        print(VERSION, flush=True)
        return 0
    if tokens[:1] != ["serve"]:
        usage_error("the stand-in only implements `serve`")
    # Who started this server and when (a file of its own: STANDIN_RECORD's event lists stay as
    # they are): the fault campaign holds the spawn against the moment its pod got SIGTERM.
    starts = os.environ.get("STANDIN_START_RECORD") or None
    record_event(starts, "start", ppid=os.getppid(), spawned_boot=spawned_at(), argv=tokens)
    try:
        install_signal_handlers(os.environ.get("STANDIN_SIGNAL_LOG") or None, term_exit_code())
        args = parse_serve_args(tokens[1:])
        knobs = read_knobs()
        worker_ranks(args.compile_flags)
    except KnobError as exc:
        usage_error(str(exc))
    engine = start_engine(args, knobs)
    exit_on_load(engine)
    if engine.impl == "vllm" and _env_bool("VLLM_RBLN_COMPILE_ONLY", "0"):
        # vllm-rbln's compile-only mode (a CPU warm Job): compile, save, exit without serving. It
        # acts on the vLLM-model path only (vllm_rbln/compilation/compiler.py 127); the optimum
        # path compiles on a device and serves.
        log("INFO", "VLLM_RBLN_COMPILE_ONLY is set: artifacts saved, exiting without serving")
        return 0
    serve(args, engine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
