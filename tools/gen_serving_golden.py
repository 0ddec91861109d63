"""Record how the REAL `vllm serve` parser (vLLM 0.30.0 + vllm-rbln 0.12.0) reads a corpus of argvs.

``cachemgr/key/serving.py`` reads a vLLM argv without vLLM. This script is the oracle it is checked
against: it runs the real parser, built exactly as ``tools/gen_vllm_flags.py`` builds it (the same
introspection venv, the CPU platform, vllm-rbln's ``add_rbln_cli_args`` from the wheel), over
hand-picked tricky argvs and a few hundred generated ones, and writes what vLLM made of each to
``tests/data/vllm_serve_golden.json``. ``tests/test_serving.py`` replays that file in CI, where there
is no vLLM. The ``--config`` YAML files the corpus names are written to ``tests/data/vllm_configs/``;
argvs name them relative to ``tests/data``, the directory both the real parser and the tests run in.

Usage, from the repository root::

    .venv/bin/python tools/gen_serving_golden.py              # rewrite the golden file (~15 s)
    .venv/bin/python tools/gen_serving_golden.py --fuzz 5000  # differential fuzz (~20 s), writes nothing

Two forms are recorded: ``vllm serve ...`` (the ``vllm`` CLI: top-level FlexibleArgumentParser, then
the serve sub-parser, then ``ServeSubcommand.cmd``'s model_tag rule) and ``python -m
vllm.entrypoints.openai.api_server ...`` (``entry.main()``: one FlexibleArgumentParser, no model
relocation, the positional ignored). For each argv the outcome is either an error (with the message
and a category: ``unrecognized``, ``choice``, ``validation``, ``exit`` for --help, ``refused`` for
the rest) or the namespace: every option the argv set explicitly (``explicit``), which of them differ
from the parser's default (``nondefault``), their values as JSON (``additional_config`` as vllm-rbln
merged it), the model (the positional, else an explicit --model, else None where vLLM would serve its
default model) and the revision. For a config-dataclass option (``--compilation-config``...) the value
recorded is the JSON document the dataclass validator received: pydantic's result is not JSON, and
cachemgr deliberately keys the document, not the validated dataclass. The real parser's option
strings, arities and value kinds are recorded too, so the tests can check serving.py's copies.

``--fuzz N`` generates N argvs from another seed, runs them through the real parser and through
``cachemgr.key.serving``, and reports every disagreement with the same checks the tests apply.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import functools
import importlib
import io
import json
import math
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
GOLDEN = DATA / "vllm_serve_golden.json"
CONFIG_DIR = "vllm_configs"  # under DATA
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_vllm_flags as flags_tool  # noqa: E402  (the parser build and the wheel paths are shared)

API_SERVER = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
GOLDEN_SEED = 20260101
SKIP_DESTS = {"subparser", "model_tag", "_rbln_additional_config_owned", "model", "revision"}

# --------------------------------------------------------------------------------------------------
# the corpus: --config files, hand-picked argvs, generated argvs
# --------------------------------------------------------------------------------------------------

CONFIG_FILES: dict[str, str] = {
    "basic.yaml": "tensor-parallel-size: 2\nmax_model_len: 4k\nenforce-eager: true\nport: 9000\n",
    "with_model.yaml": "model: org/from-config\nmax-num-seqs: 8\n",
    "false_and_null.yaml": "enforce-eager: false\nenable-prefix-caching: false\nquantization: null\n"
    "rbln-use-custom-kernel: false\n",
    "lists_and_dicts.yaml": "cudagraph-capture-sizes: [1, 2, 4]\nserved-model-name: []\n"
    "compilation-config:\n  mode: 3\n  pass_config: {fuse_norm_quant: true}\nkv-transfer-config:\n"
    "  kv_connector: RblnNixlConnector\n  kv_role: kv_both\n  kv_port: 5600\n  kv_ip: 10.0.0.1\n",
    "dotted.yaml": "compilation-config.mode: 3\nadditional-config.use_w8a8: true\n-O: 2\n",
    "rbln.yaml": "rbln-use-w8a8: true\nrbln-decode-batch-bucket-manual-buckets: [1, 4, 8]\n"
    "additional-config: {compile_dtype: bfloat16, use_custom_sampler: false}\n",
    "served_name.yaml": "served-model-name: friendly\ntensor_parallel_size: 4\n",
    "model_and_tp.yml": "model: org/yml-model\ntensor-parallel-size: 8\nrevision: '0123'\n",
    "empty.yaml": "",
    "list.yaml": "- tensor-parallel-size\n- 2\n",
    "bad.yaml": "tensor-parallel-size: [2\n",
    "int_key.yaml": "1: 2\n",
    "dates.yaml": "hf-overrides: {released: 2024-01-01}\n",
    "not_yaml.txt": "tensor-parallel-size: 2\n",
}


def _c(form: str, line: str) -> dict[str, Any]:
    return {"form": form, "args": shlex.split(line)}


def hand_picked() -> list[dict[str, Any]]:
    """Argvs that exercise each rule of the vllm_flags docstring, and its corners."""
    cfg = f"--config {CONFIG_DIR}"
    serve = [
        # where the model comes from (relocation, positional, served-model-name check)
        "serve m", "serve", "serve --model m", "serve --model=m", "serve -tp 2 --model m --enforce-eager",
        "serve m --model other", "serve --model a --model b", "serve --model", "serve --model= m",
        "serve --port 8000 m", "serve --served-model-name x", "serve --served_model_name=x --model m",
        "serve -tp 2 --served-model-name x", "serve m --served-model-name -x", "serve m --served-model-name=-x",
        "serve m --served-model-name a b", "serve m --model_impl vllm", "serve m --model-impl=vllm",
        "serve m --mod x", "serve m --revision 0123", "serve m --revision None", "serve m --revision=",
        "serve m --tokenizer-revision 01 --code-revision 1", "serve -- m", "serve m -- -tp",
        "serve m extra", "serve m --model-loader-extra-config '{\"a\": 1}'",
        # --config
        f"serve m {cfg}/basic.yaml", f"serve {cfg}/with_model.yaml", f"serve {cfg}/basic.yaml",
        f"serve m --config={CONFIG_DIR}/basic.yaml", f"serve m {cfg}/basic.yaml {cfg}/rbln.yaml",
        "serve m --config", f"serve m {cfg}/missing.yaml", f"serve m {cfg}/bad.yaml", f"serve m {cfg}/list.yaml",
        f"serve m {cfg}/empty.yaml", f"serve m {cfg}/not_yaml.txt", f"serve m -tp 4 {cfg}/basic.yaml",
        f"serve m {cfg}/basic.yaml -tp 4", f"serve m {cfg}/false_and_null.yaml --enforce-eager",
        f"serve m {cfg}/false_and_null.yaml", f"serve m {cfg}/lists_and_dicts.yaml", f"serve m {cfg}/dotted.yaml",
        f"serve m {cfg}/rbln.yaml --rbln-no-use-w8a8", f"serve m {cfg}/rbln.yaml --no-rbln-use-w8a8",
        f"serve {cfg}/served_name.yaml", f"serve -tp 2 {cfg}/served_name.yaml", f"serve m {cfg}/int_key.yaml",
        f"serve {cfg}/model_and_tp.yml", f"serve x {cfg}/model_and_tp.yml", f"serve m {cfg}/dates.yaml",
        f"serve --model m {cfg}/served_name.yaml", f"serve m --served-model-name a {cfg}/basic.yaml",
        # spelling: underscores, -O, dotted args
        "serve m --tensor_parallel_size 2", "serve m --tensor-parallel_size=2",
        "serve m --compilation_config.pass_config.x_y a_b", "serve m -O3", "serve m -O 3", "serve m -O=3",
        "serve m -Odecode", "serve m -O 4", "serve m -O", "serve m -O0 --optimization-level 2",
        "serve m --optimization_level 1 -O2", "serve m -cc.mode 3", "serve m --compilation-config.mode=3",
        "serve m -cc '{\"mode\": 1, \"backend\": \"x\"}' -cc.mode 3",
        "serve m --compilation-config.mode 3 -cc.backend x", "serve m -cc.mode 3 --compilation-config.backend x",
        "serve m --additional-config.use_w8a8 true --rbln-use-custom-kernel",
        "serve m --additional-config '{\"a\": 1}' --additional-config.b 2",
        "serve m -cc.cudagraph_capture_sizes+ 1,2 -cc.cudagraph_capture_sizes+=4",
        "serve m --hf-overrides.max_position_embeddings 80g", "serve m --hf-overrides.rope.factor 1.5K",
        "serve m --foo=1.5", "serve m --gpu-memory-utilization -0.5", "serve m --seed -1", "serve m -cc.mode",
        "serve m --kv-transfer-config.kv_connector X --kv-transfer-config.kv_role kv_both "
        "--kv-transfer-config.kv_port 1",
        "serve m -cc.a 1 -cc.a.b 2", "serve m -cc.custom_ops [\"a\"] -cc.custom_ops [\"b\"]",
        "serve m -cc.pass_config.fuse_norm_quant true -cc.pass_config.enable_sp false",
        "serve m -cc.custom_ops+ none,+rms_norm -cc.custom_ops+=-silu", "serve m -cc.mode 1 -cc '{\"mode\": 2}'",
        "serve m -cc.max_cudagraph_capture_size 4k", "serve m -cc.pass_config.fuse_norm_quant true -cc.pass_config 3",
        "serve m --speculative-config.num_speculative_tokens 3 --speculative-config.method ngram",
        # abbreviations and short options
        "serve m --tensor-parallel 2", "serve m --tensor 2", "serve m --max-num 2", "serve m --no-enforce",
        "serve m --enforce", "serve m --max-model 4k", "serve m -as 2", "serve m -tp2", "serve m -n2 -r0",
        "serve m -tp=2", "serve m -dp 2 -dpl 1", "serve m --rbln-use-w8", "serve m --no-rbln-use-w8",
        "serve m --add '{\"a\": 1}'", "serve m --gpu 0.9", "serve m -h", "serve m --help=all", "serve m --he",
        "serve m -pp 2 --pipeline 4", "serve m --pipeline-parallel-size=3", "serve m -ep", "serve m -q fp8",
        "serve m --dtype half --dtype bfloat16", "serve m --dtype foo", "serve m -v", "serve m --=x",
        # values
        "serve m --max-model-len auto", "serve m --max-model-len -1", "serve m --max-model-len 4K",
        "serve m --max-model-len 4k", "serve m --max-model-len 1.5k", "serve m --max-model-len 1.5K",
        "serve m --max-model-len None", "serve m --max-num-batched-tokens 2K", "serve m -tp 02",
        "serve m -tp +2", "serve m -tp 2_0", "serve m -tp ' 2'", "serve m -tp abc", "serve m -tp None",
        "serve m -tp", "serve m --gpu-memory-utilization 0.90", "serve m --gpu-memory-utilization .9",
        "serve m --gpu-memory-utilization 9e-1", "serve m --gpu-memory-utilization nan",
        "serve m --gpu-memory-utilization inf", "serve m --quantization None", "serve m --quantization ''",
        "serve m --quantization fp8", "serve m --device-ids 0,1", "serve m --device-ids '0, 1'",
        "serve m --device-ids a,1", "serve m --moe-backend Flashinfer-Cutlass",
        "serve m --cudagraph-capture-sizes 1 2 4", "serve m --cudagraph-capture-sizes 1 -2",
        "serve m --cudagraph-capture-sizes", "serve m --enable-prefix-caching --no-enable-prefix-caching",
        "serve m --no-enable-prefix-caching --enable-prefix-caching", "serve m --enforce-eager=1",
        "serve m --hf-token", "serve m --hf-token abc", "serve m --middleware a --middleware b",
        "serve m --api-key a b", "serve m --lora-modules a=b '{\"name\": \"c\", \"path\": \"d\"}'",
        "serve m --lora-modules '{bad'", "serve m --lora-modules '{\"name\": \"x\"}'",
        "serve m --lora-modules 'a=b,c'", "serve m --lora-modules None a=b",
        "serve m --hf-overrides '{\"kv_lora_rank\": 512, \"q_lora_rank\": 64}'", "serve m --hf-overrides foo",
        "serve m --hf-overrides '{bad}'", "serve m --additional-config foo --rbln-use-w8a8",
        "serve m --rbln-use-w8a8 --additional-config foo", "serve m --additional-config None",
        "serve m --additional-config '{\"rbln_config\": {\"device\": 1, \"x\": 2}, \"optimum_overrides\": {\"y\": 1}}'",
        "serve m --rbln-optimum-overrides '{\"device\": 0, \"tensor_parallel_size\": 2, \"sub\": [{\"device\": 1}]}'",
        "serve m --rbln-decode-batch-bucket-manual-buckets 1 2 4", "serve m --rbln-sub-block-size None",
        "serve m --rbln-sub-block-size 16 --rbln-no-enable-sub-block-cache --no-rbln-use-custom-sampler",
        "serve m --additional-config '{\"use_custom_sampler\": false, \"sub_block_size\": 4}'",
        "serve m --additional-config '{}'", "serve m --additional-config '{\"num_devices_per_local_rank\": \"4\"}'",
        "serve m --rbln-num-devices-per-local-rank 4", "serve m --rbln-compile-dtype ''",
        "serve m --kv-transfer-config '{\"kv_connector\": \"MultiConnector\", \"kv_role\": \"kv_both\", "
        "\"kv_ip\": \"1.2.3.4\", \"kv_port\": 1, \"engine_id\": \"e\", \"kv_rank\": 0, \"kv_connector_extra_config\": "
        "{\"connectors\": [{\"kv_connector\": \"A\", \"kv_role\": \"kv_both\", \"kv_port\": 2, "
        "\"kv_connector_extra_config\": {\"handshake_port\": 3, \"proxy_ip\": \"h\", \"cpu_bytes_to_use_per_rank\": 9}}]}}'",
        "serve m --kv-events-config '{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:1\", \"topic\": \"t\"}'",
        "serve m --ec-transfer-config '{\"ec_connector\": \"X\", \"ec_role\": \"ec_both\", \"ec_ip\": \"h\"}'",
        "serve m --speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'",
        "serve m -cc '{\"mode\": 3, \"max_cudagraph_capture_size\": 4k}'", "serve m --speculative-config '{\"a\": 4k}'",
        "serve m --kv-transfer-config '{bad'", "serve m --kv-transfer-config None", "serve m -cc '{\"nope\": 1}'",
        "serve m -cc '{\"mode\": 3}'", "serve m -cc '{ \"mode\" : 3 }'", "serve m -cc 3",
        "serve m --limit-mm-per-prompt '{\"image\": 2}'", "serve m --allowed-origins '[\"a\"]'",
        "serve m --unknown-flag 3", "serve m -x", "serve m --unknown", "serve --unknown m",
        "serve m --max-num-seqs 8 --max-num-seqs 16", "serve m --seed 0 --block-size 16",
        "serve m --trust-remote-code --no-trust-remote-code --trust_remote_code",
    ]  # fmt: skip
    api = [
        "--model m -tp 2", "m --model n", "m", "", "--model m --served-model-name x",
        f"--model m {cfg}/false_and_null.yaml", f"m {cfg}/basic.yaml --model n", f"{cfg}/with_model.yaml",
        "--model m -O3 -cc.mode 2", "--model m --rbln-use-w8a8 --port 1", "--model=m --enforce-eager",
        "serve --model m", "serve m", f"serve {cfg}/with_model.yaml", "-tp 2 --served-model-name x",
    ]  # fmt: skip
    return [_c("serve", line) for line in serve] + [_c("api_server", line) for line in api]


def _names() -> tuple[dict[str, str], dict[str, str], frozenset[str], frozenset[str], dict[str, str]]:
    from cachemgr.key import vllm_flags  # stdlib-only module; imported lazily so --worker never needs it

    return (vllm_flags.FLAGS, vllm_flags.ALIASES, vllm_flags.NEGATABLE, vllm_flags.JSON_FLAGS,
            vllm_flags.RBLN_FLAGS)  # fmt: skip


_FAVOURITES = [
    "tensor-parallel-size",
    "pipeline-parallel-size",
    "max-model-len",
    "max-num-seqs",
    "max-num-batched-tokens",
    "block-size",
    "dtype",
    "quantization",
    "enforce-eager",
    "enable-prefix-caching",
    "enable-chunked-prefill",
    "gpu-memory-utilization",
    "kv-cache-dtype",
    "seed",
    "revision",
    "tokenizer",
    "trust-remote-code",
    "compilation-config",
    "additional-config",
    "speculative-config",
    "hf-overrides",
    "kv-transfer-config",
    "device-ids",
    "moe-backend",
    "lora-modules",
    "enable-lora",
    "cudagraph-capture-sizes",
    "optimization-level",
    "max-lora-rank",
    "served-model-name",
    "port",
    "host",
    "api-key",
    "hf-token",
    "middleware",
    "model",
    "data-parallel-size",
    "rbln-use-w8a8",
    "rbln-compile-dtype",
    "rbln-use-custom-sampler",
    "rbln-decode-batch-bucket-manual-buckets",
    "rbln-optimum-overrides",
    "rbln-sub-block-size",
    "kv-events-config",
]
_RUNTIME_EXTRAS = [["--port", "8001"], ["--host", "10.1.2.3"], ["--served-model-name", "svc"], ["--api-key", "k"],
                   ["--disable-log-stats"], ["--uvicorn-log-level", "debug"], ["--enable-log-requests"],
                   ["--rbln-no-use-custom-sampler"], ["--master-port", "29999"]]  # fmt: skip
# values vLLM accepts, by value kind and for the favourite flags with choices; then awkward ones
_GOOD = {
    "int": ["1", "2", "4", "8", "02", "+3", "16"], "float": ["0.9", "0.90", ".9", "1", "0.5"],
    "human": ["4k", "4K", "4096", "2g", "8192", "auto", "-1", "1.5k"], "str": ["x", "org/model", "a_b", "0123"],
    "json": ['{"mode": 3}', '{ "mode":3 }', '{"a": 1, "b": [1, 2]}', '{"kv_connector": "X", "kv_role": "kv_both", '
             '"kv_port": 1, "kv_ip": "h"}', '{"device": 0, "b": [1, {"device": 2}], "create_runtimes": false}',
             '{"use_w8a8": true, "use_custom_sampler": false}', '{"method": "ngram", "num_speculative_tokens": 2}',
             '{"pass_config": {"fuse_norm_quant": true}}', "None"],
    "dtype": ["auto", "half", "bfloat16", "float16"], "kv-cache-dtype": ["auto", "fp8"],
    "quantization": ["fp8", "None", "awq", ""], "moe-backend": ["auto", "Triton", "deep-gemm"],
    "max-lora-rank": ["8", "16", "064"], "rbln-compile-dtype": ["bfloat16", "float16", ""],
    "optimization-level": ["0", "1", "2", "3"], "device-ids": ["0,1", "0, 1", "a,1"],
}  # fmt: skip
_AWKWARD = [
    "abc",
    "None",
    "",
    "-x",
    "nan",
    "inf",
    "1.5K",
    "1_0",
    " 4",
    "{bad",
    "[1]",
    "null",
    "-0.5",
    "a=b",
    "-1",
]
_DOTTED_KEYS = ["mode", "pass_config.fuse_norm_quant", "use_w8a8", "kv_port", "device", "custom_ops+",
                "cudagraph_capture_sizes", "a.b", "num_speculative_tokens", "kv_connector"]  # fmt: skip
# tokens that exercise FlexibleArgumentParser's rewrites against each other
_CHAOS = ["--model", "--model=x", "--model\n", "-O", "-O3", "-O=1", "--", "-", "-cc.mode", "3", "-0.5", "--config",
          f"{CONFIG_DIR}/basic.yaml", f"{CONFIG_DIR}/with_model.yaml", "--served-model-name", "--served_model_name=s",
          "x", "-tp", "2", "--tensor_parallel_size=2", "-n2", "--no-enforce", "--rbln-use-w8a8", "--additional-config.a",
          "--additional-config", '{"b": 1}', "foo", "-cc", '{"mode": 1}', "-cc.custom_ops+", "a,b", "--config=x.yaml",
          "--max-model-len", "4k", "-1", "--seed", "--enforce-eager", "--port", "--hf-token", "--api-key", "-q", "fp8",
          "--kv-transfer-config.kv_port", "--kv_transfer_config.kv_role", "kv_both", "-asc", "-dp=2", "-tp2"]  # fmt: skip
_DOTTED_VALUES = ["3", "true", "4k", "1,2", "x", '{"z": 1}', "-1", "1.5K", "None", "[1, 2]", "kv_both"]


class CaseGenerator:
    """Random argvs: common and random flags, in every spelling vLLM accepts, with awkward values.

    Half the cases are mutations of an earlier one (reordered, respelled, a runtime flag added, a value
    rewritten or changed), so that equal and nearly-equal configurations meet in one corpus.
    """

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)  # noqa: S311  (a test corpus, not a secret)
        self.flags, aliases, self.negatable, self.json, self.rbln = _names()
        self.aliases: dict[str, list[str]] = defaultdict(list)
        for alias, name in aliases.items():
            self.aliases[name].append(alias)
        self.options = sorted({f"--{n}" for n in self.flags} | {f"--no-{n}" for n in self.negatable})
        self.history: list[tuple[str, list[list[str]]]] = []

    def case(self) -> dict[str, Any]:
        rng = self.rng
        if rng.random() < 0.1:
            form, parts = (
                "serve" if rng.random() < 0.8 else "api_server",
                [[rng.choice(_CHAOS)] for _ in range(8)],
            )
        elif self.history and rng.random() < 0.5:
            form, parts = self.mutate(*rng.choice(self.history))
        else:
            form, parts = self.fresh()
        self.history.append((form, parts))
        args = [token for part in parts for token in part]
        return {"form": form, "args": (["serve"] if form == "serve" else []) + args}

    def fresh(self) -> tuple[str, list[list[str]]]:
        rng = self.rng
        form = "api_server" if rng.random() < 0.1 else "serve"
        count = rng.randint(0, 6)
        parts = [self.option(rng.choice(_FAVOURITES) if rng.random() < 0.75 else rng.choice(sorted(self.flags)))
                 for _ in range(count)]  # fmt: skip
        if rng.random() < 0.06:
            parts.append(
                rng.choice([["--unknown-x"], ["--unknown-y", "1"], ["extra"], ["-O"], ["--"], ["-5"]])
            )
        if rng.random() < 0.08:
            parts.append(["--config", f"{CONFIG_DIR}/{rng.choice(sorted(CONFIG_FILES))}"])
        model = rng.choice(["org/m", "/models/x", "m", "0.5"])
        placement = rng.random()
        if placement < 0.65 and form == "serve":
            parts.insert(0, [model])
        elif placement < 0.9:
            parts.insert(rng.randint(0, len(parts)), rng.choice([["--model", model], [f"--model={model}"]]))
        elif placement < 0.93:
            parts.append([model])
        return form, parts

    def mutate(self, form: str, parts: list[list[str]]) -> tuple[str, list[list[str]]]:
        rng = self.rng
        parts = [list(part) for part in parts]
        head = 1 if parts and parts[0] and not parts[0][0].startswith("-") else 0
        for _ in range(rng.randint(1, 3)):
            roll = rng.random()
            options = [i for i in range(head, len(parts)) if parts[i] and parts[i][0].startswith("--")]
            if roll < 0.25:
                tail = parts[head:]
                rng.shuffle(tail)
                parts[head:] = tail
            elif roll < 0.5 and options:
                i = rng.choice(options)
                name, eq, value = parts[i][0].partition("=")
                parts[i][0] = self.spell_string(name) + eq + value
            elif roll < 0.7:
                parts.insert(rng.randint(head, len(parts)), rng.choice(_RUNTIME_EXTRAS))
            elif roll < 0.85 and options:
                i = rng.choice(options)
                if len(parts[i]) > 1:
                    parts[i][-1] = rng.choice(
                        ["0" + parts[i][-1], parts[i][-1] + " ", *_GOOD["int"], *_AWKWARD]
                    )
            else:
                parts.append(self.option(rng.choice(_FAVOURITES)))
        return form, parts

    def option(self, name: str) -> list[str]:
        rng = self.rng
        arity = self.flags[name]
        if arity == "0":
            negative = name in self.negatable and rng.random() < 0.4
            return [self.spell(f"no-{name}" if negative else name)]
        spelled = self.spell(name)
        if name in self.json and rng.random() < 0.3:
            key, value = rng.choice(_DOTTED_KEYS), rng.choice(_DOTTED_VALUES)
            return [f"{spelled}.{key}={value}"] if rng.random() < 0.3 else [f"{spelled}.{key}", value]
        if name == "optimization-level" and rng.random() < 0.5:
            return [rng.choice(["-O3", "-O=2", "-O", "-Odecode", "-O0"]), *rng.choice([[], ["1"], ["4"]])]
        values = [self.value(name) for _ in range(rng.choice([1, 1, 2, 3]) if arity in "+*" else 1)]
        if arity == "?" and rng.random() < 0.3:
            values = []
        if len(values) == 1 and rng.random() < 0.3:
            return [f"{spelled}={values[0]}"]
        return [spelled, *values]

    def spell(self, name: str) -> str:
        if self.rng.random() < 0.2 and self.aliases.get(name):
            return self.rng.choice(self.aliases[name])
        return self.spell_string(f"--{name}")

    def spell_string(self, option: str) -> str:
        """--a-b as --a_b, a unique prefix, any prefix (maybe ambiguous), or as is."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.2 and option.startswith("--"):
            return "--" + option[2:].replace("-", "_")
        if roll < 0.4 and option.startswith("--"):
            shortest = next((n for n in range(3, len(option) + 1)
                             if sum(o.startswith(option[:n]) for o in self.options) == 1), len(option))  # fmt: skip
            return option[: rng.randint(shortest, len(option))]
        if roll < 0.45:
            return option[: rng.randint(min(3, len(option)), len(option))]
        return option

    def value(self, name: str) -> str:
        rng = self.rng
        from cachemgr.key import vllm_values  # stdlib + cachemgr only

        kinds = vllm_values.VALUE_KINDS
        if rng.random() < 0.15:
            return rng.choice(_AWKWARD)
        if name in _GOOD:
            return rng.choice(_GOOD[name])
        if name in kinds["int"]:
            return rng.choice(_GOOD["int"])
        if name in kinds["float"]:
            return rng.choice(_GOOD["float"])
        if name in kinds["human-readable-int"] | kinds["human-readable-int-or-auto"]:
            return rng.choice(_GOOD["human"])
        return rng.choice(_GOOD["json" if name in self.json else "str"])


