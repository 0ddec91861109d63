"""Re-derive, from the real sources, the facts the ``vllm`` strategy's key and checks depend on.

cachemgr does not import vLLM, vllm-rbln or optimum-rbln; it follows what their code does to the
compile cache (cachemgr/key/releases.py, vllm_key.py, rbln_env.py, rbln_config.py, vllm_rbln.py,
npu.py, runtime/loadable.py, volume/drift.py, the stand-in). This script reads the unpacked wheels of
one release and derives two kinds of facts, each with its ``file:line``:

- the release's table (``--table``, or ``--write DIR`` to update tests/data/rbln_facts/): every
  variable of vllm-rbln's ``envs.environment_variables`` with how it is parsed, ``RBLN_COMPILE_ENV``,
  the RBLNConfig fields (0.12), what vLLM's config hashes ignore, the platform's defaults, the
  optimum runtime-only keys, the model-path rule and the pinned versions; tools/gen_rules.py writes
  the release's rules from it, tests/test_rbln_facts.py holds the rules to the checked-in JSON in
  CI, and the JSON to the wheels where they are unpacked;
- pinned code facts (``FACTS``, for vllm-rbln 0.12.0): patterns cachemgr's comments cite by line;
  tests/test_rbln_facts.py fails when one moves.

Adding a release (docs/development.md, "Adding a release"): one entry in tools/releases/manifest.toml,
then tools/gen_rules.py --src DIR, which calls this tool's ``release_table`` and writes the release's
rules from the facts; read the diff. Sources, one directory per wheel::

    for p in vllm-rbln==0.12.0 optimum-rbln==0.12.0 vllm==0.30.0 vllm-rbln==0.11.2 optimum-rbln==0.11.2 vllm==0.24.0
    do pip download --no-deps -d /tmp/wheels "$p"; done
    cd /tmp/wheels && for w in *.whl; do d=src/$(echo "$w" | cut -d- -f1-2); mkdir -p "$d"; unzip -qo "$w" -d "$d"; done
    # /tmp/wheels/src/{vllm_rbln-0.12.0,optimum_rbln-0.12.0,vllm-0.30.0,...}

    .venv/bin/python tools/rbln_facts.py [--src /tmp/wheels/src] [--release 0.12.0]   # 1 if a fact is missing
    .venv/bin/python tools/rbln_facts.py --release 0.11.2 --write tests/data/rbln_facts
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

DEFAULT_SRC = Path("/tmp/wheels/src")  # noqa: S108  # where the pip downloads above are unpacked
_RBLN = "vllm_rbln/vllm_rbln"
_OPT = "optimum_rbln/optimum/rbln"
_VLLM = "vllm/vllm"


@dataclass(frozen=True)
class Fact:
    name: str
    path: str  # "<wheel>/<path in it>": vllm_rbln/..., optimum_rbln/..., vllm/...
    pattern: str  # a regular expression (MULTILINE); group 1, if any, is the fact's value
    why: str


@dataclass(frozen=True)
class Found:
    fact: Fact
    line: int  # 1-based line where the match starts
    value: str

    def __str__(self) -> str:
        return f"{self.fact.name:28} {self.fact.path}:{self.line}  {self.value!r}\n{'':29}{self.fact.why}"


FACTS: tuple[Fact, ...] = (
    Fact("vllm_pin", "vllm_rbln/vllm_rbln-0.12.0.dist-info/METADATA", r"^Requires-Dist: vllm==(\S+)$",
         "the vLLM vllm-rbln runs on, local label included: key it exactly"),
    Fact("vllm_rbln_version", "vllm_rbln/vllm_rbln-0.12.0.dist-info/METADATA", r"^Version: (\S+)$",
         "the vllm-rbln release these facts are read from"),
    Fact("optimum_rbln_version", "optimum_rbln/optimum_rbln-0.12.0.dist-info/METADATA", r"^Version: (\S+)$",
         "the optimum-rbln release these facts are read from"),
    Fact("transformers_pin", "optimum_rbln/optimum_rbln-0.12.0.dist-info/METADATA",
         r"^Requires-Dist: transformers==(\S+)$", "the transformers optimum-rbln compiles through"),
    Fact("compute_hash_version", f"{_VLLM}/config/vllm.py",
         r"if include_version:\n\s+from vllm import (__version__)\n\n\s+vllm_factors\.append\(__version__\)",
         "VllmConfig.compute_hash() hashes vllm.__version__"),
    Fact("additional_config_hashed", f"{_VLLM}/config/vllm.py",
         r"(json\.dumps\(additional_config, sort_keys=True\))", "a dict additional_config is hashed whole..."),
    Fact("additional_config_compute_hash", f"{_VLLM}/config/vllm.py",
         r"additional_config_hash = (additional_config\.compute_hash\(\))", "...an object by its compute_hash()"),
    Fact("hf_config_hashed", f"{_VLLM}/config/utils.py",
         r'if hasattr\(x, "to_json_string"\) and callable\(x\.to_json_string\):\n\s+try:\n\s+return (x\.to_json_string\(\))',
         "ModelConfig's hf_config is hashed as its JSON (transformers_version included)"),
    Fact("signature_compute_hash", f"{_RBLN}/v1/worker/mega_cache.py", r"return (vllm_config\.compute_hash\(\))",
         "the bundle signature starts from compute_hash(), so from the vLLM version"),
    Fact("signature_parts", f"{_RBLN}/v1/worker/mega_cache.py",
         r'"\|"\.join\((\[cfg, graphs, env, f"npu=\{npu\}", f"rebel=\{rebel_ver\}"\])\)',
         "what the bundle signature joins: config hash, graph set, compile env, raw NPU name, rebel major.minor"),
    Fact("signature_draft_model", f"{_RBLN}/v1/worker/mega_cache.py",
         r'"draft_model": (draft\.compute_hash\(\)) if draft is not None else None',
         "the graph set hashes the draft model's config (its hf_config)"),
    Fact("signature_npu", f"{_RBLN}/v1/worker/mega_cache.py",
         r'return (RblnPlatform\.get_device_name\(\) or "unknown")', "the NPU name is hashed as the platform gives it"),
    Fact("npu_order", f"{_RBLN}/platform/__init__.py",
         r'(rebel\.get_npu_name\(device_id\)\n\s+or os\.environ\.get\("RBLN_FORCE_NPU_NAME"\)\n'
         r'\s+or os\.environ\.get\("RBLN_TARGET_SOC"\))',
         "the device first, then RBLN_FORCE_NPU_NAME, then RBLN_TARGET_SOC"),
    Fact("model_impl_reset", f"{_RBLN}/platform/__init__.py", r'(self\.model_impl = "auto")',
         "--model-impl is reset before vLLM hashes it: only the resolved path counts"),
    Fact("mla_backend", f"{_RBLN}/platform/__init__.py", r"(if attn_selector_config\.use_mla)",
         "the attention backend follows use_mla..."),
    Fact("mla_disable", f"{_VLLM}/config/model.py", r"if (envs\.VLLM_MLA_DISABLE):\n\s+return False",
         "...which VLLM_MLA_DISABLE turns off"),
    Fact("dp_from_env", f"{_VLLM}/config/parallel.py",
         r"(self\.data_parallel_size = envs\.VLLM_DP_SIZE\n\s+self\.data_parallel_rank = envs\.VLLM_DP_RANK)",
         "without DP on the command line, its size and rank come from VLLM_DP_SIZE / VLLM_DP_RANK"),
    Fact("dp_rank_dir", f"{_RBLN}/v1/worker/rbln_worker.py", r'(os\.environ\["LOCAL_RANK"\] = str\(rank_across_dp\))',
         "the DP rank picks the rank<N> bundle directory"),
    Fact("device_nodes", f"{_RBLN}/v1/worker/utils.py", r'^(RBLN_DEV_DIR = "/dev")$',
         "a card this process can open is a /dev/rbln<N> node"),
    Fact("device_node_names", f"{_RBLN}/v1/worker/utils.py",
         r"names = (os\.listdir\(RBLN_DEV_DIR\))", "...listed from /dev (those named rbln<N>)"),
    Fact("optimum_name_no_version", f"{_RBLN}/utils/optimum/converter/dispatch.py",
         r"# (FIXME: To avoid cache collisions, the cache key should also include)\n\s+# the versions",
         "the optimum directory name hashes no version: cachemgr must"),
    Fact("optimum_name_model", f"{_RBLN}/utils/optimum/converter/dispatch.py",
         r"model_name = (str\(vllm_config\.model_config\.model\))",
         "the optimum directory is named after the (redirected) model string"),
    Fact("optimum_cache_dir", f"{_RBLN}/utils/optimum/converter/dispatch.py",
         r'envs\.VLLM_CACHE_ROOT,\n\s+("compiled_models"),', "optimum artifacts live under compiled_models/"),
    Fact("compiled_dir_test", f"{_RBLN}/utils/optimum/paths.py",
         r"return (os\.path\.isfile\(os\.path\.join\(path, RBLN_CONFIG_FILE\)\))",
         "a compiled directory is one holding rbln_config.json"),
    Fact("rbln_config_name", f"{_RBLN}/utils/optimum/paths.py", r'^RBLN_CONFIG_FILE = "([^"]+)"',
         "its name"),
    Fact("compiled_graphs_named", f"{_OPT}/modeling_base.py",
         r"(compiled_model_names = \[cfg\.compiled_model_name for cfg in rbln_config\.compile_cfgs\])",
         "optimum-rbln loads one <name>.rbln per entry of _compile_cfgs..."),
    Fact("compiled_graph_missing", f"{_OPT}/modeling_base.py",
         r'raise (FileNotFoundError)\(\n\s+f"Expected RBLN compiled model', "...and refuses a directory missing one"),
    Fact("compiled_model_default_name", f"{_OPT}/configuration_utils.py", r'^DEFAULT_COMPILED_MODEL_NAME = "([^"]+)"',
         "the name of a compile config that names none"),
    Fact("submodule_folder", f"{_OPT}/utils/submodule.py", r"(subfolder=submodule_name,)",
         "a submodule's graphs are loaded from <model>/<submodule>/"),
    Fact("model_redirect", f"{_VLLM}/config/model.py", r"(self\.model = maybe_model_redirect\(self\.model\))",
         "vLLM replaces the model string by its VLLM_MODEL_REDIRECT_PATH entry"),
    Fact("model_redirect_table", f"{_VLLM}/transformers_utils/utils.py",
         r"(redirect_dict = _maybe_json_dict\(model_redirect_path\) or _maybe_space_split_dict\()",
         "a JSON object, else 'model target' lines"),
    Fact("warmup_skip", f"{_RBLN}/v1/worker/utils.py",
         r'if vllm_config\.model_config\.enforce_eager:\n\s+return "enforce_eager is set"\n'
         r"\s+if not (envs\.VLLM_RBLN_ENABLE_WARM_UP):",
         "no warm-up with --enforce-eager or VLLM_RBLN_ENABLE_WARM_UP off"),
    Fact("warmup_skipped_in_worker", f"{_RBLN}/v1/worker/rbln_worker.py",
         r"if \(skip := (compile_and_warmup_skip_reason\(self\.vllm_config\))\) is not None:",
         "the worker skips compile and warm-up then"),
    Fact("warmup_default", f"{_RBLN}/envs.py",
         r'(os\.environ\.get\("VLLM_RBLN_ENABLE_WARM_UP", "True"\)\.lower\(\) in \("true", "1"\))',
         "warm-up is on unless set to something else than true/1"),
    Fact("save_after_warmup", f"{_RBLN}/v1/worker/rbln_model_runner.py",
         r"(mega_cache\.save\(self\.model_config\.model, sig\))", "the bundle is saved at the end of warm-up only"),
    Fact("load_disabled", f"{_RBLN}/v1/worker/mega_cache.py",
         r'def load\(model: str, sig: str\) -> None:\n\s+"""[^"]*"""\n\s+if (envs\.VLLM_DISABLE_COMPILE_CACHE):',
         "VLLM_DISABLE_COMPILE_CACHE: no load..."),
    Fact("save_disabled", f"{_RBLN}/v1/worker/mega_cache.py",
         r'def save\(model: str, sig: str\) -> None:\n\s+"""[^"]*"""\n\s+if (envs\.VLLM_DISABLE_COMPILE_CACHE):',
         "...and no save"),
    Fact("disable_cache_parse", f"{_VLLM}/envs.py",
         r'return (bool\(int\(os\.getenv\("VLLM_DISABLE_COMPILE_CACHE", "0"\)\)\))', "how vLLM reads it"),
    Fact("save_failure_logged", f"{_RBLN}/v1/worker/mega_cache.py", r'"(Could not persist the rbln mega-cache bundle)',
         "a failed save is only logged: the server serves on, nothing saved"),
    Fact("bundle_resave", f"{_RBLN}/v1/worker/mega_cache.py",
         r'(tmp_path = f"\{path\}\.\{os\.getpid\(\)\}\.tmp")', "each save writes <bundle>.<pid>.tmp, then renames it"),
    Fact("bundle_path", f"{_RBLN}/v1/worker/mega_cache.py",
         r'"rbln",\n\s+f"\{_safe_name\(raw\)\}-\{suffix\}",\n\s+sig,\n\s+f"rank\{local_rank\}",\n\s+"(mega_cache\.bin)",',
         "rbln/<model>-<sha1>/<signature>/rank<N>/mega_cache.bin"),
    Fact("modelinfos", f"{_VLLM}/model_executor/models/registry.py", r'return Path\(envs\.VLLM_CACHE_ROOT\) / "(modelinfos)"',
         "vLLM's own records under VLLM_CACHE_ROOT: not compiled artifacts"),
    Fact("model_impl_aliases", f"{_RBLN}/config.py", r'"(transformers)": "optimum",',
         "--model-impl transformers is the optimum path"),
    Fact("compile_only_vllm_path", f"{_RBLN}/compilation/compiler.py", r"if (envs\.VLLM_RBLN_COMPILE_ONLY):",
         "compile-only is an option of the vLLM-model path's torch.compile backend"),
    Fact("optimum_runtimes_default", f"{_OPT}/configuration_utils.py",
         r'elif self\._runtime_options\["create_runtimes"\] is None:\n\s+return (True)',
         "optimum-rbln creates runtimes by default..."),
    Fact("optimum_device_check", f"{_OPT}/modeling_base.py",
         r"if create_runtimes:\n\s+runtime_cannot_be_created = (tp_and_devices_are_ok)\(",
         "...and checks the devices before compiling: no CPU-only compile"),
    Fact("optimum_tmpdir", f"{_OPT}/modeling.py", r"save_dir = (TemporaryDirectory\(\))",
         "the optimum compile writes the whole model under $TMPDIR first..."),
    Fact("optimum_save_copy", f"{_OPT}/modeling_base.py", r'(tmp_dir = str\(save_directory_path\) \+ "\.tmp")',
         "...then copies it to <dir>.tmp on the cache and renames it"),
    Fact("optimum_save_called", f"{_RBLN}/model_executor/models/optimum/model_base.py",
         r"(model\.save_pretrained\(cached_model_path\))", "vllm-rbln saves the compiled model into compiled_models/"),
)  # fmt: skip


