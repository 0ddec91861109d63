"""cachemgr.key.serving reads a vLLM argv as vLLM 0.30.0 (+ vllm-rbln 0.12.0) does, and keys it safely.

The golden tests replay tests/data/vllm_serve_golden.json, what the REAL parser made of ~600 argvs
(recorded by tools/gen_serving_golden.py; CI has no vLLM). The property that matters most: two argvs
vLLM reads differently never share a key. The rest pins the documented policy (runtime-only flags,
the rbln/additional_config merge, JSON canonicalization and runtime-key stripping) and the forms.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachemgr.core.errors import ConfigError
from cachemgr.key import vllm_argv, vllm_flags, vllm_values
from cachemgr.key.cachekey import canonical_json
from cachemgr.key.serving import RUNTIME_ONLY, ServerCommand, parse_server_argv

pytestmark = pytest.mark.quick  # unit tests: no process, mount or server (conftest checks)

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"


def _load_tool() -> Any:
    spec = importlib.util.spec_from_file_location(
        "gen_serving_golden", REPO / "tools" / "gen_serving_golden.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


TOOL = _load_tool()
GOLDEN: dict[str, Any] = json.loads((DATA / "vllm_serve_golden.json").read_text(encoding="utf-8"))
CASES: list[dict[str, Any]] = GOLDEN["cases"]


@pytest.fixture
def in_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """The golden argvs name their --config files relative to tests/data, as the recording did."""
    monkeypatch.chdir(DATA)


def serve(line: str) -> ServerCommand:
    return parse_server_argv(["vllm", "serve", *shlex.split(line)])


def settings_of(line: str) -> dict[str, Any]:
    return dict(serve(line).settings)


# --------------------------------------------------------------------------------------------------
# golden: the real parser's outcomes


def test_golden_file_is_for_this_table() -> None:
    assert GOLDEN["vllm_version"] == vllm_flags.VLLM_VERSION
    assert GOLDEN["vllm_rbln_version"] == vllm_flags.VLLM_RBLN_VERSION
    outcomes = [case["outcome"] for case in CASES]
    assert len(CASES) >= 500
    assert sum(o["ok"] for o in outcomes) >= 200  # enough accepted argvs for the key property
    categories = {o["category"] for o in outcomes if not o["ok"]}
    assert {"refused", "unrecognized", "choice", "validation", "exit"} <= categories


def test_value_kinds_match_the_real_parser() -> None:
    """The generated table's value parser of each option, checked against the recorded real one."""
    real = GOLDEN["kinds"]
    assert set(real) == set(vllm_flags.FLAGS)
    for kind, names in vllm_values.VALUE_KINDS.items():
        if kind == "optional":
            assert names == {n for n, k in real.items() if k["optional"]}
        else:
            assert names == {n for n, k in real.items() if k["kind"] == kind}, kind
    json_kinds = {"json", "dataclass-json", "json-or-str"}
    assert {n for n, k in real.items() if k["kind"] in json_kinds} == vllm_flags.JSON_FLAGS


def test_option_strings_arities_and_consts_match_the_real_parser() -> None:
    parser = vllm_argv.serve_parser()
    ours = parser._option_string_actions
    real = GOLDEN["options"]
    assert set(ours) == set(real)
    for option, action in ours.items():
        assert action.nargs == real[option]["nargs"], option
        assert action.dest == real[option]["dest"], option
        if action.nargs == "?":
            assert action.const == real[option]["const"], option


@pytest.mark.usefixtures("in_data_dir")
@pytest.mark.parametrize("case", CASES, ids=[f"{i:03d}" for i in range(len(CASES))])
def test_golden_argv(case: dict[str, Any]) -> None:
    """Errors where vLLM errors; otherwise every value vLLM set, and nothing else, in the key."""
    assert TOOL.check_case(case, case["outcome"]) == [], shlex.join(TOOL.full_argv(case))


