"""The cache key: golden digests, invariance, sensitivity, and each input read as production reads it."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import cachemgr_standin as standin
import pytest
from cachemgr_standin import DECLARED_VERSIONS
from cachemgr_testkit.podlib import error_lines, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from cachemgr.core.errors import ConfigError, UsageError
from cachemgr.key.cachekey import KeyRequest, canonical_json, compute_key, major_minor

BASE_ENV = {
    "CACHEMGR_COMPILER_VERSION": "0.12.3",
    "CACHEMGR_NPU_TYPE": "RBLN-CA25",
    "PATH": "/usr/bin:/bin",
    "HF_HUB_CACHE": "/nonexistent/hf-cache",  # no snapshot to resolve, whatever this machine holds
    **DECLARED_VERSIONS,
}
ARGV = ["vllm", "serve", "org/model", "--tensor-parallel-size", "4", "--port", "8000"]


def digest(
    argv: list[str] = ARGV, *, role: str = "prefill", env: Mapping[str, str] | None = None, **kw: Any
) -> str:
    environ = {**BASE_ENV, **(env or {})}
    return compute_key(KeyRequest(argv=argv, role=role, environ=environ, **kw)).digest


# --- golden digests: changing the derivation by accident must fail here --------------------

# The vllm strategy's digests changed on purpose when the server's versions entered the key
# (issue 13): vllm-rbln's bundle signature hashes vllm.__version__. The command strategy's did not.
# They changed again with the per-release rules (issue 23): every vllm-strategy key now holds the
# rules it was made by, the model path, the transformers version and a hub model's snapshot;
# variables are keyed parsed ("2" is 2) and RBLN options as resolved fields (the JSON config's
# num_devices_per_local_rank moved from serving.additional_config to rbln). The command strategy's
# did not change.
GOLDEN = {
    "hub model, tp 4": (ARGV, {}, "23c48a2e08a5bd0afad133940e384bce"),
    "hub model with revision and JSON config": (
        ["vllm", "serve", "org/model", "--revision", "abc123", "-tp", "8",
         "--additional-config", '{"num_devices_per_local_rank": 2}'],
        {},
        "dc9d296a2e7d3c60c7595094c0df5be1",
    ),
    "decode role with compile env": (ARGV, {"role": "decode", "VLLM_RBLN_NUM_HIDDEN_LAYERS": "2"}, "ea9678ead2df64837ca9e2deacb2e6fd"),
    "an RBLN option from the environment": (ARGV, {"RBLN_USE_CUSTOM_KERNEL": "1"}, "679d581423e932b81b1765e1e35ead13"),
    "an unknown flag": ([*ARGV, "--future-flag", "3"], {}, "cdfeaa739ac2e3afddb756d3272a5ed7"),
    "vllm-rbln 0.11.2": (ARGV, {"CACHEMGR_VLLM_VERSION": "0.24.0+cpu", "CACHEMGR_VLLM_RBLN_VERSION": "0.11.2",
                                "CACHEMGR_OPTIMUM_RBLN_VERSION": "0.11.2", "VLLM_RBLN_FLASH_CAUSAL_ATTN": "0"},
                         "d8498a47573921217457c916d3eb672a"),
    "a release not checked (strict)": (ARGV, {"CACHEMGR_VLLM_RBLN_VERSION": "0.13.0", "VLLM_RBLN_X": "1"},
                                       "0c4100c50059b2733aca80dd56876337"),
}  # fmt: skip


@pytest.mark.quick
def test_golden_digest_of_the_command_strategy_is_unchanged() -> None:
    """The same digest as before the server versions entered the vllm strategy's key."""
    command = {
        "strategy": "command",
        "compile_cmd": "optimum-rbln-cli --model org/model --output-dir {output_dir}",
    }
    assert (
        digest(["vllm", "serve", "{artifact_dir}", "--port", "8000"], **command)
        == "34ad2721666f47749e72bd1bd7698464"
    )


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_digest(name: str) -> None:
    argv, extra, expected = GOLDEN[name]
    extra = dict(extra)
    role = extra.pop("role", "prefill")
    assert digest(argv, role=role, env=extra) == expected


