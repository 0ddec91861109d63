"""The key oracle's corpus: every ``vllm serve`` option, every variable of both servers' ``envs.py``,
spellings, model directory edits, images and pairs of options, as variants of the two bases.

Runs in the oracle's environment (tools/oracle/env.sh), because the options and variables come from
the live code, not from a hand list: the serve parser exactly as ``vllm serve`` builds it (the rbln
platform's ``pre_register_and_update`` included, tools/oracle/identity.py ``Server``), vLLM's
``envs.environment_variables`` and vllm-rbln's. What is hand-written here is only the value an
option is tried at where its own default or choices do not give one (``_HINTS``: a JSON option
needs a document, a path option a path), the spellings, the model edits and the images: each says
what it stands for. scripts/oracle writes the result to tests/data/oracle/corpus-RELEASE.json.

Each option is tried, against each base, at every choice but its default (three at most), at a
value of its kind otherwise, and at its own default given explicitly; each variable at a value other
than its default and at its default. Pairs of options at those values (seeded) catch what one
option changes of another's reading.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cachemgr_testkit import oracle

# Options that are not the server's configuration: help, and the positional model (a spelling).
_SKIP = {"help", "model_tag"}
# Values for options whose default and choices give none worth trying (every other option is tried
# at values of its kind: see _values). A value the server refuses is an answer too ("refused").
_HINTS: dict[str, list[str]] = {
    "model": ["{model}"],
    "tokenizer": ["{model}"],
    "hf_config_path": ["{model}"],
    "download_dir": ["/tmp/cachemgr-oracle-downloads"],
    "revision": ["main", "0123456789abcdef0123456789abcdef01234567"],
    "code_revision": ["main"],
    "tokenizer_revision": ["main"],
    "max_model_len": ["1024", "4k"],
    "quantization": ["fp8"],
    "kv_cache_dtype": ["fp8"],
    "hf_overrides": ['{"rope_theta": 20000.0}'],
    "override_generation_config": ['{"temperature": 0.5}'],
    "model_loader_extra_config": ['{"enable_multithread_load": true}'],
    "pt_load_map_location": ["cuda:0"],
    "additional_config": [
        '{"enforce_model_fp32": true}',
        '{"optimum_overrides": {"tensor_parallel_size": 1}}',
    ],
    "compilation_config": ['{"mode": 0}', '{"level": 3}'],
    "speculative_config": ['{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}'],
    "kv_transfer_config": ['{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'],
    "kv_events_config": ['{"enable_kv_cache_events": true}'],
    "structured_outputs_config": ['{"backend": "xgrammar"}'],
    "profiler_config": ['{"profiler": "torch", "torch_profiler_dir": "/tmp/profiles"}'],
    "attention_config": ['{"backend": "FLASH_ATTN"}'],
    "limit_mm_per_prompt": ['{"image": 2}'],
    "mm_processor_kwargs": ['{"num_crops": 4}'],
    "lora_modules": ["a={model}"],
    "served_model_name": ["served"],
    "max_num_batched_tokens": ["256", "4096"],
    "max_num_seqs": ["4", "1"],
    "block_size": ["16", "2048"],
    "gpu_memory_utilization": ["0.8", "0.92"],
    "num_gpu_blocks_override": ["64"],
    "tensor_parallel_size": ["2"],
    "pipeline_parallel_size": ["2"],
    "data_parallel_size": ["2"],
    "data_parallel_rank": ["1"],
    "data_parallel_start_rank": ["1"],
    "rbln_num_devices_per_local_rank": ["2"],
    "rbln_sub_block_size": ["128"],
    "rbln_optimum_overrides": ['{"tensor_parallel_size": 1}'],
    "rbln_decode_batch_bucket_manual_buckets": ["1", "2", "4"],
    "optimization_level": ["0", "3"],
    "seed": ["1"],
}
# Spellings: each against a reference written the plain way (the reference is a variant too).
_SPELLINGS: list[tuple[str, list[str], list[str]]] = [
    ("max-model-len", ["--max-model-len", "1024"], ["--max-model-len=1024"]),
    ("max_model_len", ["--max-model-len", "1024"], ["--max_model_len", "1024"]),
    ("max-model-len 1k", ["--max-model-len", "1024"], ["--max-model-len", "1k"]),
    ("-tp", ["--tensor-parallel-size", "2"], ["-tp", "2"]),
    ("-tp=", ["--tensor-parallel-size", "2"], ["-tp=2"]),
    ("abbreviation", ["--max-num-seqs", "4"], ["--max-num-se", "4"]),
    ("dtype half", ["--dtype", "float16"], ["--dtype", "half"]),
    ("float 0.80", ["--gpu-memory-utilization", "0.8"], ["--gpu-memory-utilization", "0.80"]),
    ("json order", ["--hf-overrides", '{"rope_theta": 20000.0, "rms_norm_eps": 1e-6}'],
     ["--hf-overrides", '{"rms_norm_eps": 1e-6,  "rope_theta": 20000.0}']),
    ("dotted json", ["--compilation-config", '{"mode": 0}'], ["--compilation-config.mode", "0"]),
    ("rbln flag = additional_config", ["--additional-config", '{"num_devices_per_local_rank": 2}'],
     ["--rbln-num-devices-per-local-rank", "2"]),
    ("bool =true", ["--enforce-eager"], ["--enforce-eager=true"]),
    ("bool -O", ["--optimization-level", "3"], ["-O3"]),
]  # fmt: skip
_WHOLE_SPELLINGS: list[tuple[str, list[str]]] = [
    ("--model instead of positional", ["vllm", "serve", "--model", "{model}"]),
]
# Edits of the model directory (the server reads it in place; the path stays the same).
_MODEL_EDITS: list[tuple[str, list[dict[str, Any]]]] = [
    ("config.json rope_theta", [{"op": "json_set", "file": "config.json", "key": "rope_theta", "value": 20000.0}]),
    ("config.json num_hidden_layers", [{"op": "json_set", "file": "config.json", "key": "num_hidden_layers", "value": 3}]),
    ("config.json max_position_embeddings", [{"op": "json_set", "file": "config.json", "key": "max_position_embeddings", "value": 8192}]),
    ("config.json torch_dtype", [{"op": "json_set", "file": "config.json", "key": "torch_dtype", "value": "float16"}]),
    ("config.json transformers_version only", [{"op": "json_set", "file": "config.json", "key": "transformers_version", "value": "5.0.0"}]),
    ("config.json _name_or_path only", [{"op": "json_set", "file": "config.json", "key": "_name_or_path", "value": "/elsewhere"}]),
    ("config.json rewritten, same content", [{"op": "reindent", "file": "config.json"}]),
    ("config.json quantization_config", [{"op": "json_set", "file": "config.json", "key": "quantization_config", "value": {"quant_method": "fp8", "activation_scheme": "dynamic"}}]),
    ("hf_quant_config.json added", [{"op": "write_json", "file": "hf_quant_config.json", "value": {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None}}}]),
    ("quantize_config.json added", [{"op": "write_json", "file": "quantize_config.json", "value": {"bits": 4, "group_size": 128, "desc_act": False}}]),
    ("generation_config.json temperature", [{"op": "json_set", "file": "generation_config.json", "key": "temperature", "value": 0.9}]),
    ("generation_config.json removed", [{"op": "remove", "file": "generation_config.json"}]),
    ("tokenizer_config.json model_max_length", [{"op": "json_set", "file": "tokenizer_config.json", "key": "model_max_length", "value": 1024}]),
    ("tokenizer_config.json chat_template", [{"op": "json_set", "file": "tokenizer_config.json", "key": "chat_template", "value": "{{ messages }}"}]),
    ("weights: same size, other bytes", [{"op": "weights", "file": "model.safetensors"}]),
    ("weights: another shape", [{"op": "weights_tensors", "file": "model.safetensors", "tensors": [["model.embed_tokens.weight", [256, 32]]]}]),
    ("weights: touched only", [{"op": "touch", "file": "model.safetensors"}]),
    ("README.md added", [{"op": "write_text", "file": "README.md", "value": "# a model card\n"}]),
    ("preprocessor_config.json added", [{"op": "write_json", "file": "preprocessor_config.json", "value": {"image_processor_type": "CLIPImageProcessor"}}]),
]  # fmt: skip
# Other images and NPUs: what the pod's image or node says, to both sides.
_IMAGES: list[tuple[str, dict[str, Any]]] = [
    ("compiler 0.12.5 (same major.minor)", {"image": {"compiler": "0.12.5"}}),
    ("compiler 0.13.0", {"image": {"compiler": "0.13.0"}}),
]
_NPUS = {
    "vllm": ["RBLN-CR03", " RBLN-CR13", "rbln-cr13"],
    "optimum": ["RBLN-CA12", " RBLN-CA25", "rbln-ca25"],
}
_PAIRS_PER_BASE = 60

# vllm-rbln 0.11.2 (vLLM 0.24.0) where it differs. Its additional_config is a dict vLLM hashes whole;
# the optimum directory name reads its "rbln_config" only, less the runtime-only keys (dispatch.py
# 39-96), and the compile takes "rbln_config" as the overrides (model_base.py 182). It has no --rbln-*
# option, so the spelling of one is not tried. Its compiler is a 0.11 (the manifest's).
_HINTS_0_11 = {
    **_HINTS,
    "additional_config": [
        '{"enforce_model_fp32": true}',
        '{"rbln_config": {"tensor_parallel_size": 1}}',
        '{"rbln_config": {"create_runtimes": false}}',
    ],
}
_SPELLINGS_0_11 = [s for s in _SPELLINGS if s[0] != "rbln flag = additional_config"]
_IMAGES_0_11: list[tuple[str, dict[str, Any]]] = [
    ("compiler 0.11.5 (same major.minor)", {"image": {"compiler": "0.11.5"}}),
    ("compiler 0.12.0", {"image": {"compiler": "0.12.0"}}),
]
# By the release's model-path rule (oracle.model_impl_rule, read from its code), not by its name:
# vllm-rbln 0.12's own --model-impl and RBLNConfig, or 0.11's variable alone and dict.
_BY_SHAPE: dict[str, dict[str, Any]] = {
    "flag_then_env": {"hints": _HINTS, "spellings": _SPELLINGS, "images": _IMAGES},
    "env": {"hints": _HINTS_0_11, "spellings": _SPELLINGS_0_11, "images": _IMAGES_0_11},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--release", help="the vllm-rbln release installed here (default: read it)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import fields
    import identity  # the same parser the oracle runs

    identity.set_release(args.release)
    identity._clean_environment(Path("/nonexistent-home"), Path("/nonexistent-cache"))
    serve = _serve_parser(identity.Server().parser)
    release = identity.release()
    structured = fields.structured_options(
        serve, release.structured_classes(), list(oracle.bases(release.name))
    )
    variants = list(corpus(serve, random.Random(args.seed), release.name, structured))
    ids = [v["id"] for v in variants]
    if len(ids) != len(set(ids)):
        raise SystemExit(
            f"corpus: two variants share an id: {sorted({i for i in ids if ids.count(i) > 1})[:5]}"
        )
    document = {"seed": args.seed, "structured": structured, "variants": variants}
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"corpus: {len(variants)} variants", file=sys.stderr)
    return 0


def _serve_parser(top: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]  # type: ignore[no-any-return]


def corpus(
    serve: argparse.ArgumentParser, rng: random.Random, release: str, structured: dict[str, dict[str, Any]]
) -> Iterator[dict[str, Any]]:
    options = [a for a in serve._actions if a.dest not in _SKIP and a.option_strings]
    bases = oracle.bases(release)
    own = _BY_SHAPE[oracle.model_impl_rule(release)]
    tried: dict[str, list[tuple[str, list[str]]]] = {base: [] for base in bases}
    for base in bases:
        for action in options:
            flag = _long(action)
            for label, words in _values(action, own["hints"]):
                variant = {"id": f"{base}/option/{flag} {label}", "base": base, "argv": words, "kind": "option",
                           "dest": action.dest}  # fmt: skip
                if label != "(default)":
                    tried[base].append((f"{flag} {label}", words))
                yield variant
        yield from _fields(base, serve, structured)
        yield from _spellings(base, own["spellings"], bases)
        yield from _environment(base)
        yield from _models(base)
        yield from _images(base, own["images"])
        yield from _pairs(base, tried[base], rng)


def _fields(
    base: str, serve: argparse.ArgumentParser, structured: dict[str, dict[str, Any]]
) -> Iterator[dict[str, Any]]:
    """Every field of every structured option, alone at a value of its type other than its default
    (tools/oracle/fields.py), on top of the option's seed where it has one (then the variant at the
    seed is the reference: the field's own change is what is judged)."""
    import fields

    flags = {a.dest: _long(a) for a in serve._actions if a.option_strings}
    for dest, spec in structured.items():
        on = spec["bases"].get(base)
        if on is None:
            continue
        flag = flags[dest]
        seed = fields.SEEDS.get(dest, {} if spec["none_default"] else None)
        ref = None
        if seed is not None:
            ref = f"{base}/field/{flag} (seed)"
            yield {
                "id": ref,
                "base": base,
                "argv": [flag, json.dumps(seed)],
                "kind": "field-seed",
                "dest": dest,
            }
        for path, field in on["fields"].items():
            # a type of few values: each of them but the default; else the one value of its type
            others = [v for v in field.get("values") or () if v != field["default"] and v != field["value"]]
            for value in [field["value"], *others]:
                doc = fields.nest(seed or {}, path, value)
                variant = {"id": f"{base}/field/{flag} {path}={json.dumps(value)}", "base": base,
                           "argv": [flag, json.dumps(doc)], "kind": "field", "dest": dest, "field": path,
                           "value": value}  # fmt: skip
                if ref is not None:
                    variant["ref"] = ref
                yield variant


