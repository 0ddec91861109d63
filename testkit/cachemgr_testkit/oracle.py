"""The key oracle's corpus and verdicts: what both of its sides share (standard library only).

The oracle holds ``cachemgr key`` to the server's own identity, computed by the real vLLM,
vllm-rbln and optimum-rbln code (tools/oracle/identity.py, in the environment tools/oracle/env.sh
builds). This module is what that tool and the tests (tests/test_oracle.py) both read: the two base
configurations, how a variant's model directory is laid out on disk, how a variant becomes an argv
and an environment, and the rule that turns the server's answers and cachemgr's keys into false
hits and needless misses. It imports nothing of cachemgr and nothing of the server, so it runs in
either interpreter.

A variant is one change against a reference (a base, or another variant): an option at a value,
an option at its default, another spelling, an environment variable, an edit of the model
directory, another image (compiler version, NPU). For each, the server's side records whether its
identity is the reference's and whether what it would compile is; cachemgr's side computes both
keys. The verdicts:

- false hit: cachemgr's keys are equal while the server's identity or what it compiles differ
  (the pod would load an entry the server would not have made for it);
- needless miss: cachemgr's keys differ while the server's identity and what it compiles are the
  same (the pod compiles for nothing, 11 minutes for MiniMax-M2.7);
- the server refusing a variant takes it out of both counts (no server serves it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cachemgr_testkit import manifest

REPO = manifest.REPO

MODEL = "{model}"  # in a variant's argv: the path of its model directory

# The two model paths of vllm-rbln 0.12, each with what it needs to build a configuration here:
# the vLLM-model path is refused on RBLN-CA* NPUs (vllm_rbln/config.py 327-349), so its base targets
# RBLN-CR13; the optimum path needs a block size (its config check refuses none) and compiles for
# RBLN-CA25. No device answers (the stand-in rebel says none), so RBLN_FORCE_NPU_NAME names the NPU.
BASES: dict[str, dict[str, Any]] = {
    "vllm": {
        "argv": ["vllm", "serve", MODEL, "--model-impl", "vllm"],
        "env": {"RBLN_FORCE_NPU_NAME": "RBLN-CR13"},
    },
    "optimum": {
        "argv": ["vllm", "serve", MODEL, "--model-impl", "optimum", "--block-size", "1024",
                 "--max-model-len", "2048"],
        "env": {"RBLN_FORCE_NPU_NAME": "RBLN-CA25"},
    },
}  # fmt: skip

# vllm-rbln 0.11.2 (vLLM 0.24.0) has no --model-impl of its own: VLLM_RBLN_USE_VLLM_MODEL alone picks
# the path (vllm_rbln/platform.py 267, envs.py), and --model-impl is vLLM's (auto, vllm, transformers,
# terratorch), so the bases leave it out. The same NPUs as 0.12's bases; its compiler is a 0.11
# (vllm-rbln 0.11.2's runtime extra asks for rebel-compiler ~=0.11.3).
BASES_0_11: dict[str, dict[str, Any]] = {
    "vllm": {
        "argv": ["vllm", "serve", MODEL],
        "env": {"RBLN_FORCE_NPU_NAME": "RBLN-CR13", "VLLM_RBLN_USE_VLLM_MODEL": "1"},
    },
    "optimum": {
        "argv": ["vllm", "serve", MODEL, "--block-size", "1024", "--max-model-len", "2048"],
        "env": {"RBLN_FORCE_NPU_NAME": "RBLN-CA25"},
    },
}  # fmt: skip


def bases(release: str) -> dict[str, dict[str, Any]]:
    """The release's base configurations, by model path: one per path the manifest says the oracle
    checked. Which argv picks a path is the release's own rule (tests/data/rbln_facts/, from its
    code): vllm-rbln's --model-impl then VLLM_RBLN_USE_VLLM_MODEL (0.12), or the variable alone (0.11)."""
    entry = manifest.release(release)
    found = BASES if model_impl_rule(entry.oracle) == "flag_then_env" else BASES_0_11
    return {path: found[path] for path in entry.checked}


def model_impl_rule(release: str) -> str:
    facts = REPO / "tests" / "data" / "rbln_facts" / f"vllm-rbln-{release}.json"
    rule: str = json.loads(facts.read_text(encoding="utf-8"))["model_impl_rule"]
    return rule