def generated(count: int, seed: int) -> list[dict[str, Any]]:
    generator = CaseGenerator(seed)
    return [generator.case() for _ in range(count)]


def write_config_files() -> None:
    target = DATA / CONFIG_DIR
    target.mkdir(parents=True, exist_ok=True)
    for name, text in CONFIG_FILES.items():
        (target / name).write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# worker: runs inside the introspection interpreter (vLLM installed)
# --------------------------------------------------------------------------------------------------


class _Recorder:
    """What one parse touched: the options it set and the JSON each config dataclass received."""

    def __init__(self) -> None:
        self.explicit: set[str] = set()
        self.raw: dict[str, Any] = {}
        self.validation_failed = False

    def reset(self) -> None:
        self.explicit.clear()
        self.raw.clear()
        self.validation_failed = False


def _instrument(parser: argparse.ArgumentParser, recorder: _Recorder) -> dict[str, Any]:
    """Record explicit options and dataclass JSON; return each option's kind and arity."""
    arg_utils = importlib.import_module("vllm.engine.arg_utils")
    table: dict[str, Any] = {}
    for action in parser._actions:
        cls = action.__class__

        def call(self: Any, *args: Any, _cls: Any = cls, **kwargs: Any) -> Any:
            recorder.explicit.add(self.dest)
            return _cls.__call__(self, *args, **kwargs)

        action.__class__ = type(f"Recording{cls.__name__}", (cls,), {"__call__": call})
        if not action.option_strings:
            continue
        inner, optional = flags_tool._unwrap(action.type)
        kind = flags_tool._value_kind(inner, action.dest) if action.type is not None else "none"
        if kind == "dataclass-json":
            action.type = _capturing(action.type, action.dest, optional, recorder, arg_utils)
        name = next(o for o in action.option_strings if o.startswith("--"))[2:]
        table[name] = {"kind": kind, "optional": optional}
    return table