@pytest.mark.quick
def test_canonical_json_is_sorted_and_compact() -> None:
    assert canonical_json({"b": 1, "a": [1, {"d": 2, "c": 3}]}) == b'{"a":[1,{"c":3,"d":2}],"b":1}'


# --- invariance: what must not change the key -----------------------------------------------


@pytest.mark.quick
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


@pytest.mark.quick
@pytest.mark.parametrize("version", ["0.12.0", "0.12.3", "0.12.0rc1", "0.12.1.dev4+gabc", "0.12"])
def test_patch_releases_share_the_cache(version: str) -> None:
    assert digest(env={"CACHEMGR_COMPILER_VERSION": version}) == digest()


@pytest.mark.quick
def test_npu_type_is_keyed_as_the_server_names_it() -> None:
    """No device: RBLN_FORCE_NPU_NAME decides, raw, as vllm-rbln hashes it (mega_cache.py 143-146)."""
    only_force = {k: v for k, v in BASE_ENV.items() if k != "CACHEMGR_NPU_TYPE"}
    key = compute_key(
        KeyRequest(argv=ARGV, role="prefill", environ={**only_force, "RBLN_FORCE_NPU_NAME": "RBLN-CA25"})
    )
    assert key.digest == digest()
    assert key.sources["npu"] == "RBLN_FORCE_NPU_NAME"
    both = digest(env={"CACHEMGR_NPU_TYPE": "RBLN-CA25", "RBLN_FORCE_NPU_NAME": "RBLN-CA25"})
    assert both == digest()
    legacy = {**only_force, "RBLN_TARGET_SOC": "RBLN-CA25"}
    assert (
        compute_key(KeyRequest(argv=ARGV, role="prefill", environ=legacy)).sources["npu"] == "RBLN_TARGET_SOC"
    )


@pytest.mark.quick
@pytest.mark.parametrize(
    ("setting", "value", "said"),
    [
        (
            "CACHEMGR_NPU_TYPE",
            "rbln-ca25",
            r"CACHEMGR_NPU_TYPE='rbln-ca25' is not written as RBLN names the NPU \(RBLN-CA25\)",
        ),
        (
            "RBLN_FORCE_NPU_NAME",
            " RBLN-CA25",
            r"RBLN_FORCE_NPU_NAME=' RBLN-CA25' is not written as RBLN names",
        ),
        ("CACHEMGR_NPU_TYPE", "CA25", r"CACHEMGR_NPU_TYPE='CA25' is not an NPU name"),
        ("RBLN_FORCE_NPU_NAME", "RBLN-CA25\x1b[2J", r"'RBLN-CA25\\x1b\[2J' is not an NPU name"),
    ],
)
def test_an_npu_name_written_otherwise_than_rbln_writes_it_is_refused(
    setting: str, value: str, said: str
) -> None:
    """vllm-rbln hashes the name as written (mega_cache.py 143-146) but picks the NPU family from it
    upper-cased and stripped (platform/__init__.py 155-161): " RBLN-CA25" or "rbln-ca25" would compile
    for a CA25 under a signature no pod that writes RBLN-CA25 has. Refused (78), naming the setting,
    the chart value, and the right name; nothing from the setting reaches the terminal raw."""
    env = {k: v for k, v in BASE_ENV.items() if k != "CACHEMGR_NPU_TYPE"} | {setting: value}
    with pytest.raises(ConfigError, match=said) as refused:
        compute_key(KeyRequest(argv=ARGV, role="prefill", environ=env))
    assert "npu.type" in refused.value.remedy
    assert "\x1b" not in str(refused.value)


