"""The facts the vllm strategy rests on, re-read from the real vllm-rbln / optimum-rbln / vLLM code.

tools/rbln_facts.py finds each one in the unpacked wheels (/tmp/wheels/src; CI has none, so these
tests skip there). They fail when a fact moves or changes: the cited line numbers in cachemgr's
comments (pinned in LINES) or the values cachemgr and its stand-in assume. A new SDK release: read
the diff around the fact, update cachemgr and the stand-in, then the citations and LINES.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import cachemgr_standin as standin
import pytest

from cachemgr.key import npu, vllm_rbln
from cachemgr.runtime import loadable

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "rbln_facts.py"
SRC = Path("/tmp/wheels/src")

pytestmark = pytest.mark.skipif(
    not (SRC / "vllm_rbln").is_dir(),
    reason=f"the unpacked wheels are absent ({SRC}); see tools/rbln_facts.py for how to get them",
)

# Where each fact is, as cachemgr's comments cite it (file:line of the match's first line).
LINES = {
    "vllm_pin": 229,
    "vllm_rbln_version": 3,
    "optimum_rbln_version": 3,
    "compute_hash_version": 481,
    "signature_compute_hash": 129,
    "signature_parts": 146,
    "signature_npu": 74,
    "npu_order": 141,
    "device_nodes": 189,
    "device_node_names": 282,
    "optimum_name_no_version": 78,
    "optimum_name_model": 63,
    "optimum_cache_dir": 116,
    "compiled_dir_test": 22,
    "rbln_config_name": 16,
    "model_redirect": 558,
    "model_redirect_table": 101,
    "warmup_skip": 380,
    "warmup_skipped_in_worker": 512,
    "warmup_default": 212,
    "save_after_warmup": 3645,
    "load_disabled": 182,
    "save_disabled": 206,
    "disable_cache_parse": 364,
    "save_failure_logged": 241,
    "bundle_resave": 214,
    "bundle_path": 169,
    "modelinfos": 963,
    "model_impl_aliases": 321,
    "compile_only_vllm_path": 127,
    "optimum_runtimes_default": 1138,
    "optimum_device_check": 520,
    "optimum_tmpdir": 146,
    "optimum_save_copy": 681,
    "optimum_save_called": 273,
}


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rbln_facts", TOOL)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["rbln_facts"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def facts() -> dict[str, str]:
    found, missing = _tool().derive(SRC)
    assert not missing, missing
    lines = {f.fact.name: f.line for f in found}
    assert lines == LINES, "a fact moved: re-read it and update the citations in cachemgr, then LINES"
    return {f.fact.name: f.value for f in found}


def test_the_tool_finds_every_fact() -> None:
    done = subprocess.run(
        [sys.executable, str(TOOL), "--src", str(SRC)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "compute_hash_version" in done.stdout


def test_versions_the_stand_in_declares_are_the_pinned_ones(facts: dict[str, str]) -> None:
    assert facts["vllm_pin"] == standin.VLLM_VERSION == "0.30.0+cpu"
    assert facts["vllm_rbln_version"] == standin.VLLM_RBLN_VERSION
    assert facts["optimum_rbln_version"] == standin.OPTIMUM_RBLN_VERSION
    assert facts["compute_hash_version"] == "__version__"
    assert "cfg" in facts["signature_parts"]
    assert facts["signature_compute_hash"] == "vllm_config.compute_hash()"


def test_npu_order_is_the_servers(facts: dict[str, str]) -> None:
    order = re.findall(r'"([A-Z_]+)"', facts["npu_order"])
    assert facts["npu_order"].startswith("rebel.get_npu_name(device_id)")
    assert tuple(order) == npu.SERVER_SETTINGS
    assert '"unknown"' in facts["signature_npu"]  # the raw name, never normalized
    assert facts["device_nodes"] == 'RBLN_DEV_DIR = "/dev"'


def test_loadable_artifacts_are_named_as_the_server_names_them(facts: dict[str, str]) -> None:
    assert facts["rbln_config_name"] == loadable.RBLN_CONFIG
    assert facts["bundle_path"] == loadable.BUNDLE
    assert facts["optimum_cache_dir"] == '"compiled_models"'
    assert facts["modelinfos"] == "modelinfos"


def test_what_is_never_saved(facts: dict[str, str]) -> None:
    assert facts["warmup_skip"] == "envs.VLLM_RBLN_ENABLE_WARM_UP"
    # The same parse as vllm-rbln's envs.py: anything but true/1 turns warm-up off.
    for value, off in (("True", False), ("1", False), ("true", False), ("0", True), ("no", True), ("", True)):
        reasons = vllm_rbln.never_saved({}, {"VLLM_RBLN_ENABLE_WARM_UP": value})
        assert bool(reasons) == off, value
    assert facts["disable_cache_parse"] == 'bool(int(os.getenv("VLLM_DISABLE_COMPILE_CACHE", "0")))'
    assert vllm_rbln.never_saved({}, {"VLLM_DISABLE_COMPILE_CACHE": "2"})
    assert not vllm_rbln.never_saved({}, {"VLLM_DISABLE_COMPILE_CACHE": "0"})


def test_model_impl_aliases_match(facts: dict[str, str]) -> None:
    text = (SRC / "vllm_rbln/vllm_rbln/config.py").read_text(encoding="utf-8")
    block = re.search(r"_MODEL_IMPL_ALIASES: dict\[str, ModelImpl \| None\] = (\{.*?\n\})", text, re.DOTALL)
    assert block is not None
    theirs = ast.literal_eval(block.group(1))
    assert {k: v or "auto" for k, v in theirs.items()} == vllm_rbln._MODEL_IMPL_ALIASES
    assert facts["model_impl_aliases"] == "transformers"


def test_compile_only_acts_on_the_vllm_model_path_only(facts: dict[str, str]) -> None:
    assert _tool().compile_only_readers(SRC) == ["compilation/compiler.py", "platform/vllm_impl.py"]
    assert facts["optimum_device_check"] == "tp_and_devices_are_ok"
    assert facts["optimum_runtimes_default"] == "True"
    assert facts["optimum_tmpdir"] == "TemporaryDirectory()"


def test_version_env_names_are_fixed() -> None:
    assert {env for _, env in vllm_rbln.VERSION_ENV.values()} == set(standin.DECLARED_VERSIONS)
    assert [dist for dist, _ in vllm_rbln.VERSION_ENV.values()] == ["vllm", "vllm-rbln", "optimum-rbln"]
