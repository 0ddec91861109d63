"""The server's argv, read the way the server reads it, reduced to what changes the compile.

A ``vllm serve`` argv is read in two steps, as vLLM 0.30.0 reads it (see :mod:`cachemgr.key.vllm_flags`,
whose docstring lists every rule): first the rewrites ``FlexibleArgumentParser.parse_args`` does
before argparse runs (``--model`` relocation, ``--config FILE.yaml``, underscores, ``-O``, dotted
``--x.y`` args), copied statement by statement; then argparse itself, on a parser built from the
generated option table with the same option strings, arities, value types and vllm-rbln actions. Using
the standard library's own argparse (not a re-implementation) is what makes abbreviations, short
options (``-n2``), negative numbers and ``+`` arity come out exactly as vLLM's, which runs on the same
interpreter in the modelserver image. tests/test_serving.py checks all of it against the real parser.

Not mirrored, on purpose: values outside an option's choices and config JSON that its dataclass would
reject are keyed, not refused (vLLM refuses them a moment later, so no compile is ever reused for
them); --help is dropped like a runtime flag; without a model the model is None, not vLLM's default.

What goes into the key: every flag given, as the value vLLM stores (``-tp 02`` is 2, ``0.90`` is
0.9, ``--max-model-len 4k`` is 4000), except runtime-only flags (:data:`RUNTIME_ONLY`, reported in
``dropped``). ``--rbln-*`` flags are folded into ``additional_config`` as vllm-rbln folds them; RBLN
options that do not change the compiled graphs and address/port keys of the transfer configs are left
out. Model and revision are keyed separately. Flags this table does not know are kept (fail closed: a
needless miss costs a compile, a wrong hit costs an outage). Any other server is keyed on its whole
argv minus the same runtime-only flags.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NoReturn

from cachemgr.core.errors import ConfigError
from cachemgr.key import vllm_flags

ServerKind = Literal["vllm", "other"]

# Flags that change how the server is reached, named, logged or supervised at run time, never
# what is compiled for the NPU. Each is left out of the key; every other flag counts. Checked
# against vLLM 0.30.0's serve parser (cachemgr.key.vllm_flags): nearly all are "Frontend" options,
# which live only in the API-server process and never reach the engine's config. When in doubt
# a flag is NOT here (seed, tokenizer, data-parallel ranks, reasoning parser... stay in the key).
RUNTIME_ONLY: frozenset[str] = frozenset(
    {
        # process and launcher: which front end runs and how it starts and stops
        "help", "headless", "api-server-count", "grpc", "shutdown-timeout", "fail-on-environ-validation",
        # where and how the API server listens: differs per pod
        "host", "port", "uds", "root-path", "h11-max-incomplete-event-size", "h11-max-header-count",
        "ssl-keyfile", "ssl-certfile", "ssl-ca-certs", "ssl-cert-reqs", "ssl-ciphers", "enable-ssl-refresh",
        # who may call it: CORS and credentials (secrets must never enter a key)
        "allow-credentials", "allowed-origins", "allowed-methods", "allowed-headers", "api-key", "hf-token",
        # the HTTP app around the engine
        "middleware", "enable-request-id-headers", "disable-fastapi-docs", "enable-offline-docs",
        "tokens-only", "enable-scale-out", "enable-tokenizer-info-endpoint",
        "data-parallel-supervisor-port", "dp-supervisor-probe-interval-s", "dp-supervisor-probe-timeout-s",
        "dp-supervisor-probe-failure-threshold",
        # logging, metrics and tracing
        "disable-log-stats", "aggregate-engine-logging", "enable-log-requests", "uvicorn-log-level",
        "disable-uvicorn-access-log", "disable-access-log-for-endpoints", "log-config-file", "max-log-len",
        "enable-log-outputs", "enable-log-deltas", "log-error-stack", "enable-per-request-metrics",
        "enable-server-load-tracking", "show-hidden-metrics-for-version", "otlp-traces-endpoint",
        "collect-detailed-traces", "per-request-spec-decode-metrics", "kv-cache-metrics",
        "kv-cache-metrics-sample", "cudagraph-metrics", "enable-mfu-metrics",
        "enable-logging-iteration-details", "use-tqdm-on-load", "ray-workers-use-nsight",
        # names, chat templates, tools and response formatting: the same compiled model serves them all
        "served-model-name", "chat-template", "chat-template-content-format", "trust-request-chat-template",
        "default-chat-template-kwargs", "tool-call-parser", "tool-parser-plugin", "tool-server",
        "enable-auto-tool-choice", "exclude-tools-when-tool-choice-none", "response-role",
        "return-tokens-as-token-ids", "enable-prompt-tokens-details", "enable-force-include-usage",
        "sse-keep-alive-interval", "cohere-format", "cohere-is-reasoning-model", "fingerprint-mode",
        "fingerprint-value", "enable-flash-late-interaction",
        # request input policy and API-server admission limits
        "allowed-local-media-path", "allowed-media-domains",
        "max-num-queued-reqs", "max-num-queued-tokens", "stream-interval",
        # where weights are downloaded to (their content is keyed by model and revision)
        "download-dir",
        # rendezvous addresses and host CPU pinning of this launch (ParallelConfig.compute_hash
        # ignores them). Not the distributed timeouts nor renderer-num-workers: vLLM's config hash
        # covers those, and vllm-rbln names its mega-cache bundle by that hash, so a pod differing
        # only in them would find no bundle under our entry and compile again inside the server.
        "master-addr", "master-port", "data-parallel-address", "data-parallel-rpc-port",
        "numa-bind", "numa-bind-nodes", "numa-bind-cpus",
        # --config=FILE is never loaded by vLLM (only the exact token --config is); --config FILE is
        # expanded in place, so its path does not matter either
        "config",
    }
)  # fmt: skip


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# How vLLM 0.30.0 converts each option's value (the `type=` of its argparse action, with vLLM's
# optional_type/parse_type wrappers looked through). Every option not named here keeps its text.
# tests/test_serving.py checks these sets against the real parser's, recorded in the golden data.
_INT = _names("""
    api-server-count block-size cp-kv-cache-interleave-size cpu-distributed-timeout-seconds
    cudagraph-capture-sizes data-parallel-rank data-parallel-rpc-port data-parallel-size
    data-parallel-size-local data-parallel-start-rank data-parallel-supervisor-port
    dbo-decode-token-threshold dbo-prefill-token-threshold dcp-kv-cache-interleave-size
    decode-context-parallel-size distributed-timeout-seconds dp-supervisor-probe-failure-threshold
    dp-sync-interval elastic-ep-max-dp-size h11-max-header-count h11-max-incomplete-event-size
    long-prefill-token-threshold mamba-block-size mamba-cache-philox-rounds master-port max-cpu-loras
    max-cudagraph-capture-size max-log-len max-logprobs max-lora-rank max-loras max-num-queued-reqs
    max-num-seqs max-parallel-loading-workers mm-shm-cache-max-object-size-mb nnodes node-rank
    num-gpu-blocks-override numa-bind-nodes offload-group-size offload-num-in-group
    offload-prefetch-step pipeline-parallel-size port prefill-context-parallel-size
    prefill-schedule-interval prefix-cache-retention-interval prefix-match-unit
    rbln-decode-batch-bucket-limit rbln-decode-batch-bucket-manual-buckets rbln-decode-batch-bucket-min
    rbln-decode-batch-bucket-step rbln-num-devices-per-local-rank rbln-sub-block-size
    renderer-num-workers replayssm-buffer-len safetensors-prefetch-num-threads seed shutdown-timeout
    spec-tokens sse-keep-alive-interval ssl-cert-reqs stream-interval tensor-parallel-size ubatch-size