def _capturing(convert: Any, dest: str, optional: bool, recorder: _Recorder, arg_utils: Any) -> Any:
    @functools.wraps(convert)
    def wrapper(text: str) -> Any:
        raw: Any = None
        parsed = True
        if not (optional and text in ("", "None")):
            try:
                raw = json.loads(arg_utils._expand_json_human_readable_numbers(text))
            except Exception:  # noqa: BLE001  (anything the expansion or json raises: not JSON)
                parsed = False
        try:
            result = convert(text)
        except Exception:
            recorder.validation_failed = parsed
            raise
        recorder.raw[dest] = raw
        return result

    return wrapper


def _jsonable(value: Any) -> Any:
    """A namespace value as JSON: non-finite floats as cachemgr keys them, dataclasses as dicts."""
    if isinstance(value, float) and not math.isfinite(value):
        value = {"$float": str(value)}
    elif isinstance(value, enum.Enum):
        value = value.value
    elif isinstance(value, set | frozenset):
        value = sorted(value, key=repr)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value if value is None or isinstance(value, bool | int | float | str) else {"$repr": repr(value)}


def _build_real_parsers(rbln_src: Path) -> dict[str, argparse.ArgumentParser]:
    platforms: Any = importlib.import_module("vllm.platforms")
    platforms.current_platform = importlib.import_module("vllm.platforms.cpu").CpuPlatform()
    argparse_utils = importlib.import_module("vllm.utils.argparse_utils")
    serve = importlib.import_module("vllm.entrypoints.cli.serve")
    cli_args = importlib.import_module("vllm.entrypoints.launchers.cli_args")
    sys.path.insert(0, str(rbln_src))
    rbln = importlib.import_module("vllm_rbln.config")
    # as the vllm CLI's main() builds it
    top = argparse_utils.FlexibleArgumentParser(description="vLLM CLI")
    top.add_argument("-v", "--version", action="version", version=flags_tool.VLLM_VERSION)
    subparsers = top.add_subparsers(required=False, dest="subparser")
    serve_parser = serve.ServeSubcommand().subparser_init(subparsers)
    rbln.add_rbln_cli_args(serve_parser)  # RblnPlatform.pre_register_and_update
    # as `python -m vllm.entrypoints.openai.api_server` (entry.main) builds it
    api = cli_args.make_arg_parser(
        argparse_utils.FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server.")
    )
    rbln.add_rbln_cli_args(api)
    return {"top": top, "serve": serve_parser, "api_server": api}