@pytest.mark.usefixtures("in_data_dir")
def test_safety_property_over_the_golden_corpus() -> None:
    """Different real configurations never share a key; equal ones with the same flags share it."""
    results = [(case, case["outcome"], TOOL._ours(case)) for case in CASES]
    stats: dict[str, int] = {}
    assert TOOL.check_safety(results, GOLDEN["kinds"], stats) == []
    assert stats["shared_keys"] >= 20  # the corpus does put equal configurations side by side


# --------------------------------------------------------------------------------------------------
# hypothesis: spellings that vLLM reads alike keep the key; one changed value changes it

ALL_OPTIONS = sorted(vllm_argv.serve_parser()._option_string_actions)
ALIASES_OF: dict[str, list[str]] = {}
for _alias, _name in vllm_flags.ALIASES.items():
    ALIASES_OF.setdefault(_name, []).append(_alias)

# compile-relevant options with a few values and equivalent spellings of each: value -> spellings
VALUE_OPTIONS: dict[str, dict[Any, list[str]]] = {
    "tensor-parallel-size": {1: ["1", "01"], 2: ["2", "02", "+2"], 4: ["4"]},
    "pipeline-parallel-size": {2: ["2"], 4: ["4", "04"]},
    "max-model-len": {4096: ["4096", "4K"], 4000: ["4000", "4k"], 8192: ["8K"]},
    "max-num-seqs": {8: ["8"], 16: ["16", "016"]},
    "max-num-batched-tokens": {2048: ["2048", "2K"], 512: ["512"]},
    "gpu-memory-utilization": {0.9: ["0.9", "0.90", ".9"], 0.85: ["0.85"]},
    "dtype": {"bfloat16": ["bfloat16"], "float16": ["float16"]},
    "quantization": {"fp8": ["fp8"], None: ["None", ""]},
    "block-size": {16: ["16"], 128: ["128"]},
    "seed": {0: ["0"], 7: ["7", "07"]},
    "revision": {"0123": ["0123"], "main": ["main"]},
    "kv-cache-dtype": {"fp8": ["fp8"], "auto": ["auto"]},
    "moe-backend": {"triton": ["triton", "Triton"], "deep_gemm": ["deep-gemm", "DEEP_GEMM"]},
}
SWITCHES = ["enforce-eager", "enable-prefix-caching", "enable-chunked-prefill", "trust-remote-code"]
# additional_config keys and the --rbln-* flag that writes each
RBLN = {"use_w8a8": "rbln-use-w8a8", "use_custom_kernel": "rbln-use-custom-kernel"}
RBLN_VALUES = {
    "decode_batch_bucket_limit": "rbln-decode-batch-bucket-limit",
    "compile_dtype": "rbln-compile-dtype",
}
RBLN_VALUE_CHOICES = {
    "decode_batch_bucket_limit": st.sampled_from([4, 8]),
    "compile_dtype": st.sampled_from(["bfloat16", "float16"]),
}
RUNTIME_EXTRAS = [["--port", "9001"], ["--host", "0.0.0.0"], ["--served-model-name", "svc", "alias"],
                  ["--api-key", "k"], ["--disable-log-stats"], ["--no-rbln-use-custom-sampler"],
                  ["--uvicorn-log-level", "debug"], ["--max-log-len", "10"], ["-asc", "2"]]  # fmt: skip


def unique_prefixes(option: str) -> list[str]:
    """Every abbreviation of ``option`` argparse resolves to it (an exact match always does)."""
    out = [option]
    for n in range(3, len(option)):
        prefix = option[:n]
        if [o for o in ALL_OPTIONS if o.startswith(prefix)] == [option]:
            out.append(prefix)
    return out


@st.composite
def spelled(draw: st.DrawFn, name: str) -> str:
    """One of the option strings vLLM maps to --name: aliases, underscores, unique prefixes."""
    forms = [*ALIASES_OF.get(name, []), *unique_prefixes(f"--{name}")]
    form = draw(st.sampled_from(forms))
    if form.startswith("--") and draw(st.booleans()):
        form = "--" + form[2:].replace("-", "_")
    return form


