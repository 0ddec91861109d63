"""The generated `vllm serve` option table: well-known entries, internal consistency, freshness."""

import subprocess
import sys
from pathlib import Path

import pytest

from cachemgr.key import vllm_flags as vf

REPO = Path(__file__).resolve().parent.parent
GENERATOR = REPO / "tools" / "gen_vllm_flags.py"
VLLM_WHEEL = Path("/tmp/wheels/vllmwhl/vllm-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl")
VLLM_RBLN_WHEEL = Path("/tmp/wheels/vllm_rbln-0.12.0-py3-none-any.whl")
INTROSPECTION_PYTHON = Path("/tmp/vllm-introspect/bin/python")

ARITIES = {"0", "1", "?", "+", "*"}


def test_versions() -> None:
    assert vf.VLLM_VERSION == "0.30.0"
    assert vf.VLLM_RBLN_VERSION == "0.12.0"


def test_well_known_value_flags() -> None:
    assert vf.FLAGS["tensor-parallel-size"] == "1"
    assert vf.ALIASES["-tp"] == "tensor-parallel-size"
    assert vf.ALIASES["-pp"] == "pipeline-parallel-size"
    assert vf.ALIASES["-q"] == "quantization"
    assert vf.FLAGS["max-model-len"] == "1"
    assert vf.FLAGS["served-model-name"] == "+"
    assert vf.FLAGS["hf-token"] == "?"
    assert vf.FLAGS["model"] == "1"
    assert vf.FLAGS["config"] == "1"
    assert vf.FLAGS["optimization-level"] == "1"
    # -O is a rewrite done by FlexibleArgumentParser.parse_args, not an option string.
    assert "-O" not in vf.ALIASES


def test_well_known_switches() -> None:
    assert vf.FLAGS["enforce-eager"] == "0"
    assert "enforce-eager" in vf.NEGATABLE
    assert vf.FLAGS["headless"] == "0"
    assert "headless" not in vf.NEGATABLE  # store_true: there is no --no-headless
    assert vf.FLAGS["help"] == "0"
    assert vf.ALIASES["-h"] == "help"


def test_json_flags() -> None:
    for name in ("additional-config", "compilation-config", "speculative-config", "kv-transfer-config"):
        assert name in vf.JSON_FLAGS, name
        assert vf.FLAGS[name] == "1", name
    assert vf.ALIASES["-cc"] == "compilation-config"
    assert "additional-config" in vf.JSON_OR_STR_FLAGS
    assert "tensor-parallel-size" not in vf.JSON_FLAGS


def test_rbln_flags() -> None:
    assert vf.RBLN_FLAGS["rbln-use-w8a8"] == "use_w8a8"
    assert vf.FLAGS["rbln-use-w8a8"] == "0"
    assert "rbln-use-w8a8" in vf.NEGATABLE
    assert vf.FLAGS["rbln-decode-batch-bucket-manual-buckets"] == "+"
    assert vf.FLAGS["rbln-num-devices-per-local-rank"] == "1"
    # no_flag / derived fields get no flag
    for key in ("user_max_num_batched_tokens", "num_blocks_override", "cached_model_path"):
        assert key not in vf.RBLN_FLAGS.values()


def test_table_is_consistent() -> None:
    assert set(vf.FLAGS.values()) <= ARITIES
    for name in vf.FLAGS:
        assert name == name.strip(), name
        assert not name.startswith("-"), name
        assert "_" not in name, name
    assert set(vf.ALIASES.values()) <= set(vf.FLAGS)
    assert all(alias.startswith("-") for alias in vf.ALIASES)
    assert all(vf.FLAGS[name] == "0" for name in vf.NEGATABLE)
    assert all(vf.FLAGS[name] != "0" for name in vf.JSON_FLAGS)
    assert vf.JSON_OR_STR_FLAGS <= vf.JSON_FLAGS
    assert vf.APPEND_FLAGS.issubset(vf.FLAGS)
    assert set(vf.RBLN_FLAGS) == {name for name in vf.FLAGS if name.startswith("rbln-")}
    for name, key in vf.RBLN_FLAGS.items():
        assert name == "rbln-" + key.replace("_", "-")
    # Every option string names one option.
    strings = [f"--{n}" for n in vf.FLAGS] + [f"--no-{n}" for n in vf.NEGATABLE] + list(vf.ALIASES)
    assert len(strings) == len(set(strings))


def test_table_is_sorted() -> None:
    for table in (vf.FLAGS, vf.ALIASES, vf.RBLN_FLAGS):
        assert list(table) == sorted(table)


def test_generator_check_reports_up_to_date() -> None:
    missing = [p for p in (VLLM_WHEEL, VLLM_RBLN_WHEEL, INTROSPECTION_PYTHON) if not p.exists()]
    if missing:
        pytest.skip(
            f"needs the vLLM/vllm-rbln wheels and the introspection venv, absent here: {missing}; "
            "see tools/gen_vllm_flags.py (CI has none of them)"
        )
    proc = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "is up to date" in proc.stdout