def _categorize(message: str, recorder: _Recorder) -> str:
    if "unrecognized arguments:" in message:
        return "unrecognized"
    if "invalid choice:" in message:
        return "choice"
    return "validation" if recorder.validation_failed else "refused"


def _run_one(parsers: dict[str, Any], case: dict[str, Any], recorder: _Recorder) -> dict[str, Any]:
    recorder.reset()
    form = case["form"]
    parser = parsers["top"] if form == "serve" else parsers["api_server"]
    defaults = {a.dest: a.default for a in parsers[form]._actions}
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            namespace = parser.parse_args(list(case["args"]))
    except SystemExit as stop:
        lines = [line for line in err.getvalue().splitlines() if ": error: " in line]
        message = lines[-1].split(": error: ", 1)[1] if lines else f"exit {stop.code}"
        message = re.sub(r" at 0x[0-9a-f]+", "", message)  # reprs of functions: stable across runs
        category = "exit" if stop.code == 0 else _categorize(message, recorder)
        return {"ok": False, "category": category, "error": message}
    except Exception as error:  # noqa: BLE001  (ValueError, AssertionError, IndexError, yaml, OSError...)
        return {"ok": False, "category": "refused", "error": f"{type(error).__name__}: {error}"}
    values = vars(namespace)
    explicit = set(recorder.explicit) - SKIP_DESTS
    if values.get("additional_config") != defaults.get("additional_config"):
        explicit.add("additional_config")  # written by --rbln-* actions under their own dests
    model = values.get("model") if "model" in recorder.explicit else None
    if form == "serve" and values.get("model_tag") is not None:
        model = values["model_tag"]  # ServeSubcommand.cmd
    out: dict[str, Any] = {}
    nondefault = []
    for dest, value in values.items():
        if dest in SKIP_DESTS or dest.startswith("rbln_") or dest == "dispatch_function":
            continue
        differs = dest not in defaults or value != defaults[dest]
        if differs:
            nondefault.append(dest)
        if differs or dest in explicit:
            out[dest] = recorder.raw[dest] if dest in recorder.raw else _jsonable(value)
    return {
        "ok": True, "model": model, "revision": values.get("revision"), "explicit": sorted(explicit),
        "nondefault": sorted(nondefault), "values": out,
    }  # fmt: skip


