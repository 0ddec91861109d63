"""The structured options of ``vllm serve`` and every field of each, from the live parser and the config
classes those options fill (the key oracle's corpus, tools/oracle/corpus.py, tries each field).

Runs in the oracle's environment (tools/oracle/env.sh). A structured option is one whose value is a
JSON object: the parser's type for it parses JSON (``json.loads``, ``union_dict_and_str``) or
validates a config dataclass (``_compute_kwargs``'s ``parse_dataclass``, which carries the class).
The class an option fills is the one its parser validates, else the ``VllmConfig`` field of the same
name (``--speculative-config`` fills ``SpeculativeConfig``), else the release's own
(``--additional-config`` fills vllm-rbln 0.12's ``RBLNConfig`` on the vLLM-model path and
``OptimumRBLNConfig`` on the optimum path: identity.py's adapters name them). An option that fills no
class (``--hf-overrides``, ``--mm-processor-kwargs``...) is free-form: its keys are open-ended, no
field list exists to try, and it stays keyed whole.

For each class: every field the JSON can set (``init``), nested config classes field by field
(dotted paths, ``pass_config.fuse_norm_quant``), its type, its default and a value of its type that
is not the default; and the class's own ``compute_hash`` answer for it (``hashed``: does setting the
field alone change it; None where the class cannot be built or hashed alone). The oracle's answers
decide what a model path's identity reads; ``hashed`` is what the class says it hashes, kept beside
them in the table (docs/development.md, "The key oracle").
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import typing
from collections.abc import Iterator
from pathlib import PurePath
from typing import Any

# Options whose default is None and which need more than an empty object to be accepted: the fields
# are tried on top of this value (the variant "at the seed" is their reference). Hand-written: what a
# user writes at least (a speculative method, a connector and its role).
SEEDS: dict[str, dict[str, Any]] = {
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
    "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
    "ec_transfer_config": {"ec_connector": "ECExampleConnector", "ec_role": "ec_both"},
}
_MAX_DEPTH = 3  # nested config classes deeper than this are tried as one field


def json_types(action: argparse.Action) -> tuple[bool, type | None]:
    """(the option's value is a JSON object, the dataclass its parser validates)."""
    found_json = False
    func: Any = action.type
    for _ in range(6):
        if func is None:
            break
        name = getattr(func, "__qualname__", "")
        if name.endswith("parse_dataclass"):
            return True, (func.__defaults__ or (None,))[0]
        if name in {"loads", "union_dict_and_str"} or name.endswith("union_dict_and_str"):
            found_json = True
        inner = [
            c.cell_contents for c in (getattr(func, "__closure__", None) or ()) if callable(c.cell_contents)
        ]
        func = inner[0] if inner else None
    return found_json, None


def structured_options(
    serve: argparse.ArgumentParser, release_classes: dict[str, dict[str, type]], bases: list[str]
) -> dict[str, dict[str, Any]]:
    """dest -> {"free_form", "engine", "none_default", "bases": {base: {"class", "fields"}}} for every
    option of ``serve`` whose value is a JSON object (a list-valued JSON option is not one)."""
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    vllm_hints = _hints(VllmConfig)
    found: dict[str, dict[str, Any]] = {}
    for action in serve._actions:
        is_json, cls = json_types(action)
        if not is_json or isinstance(action.default, (list, tuple)) or action.nargs in ("+", "*"):
            continue
        dest = action.dest
        per_base: dict[str, dict[str, Any]] = {}
        for base in bases:
            klass = release_classes.get(dest, {}).get(base) or cls or _dataclass_in(vllm_hints.get(dest))
            if klass is None:
                continue
            per_base[base] = {"class": f"{klass.__module__}.{klass.__qualname__}", "fields": {}}
            seed = SEEDS.get(dest, {})
            for path, tried, default, hint in enumerate_fields(klass):
                given = _at(seed, path)
                value = tried
                if given is not _ABSENT and _jsonable(tried) == given:  # the seed has it: another value
                    value = other_value(hint, given)
                per_base[base]["fields"][path] = {
                    "type": _type_text(hint),
                    "default": _jsonable(default),
                    "value": _jsonable(value),
                    "hashed": _hashed(klass, seed, path, value),
                    "values": finite_values(hint),
                }
        found[dest] = {
            "free_form": not per_base,
            "engine": dest in engine_fields,
            "none_default": action.default is None,
            "bases": per_base,
        }
    return found


def enumerate_fields(cls: type, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, Any, Any, Any]]:
    """(dotted path, a value of its type other than the default, the default, the type) per field.

    A nested config class is tried field by field, but for the classes ``VllmConfig`` holds itself
    (``SpeculativeConfig.draft_model_config`` is a ModelConfig the engine builds): such a field is one
    field, tried at an empty object."""
    from vllm.config import VllmConfig

    own = {t for hint in _hints(VllmConfig).values() for t in _flat(hint) if isinstance(t, type)}
    hints = _hints(cls)
    for field in dataclasses.fields(cls):
        if not field.init or field.name.startswith("_"):
            continue
        hint = hints.get(field.name, field.type)
        default = _default(field)
        nested = _dataclass_in(hint)
        if nested is not None and nested not in own and depth < _MAX_DEPTH and dataclasses.fields(nested):
            yield from enumerate_fields(nested, f"{prefix}{field.name}.", depth + 1)
            continue
        value = {} if nested is not None else other_value(hint, default)
        yield f"{prefix}{field.name}", value, default, hint


