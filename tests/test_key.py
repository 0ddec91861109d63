"""The cache key: golden digests, invariance, sensitivity, and each input read as production reads it."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from podlib import run_cli

from cachemgr.errors import ConfigError, UsageError
from cachemgr.key import KeyRequest, canonical_json, compute_key, major_minor

BASE_ENV = {"CACHEMGR_COMPILER_VERSION": "0.12.3", "CACHEMGR_NPU_TYPE": "RBLN-CA25", "PATH": "/usr/bin:/bin"}
ARGV = ["vllm", "serve", "org/model", "--tensor-parallel-size", "4", "--port", "8000"]


def digest(
    argv: list[str] = ARGV, *, role: str = "prefill", env: Mapping[str, str] | None = None, **kw: Any
) -> str:
    environ = {**BASE_ENV, **(env or {})}
    return compute_key(KeyRequest(argv=argv, role=role, environ=environ, **kw)).digest


# --- golden digests: changing the derivation by accident must fail here --------------------

GOLDEN = {
    "hub model, tp 4": (ARGV, {}, "c74898ef20703223b0cf32e75d350003"),
    "hub model with revision and JSON config": (
        ["vllm", "serve", "org/model", "--revision", "abc123", "-tp", "8",
         "--additional-config", '{"num_devices_per_local_rank": 2}'],
        {},
        "9b315a08ac21f5bb83d6361e97d1607a",
    ),
    "decode role with compile env": (ARGV, {"role": "decode", "VLLM_RBLN_NUM_HIDDEN_LAYERS": "2"}, "bcd40665cbf0d916d430ee3209670ff7"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_digest(name: str) -> None:
    argv, extra, expected = GOLDEN[name]
    extra = dict(extra)
    role = extra.pop("role", "prefill")
    assert digest(argv, role=role, env=extra) == expected


def test_canonical_json_is_sorted_and_compact() -> None:
    assert canonical_json({"b": 1, "a": [1, {"d": 2, "c": 3}]}) == b'{"a":[1,{"c":3,"d":2}],"b":1}'


# --- invariance: what must not change the key -----------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["vllm", "serve", "org/model", "--tensor-parallel-size", "4", "--port", "9000"],
        ["vllm", "serve", "org/model", "--tensor_parallel_size=4"],
        ["vllm", "serve", "org/model", "-tp", "4"],
        [
            "vllm",
            "serve",
            "--port",
            "1234",
            "org/model",
            "-tp",
            "4",
            "--host",
            "0.0.0.0",
            "--api-key",
            "s3cret",
        ],
        ["/usr/local/bin/vllm", "serve", "org/model", "-tp", "4", "--served-model-name", "chat"],
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "org/model", "-tp", "4"],
    ],
)
def test_same_key_for_the_same_compile(argv: list[str]) -> None:
    assert digest(argv) == digest()


@pytest.mark.parametrize("version", ["0.12.0", "0.12.3", "0.12.0rc1", "0.12.1.dev4+gabc", "0.12"])
def test_patch_releases_share_the_cache(version: str) -> None:
    assert digest(env={"CACHEMGR_COMPILER_VERSION": version}) == digest()


def test_npu_type_is_case_insensitive_and_sourced_in_order() -> None:
    assert digest(env={"CACHEMGR_NPU_TYPE": "rbln-ca25"}) == digest()
    only_force = {k: v for k, v in BASE_ENV.items() if k != "CACHEMGR_NPU_TYPE"}
    key = compute_key(
        KeyRequest(argv=ARGV, role="prefill", environ={**only_force, "RBLN_FORCE_NPU_NAME": "RBLN-CA25"})
    )
    assert key.digest == digest()
    assert key.sources["npu"] == "RBLN_FORCE_NPU_NAME"


def test_runtime_only_vllm_rbln_env_does_not_count() -> None:
    assert digest(env={"VLLM_RBLN_COMPILE_ONLY": "1", "VLLM_RBLN_METRICS": "1", "UNRELATED": "x"}) == digest()


@settings(max_examples=60, deadline=None)
@given(
    port=st.integers(1024, 65535),
    host=st.sampled_from(["0.0.0.0", "127.0.0.1", "::"]),
    served=st.from_regex(r"[a-h][a-h-]{0,9}", fullmatch=True),
    order=st.permutations(["tp", "port", "host", "served"]),
    style=st.sampled_from(["space", "equals"]),
)
def test_runtime_flags_and_order_never_change_the_key(
    port: int, host: str, served: str, order: list[str], style: str
) -> None:
    flags = {
        "tp": ("--tensor-parallel-size", "4"),
        "port": ("--port", str(port)),
        "host": ("--host", host),
        "served": ("--served-model-name", served),
    }
    argv = ["vllm", "serve", "org/model"]
    for name in order:
        flag, value = flags[name]
        argv += [f"{flag}={value}"] if style == "equals" else [flag, value]
    assert digest(argv) == digest()


# --- sensitivity: every input changes the key -------------------------------------------------


@pytest.mark.parametrize(
    ("change", "kwargs"),
    [
        ("tensor parallel 8", {"argv": ["vllm", "serve", "org/model", "--tensor-parallel-size", "8"]}),
        ("compiler 0.13", {"env": {"CACHEMGR_COMPILER_VERSION": "0.13.0"}}),
        ("NPU RBLN-CA12", {"env": {"CACHEMGR_NPU_TYPE": "RBLN-CA12"}}),
        ("role decode", {"role": "decode"}),
        ("VLLM_RBLN_NUM_HIDDEN_LAYERS", {"env": {"VLLM_RBLN_NUM_HIDDEN_LAYERS": "2"}}),
        ("another model", {"argv": ["vllm", "serve", "org/other", "-tp", "4"]}),
        ("a pinned revision", {"argv": [*ARGV, "--revision", "main"]}),
        ("max model len", {"argv": [*ARGV, "--max-model-len", "8192"]}),
        ("an unknown flag", {"argv": [*ARGV, "--some-future-flag", "1"]}),
        ("key-env", {"key_env": ["MY_COMPILE_KNOB"], "env": {"MY_COMPILE_KNOB": "on"}}),
    ],
)
def test_each_input_changes_the_key(change: str, kwargs: dict[str, Any]) -> None:
    assert digest(**kwargs) != digest(), change


@settings(max_examples=40, deadline=None)
@given(a=st.integers(1, 64), b=st.integers(1, 64))
def test_distinct_compile_settings_never_collide(a: int, b: int) -> None:
    argv_a = ["vllm", "serve", "org/model", "--max-num-seqs", str(a)]
    argv_b = ["vllm", "serve", "org/model", "--max-num-seqs", str(b)]
    assert (digest(argv_a) == digest(argv_b)) == (a == b)


# --- inputs read as production reads them -----------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("0.12.3", "0.12"),
        ("0.12.0rc1", "0.12"),
        ("0.12.1.dev4+gabc", "0.12"),
        ("1", "1.0"),
        ("2.3.4.5", "2.3"),
    ],
)
def test_major_minor(raw: str, expected: str) -> None:
    assert major_minor(raw) == expected


def test_invalid_compiler_version_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not a version number"):
        major_minor("twelve")


def _fake_dist(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _env_without_overrides(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEMGR_", "RBLN_"))}
    return {**env, "CACHEMGR_ROLE": "prefill", "CACHEMGR_LOG_FORMAT": "json", **extra}


def test_compiler_version_comes_from_installed_package_metadata(tmp_path: Path) -> None:
    _fake_dist(tmp_path / "site", "rebel-compiler", "0.12.4")
    env = _env_without_overrides(PYTHONPATH=str(tmp_path / "site"), CACHEMGR_NPU_TYPE="RBLN-CA25")
    result = run_cli("key", "-o", "json", "--", *ARGV, env=env)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["inputs"]["compiler"] == "0.12"
    assert data["sources"]["compiler"] == "package rebel-compiler 0.12.4"


def test_without_compiler_the_key_exits_78_saying_what_to_set() -> None:
    result = run_cli("key", "--", *ARGV, env=_env_without_overrides(CACHEMGR_NPU_TYPE="RBLN-CA25"))
    assert result.returncode == 78
    lines = [line for line in result.stderr.splitlines() if line.startswith("cachemgr key:")]
    assert len(lines) == 1
    assert "CACHEMGR_COMPILER_VERSION" in lines[0]


def test_without_any_npu_source_the_key_exits_78_with_one_line(tmp_path: Path) -> None:
    env = _env_without_overrides(CACHEMGR_COMPILER_VERSION="0.12.3", PATH=str(tmp_path))
    result = run_cli("key", "--", *ARGV, env=env)
    assert result.returncode == 78
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("cachemgr key:")]
    assert "CACHEMGR_NPU_TYPE" in line
    assert "unknown" not in json.dumps(result.stdout)


def test_npu_type_is_read_from_the_rbln_driver_tool(tmp_path: Path) -> None:
    """A real executable on PATH printing what rbln-smi prints (table from docs.rbln.ai)."""
    tool = tmp_path / "bin" / "rbln-smi"
    tool.parent.mkdir()
    tool.write_text(
        "#!/bin/sh\ncat <<'EOF'\n"
        "| NPU |    Name   | Device  |   PCI BUS ID  | Temp |  Power  | Perf |  Memory(used/total) |  Util |\n"
        "| 0   | RBLN-CA25 | rbln0   |  0000:51:00.0 |  38C |  43.9W  | P2   |   2.4GB / 63.7GiB   |  98.7 |\n"
        "| 1   | RBLN-CA25 | rbln1   |  0000:d8:00.0 |  25C |   6.1W  | P14  |    0.0B / 63.7GiB   |   0.0 |\n"
        "EOF\n"
    )
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    environ = {"CACHEMGR_COMPILER_VERSION": "0.12.3", "PATH": f"{tool.parent}:/usr/bin:/bin"}
    key = compute_key(KeyRequest(argv=ARGV, role="prefill", environ=environ))
    assert key.inputs["npu"] == "RBLN-CA25"
    assert key.sources["npu"] == "rbln-smi"
    assert key.digest == digest()


def test_role_is_required() -> None:
    with pytest.raises(ConfigError, match="CACHEMGR_ROLE"):
        compute_key(KeyRequest(argv=ARGV, role=None, environ=BASE_ENV))


def test_non_vllm_server_needs_a_compile_command() -> None:
    with pytest.raises(UsageError, match="--strategy command"):
        compute_key(KeyRequest(argv=["my-server", "--port", "1"], role="prefill", environ=BASE_ENV))


def test_other_servers_are_keyed_on_their_argv_minus_runtime_flags() -> None:
    def other(*argv: str) -> str:
        request = KeyRequest(
            argv=list(argv),
            role="prefill",
            environ=BASE_ENV,
            strategy="command",
            compile_cmd="c --out {output_dir}",
        )
        return compute_key(request).digest

    assert other("srv", "--model", "m", "--port", "1") == other("srv", "--model", "m", "--port", "2")
    assert other("srv", "--model", "m") != other("srv", "--model", "n")


def _model_dir(path: Path, *, layers: int = 2, shard_bytes: int = 100) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"_name_or_path": str(path), "num_hidden_layers": layers}))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model.safetensors"}}))
    (path / "model.safetensors").write_bytes(b"w" * shard_bytes)
    return path


def test_local_model_is_keyed_by_content_not_by_mount_path(tmp_path: Path) -> None:
    one = _model_dir(tmp_path / "mnt-a" / "llm")
    two = _model_dir(tmp_path / "mnt-b" / "weights")
    other = _model_dir(tmp_path / "mnt-c" / "llm", layers=3)
    bigger = _model_dir(tmp_path / "mnt-d" / "llm", shard_bytes=200)
    command = {"strategy": "command", "compile_cmd": "optimum-rbln-cli --output-dir {output_dir}"}
    keys = {name: digest(["vllm", "serve", str(path), "-tp", "4"], **command) for name, path in
            (("one", one), ("two", two), ("other", other), ("bigger", bigger))}  # fmt: skip
    assert keys["one"] == keys["two"], "the same weights under another mount path hit"
    assert keys["other"] != keys["one"], "another config at the same path misses"
    assert keys["bigger"] != keys["one"], "other weights at the same path miss"


def test_vllm_strategy_keys_local_models_by_path_too(tmp_path: Path) -> None:
    """vllm-rbln names its own cache after the model path: another path would compile in the server."""
    one = _model_dir(tmp_path / "mnt-a" / "llm")
    two = _model_dir(tmp_path / "mnt-b" / "llm")
    assert digest(["vllm", "serve", str(one)]) != digest(["vllm", "serve", str(two)])
    assert digest(["vllm", "serve", str(one)]) == digest(["vllm", "serve", str(one), "--port", "1"])


def test_missing_local_model_path_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        digest(["vllm", "serve", str(tmp_path / "nope")])


def test_key_command_prints_key_and_inputs_as_json() -> None:
    env = {**os.environ, **BASE_ENV, "CACHEMGR_ROLE": "prefill", "PATH": os.environ["PATH"]}
    result = run_cli("key", "-o", "json", "--", *ARGV, env=env)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["key"] == digest()
    assert data["inputs"]["serving"] == {"tensor_parallel_size": 4}
    assert data["dropped_runtime_flags"] == ["port"]
    table = run_cli("key", "--", *ARGV, env=env)
    assert data["key"] in table.stdout
    assert "serving.tensor_parallel_size" in table.stdout
