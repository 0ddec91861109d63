"""Which weights the server compiles: a local model directory by its content, a hub model by id and snapshot.

A local directory by what the server reads of it (the key oracle, tools/oracle, watched the real
server open its files): the configs it loads by content (``config.json`` without the two fields
transformers rewrites, ``params.json``, the quantization configs, the weight index, an optimum
``rbln_config.json``), and the weights by a content identity that is cheap to read at every start
(cachemgr.key.weights). Another tokenizer or generation config is the same compile: the server's
identity reads neither (and the oracle holds the key to that).

A hub model's snapshot: vLLM hashes the ``hf_config`` it loads (``ModelConfig.compute_hash`` hashes every field, and
``normalize_value`` turns a ``PretrainedConfig`` into its JSON, vLLM 0.30 ``config/utils.py``
318-322), so two pods that load another snapshot of ``org/model`` compile different graphs. Without
``--revision`` the server loads ``main``, whatever the hub says it is today; where the pod's HF cache
already holds the repository, ``refs/<revision>`` names the commit it resolves to, and that commit is
keyed. Where it cannot be told (no cache, a revision the cache has not seen), the key says so.

The cache is found as huggingface_hub finds it: ``HF_HUB_CACHE``, else ``HUGGINGFACE_HUB_CACHE``, else
``$HF_HOME/hub`` (``HF_HOME`` defaults to ``$XDG_CACHE_HOME/huggingface``, then
``~/.cache/huggingface``); a ``--download-dir`` is looked at first, as the server downloads there.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from cachemgr.core import jsonread
from cachemgr.core.errors import ConfigError
from cachemgr.key.digest import digest_of
from cachemgr.key.serving import ServerCommand
from cachemgr.key.weights import content_ids

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".rbln")
# The configs the server reads of a model directory, by content. config.json and hf_quant_config.json
# are read to build the configuration (vLLM 0.30 transformers_utils/config.py 767-840, where params.json
# stands for config.json in the Mistral format); quantize_config.json and quant_config.json are read at
# load by some quantization methods where config.json names none (model_loader/weight_utils.py), so
# they are keyed too (stricter than the configuration's identity, which does not read them).
CONFIG_FILES = frozenset(
    {"config.json", "params.json", "hf_quant_config.json", "quantize_config.json", "quant_config.json",
     "rbln_config.json"}
)  # fmt: skip
# Fields of config.json the server does not take from the file: transformers writes its own version
# into the configuration it saves and hashes (PretrainedConfig.to_dict), and the load path into
# _name_or_path; the same weights under another path, or saved by another transformers, compile alike.
_REWRITTEN = ("_name_or_path", "transformers_version")


def resolve_model(
    server: ServerCommand,
    *,
    model: str | None = None,
    environ: Mapping[str, str] | None = None,
    revision_keyed: bool = False,
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """The model input, its source, and details (not hashed) for names and space estimates.

    ``model`` is the model string the server will use, if not the argv's (a redirect). With
    ``environ`` (the ``vllm`` strategy), a hub model is keyed with the snapshot the server will load.
    ``revision_keyed``: the server's identity hashes ``--revision`` even for a local directory (vLLM's
    ``ModelConfig.compute_hash``, on the vLLM-model path), so the key holds it there too.
    """
    if server.kind != "vllm":
        # Any other server carries its model in its argv, which is keyed whole.
        return {"kind": "argv"}, "argv", {"model_name": Path(server.argv[0]).name}
    model = model or server.model
    if not model:
        raise ConfigError(
            "the vllm argv names no model",
            remedy="pass the model as 'vllm serve MODEL' or --model MODEL",
        )
    if "{artifact_dir}" in model:
        # The server loads what --compile-cmd produced: the compile command names the model.
        return {"kind": "artifact_dir"}, "--compile-cmd output", {"model_name": "compiled"}
    download_dir = server.options.get("download_dir")
    config_path = server.options.get("hf_config_path")
    # --hf-config-path: the server reads the model's configs from there instead (vLLM's get_config is
    # given it in place of the model), so they are keyed by what they hold there, not by its path.
    configs = Path(config_path).expanduser() if isinstance(config_path, str) and config_path else None
    found, source, details = resolve_weights(
        model,
        server.revision,
        environ,
        download_dir=download_dir if isinstance(download_dir, str) else None,
        configs=configs,
    )
    if found["kind"] == "local" and revision_keyed and server.revision is not None:
        found = {**found, "revision": server.revision}
    return found, source, details


def resolve_weights(
    model: str,
    revision: str | None,
    environ: Mapping[str, str] | None,
    *,
    download_dir: str | None = None,
    what: str = "model",
    configs: Path | None = None,
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """A model string as weights: a local directory by its content, a hub id by id, revision and snapshot.

    ``configs``: where the server reads the configs from, if not from the model (``--hf-config-path``).
    """
    path = Path(model).expanduser()
    if model_exists(path):
        return _local_model(path, configs=configs)
    if model.startswith(("/", "./", "../", "~")):
        raise ConfigError(
            f"{what} path {model} does not exist in this pod",
            remedy="mount the model volume at that path, or pass a Hugging Face model id",
        )
    hub: dict[str, Any] = {"kind": "hub", "id": model, "revision": revision}
    if configs is not None:
        hub["hf_config"] = digest_of(_configs(configs, what="--hf-config-path"))
    source = "argv (--revision)" if revision else "argv (revision unpinned: the hub may change it)"
    details: dict[str, Any] = {"model_name": model}
    if environ is not None:
        # vLLM hashes the hf_config it loads: key the snapshot this pod's HF cache resolves to.
        hub["snapshot"] = hub_snapshot(model, revision, environ, download_dir=download_dir)
        if hub["snapshot"] is None:
            details["unresolved_snapshot"] = (
                f"{what} {model}: the snapshot of {revision or 'main'} is not in this pod's Hugging Face cache, "
                "so the key cannot tell which one the server will load (it is keyed without one); pin "
                "--revision to a commit, or fill the cache first"
            )
        elif hub["snapshot"] != revision:
            source = f"{source}; snapshot {hub['snapshot'][:12]} from the local Hugging Face cache"
    return hub, source, details


def model_exists(path: Path) -> bool:
    """Does the model path exist? A name no path can have (ENAMETOOLONG) is bad input, not a bug."""
    try:
        return path.exists()
    except OSError as error:
        raise ConfigError(
            f"the model {str(path)[:80]!r}... ({len(str(path))} characters) cannot be a path here: {error.strerror}",
            remedy="pass a Hugging Face model id or a model directory that exists in this pod",
        ) from None


def _local_model(path: Path, *, configs: Path | None = None) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """Fingerprint a local model by its configs and its weights' content, not its path."""
    if not path.is_dir():
        raise ConfigError(
            f"model path {path} is not a directory", remedy="point the server at a model directory"
        )
    described: dict[str, Any] = _configs(configs, what="--hf-config-path") if configs is not None else {}
    weights: dict[str, str] = {}
    try:
        for item in sorted(_model_files(path)):
            rel = item.relative_to(path).as_posix()
            if configs is not None and rel in CONFIG_FILES:
                continue  # the server reads these from --hf-config-path instead
            if item.name.endswith(".json"):
                described[rel] = _model_json(item)
            else:
                weights[rel] = str(item)
        weight_bytes = sum(os.stat(file).st_size for file in weights.values())
        identities = content_ids(weights)
    except OSError as error:
        raise ConfigError(
            f"cannot read model directory {path}: {error.strerror or error}",
            remedy="check the model volume mount",
        ) from error
    if not {"config.json", "params.json", "rbln_config.json"} & set(described):
        raise ConfigError(
            f"model directory {path} has no config.json",
            remedy="point the server at a Hugging Face model directory",
        )
    fingerprint = digest_of({"json": described, "weights": identities})
    details = {"model_name": path.name, "model_path": str(path), "weight_bytes": weight_bytes}
    return {"kind": "local", "fingerprint": fingerprint}, f"local directory {path}", details