def worker(rbln_src: Path, cases_path: Path, out_path: Path) -> None:
    parsers = _build_real_parsers(rbln_src)
    recorder = _Recorder()
    table = _instrument(parsers["serve"], recorder)
    _instrument(parsers["api_server"], recorder)
    cases = json.loads(cases_path.read_text())
    os.chdir(DATA)
    outcomes = [_run_one(parsers, case, recorder) for case in cases]
    serve_parser = parsers["serve"]
    options = {
        s: {"dest": a.dest, "nargs": a.nargs, "const": _jsonable(a.const), "negatable": type(a).__name__}
        for s, a in serve_parser._option_string_actions.items()
    }
    out_path.write_text(json.dumps({"kinds": table, "options": options, "outcomes": outcomes}))


def run_real(cases: list[dict[str, Any]], python: Path) -> dict[str, Any]:
    """Run the worker in the introspection interpreter; return kinds, options and outcomes."""
    write_config_files()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "RBLN_", "PYTHON"))}
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    with tempfile.TemporaryDirectory(prefix="gen-serving-golden-") as tmp:
        rbln_src = Path(tmp) / "src"
        flags_tool._extract_vllm_rbln(flags_tool.DEFAULT_VLLM_RBLN_WHEEL, rbln_src)
        cases_path, out_path = Path(tmp) / "cases.json", Path(tmp) / "out.json"
        cases_path.write_text(json.dumps(cases))
        cmd = [str(python), __file__, "--worker", str(rbln_src), str(cases_path), str(out_path)]
        proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"the worker failed with exit code {proc.returncode}")
        result: dict[str, Any] = json.loads(out_path.read_text())
    return result