def _long(action: argparse.Action) -> str:
    return next(o for o in action.option_strings if o.startswith("--"))


def _values(action: argparse.Action, hints: dict[str, list[str]]) -> Iterator[tuple[str, list[str]]]:
    """(label, argv words) for each value an option is tried at, its default last."""
    flag = _long(action)
    kind = type(action).__name__
    default = action.default
    if action.nargs == 0:
        if kind in {"BooleanOptionalAction", "_StoreRblnBool"}:
            negative = next((o for o in action.option_strings if o.startswith("--no-")), None)
            # The spelling that sets the default is the option at its default; None has neither.
            yield ("(default)" if default is True else "on", [flag])
            if negative:
                yield ("(default)" if default is False else "off", [negative])
        else:
            yield ("set", [flag])
        return
    values: list[str] = list(hints.get(action.dest, []))
    if not values and action.choices is not None:
        values = [str(c) for c in action.choices if c != default and str(c) != str(default)][:3]
    if not values:
        values = _of_kind(default)
    for value in values:
        words = [flag, *value.split(" ")] if action.nargs in ("+", "*") else [flag, value]
        yield (value, words)
    shown = _default_text(default)
    if shown is not None and action.nargs not in ("+", "*"):
        yield ("(default)", [flag, shown])


def _of_kind(default: Any) -> list[str]:
    if isinstance(default, bool) or default is None:
        return ["1"]
    if isinstance(default, int):
        return [str(default * 2 if default else 2)]
    if isinstance(default, float):
        return [str(round(default / 2, 3) if default else 0.5)]
    if isinstance(default, str):
        return ["other" if default else "x"]
    if isinstance(default, (dict, list)):
        return ["{}"] if isinstance(default, dict) else ["x"]
    return ["1"]


