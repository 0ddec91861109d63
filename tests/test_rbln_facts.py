"""The facts the vllm strategy rests on, re-read from the real vllm-rbln / optimum-rbln / vLLM code.

Two layers (tools/rbln_facts.py says how the wheels are fetched and unpacked):

- in CI, without wheels: each release of ``cachemgr.key.releases.KNOWN`` is held to the facts the
  tool derived from that release's wheels and that are checked in (tests/data/rbln_facts/), so a
  table entry cannot drift from the code it was read from, and a release that is not in the table
  is keyed strictly;
- where the wheels are unpacked (``CACHEMGR_RBLN_SRC``, default /tmp/wheels/src): the checked-in facts
  are re-derived and must be equal, every pinned fact is where cachemgr's comments cite it (LINES),
  and the real ``vllm_rbln.envs`` parses every variable as cachemgr's table does.

A new SDK release: docs/development.md, "Adding a release" (one manifest entry, tools/gen_rules.py
--src DIR, read the diff).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import cachemgr_standin as standin
import pytest

from cachemgr.key import npu, rbln_env, releases, vllm_rbln
from cachemgr.key.releases import KNOWN, STRICT, Release, release_for
from cachemgr.runtime import loadable

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "rbln_facts.py"
SNAPSHOTS = REPO / "tests" / "data" / "rbln_facts"
SRC = Path(os.environ.get("CACHEMGR_RBLN_SRC", "/tmp/wheels/src"))
wheels = pytest.mark.skipif(
    not (SRC / "vllm_rbln-0.12.0").is_dir(),
    reason=f"the unpacked wheels are absent ({SRC}); see tools/rbln_facts.py for how to get them",
)

# Where each pinned fact is, as cachemgr's comments cite it (file:line of the match's first line).
LINES = {
    "vllm_pin": 229, "vllm_rbln_version": 3, "optimum_rbln_version": 3, "transformers_pin": 37,
    "compute_hash_version": 481, "additional_config_hashed": 564, "additional_config_compute_hash": 568,
    "hf_config_hashed": 319, "signature_compute_hash": 129, "signature_parts": 146, "signature_draft_model": 105,
    "signature_npu": 74, "npu_order": 141, "model_impl_reset": 238, "mla_backend": 120, "mla_disable": 1927,
    "dp_from_env": 936, "dp_rank_dir": 834, "device_nodes": 189, "device_node_names": 282,
    "optimum_name_no_version": 78, "optimum_name_model": 63, "optimum_cache_dir": 116, "compiled_dir_test": 22,
    "rbln_config_name": 16, "compiled_graphs_named": 308, "compiled_graph_missing": 208,
    "compiled_model_default_name": 37, "submodule_folder": 178, "model_redirect": 558, "model_redirect_table": 101,
    "warmup_skip": 380, "warmup_skipped_in_worker": 512, "warmup_default": 212, "save_after_warmup": 3645,
    "load_disabled": 182, "save_disabled": 206, "disable_cache_parse": 364, "save_failure_logged": 241,
    "bundle_resave": 214, "bundle_path": 169, "modelinfos": 963, "model_impl_aliases": 321,
    "compile_only_vllm_path": 127, "optimum_runtimes_default": 1138, "optimum_device_check": 520,
    "optimum_tmpdir": 146, "optimum_save_copy": 681, "optimum_save_called": 273,
}  # fmt: skip
# OptimumRBLNConfig fields the server overwrites (not its `derived` metadata, but as good as): the
# platform writes the first from --max-num-batched-tokens (platform/__init__.py 249), the sync the
# second from the compiled artifact (converter/from_optimum.py 159). A given value never counts.
OVERWRITTEN = {"user_max_num_batched_tokens", "num_blocks_override"}


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rbln_facts", TOOL)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["rbln_facts"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def snapshot(release: Release) -> dict[str, Any]:
    """The facts the release's rules were generated from (a code-identical release's: its code's)."""
    data: dict[str, Any] = json.loads(
        (SNAPSHOTS / f"vllm-rbln-{release.same_code_as or release.versions['vllm_rbln']}.json").read_text()
    )
    return data