# A tiny Llama: enough for vLLM to build a configuration and for optimum-rbln to pick a model class.
_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "transformers_version": "5.15.1",
}
_GENERATION = {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.6, "top_p": 0.9}
_TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "t1",
    "eos_token": "t2",
    "unk_token": "<unk>",
    "model_max_length": 4096,
}
_WEIGHTS = (("model.embed_tokens.weight", (256, 64)), ("lm_head.weight", (256, 64)))


def _tokenizer() -> dict[str, Any]:
    """A word-level tokenizer.json (the tokenizers library's format), written without the library."""
    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, 256)}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def safetensors_bytes(tensors: Sequence[tuple[str, tuple[int, ...]]], *, seed: int = 0) -> bytes:
    """A safetensors file of bf16 tensors with deterministic bytes (the format: an 8-byte header
    length, a JSON header of dtypes, shapes and offsets, the raw data)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = bytearray()
    for name, shape in tensors:
        size = 2
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [len(data), len(data) + size]}
        stream = hashlib.shake_256(f"{seed}:{name}".encode()).digest(size)
        data += stream
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(data)


def materialize(path: Path, edits: Sequence[Mapping[str, Any]] = ()) -> Path:
    """Lay out the base model directory at ``path`` (replacing what is there), then apply ``edits``."""
    for folder in (path, sidecar(path)):
        if folder.exists():
            shutil.rmtree(folder)
    path.mkdir(parents=True)
    files: dict[str, Any] = {
        "config.json": _CONFIG,
        "generation_config.json": _GENERATION,
        "tokenizer_config.json": _TOKENIZER_CONFIG,
        "tokenizer.json": _tokenizer(),
    }
    for name, content in files.items():
        _write_json(path / name, content)
    (path / "model.safetensors").write_bytes(safetensors_bytes(_WEIGHTS))
    for edit in edits:
        _apply(path, edit)
    return path


def sidecar(path: Path) -> Path:
    """A configs-only directory beside the model (``--hf-config-path {model}.cfg``)."""
    return path.with_name(path.name + ".cfg")


def _write_json(file: Path, content: Any) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(content, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def _apply(root: Path, edit: Mapping[str, Any]) -> None:
    """One edit of a model directory: set or drop a JSON field, write or remove a file, rewrite weights."""
    op = edit["op"]
    file = root / edit["file"]
    if op == "json_set":
        data = json.loads(file.read_text(encoding="utf-8"))
        data[edit["key"]] = edit["value"]
        _write_json(file, data)
    elif op == "json_del":
        data = json.loads(file.read_text(encoding="utf-8"))
        data.pop(edit["key"], None)
        _write_json(file, data)
    elif op == "write_json":
        _write_json(file, edit["value"])
    elif op == "write_text":
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(edit["value"], encoding="utf-8")
    elif op == "remove":
        file.unlink()
    elif op == "weights":
        # Other weights in the same layout: same tensors, same size, other bytes (a fine-tune).
        file.write_bytes(safetensors_bytes(_WEIGHTS, seed=int(edit.get("seed", 1))))
    elif op == "weights_tensors":
        file.write_bytes(safetensors_bytes([(name, tuple(shape)) for name, shape in edit["tensors"]]))
    elif op == "reindent":
        # The same JSON document written another way (key order, spacing): the same content.
        data = json.loads(file.read_text(encoding="utf-8"))
        file.write_text(json.dumps(dict(reversed(list(data.items()))), indent=4) + "\n", encoding="utf-8")
    elif op == "touch":
        os.utime(file, (1_000_000_000, 1_000_000_000))
    elif op == "sidecar":
        # The model's config.json, with ``set`` applied, in the directory beside it.
        _write_json(sidecar(root) / edit["file"], {**_CONFIG, **edit.get("set", {})})
    else:
        raise ValueError(f"unknown model edit {op!r}")


def argv_of(variant: Mapping[str, Any], model: str, release: str) -> list[str]:
    """The variant's full server argv under ``release``, its model directory at ``model``."""
    base = bases(release)[variant["base"]]
    argv = list(variant["argv_full"]) if "argv_full" in variant else [*base["argv"], *variant.get("argv", ())]
    return [word.replace(MODEL, model) for word in argv]


def env_of(variant: Mapping[str, Any], model: str, release: str) -> dict[str, str]:
    """The variables the variant's server sees on top of a clean environment (``None``: unset)."""
    env: dict[str, Any] = {**bases(release)[variant["base"]]["env"], **variant.get("env", {})}
    return {k: v.replace(MODEL, model) for k, v in env.items() if v is not None}


