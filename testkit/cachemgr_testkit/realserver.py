"""The real ``vllm serve`` behind ``cachemgr run``/``warm`` (issue 38): only the NPU runtime stood in.

The real vLLM, vllm-rbln and optimum-rbln of a release run from the environment
``scripts/realserver-env RELEASE`` builds (the key oracle's, tools/oracle/env.sh, plus torchvision
beside it), with two directories of the stand-in on PYTHONPATH: ``pymods`` (``rebel`` and ``torch.rbln``: the NPU
compiler and runtime, on the CPU, strict: any name the real code calls that the stand-in lacks fails
loudly) and ``realsite`` (a ``sitecustomize`` that lets torchvision's Python parts import). Each
compile, save and load of the runtime is an event in ``events.jsonl`` (rebel/_runtime.py), so a test
counts them inside the real server process.

The models are tiny llamas the tests make (:func:`make_tiny_llama`): random weights, a word-level
tokenizer, 2 heads of 32 (the vLLM-model path needs head_dim >= 32).

Whether the environment is there: :func:`environment` builds or checks it (well under a second when
current). Without it a test skips with the reason, except where ``CACHEMGR_REQUIRE_REALSERVER=1``
(CI): there it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cachemgr_standin as standin
from cachemgr_standin.shim import write_executable

from cachemgr_testkit import manifest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "scripts" / "realserver-env"
REQUIRE_ENV = "CACHEMGR_REQUIRE_REALSERVER"
STANDIN_DIR = Path(standin.__file__).resolve().parent
PYMODS = STANDIN_DIR / "pymods"
REALSITE = STANDIN_DIR / "realsite"


# What each release's image declares to cachemgr (its packages' metadata; cachemgr's own interpreter
# has none of them: docs/design.md, the cache key), read from the manifest: vLLM as vllm-rbln pins
# it, local label included ("+cpu": the registry's CUDA wheel tools/oracle/env.sh installs has the
# same Python source). Declaring "0.30.0" instead left every pod of the tier keyed strictly, never by
# the release's checked rules. The releases are those scripts/realserver-env builds.
def _declared(release: str) -> dict[str, str]:
    entry = manifest.release(release)
    return {
        "CACHEMGR_VLLM_VERSION": entry.vllm,
        "CACHEMGR_VLLM_RBLN_VERSION": entry.name,
        "CACHEMGR_OPTIMUM_RBLN_VERSION": entry.optimum_rbln,
        "CACHEMGR_TRANSFORMERS_VERSION": entry.transformers,
        "CACHEMGR_COMPILER_VERSION": entry.compiler,
    }


TIER = ("0.12.0", "0.11.2")
RELEASES: dict[str, dict[str, str]] = {release: _declared(release) for release in TIER}

# The NPU each model path runs on: vllm-rbln 0.12 refuses the vLLM-model path on RBLN-CA* NPUs
# (vllm_rbln/config.py 327-349), so that path's pods are RBLN-CR13 nodes.
NPU = {"optimum": "RBLN-CA25", "vllm": "RBLN-CR13"}


class UnavailableError(Exception):
    """The release's environment is not built here (the message says how to build it)."""


def oracle_dir() -> Path:
    return Path(os.environ.get("CACHEMGR_ORACLE_DIR") or REPO / ".oracle")


def environment(release: str = "0.12.0", *, build: bool | None = None) -> Path:
    """The venv of ``release``'s real server (scripts/realserver-env). ``build``: build it even where
    nothing is built yet (default: only with ``CACHEMGR_REQUIRE_REALSERVER=1``); one built before is
    always checked (a stamp: well under a second), and rebuilt if its lock changed."""
    root = oracle_dir() / release
    if build is None:
        build = os.environ.get(REQUIRE_ENV) == "1"
    built = (root / "venv" / ".cachemgr-oracle-stamp").is_file() and (root / "realserver").is_dir()
    if not build and not built:
        raise UnavailableError(
            f"the real-server environment for {release} is not built ({root}): "
            f"scripts/realserver-env {release} builds it (a few minutes, from the registry)"
        )
    done = subprocess.run(["bash", str(BUILD), release], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise UnavailableError(
            f"scripts/realserver-env {release} failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )
    return Path(done.stdout.strip().splitlines()[-1]).parent.parent


@dataclass
class Real:
    """A test module's real server: the release's venv and a tiny model made for it."""

    venv: Path
    model: Path
    release: str = "0.12.0"


def real_for_tests(tmp_path_factory: Any, release: str = "0.12.0") -> Real:
    """The ``real`` fixture of a module: :func:`environment_or_skip` and a tiny llama."""
    venv = environment_or_skip(release)
    model = make_tiny_llama(venv, tmp_path_factory.mktemp("models") / "tiny-llama")
    return Real(venv=venv, model=model, release=release)


@contextlib.contextmanager
def real_pods(real: Real, work: Path, path: str = "optimum") -> Iterator[Any]:
    """Pods (a :class:`~cachemgr_testkit.podlib.Cluster` in ``work``) in front of the real server, on
    the nodes of ``path``: RBLN-CA25 (optimum) or RBLN-CR13 (where vllm-rbln takes the vLLM-model path)."""
    from cachemgr_testkit.podlib import cluster

    write_vllm(work / "realbin", real.venv)
    with cluster(work, **pod_env(work, real.release, path=path)) as group:
        yield group


def environment_or_skip(release: str = "0.12.0") -> Path:
    """:func:`environment` for a test: it skips with the reason where the environment is not built,
    and fails instead where ``CACHEMGR_REQUIRE_REALSERVER=1`` (CI)."""
    import pytest

    try:
        return environment(release)
    except UnavailableError as exc:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))