def _overrides(what: str) -> set[str]:
    with (REPO / "tools" / "releases" / "overrides.toml").open("rb") as handle:
        items = tomllib.load(handle)["override"]
    return {flag for item in items if item["what"] == what for flag in item["add"]}


# --- the table against the derived facts (CI) -------------------------------------------------------


@pytest.mark.quick
def test_every_checked_release_has_its_derived_facts_checked_in() -> None:
    names = sorted(p.name for p in SNAPSHOTS.glob("vllm-rbln-*.json"))
    assert names == sorted(f"vllm-rbln-{r.versions['vllm_rbln']}.json" for r in KNOWN)


@pytest.mark.quick
@pytest.mark.parametrize("release", KNOWN, ids=lambda r: r.name)
def test_the_release_table_says_what_the_code_says(release: Release) -> None:
    facts = snapshot(release)
    assert dict(release.versions) == facts["versions"] or release.same_code_as
    assert release.envs_xxh3 == facts["envs_xxh3"], "an installed envs.py equal to this file is the table"
    # every variable of envs.environment_variables, parsed as envs.py parses it
    assert set(release.env) == set(facts["env"])
    for name, var in release.env.items():
        fact = facts["env"][name]
        assert (var.kind, var.default) == (fact["kind"], fact["default"]), name
        if "reads" in fact:
            assert list(var.sources) == fact["reads"], name
    # what the bundle signature hashes (RBLN_COMPILE_ENV) is compiled on the vLLM-model path...
    hashed = {n for n, v in release.env.items() if "vllm" in v.compiled_on and v.field is None}
    if facts["rbln_compile_env"] is None:  # no partition to read (0.11.1): every variable counts there
        assert hashed == set(release.env)
        assert "vllm" not in release.checked, "a path with no signature to read is not a checked one"
    else:
        assert hashed == set(facts["rbln_compile_env"])
        # ...what is not, is compiled nowhere, or through the RBLNConfig field it sets
        assert {n for n in release.env if n not in hashed} == set(facts["rbln_non_compile_env"])
        assert {n for n, v in release.env.items() if not v.compiled_on} <= set(facts["rbln_non_compile_env"])
    # the optimum path compiles from what names its directory
    optimum_env = {n for n, v in release.env.items() if "optimum" in v.compiled_on and v.field is None}
    assert optimum_env == set(facts["optimum_name_env"])
    # the flags left out by reading are fields vLLM's config hashes ignore (those the key oracle found
    # by running the server are held by tests/test_oracle.py instead)
    ignored = facts["vllm_hash_ignored"]
    for flag in _overrides("runtime_flags"):
        assert flag.replace("-", "_") in ignored["ModelConfig"] + ignored["ParallelConfig"], flag
    assert "enable_prefix_caching" in ignored["CacheConfig"]
    # the server's defaults
    assert facts["platform_defaults"]["max_num_seqs"] in release.defaults["max_num_seqs"]
    gpu = {
        facts["vllm_gpu_memory_utilization_default"],
        facts["platform_defaults"].get("gpu_memory_utilization"),
    }
    assert set(release.defaults["gpu_memory_utilization"]) == gpu - {None}
    assert release.model_impl == facts["model_impl_rule"]
    assert (release.model_impl == "flag_then_env") == facts["model_impl_reset"]
    assert (release.additional_config == "fields") == bool(facts["rbln_config"])