@st.composite
def rendered_option(draw: st.DrawFn, name: str, spelling: str) -> list[str]:
    option = draw(spelled(name))
    if draw(st.booleans()):
        return [f"{option}={spelling}"]
    return [option, spelling]


def json_text(draw: st.DrawFn, obj: dict[str, Any]) -> str:
    keys = draw(st.permutations(sorted(obj)))
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]))
    return json.dumps({k: obj[k] for k in keys}, separators=separators)


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    """A compile configuration: option values, switches, RBLN options and a compilation config."""
    values = draw(st.dictionaries(st.sampled_from(sorted(VALUE_OPTIONS)), st.none(), max_size=5))
    return {
        "values": {name: draw(st.sampled_from(list(VALUE_OPTIONS[name]))) for name in values},
        "switches": draw(st.dictionaries(st.sampled_from(SWITCHES), st.booleans(), max_size=3)),
        "rbln": draw(st.dictionaries(st.sampled_from(sorted(RBLN)), st.booleans(), max_size=2)),
        "rbln_values": draw(st.fixed_dictionaries({}, optional=RBLN_VALUE_CHOICES)),
        "cc": draw(
            st.dictionaries(st.sampled_from(["mode", "backend"]), st.sampled_from([1, 3, "x"]), max_size=2)
        ),
    }


@st.composite
def rbln_options(draw: st.DrawFn, rbln: dict[str, Any]) -> list[list[str]]:
    """RBLN options as --rbln-* flags, as one --additional-config JSON, or as dotted keys."""
    if not rbln:
        return []
    style = draw(st.sampled_from(["flags", "json", "dotted"]))
    if style == "json":
        return [["--additional-config", json_text(draw, rbln)]]
    if style == "dotted":
        return [[f"--additional-config.{k}", json.dumps(v)] for k, v in rbln.items()]
    parts = []
    for key, value in rbln.items():
        if key in RBLN:
            parts.append([f"--{RBLN[key]}" if value else f"--no-{RBLN[key]}"])
        else:
            parts.append(draw(rendered_option(RBLN_VALUES[key], str(value))))
    return parts


@st.composite
def argvs(draw: st.DrawFn, config: dict[str, Any]) -> list[str]:
    """One of the many argvs vLLM reads as ``config`` (plus runtime-only flags)."""
    parts: list[list[str]] = []
    for name, value in config["values"].items():
        parts.append(draw(rendered_option(name, draw(st.sampled_from(VALUE_OPTIONS[name][value])))))
    for name, on in config["switches"].items():
        parts.append([draw(spelled(name if on else f"no-{name}"))])
    parts += draw(rbln_options({**config["rbln"], **config["rbln_values"]}))
    if config["cc"]:
        if draw(st.booleans()):
            parts.append(
                [draw(st.sampled_from(["-cc", "--compilation-config"])), json_text(draw, config["cc"])]
            )
        else:
            parts += [
                [f"-cc.{k}", json.dumps(v) if not isinstance(v, str) else v] for k, v in config["cc"].items()
            ]
    parts += draw(st.lists(st.sampled_from(RUNTIME_EXTRAS), max_size=3, unique_by=lambda p: p[0]))
    parts = draw(st.permutations(parts))
    if draw(st.booleans()):
        return ["vllm", "serve", "org/model", *[t for p in parts for t in p]]
    at = draw(st.integers(0, len(parts)))
    parts = [*parts[:at], ["--model", "org/model"], *parts[at:]]
    return ["vllm", "serve", *[t for p in parts for t in p]]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), config=configs())