# --------------------------------------------------------------------------------------------------
# checks: cachemgr.key.serving against a recorded outcome (used by tests/test_serving.py and --fuzz)
# --------------------------------------------------------------------------------------------------


def full_argv(case: dict[str, Any]) -> list[str]:
    return ["vllm", *case["args"]] if case["form"] == "serve" else [*API_SERVER, *case["args"]]


def _canonical(name: str, value: Any) -> Any:
    from cachemgr.key.serving import canonical_setting

    return canonical_setting(name, value)


def expected_view(outcome: dict[str, Any], kinds: dict[str, Any]) -> dict[str, Any]:
    """The key view of a real namespace: what must decide (model, revision, settings).

    Non-runtime options that differ from the default, plus config dataclasses given explicitly (their
    JSON document is the value), through serving's documented policy; additional_config with nothing
    compile-relevant left counts as absent.
    """
    from cachemgr.key.serving import RUNTIME_ONLY

    view: dict[str, Any] = {}
    for dest, value in outcome["values"].items():
        name = dest.replace("_", "-")
        dataclass_json = kinds.get(name, {}).get("kind") == "dataclass-json"
        if name in RUNTIME_ONLY or not (
            dest in outcome["nondefault"] or (dataclass_json and dest in outcome["explicit"])
        ):
            continue
        setting = _canonical(name, value)
        if not (dest == "additional_config" and setting == {}):
            view[dest] = setting
    return {"model": outcome["model"], "revision": outcome["revision"], "settings": view}