@pytest.mark.quick
def test_the_rbln_fields_are_what_config_py_declares() -> None:
    release = releases.named("0.12.0")
    facts = snapshot(release)["rbln_config"]
    assert set(release.rbln_fields) == set(facts["fields"])
    for name, spec in release.rbln_fields.items():
        fact = facts["fields"][name]
        assert set(spec.classes) == set(fact["classes"]), name
        # RBLNConfig.compute_hash turns an unset use_dynamic_kv_cache into True (config.py 162-163)
        assert spec.default == (True if name == "use_dynamic_kv_cache" else fact["default"]), name
        derived = "derived" in fact.get("metadata", "") or name in OVERWRITTEN
        assert spec.derived == derived, name
        if "vllm" in spec.classes and not derived:
            assert ("vllm" in spec.compiled_on) == (name not in facts["hash_ignored"]), name
        # _env_source: the envs.py variable _env_overrides reads for the field, if envs.py has it
        attr = facts["env_name"].get(name, f"VLLM_RBLN_{name.upper()}")
        assert spec.env == (attr if attr in release.env else None), name
        if spec.env is not None:
            var = release.env[spec.env]
            assert var.field == name
            assert list(var.sources) == facts["env_probe"].get(name, [attr]) or var.kind == "num_devices", (
                name
            )
    assert {n for n, f in release.rbln_fields.items() if "optimum" in f.compiled_on} == set(
        snapshot(release)["optimum_name_fields"]
    )
    assert sorted(release.optimum_runtime_keys) == snapshot(release)["optimum_runtime_keys"]
    assert facts["renamed"] == {
        "optimum": {"rbln_config": "optimum_overrides", "prefix_block_size": "sub_block_size"}
    }


@pytest.mark.quick
def test_any_other_release_is_keyed_strictly() -> None:
    known = dict(releases.named("0.12.0").versions)
    assert release_for(known) is releases.named("0.12.0")
    for name, other in (
        ("vllm_rbln", "0.13.0"),
        ("optimum_rbln", "0.12.1"),
        ("vllm", "0.30.0"),
        ("vllm", "0.30.1+cpu"),
    ):
        assert release_for({**known, name: other}) is STRICT, (name, other)
    assert release_for({**known, "transformers": "9.9"}) is releases.named("0.12.0"), "not a server release"


@pytest.mark.quick
def test_the_stand_in_declares_the_pinned_versions() -> None:
    facts = snapshot(releases.named("0.12.0"))
    assert facts["versions"]["vllm"] == standin.VLLM_VERSION == "0.30.0+cpu"
    assert facts["versions"]["vllm_rbln"] == standin.VLLM_RBLN_VERSION
    assert facts["versions"]["optimum_rbln"] == standin.OPTIMUM_RBLN_VERSION
    assert facts["transformers_pin"] == standin.TRANSFORMERS_VERSION


@pytest.mark.quick
def test_version_env_names_are_fixed() -> None:
    assert {env for _, env in vllm_rbln.VERSION_ENV.values()} == set(standin.DECLARED_VERSIONS)
    assert [dist for dist, _ in vllm_rbln.VERSION_ENV.values()] == [
        "vllm",
        "vllm-rbln",
        "optimum-rbln",
        "transformers",
    ]


# --- the facts against the wheels ------------------------------------------------------------------


@pytest.fixture(scope="module")
def facts() -> dict[str, str]:
    tool = _tool()
    found, missing = tool.derive(tool.sources(SRC, "0.12.0"))
    assert not missing, missing
    lines = {f.fact.name: f.line for f in found}
    assert lines == LINES, "a fact moved: re-read it and update the citations in cachemgr, then LINES"
    return {f.fact.name: f.value for f in found}


@wheels
@pytest.mark.parametrize("release", KNOWN, ids=lambda r: r.name)
def test_the_checked_in_facts_are_the_wheels(release: Release) -> None:
    if release.same_code_as:
        pytest.skip("its facts are its wheel's RECORD against its code's: tools/gen_rules.py --check")
    tool = _tool()
    derived = tool.release_table(tool.sources(SRC, release.versions["vllm_rbln"]))
    assert json.loads(json.dumps(derived)) == snapshot(release), (
        "re-run tools/rbln_facts.py --write and read the diff"
    )