@pytest.mark.quick
def test_npu_settings_that_disagree_are_an_error() -> None:
    with pytest.raises(ConfigError, match=r"CACHEMGR_NPU_TYPE=RBLN-CA12 disagrees.*RBLN-CA25"):
        digest(env={"CACHEMGR_NPU_TYPE": "RBLN-CA12", "RBLN_FORCE_NPU_NAME": "RBLN-CA25"})


PYMODS = Path(standin.__file__).resolve().parent / "pymods"


def _device_env(tmp_path: Path, *, answers: str, **extra: str) -> dict[str, str]:
    """A node with one RBLN device: a ``rbln0`` node and the stand-in's fake ``rebel`` module."""
    dev = tmp_path / "dev"
    dev.mkdir(exist_ok=True)
    (dev / "rbln0").touch()
    env = {k: v for k, v in BASE_ENV.items() if k != "CACHEMGR_NPU_TYPE"}
    return {
        **env,
        "CACHEMGR_RBLN_DEV_DIR": str(dev),
        "PYTHONPATH": str(PYMODS),
        "STANDIN_NPU_NAME": answers,
        **extra,
    }


def test_the_device_decides_the_npu_type(tmp_path: Path) -> None:
    """vllm-rbln asks rebel.get_npu_name(0) first (platform/__init__.py 136-151): so does the key."""
    key = compute_key(
        KeyRequest(argv=ARGV, role="prefill", environ=_device_env(tmp_path, answers="RBLN-CA25"))
    )
    assert (key.inputs["npu"], key.sources["npu"]) == ("RBLN-CA25", "rebel.get_npu_name(0)")
    assert key.digest == digest()
    assert key.details["npu_from_device"] is True
    # A setting that disagrees with the device is refused, naming both.
    env = _device_env(tmp_path, answers="RBLN-CA25", RBLN_FORCE_NPU_NAME="RBLN-CA12")
    with pytest.raises(ConfigError, match=r"RBLN_FORCE_NPU_NAME=RBLN-CA12 disagrees.*\(RBLN-CA25\)"):
        compute_key(KeyRequest(argv=ARGV, role="prefill", environ=env))
    # The device's name is keyed as it answers (the server hashes it so); a setting written otherwise
    # disagrees with it, even in case only.
    env = _device_env(tmp_path, answers="rbln-ca25")
    assert compute_key(KeyRequest(argv=ARGV, role="prefill", environ=env)).inputs["npu"] == "rbln-ca25"
    env = _device_env(tmp_path, answers="rbln-ca25", RBLN_FORCE_NPU_NAME="RBLN-CA25")
    with pytest.raises(ConfigError, match=r"RBLN_FORCE_NPU_NAME=RBLN-CA25 disagrees.*\(rbln-ca25\)"):
        compute_key(KeyRequest(argv=ARGV, role="prefill", environ=env))


@pytest.mark.quick
def test_without_a_device_node_the_device_is_not_asked(tmp_path: Path) -> None:
    env = _device_env(tmp_path, answers="RBLN-CA12", RBLN_FORCE_NPU_NAME="RBLN-CA25")
    (tmp_path / "dev" / "rbln0").unlink()
    key = compute_key(KeyRequest(argv=ARGV, role="prefill", environ=env))
    assert (key.inputs["npu"], key.details["npu_from_device"]) == ("RBLN-CA25", False)


@pytest.mark.quick
def test_runtime_only_vllm_rbln_env_does_not_count() -> None:
    assert digest(env={"VLLM_RBLN_COMPILE_ONLY": "1", "VLLM_RBLN_METRICS": "1", "UNRELATED": "x"}) == digest()


@pytest.mark.quick
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