def test_spellings_of_one_config_share_the_key(data: st.DataObject, config: dict[str, Any]) -> None:
    first, second = data.draw(argvs(config)), data.draw(argvs(config))
    a, b = parse_server_argv(first), parse_server_argv(second)
    assert (a.model, a.revision, a.settings) == (b.model, b.revision, b.settings), (first, second)
    assert a.unknown == b.unknown == ()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), config=configs())
def test_one_changed_value_changes_the_key(data: st.DataObject, config: dict[str, Any]) -> None:
    changed = json.loads(json.dumps(config))
    what = data.draw(st.sampled_from(["value", "switch", "rbln", "cc"]))
    if what == "value":
        name = data.draw(st.sampled_from(sorted(VALUE_OPTIONS)))
        others = [v for v in VALUE_OPTIONS[name] if v != config["values"].get(name, object())]
        changed["values"][name] = data.draw(st.sampled_from(others))
    elif what == "switch":
        name = data.draw(st.sampled_from(SWITCHES))
        changed["switches"][name] = not config["switches"].get(name, False)
    elif what == "rbln":
        key = data.draw(st.sampled_from(sorted(RBLN)))
        changed["rbln"][key] = not config["rbln"].get(key, False)
    else:
        changed["cc"]["mode"] = config["cc"].get("mode", 0) + 1 if config["cc"].get("mode") != "x" else 2
    a, b = parse_server_argv(data.draw(argvs(config))), parse_server_argv(data.draw(argvs(changed)))
    assert (a.model, a.revision, a.settings) != (b.model, b.revision, b.settings)


# --------------------------------------------------------------------------------------------------
# --rbln-* flags and additional_config (vllm-rbln's merge)


def test_rbln_flags_are_additional_config_keys() -> None:
    flag = settings_of("m --rbln-use-w8a8 --rbln-decode-batch-bucket-limit 8")
    as_json = settings_of('m --additional-config \'{"use_w8a8": true, "decode_batch_bucket_limit": 8}\'')
    dotted = settings_of(
        "m --additional-config.use_w8a8 true --additional-config.decode_batch_bucket_limit 8"
    )
    assert (
        flag == as_json == dotted == {"additional_config": {"decode_batch_bucket_limit": 8, "use_w8a8": True}}
    )


def test_additional_config_merges_in_argv_order_with_dotted_last() -> None:
    assert settings_of(
        "m --additional-config '{\"a\": 1}' --rbln-use-w8a8 --additional-config '{\"a\": 2}'"
    ) == {"additional_config": {"a": 2, "use_w8a8": True}}
    # the dotted --additional-config.KEY is appended at the end of the argv: it wins over a later flag
    assert settings_of("m --additional-config.use_w8a8 false --rbln-use-w8a8")["additional_config"] == {
        "use_w8a8": False
    }
    # a string replaces the dict; a later --rbln-* flag starts a new dict
    assert settings_of("m --rbln-use-w8a8 --additional-config foo") == {"additional_config": "foo"}
    assert settings_of("m --additional-config foo --rbln-use-w8a8") == {
        "additional_config": {"use_w8a8": True}
    }


def test_rbln_options_that_do_not_change_the_compile_are_left_out() -> None:
    base = settings_of("m")
    assert (
        settings_of(
            "m --no-rbln-use-custom-sampler --rbln-sub-block-size 16 --no-rbln-enable-sub-block-cache"
        )
        == base
    )
    assert (
        settings_of('m --additional-config \'{"use_custom_sampler": false, "prefix_block_size": 4}\'') == base
    )
    assert settings_of("m --additional-config '{}'") == base