""")
_FLOAT = _names("""
    cpu-offload-gb dp-supervisor-probe-interval-s dp-supervisor-probe-timeout-s gpu-memory-utilization
    kv-cache-metrics-sample kv-offloading-size mm-encoder-fp8-scale-save-margin mm-ipc-gpu-memory-gb
    mm-processor-cache-gb video-pruning-rate watermark
""")
# human_readable_int: "4k" is 4000, "4K" is 4096
_HUMAN_INT = _names("""
    kv-cache-memory-bytes max-num-batched-tokens max-num-queued-tokens max-num-scheduled-tokens
    safetensors-prefetch-block-size
""")
_HUMAN_INT_OR_AUTO = _names("max-model-len")  # human_readable_int_or_auto: "auto" and "-1" are -1
# config dataclasses: the JSON may carry bare 4k/2G numbers (_expand_json_human_readable_numbers)
_DATACLASS_JSON = _names("""
    attention-config compilation-config ec-manager-config ec-transfer-config engram-config eplb-config
    fault-tolerance-config ir-op-priority kernel-config kv-events-config kv-transfer-config
    pooler-config profiler-config quantization-config reasoning-config structured-outputs-config
    weight-transfer-config
""")
_LOWER_UNDERSCORED = _names("linear-backend moe-backend sparse-indexer-topk-backend")
_DEVICE_IDS = _names("device-ids")
# optional_type: "" and "None" are read as None
_OPTIONAL = _names("""
    allowed-media-domains api-key attention-backend chat-template code-revision collect-detailed-traces
    cpu-distributed-timeout-seconds dcp-comm-backend default-mm-loras diffusion-config
    disable-access-log-for-endpoints distributed-executor-backend distributed-timeout-seconds
    download-dir ec-transfer-config engram-config fingerprint-value hf-config-path host
    io-processor-plugin kv-cache-memory-bytes kv-events-config kv-offloading-size kv-transfer-config
    log-config-file logits-processors lora-modules lora-target-modules mamba-block-size
    mamba-ssu-algorithm max-cpu-loras max-log-len max-num-queued-reqs max-num-queued-tokens
    max-num-scheduled-tokens max-parallel-loading-workers mm-encoder-attn-backend mm-encoder-attn-dtype
    mm-encoder-fp8-scale-path mm-encoder-fp8-scale-save-path mm-processor-kwargs num-gpu-blocks-override
    numa-bind-cpus numa-bind-nodes otlp-traces-endpoint pooler-config prefix-cache-retention-interval
    prefix-match-unit quantization quantization-config rbln-sub-block-size reasoning-config revision
    root-path safetensors-load-strategy scheduler-cls served-model-name show-hidden-metrics-for-version
    spec-method spec-model speculative-config ssl-ca-certs ssl-certfile ssl-ciphers ssl-keyfile
    tokenizer-revision tool-call-parser tool-server uds video-pruning-rate watermark-config
    weight-transfer-config