def check_case(case: dict[str, Any], outcome: dict[str, Any]) -> list[str]:
    """Where cachemgr.key.serving disagrees with the real parser on one argv (empty: they agree)."""
    from cachemgr.core.errors import ConfigError
    from cachemgr.key.serving import parse_server_argv

    try:
        ours = parse_server_argv(full_argv(case))
    except ConfigError as error:
        return [f"we refuse ({error}) what vLLM accepts"] if outcome["ok"] else []
    if not outcome["ok"]:
        category = outcome["category"]
        if category in {"choice", "validation", "exit"}:
            return []  # deliberately not mirrored: vLLM refuses later; keying it is harmless
        if category == "unrecognized" and ours.unknown:
            return []  # fail closed: keyed on the unrecognized tokens
        return [f"we accept what vLLM refuses ({category}: {outcome['error']})"]
    problems = []
    if (ours.model, ours.revision) != (outcome["model"], outcome["revision"]):
        problems.append(
            f"model/revision {ours.model!r}/{ours.revision!r} != {outcome['model']!r}/{outcome['revision']!r}"
        )
    if ours.unknown:
        problems.append(f"unknown {ours.unknown} where vLLM knows every option")
    reported = set(ours.settings) | {d.replace("-", "_") for d in ours.dropped}
    for dest in sorted(set(outcome["values"]) | reported):
        problems += _check_value(dest, outcome, ours)
    return problems


def _check_value(dest: str, outcome: dict[str, Any], ours: Any) -> list[str]:
    from cachemgr.key.serving import RUNTIME_ONLY

    name = dest.replace("_", "-")
    if name in RUNTIME_ONLY:
        if (dest in outcome["explicit"]) != (name in ours.dropped):
            return [f"{name}: runtime-only, explicit={dest in outcome['explicit']}, dropped={ours.dropped}"]
        return []
    if dest not in outcome["values"]:
        return [f"{dest}: we report {ours.settings.get(dest)!r}, vLLM sets nothing"]
    expected = _canonical(name, outcome["values"][dest])
    if dest == "additional_config" and expected == {}:
        # nothing compile-relevant: the same key as no additional_config at all
        return (
            [f"{dest}: ours {ours.settings[dest]!r}, real has nothing to key"]
            if dest in ours.settings
            else []
        )
    if dest not in ours.settings or ours.settings[dest] != expected:
        return [f"{dest}: ours {ours.settings.get(dest, '<absent>')!r} != real {expected!r}"]
    return []


