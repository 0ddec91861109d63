"""The server's own identity of each variant, computed by the real server code (the key oracle).

Runs in the environment tools/oracle/env.sh builds (vLLM 0.30.0, vllm-rbln 0.12.0, optimum-rbln
0.12.0, transformers 5.15.1, the CPU torch; the stand-in's ``rebel``/``torch.rbln`` import surface
in place of the RBLN compiler), with standin/cachemgr_standin/pymods and testkit/ on PYTHONPATH.
scripts/oracle runs it; nothing of cachemgr is imported here. The line numbers cited are 0.12.0's;
vllm-rbln 0.11 (no RBLNConfig: 0.11.2 on vLLM 0.24.0, 0.11.1 on vLLM 0.22.0) differs where
``_Release011`` says, and a release without a mega-cache module (0.11.1) has no bundle to identify on
its vLLM-model path. Which of these the installed release is, is probed from its code.

For a variant (testkit/cachemgr_testkit/oracle.py: an argv, an environment, a model directory,
an image) it does what ``vllm serve`` does up to the compile, with the server's own functions:

1. the argv through the real parser (``vllm.entrypoints.cli.serve``'s ``make_arg_parser`` with the
   rbln platform's ``pre_register_and_update``) and ``validate``, as ``vllm.entrypoints.cli.main``;
2. ``AsyncEngineArgs.from_cli_args`` and ``create_engine_config`` (vllm-rbln's wrapper of it
   included: it resolves the model path and the platform's config hooks run inside);
3. the identity the server saves and looks up its compile under:
   - vLLM-model path: ``mega_cache.config_signature(vllm_config)`` and the directory
     ``mega_cache.bundle_path`` puts it in (``rbln/<model>-<sha>/<signature>``), with the ranks
     whose ``rank<N>/mega_cache.bin`` this process's workers write (``rbln_worker.py`` 818-835);
   - optimum path: ``OptimumRBLNConfig.cached_model_path``, the ``compiled_models/`` directory
     ``dispatch._resolve_rbln_config`` computed with ``_generate_model_path_name`` during step 2;
4. what a miss would compile: on the optimum path, ``RBLNCompileSpec.for_architecture`` with the
   arguments ``OptimumModelBase.init_model`` passes (model class and rbln_config), the
   ``hf_config`` and dtype it hands to ``from_pretrained``, and the weights it reads (by content);
   on the vLLM-model path the bundle's signature is that record (vllm-rbln hashes there what its
   graphs are built from).

The server identity can miss a compile input (the optimum directory name hashes a few fields;
``hf_config`` edits, quantization configs and weights are compiled in): the answer says so
(``server_same`` true, ``compile_same`` false) and cachemgr must key it.

How variants run. A fresh server start per variant costs ~10 s (importing vLLM and vllm-rbln),
so variants that change only the argv (or a vLLM variable, which vLLM reads lazily at each access,
``vllm/envs.py`` 2179-2189) run in a child forked from a process that has built the parser and one
base configuration ("warm"). Everything that could be read at import time runs in a child forked
before vLLM is imported ("cold"): vllm-rbln variables (``envs.py`` 173 reads one at import; the
platform resolves the path from them at import), model directory edits (vLLM caches configs by
path), another image. Each run checks its own fidelity: a sample of warm variants runs cold too
(``--fidelity``), and any difference stops the oracle.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import signal
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cachemgr_testkit import oracle

# vllm-rbln's RBLN_* and VLLM_RBLN_* variables, and the one it publishes for its children.
_IMPORT_TIME_PREFIXES = ("VLLM_RBLN_", "RBLN_", "_VLLM_RBLN_")
_CHILD_TIMEOUT = 600.0
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=2, help="cold children at once")
    parser.add_argument("--fidelity", type=int, default=12, help="warm variants also run cold, per base")
    parser.add_argument("--only", nargs="*", help="variant ids (and their references) to run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--release", help="the vllm-rbln release installed here (default: read it)")
    args = parser.parse_args()
    set_release(args.release)
    corpus = json.loads(args.corpus.read_text())
    variants = {v["id"]: v for v in corpus["variants"]}
    if args.only:
        wanted = set(args.only)
        for vid in list(wanted):
            wanted |= _refs(variants, vid)
        variants = {k: v for k, v in variants.items() if k in wanted}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cachemgr-oracle-") as tmp:
        runner = Oracle(Path(tmp), jobs=args.jobs)
        try:
            answers = runner.run(variants, fidelity=args.fidelity, seed=args.seed)
        finally:
            if getattr(runner, "raw", None):  # every run's result, kept whatever happens next
                args.out.with_suffix(".raw.json").write_text(json.dumps(runner.raw, default=str))
    result = {
        "versions": _versions(),
        "reads": runner.base_reads,  # the files of the model directory each base's server opens
        "seconds": round(time.monotonic() - started, 1),
        "answers": answers,
    }
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    refused = sum(1 for a in answers.values() if a.get("refused"))
    print(f"oracle: {len(answers)} variants in {result['seconds']} s, {refused} refused by the server",
          file=sys.stderr)  # fmt: skip
    return 0


def _refs(variants: Mapping[str, Any], vid: str) -> set[str]:
    found: set[str] = set()
    ref = variants[vid].get("ref")
    while ref:
        found.add(ref)
        ref = variants[ref].get("ref")
    return found


def _versions() -> dict[str, str]:
    import importlib.metadata

    return {
        d: importlib.metadata.version(d)
        for d in ("vllm", "vllm-rbln", "optimum-rbln", "transformers", "torch")
    }


# --- scheduling ---------------------------------------------------------------------------------


def is_cold(variant: Mapping[str, Any]) -> bool:
    """Must this variant start from an interpreter that has not imported vLLM?"""
    env = variant.get("env", {})
    return bool(
        variant.get("model")
        or variant.get("image")
        or variant.get("cold")
        or any(name.startswith(_IMPORT_TIME_PREFIXES) or not name.startswith("VLLM_") for name in env)
    )


class Oracle:
    def __init__(self, tmp: Path, *, jobs: int) -> None:
        self.tmp = tmp
        self.jobs = jobs
        self.cache_root = tmp / "vllm-cache"  # VLLM_CACHE_ROOT: identities are read relative to it
        self.home = tmp / "home"
        self.home.mkdir()
        self.models = tmp / "models"
        self.base_model = oracle.materialize(self.models / "base")

    def run(self, variants: Mapping[str, Any], *, fidelity: int, seed: int) -> dict[str, Any]:
        _clean_environment(self.home, self.cache_root)
        _import_third_party(self.base_model, self.home, self.cache_root)  # shared by every child
        results: dict[str, dict[str, Any]] = {}
        # Cold: every variant that needs it. A variant that edits the model directory runs at a path
        # of its own, after its reference at that same path (the path is part of both identities).
        cold_jobs: list[list[tuple[str, Mapping[str, Any], Path]]] = []
        for vid, variant in variants.items():
            if not is_cold(variant):
                continue
            if variant.get("model"):
                path = self.models / _slug(vid)
                ref = variants[variant["ref"]] if variant.get("ref") else _base(variant)
                cold_jobs.append([(f"{vid}#ref", ref, path), (vid, variant, path)])
            else:
                cold_jobs.append([(vid, variant, self.base_model)])
        warm = {vid: v for vid, v in variants.items() if not is_cold(v)}
        rng = random.Random(seed)
        sample: list[str] = []
        for base in _bases():
            ids = sorted(vid for vid, v in warm.items() if v["base"] == base)
            sample += rng.sample(ids, min(fidelity, len(ids)))
        for vid in sample:
            cold_jobs.append([(f"{vid}#cold", warm[vid], self.base_model)])
        for base in _bases():
            cold_jobs.append([(f"base:{base}", _base({"base": base}), self.base_model)])
        # The warm zygotes run beside the cold jobs (each one process at a time).
        zygotes = {
            base: self._start_warm(base, {vid: v for vid, v in warm.items() if v["base"] == base})
            for base in _bases()
        }
        results |= self._run_cold(cold_jobs)
        for base, (pid, out) in zygotes.items():
            results |= self._finish_warm(base, pid, out)
        self.raw = results
        _check_fidelity(results, sample)
        self.base_reads = {base: results[f"base:{base}"].get("reads", []) for base in _bases()}
        return {vid: _answer(vid, variants, results) for vid in variants}

    def _run_cold(self, jobs: Sequence[Sequence[tuple[str, Mapping[str, Any], Path]]]) -> dict[str, Any]:
        """Up to ``self.jobs`` jobs at once; each job's runs one after another, a fresh child each."""
        results: dict[str, dict[str, Any]] = {}
        pending = list(jobs)
        running: dict[int, int] = {}
        while pending or running:
            while pending and len(running) < self.jobs:
                job = pending.pop(0)
                pid, fd = _fork(lambda j=job: self._cold_job(j))
                running[pid] = fd
            pid, status = _wait_any(running)
            if pid in running:
                done = _collect(running.pop(pid), status, 0.0)
                if "error" in done or "refused" in done:
                    raise SystemExit(f"oracle: a cold job failed: {done}")
                results |= done
                _progress("cold", len(jobs) - len(pending) - len(running), len(jobs))
        return results

    def _cold_job(self, job: Sequence[tuple[str, Mapping[str, Any], Path]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for run_id, spec, path in job:
            began = time.monotonic()
            pid, fd = _fork(lambda s=spec, p=path: self._cold_child(s, p))
            _, status = os.waitpid(pid, 0)
            out[run_id] = _collect(fd, status, time.monotonic() - began)
        return out

    def _cold_child(self, variant: Mapping[str, Any], path: Path) -> dict[str, Any]:
        if path != self.base_model:
            oracle.materialize(path, variant.get("model", ()))
        _set_environment(variant, path, self.home, self.cache_root)
        server = Server()
        return server.identity(oracle.argv_of(variant, str(path), release().name), path, self.cache_root)

    def _start_warm(self, base: str, variants: Mapping[str, Any]) -> tuple[int, Path]:
        """A zygote warmed with the base's configuration, a fork per variant; results to a file."""
        out = self.tmp / f"warm-{base}.jsonl"
        pid = os.fork()
        if pid == 0:  # the zygote
            code = 0
            try:
                with open(out, "w") as stream:
                    self._zygote(base, variants, stream)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        return pid, out

    def _finish_warm(self, base: str, pid: int, out: Path) -> dict[str, dict[str, Any]]:
        status = _wait(pid)
        if status != 0:
            raise SystemExit(f"the warm zygote of {base} failed ({status})")
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        return {line["run"]: line["result"] for line in lines}

    def _zygote(self, base: str, variants: Mapping[str, Any], out: Any) -> None:
        spec = _base({"base": base})
        _set_environment(spec, self.base_model, self.home, self.cache_root)
        server = Server()
        argv = oracle.argv_of(spec, str(self.base_model), release().name)
        first = server.identity(argv, self.base_model, self.cache_root)
        out.write(json.dumps({"run": f"base:{base}#warm", "result": first}) + "\n")
        out.flush()
        for n, (vid, variant) in enumerate(variants.items(), 1):
            _progress(f"warm {base}", n, len(variants))
            pid, fd = _fork(lambda v=variant: self._warm_child(server, v))
            _, status = os.waitpid(pid, 0)
            out.write(json.dumps({"run": vid, "result": _collect(fd, status, 0.0)}) + "\n")
            out.flush()

    def _warm_child(self, server: Server, variant: Mapping[str, Any]) -> dict[str, Any]:
        _set_environment(variant, self.base_model, self.home, self.cache_root)
        return server.identity(
            oracle.argv_of(variant, str(self.base_model), release().name), self.base_model, self.cache_root
        )


_REAPED: dict[int, int] = {}  # children reaped while waiting for others: pid -> status


def _wait_any(pids: Mapping[int, Any]) -> tuple[int, int]:
    """Wait for one of ``pids``; another child that ends meanwhile (a warm zygote) is kept for later."""
    for pid in pids:
        if pid in _REAPED:
            return pid, _REAPED.pop(pid)
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid in pids:
            return pid, status
        _REAPED[pid] = status


def _wait(pid: int) -> int:
    return _REAPED.pop(pid) if pid in _REAPED else os.waitpid(pid, 0)[1]


_STARTED = time.monotonic()


def _progress(what: str, done: int, total: int) -> None:
    if done == total or done % 25 == 0:
        print(
            f"oracle: {what} {done}/{total} after {time.monotonic() - _STARTED:.0f} s",
            file=sys.stderr,
            flush=True,
        )


def _base(variant: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": f"base:{variant['base']}", "base": variant["base"]}


def _slug(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _fork(work: Any) -> tuple[int, int]:
    """Run ``work()`` in a child; its JSON result comes back on the returned descriptor."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        signal.alarm(int(_CHILD_TIMEOUT))
        code = 0
        try:
            result = work()
        except BaseException as error:  # the server refusing a variant is an answer, not a failure
            result = {"refused": f"{type(error).__name__}: {_first_line(error)}"}
        try:
            with os.fdopen(write, "w") as stream:
                json.dump(result, stream, default=str)
        except BaseException:
            code = 3
        os._exit(code)
    os.close(write)
    return pid, read


def _collect(fd: int, status: int, seconds: float) -> dict[str, Any]:
    with os.fdopen(fd) as stream:
        text = stream.read()
    if status != 0 or not text:
        return {"error": f"child ended with status {status}", "seconds": round(seconds, 1)}
    result: dict[str, Any] = json.loads(text)
    return result


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""


def _check_fidelity(results: Mapping[str, Any], sample: Sequence[str]) -> None:
    """A warm run must answer as a fresh start does: the sample ran both ways."""
    pairs = [(f"base:{b}#warm", f"base:{b}") for b in _bases()] + [(vid, f"{vid}#cold") for vid in sample]
    for warm_id, cold_id in pairs:
        warm, cold = _comparable(results[warm_id]), _comparable(results[cold_id])
        if warm != cold:
            raise SystemExit(f"oracle: {warm_id} answers otherwise warm than cold:\n{warm}\n{cold}")


def _comparable(result: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != "seconds"}


def _answer(vid: str, variants: Mapping[str, Any], results: Mapping[str, Any]) -> dict[str, Any]:
    """The variant's answer against its reference: is the server's identity (and compile) the same?"""
    variant = variants[vid]
    mine = results[vid]
    if variant.get("model"):
        ref = results[f"{vid}#ref"]
    elif variant.get("ref"):
        ref = results[variant["ref"]]
    else:
        ref = results[f"base:{variant['base']}"]
    for name, result in (("variant", mine), ("reference", ref)):
        if "error" in result:
            raise SystemExit(f"oracle: {vid}: the {name} run failed: {result['error']}")
    if ref.get("refused"):
        return {"refused": f"its reference is refused: {ref['refused']}"}
    if mine.get("refused"):
        return {"refused": mine["refused"]}
    return {
        "path": mine["path"],
        **({"reads": mine.get("reads", [])} if variant.get("model") else {}),
        "server_same": mine["path"] == ref["path"] and mine["identity"] == ref["identity"],
        "compile_same": mine["path"] == ref["path"] and mine["compile"] == ref["compile"],
        "differs": sorted(
            {f"identity.{k}" for k in _diff(mine["identity"], ref["identity"])}
            | {f"compile.{k}" for k in _diff(mine["compile"], ref["compile"])}
            | ({"path"} if mine["path"] != ref["path"] else set())
        ),
    }


def _diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> set[str]:
    return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}


# --- one server start ---------------------------------------------------------------------------


def _clean_environment(home: Path, cache_root: Path) -> None:
    """What every run starts from: no VLLM_/RBLN_/HF_ variable of the caller, offline, a private home."""
    keep = {"PATH", "PYTHONPATH", "LANG", "LC_ALL", "TMPDIR", "TZ"}
    for name in list(os.environ):
        if name not in keep:
            del os.environ[name]
    os.environ.update(_fixed(home, cache_root))


def _fixed(home: Path, cache_root: Path) -> dict[str, str]:
    return {
        "HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(cache_root),
        "VLLM_CONFIGURE_LOGGING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "STANDIN_NPU_NAME": "none",  # the stand-in rebel: no device answers
    }


def _set_environment(variant: Mapping[str, Any], model: Path, home: Path, cache_root: Path) -> None:
    image = oracle.image_of(variant, release().name)
    wanted = {**_fixed(home, cache_root), **oracle.env_of(variant, str(model), release().name)}
    wanted["STANDIN_REBEL_VERSION"] = image["compiler"]
    keep = {"PATH", "PYTHONPATH", "LANG", "LC_ALL", "TMPDIR", "TZ"}
    for name in list(os.environ):
        if name not in keep and name not in wanted:
            del os.environ[name]
    os.environ.update(wanted)


# The server's own packages: imported by each run, never before the run's environment is set.
_SERVER_PACKAGES = (
    "vllm",
    "vllm_rbln",
    "optimum",
    "rebel",
    "torch.rbln",
    "identity",
    "cachemgr_testkit",
    "__main__",
)


def _import_third_party(model: Path, home: Path, cache_root: Path) -> None:
    """Import, once, before any fork, every library a server start imports but the server's own.

    A cold run pays for importing vLLM and vllm-rbln, which read the run's VLLM_/RBLN_ variables at
    import; the libraries under them (torch and its compiler stack, transformers, openai, pydantic,
    numba...) read none of those, so they are imported here, in the clean environment every run
    shares. Which they are is learnt from one start in a throwaway child, not listed by hand.
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        code = 0
        try:
            for base in _bases():  # both paths: each imports its own modules
                spec = _base({"base": base})
                _set_environment(spec, model, home, cache_root)
                Server().identity(oracle.argv_of(spec, str(model), release().name), model, cache_root)
            names = sorted(n for n in sys.modules if not n.startswith(_SERVER_PACKAGES))
            with os.fdopen(write, "w") as stream:
                json.dump(names, stream)
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as stream:
        text = stream.read()
    _, status = os.waitpid(pid, 0)
    if status != 0 or not text:
        raise SystemExit("oracle: the first server start failed; see above")
    _clean_environment(home, cache_root)
    for name in json.loads(text):
        with contextlib.suppress(Exception):
            __import__(name)


class Server:
    """``vllm serve`` up to its compile, in this process (imports vLLM on first use)."""

    def __init__(self) -> None:
        import rebel  # noqa: F401  # the stand-in: installs the rebel.* / torch.rbln import surface
        from vllm.entrypoints.cli import serve
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        cli_env_setup = _first_of(
            "cli_env_setup", "vllm.entrypoints.serve.utils.api_utils", "vllm.entrypoints.utils"
        )

        cli_env_setup()
        # As vllm.entrypoints.cli.main.main() builds it (the serve subcommand alone: the others add
        # no option to it).
        self.parser = FlexibleArgumentParser(description="vLLM CLI")
        subparsers = self.parser.add_subparsers(required=False, dest="subparser")
        self.commands = {}
        for command in serve.cmd_init():
            command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
            self.commands[command.name] = command

    def identity(self, argv: Sequence[str], model: Path, cache_root: Path) -> dict[str, Any]:
        began = time.monotonic()
        with _files_read_under(model) as reads:
            config = self.config(argv)
        impl = release().resolved_path()
        if impl == "vllm":
            identity, compile_record = _vllm_path(config, cache_root)
        else:
            identity, compile_record = _optimum_path(config, cache_root, model)
        return {"path": impl, "identity": identity, "compile": compile_record, "reads": sorted(reads),
                "seconds": round(time.monotonic() - began, 2)}  # fmt: skip

    def config(self, argv: Sequence[str]) -> Any:
        import vllm
        from vllm.usage.usage_lib import UsageContext

        if list(argv[:1]) != ["vllm"]:
            raise ValueError(f"not a vllm argv: {argv[:2]}")
        with _argparse_errors():
            args = self.parser.parse_args(list(argv[1:]))
        if args.subparser in self.commands:
            self.commands[args.subparser].validate(args)
        # ServeSubcommand.cmd: a positional model wins over --model.
        if getattr(args, "model_tag", None) is not None:
            args.model = args.model_tag
        engine_args = vllm.AsyncEngineArgs.from_cli_args(args)
        return engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def _first_of(name: str, *modules: str) -> Any:
    """``name`` from the first of ``modules`` that has it: a function vLLM moved between releases
    (``cli_env_setup``: ``vllm/entrypoints/utils.py`` in 0.22, ``serve/utils/api_utils.py`` later)."""
    import importlib

    for module in modules:
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    raise ImportError(f"{name} is in none of {modules}")


_READS: list[tuple[str, set[str]]] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _READS and isinstance(args[0], str):
        root, found = _READS[-1]
        path = os.path.abspath(args[0])
        if path.startswith(root + os.sep):
            found.add(os.path.relpath(path, root))


@contextlib.contextmanager
def _files_read_under(model: Path) -> Any:
    """The files of the model directory the server opens while it builds its configuration."""
    if not getattr(_audit, "installed", False):
        sys.addaudithook(_audit)
        _audit.installed = True  # type: ignore[attr-defined]
    found: set[str] = set()
    _READS.append((str(model.resolve()), found))
    try:
        yield found
    finally:
        _READS.pop()


@contextlib.contextmanager
def _argparse_errors() -> Any:
    """argparse reports a refused argv by exiting 2: make it an answer."""
    try:
        yield
    except SystemExit as exit_:
        raise ValueError(f"the parser refuses the argv (exit {exit_.code})") from None


def _resolved_path() -> str:
    from vllm_rbln import platform

    return str(platform._MODEL_IMPL)  # set by the create_engine_config wrapper (platform/__init__.py 413-432)


def _vllm_path(config: Any, cache_root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    mega_cache = _mega_cache()
    if mega_cache is None:
        # vllm-rbln 0.11.1 (vLLM 0.22): no mega-cache bundle; the RBLN compiler caches the vLLM-model
        # path's graphs itself. The path is recorded, its identity is not (the manifest leaves it
        # unchecked: cachemgr keys it strictly).
        return {"layout": "compiler"}, {"layout": "compiler"}
    signature = mega_cache.config_signature(config)
    bundle = Path(mega_cache.bundle_path(config.model_config.model, signature))
    folder = bundle.parent.parent.relative_to(cache_root).as_posix()  # rbln/<model>-<sha>/<signature>
    parallel = config.parallel_config
    world = parallel.world_size
    first = parallel.data_parallel_rank * world if parallel.data_parallel_size > 1 else 0
    identity = {"bundle": folder, "ranks": [first, first + world]}
    return identity, dict(identity)


def _mega_cache() -> Any:
    """vllm-rbln's mega-cache module, or None where the release has none (probed, not assumed)."""
    import importlib.util

    if importlib.util.find_spec("vllm_rbln.v1.worker.mega_cache") is None:
        return None
    from vllm_rbln.v1.worker import mega_cache

    return mega_cache


def _optimum_path(config: Any, cache_root: Path, model: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    folder = Path(release().cached_model_path(config)).relative_to(cache_root).as_posix()
    spec = release().compile_spec(config)
    hf_config = config.model_config.hf_config.to_dict()
    # PretrainedConfig.to_dict writes the running transformers' version, whatever the file said, and
    # the folder the config was read from (--hf-config-path moves it): neither reaches the compile.
    hf_config.pop("transformers_version", None)
    hf_config.pop("_name_or_path", None)
    record = {
        "dir": folder,
        "model_cls": f"{spec.model_cls.__module__}.{spec.model_cls.__name__}",
        "rbln_config": spec.rbln_config,
        "dtype": str(config.model_config.dtype),
        "hf_config": _digest(hf_config),
        "weights": _weights(Path(config.model_config.model)),
        # what the compiler targets and which compiler: vllm-rbln's signature reads both the same way
        # (mega_cache.py 69-76, 39-49); the directory name reads neither (dispatch.py 78-79)
        "npu": _npu_name(),
        "rebel": _rebel_major_minor(),
    }
    return {"dir": folder}, json.loads(json.dumps(record, default=str))


def _compile_spec(config: Any) -> Any:
    """``RBLNCompileSpec.for_architecture`` with the arguments ``OptimumModelBase.init_model`` passes
    on a miss (vllm_rbln/model_executor/models/optimum/model_base.py 229-240).

    The package ``vllm_rbln.model_executor.models.optimum`` imports every model module, one of which
    imports torchvision (PyPI's build does not load beside the CPU torch here); the spec needs only
    its ``compilation`` module and ``utils.optimum``, so the package is entered without its
    ``__init__``.
    """
    _enter_optimum_package()
    from vllm_rbln.model_executor.models.optimum.compilation import RBLNCompileSpec
    from vllm_rbln.utils.optimum.block_size import get_attn_block_size

    rbln_config = config.additional_config
    return RBLNCompileSpec.for_architecture(
        config.model_config.hf_config,
        batch_size=config.scheduler_config.max_num_seqs,
        block_size=get_attn_block_size(config),
        max_model_len=config.model_config.max_model_len,
        num_devices=rbln_config.num_devices_per_local_rank,
        prefill_chunk_size=config.scheduler_config.max_num_batched_tokens,
        memory_budget=config.cache_config.gpu_memory_utilization,
        rbln_overrides=rbln_config.optimum_overrides,
    )


def _enter_optimum_package() -> None:
    from vllm_rbln.model_executor import models

    name = "vllm_rbln.model_executor.models.optimum"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(next(iter(models.__path__)), "optimum")]
        sys.modules[name] = package


def _npu_name() -> str:
    mega_cache = _mega_cache()
    if mega_cache is not None:
        return str(mega_cache._npu_name())
    # no mega_cache (0.11.1): the platform's name, as mega_cache reads it where it exists
    from vllm_rbln.platform import RblnPlatform

    return RblnPlatform.get_device_name() or "unknown"


def _rebel_major_minor() -> str:
    mega_cache = _mega_cache()
    if mega_cache is not None:
        return str(mega_cache._rebel_major_minor())
    import re

    import rebel

    match = re.match(r"\s*(\d+)\.(\d+)", getattr(rebel, "__version__", "") or "")
    return f"{match.group(1)}.{match.group(2)}" if match else "unknown"


# --- what differs between releases -------------------------------------------------------------


class _Release012:
    """vllm-rbln 0.12.0 (vLLM 0.30.0): the functions above, as they were written for it."""

    name = ""  # set_release names the installed release

    @staticmethod
    def resolved_path() -> str:
        return _resolved_path()

    @staticmethod
    def cached_model_path(config: Any) -> str:
        return str(config.additional_config.cached_model_path)

    @staticmethod
    def compile_spec(config: Any) -> Any:
        return _compile_spec(config)

    @staticmethod
    def structured_classes() -> dict[str, dict[str, type]]:
        """The config classes an option fills that the parser does not name: ``--additional-config``
        resolves into RBLNConfig on the vLLM-model path, OptimumRBLNConfig on the optimum path
        (vllm_rbln/config.py 532-605)."""
        from vllm_rbln.config import OptimumRBLNConfig, RBLNConfig

        return {"additional_config": {"vllm": RBLNConfig, "optimum": OptimumRBLNConfig}}


class _Release011:
    """vllm-rbln 0.11.2 (vLLM 0.24.0): no RBLNConfig (``additional_config`` stays a dict), no
    ``--model-impl`` of vllm-rbln's own, the platform a module (``vllm_rbln/platform.py``)."""

    name = ""  # set_release names the installed release

    @staticmethod
    def resolved_path() -> str:
        # VLLM_RBLN_USE_VLLM_MODEL alone picks the path (platform.py 267, 381); envs reads it
        # at each access (envs.py 458-461)
        from vllm_rbln import envs

        return "vllm" if envs.VLLM_RBLN_USE_VLLM_MODEL else "optimum"

    @staticmethod
    def cached_model_path(config: Any) -> str:
        # utils/optimum/converter/dispatch.py 113-118: VLLM_CACHE_ROOT/compiled_models/<name>, the name
        # from _generate_model_path_name (dispatch.py 57-96), staged in additional_config
        return str(config.additional_config["cached_model_path"])

    @staticmethod
    def compile_spec(config: Any) -> Any:
        """What ``OptimumModelBase.init_model`` compiles on a miss (model_base.py 179-240, 0.11.2): the
        overrides from ``additional_config["rbln_config"]``, the devices from the variable."""
        _enter_optimum_package()
        from vllm_rbln import envs
        from vllm_rbln.model_executor.models.optimum.compilation import RBLNCompileSpec
        from vllm_rbln.utils.optimum.block_size import get_attn_block_size

        return RBLNCompileSpec.for_architecture(
            config.model_config.hf_config,
            batch_size=config.scheduler_config.max_num_seqs,
            block_size=get_attn_block_size(config),
            max_model_len=config.model_config.max_model_len,
            num_devices=envs.VLLM_RBLN_NUM_DEVICES_PER_LOCAL_RANK,
            prefill_chunk_size=config.scheduler_config.max_num_batched_tokens,
            memory_budget=config.cache_config.gpu_memory_utilization,
            rbln_overrides=config.additional_config.get("rbln_config", {}),
        )

    @staticmethod
    def structured_classes() -> dict[str, dict[str, type]]:
        """None of its own: ``additional_config`` is a dict vLLM 0.24 hashes whole (free-form)."""
        return {}


_CURRENT: list[Any] = [_Release012]  # set_release: the installed release's, before anything runs


def release() -> Any:
    """The adapters of the release being run."""
    return _CURRENT[0]


def set_release(name: str | None) -> None:
    """Use the installed release's adapters; ``name``, if given, must be the installed release and a
    release of the manifest the oracle runs. Which adapters is probed from the installed code
    (vllm-rbln 0.12's ``vllm_rbln/config.py`` holds RBLNConfig; 0.11's have none), not named."""
    import importlib.metadata
    import importlib.util

    from cachemgr_testkit import manifest

    installed = importlib.metadata.version("vllm-rbln")
    name = name or installed
    if name != installed or name not in manifest.oracle_releases():
        raise SystemExit(
            f"oracle: release {name}, vllm-rbln {installed} installed (known: {manifest.oracle_releases()})"
        )
    package = importlib.util.find_spec("vllm_rbln")  # found, not imported (it reads the environment)
    assert package is not None
    assert package.submodule_search_locations
    has_config = (Path(next(iter(package.submodule_search_locations))) / "config.py").is_file()
    shape = _Release012 if has_config else _Release011
    _CURRENT[0] = type(f"_Release_{name}", (shape,), {"name": name})


def _bases() -> dict[str, dict[str, Any]]:
    return oracle.bases(release().name)


def _weights(folder: Path) -> dict[str, str]:
    """Every weight file the loader could read, by its full content (what is compiled in)."""
    found: dict[str, str] = {}
    if folder.is_dir():
        for item in sorted(folder.rglob("*")):
            if item.is_file() and item.name.endswith(_WEIGHT_SUFFIXES):
                found[item.relative_to(folder).as_posix()] = hashlib.sha256(item.read_bytes()).hexdigest()
    return found


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:32]


if __name__ == "__main__":
    sys.exit(main())