""")
VALUE_KINDS: Mapping[str, frozenset[str]] = {
    "int": _INT, "float": _FLOAT, "human-readable-int": _HUMAN_INT,
    "human-readable-int-or-auto": _HUMAN_INT_OR_AUTO, "dataclass-json": _DATACLASS_JSON,
    "lower-underscored-str": _LOWER_UNDERSCORED, "comma-separated-ids": _DEVICE_IDS, "optional": _OPTIONAL,
}  # fmt: skip

# Keys of the transfer configs that wire this pod to its peers: addresses, ports, engine ids, the
# instance's rank among them. vLLM's KVTransferConfig.compute_hash counts none of its fields, and none
# of these reaches a compiled graph. Every other key (kv_connector, kv_role, buffer sizes...) stays.
_TRANSFER_WIRING: Mapping[str, frozenset[str]] = {
    "kv-transfer-config": frozenset({"kv_ip", "kv_port", "kv_rank", "engine_id"}),
    "ec-transfer-config": frozenset({"ec_ip", "ec_port", "ec_rank", "engine_id"}),
    "kv-events-config": frozenset({"endpoint", "replay_endpoint"}),  # ZMQ publisher sockets
}
# Inside a connector's free-form extra config (MultiConnector children included): the connectors'
# own side channels (handshake_port, notify_port, proxy_ip, llm_host, http_port...).
_CONNECTOR_EXTRA = frozenset({"kv_connector_extra_config", "ec_connector_extra_config"})
_WIRING_KEY = re.compile(r"(^|_)(ip|host|hostname|port|addr|address|url|endpoint)s?$|^(engine_id|kv_rank)$")

# RBLN options that do not change the compiled graphs: RBLNConfig.compute_hash ignores them (sampler
# graphs compile with use_cache=False; sub-block caching changes what runs, not what is built), and the
# optimum path's compiled-model key (_generate_model_path_name) does not read sub_block_size either.
_RBLN_NOT_COMPILED: frozenset[str] = frozenset(
    {"use_custom_sampler", "enable_sub_block_cache", "sub_block_size", "prefix_block_size"}
)
# optimum-rbln overrides that only steer runtime loading (vllm-rbln's _RUNTIME_ONLY_KEYS).
_OPTIMUM_RUNTIME_ONLY: frozenset[str] = frozenset({"device", "create_runtimes", "kvcache_num_blocks"})
# Former additional_config keys vllm-rbln 0.12 still accepts (OptimumRBLNConfig's _RENAMED_KEYS).
_RBLN_RENAMED: Mapping[str, str] = {"rbln_config": "optimum_overrides", "prefix_block_size": "sub_block_size"}

# FlexibleArgumentParser's patterns, verbatim (note: "$" also matches before a final newline).
_MODEL_OPTION = re.compile(r"^--model(=.+|$)")
_SERVED_NAME_OPTION = re.compile(r"^--served[-_]model[-_]name(=.+|$)")
_CONFIG_OPTION = re.compile(r"^--config(=.+|$)")
_TOP_LEVEL_OPTIONS = frozenset({"-h", "--help", "-v", "--version"})  # the `vllm` parser's own
_BARE_HUMAN_INT = re.compile(r"\b\d+(?:\.\d+)?[kKmMgGtT]\b")
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # argparse's _negative_number_matcher
_OWNED = "_rbln_additional_config_owned"  # vllm-rbln's marker attribute
# LoRAModulePath's fields and defaults
_LORA: dict[str, Any] = {"name": None, "path": None, "base_model_name": None, "is_3d_lora_weight": False}
# `python -m` modules that run entry.main(): one parser, no subcommand
_API_SERVER_MODULES = {"vllm.entrypoints.openai.api_server", "vllm.entrypoints.launchers.api_server.entry"}


@dataclass(frozen=True)
class ServerCommand:
    """A server argv and what of it goes into the cache key."""

    argv: tuple[str, ...]
    kind: ServerKind
    model: str | None = None
    revision: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    port: int | None = None
    host: str | None = None

    @property
    def pipeline_parallel_size(self) -> int:
        """PP degree: each rank's compiled output grows with it (space estimates scale by it)."""
        value = self.settings.get("pipeline_parallel_size", 1)
        return value if isinstance(value, int) and value > 0 else 1