@dataclass(frozen=True)
class Sources:
    """The unpacked wheels of one release: vllm-rbln, the optimum-rbln it is checked with, its vLLM."""

    rbln: Path
    optimum: Path
    vllm: Path

    def file(self, logical: str) -> Path:
        wheel, _, rest = logical.partition("/")
        return {"vllm_rbln": self.rbln, "optimum_rbln": self.optimum, "vllm": self.vllm}[wheel] / rest


def sources(src: Path, release: str) -> Sources:
    """``src/vllm_rbln-<release>``, the optimum-rbln of the same release, and the vLLM it pins."""
    rbln = src / f"vllm_rbln-{release}"
    metadata = _read(rbln / f"vllm_rbln-{release}.dist-info" / "METADATA")
    pin = re.search(r"^Requires-Dist: vllm==(\S+)$", metadata, re.MULTILINE)
    if pin is None:
        raise SystemExit(f"{rbln}: no vllm pin in its METADATA")
    return Sources(rbln, src / f"optimum_rbln-{release}", src / f"vllm-{pin.group(1).split('+')[0]}")


def releases_in(src: Path) -> list[str]:
    """The releases of the manifest the oracle runs whose wheels are unpacked under ``src`` (a
    code-identical release has no facts of its own: tools/gen_rules.py compares its wheel)."""
    from cachemgr_testkit import manifest

    return [r for r in manifest.oracle_releases() if (src / f"vllm_rbln-{r}").is_dir()]


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def derive(src: Sources) -> tuple[list[Found], list[str]]:
    """Every pinned fact found in ``src``, and those not found (with why)."""
    found: list[Found] = []
    missing: list[str] = []
    for fact in FACTS:
        path = src.file(fact.path.replace("0.12.0", src.rbln.name.split("-", 1)[1]))
        try:
            text = _read(path)
        except OSError as error:
            missing.append(f"{fact.name}: {fact.path}: {error.strerror}")
            continue
        match = re.search(fact.pattern, text, re.MULTILINE)
        if match is None:
            missing.append(f"{fact.name}: {fact.path}: pattern not found (the code moved on)")
            continue
        value = match.group(1) if match.groups() else match.group(0)
        found.append(Found(fact, text.count("\n", 0, match.start()) + 1, value))
    return found, missing


