"""How vLLM 0.30.0 converts each option's value, and the refusal when it would not.

Each option's value parser is the ``type=`` of its argparse action (vLLM's optional_type/parse_type
wrappers looked through), as the generated table records it (:data:`cachemgr.key.vllm_flags.FLAG_KINDS`
and ``OPTIONAL_FLAGS``); the functions here are those parsers, copied statement by statement.
tests/test_serving.py checks them against the real parser's outcomes.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from cachemgr.core.errors import ConfigError
from cachemgr.key import vllm_flags

# The options of each value kind, from the generated table; "optional": optional_type reads "" and
# "None" as None. Every option not named keeps its text.
VALUE_KINDS: Mapping[str, frozenset[str]] = {
    **{
        kind: frozenset(name for name, k in vllm_flags.FLAG_KINDS.items() if k == kind)
        for kind in (
            "int", "float", "human-readable-int", "human-readable-int-or-auto", "dataclass-json",
            "lower-underscored-str", "comma-separated-ids",
        )
    },
    "optional": vllm_flags.OPTIONAL_FLAGS,
}  # fmt: skip


def refuse(what: str) -> NoReturn:
    raise ConfigError(
        f"vLLM {vllm_flags.VLLM_VERSION} would refuse this argv: {what}",
        remedy="fix the server's flags (see vllm serve --help)",
    )


MAX_DEPTH = 64  # vLLM's JSON configs nest a few levels; the key's canonical form recurses per level


class _TooDeepError(ConfigError, argparse.ArgumentTypeError):
    """A ConfigError (exit 78) that argparse, refusing the flag, quotes as it is."""


def loads(text: str) -> Any:
    """``json.loads`` for a flag's value, bounded: deep nesting is a config error, not a crash.

    Named ``loads``: argparse names the type function in its refusals, as vLLM's own json.loads.
    """
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
        depth = MAX_DEPTH + 1
    else:
        depth = _depth(value)
    if depth > MAX_DEPTH:
        raise _TooDeepError(
            f"a JSON value in the server argv is nested more than {MAX_DEPTH} levels deep",
            remedy="pass the server's JSON options as vLLM documents them",
        )
    return value


def _depth(value: Any) -> int:
    """How deeply ``value`` nests (iterative: the point is not to recurse without bound)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if level <= MAX_DEPTH and isinstance(item, dict | list):
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


_BARE_HUMAN_INT = re.compile(r"\b\d+(?:\.\d+)?[kKmMgGtT]\b")
_DECIMAL: Mapping[str, int] = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY: Mapping[str, int] = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int:
    """vllm.utils.argparse_utils.human_readable_int: "25.6k" is 25600, "1K" is 1024."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        try:
            return int(number) * _BINARY[suffix]
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"no decimals with binary suffix {suffix}") from error
    return int(value)


def _human_readable_int_or_auto(value: str) -> int:
    value = value.strip()
    return -1 if value == "-1" or value.lower() == "auto" else human_readable_int(value)


def _json_or_str(value: str) -> Any:
    """union_dict_and_str: JSON only when shaped like {...}."""
    return loads(value) if re.match(r"(?s)^\s*{.*}\s*$", value) else value


def _dataclass_json(value: str) -> Any:
    """The JSON a config dataclass validates, after _expand_json_human_readable_numbers."""
    parts = re.split(r'("(?:[^"\\]|\\.)*")', value)
    for i in range(0, len(parts), 2):  # outside string literals only
        parts[i] = _BARE_HUMAN_INT.sub(lambda m: str(human_readable_int(m.group())), parts[i])
    return loads("".join(parts))


def _device_ids(value: str) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in (p.strip() for p in value.split(","))]


_CONVERTERS: Mapping[str, Callable[[str], Any]] = {
    "int": int, "float": float, "human-readable-int": human_readable_int,
    "human-readable-int-or-auto": _human_readable_int_or_auto, "json-or-str": _json_or_str,
    "dataclass-json": _dataclass_json, "json": loads,
    "lower-underscored-str": lambda s: s.lower().replace("-", "_"), "comma-separated-ids": _device_ids,
}  # fmt: skip


def value_type(name: str) -> Callable[[str], Any] | None:
    """The `type=` vLLM gives option ``name``; ValueError/ArgumentTypeError make argparse refuse."""
    convert = _CONVERTERS.get(vllm_flags.FLAG_KINDS.get(name, "str"))
    if name not in vllm_flags.OPTIONAL_FLAGS:
        return convert
    inner = convert or str

    def optional(value: str) -> Any:
        return None if value in ("", "None") else inner(value)

    optional.__name__ = getattr(inner, "__name__", "value")
    return optional