def parse_server_argv(argv: Sequence[str]) -> ServerCommand:
    """Read a server argv: ``vllm serve ...`` as vLLM does, anything else token by token."""
    if not argv:
        raise ConfigError(
            "no server command was given",
            remedy="append the server's argv after '--', e.g. cachemgr run -- vllm serve MODEL",
        )
    found = _vllm_args(argv)
    if found is None:
        return _parse_other(tuple(argv))
    args, subcommand = found
    return _parse_vllm(tuple(argv), args, subcommand=subcommand)


def _vllm_args(argv: Sequence[str]) -> tuple[list[str], bool] | None:
    """What vLLM's parse_args receives, and whether via the ``vllm`` CLI (``serve`` first), or None."""
    exe = Path(argv[0]).name
    if exe == "vllm" and len(argv) > 1 and argv[1] == "serve":
        return list(argv[1:]), True
    if re.fullmatch(r"python[\d.]*", exe) and len(argv) > 2 and argv[1] == "-m":
        if argv[2] in _API_SERVER_MODULES:
            return list(argv[3:]), False  # entry.main(): one parser, no subcommand
        if argv[2] == "vllm.entrypoints.cli.main" and len(argv) > 3 and argv[3] == "serve":
            return list(argv[3:]), True
    return None


def _refuse(what: str) -> NoReturn:
    raise ConfigError(
        f"vLLM {vllm_flags.VLLM_VERSION} would refuse this argv: {what}",
        remedy="fix the server's flags (see vllm serve --help)",
    )