@wheels
def test_the_tool_finds_every_fact() -> None:
    done = subprocess.run(
        [sys.executable, str(TOOL), "--src", str(SRC)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "compute_hash_version" in done.stdout


@wheels
def test_versions_the_stand_in_declares_are_the_pinned_ones(facts: dict[str, str]) -> None:
    assert facts["vllm_pin"] == standin.VLLM_VERSION == "0.30.0+cpu"
    assert facts["transformers_pin"] == standin.TRANSFORMERS_VERSION
    assert facts["compute_hash_version"] == "__version__"
    assert "cfg" in facts["signature_parts"]
    assert facts["signature_compute_hash"] == "vllm_config.compute_hash()"
    assert facts["signature_draft_model"] == "draft.compute_hash()"


@wheels
def test_npu_order_is_the_servers(facts: dict[str, str]) -> None:
    order = re.findall(r'"([A-Z_]+)"', facts["npu_order"])
    assert facts["npu_order"].startswith("rebel.get_npu_name(device_id)")
    assert tuple(order) == npu.SERVER_SETTINGS
    assert '"unknown"' in facts["signature_npu"]  # the raw name, never normalized
    assert facts["device_nodes"] == 'RBLN_DEV_DIR = "/dev"'


@wheels
def test_loadable_artifacts_are_named_as_the_server_names_them(facts: dict[str, str]) -> None:
    assert facts["rbln_config_name"] == loadable.RBLN_CONFIG
    assert facts["bundle_path"] == loadable.BUNDLE
    assert facts["compiled_model_default_name"] == loadable.COMPILED_MODEL_NAME
    assert facts["compiled_graph_missing"] == "FileNotFoundError"
    assert facts["optimum_cache_dir"] == '"compiled_models"'
    assert facts["modelinfos"] == "modelinfos"


@wheels
def test_what_is_never_saved(facts: dict[str, str]) -> None:
    assert facts["warmup_skip"] == "envs.VLLM_RBLN_ENABLE_WARM_UP"
    # The same parse as vllm-rbln's envs.py: anything but true/1 turns warm-up off.
    for value, off in (("True", False), ("1", False), ("true", False), ("0", True), ("no", True), ("", True)):
        reasons = vllm_rbln.never_saved({}, {"VLLM_RBLN_ENABLE_WARM_UP": value})
        assert bool(reasons) == off, value
    assert facts["disable_cache_parse"] == 'bool(int(os.getenv("VLLM_DISABLE_COMPILE_CACHE", "0")))'
    assert vllm_rbln.never_saved({}, {"VLLM_DISABLE_COMPILE_CACHE": "2"})
    assert not vllm_rbln.never_saved({}, {"VLLM_DISABLE_COMPILE_CACHE": "0"})


@wheels
def test_model_impl_aliases_match(facts: dict[str, str]) -> None:
    text = (SRC / "vllm_rbln-0.12.0/vllm_rbln/config.py").read_text(encoding="utf-8")
    block = re.search(r"_MODEL_IMPL_ALIASES: dict\[str, ModelImpl \| None\] = (\{.*?\n\})", text, re.DOTALL)
    assert block is not None
    theirs = ast.literal_eval(block.group(1))
    assert {k: v or "auto" for k, v in theirs.items()} == vllm_rbln._MODEL_IMPL_ALIASES
    assert facts["model_impl_aliases"] == "transformers"


@wheels
def test_compile_only_acts_on_the_vllm_model_path_only(facts: dict[str, str]) -> None:
    tool = _tool()
    assert tool.compile_only_readers(tool.sources(SRC, "0.12.0")) == [
        "compilation/compiler.py",
        "platform/vllm_impl.py",
    ]
    assert facts["optimum_device_check"] == "tp_and_devices_are_ok"
    assert facts["optimum_runtimes_default"] == "True"
    assert facts["optimum_tmpdir"] == "TemporaryDirectory()"


# A value of every shape each kind of parser meets: set, unset, empty, spelled otherwise, refused.
SAMPLES: dict[str, list[str | None]] = {
    "bool": [None, "1", "0", "true", "TRUE", "True", "false", "yes", "", " 1"],
    "int": [None, "0", "2", "02", " 3", "+4", "x", ""],
    "str": [None, "", "a b"],
    "opt_int": [None, "", "4", "x"],
    "int_list": [None, "1,2", "2, 1", "0", "1,1", "x", ""],
    "bucket_strategy": [None, "exp", "EXP", "linear", "manual", "bad"],
    "num_devices": [None, "2", "x"],
    "auto_port": [None, "1", "0"],
    "w8a16": ["1", "0", "TRUE"],  # unset, it asks the platform (imports vllm): keyed as the NPU decides
}


def _envs_module(release: str) -> Any:
    """The release's envs.py executed as the tool executes it: without its imports of vLLM (0.11.1
    imports vLLM's table to merge it), every other line its own."""
    return _tool().envs_namespace(SRC / f"vllm_rbln-{release}" / "vllm_rbln" / "envs.py", {})


@wheels
@pytest.mark.parametrize("release", KNOWN, ids=lambda r: r.name)
def test_the_real_envs_module_parses_as_the_table(release: Release) -> None:
    """Every variable, every sample value: the real envs.py function, run on that environment, and
    cachemgr's parse agree (or both refuse: the server fails, the key says unparsed)."""
    module = _envs_module(release.versions["vllm_rbln"])
    assert set(module.environment_variables) == set(release.env)
    assert set(getattr(module, "RBLN_COMPILE_ENV", release.env)) == {
        n for n, v in release.env.items() if "vllm" in v.compiled_on and v.field is None
    }
    for name, var in release.env.items():
        for value in SAMPLES[var.kind]:
            for other in [None, "3"] if len(var.sources) > 1 else [None]:
                environ = {} if value is None else {var.sources[0]: value}
                if other is not None:
                    environ[var.sources[1]] = other
                if var.kind == "num_devices" and not release.rbln_fields and other is not None:
                    continue  # 0.11 logs a deprecation through vllm there
                ours = rbln_env.parse(var, environ, npu="RBLN-CA25")
                try:
                    theirs = _rehomed_with_helpers(module, name)(environ)
                except ValueError:
                    assert isinstance(ours, dict), (name, environ, ours)
                    assert "$unparsed" in ours, (name, environ, ours)
                    continue
                assert ours == theirs, (name, environ)


def _rehomed_with_helpers(module: Any, name: str) -> Any:
    """The module's function for ``name`` with ``os.environ`` being the given mapping, helpers included."""

    def run(environ: dict[str, str]) -> Any:
        import types

        scope = dict(vars(module))
        scope["os"] = types.SimpleNamespace(environ=environ, getenv=environ.get)
        for key, value in list(scope.items()):
            if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
                scope[key] = types.FunctionType(value.__code__, scope, value.__name__, value.__defaults__)
        fn = module.environment_variables[name]
        return types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)()

    return run


@wheels
def test_the_real_vllm_rbln_installed_is_read_as_the_table(tmp_path: Path) -> None:
    """The modelserver image: vllm-rbln 0.12.0 on sys.path. Its envs.py is the checked file: same key."""
    from cachemgr_testkit.podlib import run_cli

    env = {
        "PATH": os.environ["PATH"], "HOME": str(tmp_path), "CACHEMGR_ROLE": "prefill",
        "CACHEMGR_COMPILER_VERSION": "0.12.3", "CACHEMGR_NPU_TYPE": "RBLN-CA25", **standin.DECLARED_VERSIONS,
    }  # fmt: skip
    argv = ["vllm", "serve", "org/model", "-tp", "4", "--port", "8000"]
    plain = run_cli("key", "-o", "json", "--", *argv, env=env)
    image = run_cli(
        "key", "-o", "json", "--", *argv, env={**env, "PYTHONPATH": str(SRC / "vllm_rbln-0.12.0")}
    )
    assert plain.returncode == image.returncode == 0, (plain.stderr, image.stderr)
    assert json.loads(image.stdout)["sources"]["env"].endswith("the checked vllm-rbln 0.12.0 file")
    assert json.loads(image.stdout)["key"] == json.loads(plain.stdout)["key"]


@wheels
def test_auto_takes_the_optimum_path_for_the_architectures_optimum_rbln_implements() -> None:
    """The table's architectures are the registry's (vllm_rbln/utils/optimum/registry.py), read by
    the release's own code: every _RBLN_*_MODELS dict merged into _RBLN_SUPPORTED_MODELS."""
    registry = SRC / "vllm_rbln-0.12.0" / "vllm_rbln" / "utils" / "optimum" / "registry.py"
    tree = ast.parse(registry.read_text())
    tables: dict[str, set[str]] = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Dict):
            keys = {k.value for k in value.keys if isinstance(k, ast.Constant)}
            spread = [
                v.id
                for k, v in zip(value.keys, value.values, strict=True)
                if k is None and isinstance(v, ast.Name)
            ]
            tables[target.id] = keys | {a for name in spread for a in tables.get(name, set())}
    assert tables["_RBLN_SUPPORTED_MODELS"] == set(releases.named("0.12.0").optimum_architectures)


