"""``--config FILE.yaml``: the serving config file read as vLLM's load_config_file reads it, into
argv tokens, with the bounds a file from the pod spec needs (a regular file, capped in size, no
alias bombs)."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from cachemgr.core.errors import ConfigError
from cachemgr.key.vllm_values import MAX_DEPTH, refuse

_CONFIG_MAX_BYTES = 1 << 20  # a serving config is a few KB
_CONFIG_MAX_NODES = 100_000


def config_file_args(path: str, own_options: frozenset[str]) -> list[str]:
    """load_config_file: YAML keys to tokens (a false is kept only as an exact --no-KEY option)."""
    if path.rsplit(".", maxsplit=1)[-1] not in ("yaml", "yml"):
        refuse(f"--config {path} is not a .yaml/.yml file")
    import yaml  # only argvs with --config pay for it

    text = _read_config_file(path)
    try:
        config = yaml.safe_load(text)  # vllm/utils/argparse_utils.py:583 (load_config_file)
    except (yaml.YAMLError, RecursionError) as error:
        what = f"vllm --config {path} is not valid YAML ({error})"
        raise ConfigError(what, remedy="fix the YAML") from error
    if _expanded_size(config) > _CONFIG_MAX_NODES:
        # Aliases share one object when loaded, but every use is a copy in the argv (and in the
        # key): nine aliases of nine aliases of ... ("billion laughs") would never finish.
        raise ConfigError(
            f"vllm --config {path} expands to more than {_CONFIG_MAX_NODES} values (YAML aliases "
            f"or nesting over {MAX_DEPTH} levels)",
            remedy="write the config without nested aliases",
        )
    if not isinstance(config, dict):  # vLLM: AttributeError on config.items()
        refuse(f"--config {path} is not a mapping of flag names to values")
    return [token for key, value in config.items() for token in _config_entry(path, key, value, own_options)]


def _read_config_file(path: str) -> str:
    """The config's text: a regular file only (a FIFO would block here forever), capped in size."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise ConfigError(
            f"cannot read vllm --config {path}: {error.strerror}", remedy="mount the config file in the pod"
        ) from error
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _CONFIG_MAX_BYTES:
            what = "is not a regular file" if not stat.S_ISREG(st.st_mode) else f"is {st.st_size} bytes"
            raise ConfigError(
                f"vllm --config {path} {what}",
                remedy=f"give --config a YAML file of at most {_CONFIG_MAX_BYTES >> 10} KiB",
            )
        data = os.read(fd, _CONFIG_MAX_BYTES + 1)
    except OSError as error:
        raise ConfigError(
            f"cannot read vllm --config {path}: {error.strerror}", remedy="mount the config file in the pod"
        ) from error
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"vllm --config {path} is not UTF-8 text ({error})", remedy="fix the YAML"
        ) from None


def _expanded_size(value: Any) -> int:
    """Values in ``value`` with every alias copied out, counted up to just past the limit."""
    count, stack = 0, [(value, 1)]
    while stack and count <= _CONFIG_MAX_NODES:
        item, level = stack.pop()
        count += 1
        if level > MAX_DEPTH:
            return _CONFIG_MAX_NODES + 1
        if isinstance(item, dict):
            stack.extend((child, level + 1) for pair in item.items() for child in pair)
        elif isinstance(item, list):
            stack.extend((child, level + 1) for child in item)
    return count


def _config_entry(path: str, key: Any, value: Any, own_options: frozenset[str]) -> list[str]:
    if not isinstance(key, str):  # vLLM: TypeError on "--" + key
        refuse(f"--config {path} has a key that is not text: {key!r}")
    if isinstance(value, bool):
        if value:
            return [f"--{key}"]
        return [f"--no-{key}"] if f"--no-{key}" in own_options else []
    if isinstance(value, list):
        return [f"--{key}", *(str(item) for item in value)] if value else []
    if isinstance(value, dict):
        try:
            return [f"--{key}", json.dumps(value)]
        except (TypeError, ValueError) as error:
            refuse(f"--config {path}: {key} is not JSON-serialisable ({error})")
    return [f"--{key}", str(value)]