# --- step 1: FlexibleArgumentParser.parse_args, before argparse ---------------------------------


def _flexible_rewrite(args: list[str], own_options: frozenset[str]) -> list[str]:
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
                _refuse("--model has no value")  # vLLM: IndexError
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
        _refuse("the model must be the first positional argument when --served-model-name is given")
    return args


def _splice_config(args: list[str], own_options: frozenset[str]) -> list[str]:
    """_pull_args_from_config: the file's flags go first, so the command line overrides them."""
    if args.count("--config") > 1:
        _refuse("more than one --config file")  # vLLM: AssertionError
    index = args.index("--config")
    if index == len(args) - 1:
        _refuse("--config has no file")
    config_args = _config_file_args(args[index + 1], own_options)
    head, rest = args[:index], args[index + 2 :]
    if args[0].startswith("-"):
        return [*config_args, *head, *rest]
    if args[0] == "serve" and not (len(args) > 1 and not args[1].startswith("-")):
        if "--model" not in config_args:
            _refuse("no model: give it as the positional argument or as 'model:' in the config file")
        return [args[0], *config_args, *args[1:index], *rest]
    if args[0] == "serve":
        return [*args[:2], *config_args, *args[2:index], *rest]
    return [args[0], *config_args, *args[1:index], *rest]


def _config_file_args(path: str, own_options: frozenset[str]) -> list[str]:
    """load_config_file: YAML keys to tokens (a false is kept only as an exact --no-KEY option)."""
    if path.rsplit(".", maxsplit=1)[-1] not in ("yaml", "yml"):
        _refuse(f"--config {path} is not a .yaml/.yml file")
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
            f"or nesting over {_MAX_DEPTH} levels)",
            remedy="write the config without nested aliases",
        )
    if not isinstance(config, dict):  # vLLM: AttributeError on config.items()
        _refuse(f"--config {path} is not a mapping of flag names to values")
    return [token for key, value in config.items() for token in _config_entry(path, key, value, own_options)]


_CONFIG_MAX_BYTES = 1 << 20  # a serving config is a few KB
_CONFIG_MAX_NODES = 100_000


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
        if level > _MAX_DEPTH:
            return _CONFIG_MAX_NODES + 1
        if isinstance(item, dict):
            stack.extend((child, level + 1) for pair in item.items() for child in pair)
        elif isinstance(item, list):
            stack.extend((child, level + 1) for child in item)
    return count


def _config_entry(path: str, key: Any, value: Any, own_options: frozenset[str]) -> list[str]:
    if not isinstance(key, str):  # vLLM: TypeError on "--" + key
        _refuse(f"--config {path} has a key that is not text: {key!r}")
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
            _refuse(f"--config {path}: {key} is not JSON-serialisable ({error})")
    return [f"--{key}", str(value)]


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
                _refuse(f"{arg} has no value")  # vLLM: IndexError
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


_MAX_DEPTH = 64  # vLLM's JSON configs nest a few levels; the key's canonical form recurses per level


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
        depth = _MAX_DEPTH + 1
    else:
        depth = _depth(value)
    if depth > _MAX_DEPTH:
        raise _TooDeepError(
            f"a JSON value in the server argv is nested more than {_MAX_DEPTH} levels deep",
            remedy="pass the server's JSON options as vLLM documents them",
        )
    return value