def test_optimum_overrides_runtime_keys_and_legacy_names() -> None:
    overrides = '{"device": [0, 1], "tensor_parallel_size": 2, "sub": [{"device": 3, "create_runtimes": true, "x": 1}]}'
    expected = {"optimum_overrides": {"sub": [{"x": 1}], "tensor_parallel_size": 2}}
    assert settings_of(f"m --rbln-optimum-overrides '{overrides}'")["additional_config"] == expected
    legacy = settings_of(f"m --additional-config '{{\"rbln_config\": {overrides}}}'")
    assert legacy["additional_config"] == expected
    # vllm-rbln resolves the former name last: its value wins over the new name's
    both = settings_of('m --additional-config \'{"rbln_config": {"a": 1}, "optimum_overrides": {"a": 2}}\'')
    assert both["additional_config"] == {"optimum_overrides": {"a": 1}}
    assert settings_of("m --rbln-optimum-overrides '{\"kvcache_num_blocks\": 9}'") == {
        "additional_config": {"optimum_overrides": {}}
    }


# --------------------------------------------------------------------------------------------------
# JSON values: canonical form, runtime keys


def test_json_key_order_and_spacing_do_not_matter() -> None:
    a = settings_of('m -cc \'{"mode": 3, "pass_config": {"b": 1, "a": 2}}\'')
    b = settings_of('m --compilation-config \'{ "pass_config":{"a":2,"b":1} , "mode":3 }\'')
    c = settings_of("m -cc.pass_config.a 2 --compilation_config.mode=3")
    d = settings_of("m -cc.mode 3 -cc.pass_config.b 1 -cc.pass_config.a 2")
    assert a == b == d
    assert c == {"compilation_config": {"mode": 3}}  # two spellings, two JSONs: the later one wins whole
    assert list(a["compilation_config"]) == ["mode", "pass_config"]
    assert list(a["compilation_config"]["pass_config"]) == ["a", "b"]


def test_config_dataclass_json_reads_human_numbers() -> None:
    assert settings_of('m -cc \'{"max_cudagraph_capture_size": 4k, "s": "4k"}\'') == {
        "compilation_config": {"max_cudagraph_capture_size": 4000, "s": "4k"}
    }
    with pytest.raises(ConfigError):  # a plain JSON option does not
        serve("m --speculative-config '{\"n\": 4k}'")


