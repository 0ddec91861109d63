"""Generate ``cachemgr/key/vllm_flags.py``: every option of ``vllm serve`` (vLLM 0.30.0 + vllm-rbln 0.12.0).

cachemgr parses a ``vllm serve MODEL ...`` argv without importing vLLM, so it needs vLLM's option
table as data. This script takes that table from the real parser: it builds the ``serve`` sub-parser
exactly as ``vllm.entrypoints.cli.main.main()`` does, adds the ``--rbln-*`` flags exactly as the RBLN
platform does, and writes down every argparse action. Nothing is transcribed by hand.

How the committed table was made (Python 3.11.7, 2 cores, no GPU, no network but the registries)
---------------------------------------------------------------------------------------------------
Sources on disk::

    /tmp/wheels/vllmwhl/vllm-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl
        sha256 ef52ee58c410ead0b8afb190838fa4cbcb52075596f67862a03859d984966ac4
    /tmp/wheels/vllm_rbln-0.12.0-py3-none-any.whl
        sha256 0af77bcf84421b15ffbb9625b880ce2184f6afa4cc720e91dd2c904d19ee2263
    /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl   (the torch vLLM 0.30.0 pins)

Commands, from the repository root::

    .venv/bin/python tools/gen_vllm_flags.py --setup-venv   # builds /tmp/vllm-introspect (a few minutes)
    .venv/bin/python tools/gen_vllm_flags.py                # writes cachemgr/key/vllm_flags.py (about 10 s)
    .venv/bin/python tools/gen_vllm_flags.py --check        # exit 0 if the committed file is current

``--setup-venv`` makes a throwaway venv outside the repo, installs the vLLM wheel with ``--no-deps``,
the local CPU torch, and the pure-Python part of vLLM's own ``Requires-Dist`` (``_INTROSPECTION_DEPS``
below; the CUDA-only ones -- flashinfer, cutlass, nvtx, tilelang, torchaudio/vision/codec ... -- are
left out because building the parser never imports them). The resolved versions of the committed run
included pydantic 2.14.4, transformers 5.24.0, torch 2.13.0+cpu. Nothing is installed into the
project's ``.venv`` and nothing of vLLM is imported by cachemgr at run time.

What the dump step does (``--dump``, run by the driver inside the introspection interpreter)
----------------------------------------------------------------------------------------------
1. Checks that the installed ``vllm`` is 0.30.0 and that every ``vllm/**.py`` file it imports from
   has the sha256 the wheel's RECORD lists, i.e. the parser comes from exactly that wheel.
2. Checks that no vLLM plugin other than vLLM's own is installed (a plugin can add options).
3. Sets ``vllm.platforms.current_platform`` to ``CpuPlatform()``, as ``vllm bench`` does, because the
   RBLN platform itself cannot load here (it imports ``rebel``, the RBLN compiler, which is not on
   this machine). At parse time ``RblnPlatform.device_type`` is "cpu" too unless the vllm model path
   with device tensors is selected by environment, which would only add "rbln" to the choices of
   ``--mm-processor-device``: no option appears, disappears or changes arity.
4. Builds the ``vllm`` top-level parser and ``ServeSubcommand().subparser_init(subparsers)``, the very
   code ``vllm serve`` runs (``make_arg_parser`` -> ``FrontendArgs.add_cli_args`` ->
   ``AsyncEngineArgs.add_cli_args``).
5. Extracts ``vllm_rbln/`` (not its dist-info, so its platform entry point stays unregistered) from
   the vllm-rbln wheel into a temp dir and calls ``vllm_rbln.config.add_rbln_cli_args(serve_parser)``,
   which is what ``RblnPlatform.pre_register_and_update(parser)`` does at the end of
   ``AsyncEngineArgs.add_cli_args``. That hook's other parser edits (``--block-size`` choices dropped,
   ``--gpu-memory-utilization`` default 0.93, "rbln" appended to a ``--device`` option that 0.30.0 no
   longer has) change no option string, arity or value parser, so they are not mirrored.
6. Writes every action of the serve parser as JSON: option strings, nargs, action class, and the value
   parser with vLLM's ``optional_type``/``parse_type`` wrappers unwrapped. An action class or value
   parser this script has not classified before is an error, so a future vLLM cannot slip through.

The driver then renders the module (sorted, one entry per line) and writes or ``--check``s it.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib
import importlib.metadata
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.30.0"
VLLM_RBLN_VERSION = "0.12.0"

REPO = Path(__file__).resolve().parent.parent
OUTPUT = REPO / "cachemgr" / "key" / "vllm_flags.py"
# Where the sources lay when the table was made; read only, never written (hence the noqa).
DEFAULT_PYTHON = Path("/tmp/vllm-introspect/bin/python")  # noqa: S108
DEFAULT_VLLM_WHEEL = Path("/tmp/wheels/vllmwhl/vllm-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl")  # noqa: S108
DEFAULT_VLLM_RBLN_WHEEL = Path("/tmp/wheels/vllm_rbln-0.12.0-py3-none-any.whl")  # noqa: S108
LOCAL_TORCH = "torch==2.13.0"  # pip's find-links on this machine serve the local CPU build

# vLLM 0.30.0's Requires-Dist minus the CUDA/GPU-only packages; enough to import its CLI.
_INTROSPECTION_DEPS = (
    "regex", "cachetools", "psutil", "sentencepiece", "numpy", "requests>=2.26.0", "tqdm", "blake3",
    "py-cpuinfo", "transformers>=5.10.4", "huggingface_hub>=1.31.0", "tokenizers>=0.21.1",
    "safetensors>=0.6.2", "protobuf", "fastapi[standard]>=0.133.0,<0.137.0", "starlette>=1.0.1",
    "aiohttp>=3.13.3", "openai>=2.25.0", "pydantic>=2.12.0", "prometheus_client>=0.18.0", "pillow",
    "prometheus-fastapi-instrumentator>=8.0.0", "tiktoken>=0.6.0", "lm-format-enforcer==0.11.3",
    "llguidance>=1.7.0,<1.8.0", "outlines_core==0.2.14", "lark==1.2.2", "xgrammar>=0.2.1,<1.0.0",
    "partial-json-parser", "jsonschema>=4.23.0", "pyzmq>=25.0.0", "msgspec", "mistral_common[image]>=1.11.6",
    "pyyaml", "einops", "compressed-tensors==0.17.0", "depyf==0.20.0", "cloudpickle", "watchfiles",
    "python-json-logger", "ninja", "pybase64", "cbor2", "ijson", "setproctitle", "uvloop",
    "openai-harmony>=0.0.3", "anthropic>=0.71.0", "model-hosting-container-standards>=0.1.14,<1.0.0",
    "mcp>=2.0.0,<3.0.0", "opentelemetry-sdk>=1.27.0", "opentelemetry-api>=1.27.0",
    "opentelemetry-exporter-otlp>=1.27.0", "opentelemetry-semantic-conventions-ai>=0.4.1",
)  # fmt: skip

# Action classes argparse/vLLM/vllm-rbln use in the serve parser, by the arity they imply.
_ZERO_ARG_ACTIONS = {
    "_HelpAction", "_StoreTrueAction", "_StoreFalseAction", "_StoreConstAction", "_CountAction",
    "BooleanOptionalAction", "_StoreRblnBool",
}  # fmt: skip
_VALUE_ACTIONS = {"_StoreAction", "_AppendAction", "LoRAParserAction", "_MergeAdditionalConfig", "_StoreRbln"}

# Value parsers (after unwrapping optional_type/parse_type) that read the value as JSON.
_JSON_KINDS = {"json", "dataclass-json", "json-or-str"}
_KNOWN_KINDS = _JSON_KINDS | {
    "none", "str", "int", "float", "human-readable-int", "human-readable-int-or-auto",
    "comma-separated-ids", "lower-underscored-str",
}  # fmt: skip
# Value parsers that keep the value as text (or take none): FLAG_KINDS leaves them out.
_TEXT_KINDS = {"none", "str"}
_LAMBDA_KINDS = {
    "device_ids": "comma-separated-ids",
    "moe_backend": "lower-underscored-str",
    "linear_backend": "lower-underscored-str",
    "sparse_indexer_topk_backend": "lower-underscored-str",
}
_RBLN_GROUP = "RBLNConfig"


# --------------------------------------------------------------------------------------------------
# dump: runs inside the introspection interpreter (vLLM installed), stdlib + vLLM only
# --------------------------------------------------------------------------------------------------


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _verify_installed_vllm(wheel: Path) -> int:
    """Every vllm/**.py of the wheel is installed byte for byte; returns how many were checked."""
    found = importlib.metadata.version("vllm")
    if found != VLLM_VERSION:
        raise SystemExit(f"the introspection interpreter has vllm {found}, not {VLLM_VERSION}")
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm is not importable in the introspection interpreter")
    site = Path(next(iter(spec.submodule_search_locations))).parent
    with zipfile.ZipFile(wheel) as zf:
        record_name = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(zf.read(record_name).decode())))
    checked = 0
    for path, digest, _size in rows:
        if not (path.startswith("vllm/") and path.endswith(".py")):
            continue
        installed = site / path
        if not installed.is_file() or _record_hash(installed.read_bytes()) != digest:
            raise SystemExit(f"{installed} differs from {wheel.name}; reinstall the wheel")
        checked += 1
    return checked


def _verify_no_foreign_plugins() -> None:
    for group in ("vllm.general_plugins", "vllm.platform_plugins"):
        for ep in importlib.metadata.entry_points(group=group):
            dist = ep.dist.name if ep.dist is not None else "?"
            if dist != "vllm":
                raise SystemExit(f"plugin {ep.name!r} of {dist} is installed; it could add options")


def _unwrap(fn: Any) -> tuple[Any, bool]:
    """The value parser inside vLLM's optional_type/parse_type wrappers, and whether optional_type
    (which reads "" and "None" as None) was among them."""
    optional = False
    while (
        callable(fn)
        and getattr(fn, "__module__", "") == "vllm.engine.arg_utils"
        and getattr(fn, "__name__", "") in {"_optional_type", "_parse_type"}
    ):
        optional = optional or fn.__name__ == "_optional_type"
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__), strict=True))
        fn = cells["return_type"]
    return fn, optional


def _value_kind(fn: Any, dest: str) -> str:
    """Name the value parser an action applies, looking through optional_type/parse_type."""
    arg_utils = importlib.import_module("vllm.engine.arg_utils")
    argparse_utils = importlib.import_module("vllm.utils.argparse_utils")
    fn, _ = _unwrap(fn)
    kinds: dict[Any, str] = {
        None: "none",
        str: "str",
        int: "int",
        float: "float",
        json.loads: "json",
        arg_utils.union_dict_and_str: "json-or-str",
        argparse_utils.human_readable_int: "human-readable-int",
        argparse_utils.human_readable_int_or_auto: "human-readable-int-or-auto",
    }
    if fn in kinds:
        return kinds[fn]
    name = getattr(fn, "__name__", "")
    in_arg_utils = getattr(fn, "__module__", "") == "vllm.engine.arg_utils"
    if in_arg_utils and name == "parse_dataclass":
        return "dataclass-json"
    if in_arg_utils and name == "<lambda>" and dest in _LAMBDA_KINDS:
        return _LAMBDA_KINDS[dest]
    raise SystemExit(f"unclassified value parser {fn!r} for {dest}; teach tools/gen_vllm_flags.py")


def _jsonable(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def dump(rbln_src: Path, vllm_wheel: Path, out: Path) -> None:
    checked = _verify_installed_vllm(vllm_wheel)
    _verify_no_foreign_plugins()

    platforms: Any = importlib.import_module("vllm.platforms")
    cpu = importlib.import_module("vllm.platforms.cpu")
    platforms.current_platform = cpu.CpuPlatform()  # what `vllm bench` does; see the docstring

    serve = importlib.import_module("vllm.entrypoints.cli.serve")
    argparse_utils = importlib.import_module("vllm.utils.argparse_utils")
    # As vllm.entrypoints.cli.main.main() builds it.
    top = argparse_utils.FlexibleArgumentParser(description="vLLM CLI")
    top.add_argument("-v", "--version", action="version", version=VLLM_VERSION)
    subparsers = top.add_subparsers(required=False, dest="subparser")
    parser = serve.ServeSubcommand().subparser_init(subparsers)

    sys.path.insert(0, str(rbln_src))
    rbln_version = importlib.import_module("vllm_rbln._version").__version__
    if rbln_version != VLLM_RBLN_VERSION:
        raise SystemExit(f"vllm-rbln is {rbln_version}, not {VLLM_RBLN_VERSION}")
    importlib.import_module("vllm_rbln.config").add_rbln_cli_args(parser)

    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    actions = [
        {
            "option_strings": list(a.option_strings),
            "dest": a.dest,
            "nargs": a.nargs,
            "action": type(a).__name__,
            "negatable": isinstance(a, argparse.BooleanOptionalAction),
            "append": isinstance(a, argparse._AppendAction),
            "kind": _value_kind(a.type, a.dest),
            "optional": _unwrap(a.type)[1],
            "const": _jsonable(a.const),
            "group": group_of.get(id(a)),
        }
        for a in parser._actions
    ]
    result = {
        "vllm_version": importlib.metadata.version("vllm"),
        "vllm_rbln_version": rbln_version,
        "python": sys.version.split()[0],
        "checked_files": checked,
        "allow_abbrev": parser.allow_abbrev,
        "prefix_chars": parser.prefix_chars,
        "top_level_options": sorted(top._option_string_actions),
        "actions": actions,
    }
    out.write_text(json.dumps(result, indent=1, sort_keys=True))


# --------------------------------------------------------------------------------------------------
# driver: runs with any Python 3.11+, stdlib only
# --------------------------------------------------------------------------------------------------


def _extract_vllm_rbln(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith("vllm_rbln/") and not name.endswith("/"):
                target = dest / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(name))


def run_dump(python: Path, vllm_wheel: Path, vllm_rbln_wheel: Path) -> dict[str, Any]:
    for needed in (python, vllm_wheel, vllm_rbln_wheel):
        if not needed.exists():
            raise SystemExit(f"{needed} is missing; see the docstring of {Path(__file__).name}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "RBLN_", "PYTHON"))}
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    with tempfile.TemporaryDirectory(prefix="gen-vllm-flags-") as tmp:
        rbln_src = Path(tmp) / "src"
        _extract_vllm_rbln(vllm_rbln_wheel, rbln_src)
        out = Path(tmp) / "dump.json"
        cmd = [str(python), str(Path(__file__).resolve()), "--dump", str(rbln_src), "--vllm-wheel",
               str(vllm_wheel), "--dump-to", str(out)]  # fmt: skip
        proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"the dump failed with exit code {proc.returncode}")
        data: dict[str, Any] = json.loads(out.read_text())
    return data


def _canonical_and_aliases(action: dict[str, Any]) -> tuple[str, list[str]]:
    opts: list[str] = action["option_strings"]
    if action["negatable"]:
        # BooleanOptionalAction adds "--no-X" after each "--X" it was given; those are not aliases.
        opts = [o for o in opts if not (o.startswith("--no-") and "--" + o[5:] in opts)]
    longs = [o for o in opts if o.startswith("--")]
    if not longs:
        raise SystemExit(f"option without a long spelling: {opts}")
    return longs[0][2:], [o for o in opts if o != longs[0]]


def _arity(action: dict[str, Any]) -> str:
    nargs = action["nargs"]
    cls = action["action"]
    if cls in _ZERO_ARG_ACTIONS:
        if nargs != 0:
            raise SystemExit(f"{cls} with nargs {nargs!r}")
        return "0"
    if cls not in _VALUE_ACTIONS:
        raise SystemExit(f"unclassified action class {cls}; teach tools/gen_vllm_flags.py")
    if nargs is None:
        return "1"
    if nargs in ("?", "+", "*"):
        return str(nargs)
    raise SystemExit(f"unexpected nargs {nargs!r} for {action['option_strings']}")


class Table:
    def __init__(self, data: dict[str, Any]) -> None:
        if data["vllm_version"] != VLLM_VERSION or data["vllm_rbln_version"] != VLLM_RBLN_VERSION:
            versions = f"vllm {data['vllm_version']} / vllm-rbln {data['vllm_rbln_version']}"
            raise SystemExit(f"the dump is of {versions}")
        if not data["allow_abbrev"] or data["prefix_chars"] != "-":
            raise SystemExit("the serve parser's abbreviation rules changed: revise the docstring notes")
        self.flags: dict[str, str] = {}
        self.aliases: dict[str, str] = {}
        self.negatable: set[str] = set()
        self.json: set[str] = set()
        self.json_or_str: set[str] = set()
        self.append: set[str] = set()
        self.kinds: dict[str, str] = {}
        self.optional: set[str] = set()
        self.rbln: dict[str, str] = {}
        self.optional_consts: dict[str, Any] = {}
        self.positionals: list[str] = []
        seen: set[str] = set()
        for action in data["actions"]:
            opts = action["option_strings"]
            if not opts:
                self.positionals.append(f"{action['dest']} (nargs {action['nargs']!r})")
                continue
            if dup := seen.intersection(opts):
                raise SystemExit(f"option string defined twice: {sorted(dup)}")
            seen.update(opts)
            self._add(action)

    def _add(self, action: dict[str, Any]) -> None:
        name, aliases = _canonical_and_aliases(action)
        if name in self.flags:
            raise SystemExit(f"canonical name {name} twice")
        self.flags[name] = _arity(action)
        for alias in aliases:
            self.aliases[alias] = name
        if action["negatable"]:
            self.negatable.add(name)
        self._add_value_kind(name, action)
        if action["append"]:
            self.append.add(name)
        if self.flags[name] == "?":
            self.optional_consts[name] = action["const"]
        if action["group"] == _RBLN_GROUP:
            key = action["dest"].removeprefix("rbln_")
            if name != "rbln-" + key.replace("_", "-"):
                raise SystemExit(f"{name} does not spell its additional_config key {key}")
            self.rbln[name] = key
        elif name.startswith("rbln-"):
            raise SystemExit(f"{name} is outside the {_RBLN_GROUP} group")

    def _add_value_kind(self, name: str, action: dict[str, Any]) -> None:
        kind = action["kind"]
        if kind not in _KNOWN_KINDS:
            raise SystemExit(f"unknown value kind {kind}")
        if kind in _JSON_KINDS:
            self.json.add(name)
        if kind == "json-or-str":
            self.json_or_str.add(name)
        if kind not in _TEXT_KINDS:
            self.kinds[name] = kind
        if action["optional"]:
            self.optional.add(name)


def _dict_literal(name: str, annotation: str, items: dict[str, str]) -> list[str]:
    lines = [f"{name}: {annotation} = {{"]
    lines += [f"    {json.dumps(k)}: {json.dumps(v)}," for k, v in sorted(items.items())]
    return [*lines, "}"]


def _set_literal(name: str, items: set[str]) -> list[str]:
    lines = [f"{name}: Final[frozenset[str]] = frozenset(", "    {"]
    lines += [f"        {json.dumps(k)}," for k in sorted(items)]
    return [*lines, "    }", ")"]


_NOTES = '''\
"""Generated by tools/gen_vllm_flags.py from vllm {vllm} and vllm-rbln {rbln}: do not edit by hand.

The option table of `vllm serve` as vLLM {vllm} builds it with the vllm-rbln {rbln} platform plugin
(dumped from the live parser under Python {python}). Counts: {n_flags} options, {n_aliases} aliases,
{n_neg} negatable, {n_json} JSON-valued, {n_rbln} --rbln-* flags. Positional: {positionals}.

How vLLM turns the argv into options, which a reimplementation must mirror (all verified against the
real parser). `vllm serve ...` runs vllm.entrypoints.cli.main.main(): the TOP-LEVEL `vllm` parser (a
FlexibleArgumentParser whose only options are -h/--help and -v/--version) gets parse_args(argv) with
argv = ["serve", ...]; its parse_args rewrites the whole argv in the steps below, then plain argparse
hands the tokens after "serve" to the serve sub-parser (no second rewrite).

1. --model relocation (argv[0] == "serve" only). The first token matching ^--model(=.+|$) (exactly
   "--model" or "--model=VALUE", matched before the underscore rewrite, so "--model_impl" and
   "--model-impl" never match) is removed together with its value (the next token, or the text after
   "=") and the value is inserted as argv[1], the positional. Later --model tokens stay options and set
   args.model; the positional wins (ServeSubcommand.cmd sets args.model = args.model_tag when given).
   Then: if argv[1] starts with "-", no token matches ^--config(=.+|$) and some token matches
   ^--served[-_]model[-_]name(=.+|$), vLLM raises ValueError (model must be the first positional).
2. --config FILE. Runs only if the exact token "--config" is present: "--config=FILE" does NOT load the
   file (it only sets args.config, which nothing reads). More than one "--config" token is an error.
   FILE must end in .yaml or .yml and is read with yaml.safe_load; each top-level key, in file order,
   becomes tokens: true -> "--KEY"; false -> "--no-KEY" only if the parser running parse_args has that
   option string, and for `vllm serve` that is the top-level parser, so a false is DROPPED (e.g.
   "enforce-eager: false" leaves the default); a list -> "--KEY" then str(item) for each item (an
   empty list is dropped); a dict -> "--KEY" json.dumps(value); anything else -> "--KEY" str(value)
   (so null -> "None", which the optional-typed options read as None). The tokens are spliced in right
   after "serve MODEL" (when argv[1] does not start with "-") or right after "serve" (then the file
   must have a "model" key, i.e. a "--model" token, else ValueError), and "--config FILE" is removed.
   Since argparse keeps the last value, precedence is CLI > config file > default wherever --config
   sits in the argv. A "model: X" key yields the option "--model X", not the positional (step 1 has
   already run). Config keys go through steps 3-4 like CLI tokens ("tensor_parallel_size: 2" works,
   "compilation-config.mode: 3" becomes a dotted token).
3. Per-token rewrite, every token (values included):
   - "--help=KW" -> "--help" (a help search).
   - a token starting with "--": in the part before the first "=", the text after "--" up to the
     first "." has "_" replaced by "-"; text after that "." and after "=" is untouched
     ("--compilation_config.pass_config.x_y=a_b" -> "--compilation-config.pass_config.x_y=a_b").
   - a token starting with "-O" other than "-O" itself: "-O=X" and "-OX" -> "--optimization-level" "X"
     for any X ("-O3", "-Odecode").
   - "-O" directly followed by a token in {{"0", "1", "2", "3"}} -> "--optimization-level"; any other
     bare "-O" is left alone and argparse rejects it. "-O" is not an option string (not in ALIASES).
4. Dotted JSON tokens. Every token starting with "-" and containing "." (long "--x.y" and short
   "-cc.mode" alike; beware a value such as "-0.5", which vLLM treats the same way): if it has "=",
   it is split at the first "=" and, if the name part has no ".", it is not dotted after all;
   otherwise the value is the NEXT token, consumed whatever it is. A name ending in "+" drops the "+"
   and the value becomes json.dumps(value.split(",")). The name splits on "." into KEY (e.g.
   "--compilation-config" or "-cc") and a path; the value is json.loads(value), else
   human_readable_int(value) ("80g" = 80*10**9, "4K" = 4096; k/m/g/t decimal, K/M/G/T binary), else
   the raw string. Values merge into one dict per KEY spelling (nested by path; dict+dict merges
   recursively, list+list concatenates, anything else is overwritten by the later one). The dotted
   tokens are removed and, per KEY in first-seen order, "KEY" json.dumps(dict) is APPENDED at the end
   of the argv. Hence a dotted value replaces, not merges with, an earlier "--KEY '{{json}}'" (last one
   wins), except for --additional-config (see 6).
5. Then plain argparse (Python 3.11 semantics; the serve parser has allow_abbrev=True):
   - a long option may be abbreviated to any unique prefix of an option string, "--no-*" spellings
     included ("--tensor-parallel 2" is --tensor-parallel-size, "--no-enforce" is --no-enforce-eager);
     an exact match wins; an ambiguous prefix ("--max-num") is an error. "--opt=value" works for
     every option that takes a value.
   - short options: an exact match first ("-tp 2", "-tp=2"); "-n2"/"-r0" work because "-n" and "-r"
     are two characters long (value attached); "-tp2" is an error; a single-dash token may also be a
     unique prefix of a short option ("-as 2" is -asc 2).
   - arity per FLAGS; "+" takes every following token up to the next one that looks like an option (a
     negative number such as "-1" does not); an option given twice keeps the last value, except
     APPEND_FLAGS, which accumulate; for NEGATABLE the last of --X / --no-X wins.
   - a separate value token that starts with "-" and is not a negative number counts as an option, so
     "--served-model-name -x" is an error and only "--served-model-name=-x" passes such a value.
   - optional-value options ("?"), bare form -> const: {optional_consts}.
   - the positional model_tag (nargs "?") may come after options ("serve --port 8000 MODEL" works).
6. vllm-rbln: each "--rbln-FIELD V" stores additional_config[field] = V (parsed), and
   "--rbln-B"/"--no-rbln-B" store True/False; the --additional-config action is replaced by one that
   MERGES a dict value into additional_config (dict.update, in argv order, with the appended dotted
   --additional-config last), while a non-dict value (a string not shaped like "{{...}}") replaces it.
   So --rbln-* flags, repeated --additional-config and --additional-config.KEY all accumulate, a later
   write of the same key winning.

JSON_OR_STR_FLAGS (a subset of JSON_FLAGS) parse the value as JSON only if, stripped of surrounding
whitespace, it starts with "{{" and ends with "}}"; otherwise they keep it as a plain string. The other
JSON_FLAGS always parse JSON (the dataclass-typed *-config ones first expand bare 4k/2G-style numbers);
a few hold a JSON list, not an object (allowed-origins, allowed-methods, allowed-headers).
--lora-modules is not in JSON_FLAGS: each of its items is either name=path or a JSON object.
"""
'''


def render(data: dict[str, Any]) -> str:
    t = Table(data)
    consts = ", ".join(f"--{k} -> {v!r}" for k, v in sorted(t.optional_consts.items())) or "none"
    head = _NOTES.format(
        vllm=VLLM_VERSION, rbln=VLLM_RBLN_VERSION, python=data["python"], n_flags=len(t.flags),
        n_aliases=len(t.aliases), n_neg=len(t.negatable), n_json=len(t.json), n_rbln=len(t.rbln),
        positionals=", ".join(t.positionals) or "none", optional_consts=consts,
    )  # fmt: skip
    lines = [
        head.rstrip("\n"),
        "",
        "from typing import Final",
        "",
        f"VLLM_VERSION: Final = {json.dumps(VLLM_VERSION)}",
        f"VLLM_RBLN_VERSION: Final = {json.dumps(VLLM_RBLN_VERSION)}",
        "",
        '# canonical name (long option without the leading "--", dashes not underscores) -> arity:',
        '#   "0": takes no value (store_true, store_false, store_const, BooleanOptionalAction, count, help)',
        '#   "1": exactly one value;  "?": optional value;  "+": one or more;  "*": zero or more',
        *_dict_literal("FLAGS", "Final[dict[str, str]]", t.flags),
        "",
        "# every other option string -> canonical name: short aliases and alternate long spellings",
        '# (not the "--no-X" spellings: those are NEGATABLE)',
        *_dict_literal("ALIASES", "Final[dict[str, str]]", t.aliases),
        "",
        "# canonical names that also accept --no-<name> (BooleanOptionalAction)",
        *_set_literal("NEGATABLE", t.negatable),
        "",
        "# canonical names whose value vLLM parses as JSON (json.loads, a config dataclass's JSON",
        "# validator, or union_dict_and_str)",
        *_set_literal("JSON_FLAGS", t.json),
        "",
        '# the JSON_FLAGS that parse JSON only when the value looks like "{...}", else keep the string',
        *_set_literal("JSON_OR_STR_FLAGS", t.json_or_str),
        "",
        "# canonical names whose repeated occurrences accumulate (action='append') instead of last-wins",
        *_set_literal("APPEND_FLAGS", t.append),
        "",
        "# canonical name -> how vLLM converts its value (the `type=` of its action, with optional_type and",
        "# parse_type looked through), for every option whose value is not kept as text:",
        '#   "int", "float", "human-readable-int" ("4k" is 4000, "4K" 4096), "human-readable-int-or-auto"',
        '#   ("auto" and "-1" are -1), "json", "json-or-str", "dataclass-json" (bare 4k/2G numbers expanded',
        '#   first), "lower-underscored-str" (lower case, "-" -> "_"), "comma-separated-ids" (digits -> int)',
        *_dict_literal("FLAG_KINDS", "Final[dict[str, str]]", t.kinds),
        "",
        '# canonical names whose value parser is wrapped in optional_type: "" and "None" are read as None',
        *_set_literal("OPTIONAL_FLAGS", t.optional),
        "",
        "# the --rbln-* flags: canonical name -> the additional_config key it writes",
        '# ("rbln-use-w8a8" -> "use_w8a8")',
        *_dict_literal("RBLN_FLAGS", "Final[dict[str, str]]", t.rbln),
    ]
    return "\n".join(lines) + "\n"


def setup_venv(python: Path, vllm_wheel: Path) -> None:
    venv = python.parent.parent
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    subprocess.run([*pip, "--no-deps", str(vllm_wheel)], check=True)
    subprocess.run([*pip, LOCAL_TORCH], check=True)
    subprocess.run([*pip, *_INTROSPECTION_DEPS], check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--python", type=Path, default=DEFAULT_PYTHON, help="interpreter with vllm installed")
    ap.add_argument("--vllm-wheel", type=Path, default=DEFAULT_VLLM_WHEEL)
    ap.add_argument("--vllm-rbln-wheel", type=Path, default=DEFAULT_VLLM_RBLN_WHEEL)
    ap.add_argument("--output", type=Path, default=OUTPUT)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if the output file is not current")
    mode.add_argument("--setup-venv", action="store_true", help="create the introspection venv")
    mode.add_argument("--dump", type=Path, metavar="RBLN_SRC", help=argparse.SUPPRESS)
    ap.add_argument("--dump-to", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.dump is not None:
        dump(args.dump, args.vllm_wheel, args.dump_to)
        return 0
    if args.setup_venv:
        setup_venv(args.python, args.vllm_wheel)
        return 0
    text = render(run_dump(args.python, args.vllm_wheel, args.vllm_rbln_wheel))
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            sys.stderr.write(f"{args.output} is out of date: run tools/gen_vllm_flags.py\n")
            return 1
        sys.stdout.write(f"{args.output} is up to date\n")
        return 0
    args.output.write_text(text)
    sys.stdout.write(f"wrote {args.output}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