@pytest.mark.quick
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
        ("vLLM 0.30.1, same compiler", {"env": {"CACHEMGR_VLLM_VERSION": "0.30.1+cpu"}}),
        ("vLLM without the +cpu label", {"env": {"CACHEMGR_VLLM_VERSION": "0.30.0"}}),
        ("vllm-rbln 0.12.1", {"env": {"CACHEMGR_VLLM_RBLN_VERSION": "0.12.1"}}),
        ("optimum-rbln 0.12.1", {"env": {"CACHEMGR_OPTIMUM_RBLN_VERSION": "0.12.1"}}),
    ],
)
def test_each_input_changes_the_key(change: str, kwargs: dict[str, Any]) -> None:
    assert digest(**kwargs) != digest(), change


@pytest.mark.quick
@settings(max_examples=40, deadline=None)
@given(a=st.integers(1, 64), b=st.integers(1, 64))
def test_distinct_compile_settings_never_collide(a: int, b: int) -> None:
    argv_a = ["vllm", "serve", "org/model", "--max-num-seqs", str(a)]
    argv_b = ["vllm", "serve", "org/model", "--max-num-seqs", str(b)]
    assert (digest(argv_a) == digest(argv_b)) == (a == b)


# --- inputs read as production reads them -----------------------------------------------------


@pytest.mark.quick
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


# Pieces of versions, valid and not (a space, an Arabic-Indic digit), joined at random.
_PIECES = (
    "0",
    "12",
    "007",
    ".",
    "+",
    "cpu",
    "rc1",
    "dev4",
    "post2",
    "v",
    "-",
    "_",
    "a",
    "gabc",
    "!",
    "1!",
    " ",
)
_VERSION_PARTS = st.sampled_from([*_PIECES, "\u0663"])


def _assert_read_as_packaging_reads(text: str) -> None:
    """The same release numbers from core.versions and packaging, or both refuse ``text``."""
    from packaging.version import InvalidVersion, Version

    from cachemgr.core.versions import release_numbers

    try:
        expected: tuple[int, ...] | None = Version(text).release
    except InvalidVersion:
        expected = None
    try:
        got: tuple[int, ...] | None = release_numbers(text)
    except ValueError:
        got = None
    assert got == expected


@pytest.mark.quick
@settings(max_examples=400)
@given(st.lists(_VERSION_PARTS, max_size=7).map("".join))
def test_version_numbers_read_as_packaging_reads_them(text: str) -> None:
    """core.versions reads plain releases without packaging (the hit path); it must agree with
    packaging on every string: the same release numbers, or both refuse it."""
    _assert_read_as_packaging_reads(text)


@pytest.mark.quick
@pytest.mark.parametrize(
    "text",
    # Letters that IGNORECASE folds into [a-z] (Kelvin sign, long s, dotless i, dotted I):
    # packaging reads a local label as ASCII only.
    ["1.0+\u212a", "0.30.0+cp\u017f", "1.0+\u0131", "1.0+\u0130", "1.0+cpu.\u212a8s"],
)
def test_version_numbers_refuse_what_packaging_refuses(text: str) -> None:
    _assert_read_as_packaging_reads(text)


@pytest.mark.quick
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
    env = _env_without_overrides(
        PYTHONPATH=str(tmp_path / "site"), CACHEMGR_NPU_TYPE="RBLN-CA25", **DECLARED_VERSIONS
    )
    result = run_cli("key", "-o", "json", "--", *ARGV, env=env)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["inputs"]["compiler"] == "0.12"
    assert data["sources"]["compiler"] == "package rebel-compiler 0.12.4"


def test_without_compiler_the_key_exits_78_saying_what_to_set() -> None:
    result = run_cli("key", "--", *ARGV, env=_env_without_overrides(CACHEMGR_NPU_TYPE="RBLN-CA25"))
    assert result.returncode == 78
    lines = error_lines(result.stderr)
    assert len(lines) == 1
    assert "CACHEMGR_COMPILER_VERSION" in lines[0]


