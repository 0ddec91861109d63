"""vllm-rbln's environment variables, read the way the release reads them.

Each variable of a release's ``envs.environment_variables`` is parsed as its ``envs.py`` parses it
(:data:`cachemgr.key.releases.Kind`): ``=1``, ``=true`` and ``=TRUE`` are one value to the server,
``=0``, ``=false`` and unset another where the default is false, so the key holds the parsed value
and only where it differs from the default. A value the server cannot parse (``int("two")``) makes
it fail at start, so nothing compiled for it is ever reused: it is keyed as ``{"$unparsed": text}``.

Where the image has ``vllm_rbln`` installed, its ``envs.py`` decides. Byte for byte the release's
(its xxh3-128 is in the table, the usual case), it is the table, which tests/test_rbln_facts.py holds
to that very file: one read of 20 KB. Otherwise (a patched build of the release's version) the file
is read, never imported: importing it imports vLLM where the release's envs.py does (0.11.1 merges
vLLM's own table into its own: 2 s, and every vLLM variable, ``VLLM_API_KEY`` among them, would look
like one of vllm-rbln's). Its source is parsed: a variable it names that the table does not, or one
its ``RBLN_COMPILE_ENV`` adds, is keyed (raw, strictly; never one whose name says it is a secret),
and its plain ``lambda`` parsers are compiled alone and run on the request's environment. Its named functions are not called: some import ``vllm``.
"""

from __future__ import annotations

import ast
import os
import re
import types
from collections.abc import Callable, Mapping
from typing import Any

import xxhash

from cachemgr.key.releases import EnvVar, Path, Release

# A secret never enters a key (key.json lies on the volume, readable by every pod of the role).
SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|ACCESS_KEY|PRIVATE_KEY")
_W8A8_CAPABLE = frozenset({"RBLN-CR13", "RBLN-CR23"})  # vllm_rbln 0.11.2 envs.py 87
_BUCKET_STRATEGIES = frozenset({"exponential", "exp", "linear", "manual"})  # 0.12.0 envs.py 107


class UnparsableError(ValueError):
    """The server's parser raises on this value."""


def parse(var: EnvVar, environ: Mapping[str, str], *, npu: str = "") -> Any:
    """The value ``envs.<name>`` has in a server started with ``environ`` (as JSON data)."""
    try:
        return _PARSERS[var.kind](var, environ.get(var.sources[0]), environ, npu)
    except ValueError:
        return {"$unparsed": {name: environ[name] for name in var.sources if name in environ}}


def _bool(var: EnvVar, raw: str | None, _environ: Mapping[str, str], _npu: str) -> bool:
    return (raw if raw is not None else str(var.default)).lower() in ("true", "1")


def _int(var: EnvVar, raw: str | None, _environ: Mapping[str, str], _npu: str) -> Any:
    return int(raw) if raw is not None else var.default


def _str(var: EnvVar, raw: str | None, _environ: Mapping[str, str], _npu: str) -> Any:
    return raw if raw is not None else var.default


def _opt_int(_var: EnvVar, raw: str | None, _environ: Mapping[str, str], _npu: str) -> int | None:
    return int(raw) if raw else None


def _num_devices(var: EnvVar, raw: str | None, environ: Mapping[str, str], _npu: str) -> Any:
    """get_num_devices_per_local_rank: the new name, then the legacy VLLM_RBLN_TP_SIZE (envs.py 84-98)."""
    legacy = environ.get(var.sources[1])
    return int(raw) if raw is not None else (int(legacy) if legacy is not None else var.default)


def _buckets(_var: EnvVar | None, raw: str | None, _environ: Mapping[str, str], _npu: str) -> list[int]:
    """get_decode_batch_bucket_manual_buckets (envs.py 125-146)."""
    if raw is None:
        return []
    buckets = [int(bucket) for bucket in raw.split(",")]
    if any(b <= 0 for b in buckets) or not buckets or len(buckets) != len(set(buckets)):
        raise UnparsableError(raw)
    return buckets