def _signature(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)


def check_safety(
    results: Iterable[tuple[dict[str, Any], dict[str, Any], Any]],
    kinds: dict[str, Any],
    stats: dict[str, int] | None = None,
) -> list[str]:
    """The key property over a corpus: different real views never share a key; equal ones share it.

    ``results``: (case, real outcome, our ServerCommand or None). Two argvs whose real key views
    differ must get different (model, revision, settings); two with equal views and the same
    explicit non-runtime options must get equal ones.
    """
    from cachemgr.key.serving import RUNTIME_ONLY

    stats = {} if stats is None else stats
    by_ours: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    by_real: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for case, outcome, ours in results:
        if ours is None or not outcome["ok"]:
            continue
        line = shlex.join(full_argv(case))
        ours_sig = _signature(
            {"model": ours.model, "revision": ours.revision, "settings": dict(ours.settings)}
        )
        real_sig = _signature(expected_view(outcome, kinds))
        explicit = sorted(d for d in outcome["explicit"] if d.replace("_", "-") not in RUNTIME_ONLY)
        by_ours[ours_sig][real_sig].append(line)
        by_real[_signature([real_sig, explicit])][ours_sig].append(line)
    shared = [g for g in by_ours.values() if sum(len(v) for v in g.values()) > 1]
    stats["argvs"], stats["keys"] = (
        sum(sum(len(v) for v in g.values()) for g in by_ours.values()),
        len(by_ours),
    )
    stats["shared_keys"], stats["argvs_sharing"] = (
        len(shared),
        sum(sum(len(v) for v in g.values()) for g in shared),
    )
    problems = []
    for group in by_ours.values():
        if len(group) > 1:
            problems.append(
                "WRONG HIT: one key for different real configs: " + " | ".join(v[0] for v in group.values())
            )
    for group in by_real.values():
        if len(group) > 1:
            problems.append(
                "needless miss: equal real configs, different keys: "
                + " | ".join(v[0] for v in group.values())
            )
    return problems


# --------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------


def _ours(case: dict[str, Any]) -> Any:
    from cachemgr.core.errors import ConfigError
    from cachemgr.key.serving import parse_server_argv

    try:
        return parse_server_argv(full_argv(case))
    except ConfigError:
        return None


def fuzz(count: int, seed: int, python: Path) -> int:
    cases = generated(count, seed)
    real = run_real(cases, python)
    os.chdir(DATA)
    per_case: Counter[str] = Counter()
    examples: dict[str, list[str]] = defaultdict(list)
    results = []
    for case, outcome in zip(cases, real["outcomes"], strict=True):
        for problem in check_case(case, outcome):
            kind = problem.split(":")[0][:60]
            per_case[kind] += 1
            if len(examples[kind]) < 3:
                examples[kind].append(f"{shlex.join(full_argv(case))}\n      {problem}")
        results.append((case, outcome, _ours(case)))
    stats: dict[str, int] = {}
    safety = check_safety(results, real["kinds"], stats)
    outcomes = Counter("ok" if o["ok"] else o["category"] for o in real["outcomes"])
    print(f"fuzz: {count} argvs (seed {seed}); real outcomes {dict(outcomes)}")
    print(f"per-argv disagreements: {sum(per_case.values())}; safety-property violations: {len(safety)}")
    print(f"accepted argvs: {stats['argvs']} -> {stats['keys']} keys; {stats['shared_keys']} keys shared "
          f"by {stats['argvs_sharing']} argvs (each group checked to be one real configuration)")  # fmt: skip
    for kind, n in per_case.most_common():
        print(f"  {n:5d}  {kind}")
        for example in examples[kind]:
            print(f"    {example}")
    for problem in safety[:20]:
        print(f"  {problem}")
    return 1 if per_case or safety else 0


def golden(count: int, python: Path) -> None:
    cases = hand_picked() + generated(count, GOLDEN_SEED)
    real = run_real(cases, python)
    entries = [{**case, "outcome": outcome} for case, outcome in zip(cases, real["outcomes"], strict=True)]
    document = {
        "vllm_version": flags_tool.VLLM_VERSION,
        "vllm_rbln_version": flags_tool.VLLM_RBLN_VERSION,
        "generator": "tools/gen_serving_golden.py",
        "kinds": real["kinds"],
        "options": real["options"],
    }
    # one argv per line, so that a regenerated file diffs argv by argv
    head = json.dumps(document, indent=1, sort_keys=True).removesuffix("\n}")
    lines = ",\n  ".join(json.dumps(entry, sort_keys=True) for entry in entries)
    GOLDEN.write_text(f'{head},\n "cases": [\n  {lines}\n ]\n}}\n', encoding="utf-8")
    print(f"wrote {GOLDEN.relative_to(REPO)}: {len(entries)} argvs")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--python", type=Path, default=flags_tool.DEFAULT_PYTHON, help="interpreter with vllm")
    ap.add_argument("--count", type=int, default=400, help="generated argvs in the golden file")
    ap.add_argument("--fuzz", type=int, metavar="N", help="differential fuzz of N argvs; writes nothing")
    ap.add_argument("--seed", type=int, default=1, help="seed of the fuzz corpus")
    ap.add_argument("--worker", nargs=3, type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    sys.path.insert(0, str(REPO))
    if args.fuzz:
        return fuzz(args.fuzz, args.seed, args.python)
    golden(args.count, args.python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