def _default_text(default: Any) -> str | None:
    """The default as a user would type it, where it has a plain spelling."""
    if isinstance(default, enum.Enum):
        default = default.value
    if isinstance(default, bool) or default is None:
        return None
    if isinstance(default, (int, float, str)):
        return str(default)
    if isinstance(default, (dict, list)):
        return json.dumps(default)
    return None


def _spellings(
    base: str, spellings: list[tuple[str, list[str], list[str]]], bases: dict[str, dict[str, Any]]
) -> Iterator[dict[str, Any]]:
    for label, reference, spelled in spellings:
        ref_id = f"{base}/spelling-ref/{label}"
        yield {"id": ref_id, "base": base, "argv": reference, "kind": "spelling-ref"}
        yield {
            "id": f"{base}/spelling/{label}",
            "base": base,
            "argv": spelled,
            "ref": ref_id,
            "kind": "spelling",
        }
    for label, argv in _WHOLE_SPELLINGS:
        full = [*argv, *bases[base]["argv"][3:]]
        yield {"id": f"{base}/spelling/{label}", "base": base, "argv_full": full, "kind": "spelling"}


def _environment(base: str) -> Iterator[dict[str, Any]]:
    import vllm.envs as vllm_envs
    import vllm_rbln.envs as rbln_envs

    names: dict[str, Any] = {}
    for module in (vllm_envs, rbln_envs):
        for name, read in module.environment_variables.items():
            if name in names or name in _ENV_FIXED:
                continue
            saved = os.environ.pop(name, None)
            try:
                names[name] = read()
            except Exception:  # a variable whose default cannot be read without others: tried at "1"
                names[name] = None
            finally:
                if saved is not None:
                    os.environ[name] = saved
    for name, default in sorted(names.items()):
        for label, value in _env_values(name, default):
            yield {
                "id": f"{base}/env/{name}={value}{label}",
                "base": base,
                "env": {name: value},
                "kind": "env",
            }