def other_value(hint: Any, default: Any) -> Any:  # noqa: PLR0911
    """A JSON value of ``hint``'s type that is not ``default``."""
    options = _flat(hint)
    literals = [a for o in options if typing.get_origin(o) is typing.Literal for a in typing.get_args(o)]
    enums = [o for o in options if isinstance(o, type) and issubclass(o, enum.Enum)]
    shown = _jsonable(default)
    if literals:
        return next((v for v in literals if v != shown and v is not None), literals[0])
    if enums:
        members = [m.value if isinstance(m.value, (int, str)) else m.name for m in enums[0]]
        return next((v for v in members if v != shown and str(v) != str(shown)), members[0])
    if bool in options:
        return not default if isinstance(default, bool) else True
    if int in options:
        return default * 2 if isinstance(default, int) and default > 0 else 2
    if float in options:
        return round(default / 2, 4) if isinstance(default, float) and default > 0 else 0.5
    for origin in (list, tuple, set, frozenset):
        args = next(
            (typing.get_args(o) for o in options if typing.get_origin(o) is origin or o is origin), None
        )
        if args is not None:
            if isinstance(default, (list, tuple, set, frozenset)) and len(default) > 1:
                return _jsonable(list(default)[:-1])
            element = args[0] if args else str
            return [1, 2] if int in _flat(element) else [0.5] if float in _flat(element) else ["oracle"]
    if any(typing.get_origin(o) is dict or o is dict for o in options):
        return {"oracle": 1} if not default else {}
    if any(isinstance(o, type) and issubclass(o, PurePath) for o in options):
        return "/tmp/cachemgr-oracle-path"
    if str in options:
        return f"{default}-oracle" if isinstance(default, str) and default else "oracle"
    return 1


def finite_values(hint: Any) -> list[Any] | None:
    """Every JSON value of a type with few (a bool, a Literal, an enum), else None. One value tried
    proves nothing of the others: a field that defaults to None is resolved by the server, and the
    value tried may be the one it resolves to (``cudagraph_mode`` NONE where compilation is off)."""
    options = _flat(hint)
    found: list[Any] = []
    for option in options:
        if typing.get_origin(option) is typing.Literal:
            found += list(typing.get_args(option))
        elif isinstance(option, type) and issubclass(option, enum.Enum):
            found += [m.value if isinstance(m.value, (int, str)) else m.name for m in option]
        elif option is bool:
            found += [True, False]
        elif option is not type(None):
            return None
    return found or None


def _hashed(cls: type, seed: dict[str, Any], path: str, value: Any) -> bool | None:
    """Does the class's own compute_hash change when this field alone is set (None: cannot tell)?"""
    if not hasattr(cls, "compute_hash"):
        return None
    try:
        from pydantic import TypeAdapter

        adapter = TypeAdapter(cls)
        before = adapter.validate_python(json.loads(json.dumps(seed))).compute_hash()
        after = adapter.validate_python(nest(seed, path, value)).compute_hash()
    except Exception:  # the class refuses the field alone, or cannot hash outside a VllmConfig
        return None
    return bool(before != after)


_ABSENT = object()


def _at(doc: dict[str, Any], path: str) -> Any:
    here: Any = doc
    for name in path.split("."):
        if not isinstance(here, dict) or name not in here:
            return _ABSENT
        here = here[name]
    return here


def nest(seed: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """``seed`` with the dotted ``path`` set to ``value`` (a JSON document the parser accepts)."""
    doc: dict[str, Any] = json.loads(json.dumps(seed))
    here = doc
    *parents, last = path.split(".")
    for name in parents:
        here = here.setdefault(name, {})
    here[last] = value
    return doc


def _default(field: dataclasses.Field[Any]) -> Any:
    default = field.default
    if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
        try:
            default = field.default_factory()
        except Exception:
            default = None
    if default is dataclasses.MISSING:
        return None
    if type(default).__name__ == "FieldInfo":  # pydantic.Field(default=...)
        factory = getattr(default, "default_factory", None)
        return factory() if factory is not None else getattr(default, "default", None)
    return default


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls, include_extras=False)
    except Exception:
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _flat(hint: Any) -> list[Any]:
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        return _flat(typing.get_args(hint)[0])
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return [t for arg in typing.get_args(hint) for t in _flat(arg)]
    return [hint]


def _dataclass_in(hint: Any) -> type | None:
    return next((t for t in _flat(hint) if isinstance(t, type) and dataclasses.is_dataclass(t)), None)


def _type_text(hint: Any) -> str:
    text = getattr(hint, "__name__", None) if isinstance(hint, type) else None
    return text or str(hint).replace("typing.", "")


def _jsonable(value: Any) -> Any:  # noqa: PLR0911
    """The value as JSON writes it (an enum by its value, a dataclass by its fields, a path as text)."""
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, PurePath):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