def test_transfer_config_wiring_is_stripped() -> None:
    def kv(extra: dict[str, Any], **top: Any) -> dict[str, Any]:
        config = {
            "kv_connector": "RblnNixlConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        return settings_of(f"m --kv-transfer-config '{json.dumps({**config, **top})}'")

    pod_a = kv({"handshake_port": 1, "proxy_ip": "a", "backends": ["UCX"]}, kv_ip="10.0.0.1", kv_port=1, engine_id="a",
               kv_rank=0)  # fmt: skip
    pod_b = kv({"handshake_port": 2, "proxy_ip": "b", "backends": ["UCX"]}, kv_ip="10.0.0.2", kv_port=2, engine_id="b",
               kv_rank=1)  # fmt: skip
    assert pod_a == pod_b == {
        "kv_transfer_config": {
            "kv_connector": "RblnNixlConnector", "kv_connector_extra_config": {"backends": ["UCX"]}, "kv_role": "kv_both",
        }
    }  # fmt: skip
    # what the transfer does is kept
    assert kv({"cpu_bytes_to_use_per_rank": 1}) != kv({"cpu_bytes_to_use_per_rank": 2})
    assert kv({}, kv_buffer_size=1e9) != kv({}, kv_buffer_size=2e9)
    # MultiConnector children are KVTransferConfig dicts too
    children = [
        {"kv_connector": "A", "kv_port": 5, "engine_id": "x", "kv_connector_extra_config": {"notify_port": 9}}
    ]
    assert kv({"connectors": children})["kv_transfer_config"]["kv_connector_extra_config"] == {
        "connectors": [{"kv_connector": "A", "kv_connector_extra_config": {}}]
    }
    events = settings_of(
        'm --kv-events-config \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\''
    )
    assert events == {"kv_events_config": {"enable_kv_cache_events": True}}


def test_other_json_options_keep_every_key() -> None:
    """hf_overrides of DeepSeek-style models carry *_rank and *_port-like names that shape the graph."""
    overrides = '{"kv_lora_rank": 512, "q_lora_rank": 1536, "host": "h", "max_position_embeddings": 4096}'
    assert settings_of(f"m --hf-overrides '{overrides}'") == {"hf_overrides": json.loads(overrides)}
    assert settings_of("m --hf-overrides '{\"kv_lora_rank\": 512}'") != settings_of(
        "m --hf-overrides '{\"kv_lora_rank\": 256}'"
    )
    assert (
        settings_of('m --speculative-config \'{"method": "ngram", "port": 1}\'')["speculative_config"]["port"]
        == 1
    )


# --------------------------------------------------------------------------------------------------
# values, -O, dotted args, --config, errors


def test_values_are_read_as_vllm_types_them() -> None:
    assert settings_of("m -tp 02 --gpu-memory-utilization 0.90 --max-model-len 4k --max-num-batched-tokens 2K") == {
        "gpu_memory_utilization": 0.9, "max_model_len": 4000, "max_num_batched_tokens": 2048, "tensor_parallel_size": 2,
    }  # fmt: skip
    assert (
        settings_of("m --max-model-len auto") == settings_of("m --max-model-len -1") == {"max_model_len": -1}
    )
    # text stays text: "01" and "1" are different tokenizers, "0123" a revision
    assert settings_of("m --tokenizer 01") != settings_of("m --tokenizer 1")
    assert settings_of("m --tokenizer 01") == {"tokenizer": "01"}
    assert serve("m --revision 0123").revision == "0123"
    assert serve("m --revision None").revision is None
    assert (
        settings_of("m --quantization None") == settings_of("m --quantization ''") == {"quantization": None}
    )
    assert settings_of("m --device-ids '0, 1'") == {"device_ids": [0, 1]}
    assert settings_of("m --moe-backend Deep-Gemm") == {"moe_backend": "deep_gemm"}


def test_non_finite_numbers_can_be_keyed() -> None:
    found = settings_of("m --gpu-memory-utilization nan -cc '{\"x\": Infinity}'")
    assert found == {
        "gpu_memory_utilization": {"$float": "nan"},
        "compilation_config": {"x": {"$float": "inf"}},
    }
    canonical_json(found)  # key.py hashes with allow_nan=False
    assert not any(isinstance(v, float) and math.isnan(v) for v in found.values())


@pytest.mark.parametrize(
    "spelling", ["-O3", "-O 3", "-O=3", "--optimization-level 3", "--optimization_level=3", "-O1 -O3"]
)
def test_optimization_level_forms(spelling: str) -> None:
    assert settings_of(f"m {spelling}") == {"optimization_level": "3"}


def test_optimization_level_oddities() -> None:
    assert settings_of("m -Odecode") == {"optimization_level": "decode"}
    # "-O 4": vLLM rewrites -O only before 0-3; argparse then refuses "-O" (kept in the key, fail closed)
    odd = serve("m -O 4")
    assert odd.unknown == ("O",)
    assert odd.settings == {}
    assert odd.argv_without(RUNTIME_ONLY) == ["m", "-O", "4"]


def test_dotted_args() -> None:
    assert settings_of("m -cc.custom_ops+ a,b -cc.custom_ops+=c") == {
        "compilation_config": {"custom_ops": ["a", "b", "c"]}
    }
    # appended after everything else: the dotted form replaces an earlier JSON of the same spelling...
    assert settings_of('m -cc.mode 1 -cc \'{"mode": 2, "backend": "x"}\'') == {
        "compilation_config": {"mode": 1}
    }
    # ...and each spelling is its own JSON, the later-seen one winning whole
    assert settings_of("m --compilation-config.mode 3 -cc.backend x") == {
        "compilation_config": {"backend": "x"}
    }
    assert settings_of("m --hf-overrides.max_position_embeddings 80g") == {
        "hf_overrides": {"max_position_embeddings": 80_000_000_000}
    }
    assert settings_of("m --compilation_config.pass_config.x_y a_b") == {
        "compilation_config": {"pass_config": {"x_y": "a_b"}}
    }
    with pytest.raises(ConfigError, match="no value"):
        serve("m -cc.mode")


def write_config(tmp_path: Path, text: str, name: str = "serve.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_config_file_precedence(tmp_path: Path) -> None:
    config = write_config(
        tmp_path, "tensor-parallel-size: 2\nmax_model_len: 4k\nenforce-eager: true\nport: 9000\n"
    )
    from_file = serve(f"m --config {config}")
    assert from_file.settings == {"enforce_eager": True, "max_model_len": 4000, "tensor_parallel_size": 2}
    assert from_file.port == 9000
    # the command line wins wherever --config sits
    assert settings_of(f"m -tp 4 --config {config}") == settings_of(f"m --config {config} -tp 4")
    assert settings_of(f"m --config {config} -tp 4")["tensor_parallel_size"] == 4
    # the file's settings equal the same flags on the command line
    assert from_file.settings == settings_of("m -tp 2 --max-model-len 4000 --enforce-eager")


def test_config_file_values(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        "model: org/from-file\nenforce-eager: false\nquantization: null\ncudagraph-capture-sizes: [1, 2]\n"
        "compilation-config: {mode: 3}\nrbln-use-w8a8: true\n",
    )
    found = serve(f"--config {config}")
    assert found.model == "org/from-file"
    # false is dropped for `vllm serve` (the top-level parser has no --no-KEY), null is read as "None"
    assert found.settings == {
        "additional_config": {"use_w8a8": True}, "compilation_config": {"mode": 3}, "cudagraph_capture_sizes": [1, 2],
        "quantization": None,
    }  # fmt: skip
    # the api_server's parser is the serve parser itself: there a false becomes --no-KEY
    api = parse_server_argv(["python3", "-m", "vllm.entrypoints.openai.api_server", "--config", config])
    assert api.model == "org/from-file"
    assert api.settings["enforce_eager"] is False
    # --config=FILE is not loaded by vLLM at all
    assert settings_of(f"m --config={config}") == {}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("m --max-num 2", "ambiguous option"),
        ("m -tp", "expected one argument"),
        ("m -tp abc", "invalid int value"),
        ("m --config a.yaml --config b.yaml", "more than one --config"),
        ("m --config", "no file"),
        ("m --config missing.yaml", "cannot read"),
        ("m --config serve.txt", "not a .yaml/.yml"),
        ("--served-model-name x", "first positional"),
        ("--model", "--model has no value"),
        ("m extra", "unrecognized arguments"),
        ("m --enforce-eager=1", "ignored explicit argument"),
        ('m --lora-modules \'{"name": "x"}\'', "Invalid fields"),
    ],
)
def test_argvs_vllm_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str, message: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message) as raised:
        serve(line)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("text", "message"), [("tp: [2\n", "not valid YAML"), ("- 2\n", "not a mapping"), ("", "not a mapping")]
)
def test_bad_config_files(tmp_path: Path, text: str, message: str) -> None:
    config = write_config(tmp_path, text)
    with pytest.raises(ConfigError, match=message):
        serve(f"m --config {config}")