# --- probe, do not branch: a release of another shape -----------------------------------------------

# The shape of vllm-rbln 0.11.1's envs.py: it imports vLLM, merges vLLM's own table into its own, has
# no RBLN_COMPILE_ENV partition, and VLLM_RBLN_AUTO_PORT follows a device-tensor default of False.
_ENVS_0_11_1_SHAPE = """\
import os
from vllm.envs import environment_variables as vllm_envs
from vllm_rbln.logger import init_logger
logger = init_logger(__name__)


def use_auto_port() -> bool:
    raw = os.environ.get("VLLM_RBLN_AUTO_PORT")
    if raw is not None:
        return raw.lower() in ("true", "1")
    return os.environ.get("VLLM_RBLN_USE_DEVICE_TENSOR", "False").lower() in ("true", "1")


def get_use_w8a16() -> bool:
    from vllm.platforms import current_platform
    return current_platform.get_device_name() != "RBLN-CR13"


environment_variables = {
    **vllm_envs,
    "VLLM_RBLN_USE_DEVICE_TENSOR": (
        lambda: os.environ.get("VLLM_RBLN_USE_DEVICE_TENSOR", "False").lower() in ("true", "1")
    ),
    "VLLM_RBLN_AUTO_PORT": use_auto_port,
    "VLLM_RBLN_USE_W8A16": get_use_w8a16,
}
vllm_envs.update(environment_variables)
"""