def _strategy(_var: EnvVar, raw: str | None, environ: Mapping[str, str], _npu: str) -> str:
    """get_decode_batch_bucket_strategy (envs.py 101-122)."""
    if raw is None:
        return "exponential"
    strategy = raw.lower()
    if strategy not in _BUCKET_STRATEGIES:
        raise UnparsableError(raw)
    manual = environ.get("VLLM_RBLN_DECODE_BATCH_BUCKET_MANUAL_BUCKETS")
    if strategy == "manual" and not _buckets(None, manual, environ, ""):
        raise UnparsableError(raw)
    return "exponential" if strategy == "exp" else strategy


def _w8a16(_var: EnvVar, raw: str | None, _environ: Mapping[str, str], npu: str) -> bool:
    """get_use_w8a16 (0.11.2 envs.py 92-111): set, a boolean; unset, it follows the NPU (which is keyed)."""
    return raw.lower() in ("true", "1") if raw is not None else npu.strip().upper() not in _W8A8_CAPABLE


def _auto_port(var: EnvVar, raw: str | None, environ: Mapping[str, str], _npu: str) -> bool:
    """use_auto_port (envs.py 149-158): its own value, else VLLM_RBLN_USE_DEVICE_TENSOR's, whose
    default is the release's (0.12.0 and 0.11.2: true; 0.11.1: false), the default of both unset."""
    fallback = environ.get(var.sources[1], str(var.default))
    return (raw if raw is not None else fallback).lower() in ("true", "1")


_PARSERS: dict[str, Callable[[EnvVar, str | None, Mapping[str, str], str], Any]] = {
    "bool": _bool,
    "int": _int,
    "str": _str,
    "opt_int": _opt_int,
    "num_devices": _num_devices,
    "int_list": _buckets,
    "bucket_strategy": _strategy,
    "w8a16": _w8a16,
    "auto_port": _auto_port,
}


def present(var: EnvVar, environ: Mapping[str, str]) -> bool:
    """Does the environment set it (config._env_overrides probes each name it reads)?"""
    return any(name in environ for name in var.sources)


def keyed_env(
    release: Release, paths: frozenset[Path], environ: Mapping[str, str], *, npu: str
) -> tuple[dict[str, Any], str]:
    """The variables a model path in ``paths`` compiles from (fields excepted), parsed, where not the default."""
    image = image_envs(release)
    keyed: dict[str, Any] = {}
    for var in release.env.values():
        if var.field is not None or not (var.compiled_on & paths):
            continue  # a field is keyed where the field is (cachemgr.key.vllm_key.resolve_rbln)
        value = read(release, var, environ, npu=npu)
        if value != var.default:
            keyed[var.name] = value
    if image is not None:
        # What this image's vllm-rbln hashes or names beyond the checked table: keyed as given.
        extra = (image.compile_env | image.names) - set(release.env)
        keyed |= {
            name: environ[name] for name in sorted(extra) if name in environ and not SECRET.search(name)
        }
        # ...and what it hashes that the table says no path compiles from (a patched build): keyed too.
        keyed |= {
            name: parse(release.env[name], environ, npu=npu)
            for name in sorted(image.compile_env & set(release.env))
            if not release.env[name].compiled_on
            and release.env[name].field is None
            and present(release.env[name], environ)
        }
    table = image_source(release) or "vllm-rbln's envs.py, as checked"
    return dict(sorted(keyed.items())), image.source if image else table


def read(release: Release, var: EnvVar, environ: Mapping[str, str], *, npu: str) -> Any:
    """``envs.<name>`` as the image's own parser reads it where it can be run safely, else the table's."""
    image = image_envs(release)
    parser = image.parsers.get(var.name) if image is not None else None
    if parser is None:
        return parse(var, environ, npu=npu)
    try:
        return parser(environ)
    except ValueError:
        return {"$unparsed": {name: environ[name] for name in var.sources if name in environ}}
    except Exception:  # noqa: BLE001 - the image's parser failed otherwise: the table reads it
        return parse(var, environ, npu=npu)


# --- the image's own vllm_rbln.envs ------------------------------------------------------------


