"""A ``vllm serve`` argv read the way vLLM 0.30.0 reads it, in two steps (the :mod:`cachemgr.key.vllm_flags`
docstring lists every rule): the rewrites ``FlexibleArgumentParser.parse_args`` does before argparse runs
(``--model`` relocation, ``--config FILE.yaml``, underscores, ``-O``, dotted ``--x.y`` args), copied
statement by statement; then argparse itself, on a parser built from the generated option table with the
same option strings, arities, value types and vllm-rbln actions. Using the standard library's own argparse
(not a re-implementation) is what makes abbreviations, short options (``-n2``), negative numbers and ``+``
arity come out exactly as vLLM's, which runs on the same interpreter in the modelserver image.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from typing import Any, NoReturn

from cachemgr.key import vllm_flags
from cachemgr.key.vllm_config import config_file_args
from cachemgr.key.vllm_values import human_readable_int, loads, refuse, value_type

# FlexibleArgumentParser's patterns, verbatim (note: "$" also matches before a final newline).
_MODEL_OPTION = re.compile(r"^--model(=.+|$)")
_SERVED_NAME_OPTION = re.compile(r"^--served[-_]model[-_]name(=.+|$)")
_CONFIG_OPTION = re.compile(r"^--config(=.+|$)")
TOP_LEVEL_OPTIONS = frozenset({"-h", "--help", "-v", "--version"})  # the `vllm` parser's own
OWNED = "_rbln_additional_config_owned"  # vllm-rbln's marker attribute
# LoRAModulePath's fields and defaults
_LORA: dict[str, Any] = {"name": None, "path": None, "base_model_name": None, "is_3d_lora_weight": False}


# --- step 1: FlexibleArgumentParser.parse_args, before argparse ---------------------------------


def flexible_rewrite(args: list[str], own_options: frozenset[str]) -> list[str]:
    """The argv FlexibleArgumentParser hands to argparse (vllm_flags docstring, steps 1-4).

    ``own_options``: the option strings of the parser whose parse_args runs (for `vllm serve`, the
    top-level `vllm` parser's), the only ones a false in a --config file can become --no-KEY of.
    """
    if args[:1] == ["serve"]:  # for any FlexibleArgumentParser, the api_server's included
        args = _relocate_model(args)
    if "--config" in args:
        args = _splice_config(args, own_options)
    return _collect_dotted(_respell(args))


def _relocate_model(args: list[str]) -> list[str]:
    """The first --model/--model=X becomes the positional right after "serve"."""
    index = next((i for i, arg in enumerate(args) if _MODEL_OPTION.match(arg)), None)
    if index is not None:
        if args[index] == "--model":
            if index + 1 >= len(args):
                refuse("--model has no value")  # vLLM: IndexError
            model, rest = args[index + 1], index + 2
        else:
            model, rest = args[index].removeprefix("--model="), index + 1
        args = ["serve", model, *args[1:index], *args[rest:]]
    if (
        len(args) > 1
        and args[1].startswith("-")
        and not any(_CONFIG_OPTION.match(arg) for arg in args)
        and any(_SERVED_NAME_OPTION.match(arg) for arg in args)
    ):
        refuse("the model must be the first positional argument when --served-model-name is given")
    return args


def _splice_config(args: list[str], own_options: frozenset[str]) -> list[str]:
    """_pull_args_from_config: the file's flags go first, so the command line overrides them."""
    if args.count("--config") > 1:
        refuse("more than one --config file")  # vLLM: AssertionError
    index = args.index("--config")
    if index == len(args) - 1:
        refuse("--config has no file")
    config_args = config_file_args(args[index + 1], own_options)
    head, rest = args[:index], args[index + 2 :]
    if args[0].startswith("-"):
        return [*config_args, *head, *rest]
    if args[0] == "serve" and not (len(args) > 1 and not args[1].startswith("-")):
        if "--model" not in config_args:
            refuse("no model: give it as the positional argument or as 'model:' in the config file")
        return [args[0], *config_args, *args[1:index], *rest]
    if args[0] == "serve":
        return [*args[:2], *config_args, *args[2:index], *rest]
    return [args[0], *config_args, *args[1:index], *rest]


def _respell(args: list[str]) -> list[str]:
    """Dashes for underscores in option names (up to the first '.'), --help=KW, and the -O forms."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg.startswith("--help="):
            out.append("--help")
        elif arg.startswith("--"):
            key, eq, value = arg.partition("=")
            name, dot, path = key[2:].partition(".")
            out.append(f"--{name.replace('_', '-')}{dot}{path}{eq}{value}")
        elif arg.startswith("-O") and arg != "-O":
            out += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O" and i + 1 < len(args) and args[i + 1] in {"0", "1", "2", "3"}:
            out.append("--optimization-level")
        else:
            out.append(arg)
    return out


def _collect_dotted(args: list[str]) -> list[str]:
    """``-x.a.b V`` tokens merged into one JSON dict per spelling of -x, appended at the end."""
    delete: set[int] = set()
    merged: dict[str, dict[str, Any]] = {}
    for i, arg in enumerate(args):
        if i in delete or not arg.startswith("-") or "." not in arg:
            continue
        if "=" in arg:
            name, value_text = arg.split("=", 1)
            if "." not in name:
                continue  # the '.' was in the value
        else:
            if i + 1 >= len(args):
                refuse(f"{arg} has no value")  # vLLM: IndexError
            name, value_text = arg, args[i + 1]
            delete.add(i + 1)
        if name.endswith("+"):
            name, value_text = name[:-1], json.dumps(value_text.split(","))
        key, *path = name.split(".")
        nested: Any = _dotted_value(value_text)
        for part in reversed(path):
            nested = {part: nested}
        _merge_into(merged.setdefault(key, {}), nested)
        delete.add(i)
    out = [arg for i, arg in enumerate(args) if i not in delete]
    for key, value in merged.items():
        out += [key, json.dumps(value)]
    return out


def _dotted_value(text: str) -> Any:
    try:
        return loads(text)
    except json.JSONDecodeError:
        try:
            return human_readable_int(text)
        except (ValueError, argparse.ArgumentTypeError):
            return text


def _merge_into(original: dict[str, Any], update: dict[str, Any]) -> None:
    """recursive_dict_update: dicts merge, lists concatenate, anything else is replaced."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(original.get(key), dict):
            _merge_into(original[key], value)
        elif isinstance(value, list) and isinstance(original.get(key), list):
            original[key] += value
        else:
            original[key] = value


# --- step 2: argparse, with vLLM's value parsers and vllm-rbln's actions -----------------------


def _writable_additional_config(namespace: argparse.Namespace) -> dict[str, Any]:
    """vllm_rbln.config._additional_config: copy once, then write into it."""
    if not getattr(namespace, OWNED, False):
        current = getattr(namespace, "additional_config", None)
        namespace.additional_config = dict(current) if isinstance(current, dict) else {}
        setattr(namespace, OWNED, True)
    config: dict[str, Any] = namespace.additional_config
    return config


class _StoreRbln(argparse.Action):
    """vllm-rbln: --rbln-FIELD V writes additional_config[FIELD]."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        _writable_additional_config(namespace)[self.dest.removeprefix("rbln_")] = values


class _StoreRblnBool(argparse.BooleanOptionalAction):
    """vllm-rbln: --rbln-B / --no-rbln-B write additional_config[B] = True / False."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        if option_string in self.option_strings:
            key = self.dest.removeprefix("rbln_")
            _writable_additional_config(namespace)[key] = not str(option_string).startswith("--no-")


class _MergeAdditionalConfig(argparse.Action):
    """vllm-rbln: a dict --additional-config merges into what came before; a string replaces it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        if not isinstance(values, dict):
            namespace.additional_config = values
            setattr(namespace, OWNED, False)
            return
        _writable_additional_config(namespace).update(values)


class _LoRAModules(argparse.Action):
    """LoRAParserAction: each item is name=path or a JSON LoRAModulePath."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        modules: list[dict[str, Any]] = []
        for item in values or []:
            if item in (None, ""):
                continue
            if "=" in item and "," not in item:
                name, path = item.split("=", 1)
                modules.append({**_LORA, "name": name, "path": path})
                continue
            try:
                loaded = loads(item)
            except json.JSONDecodeError:
                parser.error(f"Invalid JSON format for --lora-modules: {item}")
            if not isinstance(loaded, dict) or not {"name", "path"} <= set(loaded) <= set(_LORA):
                parser.error(f"Invalid fields for --lora-modules: {item}")
            modules.append({**_LORA, **loaded})
        setattr(namespace, self.dest, modules)


class _Parser(argparse.ArgumentParser):
    """argparse as vLLM runs it, except that a refusal raises ConfigError instead of exiting."""

    def error(self, message: str) -> NoReturn:
        refuse(message)


def _add_option(parser: _Parser, name: str, arity: str) -> None:
    strings = [f"--{name}", *sorted(a for a, target in vllm_flags.ALIASES.items() if target == name)]
    # Defaults are suppressed: the namespace then holds exactly the options the argv set.
    kwargs: dict[str, Any] = {"default": argparse.SUPPRESS}
    if name in vllm_flags.RBLN_FLAGS:
        rbln_bool = name in vllm_flags.NEGATABLE
        kwargs |= {"dest": name.replace("-", "_"), "action": _StoreRblnBool if rbln_bool else _StoreRbln}
    elif name == "additional-config":
        kwargs["action"] = _MergeAdditionalConfig
    elif name == "lora-modules":
        kwargs["action"] = _LoRAModules
    elif name in vllm_flags.NEGATABLE:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif arity == "0":
        kwargs["action"] = "store_true"  # --help too: asking for help is not refused, just dropped
    elif name in vllm_flags.APPEND_FLAGS:
        kwargs["action"] = "append"
    if arity != "0":
        kwargs["type"] = value_type(name)
        if arity != "1":
            kwargs["nargs"] = arity
        if arity == "?":
            kwargs["const"] = True  # --hf-token alone
    parser.add_argument(*strings, **kwargs)


@functools.cache
def serve_parser() -> _Parser:
    """The `vllm serve` parser (make_arg_parser + vllm-rbln's add_rbln_cli_args), from the table."""
    parser = _Parser(prog="vllm serve", add_help=False, allow_abbrev=True)
    parser.add_argument("model_tag", nargs="?", default=None)
    for name, arity in vllm_flags.FLAGS.items():
        _add_option(parser, name, arity)
    return parser