@pytest.mark.quick
def test_the_facts_of_a_merged_table_without_partitions_come_from_executing_it(tmp_path: Path) -> None:
    """rbln_facts crashed on 0.11.1's table (a ``**`` entry has no key) and wrote AUTO_PORT's default
    as True from a hard-coded copy; each default is now what the entry returns, run without vLLM."""
    tool = _tool()
    rbln = tmp_path / "vllm_rbln-9.9.9"
    (rbln / "vllm_rbln").mkdir(parents=True)
    (rbln / "vllm_rbln" / "envs.py").write_text(_ENVS_0_11_1_SHAPE)
    table = tool.env_table(tool.Sources(rbln, tmp_path / "o", tmp_path / "v"))
    assert table["merged"] == ["vllm_envs"]
    assert table["rbln_compile_env"] is None
    assert table["rbln_non_compile_env"] is None
    assert table["env"]["VLLM_RBLN_AUTO_PORT"]["kind"] == "auto_port"
    assert table["env"]["VLLM_RBLN_AUTO_PORT"]["default"] is False
    assert table["env"]["VLLM_RBLN_USE_DEVICE_TENSOR"]["default"] is False
    assert table["env"]["VLLM_RBLN_USE_W8A16"]["default"] is None, "it asks the platform: no default alone"
    assert "vllm" not in sys.modules or not hasattr(sys.modules["vllm"], "envs")


@pytest.mark.quick
def test_auto_port_follows_the_releases_own_device_tensor_default() -> None:
    """key/rbln_env.py read an unset VLLM_RBLN_USE_DEVICE_TENSOR as True in every release."""
    sources = ("VLLM_RBLN_AUTO_PORT", "VLLM_RBLN_USE_DEVICE_TENSOR")
    off = releases.EnvVar("VLLM_RBLN_AUTO_PORT", "auto_port", False, reads=sources)
    on = releases.EnvVar("VLLM_RBLN_AUTO_PORT", "auto_port", True, reads=sources)
    assert rbln_env.parse(off, {}) is False
    assert rbln_env.parse(on, {}) is True
    assert rbln_env.parse(off, {"VLLM_RBLN_USE_DEVICE_TENSOR": "1"}) is True
    assert rbln_env.parse(on, {"VLLM_RBLN_AUTO_PORT": "0"}) is False
    assert releases.named("0.11.1").env["VLLM_RBLN_AUTO_PORT"].default is False
    assert releases.named("0.12.0").env["VLLM_RBLN_AUTO_PORT"].default is True