class ImageEnvs:
    """What the installed ``vllm_rbln.envs`` says: its names, its compile set, its pure parsers."""

    def __init__(self, module: Any, source: str) -> None:
        self.source = source
        self.compile_env = frozenset(getattr(module, "RBLN_COMPILE_ENV", ()))
        table = getattr(module, "environment_variables", {})
        self.names = frozenset(table)
        self.parsers: dict[str, Callable[[Mapping[str, str]], Any]] = {
            name: _rehomed(fn)
            for name, fn in table.items()
            if isinstance(fn, types.FunctionType) and fn.__name__ == "<lambda>"
        }


_cache: dict[str, ImageEnvs | None] = {}


def image_envs(release: Release) -> ImageEnvs | None:
    """The image's ``vllm_rbln.envs`` where it says more than the table; else None (the table decides)."""
    wanted = release.versions.get("vllm_rbln")
    if not wanted:
        return None
    if wanted not in _cache:
        _cache[wanted] = _load(release, wanted)
    return _cache[wanted]


def image_source(release: Release) -> str | None:
    """What ``sources["env"]`` says when the table read the variables (None: no vllm_rbln installed)."""
    return _identical.get(release.name)


_identical: dict[str, str] = {}


def _load(release: Release, wanted: str) -> ImageEnvs | None:
    import importlib.util  # only on the vllm strategy's key path, once per process

    try:
        spec = importlib.util.find_spec("vllm_rbln")  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            return None  # not installed: the usual case outside the modelserver image
        folder = next(iter(spec.submodule_search_locations))
        with open(os.path.join(folder, "envs.py"), "rb") as source:
            text = source.read()
        if xxhash.xxh3_128_hexdigest(text) == release.envs_xxh3:
            _identical[release.name] = f"vllm_rbln/envs.py of this image: the checked {release.name} file"
            return None
        version = _version_of(os.path.join(folder, "_version.py"))
        if version != wanted:
            return None
        return ImageEnvs(_probed(text), f"vllm_rbln/envs.py {version} (this image, read)")
    except Exception:  # noqa: BLE001 - an odd installation must not stop the key: the table decides
        return None


def _version_of(path: str) -> str | None:
    """``__version__`` of vllm_rbln/_version.py (setuptools-scm writes it), read, not imported."""
    with open(path, encoding="utf-8") as source:
        for node in ast.parse(source.read()).body:
            if isinstance(node, ast.Assign) and any(
                getattr(t, "id", None) == "__version__" for t in node.targets
            ):
                # `__version__ = version = '0.11.2'`: a chained assignment of a constant
                value = ast.literal_eval(node.value)
                return value if isinstance(value, str) else None
    return None


def _probed(text: bytes) -> types.SimpleNamespace:
    """What envs.py says, from its source: the names of ``environment_variables`` (another table
    merged in with ``**`` is not vllm-rbln's), ``RBLN_COMPILE_ENV`` where it has one, and its plain
    lambdas compiled alone with ``os`` in scope."""
    tree = ast.parse(text)
    table: dict[str, Any] = {}
    compile_env: frozenset[str] = frozenset()
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(node, ast.AnnAssign):
            target = node.target
        value = getattr(node, "value", None)
        name = getattr(target, "id", None)
        if name == "environment_variables" and isinstance(value, ast.Dict):
            for key, entry in zip(value.keys, value.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    table[key.value] = _lambda(entry)
        elif name == "RBLN_COMPILE_ENV" and isinstance(value, ast.Call) and value.args:
            compile_env = frozenset(ast.literal_eval(value.args[0]))
    return types.SimpleNamespace(environment_variables=table, RBLN_COMPILE_ENV=compile_env)


def _lambda(node: ast.expr) -> Any:
    """A ``lambda`` entry compiled alone (its globals: ``os``), else None (a named function)."""
    if not isinstance(node, ast.Lambda):
        return None
    code = compile(ast.Expression(node), "<vllm_rbln/envs.py>", "eval")
    return eval(code, {"os": os, "__builtins__": __builtins__})  # noqa: S307 - a lambda of the image's envs.py


def _rehomed(fn: types.FunctionType) -> Callable[[Mapping[str, str]], Any]:
    """``fn`` run with ``os.environ`` being the given mapping (its globals copied, not changed)."""

    def run(environ: Mapping[str, str]) -> Any:
        scope = dict(fn.__globals__)
        scope["os"] = types.SimpleNamespace(environ=environ, getenv=environ.get)
        return types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)()

    return run