# --- the release's table ---------------------------------------------------------------------------

_ENV_SHAPES: tuple[tuple[str, str], ...] = (
    (
        "bool",
        r"lambda: os\.environ\.get\('(?P<name>\w+)', '(?P<default>\w+)'\)\.lower\(\) in \('true', '1'\)",
    ),
    ("int", r"lambda: int\(os\.environ\.get\('(?P<name>\w+)', (?P<default>-?\d+)\)\)"),
    ("str", r"lambda: os\.environ\.get\('(?P<name>\w+)', '(?P<default>[^']*)'\)"),
    ("opt_int", r"lambda: int\(size\) if \(size := os\.environ\.get\('(?P<name>\w+)'\)\) else None"),
)
# envs.py's named parsers: how cachemgr.key.rbln_env parses each (its Kind). Their defaults are not
# written here: every default is what the release's own entry returns on an empty environment
# (executed_defaults), so a release that changes one (0.11.1's VLLM_RBLN_AUTO_PORT) says so itself.
_ENV_FUNCTIONS = {
    "get_num_devices_per_local_rank": "num_devices",
    "get_decode_batch_bucket_strategy": "bucket_strategy",
    "get_decode_batch_bucket_manual_buckets": "int_list",
    "use_auto_port": "auto_port",
    "get_use_w8a16": "w8a16",
}
_SERVER_PACKAGES = ("vllm", "vllm_rbln", "optimum", "rebel", "torch")