def complete(port: int) -> dict[str, Any]:
    """One completion from the real server's OpenAI API on ``port``."""

    from cachemgr_testkit.podlib import LOOPBACK

    body = json.dumps({"prompt": "w1 w2 w3", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with LOOPBACK.open(request, timeout=60) as reply:
        answer: dict[str, Any] = json.loads(reply.read())
    return answer


def entry_files(entry: Path) -> dict[Path, bytes]:
    """Every file of a published entry and its bytes: what "the entry is untouched" compares."""
    return {p: p.read_bytes() for p in sorted(entry.rglob("*")) if p.is_file()}


def server_pythonpath(venv: Path) -> str:
    """The stand-in's start-up and NPU runtime, and the tier's packages beside the venv (torchvision)."""
    return os.pathsep.join([str(REALSITE), str(PYMODS), str(venv.parent / "realserver")])


def write_vllm(bin_dir: Path, venv: Path) -> Path:
    """``bin_dir/vllm``: the real ``vllm`` of ``venv`` with the stand-in NPU runtime on its path.
    cachemgr recognises the server by argv (basename ``vllm``), so pods run ``vllm serve ...``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = (
        "#!/bin/sh\n"
        "# The REAL vLLM server (tools/oracle/env.sh), with the STAND-IN NPU runtime (rebel, torch.rbln).\n"
        f"PYTHONPATH={shlex.quote(server_pythonpath(venv))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
        "export PYTHONPATH\n"
        f'exec {shlex.quote(str(venv / "bin" / "python"))} -m vllm.entrypoints.cli.main "$@"\n'
    )
    return write_executable(bin_dir / "vllm", script)


_MAKE_MODEL = r"""
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = Path(sys.argv[1])
words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(253)]
tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(out)
config = LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
)
torch.manual_seed(int(sys.argv[2]))
LlamaForCausalLM(config).save_pretrained(out)
"""


def make_tiny_llama(venv: Path, out: Path, seed: int = 0) -> Path:
    """A llama of 2 layers, 2 heads of 32, a vocabulary of 256 words, random weights (``seed``):
    config, safetensors and tokenizer saved in ``out``, by the release's own transformers."""
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", _MAKE_MODEL, str(out), str(seed)],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": server_pythonpath(venv)},
    )
    if done.returncode != 0:
        raise AssertionError(f"making the tiny llama failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return out


# How a release picks the model path: vllm-rbln 0.12's --model-impl (vllm_rbln/config.py), the 0.11
# releases' VLLM_RBLN_USE_VLLM_MODEL alone (0.11.2 vllm_rbln/envs.py:204-207; vLLM 0.24's parser has
# no "optimum" choice for --model-impl): :func:`argv` and :func:`pod_env` follow it.
BY_FLAG = frozenset({"0.12.0"})


def releases_under_test() -> list[str]:
    """The releases the tier runs (``$CACHEMGR_REALSERVER_RELEASES``, comma-separated; default 0.12.0,
    the one CI builds): e.g. ``0.12.0,0.11.2`` is the long form (docs/development.md)."""
    raw = os.environ.get("CACHEMGR_REALSERVER_RELEASES") or "0.12.0"
    names = [name.strip() for name in raw.split(",") if name.strip()]
    unknown = [name for name in names if name not in RELEASES]
    if unknown:
        raise ValueError(
            f"CACHEMGR_REALSERVER_RELEASES names {', '.join(unknown)}: the tier knows {', '.join(RELEASES)}"
        )
    return names


def argv(model: Path, port: int, path: str = "optimum", *extra: str, release: str = "0.12.0") -> list[str]:
    """``vllm serve`` of the tiny model on ``path`` ("optimum" or "vllm"), small enough for the CPU."""
    common = [
        "vllm",
        "serve",
        str(model),
        "--port",
        str(port),
        "--max-model-len",
        "128",
        "--max-num-seqs",
        "2",
    ]
    impl = ["--model-impl", path] if release in BY_FLAG else []  # else VLLM_RBLN_USE_VLLM_MODEL (pod_env)
    if path == "optimum":
        # The optimum path needs a block size (vllm_rbln/config.py refuses none).
        return [*common, *impl, "--block-size", "128", *extra]
    # Host tensors (VLLM_RBLN_USE_DEVICE_TENSOR=0, pod_env) and a fixed KV-cache size: no device memory.
    return [*common, *impl, "--block-size", "16", "--num-gpu-blocks-override", "64", *extra]


def pod_env(work: Path, release: str = "0.12.0", path: str = "optimum") -> dict[str, str]:
    """What a pod of the real server needs beyond :class:`~cachemgr_testkit.podlib.Cluster`'s:
    the real ``vllm`` first on PATH, the strict stand-in runtime logging to ``work/events.jsonl``,
    an NPU node (a ``rbln0`` device node; the stand-in rebel names the NPU) and the release's versions."""
    bin_dir = work / "realbin"
    dev = work / "dev"
    dev.mkdir(parents=True, exist_ok=True)
    (dev / "rbln0").touch()
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(PYMODS),  # cachemgr's own key resolution asks the stand-in rebel too
        "CACHEMGR_RBLN_DEV_DIR": str(dev),
        "CACHEMGR_NPU_TYPE": NPU[path],
        "STANDIN_NPU_NAME": NPU[path],
        "STANDIN_REBEL_STRICT": "1",
        # rebel.__version__ as the release's image has it (its major.minor is in the bundle's signature)
        "STANDIN_REBEL_VERSION": RELEASES[release]["CACHEMGR_COMPILER_VERSION"],
        "STANDIN_REBEL_EVENTS": str(work / "events.jsonl"),
        "VLLM_RBLN_USE_DEVICE_TENSOR": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        **({} if release in BY_FLAG else {"VLLM_RBLN_USE_VLLM_MODEL": "1" if path == "vllm" else "0"}),
        **RELEASES[release],
    }