def _depth(value: Any) -> int:
    """How deeply ``value`` nests (iterative: the point is not to recurse without bound)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if level <= _MAX_DEPTH and isinstance(item, dict | list):
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


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


def _value_type(name: str) -> Callable[[str], Any] | None:
    """The `type=` vLLM gives option ``name``; ValueError/ArgumentTypeError make argparse refuse."""
    kinds: list[tuple[frozenset[str], Callable[[str], Any]]] = [
        (_INT, int), (_FLOAT, float), (_HUMAN_INT, human_readable_int),
        (_HUMAN_INT_OR_AUTO, _human_readable_int_or_auto), (vllm_flags.JSON_OR_STR_FLAGS, _json_or_str),
        (_DATACLASS_JSON, _dataclass_json), (vllm_flags.JSON_FLAGS, loads),
        (_LOWER_UNDERSCORED, lambda s: s.lower().replace("-", "_")), (_DEVICE_IDS, _device_ids),
    ]  # fmt: skip
    convert = next((fn for names, fn in kinds if name in names), None)
    if name not in _OPTIONAL:
        return convert
    inner = convert or str

    def optional(value: str) -> Any:
        return None if value in ("", "None") else inner(value)

    optional.__name__ = getattr(inner, "__name__", "value")
    return optional


def _writable_additional_config(namespace: argparse.Namespace) -> dict[str, Any]:
    """vllm_rbln.config._additional_config: copy once, then write into it."""
    if not getattr(namespace, _OWNED, False):
        current = getattr(namespace, "additional_config", None)
        namespace.additional_config = dict(current) if isinstance(current, dict) else {}
        setattr(namespace, _OWNED, True)
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
            setattr(namespace, _OWNED, False)
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
        _refuse(message)


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
        kwargs["type"] = _value_type(name)
        if arity != "1":
            kwargs["nargs"] = arity
        if arity == "?":
            kwargs["const"] = True  # --hf-token alone
    parser.add_argument(*strings, **kwargs)


@functools.cache
def _serve_parser() -> _Parser:
    """The `vllm serve` parser (make_arg_parser + vllm-rbln's add_rbln_cli_args), from the table."""
    parser = _Parser(prog="vllm serve", add_help=False, allow_abbrev=True)
    parser.add_argument("model_tag", nargs="?", default=None)
    for name, arity in vllm_flags.FLAGS.items():
        _add_option(parser, name, arity)
    return parser


# --- the key -----------------------------------------------------------------------------------


def _parse_vllm(argv: tuple[str, ...], args: list[str], *, subcommand: bool) -> ServerCommand:
    parser = _serve_parser()
    own = _TOP_LEVEL_OPTIONS if subcommand else frozenset(parser._option_string_actions)
    tokens = _flexible_rewrite(args, own)
    if subcommand:
        tokens = tokens[1:]  # "serve": the sub-parser gets the rest, '--' included
    namespace, extras = parser.parse_known_args(tokens)
    values = {name: value for name, value in vars(namespace).items() if name != _OWNED}
    unknown = [t.lstrip("-").partition("=")[0] for t in extras if _looks_like_option(t)]
    if extras and not unknown:
        _refuse(f"unrecognized arguments: {' '.join(extras)}")
    model_tag = values.pop("model_tag", None)
    model = values.pop("model", None)
    if subcommand and model_tag is not None:
        model = model_tag  # ServeSubcommand.cmd: the positional wins; the api_server ignores it
    revision = values.pop("revision", None)
    settings: dict[str, Any] = {}
    dropped: list[str] = []
    for dest, value in values.items():
        name = dest.replace("_", "-")
        if name in RUNTIME_ONLY:
            dropped.append(name)
        elif (setting := canonical_setting(name, value)) != {} or dest != "additional_config":
            settings[dest] = setting  # an additional_config of only runtime RBLN options: as if none
    if unknown:
        # Fail closed: vLLM 0.30.0 refuses these, and which token a newer vLLM would read as whose value
        # cannot be known, so the whole argv as argparse gets it goes into the key, in order.
        settings["unrecognized_argv"] = _masked(tokens, values)
    port = values.get("port", 8000)
    return ServerCommand(
        argv=argv,
        kind="vllm",
        model=None if model is None else str(model),
        revision=None if revision is None else str(revision),
        settings=dict(sorted(settings.items())),
        dropped=tuple(sorted(dropped)),
        unknown=tuple(unknown),
        port=port if isinstance(port, int) else None,
        host=values.get("host"),
    )


def canonical_setting(name: str, value: Any) -> Any:
    """What of option ``name``'s parsed value goes into the key.

    JSON objects have their keys sorted; non-finite floats, which JSON cannot hold, become
    {"$float": "nan"} and the like; the policy above is applied to additional_config and the
    transfer configs.
    """
    if name == "additional-config" and isinstance(value, dict):
        value = compiled_additional_config(value)
    elif name in _TRANSFER_WIRING and isinstance(value, dict):
        value = strip_transfer_wiring(name, value)
    return _canonical(value)


def compiled_additional_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """additional_config without the RBLN options that do not change the compiled graphs."""
    resolved = dict(config)
    for old, new in _RBLN_RENAMED.items():
        if old in resolved:  # vllm-rbln's _resolve: the former name's value wins
            resolved = {k: v for k, v in resolved.items() if k != old} | {new: resolved[old]}
    overrides = resolved.get("optimum_overrides")
    if isinstance(overrides, dict):
        resolved["optimum_overrides"] = _strip_keys(overrides, lambda key: key in _OPTIMUM_RUNTIME_ONLY)
    return {key: value for key, value in resolved.items() if key not in _RBLN_NOT_COMPILED}


def strip_transfer_wiring(name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """A kv/ec transfer or kv-events config without its addresses, ports, engine ids and ranks."""
    wiring = _TRANSFER_WIRING[name]
    return {
        key: _strip_keys(value, lambda k: bool(_WIRING_KEY.search(k))) if key in _CONNECTOR_EXTRA else value
        for key, value in config.items()
        if key not in wiring
    }


def _strip_keys(obj: Any, drop: Callable[[str], bool]) -> Any:
    if isinstance(obj, dict):
        return {k: _strip_keys(v, drop) for k, v in obj.items() if not drop(str(k))}
    if isinstance(obj, list):
        return [_strip_keys(item, drop) for item in obj]
    return obj


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [_canonical(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return {"$float": str(value)}
    return value


def _masked(tokens: list[str], values: Mapping[str, Any]) -> list[str]:
    """``tokens`` with the values of --api-key and --hf-token masked: secrets never enter a key."""
    given = [values.get("hf_token"), *(values.get("api_key") or [])]
    secrets = {s for s in given if isinstance(s, str) and s}
    return [
        "<secret>" if token in secrets else f"{token.partition('=')[0]}=<secret>"
        if token.partition("=")[2] in secrets else token
        for token in tokens
    ]  # fmt: skip


def _looks_like_option(arg: str) -> bool:
    """An unknown option to argparse: not a positional, not "--", not a negative number ("-1", "-.5")."""
    return arg.startswith("-") and arg not in ("-", "--") and not _NEGATIVE_NUMBER.match(arg)


def _parse_other(argv: tuple[str, ...]) -> ServerCommand:
    """Any other server: the whole argv in order, minus runtime-only flags and their values."""
    kept: list[str] = []
    dropped: list[str] = []
    port: int | None = None
    i = 0
    while i < len(argv):
        token = argv[i]
        name, _, inline = token.lstrip("-").partition("=")
        name = name.replace("_", "-")
        if token.startswith("--") and name in RUNTIME_ONLY:
            dropped.append(name)
            has_value = not inline and i + 1 < len(argv) and not argv[i + 1].startswith("-")
            value = inline or (argv[i + 1] if has_value else None)
            if name == "port":
                port = _int_or_none(value)
            i += 2 if has_value else 1
            continue
        kept.append(token)
        i += 1
    kept[0] = Path(kept[0]).name
    return ServerCommand(
        argv=argv, kind="other", settings={"argv": kept}, dropped=tuple(sorted(set(dropped))), port=port
    )


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