def test_unknown_flags_fail_closed() -> None:
    found = serve(
        "m --future-flag 3 -tp 2 --api-key s3cret --hf-token=tok --port 9000 --served-model-name a b"
    )
    assert found.unknown == ("future-flag",)
    assert found.settings == {"tensor_parallel_size": 2}
    # which token a newer vLLM reads as whose value is unknowable: the argv is kept, in order, with
    # the secrets masked...
    assert found.unknown_argv == (
        "m", "--future-flag", "3", "-tp", "2", "--api-key", "<secret>", "--hf-token=<secret>", "--port", "9000",
        "--served-model-name", "a", "b",
    )  # fmt: skip
    # ...and what the key takes of it leaves the known runtime-only flags out, values included
    assert found.argv_without(RUNTIME_ONLY) == ["m", "--future-flag", "3", "-tp", "2"]
    assert serve("m --future-flag 3 --port 1").argv_without(RUNTIME_ONLY) == ["m", "--future-flag", "3"]

    def keyed(text: str) -> list[str]:
        return serve(text).argv_without(RUNTIME_ONLY)

    assert keyed("m --future-flag 3") != keyed("m --future-flag 4")
    assert keyed("--future-flag x") != keyed("x --future-flag")
    assert keyed("m --future-flag --port=1 -tp 2") == keyed("m --future-flag --port 2 -tp 2")
    with pytest.raises(ConfigError, match="unrecognized arguments"):
        serve("m extra")  # no unknown option: nothing a newer vLLM could mean by it


