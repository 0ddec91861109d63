"""The server's key or stricter, for every release (issue 23): each input keyed as the server reads it.

Every case cites the server's code it follows (cachemgr/key/releases.py has the table, docs/design.md
the key table). False hits: an input the server hashes or compiles from that the key must hold.
Needless misses: spellings, defaults and flags the server treats as one, which the key must too.
Releases: 0.11.2's own rules, and strict rules for any release not checked.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.podlib import run_cli
from cachemgr_testkit.scenarios import KEY_ENV, SERVE_ARGV

from cachemgr.key import rbln_env
from cachemgr.key.cachekey import CacheKey, KeyRequest, compute_key

VLLM_PATH = ["--model-impl", "vllm"]
OPTIMUM_PATH = ["--model-impl", "optimum"]
RELEASE_0_11 = {
    "CACHEMGR_VLLM_VERSION": "0.24.0+cpu",
    "CACHEMGR_VLLM_RBLN_VERSION": "0.11.2",
    "CACHEMGR_OPTIMUM_RBLN_VERSION": "0.11.2",
    "CACHEMGR_TRANSFORMERS_VERSION": "5.8.1",
}
UNCHECKED = {"CACHEMGR_VLLM_RBLN_VERSION": "0.13.0", "CACHEMGR_OPTIMUM_RBLN_VERSION": "0.13.0"}


def key(
    extra: list[str] | tuple[str, ...] = (),
    env: Mapping[str, str] | None = None,
    argv: list[str] = SERVE_ARGV,
) -> CacheKey:
    return compute_key(KeyRequest(argv=[*argv, *extra], role="prefill", environ={**KEY_ENV, **(env or {})}))


def digest(extra: list[str] | tuple[str, ...] = (), env: Mapping[str, str] | None = None, **kw: Any) -> str:
    return key(extra, env, **kw).digest


# --- false hits -------------------------------------------------------------------------------------


@pytest.mark.quick
def test_data_parallel_from_the_environment_is_keyed() -> None:
    """vLLM 0.30 config/parallel.py 910-940: without DP > 1 on the command line, VLLM_DP_SIZE and
    VLLM_DP_RANK fill ParallelConfig; the size is hashed, the rank picks rank<N> (rbln_worker.py 818-835)."""
    rank0 = digest(env={"VLLM_DP_SIZE": "2", "VLLM_DP_RANK": "0"})
    rank1 = digest(env={"VLLM_DP_SIZE": "2", "VLLM_DP_RANK": "1"})
    assert len({digest(), rank0, rank1}) == 3
    assert digest(env={"VLLM_DP_SIZE": "02", "VLLM_DP_RANK": "1"}) == rank1, "read as int(), as vLLM does"
    assert digest(env={"VLLM_DP_SIZE": "1", "VLLM_DP_RANK": "3"}) == digest(), "no DP: the rank is not read"
    # DP on the command line: the environment is not read (the flags are keyed as given)
    flags = ["--data-parallel-size", "2", "--data-parallel-rank", "1"]
    assert digest(flags, env={"VLLM_DP_SIZE": "4", "VLLM_DP_RANK": "3"}) == digest(flags)
    assert key(env={"VLLM_DP_SIZE": "2", "VLLM_DP_RANK": "1"}).inputs["env"] == {
        "VLLM_DP_SIZE": 2,
        "VLLM_DP_RANK": 1,
    }


# Each changes vllm-rbln 0.12.0's mega_cache.config_signature on the vLLM-model path (the key oracle:
# CompilationConfig.compute_hash hashes them, VllmConfig.compute_hash holds it, mega_cache.py 140-150).
_COMPILATION_FIELDS = (
    '{"cudagraph_capture_sizes": [1, 2]}',
    '{"compile_sizes": [1, 2]}',
    '{"max_cudagraph_capture_size": 8}',
)


@pytest.mark.quick
def test_compilation_config_fields_the_bundle_signature_reads_are_keyed() -> None:
    """issue 39: `--compilation-config` was concluded ignored from two sampled values, so these three
    were one key with `{}`: the pod hit, the server found no bundle under its own signature and
    compiled inside the pod at every start. Each field is now keyed as vLLM parses it."""
    none = digest(VLLM_PATH)
    keys = [digest([*VLLM_PATH, "--compilation-config", value]) for value in _COMPILATION_FIELDS]
    assert len({none, *keys}) == 4
    assert digest([*VLLM_PATH, "--compilation-config", "{}"]) == none, "an object of no fields: the default"
    assert digest([*VLLM_PATH, "--compilation-config", '{"compile_sizes": null}']) == none, (
        "a field at its default"
    )
    assert digest([*VLLM_PATH, "-cc.compile_sizes", "[1,2]"]) == keys[1], "the dotted spelling: one field"
    assert digest([*VLLM_PATH, "--compilation-config", '{ "compile_sizes" : [1, 2] }']) == keys[1]


@pytest.mark.quick
def test_a_field_proven_not_to_reach_a_paths_identity_is_left_out_there() -> None:
    """The key oracle tried each field alone: `debug_dump_path` (where vLLM writes debug dumps) changed
    no identity on the vLLM-model path, and the optimum path compiles none of --compilation-config's
    `compile_sizes` (its graphs are optimum-rbln's, not torch.compile's): those leave the key there,
    while what the path reads stays (cachemgr/key/vllm_identity.py FIELDS)."""
    sizes = digest([*VLLM_PATH, "--compilation-config", '{"compile_sizes": [1, 2]}'])
    dump = '{"compile_sizes": [1, 2], "debug_dump_path": "/tmp/dumps"}'
    assert digest([*VLLM_PATH, "--compilation-config", dump]) == sizes
    assert digest([*VLLM_PATH, "--compilation-config", '{"debug_dump_path": "/tmp/dumps"}']) == digest(
        VLLM_PATH
    )
    optimum = digest([*OPTIMUM_PATH, "--compilation-config", '{"compile_sizes": [1, 2]}'])
    assert optimum == digest(OPTIMUM_PATH)
    # a key the class does not have is kept as given (the server refuses it): never dropped
    assert digest([*VLLM_PATH, "--compilation-config", '{"no_such_field": 1}']) != digest(VLLM_PATH)


@pytest.mark.quick
def test_the_model_path_a_parent_published_is_keyed() -> None:
    """envs.py 167-185, config.py 428-434: _VLLM_RBLN_RESOLVED_MODEL_IMPL picks the path under auto."""
    inherited = key(env={"_VLLM_RBLN_RESOLVED_MODEL_IMPL": "vllm"})
    assert inherited.inputs["model_impl"] == "vllm"
    assert inherited.digest != digest()
    assert inherited.digest == digest(VLLM_PATH), "the same path however it was named"
    assert digest(OPTIMUM_PATH, env={"_VLLM_RBLN_RESOLVED_MODEL_IMPL": "vllm"}) == digest(OPTIMUM_PATH), (
        "the flag wins"
    )
    assert digest(env={"_VLLM_RBLN_RESOLVED_MODEL_IMPL": ""}) == digest(), "empty is unset (envs.py 173)"


@pytest.mark.quick
def test_mla_disable_is_keyed_on_the_vllm_model_path() -> None:
    """vLLM config/model.py 1926-1927 and vllm-rbln platform/__init__.py 117-122: the attention backend."""
    assert digest(VLLM_PATH, env={"VLLM_MLA_DISABLE": "1"}) != digest(VLLM_PATH)
    assert digest(VLLM_PATH, env={"VLLM_MLA_DISABLE": "0"}) == digest(VLLM_PATH), "bool(int(...))"
    assert digest(env={"VLLM_MLA_DISABLE": "1"}) != digest(), "auto may take the vLLM-model path"
    assert digest(OPTIMUM_PATH, env={"VLLM_MLA_DISABLE": "1"}) == digest(OPTIMUM_PATH), "optimum: not read"


def _model(path: Path, config: dict[str, Any]) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"w" * 64)
    return path


@pytest.mark.quick
def test_the_draft_models_content_is_keyed(tmp_path: Path) -> None:
    """mega_cache.py 105: the graph set hashes the draft's ModelConfig, hf_config included."""
    draft = _model(tmp_path / "draft", {"num_hidden_layers": 1})
    spec = ["--speculative-config", json.dumps({"model": str(draft), "num_speculative_tokens": 2})]
    before = key(spec)
    assert before.inputs["draft_model"]["kind"] == "local"
    (draft / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    assert digest(spec) != before.digest, "the same path, another draft config"


def _hf_cache(home: Path, repo: str, ref: str, commit: str) -> None:
    folder = home / "hub" / ("models--" + repo.replace("/", "--"))
    (folder / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit)


@pytest.mark.quick
def test_a_hub_model_is_keyed_by_the_snapshot_the_server_will_load(tmp_path: Path) -> None:
    """vLLM hashes the hf_config it loads (config/utils.py 318-322): without --revision, main's snapshot."""
    home = tmp_path / "hf"
    env = {"HF_HOME": str(home)}
    unresolved = key(env=env)
    assert unresolved.inputs["model"]["snapshot"] is None
    assert any("not in this pod's Hugging Face cache" in note for note in unresolved.notes)
    _hf_cache(home, "org/model", "main", "a" * 40)
    first = key(env=env)
    assert first.inputs["model"]["snapshot"] == "a" * 40
    assert not first.notes
    _hf_cache(home, "org/model", "main", "b" * 40)
    assert digest(env=env) != first.digest, "main moved: another snapshot, another key"
    # a pinned commit names itself; a branch resolves through refs/
    assert key(["--revision", "c" * 40], env=env).inputs["model"]["snapshot"] == "c" * 40
    _hf_cache(home, "org/model", "v1", "d" * 40)
    assert key(["--revision", "v1"], env=env).inputs["model"]["snapshot"] == "d" * 40
    assert key(env={"HF_HUB_CACHE": str(home / "hub")}).inputs["model"]["snapshot"] == "b" * 40


def test_a_fifo_as_a_hub_ref_is_a_ref_the_cache_does_not_hold(tmp_path: Path) -> None:
    """refs/main was read with a plain open(): a FIFO there with no writer hung key and run (and a pod
    blocked in open() ignores SIGTERM). Now it is as if the cache did not hold the ref: keyed without
    a snapshot, and key says so."""
    home = tmp_path / "hf"
    _hf_cache(home, "org/model", "main", "a" * 40)
    ref = home / "hub" / "models--org--model" / "refs" / "main"
    ref.unlink()
    os.mkfifo(ref)
    env = {**KEY_ENV, "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "HF_HOME": str(home)}
    done = run_cli(
        "key", "--role", "prefill", "-o", "json", "--", *SERVE_ARGV, env=env, timeout=15
    )  # it hung
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["inputs"]["model"]["snapshot"] is None
    assert "the snapshot of main is not in this pod's Hugging Face cache" in done.stderr


@pytest.mark.quick
def test_a_hub_ref_larger_than_a_ref_is_not_read_whole(tmp_path: Path) -> None:
    """A ref is a 40-hex commit; a file of megabytes there is not one (it was read whole before)."""
    home = tmp_path / "hf"
    _hf_cache(home, "org/model", "main", "a" * 40)
    ref = home / "hub" / "models--org--model" / "refs" / "main"
    ref.write_text("a" * 40 + "\n" * (1 << 20))  # the commit, then a megabyte of padding
    assert key(env={"HF_HOME": str(home)}).inputs["model"]["snapshot"] is None
    ref.write_text("a" * 40 + "\n")  # as huggingface_hub writes it
    assert key(env={"HF_HOME": str(home)}).inputs["model"]["snapshot"] == "a" * 40


@pytest.mark.quick
def test_the_transformers_version_is_keyed() -> None:
    """The hashed hf_config carries transformers_version; optimum-rbln compiles through transformers."""
    assert digest(env={"CACHEMGR_TRANSFORMERS_VERSION": "5.16.0"}) != digest()
    assert key().inputs["versions"]["transformers"] == "5.15.1"


# --- needless misses --------------------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize(
    "spellings",
    [
        # envs.py: `.lower() in ("true", "1")`
        ({"VLLM_RBLN_USE_DEVICE_TENSOR": "1"}, {"VLLM_RBLN_USE_DEVICE_TENSOR": "TRUE"}, {}),
        ({"VLLM_RBLN_USE_VLLM_MODEL": "0"}, {"VLLM_RBLN_USE_VLLM_MODEL": "false"}, {"VLLM_RBLN_USE_VLLM_MODEL": "no"}),
        ({"VLLM_RBLN_NUM_HIDDEN_LAYERS": "02"}, {"VLLM_RBLN_NUM_HIDDEN_LAYERS": "2"}),
        # RBLNConfig fields: the variable, the deprecated alias, the flag and the JSON key are one field
        ({"RBLN_USE_CUSTOM_KERNEL": "1"}, {"RBLN_USE_CUSTOM_KERNEL": "true"}),
        ({"VLLM_RBLN_ENFORCE_MODEL_FP32": "TRUE"}, {"VLLM_RBLN_ENFORCE_MODEL_FP32": "1"}),
        ({"VLLM_RBLN_TP_SIZE": "2"}, {"VLLM_RBLN_NUM_DEVICES_PER_LOCAL_RANK": "2"},
         {"VLLM_RBLN_NUM_DEVICES_PER_LOCAL_RANK": "2", "VLLM_RBLN_TP_SIZE": "8"}),
        ({"VLLM_RBLN_DECODE_BATCH_BUCKET_STRATEGY": "exp"}, {"VLLM_RBLN_DECODE_BATCH_BUCKET_STRATEGY": "EXPONENTIAL"}, {}),
        ({"VLLM_RBLN_USE_DYNAMIC_KV_CACHE": "1"}, {}),
        # variables the server never reads
        ({"VLLM_RBLN_USE_CUSTOM_KERNEL": "1"}, {"VLLM_RBLN_FLASH_CAUSAL_ATTN": "0"}, {"VLLM_RBLN_SORT_BATCH": "1"}, {}),
    ],
)  # fmt: skip
def test_spellings_the_server_reads_as_one_are_one_key(spellings: tuple[dict[str, str], ...]) -> None:
    assert len({digest(env=env) for env in spellings}) == 1, spellings


@pytest.mark.quick
def test_a_flag_a_json_key_and_a_variable_that_set_one_field_are_one_key() -> None:
    """config.py 532-605: additional_config (which --rbln-* writes) over VLLM_RBLN_* over the default."""
    forms = [
        digest(["--rbln-use-custom-kernel"]),
        digest(["--additional-config", '{"use_custom_kernel": true}']),
        digest(env={"RBLN_USE_CUSTOM_KERNEL": "1"}),
        digest(["--rbln-use-custom-kernel"], env={"RBLN_USE_CUSTOM_KERNEL": "0"}),  # the flag wins
    ]
    assert len(set(forms)) == 1
    assert forms[0] != digest()
    assert digest(["--no-rbln-use-custom-kernel"], env={"RBLN_USE_CUSTOM_KERNEL": "1"}) == digest()
    # dynamic KV cache: unset and true build the same graph (config.py 162-163), false another
    assert digest(["--rbln-use-dynamic-kv-cache"]) == digest()
    assert digest(["--no-rbln-use-dynamic-kv-cache"]) != digest()
    assert digest(env={"VLLM_RBLN_USE_DYNAMIC_KV_CACHE": "0"}) == digest(["--no-rbln-use-dynamic-kv-cache"])
    # what RBLNConfig.compute_hash ignores (config.py 154-160)
    assert digest(["--rbln-sub-block-size", "64", "--no-rbln-use-custom-sampler"]) == digest()


@pytest.mark.quick
def test_values_equal_to_the_servers_default_are_the_default() -> None:
    """platform/__init__.py 49-51, 179-207, 299-321: max_num_seqs 1; gpu_memory_utilization 0.93 (0.92 raised)."""
    assert (
        digest(["--gpu-memory-utilization", "0.92"])
        == digest(["--gpu-memory-utilization", "0.93"])
        == digest()
    )
    assert digest(["--gpu-memory-utilization", "0.9"]) != digest()
    assert digest(["--max-num-seqs", "1"]) == digest()
    assert digest(["--max-num-seqs", "2"]) != digest()
    assert key(["--max-num-seqs", "1"]).defaulted == ("max-num-seqs 1",)


@pytest.mark.quick
@pytest.mark.parametrize(
    "flags",
    [
        ["--seed", "7"], ["--tokenizer", "org/tok"], ["--tokenizer-mode", "slow"], ["--tokenizer-revision", "x"],
        ["--distributed-executor-backend", "mp"], ["--worker-cls", "a.B"], ["--disable-custom-all-reduce"],
        ["--max-parallel-loading-workers", "2"], ["--model-impl", "transformers"],
    ],
)  # fmt: skip
def test_flags_the_servers_hash_ignores_are_runtime_only(flags: list[str]) -> None:
    """vLLM 0.30 config/model.py 434-440, config/parallel.py 847-853 (and --model-impl, which vllm-rbln
    resets before vLLM hashes it, platform/__init__.py 238: only the path it names counts)."""
    base = OPTIMUM_PATH if flags[0] == "--model-impl" else []
    assert digest([*base, *flags]) == digest(base), flags
    assert flags[0].lstrip("-") in key(flags).dropped or flags[0] == "--model-impl"


@pytest.mark.quick
def test_prefix_caching_is_runtime_only_on_both_paths() -> None:
    """config/cache.py 266 ignores it for the bundle. The optimum path sets the scheduler's block size
    by it (converter/common.py 92), after the directory name is computed and beside the attention block
    size it compiles with (common.py 74): the key oracle, running that code, saw neither the directory
    nor the compile spec change. Read off the code alone it was keyed there; executed, it is not."""
    assert digest([*VLLM_PATH, "--enable-prefix-caching"]) == digest(VLLM_PATH)
    assert digest([*OPTIMUM_PATH, "--enable-prefix-caching"]) == digest(OPTIMUM_PATH)
    assert digest(["--enable-prefix-caching"]) == digest(), "auto: neither path reads it"


@pytest.mark.quick
def test_the_optimum_path_does_not_key_what_only_the_vllm_model_path_reads() -> None:
    """envs.py 47-81: these are read only when VLLM_RBLN_USE_VLLM_MODEL is true."""
    for env in ({"VLLM_RBLN_NUM_HIDDEN_LAYERS": "2"}, {"VLLM_RBLN_ENFORCE_MODEL_FP32": "1"}):
        assert digest(OPTIMUM_PATH, env=env) == digest(OPTIMUM_PATH), env
        assert digest(VLLM_PATH, env=env) != digest(VLLM_PATH), env
    # ...while the devices per rank name the optimum directory too (dispatch.py 68-85)
    assert digest(OPTIMUM_PATH, env={"VLLM_RBLN_NUM_DEVICES_PER_LOCAL_RANK": "2"}) != digest(OPTIMUM_PATH)


@pytest.mark.quick
def test_an_unknown_flag_is_keyed_as_given_and_nothing_else_comes_with_it() -> None:
    """issue 24 item 4: --port stays out of the key beside an unknown flag, which is keyed as given."""
    one = key(["--future-flag", "3", "--port", "9001"])
    assert one.digest == digest(["--future-flag", "3", "--port", "9002"])
    assert one.digest != digest(["--future-flag", "4"])
    assert one.digest != digest()
    assert one.inputs["unknown_flags"] == ["org/model", "--tensor-parallel-size", "4", "--future-flag", "3"]
    assert "port" in one.dropped
    assert "unrecognized_argv" not in json.dumps(one.to_json())


# --- releases -----------------------------------------------------------------------------------------


@pytest.mark.quick
def test_vllm_rbln_0_11_2_is_keyed_by_its_own_rules() -> None:
    """0.11.2 envs.py 412-435: 20 variables hashed; vLLM 0.24 hashes additional_config whole; the
    model path is VLLM_RBLN_USE_VLLM_MODEL alone (--model-impl is vLLM's own flag there: hashed into
    the vLLM-model path's bundle, and read by nothing of the optimum path's, as the key oracle's
    0.11.2 table answers: vllm/option/--model-impl other, optimum/option/--model-impl other)."""
    old = key(env=RELEASE_0_11)
    assert old.inputs["rules"] == "vllm-rbln 0.11.2"
    assert old.inputs["model_impl"] == "optimum"
    vllm_path = {**RELEASE_0_11, "VLLM_RBLN_USE_VLLM_MODEL": "1"}
    assert key(env=vllm_path).inputs["model_impl"] == "vllm"
    assert digest(env={**vllm_path, "VLLM_RBLN_FLASH_CAUSAL_ATTN": "0"}) != digest(env=vllm_path)
    assert digest(env={**vllm_path, "VLLM_RBLN_FLASH_CAUSAL_ATTN": "FALSE"}) == digest(
        env={**vllm_path, "VLLM_RBLN_FLASH_CAUSAL_ATTN": "0"}
    )
    assert digest(["--model-impl", "vllm"], env=vllm_path) != digest(env=vllm_path)
    assert digest(["--model-impl", "vllm"], env=RELEASE_0_11) == digest(env=RELEASE_0_11)
    # additional_config whole: what 0.12 would leave out (use_custom_sampler) counts here
    sampler = ["--additional-config", '{"use_custom_sampler": false}']
    assert digest(sampler, env=RELEASE_0_11) != digest(env=RELEASE_0_11)
    assert digest(sampler) == digest()
    # W8A16 follows the NPU when unset (0.11.2 envs.py 87-111): true on RBLN-CA25
    assert digest(env={**vllm_path, "VLLM_RBLN_USE_W8A16": "1"}) == digest(env=vllm_path)
    assert digest(env={**RELEASE_0_11, "VLLM_RBLN_ENFORCE_MODEL_FP32": "1"}) == digest(env=RELEASE_0_11)
    assert digest(env=RELEASE_0_11) != digest()


@pytest.mark.quick
def test_a_release_that_was_not_checked_is_keyed_strictly() -> None:
    strict = key(["--seed", "7"], env={**UNCHECKED, "VLLM_RBLN_ENFORCE_MODEL_FP32": "1", "VLLM_FOO": "x"})
    assert strict.inputs["rules"] == "strict"
    assert "model_impl" not in strict.inputs
    assert strict.inputs["serving"]["seed"] == 7, "0.12's runtime-only flags count"
    assert strict.inputs["env"] == {"VLLM_RBLN_ENFORCE_MODEL_FP32": "1", "VLLM_FOO": "x"}, "raw, every one"
    release, why = strict.notes[0].split(": ", 1)
    assert release == "vllm 0.30.0+cpu, vllm-rbln 0.13.0, optimum-rbln 0.13.0, transformers 5.15.1"
    assert why.startswith("this cachemgr was not checked against that release, so the key is strict")
    # never 0.12's rules: spellings 0.12 reads as one are two here
    one = {**UNCHECKED, "VLLM_RBLN_ENFORCE_MODEL_FP32": "1"}
    assert digest(env=one) != digest(env={**UNCHECKED, "VLLM_RBLN_ENFORCE_MODEL_FP32": "true"})
    # ...but what is runtime-only in every release stays out, and so do cachemgr's own and the NPU's names
    assert digest(["--port", "1"], env=UNCHECKED) == digest(["--port", "2"], env=UNCHECKED)
    calm = {"RBLN_VISIBLE_DEVICES": "0,1", "VLLM_CACHE_ROOT": "/x", "RBLN_FORCE_NPU_NAME": "RBLN-CA25",
            "VLLM_RBLN_COMPILE_ONLY": "1", "VLLM_API_KEY": "s3cret", "VLLM_MY_TOKEN": "t",
            "RBLN_REGISTRY_PASSWORD": "p"}  # fmt: skip
    assert digest(env={**UNCHECKED, **calm}) == digest(env=UNCHECKED)


# --- the image's own vllm_rbln.envs -------------------------------------------------------------------


@pytest.fixture
def image_envs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A vllm_rbln 0.12.0 package on sys.path, its envs.py a copy of the shape of the real one."""
    package = tmp_path / "site" / "vllm_rbln"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_version.py").write_text("__version__ = version = '0.12.0'\n")
    (package / "envs.py").write_text(
        "import os\n"
        "environment_variables = {\n"
        '    "VLLM_RBLN_NUM_HIDDEN_LAYERS": lambda: int(os.environ.get("VLLM_RBLN_NUM_HIDDEN_LAYERS", 0)),\n'
        '    "VLLM_RBLN_NEW_KNOB": lambda: os.environ.get("VLLM_RBLN_NEW_KNOB", ""),\n'
        "}\n"
        'RBLN_COMPILE_ENV = frozenset({"VLLM_RBLN_NUM_HIDDEN_LAYERS", "VLLM_RBLN_NEW_KNOB"})\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m == "vllm_rbln" or m.startswith("vllm_rbln.")]:
        monkeypatch.delitem(sys.modules, name)
    rbln_env._cache.clear()
    rbln_env._identical.clear()
    yield package
    rbln_env._cache.clear()
    rbln_env._identical.clear()
    for name in [m for m in sys.modules if m == "vllm_rbln" or m.startswith("vllm_rbln.")]:
        del sys.modules[name]


@pytest.mark.quick
def test_an_installed_envs_py_equal_to_the_checked_one_is_the_table_and_is_not_imported(
    image_envs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import xxhash

    from cachemgr.key import releases

    same = releases.named("0.12.0")._replace(
        envs_xxh3=xxhash.xxh3_128_hexdigest((image_envs / "envs.py").read_bytes())
    )
    monkeypatch.setattr(releases, "KNOWN", (same, releases.named("0.11.2")))
    found = key(VLLM_PATH, env={"VLLM_RBLN_NEW_KNOB": "on"})
    assert found.sources["env"] == "vllm_rbln/envs.py of this image: the checked vllm-rbln 0.12.0 file"
    assert found.inputs["env"] == {}, "the table's names: this file is the one it was checked against"
    assert "vllm_rbln.envs" not in sys.modules, "read (20 KB), not imported"


@pytest.mark.quick
def test_the_images_own_envs_module_is_read_where_installed(image_envs: Path) -> None:
    found = key(VLLM_PATH, env={"VLLM_RBLN_NUM_HIDDEN_LAYERS": "02", "VLLM_RBLN_NEW_KNOB": "on"})
    assert found.sources["env"] == "vllm_rbln/envs.py 0.12.0 (this image, read)"
    # its parser (int: 02 is 2), and what it hashes that the table does not know: keyed, as given
    assert found.inputs["env"] == {"VLLM_RBLN_NEW_KNOB": "on", "VLLM_RBLN_NUM_HIDDEN_LAYERS": 2}
    # another version of vllm_rbln installed than the key's: the table decides
    (image_envs / "_version.py").write_text("__version__ = '0.12.1'\n")
    sys.modules.pop("vllm_rbln._version", None)
    rbln_env._cache.clear()
    assert key(VLLM_PATH).sources["env"] == "vllm-rbln's envs.py, as checked"


# --- what key and explain say ---------------------------------------------------------------------


def _cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    import os

    return {
        **os.environ, **KEY_ENV, "PATH": os.environ["PATH"], "HF_HOME": str(tmp_path / "hf"),
        "CACHEMGR_ROLE": "prefill", "CACHEMGR_CACHE_ROOT": str(tmp_path / "volume"), **extra,
    }  # fmt: skip


def test_key_says_exactly_what_is_keyed(tmp_path: Path) -> None:

    argv = [*SERVE_ARGV, "--future-flag", "3", "--seed", "7", "--max-num-seqs", "1"]
    done = run_cli("key", "--", *argv, env=_cli_env(tmp_path))
    assert done.returncode == 0, done.stderr
    lines = re.sub(r"\n +", " ", done.stdout).splitlines()  # a long value goes on under itself
    assert "rules           vllm-rbln 0.12.0, optimum-rbln 0.12.0, vLLM 0.30.0+cpu" in lines
    assert "runtime-only    --port --seed (not in the key)" in lines
    assert "at default      --max-num-seqs 1 (keyed as if not given)" in lines
    assert (
        "keyed as given  org/model --tensor-parallel-size 4 --future-flag 3 (vLLM 0.30 does not know --future-flag)"
        in lines
    )
    assert "unrecognized" not in done.stdout
    # the snapshot it could not resolve: one warning, on stderr (stdout stays the key's)
    assert done.stderr.count("warning: model org/model: the snapshot of main is not in this pod's") == 1
    strict = run_cli("key", "-o", "json", "--", *SERVE_ARGV, env=_cli_env(tmp_path, **UNCHECKED))
    assert strict.returncode == 0, strict.stderr
    assert json.loads(strict.stdout)["rules"] == "strict"
    assert [line for line in strict.stderr.splitlines() if "key is strict" in line] != []


def test_explain_with_an_unknown_flag_says_what_is_keyed_and_exits_1_on_a_miss(tmp_path: Path) -> None:

    (tmp_path / "volume").mkdir()
    argv = [*SERVE_ARGV, "--future-flag", "3"]
    done = run_cli("explain", "--", *argv, env=_cli_env(tmp_path))
    assert done.returncode == 1, done.stderr  # a miss, as diff's 1 (docs/reference.md)
    assert "runtime-only    --port (not in the key)" in done.stdout
    assert "keyed as given  org/model --tensor-parallel-size 4 --future-flag 3" in done.stdout
    assert "--unrecognized-argv" not in done.stdout
    as_json = run_cli("explain", "-o", "json", "--", *argv, env=_cli_env(tmp_path))
    assert as_json.returncode == 1
    assert json.loads(as_json.stdout)["result"] == "miss"


@pytest.mark.quick
def test_an_image_envs_py_that_imports_vllm_is_read_not_imported(image_envs: Path) -> None:
    """0.11.1's envs.py imports vLLM and merges vLLM's own table into its own: importing it cost 2 s a
    key and made every vLLM variable (VLLM_API_KEY, VLLM_PORT, VLLM_HOST_IP) look like one of
    vllm-rbln's, keyed raw into key.json on the shared volume. It is read, never imported."""
    vllm = image_envs.parent / "vllm"
    vllm.mkdir()
    marker = image_envs.parent / "vllm-imported"
    (vllm / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise RuntimeError('imported')\n")
    (image_envs / "envs.py").write_text(
        "import os\n"
        "from vllm.envs import environment_variables as vllm_envs\n"
        "from vllm_rbln.logger import init_logger\n"
        "environment_variables = {\n"
        "    **vllm_envs,\n"
        '    "VLLM_RBLN_NUM_HIDDEN_LAYERS": (lambda: int(os.environ.get("VLLM_RBLN_NUM_HIDDEN_LAYERS", 0))),\n'
        '    "VLLM_RBLN_NEW_KNOB": lambda: os.environ.get("VLLM_RBLN_NEW_KNOB", ""),\n'
        '    "VLLM_RBLN_API_KEY": lambda: os.environ.get("VLLM_RBLN_API_KEY", ""),\n'
        "}\n"
        "vllm_envs.update(environment_variables)\n"
    )
    secrets = {
        "VLLM_API_KEY": "sk-1",
        "VLLM_PORT": "8001",
        "VLLM_HOST_IP": "10.0.0.9",
        "VLLM_RBLN_API_KEY": "k",
    }
    found = key(VLLM_PATH, env={"VLLM_RBLN_NUM_HIDDEN_LAYERS": "02", "VLLM_RBLN_NEW_KNOB": "on", **secrets})
    assert not marker.exists(), "the key imported vLLM"
    assert "vllm_rbln.envs" not in sys.modules
    assert found.sources["env"] == "vllm_rbln/envs.py 0.12.0 (this image, read)"
    assert found.inputs["env"] == {"VLLM_RBLN_NEW_KNOB": "on", "VLLM_RBLN_NUM_HIDDEN_LAYERS": 2}