# Set by the oracle itself for every run (identity.py _fixed): not varied.
_ENV_FIXED = {"VLLM_CACHE_ROOT", "VLLM_CONFIGURE_LOGGING", "VLLM_NO_USAGE_STATS", "RBLN_FORCE_NPU_NAME"}


def _env_values(name: str, default: Any) -> list[tuple[str, str]]:
    if isinstance(default, bool):
        return [("", "0" if default else "1"), (" (default)", "1" if default else "0")]
    if isinstance(default, int):
        return [("", str(default * 2 if default else 1)), (" (default)", str(default))]
    if isinstance(default, float):
        return [("", str(default * 2 if default else 1.0))]
    if isinstance(default, str) and default:
        return [("", "other"), (" (default)", default)]
    return [("", "1")]


def _models(base: str) -> Iterator[dict[str, Any]]:
    for label, edits in _MODEL_EDITS:
        yield {"id": f"{base}/model/{label}", "base": base, "model": edits, "kind": "model"}
    # --hf-config-path: the configs read from a directory beside the model, edited there in place.
    ref = f"{base}/model/--hf-config-path beside, the same config"
    argv = ["--hf-config-path", "{model}.cfg"]
    yield {"id": ref, "base": base, "argv": argv, "model": [{"op": "sidecar", "file": "config.json"}],
           "kind": "model"}  # fmt: skip
    for key, value in (("rope_theta", 20000.0), ("num_hidden_layers", 3)):
        yield {"id": f"{base}/model/--hf-config-path beside, {key} changed there", "base": base, "argv": argv,
               "model": [{"op": "sidecar", "file": "config.json", "set": {key: value}}], "ref": ref,
               "kind": "model"}  # fmt: skip


def _images(base: str, images: list[tuple[str, dict[str, Any]]]) -> Iterator[dict[str, Any]]:
    for label, change in images:
        yield {"id": f"{base}/image/{label}", "base": base, **change, "kind": "image"}
    for npu in _NPUS[base]:
        yield {"id": f"{base}/npu/{npu!r}", "base": base, "env": {"RBLN_FORCE_NPU_NAME": npu}, "kind": "npu",
               "cold": True}  # fmt: skip


def _pairs(base: str, tried: list[tuple[str, list[str]]], rng: random.Random) -> Iterator[dict[str, Any]]:
    seen: set[str] = set()
    while len(seen) < _PAIRS_PER_BASE:
        (a, wa), (b, wb) = rng.sample(tried, 2)
        vid = f"{base}/pair/{a} + {b}"
        if vid not in seen:
            seen.add(vid)
            yield {"id": vid, "base": base, "argv": [*wa, *wb], "kind": "pair"}


if __name__ == "__main__":
    sys.exit(main())