def _configs(path: Path, *, what: str) -> dict[str, Any]:
    """A directory's configs by content (``--hf-config-path``): what the server builds its configuration from."""
    try:
        described = {
            item.name: _model_json(item)
            for item in sorted(path.iterdir())
            if item.name in CONFIG_FILES and item.is_file()
        }
    except OSError as error:
        raise ConfigError(
            f"cannot read {what} {path}: {error.strerror or error}", remedy=f"mount it, or drop {what}"
        ) from error
    if not described:
        raise ConfigError(
            f"{what} {path} holds no config.json", remedy=f"point {what} at a directory with config.json"
        )
    return described


def _model_files(path: Path) -> list[Path]:
    found: list[Path] = []
    for item in path.iterdir():
        if item.is_dir() and not item.name.startswith("."):
            # One level down: compiled dirs and sharded checkpoints keep files in subdirectories.
            found += [sub for sub in item.iterdir() if _is_model_file(sub)]
        elif _is_model_file(item):
            found.append(item)
    return found


def _is_model_file(item: Path) -> bool:
    name = item.name
    is_json = name in CONFIG_FILES or name.endswith(".index.json")
    return item.is_file() and (is_json or name.endswith(_WEIGHT_SUFFIXES))


def _model_json(item: Path) -> Any:
    try:
        # A hub snapshot's files are links to its blobs: followed here (the server follows them too).
        data = jsonread.read(item, follow=True)
    except ValueError:  # not JSON, too deep, too large, not a regular file: keyed by its bytes
        return {"unparsable_bytes": item.stat().st_size, "xxh3": _file_xxh3(item)}
    if isinstance(data, dict) and item.name == "config.json":
        for field in _REWRITTEN:
            data.pop(field, None)
    return data