# --------------------------------------------------------------------------------------------------
# runtime-only flags, the model, the forms vLLM is started by


def test_runtime_only_flags_are_dropped() -> None:
    found = serve(
        "m --port 9001 --host 0.0.0.0 --served-model-name a b --api-key s --hf-token t -tp 2 --headless"
    )
    assert found.settings == {"tensor_parallel_size": 2}
    assert found.dropped == ("api-key", "headless", "hf-token", "host", "port", "served-model-name")
    assert (found.port, found.host) == (9001, "0.0.0.0")
    assert set(found.dropped) <= RUNTIME_ONLY
    assert serve("m").port == 8000


def test_model_sources() -> None:
    assert serve("org/m").model == "org/m"
    assert serve("--model org/m -tp 2").model == "org/m"
    assert serve("--model=org/m").model == "org/m"
    assert serve("--port 1 org/m").model == "org/m"
    assert serve("--model a --model b").model == "a"  # the first --model becomes the positional, which wins
    assert serve("").model is None  # vLLM would serve its default model; key.py refuses to guess
    assert serve("org/m --revision abc").settings == {}
    assert serve("org/m --revision abc").revision == "abc"
    assert serve("org/m").pipeline_parallel_size == 1
    assert serve("org/m -pp 4").pipeline_parallel_size == 4


@pytest.mark.parametrize(
    "argv",
    [
        ["vllm", "serve", "org/m", "-tp", "2"],
        ["/usr/bin/vllm", "serve", "org/m", "-tp", "2"],
        ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "org/m", "-tp", "2"],
        ["python3", "-m", "vllm.entrypoints.cli.main", "serve", "org/m", "-tp", "2"],
        ["/usr/bin/python3.11", "-m", "vllm.entrypoints.cli.main", "serve", "--model", "org/m", "-tp", "2"],
    ],
)
def test_vllm_forms(argv: list[str]) -> None:
    found = parse_server_argv(argv)
    assert (found.kind, found.model, dict(found.settings)) == ("vllm", "org/m", {"tensor_parallel_size": 2})


def test_api_server_ignores_the_positional() -> None:
    found = parse_server_argv(
        ["python3", "-m", "vllm.entrypoints.openai.api_server", "org/a", "--model", "org/b"]
    )
    assert found.model == "org/b"


@pytest.mark.parametrize(
    "argv",
    [
        ["vllm", "chat"],
        ["python", "-m", "http.server"],
        ["my-server", "--port", "1", "--model", "x"],
        ["vllm"],
    ],
)
def test_other_servers(argv: list[str]) -> None:
    found = parse_server_argv(argv)
    assert found.kind == "other"


def test_other_servers_are_keyed_on_their_argv_minus_runtime_flags() -> None:
    found = parse_server_argv(["/opt/bin/srv", "--model", "x", "--port", "8080", "--tp=2"])
    assert found.settings == {"argv": ["srv", "--model", "x", "--tp=2"]}
    assert (found.dropped, found.port) == (("port",), 8080)


def test_empty_argv_is_refused() -> None:
    with pytest.raises(ConfigError, match="no server command"):
        parse_server_argv([])