def _assigned(tree: ast.Module, name: str) -> ast.expr:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return node.value
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            assert node.value is not None
            return node.value
    raise KeyError(name)


class _Stub(dict):  # type: ignore[type-arg]
    """What a server import of envs.py stands for while its entries run: an empty table (vLLM's
    ``environment_variables``, merged in by 0.11.1), and any attribute or call (a logger)."""

    def __getattr__(self, name: str) -> Any:
        return _Stub()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Stub()


class _NoServerImports:
    """A meta-path finder that refuses the server's packages: an entry that imports one (0.11's
    ``get_use_w8a16`` asks vLLM's platform) has no default of its own."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".", maxsplit=1)[0] in _SERVER_PACKAGES:
            raise ImportError(f"{name}: not imported to read a default")


def envs_namespace(path: Path, environ: dict[str, str]) -> Any:
    """The release's envs.py executed without its imports of the server (each name they bind is a
    stub: an empty table, a no-op logger), ``os.environ`` being ``environ``: its namespace."""
    import os
    import types

    tree = ast.parse(_read(path))
    body: list[ast.stmt] = []
    stubs: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if module and module.split(".", maxsplit=1)[0] in _SERVER_PACKAGES:
                stubs |= {(a.asname or a.name).split(".", maxsplit=1)[0]: _Stub() for a in node.names}
                continue
        body.append(node)
    tree.body = body
    scope: dict[str, Any] = {"__name__": f"envs_under_probe_{abs(hash(path))}", **stubs}
    exec(compile(tree, str(path), "exec"), scope)  # noqa: S102 - the release's own envs.py, stubbed
    scope["os"] = types.SimpleNamespace(environ=environ, getenv=environ.get, path=os.path)
    return types.SimpleNamespace(**scope)


def executed_defaults(path: Path) -> dict[str, Any]:
    """Each entry of ``environment_variables`` run on an empty environment: its default, as the
    release computes it (:func:`envs_namespace`); an entry that raises or imports the server (which
    is refused meanwhile) maps to the marker ``{"$depends": reason}``."""
    blocker = _NoServerImports()
    sys.meta_path.insert(0, blocker)
    try:
        module = envs_namespace(path, {})
        defaults: dict[str, Any] = {}
        for name, entry in module.environment_variables.items():
            if not callable(entry):
                continue
            try:
                defaults[name] = entry()  # its globals are the namespace: os.environ is the empty mapping
            except Exception as error:  # noqa: BLE001 - the entry cannot say alone: recorded as such
                defaults[name] = {"$depends": f"{type(error).__name__}: {error}"}
        return defaults
    finally:
        sys.meta_path.remove(blocker)


def env_table(src: Sources) -> dict[str, Any]:
    """envs.environment_variables: each name with how it is parsed and its executed default, what
    it merges in (0.11.1 spreads vLLM's own table into it), and the partitions where envs.py has them."""
    path = src.rbln / "vllm_rbln" / "envs.py"
    tree = ast.parse(_read(path))
    table = _assigned(tree, "environment_variables")
    assert isinstance(table, ast.Dict)
    defaults = executed_defaults(path)
    env: dict[str, Any] = {}
    merged: list[str] = []
    for key, value in zip(table.keys, table.values, strict=True):
        if key is None:  # {**vllm_envs, ...}: another table merged in, not a variable of vllm-rbln's
            merged.append(ast.unparse(value))
            continue
        assert isinstance(key, ast.Constant)
        text = " ".join(ast.unparse(value).split())
        entry: dict[str, Any] = {"kind": "unknown", "line": value.lineno, "code": text}
        if isinstance(value, ast.Name) and value.id in _ENV_FUNCTIONS:
            entry = {"kind": _ENV_FUNCTIONS[value.id], "line": value.lineno}
        for kind, shape in _ENV_SHAPES:
            if (m := re.fullmatch(shape, text)) is not None:
                entry = {"kind": kind, "line": value.lineno}
                if m["name"] != key.value:
                    entry["reads"] = [m["name"]]
        if entry["kind"] != "unknown":
            default = defaults.get(str(key.value))
            # a default the entry cannot compute alone (it asks the platform): None, keyed as read
            entry["default"] = None if isinstance(default, dict) and "$depends" in default else default
        env[str(key.value)] = entry
    partitions: dict[str, Any] = {}
    for name in ("RBLN_COMPILE_ENV", "RBLN_NON_COMPILE_ENV"):
        try:
            partitions[name.lower()] = sorted(ast.literal_eval(_assigned(tree, name).args[0]))  # type: ignore[attr-defined]
        except KeyError:  # 0.11.1: no mega-cache, no partition (None: not the same as empty)
            partitions[name.lower()] = None
    return {
        "env": env,
        "merged": merged,
        **partitions,
        # what cachemgr compares an installed envs.py with (cachemgr/key/rbln_env.py)
        "envs_xxh3": xxhash.xxh3_128_hexdigest(path.read_bytes()),
        "cite": f"{path.relative_to(src.rbln.parent)}",
    }


def _ignored_factors(path: Path, cls: str) -> list[str]:
    """The ``ignored_factors`` set literal in ``cls.compute_hash``."""
    tree = ast.parse(_read(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "ignored_factors" for t in sub.targets)
                    and isinstance(sub.value, ast.Set)
                ):
                    return sorted(ast.literal_eval(sub.value))
    return []


def rbln_fields(src: Sources) -> dict[str, Any]:
    """vllm-rbln 0.12's RBLNConfig / OptimumRBLNConfig fields, defaults, metadata, env sources, hash."""
    path = src.rbln / "vllm_rbln" / "config.py"
    if not path.is_file():
        return {}
    tree = ast.parse(_read(path))
    classes = {
        "RBLNConfigBase": ["vllm", "optimum"],
        "RBLNConfig": ["vllm"],
        "OptimumRBLNConfig": ["optimum"],
    }
    metadata = {name: ast.literal_eval(_assigned(tree, name)) for name in ("_NO_FLAG", "_DERIVED")}
    fields: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for item in node.body:
                if (
                    isinstance(item, ast.AnnAssign)
                    and isinstance(item.target, ast.Name)
                    and item.value is not None
                ):
                    fields[item.target.id] = {
                        "classes": classes[node.name],
                        "line": item.lineno,
                        **_field_default(item.value, metadata),
                    }
    return {
        "fields": fields,
        "hash_ignored": _ignored_factors(path, "RBLNConfig"),
        "optimum_hash_ignored_extra": _ignored_factors(path, "OptimumRBLNConfig"),
        "env_name": ast.literal_eval(_assigned(tree, "_ENV_NAME")),
        "env_probe": {k: list(v) for k, v in ast.literal_eval(_assigned(tree, "_ENV_PROBE")).items()},
        "renamed": ast.literal_eval(
            ast.unparse(_assigned(tree, "_RENAMED_KEYS")).replace("OptimumRBLNConfig", "'optimum'")
        ),
        "cite": str(path.relative_to(src.rbln.parent)),
    }


def _field_default(value: ast.expr, metadata: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, ast.Call):  # field(default=..., metadata=...) / Field(default=None, gt=0)
        out: dict[str, Any] = {}
        for kw in value.keywords:
            if kw.arg == "default":
                out["default"] = ast.literal_eval(kw.value)
            elif kw.arg == "default_factory":
                out["default"] = {"list": [], "dict": {}}[ast.unparse(kw.value)]
            elif kw.arg == "metadata":
                out["metadata"] = metadata.get(ast.unparse(kw.value), ast.unparse(kw.value))
        return out
    return {"default": ast.literal_eval(value)}


def release_table(src: Sources) -> dict[str, Any]:
    """What cachemgr.key.releases must say about this release (see the module docstring)."""
    rbln_meta = _read(src.rbln / f"{src.rbln.name}.dist-info" / "METADATA")
    opt_meta = _read(src.optimum / f"{src.optimum.name}.dist-info" / "METADATA")
    version = re.search(r"^Version: (\S+)$", rbln_meta, re.MULTILINE)
    vllm_pin = re.search(r"^Requires-Dist: vllm==(\S+)$", rbln_meta, re.MULTILINE)
    opt_version = re.search(r"^Version: (\S+)$", opt_meta, re.MULTILINE)
    transformers = re.search(r"^Requires-Dist: transformers==(\S+)$", opt_meta, re.MULTILINE)
    assert version is not None
    assert vllm_pin is not None
    assert opt_version is not None
    platform = src.rbln / "vllm_rbln" / "platform" / "__init__.py"
    if not platform.is_file():
        platform = src.rbln / "vllm_rbln" / "platform.py"
    platform_text = _read(platform)
    defaults: dict[str, Any] = {}
    for name, pattern in (("max_num_seqs", r"^RBLN_DEFAULT_MAX_NUM_SEQS = (\S+)$"),
                          ("gpu_memory_utilization", r"^RBLN_DEFAULT_GPU_MEMORY_UTILIZATION = (\S+)$")):  # fmt: skip
        if (m := re.search(pattern, platform_text, re.MULTILINE)) is not None:
            defaults[name] = ast.literal_eval(m.group(1))
    cache = _read(src.vllm / "vllm" / "config" / "cache.py")
    vllm_default = re.search(r"gpu_memory_utilization: float = Field\(default=([\d.]+)", cache)
    config_dir = src.vllm / "vllm" / "config"
    dispatch = _read(src.rbln / "vllm_rbln" / "utils" / "optimum" / "converter" / "dispatch.py")
    runtime_keys = re.search(r"_RUNTIME_ONLY_KEYS: frozenset\[str\] = frozenset\(\n?\s*(\{[^}]*\})", dispatch)
    name_fn = dispatch[dispatch.index("def _generate_model_path_name") :].split("\ndef ", 1)[0]
    return {
        "versions": {
            "vllm_rbln": version.group(1),
            "optimum_rbln": opt_version.group(1),
            "vllm": vllm_pin.group(1),
        },
        "transformers_pin": transformers.group(1) if transformers else None,
        **env_table(src),
        "rbln_config": rbln_fields(src),
        "vllm_hash_ignored": {
            cls: _ignored_factors(config_dir / f"{mod}.py", cls)
            for mod, cls in (
                ("model", "ModelConfig"),
                ("parallel", "ParallelConfig"),
                ("cache", "CacheConfig"),
            )
        },
        "platform_defaults": defaults,
        "vllm_gpu_memory_utilization_default": float(vllm_default.group(1)) if vllm_default else None,
        "model_impl_rule": "flag_then_env"
        if "def resolve_model_impl" in _read_or_empty(src.rbln / "vllm_rbln" / "config.py")
        else "env",
        "model_impl_reset": 'self.model_impl = "auto"' in platform_text,
        "optimum_runtime_keys": sorted(ast.literal_eval(runtime_keys.group(1))) if runtime_keys else [],
        "optimum_name_env": sorted(set(re.findall(r"envs\.(VLLM_RBLN_\w+)", name_fn))),
        "optimum_name_fields": sorted(set(re.findall(r"rbln_config\.(\w+)", name_fn))),
        "optimum_architectures": optimum_architectures(src),
        # how each model path's compiled artifacts lie (cachemgr.key.release_model.Layout), probed:
        # no mega_cache module, no bundle (0.11.1: the RBLN compiler caches the vLLM-model path)
        "layouts": {
            "vllm": "bundle"
            if (src.rbln / "vllm_rbln" / "v1" / "worker" / "mega_cache.py").is_file()
            else "compiler",
            "optimum": "optimum_dir" if '"compiled_models"' in dispatch else "compiler",
        },
        # every file of the vllm-rbln wheel with its sha256 (its RECORD, less the dist-info): what
        # tools/gen_rules.py compares to recognise a release whose code is another's
        "record": wheel_record(src.rbln),
    }


def wheel_record(unpacked: Path) -> dict[str, str]:
    """The wheel's RECORD (path -> sha256, urlsafe base64 as pip writes it), less its dist-info."""
    (info,) = unpacked.glob("*.dist-info")
    record: dict[str, str] = {}
    for line in _read(info / "RECORD").splitlines():
        path, digest, _size = line.rsplit(",", 2)
        if digest and not path.split("/")[0].endswith(".dist-info"):
            record[path] = digest.removeprefix("sha256=")
    return dict(sorted(record.items()))


def optimum_architectures(src: Sources) -> list[str]:
    """utils/optimum/registry.py's _RBLN_SUPPORTED_MODELS: every _RBLN_*_MODELS dict merged into it
    (what --model-impl auto sends to the optimum path)."""
    registry = src.rbln / "vllm_rbln" / "utils" / "optimum" / "registry.py"
    tables: dict[str, set[str]] = {}
    for node in ast.parse(_read(registry)).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Dict):
            keys = {k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            spread = [
                v.id
                for k, v in zip(value.keys, value.values, strict=True)
                if k is None and isinstance(v, ast.Name)
            ]
            tables[target.id] = keys | {a for name in spread for a in tables.get(name, set())}
    return sorted(tables.get("_RBLN_SUPPORTED_MODELS", set()))


def _read_or_empty(path: Path) -> str:
    try:
        return _read(path)
    except OSError:
        return ""


def compile_only_readers(src: Sources) -> list[str]:
    """vllm-rbln files that read VLLM_RBLN_COMPILE_ONLY (envs.py defines it): where compile-only acts."""
    root = src.rbln / "vllm_rbln"
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.name != "envs.py" and "envs.VLLM_RBLN_COMPILE_ONLY" in _read(p)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--src", type=Path, default=DEFAULT_SRC, help=f"unpacked wheels (default {DEFAULT_SRC})"
    )
    parser.add_argument(
        "--release", action="append", help="a vllm-rbln version (default: every one under --src)"
    )
    parser.add_argument("--table", action="store_true", help="print each release's table as JSON")
    parser.add_argument("--write", type=Path, metavar="DIR", help="write DIR/vllm-rbln-<release>.json")
    args = parser.parse_args(argv)
    status = 0
    for release in args.release or releases_in(args.src):
        src = sources(args.src, release)
        table = release_table(src)
        if args.write:
            args.write.mkdir(parents=True, exist_ok=True)
            out = args.write / f"vllm-rbln-{release}.json"
            out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            print(f"wrote {out}")
        elif args.table:
            print(json.dumps(table, indent=1, sort_keys=True))
        unknown = [n for n, e in table["env"].items() if e["kind"] == "unknown"]
        for name in unknown:
            print(f"UNKNOWN PARSER {release} {name}: {table['env'][name]['code']}", file=sys.stderr)
        status |= 1 if unknown else 0
        if release != "0.12.0":
            continue
        found, missing = derive(src)
        if not (args.table or args.write):
            for item in found:
                print(item)
            print(f"VLLM_RBLN_COMPILE_ONLY is read in: {', '.join(compile_only_readers(src))}")
        for line in missing:
            print(f"MISSING {line}", file=sys.stderr)
        status |= 1 if missing else 0
    return status


if __name__ == "__main__":
    raise SystemExit(main())