def _file_xxh3(item: Path) -> str:
    digest = xxhash.xxh3_128()
    with item.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# --- the Hugging Face snapshot of a hub model --------------------------------------------------

_COMMIT = re.compile(r"[0-9a-f]{40}")
_REF_LIMIT = 4096  # a ref holds a 40-hex commit: more is not a ref


def cache_dirs(environ: Mapping[str, str], download_dir: str | None = None) -> list[Path]:
    """Where the server looks for hub snapshots, in order."""
    home = environ.get("HF_HOME") or os.path.join(
        environ.get("XDG_CACHE_HOME")
        or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache"),
        "huggingface",
    )
    hub = environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    found = [Path(download_dir).expanduser()] if download_dir else []
    return [*found, Path(hub).expanduser()]


def hub_snapshot(
    model_id: str, revision: str | None, environ: Mapping[str, str], *, download_dir: str | None = None
) -> str | None:
    """The commit the server will load for ``model_id`` at ``revision`` (default ``main``), or None."""
    wanted = revision or "main"
    if _COMMIT.fullmatch(wanted):
        return wanted  # a commit names itself, whether or not it is downloaded yet
    folder = "models--" + model_id.replace("/", "--")
    for cache in cache_dirs(environ, download_dir):
        ref = cache / folder / "refs" / wanted
        try:
            # Bounded, never blocking: a FIFO planted as the ref would hang the pod past its SIGTERM.
            # It, a file too large to be a ref, or one that is not ASCII, is a ref this cache does not hold.
            commit = jsonread.read_bytes(ref, limit=_REF_LIMIT, follow=True).decode("ascii").strip()
        except (OSError, ValueError):  # ValueError: not a regular file, too large, not ASCII
            continue
        if _COMMIT.fullmatch(commit) and (cache / folder / "snapshots" / commit).is_dir():
            return commit
    return None