def test_without_any_npu_source_the_key_exits_78_with_one_line(tmp_path: Path) -> None:
    env = _env_without_overrides(CACHEMGR_COMPILER_VERSION="0.12.3", PATH=str(tmp_path))
    result = run_cli("key", "--", *ARGV, env=env)
    assert result.returncode == 78
    (line,) = error_lines(result.stderr)
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
    # A device node, and no rebel in this Python (its query exits 3): the driver's tool answers.
    environ = {
        **_device_env(tmp_path, answers="none"),
        "PATH": f"{tool.parent}:/usr/bin:/bin",
        "PYTHONPATH": "",
    }
    key = compute_key(KeyRequest(argv=ARGV, role="prefill", environ=environ))
    assert key.inputs["npu"] == "RBLN-CA25"
    assert key.sources["npu"] == "rbln-smi"
    assert key.digest == digest()


@pytest.mark.quick
def test_role_is_required() -> None:
    with pytest.raises(ConfigError, match="CACHEMGR_ROLE"):
        compute_key(KeyRequest(argv=ARGV, role=None, environ=BASE_ENV))


@pytest.mark.quick
def test_non_vllm_server_needs_a_compile_command() -> None:
    with pytest.raises(UsageError, match="--strategy command"):
        compute_key(KeyRequest(argv=["my-server", "--port", "1"], role="prefill", environ=BASE_ENV))


@pytest.mark.quick
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


@pytest.mark.quick
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


@pytest.mark.quick
def test_vllm_strategy_keys_local_models_by_path_too(tmp_path: Path) -> None:
    """vllm-rbln names its own cache after the model path: another path would compile in the server."""
    one = _model_dir(tmp_path / "mnt-a" / "llm")
    two = _model_dir(tmp_path / "mnt-b" / "llm")
    assert digest(["vllm", "serve", str(one)]) != digest(["vllm", "serve", str(two)])
    assert digest(["vllm", "serve", str(one)]) == digest(["vllm", "serve", str(one), "--port", "1"])


@pytest.mark.quick
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