def image_of(variant: Mapping[str, Any], release: str) -> dict[str, str]:
    return {"compiler": manifest.release(release).compiler, **variant.get("image", {})}


# --- verdicts -------------------------------------------------------------------------------------


def verdict(answer: Mapping[str, Any], keys_equal: bool | None) -> str:
    """One variant's verdict from the server's answer and whether cachemgr's two keys are equal.

    ``keys_equal`` is None where cachemgr refused the variant (exit 78 or 64: no key, no entry).
    """
    if answer.get("refused"):
        return "server-refuses"
    if keys_equal is None:
        return "cachemgr-refuses"
    same = answer["server_same"] and answer["compile_same"]
    if keys_equal and not same:
        return "false-hit"
    if not keys_equal and same:
        return "needless-miss"
    return "held"


def report(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The counts a run of the oracle is judged by (rows: {"id", "verdict"})."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
    judged = sum(n for v, n in counts.items() if v not in {"server-refuses"})
    return {
        "variants": len(rows),
        "judged": judged,
        "counts": dict(sorted(counts.items())),
        "needless_share": counts.get("needless-miss", 0) / judged if judged else 0.0,
        "false_hits": [r["id"] for r in rows if r["verdict"] == "false-hit"],
        "needless_misses": [r["id"] for r in rows if r["verdict"] == "needless-miss"],
        "cachemgr_refuses": [r["id"] for r in rows if r["verdict"] == "cachemgr-refuses"],
    }


def lock_file(release: str) -> Path:
    """The pinned environment the answers were computed in (tools/oracle/env.sh installs it)."""
    return manifest.release(release).lock


def lock_digest(release: str) -> str:
    return hashlib.sha256(lock_file(release).read_bytes()).hexdigest()


def make_table(release: str, corpus: Mapping[str, Any], answers: Mapping[str, Any]) -> dict[str, Any]:
    """The table the tests replay: the corpus, each variant with the server's answer to it."""
    given = answers["answers"]
    missing = [v["id"] for v in corpus["variants"] if v["id"] not in given]
    if missing:
        raise ValueError(f"the oracle did not answer {len(missing)} variants, e.g. {missing[:3]}")
    return {
        "release": release,
        "versions": answers["versions"],
        "reads": answers.get("reads", {}),
        "lock_sha256": lock_digest(release),
        "seconds": answers["seconds"],
        "seed": corpus.get("seed"),
        # every structured option, its config class per model path and each field tried (fields.py)
        "structured": corpus.get("structured", {}),
        "variants": [{**v, "answer": given[v["id"]]} for v in corpus["variants"]],
    }


def differences(committed: Mapping[str, Any], fresh: Mapping[str, Any]) -> list[str]:
    """What a fresh run of the oracle answers otherwise than the committed table (timings aside)."""
    found = [f"{k}: {committed.get(k)!r} -> {fresh.get(k)!r}" for k in ("release", "versions", "lock_sha256", "seed")
             if committed.get(k) != fresh.get(k)]  # fmt: skip
    old = {v["id"]: v for v in committed["variants"]}
    new = {v["id"]: v for v in fresh["variants"]}
    found += [f"only in the committed table: {vid}" for vid in sorted(set(old) - set(new))]
    found += [f"only in the fresh run: {vid}" for vid in sorted(set(new) - set(old))]
    found += [
        f"{vid}: {old[vid]} -> {new[vid]}" for vid in sorted(set(old) & set(new)) if old[vid] != new[vid]
    ]
    return found


def main(argv: Sequence[str]) -> int:
    """``table RELEASE CORPUS ANSWERS OUT`` writes a table; ``compare COMMITTED FRESH`` checks one."""
    if argv[:1] == ["table"] and len(argv) == 5:
        release, corpus, answers, out = argv[1], *map(Path, argv[2:])
        table = make_table(release, json.loads(corpus.read_text()), json.loads(answers.read_text()))
        out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        return 0
    if argv[:1] == ["compare"] and len(argv) == 3:
        found = differences(json.loads(Path(argv[1]).read_text()), json.loads(Path(argv[2]).read_text()))
        for line in found[:50]:
            print(line)
        if found:
            print(f"{len(found)} differences: the committed table is not current; rerun scripts/oracle")
        return 1 if found else 0
    print(
        "usage: python -m cachemgr_testkit.oracle table RELEASE CORPUS ANSWERS OUT | compare COMMITTED FRESH"
    )
    return 64


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
