"""Re-derive, from the real sources, the facts the ``vllm`` strategy's key and checks depend on.

cachemgr does not import vLLM, vllm-rbln or optimum-rbln; it follows what their code does to the
compile cache (cachemgr/key/vllm_rbln.py, npu.py, loadable.py, drift.py, the stand-in). Each fact below
is a pattern in one file of the unpacked wheels; this script finds it and prints ``file:line``
and what it says, so a reader can check every citation, and tests/test_rbln_facts.py fails when a
fact moves or disappears (a new SDK release: read the diff, update cachemgr, then the citations).

Sources (vllm-rbln 0.12.0 pins ``vllm==0.30.0+cpu``)::

    pip download --no-deps -d /tmp/wheels vllm-rbln==0.12.0 optimum-rbln==0.12.0 vllm==0.30.0
    # unpacked as /tmp/wheels/src/{vllm,vllm_rbln,optimum_rbln}

    .venv/bin/python tools/rbln_facts.py [--src /tmp/wheels/src]   # prints every fact; 1 if one is missing
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SRC = Path("/tmp/wheels/src")  # noqa: S108  # where the pip download above is unpacked
_RBLN = "vllm_rbln/vllm_rbln"
_OPT = "optimum_rbln/optimum/rbln"
_VLLM = "vllm/vllm"


@dataclass(frozen=True)
class Fact:
    name: str
    path: str  # relative to the source root
    pattern: str  # a regular expression (MULTILINE); group 1, if any, is the fact's value
    why: str


@dataclass(frozen=True)
class Found:
    fact: Fact
    line: int  # 1-based line where the match starts
    value: str

    def __str__(self) -> str:
        return f"{self.fact.name:28} {self.fact.path}:{self.line}  {self.value!r}\n{'':29}{self.fact.why}"


FACTS: tuple[Fact, ...] = (
    Fact("vllm_pin", "vllm_rbln/vllm_rbln-0.12.0.dist-info/METADATA", r"^Requires-Dist: vllm==(\S+)$",
         "the vLLM vllm-rbln runs on, local label included: key it exactly"),
    Fact("vllm_rbln_version", "vllm_rbln/vllm_rbln-0.12.0.dist-info/METADATA", r"^Version: (\S+)$",
         "the vllm-rbln release these facts are read from"),
    Fact("optimum_rbln_version", "optimum_rbln/optimum_rbln-0.12.0.dist-info/METADATA", r"^Version: (\S+)$",
         "the optimum-rbln release these facts are read from"),
    Fact("compute_hash_version", f"{_VLLM}/config/vllm.py",
         r"if include_version:\n\s+from vllm import (__version__)\n\n\s+vllm_factors\.append\(__version__\)",
         "VllmConfig.compute_hash() hashes vllm.__version__"),
    Fact("signature_compute_hash", f"{_RBLN}/v1/worker/mega_cache.py", r"return (vllm_config\.compute_hash\(\))",
         "the bundle signature starts from compute_hash(), so from the vLLM version"),
    Fact("signature_parts", f"{_RBLN}/v1/worker/mega_cache.py",
         r'"\|"\.join\((\[cfg, graphs, env, f"npu=\{npu\}", f"rebel=\{rebel_ver\}"\])\)',
         "what the bundle signature joins: config hash, graph set, compile env, raw NPU name, rebel major.minor"),
    Fact("signature_npu", f"{_RBLN}/v1/worker/mega_cache.py",
         r'return (RblnPlatform\.get_device_name\(\) or "unknown")', "the NPU name is hashed as the platform gives it"),
    Fact("npu_order", f"{_RBLN}/platform/__init__.py",
         r'(rebel\.get_npu_name\(device_id\)\n\s+or os\.environ\.get\("RBLN_FORCE_NPU_NAME"\)\n'
         r'\s+or os\.environ\.get\("RBLN_TARGET_SOC"\))',
         "the device first, then RBLN_FORCE_NPU_NAME, then RBLN_TARGET_SOC"),
    Fact("device_nodes", f"{_RBLN}/v1/worker/utils.py", r'^(RBLN_DEV_DIR = "/dev")$',
         "a card this process can open is a /dev/rbln<N> node"),
    Fact("device_node_names", f"{_RBLN}/v1/worker/utils.py",
         r"names = (os\.listdir\(RBLN_DEV_DIR\))", "...listed from /dev (those named rbln<N>)"),
    Fact("optimum_name_no_version", f"{_RBLN}/utils/optimum/converter/dispatch.py",
         r"# (FIXME: To avoid cache collisions, the cache key should also include)\n\s+# the versions",
         "the optimum directory name hashes no version: cachemgr must"),
    Fact("optimum_name_model", f"{_RBLN}/utils/optimum/converter/dispatch.py",
         r"model_name = (str\(vllm_config\.model_config\.model\))",
         "the optimum directory is named after the (redirected) model string"),
    Fact("optimum_cache_dir", f"{_RBLN}/utils/optimum/converter/dispatch.py",
         r'envs\.VLLM_CACHE_ROOT,\n\s+("compiled_models"),', "optimum artifacts live under compiled_models/"),
    Fact("compiled_dir_test", f"{_RBLN}/utils/optimum/paths.py",
         r"return (os\.path\.isfile\(os\.path\.join\(path, RBLN_CONFIG_FILE\)\))",
         "a compiled directory is one holding rbln_config.json"),
    Fact("rbln_config_name", f"{_RBLN}/utils/optimum/paths.py", r'^RBLN_CONFIG_FILE = "([^"]+)"',
         "its name"),
    Fact("model_redirect", f"{_VLLM}/config/model.py", r"(self\.model = maybe_model_redirect\(self\.model\))",
         "vLLM replaces the model string by its VLLM_MODEL_REDIRECT_PATH entry"),
    Fact("model_redirect_table", f"{_VLLM}/transformers_utils/utils.py",
         r"(redirect_dict = _maybe_json_dict\(model_redirect_path\) or _maybe_space_split_dict\()",
         "a JSON object, else 'model target' lines"),
    Fact("warmup_skip", f"{_RBLN}/v1/worker/utils.py",
         r'if vllm_config\.model_config\.enforce_eager:\n\s+return "enforce_eager is set"\n'
         r"\s+if not (envs\.VLLM_RBLN_ENABLE_WARM_UP):",
         "no warm-up with --enforce-eager or VLLM_RBLN_ENABLE_WARM_UP off"),
    Fact("warmup_skipped_in_worker", f"{_RBLN}/v1/worker/rbln_worker.py",
         r"if \(skip := (compile_and_warmup_skip_reason\(self\.vllm_config\))\) is not None:",
         "the worker skips compile and warm-up then"),
    Fact("warmup_default", f"{_RBLN}/envs.py",
         r'(os\.environ\.get\("VLLM_RBLN_ENABLE_WARM_UP", "True"\)\.lower\(\) in \("true", "1"\))',
         "warm-up is on unless set to something else than true/1"),
    Fact("save_after_warmup", f"{_RBLN}/v1/worker/rbln_model_runner.py",
         r"(mega_cache\.save\(self\.model_config\.model, sig\))", "the bundle is saved at the end of warm-up only"),
    Fact("load_disabled", f"{_RBLN}/v1/worker/mega_cache.py",
         r'def load\(model: str, sig: str\) -> None:\n\s+"""[^"]*"""\n\s+if (envs\.VLLM_DISABLE_COMPILE_CACHE):',
         "VLLM_DISABLE_COMPILE_CACHE: no load..."),
    Fact("save_disabled", f"{_RBLN}/v1/worker/mega_cache.py",
         r'def save\(model: str, sig: str\) -> None:\n\s+"""[^"]*"""\n\s+if (envs\.VLLM_DISABLE_COMPILE_CACHE):',
         "...and no save"),
    Fact("disable_cache_parse", f"{_VLLM}/envs.py",
         r'return (bool\(int\(os\.getenv\("VLLM_DISABLE_COMPILE_CACHE", "0"\)\)\))', "how vLLM reads it"),
    Fact("save_failure_logged", f"{_RBLN}/v1/worker/mega_cache.py", r'"(Could not persist the rbln mega-cache bundle)',
         "a failed save is only logged: the server serves on, nothing saved"),
    Fact("bundle_resave", f"{_RBLN}/v1/worker/mega_cache.py",
         r'(tmp_path = f"\{path\}\.\{os\.getpid\(\)\}\.tmp")', "each save writes <bundle>.<pid>.tmp, then renames it"),
    Fact("bundle_path", f"{_RBLN}/v1/worker/mega_cache.py",
         r'"rbln",\n\s+f"\{_safe_name\(raw\)\}-\{suffix\}",\n\s+sig,\n\s+f"rank\{local_rank\}",\n\s+"(mega_cache\.bin)",',
         "rbln/<model>-<sha1>/<signature>/rank<N>/mega_cache.bin"),
    Fact("modelinfos", f"{_VLLM}/model_executor/models/registry.py", r'return Path\(envs\.VLLM_CACHE_ROOT\) / "(modelinfos)"',
         "vLLM's own records under VLLM_CACHE_ROOT: not compiled artifacts"),
    Fact("model_impl_aliases", f"{_RBLN}/config.py", r'"(transformers)": "optimum",',
         "--model-impl transformers is the optimum path"),
    Fact("compile_only_vllm_path", f"{_RBLN}/compilation/compiler.py", r"if (envs\.VLLM_RBLN_COMPILE_ONLY):",
         "compile-only is an option of the vLLM-model path's torch.compile backend"),
    Fact("optimum_runtimes_default", f"{_OPT}/configuration_utils.py",
         r'elif self\._runtime_options\["create_runtimes"\] is None:\n\s+return (True)',
         "optimum-rbln creates runtimes by default..."),
    Fact("optimum_device_check", f"{_OPT}/modeling_base.py",
         r"if create_runtimes:\n\s+runtime_cannot_be_created = (tp_and_devices_are_ok)\(",
         "...and checks the devices before compiling: no CPU-only compile"),
    Fact("optimum_tmpdir", f"{_OPT}/modeling.py", r"save_dir = (TemporaryDirectory\(\))",
         "the optimum compile writes the whole model under $TMPDIR first..."),
    Fact("optimum_save_copy", f"{_OPT}/modeling_base.py", r'(tmp_dir = str\(save_directory_path\) \+ "\.tmp")',
         "...then copies it to <dir>.tmp on the cache and renames it"),
    Fact("optimum_save_called", f"{_RBLN}/model_executor/models/optimum/model_base.py",
         r"(model\.save_pretrained\(cached_model_path\))", "vllm-rbln saves the compiled model into compiled_models/"),
)  # fmt: skip