def test_server_versions_come_from_package_metadata_and_key_shows_them(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _fake_dist(site, "rebel-compiler", "0.12.4")
    _fake_dist(site, "vllm", "0.30.0+cpu")
    _fake_dist(site, "vllm-rbln", "0.12.0")
    _fake_dist(site, "optimum-rbln", "0.12.0")
    _fake_dist(site, "transformers", "5.15.1")
    env = _env_without_overrides(
        PYTHONPATH=str(site), CACHEMGR_NPU_TYPE="RBLN-CA25", HF_HUB_CACHE=str(tmp_path / "no-hf-cache")
    )
    result = run_cli("key", "-o", "json", "--", *ARGV, env=env)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["inputs"]["versions"] == {
        "vllm": "0.30.0+cpu",
        "vllm_rbln": "0.12.0",
        "optimum_rbln": "0.12.0",
        "transformers": "5.15.1",
    }
    assert "package vllm 0.30.0+cpu" in data["sources"]["versions"]
    assert data["key"] == digest(), "the same versions as the stand-in declares: the same key"
    table = run_cli("key", "--", *ARGV, env=env)
    assert "versions.vllm" in table.stdout
    assert "0.30.0+cpu" in table.stdout


def test_without_the_server_versions_the_vllm_strategy_exits_78(tmp_path: Path) -> None:
    env = _env_without_overrides(CACHEMGR_NPU_TYPE="RBLN-CA25", CACHEMGR_COMPILER_VERSION="0.12.0")
    env = {**env, "CACHEMGR_VLLM_VERSION": "0.30.0+cpu"}
    result = run_cli("key", "--", *ARGV, env=env)
    assert result.returncode == 78, result.stderr
    (line,) = error_lines(result.stderr)
    assert "vllm-rbln, optimum-rbln" in line
    assert "CACHEMGR_VLLM_RBLN_VERSION, CACHEMGR_OPTIMUM_RBLN_VERSION" in line
    bad = run_cli("key", "--", *ARGV, env={**env, **DECLARED_VERSIONS, "CACHEMGR_VLLM_VERSION": "thirty"})
    assert bad.returncode == 78
    assert "not a version number" in bad.stderr
    # The command strategy runs a compiler of its own: it does not need them.
    command = ["--strategy", "command", "--compile-cmd", "c --out {output_dir}"]
    other = run_cli("key", *command, "--", "vllm", "serve", "{artifact_dir}", env=env)
    assert other.returncode == 0, other.stderr


@pytest.mark.quick
def test_model_redirect_is_resolved_before_keying(tmp_path: Path) -> None:
    """vLLM replaces the model by its VLLM_MODEL_REDIRECT_PATH entry (config/model.py 558)."""
    local = _model_dir(tmp_path / "models" / "llm")
    table = tmp_path / "redirect.txt"
    table.write_text(f"org/model {local}\n")
    redirected = compute_key(
        KeyRequest(argv=ARGV, role="prefill", environ={**BASE_ENV, "VLLM_MODEL_REDIRECT_PATH": str(table)})
    )
    direct = compute_key(
        KeyRequest(argv=["vllm", "serve", str(local), "-tp", "4"], role="prefill", environ=BASE_ENV)
    )
    assert redirected.inputs["model"] == direct.inputs["model"]
    assert redirected.inputs["model"]["path"] == str(local)
    assert redirected.digest == direct.digest
    table.write_text(json.dumps({"org/model": str(local)}))
    assert digest(env={"VLLM_MODEL_REDIRECT_PATH": str(table)}) == direct.digest
    assert digest(env={"VLLM_MODEL_REDIRECT_PATH": str(tmp_path / "absent")}) == digest()
    table.write_text(json.dumps({"org/other": str(local)}))
    assert digest(env={"VLLM_MODEL_REDIRECT_PATH": str(table)}) == digest()


@pytest.mark.quick
def test_a_model_redirect_file_nested_too_deep_for_json_is_read_as_lines(tmp_path: Path) -> None:
    """vLLM's _maybe_json_dict takes any failure of json.loads as "not JSON" and reads the lines:
    a table nested 100,000 deep made key exit 70 on a RecursionError."""
    table = tmp_path / "redirect"
    table.write_text("[" * 100_000)
    assert digest(env={"VLLM_MODEL_REDIRECT_PATH": str(table)}) == digest()


@pytest.mark.quick
@pytest.mark.parametrize(
    ("argv_extra", "env", "says"),
    [
        (["--model-impl", "vllm", "--enforce-eager"], {}, "--enforce-eager"),
        (["--model-impl", "vllm"], {"VLLM_RBLN_ENABLE_WARM_UP": "0"}, "VLLM_RBLN_ENABLE_WARM_UP is off"),
        (
            [],
            {"VLLM_RBLN_USE_VLLM_MODEL": "1", "VLLM_DISABLE_COMPILE_CACHE": "1"},
            "VLLM_DISABLE_COMPILE_CACHE=1",
        ),
        (["--enforce-eager"], {}, "if the model takes the vLLM-model path"),
    ],
)
def test_key_says_when_a_configuration_cannot_be_cached(
    argv_extra: list[str], env: dict[str, str], says: str
) -> None:
    key = compute_key(KeyRequest(argv=[*ARGV, *argv_extra], role="prefill", environ={**BASE_ENV, **env}))
    assert any(says in reason for reason in key.to_json()["cannot_be_cached"])
    optimum = (
        compute_key(
            KeyRequest(
                argv=[*ARGV, *argv_extra, "--model-impl", "optimum"],
                role="prefill",
                environ={**BASE_ENV, **env},
            )
        )
        if "VLLM_RBLN_USE_VLLM_MODEL" not in env
        else None
    )
    assert optimum is None or optimum.to_json()["cannot_be_cached"] == []
    assert (
        compute_key(KeyRequest(argv=ARGV, role="prefill", environ=BASE_ENV)).to_json()["cannot_be_cached"]
        == []
    )


# --- the weights' identity (cachemgr/key/weights.py) --------------------------------------------


@pytest.mark.quick
def test_weights_are_identified_by_content_cheaply(tmp_path: Path) -> None:
    """Other weights of the same size (a fine-tune) are another identity; the same bytes elsewhere, or
    touched, the same; a hub blob is named by the sha256 of its content, so its name is the identity."""
    from cachemgr.key.weights import BLOCK_BYTES, HEAD_BYTES, content_id, content_ids

    size = HEAD_BYTES + 64 * BLOCK_BYTES
    data = bytes(range(256)) * (size // 256)
    a, b, c = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    a.write_bytes(data)
    b.write_bytes(data)
    os.utime(b, (1_000_000_000, 1_000_000_000))
    assert content_id(str(a)) == content_id(str(b)), "same bytes, another path and time"
    fine_tune = bytes((x + 1) % 256 for x in data)
    c.write_bytes(fine_tune)
    assert content_id(str(c)) != content_id(str(a)), "same size, other bytes"
    assert content_id(str(c)).startswith(f"xxh3:{size}:")
    # A hub snapshot's file is a link to blobs/<sha256 of its content>: that name is the identity.
    blob = tmp_path / "models--o--m" / "blobs" / ("ab" * 32)
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"weights")
    snap = tmp_path / "models--o--m" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(os.path.relpath(blob, snap))
    assert content_id(str(snap / "model.safetensors")) == f"sha256:{'ab' * 32}"
    assert content_ids({"a": str(a), "c": str(c)}) == {"a": content_id(str(a)), "c": content_id(str(c))}
    with pytest.raises(OSError, match="not a regular file"):
        content_id(str(tmp_path))  # a directory is no weight file


@pytest.mark.quick
def test_a_local_model_is_keyed_by_what_the_server_reads_of_it(tmp_path: Path) -> None:
    """The key oracle's findings on a model directory, one by one: a quantization config added, other
    weights of the same size and --revision (on the vLLM-model path) make another key; a tokenizer or
    generation config, the transformers_version field and the files' times do not; --hf-config-path is
    keyed by the configs it holds, not by its path."""
    from cachemgr_testkit import oracle

    model = tmp_path / "m"

    def key_of(*extra: str, edits: tuple[dict[str, Any], ...] = (), impl: str = "vllm") -> str:
        oracle.materialize(model, edits)
        argv = ["vllm", "serve", str(model), "--model-impl", impl, *extra]
        return compute_key(KeyRequest(argv=argv, role="prefill", environ=BASE_ENV)).digest

    base = key_of()
    differs = {
        "hf_quant_config.json": ({"op": "write_json", "file": "hf_quant_config.json", "value": {"q": 1}},),
        "weights": ({"op": "weights", "file": "model.safetensors"},),
    }
    for name, edits in differs.items():
        assert key_of(edits=edits) != base, name
    same = {
        "tokenizer_config": (
            {"op": "json_set", "file": "tokenizer_config.json", "key": "model_max_length", "value": 9},
        ),
        "generation_config": (
            {"op": "json_set", "file": "generation_config.json", "key": "temperature", "value": 1.0},
        ),
        "transformers_version": (
            {"op": "json_set", "file": "config.json", "key": "transformers_version", "value": "1"},
        ),
        "touched": ({"op": "touch", "file": "model.safetensors"},),
    }
    for name, edits in same.items():
        assert key_of(edits=edits) == base, name
    assert key_of("--revision", "main") != base, "the vLLM-model path's identity hashes the revision"
    assert key_of("--revision", "main", impl="optimum") == key_of(impl="optimum"), (
        "the optimum path's does not"
    )
    beside = ({"op": "sidecar", "file": "config.json"},)
    changed = ({"op": "sidecar", "file": "config.json", "set": {"rope_theta": 1.0}},)
    assert key_of("--hf-config-path", f"{model}.cfg", edits=beside) == base, "the same configs, elsewhere"
    assert key_of("--hf-config-path", f"{model}.cfg", edits=changed) != base