# Whether the release's optimum path caches a model given as a local directory. vllm-rbln 0.12.0 asks
# whether the directory holds a compiled model (model_base.py:190-195, is_compiled_dir) and compiles a
# plain one into compiled_models/; 0.11.2 takes any existing path as compiled (model_base.py:185-186,
# os.path.exists), so optimum-rbln compiles it in place on every start, into a temporary directory,
# and nothing is saved under VLLM_CACHE_ROOT (a hub id offline is such a path too: vLLM 0.24
# arg_utils.py:759-766 replaces it with its snapshot directory).
CACHES_LOCAL_MODEL = {"0.12.0": True, "0.11.2": False}


@dataclass
class Events:
    """The stand-in runtime's events of one test (``work/events.jsonl``), from every server process."""

    path: Path

    def all(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.all() if e["event"] == kind]

    def graph_compiling_processes(self) -> set[int]:
        """Server processes that compiled a graph through the torch.compile backend (vLLM-model path)."""
        return {e["pid"] for e in self.of("backend_compile")}

    def compiling_processes(self) -> set[int]:
        """Server processes that compiled the model: optimum-rbln's ``compile_from_torch`` (optimum
        path) or a graph of the model through the torch.compile backend (vLLM-model path)."""
        return {e["pid"] for e in self.all() if e["event"] == "compile"}

    def loading_processes(self) -> set[int]:
        return {e["pid"] for e in self.all() if e["event"] in {"load", "bundle_read"} and e.get("ok", True)}

    def missing(self) -> list[str]:
        """Names the real code called that the stand-in lacks (strict mode refused them)."""
        return [str(e["name"]) for e in self.of("missing")]


def demo(work: Path, release: str = "0.12.0") -> int:
    """``scripts/realserver-demo``: a cold pod, then a warm one, on one volume, in front of the real
    server; prints what each pod's server compiled and loaded (the stand-in runtime's events)."""
    import signal
    import time

    from cachemgr_testkit.podlib import cluster, free_port

    venv = environment(release, build=True)
    print(f"real server: vLLM {RELEASES[release]['CACHEMGR_VLLM_VERSION']}, vllm-rbln {release} ({venv})")
    model = make_tiny_llama(venv, work / "models" / "tiny-llama")
    print(f"model: a tiny llama made here ({model})")
    write_vllm(work / "realbin", venv)
    events = Events(work / "events.jsonl")
    volume = work / "volume"
    volume.mkdir(parents=True, exist_ok=True)
    with cluster(work, **pod_env(work, release), CACHEMGR_LOG_FORMAT="console") as pods:
        for name in ("cold", "warm"):
            seen = {e["pid"] for e in events.all()}
            started = time.monotonic()
            pod = pods.start(name, argv(model, free_port()), cache_root=volume)
            pod.wait_phase("serving", timeout=900)
            serving = time.monotonic() - started
            pod.signal(signal.SIGTERM)
            code = pod.wait_exit(timeout=120)
            mine = [e for e in events.all() if e["pid"] not in seen]
            compiles = sum(1 for e in mine if e["event"] == "compile")
            loads = sum(1 for e in mine if e["event"] == "load")
            print(
                f"{name} pod: serving after {serving:.0f} s; the real server compiled {compiles} graph(s) "
                f"and loaded {loads} compiled graph(s); exit {code} after SIGTERM (log: {pod.log})"
            )
    return 0


if __name__ == "__main__":
    import sys
    import tempfile

    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="cachemgr-realserver-"))
    raise SystemExit(demo(target))