def derive(src: Path) -> tuple[list[Found], list[str]]:
    """Every fact found under ``src``, and the names of those not found (with why)."""
    found: list[Found] = []
    missing: list[str] = []
    for fact in FACTS:
        path = src / fact.path
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            missing.append(f"{fact.name}: {fact.path}: {error.strerror}")
            continue
        match = re.search(fact.pattern, text, re.MULTILINE)
        if match is None:
            missing.append(f"{fact.name}: {fact.path}: pattern not found (the code moved on)")
            continue
        value = match.group(1) if match.groups() else match.group(0)
        found.append(Found(fact, text.count("\n", 0, match.start()) + 1, value))
    return found, missing


def compile_only_readers(src: Path) -> list[str]:
    """vllm-rbln files that read VLLM_RBLN_COMPILE_ONLY (envs.py defines it): where compile-only acts."""
    root = src / _RBLN
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.name != "envs.py" and "envs.VLLM_RBLN_COMPILE_ONLY" in p.read_text(encoding="utf-8")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--src", type=Path, default=DEFAULT_SRC, help=f"unpacked wheels (default {DEFAULT_SRC})"
    )
    args = parser.parse_args(argv)
    found, missing = derive(args.src)
    for item in found:
        print(item)
    print(f"VLLM_RBLN_COMPILE_ONLY is read in: {', '.join(compile_only_readers(args.src))}")
    for line in missing:
        print(f"MISSING {line}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
